"""A head shard's rows go through the serving stage's scheduler (issue 31; skippy.stage.head_split).

The placement (``Scheduler.head_rows``) is checked with a fake blocking runtime that records each
native batch's interval and thread: the shard's rows never run while a batch runs; they run first
in the next turn on the runtime thread, ending a gathering turn's wait; on an idle runtime with at
most one working lane and beside a decode relay (without stopping it) on the trio thread.  The stage's shard service (``serve_head_shard``, a trio task) is checked over TCP
against the head computed directly: bitwise the same columns, computed on the runtime thread,
and a request of the wrong width refused; and over mutual TLS, where a serving stage without the
chain's certificate is refused.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import trio

from skippy.lane.work import WorkItem, WorkResult
from skippy.models import ensure_model, tiny
from skippy.net.address import Address
from skippy.runtime import LayerRange, Model
from skippy.runtime.head_shard import HEADER, MAGIC, HeadCompute, HeadShardError, HeadShardPort, RemoteHeadShard
from skippy.runtime.null import NullContext, NullModel, NullSpec
from skippy.stage.executor import Executor
from skippy.stage.head_split import serve_head_shard
from skippy.stage.scheduler import Scheduler
from skippy.stage.stats import StageStats


def _row(session: int) -> WorkItem:
    return WorkItem(session=session, positions=np.array([7], dtype=np.int32), tokens=np.array([5], dtype=np.int32))


class _Runtime:
    """An executor stand-in: a native batch sleeps ``seconds`` per row; every batch and shard
    computation is recorded with its interval (time.monotonic) and thread."""

    blocking = True

    def __init__(self, seconds: float, compute_threads: int = 1) -> None:
        self.seconds = seconds
        self.compute_threads = compute_threads  # > 1: every computation on the runtime thread
        self.log: list[tuple[Any, float, float, str]] = []  # (what, start, end, thread name)

    def _ran(self, what: Any, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        self.log.append((what, start, time.monotonic(), threading.current_thread().name))

    def run_decode_batch(self, items: Sequence[WorkItem]) -> list[WorkResult]:
        self._ran(sorted(item.session for item in items), self.seconds * len(items))
        return [WorkResult(None, [1], len(items)) for _ in items]

    def run_item(self, item: WorkItem) -> WorkResult:
        self._ran([item.session], self.seconds)
        return WorkResult(None, [1])

    def shard(self) -> str:
        self._ran("shard", self.seconds)
        return "rows"

    def order(self) -> list[Any]:
        return [what for what, *_ in self.log]


def _no_overlap(log: list[tuple[Any, float, float, str]]) -> None:
    spans = sorted((start, end) for _, start, end, _ in log)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, "two computations at once"


async def test_shard_rows_wait_for_the_running_batch_then_go_first_on_the_runtime_thread() -> None:
    runtime = _Runtime(0.02)
    scheduler = Scheduler(runtime, StageStats(), decode_groups=2)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        nursery.start_soon(scheduler.execute, _row(1))  # runs at once (the idle fast path)
        await trio.sleep(0.005)
        nursery.start_soon(scheduler.execute, _row(2))  # queued behind it
        await trio.sleep(0.002)
        assert await scheduler.head_rows(runtime.shard) == "rows"  # queued after row 2
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert runtime.order() == [[1], "shard", [2]]  # the shard's rows first in the next turn
    assert {thread for *_, thread in runtime.log} == {"skippy-runtime"}  # the stage's one compute thread
    _no_overlap(runtime.log)
    assert scheduler.stats.runtime_busy_us > 0


async def test_shard_rows_run_at_once_in_a_gathering_turn_which_keeps_its_group() -> None:
    runtime = _Runtime(0.05)
    scheduler = Scheduler(runtime, StageStats(), decode_groups=1)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)

        async def late(session: int) -> None:
            await trio.sleep(0.04)
            await scheduler.execute(_row(session))

        for _ in range(4):  # sessions 2 and 3 come back 40 ms after 1: a turn waits for them
            async with trio.open_nursery() as rows:
                rows.start_soon(scheduler.execute, _row(1))
                rows.start_soon(late, 2)
                rows.start_soon(late, 3)
        assert runtime.order()[-1] == [1, 2, 3]
        runtime.log.clear()
        async with trio.open_nursery() as rows:
            rows.start_soon(scheduler.execute, _row(1))  # its turn gathers for rows 2 and 3 ...
            rows.start_soon(late, 2)
            rows.start_soon(late, 3)
            await trio.sleep(0.002)
            asked = time.monotonic()
            await scheduler.head_rows(runtime.shard)  # ... and runs the shard's rows meanwhile
        nursery.cancel_scope.cancel()
    assert runtime.order() == ["shard", [1, 2, 3]]  # the group stays one batch
    assert runtime.log[0][1] - asked < 0.025  # the shard did not wait for the gather (40 ms)
    assert runtime.log[0][3] == "skippy-runtime"
    _no_overlap(runtime.log)


async def test_shard_rows_run_beside_a_decode_relay_without_stopping_it_on_the_trio_thread() -> None:
    runtime = _Runtime(0.01)
    scheduler = Scheduler(runtime, StageStats(), decode_groups=2)  # type: ignore[arg-type]
    stops: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await scheduler.execute(_row(1))
        assert scheduler.hold(lambda: stops.append(1), 0)
        with trio.fail_after(2):
            assert await scheduler.head_rows(runtime.shard) == "rows"
        assert scheduler.held and not stops  # the relay carries on
        done = trio.Event()

        async def other() -> None:
            await scheduler.execute(_row(2))
            done.set()

        nursery.start_soon(other)  # other work still ends the relay's run
        await trio.sleep(0.02)
        assert stops == [1]
        scheduler.release_hold()
        with trio.fail_after(2):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert runtime.order() == [[1], "shard", [2]]
    assert runtime.log[1][3] == threading.current_thread().name  # the relay holds the runtime thread


@pytest.mark.parametrize(("lanes", "inline", "threads", "thread"), [
    (1, True, 1, "here"), (0, True, 1, "here"), (2, True, 1, "skippy-runtime"),
    (1, False, 1, "skippy-runtime"), (1, True, 2, "skippy-runtime")])
async def test_shard_rows_on_an_idle_runtime_run_inline_with_one_working_lane(
        lanes: int, inline: bool, threads: int, thread: str) -> None:
    """As inline decode: with at most one working lane nothing else can need the trio thread
    meanwhile, and the hand-off to the runtime thread is saved (``--inline-decode off``: never;
    a stage of several compute threads: never either, one OpenMP pool per stage)."""
    from skippy.lane.registry import LaneRegistry

    registry = LaneRegistry()
    for lane in range(lanes):
        registry.opened(lane + 1)
    runtime = _Runtime(0.005, compute_threads=threads)
    scheduler = Scheduler(runtime, StageStats(), decode_groups=2, lanes=registry,  # type: ignore[arg-type]
                          inline_decode=inline)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        assert await scheduler.head_rows(runtime.shard) == "rows"
        nursery.cancel_scope.cancel()
    assert runtime.log[0][3] == (threading.current_thread().name if thread == "here" else thread)


# -- the stage's shard service over TCP --------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_path() -> Path:
    return ensure_model(tiny("llama", dtype="F32"))


class _RecordingCompute:
    """A HeadCompute that records the threads it computes on."""

    def __init__(self, compute: HeadCompute) -> None:
        self._compute = compute
        self.rows = compute.rows
        self.n_embd = compute.n_embd
        self.n_batch = compute.n_batch
        self.model = compute.model
        self.threads: list[str] = []

    def compute(self, hidden: np.ndarray) -> np.ndarray:
        self.threads.append(threading.current_thread().name)
        return self._compute.compute(hidden)


async def test_the_stage_serves_its_shard_through_its_scheduler(llama_path: Path) -> None:
    n_layer = 4
    head = Model(llama_path, LayerRange(n_layer, n_layer), head_rows=(0, 96))
    direct = HeadCompute(head, n_batch=8, threads=1)
    served = HeadCompute(head, n_batch=8, threads=1)
    recording = _RecordingCompute(served)
    context = NullContext(NullModel(NullSpec(n_embd=8, n_layer=2), "0:1"))
    context.blocking = True  # type: ignore[misc]
    from skippy.lane.registry import LaneRegistry

    lanes = LaneRegistry()
    lanes.opened(1)
    lanes.opened(2)  # two working lanes: the rows go to the runtime thread
    scheduler = Scheduler(Executor(context), StageStats(), lanes=lanes)
    port = HeadShardPort()
    hidden = np.random.default_rng(3).standard_normal((3, head.n_embd)).astype(np.float32)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            nursery.start_soon(serve_head_shard, scheduler, recording, Address(*port.address))
            client = RemoteHeadShard.through(port, rows=(0, 96), identity=head.identity, n_embd=head.n_embd,
                                             timeout=10.0)

            def ask(rows: np.ndarray) -> np.ndarray:
                out = np.empty((rows.shape[0], 96), dtype=np.float32)
                client.start(rows)
                client.finish(out)
                return out

            for count in (3, 1, 2):
                got = await trio.to_thread.run_sync(ask, hidden[:count])
                assert np.array_equal(got, direct.compute(hidden[:count]).copy())
            client.close()  # the service dials again: a request of the wrong width is refused

            def wrong_width() -> tuple[int, bytes]:
                conn = port.take(10.0)
                with conn:
                    conn.settimeout(10.0)
                    conn.sendall(HEADER.pack(MAGIC, 1, head.n_embd + 1, 0, 0))
                    _, status, length, _, _ = HEADER.unpack(conn.recv(HEADER.size, socket.MSG_WAITALL))
                    return status, conn.recv(length, socket.MSG_WAITALL)

            status, message = await trio.to_thread.run_sync(wrong_width)
            assert status == 1 and b"rows of" in message
            nursery.cancel_scope.cancel()
    finally:
        port.close()
        direct.close()
        served.close()
        head.close()
    assert recording.threads == ["skippy-runtime"] * 3
    assert HEADER.size == 20 and MAGIC == b"SKH1"


async def test_the_stage_serves_its_shard_over_tls_and_is_refused_without_the_chains_certificate(
        llama_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same columns over mutual TLS (each end its chain certificate); a serving stage holding
    another CA's certificate is refused at the final stage's port, which names the refusal, and
    says so once in its log though it dials again."""
    from skippy.deploy.certs import make_chain_certificates
    from skippy.net.tls import TlsFiles, client_context, server_context

    make_chain_certificates(tmp_path, ["stage-0", "stage-1"])
    make_chain_certificates(tmp_path / "other", ["stage-0"], chain_name="another chain")
    impostor = client_context(TlsFiles(tmp_path / "other" / "stage-0.pem", tmp_path / "other" / "stage-0.key",
                                       tmp_path / "ca.pem"))
    head = Model(llama_path, LayerRange(4, 4), head_rows=(0, 96))
    direct = HeadCompute(head, n_batch=8, threads=1)
    served = HeadCompute(head, n_batch=8, threads=1)
    context = NullContext(NullModel(NullSpec(n_embd=8, n_layer=2), "0:1"))
    context.blocking = True  # type: ignore[misc]
    scheduler = Scheduler(Executor(context), StageStats())
    port = HeadShardPort(tls=server_context(TlsFiles.in_directory(tmp_path, "stage-1")), handshake_timeout=2.0)
    refusing = HeadShardPort(tls=server_context(TlsFiles.in_directory(tmp_path, "stage-1")), handshake_timeout=2.0)
    hidden = np.random.default_rng(5).standard_normal((3, head.n_embd)).astype(np.float32)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            nursery.start_soon(functools.partial(serve_head_shard, scheduler, served, Address(*port.address),
                                                 tls=client_context(TlsFiles.in_directory(tmp_path, "stage-0"))))
            client = RemoteHeadShard.through(port, rows=(0, 96), identity=head.identity, n_embd=head.n_embd,
                                             timeout=10.0)

            def ask(rows: np.ndarray) -> np.ndarray:
                out = np.empty((rows.shape[0], 96), dtype=np.float32)
                client.start(rows)
                client.finish(out)
                return out

            for count in (3, 1):
                got = await trio.to_thread.run_sync(ask, hidden[:count])
                assert np.array_equal(got, direct.compute(hidden[:count]).copy())
            client.close()
            nursery.start_soon(functools.partial(serve_head_shard, scheduler, served, Address(*refusing.address),
                                                 tls=impostor, retry_s=0.05))
            with pytest.raises(HeadShardError, match="refused at the TLS handshake.*CERTIFICATE_VERIFY_FAILED"):
                await trio.to_thread.run_sync(refusing.take, 2.0)
            assert refusing.refused >= 2  # dialled again (backing off), refused again
            nursery.cancel_scope.cancel()
    finally:
        port.close()
        refusing.close()
        direct.close()
        served.close()
        head.close()
    said = [r.getMessage() for r in caplog.records if "failed before a request" in r.getMessage()]
    assert len(said) == 1 and "TLS" in said[0], said
