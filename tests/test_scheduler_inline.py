"""Inline decode: which thread a job runs on (no model, no sockets).

A null context marked *blocking* stands in for llama.cpp, so the scheduler treats it as a real
runtime; the executor records the thread each decode ran on.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

from skippy.runtime.null import NullContext, NullModel, NullSpec
from skippy.stage.executor import Executor, WorkItem
from skippy.stage.scheduler import Scheduler
from skippy.stage.stats import StageStats


class _BlockingNull(NullContext):
    blocking = True  # type: ignore[assignment]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.threads: list[int] = []

    def decode(self, **kwargs: object) -> None:  # type: ignore[override]
        self.threads.append(threading.get_ident())
        super().decode(**kwargs)  # type: ignore[arg-type]


def _scheduler(inline: bool, lanes: int, return_lanes: int = 0) -> tuple[Scheduler, _BlockingNull]:
    context = _BlockingNull(NullModel(NullSpec(n_embd=8, n_layer=2), "0:2"))
    stats = StageStats()
    stats.connections_open = lanes + return_lanes
    stats.return_lanes_open = return_lanes
    return Scheduler(Executor(context), stats, inline_decode=inline), context


def _decode(position: int) -> WorkItem:
    return WorkItem(session=1, positions=np.array([position], dtype=np.int32),
                    tokens=np.array([5], dtype=np.int32))


def _prefill() -> WorkItem:
    return WorkItem(session=1, positions=np.arange(4, dtype=np.int32), tokens=np.arange(1, 5, dtype=np.int32),
                    prefill=True)


@pytest.mark.parametrize(("inline", "lanes", "return_lanes", "on_trio_thread"), [
    (True, 1, 0, True), (False, 1, 0, False), (True, 2, 0, False),
    (True, 1, 2, True),  # a final stage's return lanes (docs/protocol.md §8) bring no work
    (True, 2, 1, False),
])
async def test_a_lone_decode_runs_on_the_trio_thread_only_when_inline_and_one_lane(
        inline: bool, lanes: int, return_lanes: int, on_trio_thread: bool) -> None:
    scheduler, context = _scheduler(inline, lanes, return_lanes)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.execute(_prefill())
        result, _ = await scheduler.execute(_decode(4))
        nursery.cancel_scope.cancel()
    here = threading.get_ident()
    prefill_thread, decode_thread = context.threads
    assert prefill_thread != here  # a prefill chunk always goes to the runtime thread
    assert (decode_thread == here) is on_trio_thread
    assert result.tokens == [6]
