"""Inline decode: which thread a job runs on (no model, no sockets).

A null context marked *blocking* stands in for llama.cpp, so the scheduler treats it as a real
runtime; the executor records the thread each decode ran on.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

from skippy.lane.registry import LaneRegistry
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


def _scheduler(inline: bool, lanes: int, return_lanes: int = 0,
               compute_threads: int = 1) -> tuple[Scheduler, _BlockingNull]:
    context = _BlockingNull(NullModel(NullSpec(n_embd=8, n_layer=2), "0:2"))
    context.compute_threads = compute_threads  # type: ignore[misc]
    registry = LaneRegistry()
    for lane in range(lanes):  # a return lane never registers: it brings no work
        registry.opened(lane + 1)
    stats = StageStats()
    stats.connections_open = lanes + return_lanes  # what the policy must not read
    stats.return_lanes_open = 0
    return Scheduler(Executor(context), stats, inline_decode=inline, lanes=registry), context


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


async def test_a_stage_of_several_compute_threads_computes_on_the_runtime_thread_only() -> None:
    """With more than one compute thread every native call runs on the one runtime thread (a lone
    decode too, and a decode relay's loop through ``run_native``): libgomp keeps a pool of helper
    threads per calling thread, and a second pool throttles every wait of the process."""
    scheduler, context = _scheduler(True, 1, compute_threads=2)
    assert not scheduler.inline_decode
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.execute(_prefill())
        await scheduler.execute(_decode(4))
        relay_thread = await scheduler.run_native(threading.get_ident)
        nursery.cancel_scope.cancel()
    prefill_thread, decode_thread = context.threads
    assert decode_thread == prefill_thread == relay_thread != threading.get_ident()


def _lane_decode(lane: int, position: int) -> WorkItem:
    return WorkItem(session=(lane << 64) | 1, positions=np.array([position], dtype=np.int32),
                    tokens=np.array([5], dtype=np.int32))


async def test_a_relay_holds_the_runtime_until_work_is_queued_behind_it() -> None:
    """Scheduler.hold (skippy.stage.decode_relay): only for the lane that brought the last work,
    refused while another lane brought work lately; a job queued behind it stops it and runs
    once it is released."""
    scheduler, context = _scheduler(True, 2)
    stops: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.execute(_lane_decode(1, 0))
        assert scheduler.hold(lambda: stops.append("1"), 1) and scheduler.held
        assert not scheduler.hold(lambda: stops.append("again"), 1)  # held already
        done = trio.Event()

        async def other_lane() -> None:
            await scheduler.execute(_lane_decode(2, 0))
            done.set()

        nursery.start_soon(other_lane)
        await trio.sleep(0.05)
        assert stops == ["1"] and not done.is_set()  # queued behind the hold, which was asked to stop
        scheduler.release_hold()
        with trio.fail_after(2):
            await done.wait()
        # lane 2 brought work just now: lane 1 may not hold (their rows batch), lane 2 may not either
        # while lane 1's work is as recent
        assert not scheduler.hold(lambda: None, 1) and not scheduler.hold(lambda: None, 2)
        nursery.cancel_scope.cancel()
    assert len(context.threads) == 2


async def test_lanes_that_brought_no_work_lately_do_not_keep_a_relay_off() -> None:
    from skippy.stage import scheduler as scheduler_module

    scheduler, _ = _scheduler(True, 3)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.execute(_lane_decode(2, 0))
        await scheduler.execute(_lane_decode(1, 0))
        assert not scheduler.hold(lambda: None, 1)
        scheduler_module_recent = scheduler_module.RECENT_WORK_S
        try:
            scheduler_module.RECENT_WORK_S = 0.01
            await trio.sleep(0.02)
            await scheduler.execute(_lane_decode(1, 1))
            assert scheduler.hold(lambda: None, 1)  # lane 2 (and a lane that never sent) are idle
        finally:
            scheduler_module.RECENT_WORK_S = scheduler_module_recent
        scheduler.release_hold()
        nursery.cancel_scope.cancel()
