"""The lane's side of the decode relay: when a session's decode may leave Python, and how it comes back.

Strategy: with direct return (docs/protocol.md §8) no stage answers a flagged DecodeEmbd
upstream, so once a session decodes steadily every token is the same three steps on every
stage: read, compute, write (downstream; on the final stage, the prediction into the session's
return lane).  After the lane has handled such a message in full (its one path: the protocol,
the executor, the write-through or the direct reply), :func:`relay_plan` decides whether the
next ones may go through :mod:`skippy.stage._relay` (its ``nogil`` loop; the twin ``skippy.stage._relay_py``
with ``SKIPPY_NO_EXTENSIONS=1``): the lane must have nothing queued, in flight or buffered, no
other lane may have brought work lately (``Scheduler.hold``: their rows batch instead), both
streams must be plain sockets with no simulated wire, the message one row of f32/f16 with no
sampling or metadata section, the runtime a native context, and on the final stage the
session's sampler one the loop can run as the executor would (no grammar, no logprobs).  Then
:meth:`RelayRun.run` holds the scheduler's runtime (and, on the final stage, the return lane's
lock), runs the loop on a worker thread and waits.

Whatever the loop does not carry comes back unread (:mod:`skippy.stage._relay`'s header): the lane
feeds those bytes to its reader and goes on as if the loop had never run, so every refusal,
rollback and error keeps its one path.  The run ends early when anything else needs the
runtime (the scheduler writes the stop descriptor), when the lane is cancelled or its return
lane closes (the abort descriptor, which also cuts a write waiting on a full socket; the wait
for the thread is never abandoned, so no socket is closed under it), and every ``max_steps``
tokens so the stage's statistics stay current.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import trio

from skippy.codec.protocol import MessageKind, StageMessage, WireDType
from skippy.codec.protocol_ext import DIRECT_RETURN_FLAG
from skippy.lane.errors import ReturnLaneLost
from skippy.stage.executor import ACTIVATION_LIMIT
from skippy.stage.transport import codec, write_failed

if TYPE_CHECKING:
    from skippy.lane.timings import DirectTimings
    from skippy.stage.direct_return import ReturnLane
    from skippy.runtime.sampling import Sampler
    from skippy.stage.executor import Executor
    from skippy.stage.scheduler import Scheduler
    from skippy.stage.stats import StageStats
    from skippy.stage.transport import MessageReader
    from skippy.net.socket_io import SocketIO

if os.environ.get("SKIPPY_NO_EXTENSIONS") == "1":
    from skippy.stage import _relay_py as _implementation
else:
    try:
        from skippy.stage import _relay as _implementation  # type: ignore[no-redef]
    except ImportError:  # not built: the twin carries the same bytes
        from skippy.stage import _relay_py as _implementation  # type: ignore[no-redef]

#: Which implementation carries the relay: "cython" or "python".
IMPLEMENTATION: str = _implementation.IMPLEMENTATION

__all__ = ["IMPLEMENTATION", "RelayPlan", "RelayRun", "carry", "relay_plan"]

log = logging.getLogger("skippy.stage")

_OUTCOMES = {_implementation.HANDED_BACK: "handed back", _implementation.STOPPED: "stopped",
             _implementation.STEP_LIMIT: "step limit", _implementation.DOWNSTREAM_FAILED: "downstream write failed",
             _implementation.ABORTED: "aborted"}

#: Tokens one run relays before handing its counts to the stage's statistics.
MAX_STEPS = 1024
#: The activation encodings the loop carries (q8 frames take the lane's path).
_CARRIED_DTYPES = frozenset((WireDType.F32, WireDType.F16))


@dataclasses.dataclass(frozen=True, slots=True)
class RelayPlan:
    """What a run needs from the message the lane just handled."""

    in_template: bytes
    out_template: bytes
    seq: int
    next_position: int
    #: A final stage's: the session's sampler (the loop picks its tokens); None elsewhere.
    sampler: "Sampler | None" = None


def relay_plan(message: StageMessage, forwarded: bytes, *, executor: "Executor", session_key: int,
               width: int, out_dtype: WireDType, position_end: int) -> RelayPlan | None:
    """The plan for relaying the decode that follows ``message`` (just executed and forwarded as
    ``forwarded``; on the final stage, answered with the reply ``forwarded`` is the template of),
    or None when the loop would not carry it exactly as the lane did."""
    state = message.state
    final = executor.is_last
    if (message.kind is not MessageKind.DECODE_EMBD or not state.flags & DIRECT_RETURN_FLAG
            or message.token_count != 1 or message.sampling is not None
            or message.chat_sampling_metadata is not None or state.activation_row_multiplier != 1
            or message.positions.shape[0] != 0 or (not final and out_dtype not in _CARRIED_DTYPES)
            or (final and executor.is_first) or getattr(executor, "reads_tokens", False)
            or getattr(executor, "sideband_flag", 0) or getattr(executor, "output_flag", 0)):
        return None  # (a stage that reads the token ids or a sideband beside the activation: the lane path)
    try:
        in_dtype = WireDType(state.reserved)
    except ValueError:
        return None
    if not executor.is_first and in_dtype not in _CARRIED_DTYPES:
        return None
    if getattr(executor.context, "recurrent", False):
        return None  # a recurrent stage logs every row for its rollbacks (the stage's log says so)
    row_batch = getattr(executor.context, "row_batch", None)
    seq = executor.session_seq(session_key)
    sampler = executor.relay_sampler(session_key) if final else None
    if row_batch is None or seq is None or (final and sampler is None):
        return None  # the null runtime, a session already released, or tokens the loop cannot pick
    next_position = executor.context.length(seq)
    if next_position != message.pos_start + 1:
        return None
    in_template = codec.encode_message(message, in_dtype, width)
    try:
        _implementation.template_layout(in_template, forwarded, width=width, first=executor.is_first, final=final)
    except ValueError:
        return None
    if 0 < position_end <= next_position:
        return None
    return RelayPlan(in_template, forwarded, seq, next_position, sampler)


class RelayRun:
    """One hand-over of a lane's upstream reading to the loop (see the module header).

    Args:
        plan: from :func:`relay_plan`.
        upstream / downstream: the lane's socket I/O (both ``is_socket``; a final stage's
            downstream is the session's return lane, whose lock the caller holds).
        reader: the lane's message reader (empty: the caller checked).
        downstream_name: for the error of a failed write.
    """

    def __init__(self, plan: RelayPlan, *, executor: "Executor", scheduler: "Scheduler", stats: "StageStats",
                 upstream: "SocketIO", downstream: "SocketIO", reader: "MessageReader", downstream_name: str,
                 width: int, position_end: int) -> None:
        self._executor, self._scheduler, self._stats = executor, scheduler, stats
        self._upstream, self._downstream, self._reader = upstream, downstream, reader
        self._downstream_name = downstream_name
        self.final = plan.sampler is not None
        self._stop = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._abort = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._rows = executor.context.row_batch(plan.seq, plan.sampler)  # type: ignore[attr-defined]
            self._relay: Any = _implementation.DecodeRelay(
                upstream_fd=upstream.fileno(), downstream_fd=downstream.fileno(), stop_fd=self._stop,
                abort_fd=self._abort, in_template=plan.in_template, out_template=plan.out_template, width=width,
                first=executor.is_first, n_vocab=executor.n_vocab, next_position=plan.next_position,
                position_end=position_end, activation_limit=ACTIVATION_LIMIT, runtime=self._rows, final=self.final,
                max_steps=MAX_STEPS)
        except BaseException:
            self.close()
            raise
        #: Tokens relayed, and their compute and downstream-write time (microseconds): the lane
        #: adds them to the session's direct-return timings (docs/protocol.md §8).
        self.steps = self.compute_us = self.write_us = 0
        #: The outcome of a run whose wait was cancelled, to account before the lane closes.
        self._unaccounted: Any = None

    def close(self) -> None:
        """Release the descriptors (after the run, or for a run that never ran); idempotent."""
        for name in ("_stop", "_abort"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def stop(self) -> None:
        """Ask the loop to end between frames (the trio thread; idempotent)."""
        if self._stop >= 0:
            os.eventfd_write(self._stop, 1)

    def abort(self) -> None:
        """End the loop at once, even in the middle of a write (the lane or its return lane is
        closing; the trio thread; idempotent)."""
        if self._abort >= 0:
            os.eventfd_write(self._abort, 1)

    def idle_since(self) -> float:
        """When the loop last began receiving a frame, on trio's clock (the idle timeout)."""
        return trio.current_time() - (time.monotonic_ns() - self._relay.last_frame_ns) / 1e9

    async def run(self) -> None:
        """Relay until the loop hands back; the reader then holds what it did not carry.

        Raises:
            DownstreamLost / ReturnLaneLost: writing downstream (or into the return lane) failed
                or was cut off by the return lane closing.
        """
        pending = b""
        try:
            while True:
                outcome = await self._run_once(pending)
                self._unaccounted = None
                self._account(outcome)
                log.debug("decode relay (%s%s): %d tokens, then %s with %d bytes unread", IMPLEMENTATION,
                          ", final stage" if self.final else "", outcome.steps, _OUTCOMES[outcome.status],
                          len(outcome.leftover))
                pending = outcome.leftover
                if outcome.status != _implementation.STEP_LIMIT:
                    break
        finally:
            if self._unaccounted is not None:  # cancelled: the thread's run still happened
                self._account(self._unaccounted)
                self._unaccounted = None
            self.close()
        if pending:  # (an empty chunk would tell the decoder the stream ended)
            self._reader.decoder.receive_data(pending)  # type: ignore[attr-defined]
        self._upstream.mark_drained()
        if outcome.status in (_implementation.DOWNSTREAM_FAILED, _implementation.ABORTED):
            cause = trio.BrokenResourceError("the decode relay's write failed or was cut off")
            if self.final:
                raise ReturnLaneLost(f"the return lane to {self._downstream_name} failed a write or closed "
                                     "during one") from cause
            raise write_failed(self._downstream_name, downstream=True) from cause

    async def _run_once(self, pending: bytes) -> Any:
        def relay() -> Any:  # the worker thread: the outcome is kept even if the wait is cancelled
            self._unaccounted = self._relay.run(pending)
            return self._unaccounted

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_cancelled)
            # never abandoned: a cancel ends the loop (above) and waits for the thread to return
            outcome = await trio.to_thread.run_sync(relay)
            nursery.cancel_scope.cancel()
        return outcome

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.stop()
            self.abort()

    def _account(self, outcome: Any) -> None:
        steps = outcome.steps
        self.steps += steps
        stats = self._stats
        stats.decode_relay_runs += 1
        self._upstream.bytes_in += outcome.bytes_in
        self._downstream.bytes_out += outcome.bytes_out
        if not steps:
            return
        self._rows.finished(steps)
        self.compute_us += outcome.compute_us
        self.write_us += outcome.write_us
        stats.decode_relay_steps += steps
        stats.messages += steps
        stats.decode_items += steps
        stats.native_batches += steps
        stats.compute_us += outcome.compute_us
        if self.final:
            stats.direct_replies += steps
        else:
            stats.write_throughs += steps
            stats.forward_write_us += outcome.write_us
        per_step = outcome.compute_us // steps
        for _ in range(steps):
            stats.observe_decode_batch(1)
            stats.compute_histogram.observe(per_step)
            stats.queue_histogram.observe(0)
        self._reader.last_frame = trio.current_time()
        stats.touch()


async def carry(run: RelayRun, *, scheduler: "Scheduler", lane_id: int, session_key: int,
                return_lane: "ReturnLane | None", timings: "DirectTimings",
                running: Callable[[RelayRun | None], None]) -> None:
    """Run ``run`` while this lane is the stage's only work (``Scheduler.hold``; else it is
    closed unrun): on the final stage as the return lane's one writer (its close aborts the
    run), elsewhere adding what it carried to the session's direct-return ``timings``.
    ``running`` is told the run reading the upstream (the watchdog's idle clock), then None."""
    if not scheduler.hold(run.stop, lane_id):
        run.close()
        return
    running(run)
    try:
        if return_lane is None:
            try:
                await run.run()
            finally:
                timings.add(session_key, compute_us=run.compute_us, write_us=run.write_us, messages=run.steps)
            return
        async with return_lane.lock:  # the return lane's one writer until the run ends
            return_lane.relay_abort = run.abort
            try:
                await run.run()
            finally:
                return_lane.relay_abort = None
    finally:
        running(None)
        scheduler.release_hold()
