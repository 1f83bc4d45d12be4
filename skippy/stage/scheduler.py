"""One scheduler per stage: the only path to the runtime, with cross-session decode batching.

Strategy: every connection submits work as a *job* to one queue and awaits its result; a single
scheduler task owns the :class:`~skippy.stage.executor.Executor`.  When the runtime is free the
scheduler takes **every** job that is ready (optionally after a small collection window, off by
default) and runs, in one trip to the worker thread:

* all single-row decode jobs of distinct sessions as one native batch (continuous batching: rows
  that arrived while the previous batch ran are merged, nothing waits for company by default);
* then the other jobs (prefill chunks, verify windows, session control) one by one, in arrival
  order.

Native calls run on the stage's :class:`~skippy.stage.worker.RuntimeThread` (cffi releases the
GIL; one dedicated thread is cheaper per call than ``trio.to_thread``); the null runtime, which
never blocks, runs inline.  *Inline decode* (``inline_decode``, on by default): a lone decode row
while the stage has exactly one working lane (its :class:`~skippy.lane.registry.LaneRegistry`:
return lanes, which only carry predictions written into them, do not count) runs on the trio
thread itself.  Nothing else can need
that thread during the compute (the lane's next message waits on this row's reply, and there is
no other lane), and the hand-off it saves is on every token's critical path: the queue put that
wakes the runtime thread, the GIL passing back and forth, the completion's wake-up fd and run-loop
pass -- 0.2-0.3 ms of CPU per stage per token on the 2-core bench host
(``bench/RESULTS-stage.md``, "Per-boundary cost with real compute").  Prefill chunks, verify
windows, control calls and every job once a second lane is open still go to the runtime thread.  A job's requester that is cancelled simply
stops waiting: the job still runs, so the runtime and the session table stay consistent.  Each
connection has at most one job queued at a time, so per-session order is the submission order.

*Decode batching* (``decode_batching``, on by default) can be turned off: llama.cpp's CPU kernels
take different paths for one row and for several (a batched row's logits differ from the same row
alone in the last bits: ~2e-6 on the tiny llama), so with batching a session's greedy tokens can
flip at a near-tie depending on what other sessions were decoding at that moment.  Off, every row
is its own native batch: a session's results depend only on its own messages.

Idle fast path: when the runtime is free and nothing is queued (and no batching window is set),
the submitting task runs its job itself, as the scheduler would have, instead of waking the
scheduler task and being woken back (two trio hand-offs per message).  The runtime is claimed
first; for a native decode row the task then yields once, so rows other lanes submit in the same
trio tick join its batch (what one scheduler pass gave), and rows submitted while it runs queue
and are batched by the scheduler as soon as it is released: batching across sessions is kept.  A requester cancelled during
its own run still lets the job finish (the runtime thread's calls are never abandoned).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Generic, Sequence, TypeVar

import trio

from skippy.lane.errors import ShuttingDown
from skippy.lane.registry import LaneRegistry
from skippy.stage.executor import Executor, WorkItem, WorkResult
from skippy.stage.stats import StageStats
from skippy.stage.worker import RuntimeThread

T = TypeVar("T")

#: A lane that brought work within this many seconds keeps a decode relay from holding the
#: runtime for another lane (:meth:`Scheduler.hold`): their rows batch instead.
RECENT_WORK_S = 0.5

#: Trio ticks the idle fast path waits, at most, for rows arriving with its own (it stops at the
#: first tick that brings none, so a lone session pays one yield).
_GATHER_TICKS = 3


@dataclasses.dataclass(slots=True, eq=False)
class _Job(Generic[T]):
    item: WorkItem | None
    call: Callable[[], T] | None
    submitted_ns: int
    #: The write made where the result is computed (the runtime thread), with (result, queue_us):
    #: a write-through placement (:mod:`skippy.stage.write_through`).  It must not raise.
    then: Callable[[WorkResult, int], None] | None = None
    done: trio.Event | None = None  #: made when the job is queued (the fast path never waits)
    result: Any = None
    error: BaseException | None = None
    wait_us: int = 0


class Scheduler:
    """Serialises and batches runtime work for all connections of a stage.

    Args:
        executor: the runtime and its session table.
        stats: counters to update.
        batch_window: seconds to wait for more decode rows once one is ready (0 = none).
        lanes: the stage's working lanes (the lanes register themselves; None: a new registry).
    """

    def __init__(self, executor: Executor, stats: StageStats, *, batch_window: float = 0.0,
                 inline_decode: bool = True, decode_batching: bool = True,
                 lanes: LaneRegistry | None = None) -> None:
        self.executor = executor
        self.stats = stats
        #: The lanes that may bring work (the placement policy's input; never the statistics).
        self.lanes = lanes if lanes is not None else LaneRegistry()
        self.batch_window = batch_window
        #: False (``--decode-batching off``): every decode row runs as its own native batch.
        self.decode_batching = decode_batching
        self.inline_decode = inline_decode
        self._send, self._receive = trio.open_memory_channel[_Job[Any]](math.inf)
        #: The runtime is running a batch (the scheduler's or a caller's fast-path job).
        self._busy = False
        #: Jobs submitted to the queue and not yet started.
        self._queued = 0
        self._released: trio.Event | None = None
        #: The decode relay holding the runtime: called when a job is queued behind it.
        self._holder_stop: Callable[[], None] | None = None
        #: When each lane (a session key's upper bits) last submitted a work item.
        self._last_work: dict[int, float] = {}
        self._thread = RuntimeThread()

    def hold(self, stop: Callable[[], None], lane: int) -> bool:
        """Claim the idle runtime for a decode relay (:mod:`skippy.stage.decode_relay`) of lane
        ``lane``; ``stop`` is called (on the trio thread) when a job is queued behind it.  False
        when the runtime is busy, jobs wait, or another lane brought work in the last
        :data:`RECENT_WORK_S` (idle lanes, such as an API pool keeps open, do not count)."""
        if self._busy or self._queued:
            return False
        now = time.monotonic()
        for other, when in list(self._last_work.items()):
            if now - when > RECENT_WORK_S:
                del self._last_work[other]
            elif other != lane:
                return False
        self._busy = True
        self._holder_stop = stop
        return True

    @property
    def held(self) -> bool:
        """A decode relay holds the runtime now."""
        return self._holder_stop is not None

    def release_hold(self) -> None:
        """The relay gave the runtime back: queued jobs run."""
        self._holder_stop = None
        self._busy = False
        if self._released is not None:
            self._released.set()
            self._released = None

    async def execute(self, item: WorkItem, then: Callable[[WorkResult, int], None] | None = None
                      ) -> tuple[WorkResult, int]:
        """Run one executable item; returns its result and the microseconds it queued.

        ``then`` is called with them where the result is computed (the runtime thread: a
        write-through), before this returns; it must not raise.

        Raises:
            StageError: the item was refused or the runtime failed it (the subclass names why);
            any other exception is a bug, passed through with its traceback.
        """
        job: _Job[WorkResult] = _Job(item, None, time.perf_counter_ns(), then)
        result = await self._submit(job)
        return result, job.wait_us

    async def call(self, function: Callable[[], T]) -> T:
        """Run ``function(…)`` on the runtime thread, in order with the compute jobs."""
        job: _Job[T] = _Job(None, function, time.perf_counter_ns())
        result: T = await self._submit(job)
        return result

    async def _submit(self, job: _Job[T]) -> T:
        if job.item is not None:
            self._last_work[job.item.session >> 64] = time.monotonic()
        if not self._busy and not self._queued and (self.batch_window <= 0 or job.item is None):
            await self._run_here(job)
        else:
            try:
                self._send.send_nowait(job)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:  # the stage is shutting down
                raise ShuttingDown("the stage's scheduler has stopped") from exc
            self._queued += 1
            if self._holder_stop is not None:  # a decode relay holds the runtime: end its run
                self._holder_stop()
            job.done = trio.Event()
            await job.done.wait()
        if job.error is not None:
            raise job.error
        result: T = job.result
        return result

    async def _run_here(self, job: _Job[Any]) -> None:
        """The idle fast path: run ``job`` on this task (with any decode rows of the same tick)."""
        jobs = [job]
        # With one lane open nobody else can bring a row this tick (a lane has at most one job
        # queued): skip the yield, a trip through trio's run loop per message.
        if (self.decode_batching and self.executor.blocking and job.item is not None and job.item.batchable
                and self.lanes.working != 1):
            # Let the other lanes' tasks of this trio tick queue their rows behind the claimed
            # runtime, and take them into this batch: the batching a scheduler pass used to give.
            self._busy = True
            try:
                for _ in range(_GATHER_TICKS):
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    before = len(jobs)
                    while True:
                        try:
                            jobs.append(self._receive.receive_nowait())
                        except trio.WouldBlock:  # nothing more is ready
                            break
                    if len(jobs) == before:  # a quiet tick: the rows of this moment are in
                        break
            finally:
                self._busy = False
            self._queued -= len(jobs) - 1
        try:
            await self._run_batch(jobs)
        finally:
            for other in jobs[1:]:
                assert other.done is not None
                other.done.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler loop; runs until cancelled."""
        task_status.started()
        try:
            await self._serve()
        finally:
            self._thread.close()

    async def _serve(self) -> None:
        async with self._receive:
            async for first in self._receive:
                if self.batch_window > 0 and first.item is not None and first.item.batchable:
                    await trio.sleep(self.batch_window)
                while self._busy:  # a caller's fast-path job holds the runtime
                    self._released = trio.Event()
                    await self._released.wait()
                jobs = [first]
                while True:
                    try:
                        jobs.append(self._receive.receive_nowait())
                    except trio.WouldBlock:
                        break
                self._queued -= len(jobs)
                await self._run_batch(jobs)
                for job in jobs:
                    assert job.done is not None
                    job.done.set()

    async def _run_batch(self, jobs: list[_Job[Any]]) -> None:
        """Claim the runtime, run ``jobs`` (on the worker thread unless it never blocks), account."""
        self._busy = True
        try:
            started = time.perf_counter_ns()
            for job in jobs:
                job.wait_us = (started - job.submitted_ns) // 1000
            if self.executor.blocking and not self._runs_inline(jobs):
                decode_batches, native = await self._thread.run_sync(lambda: self._run_jobs(jobs))
            else:
                decode_batches, native = self._run_jobs(jobs)
        finally:
            self._busy = False
            if self._released is not None:
                self._released.set()
                self._released = None
        self.stats.native_batches += native
        for size in decode_batches:
            self.stats.observe_decode_batch(size)
        for job in jobs:
            self._account(job)

    def _runs_inline(self, jobs: list[_Job[Any]]) -> bool:
        """Inline decode (module header): one decode row, and this stage's only lane asked for it."""
        if not self.inline_decode or len(jobs) != 1 or self.lanes.working != 1:
            return False
        item = jobs[0].item
        return item is not None and item.batchable

    def _account(self, job: _Job[Any]) -> None:
        result = job.result
        if isinstance(result, WorkResult):
            self.stats.queue_histogram.observe(max(0, job.wait_us))
            self.stats.compute_us += result.compute_us
            self.stats.compute_histogram.observe(max(0, result.compute_us))
            if result.trimmed_tokens:
                self.stats.auto_aligns += 1
                self.stats.trimmed_tokens += result.trimmed_tokens
        self.stats.touch()

    def _run_jobs(self, jobs: list[_Job[Any]]) -> tuple[list[int], int]:
        """Worker-thread side: one decode batch, then the rest in order.

        Returns the sizes of the decode batches run and the number of native batches (the
        stats are updated by the caller, on the trio thread).
        """
        decode_batches: list[int] = []
        if len(jobs) == 1:  # the common case: no batch to form
            return decode_batches, self._run_one(jobs[0], decode_batches)
        if not self.decode_batching:  # every row alone, in arrival order
            return decode_batches, sum(self._run_one(job, decode_batches) for job in jobs)
        native = 0
        batch: list[_Job[Any]] = []
        rest: list[_Job[Any]] = []
        sessions: set[int] = set()
        for job in jobs:
            item = job.item
            if item is not None and item.batchable and item.session not in sessions:
                sessions.add(item.session)
                batch.append(job)
            else:
                rest.append(job)
        if len(batch) == 1:
            rest.insert(0, batch.pop())
        if batch:
            items = [job.item for job in batch if job.item is not None]
            outcomes: Sequence[WorkResult | Exception]
            try:
                outcomes = self.executor.run_decode_batch(items)
            except Exception as exc:  # a bug fails these jobs (their lanes log it), not the stage
                outcomes = [exc] * len(items)
            native += 1
            decode_batches.append(len(items))
            for job, outcome in zip(batch, outcomes):
                if isinstance(outcome, Exception):
                    job.error = outcome
                else:
                    job.result = outcome
                    if job.then is not None:
                        job.then(outcome, job.wait_us)
        for job in rest:
            native += self._run_one(job, decode_batches)
        return decode_batches, native

    def _run_one(self, job: _Job[Any], decode_batches: list[int]) -> int:
        """Run one job alone (its error kept on it); returns the native batches it ran."""
        try:
            item = job.item
            if item is not None:
                job.result = self.executor.run_item(item)
                if job.then is not None:
                    job.then(job.result, job.wait_us)
                if item.batchable:
                    decode_batches.append(1)
                return 1
            if job.call is not None:
                job.result = job.call()
        except Exception as exc:  # a refusal or a bug fails this one job (its lane reports it), not the stage
            job.error = exc
        return 0
