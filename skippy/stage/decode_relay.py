"""The lane's side of the decode relay: when a session's decode may leave Python, and how it comes back.

Strategy: with direct return (docs/protocol.md §8) a non-final stage answers nothing upstream
for a flagged DecodeEmbd, so once a session decodes steadily every token is the same three
steps: read, compute, write downstream.  After the lane has handled such a message in full (its
one path: the protocol, the executor, the write-through), :func:`relay_plan` decides whether the
next ones may go through :mod:`skippy._relay` (its ``nogil`` loop; the twin ``skippy._relay_py``
with ``SKIPPY_NO_EXTENSIONS=1``): the lane must have nothing queued, in flight or buffered, no
other lane may have brought work lately (``Scheduler.hold``: their rows batch instead), both streams plain sockets with no simulated wire, the message one row
of f32/f16 with no sampling or metadata section, and the runtime a native context.  Then
:meth:`RelayRun.run` holds the scheduler's runtime, runs the loop on a worker thread and waits.

Whatever the loop does not carry comes back unread (:mod:`skippy._relay`'s header): the lane
feeds those bytes to its reader and goes on as if the loop had never run, so every refusal,
rollback and error keeps its one path.  The run ends early when anything else needs the
runtime (the scheduler writes the stop descriptor), when the lane is cancelled (the wait is
never abandoned: the thread is stopped and joined before the lane closes a socket), and every
``max_steps`` tokens so the stage's statistics stay current.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import trio

from skippy.protocol import MessageKind, StageMessage, WireDType
from skippy.protocol_ext import DIRECT_RETURN_FLAG
from skippy.stage.executor import ACTIVATION_LIMIT
from skippy.stage.transport import codec, write_failed

if TYPE_CHECKING:
    from skippy.stage.executor import Executor
    from skippy.stage.scheduler import Scheduler
    from skippy.stage.stats import StageStats
    from skippy.stage.transport import MessageReader, SocketIO

if os.environ.get("SKIPPY_NO_EXTENSIONS") == "1":
    from skippy import _relay_py as _implementation
else:
    try:
        from skippy import _relay as _implementation  # type: ignore[no-redef]
    except ImportError:  # not built: the twin carries the same bytes
        from skippy import _relay_py as _implementation  # type: ignore[no-redef]

#: Which implementation carries the relay: "cython" or "python".
IMPLEMENTATION: str = _implementation.IMPLEMENTATION

__all__ = ["IMPLEMENTATION", "RelayPlan", "RelayRun", "relay_plan"]

log = logging.getLogger("skippy.stage")

_OUTCOMES = {_implementation.HANDED_BACK: "handed back", _implementation.STOPPED: "stopped",
             _implementation.STEP_LIMIT: "step limit", _implementation.DOWNSTREAM_FAILED: "downstream write failed"}

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


def relay_plan(message: StageMessage, forwarded: bytes, *, executor: "Executor", session_key: int,
               width: int, out_dtype: WireDType, position_end: int) -> RelayPlan | None:
    """The plan for relaying the decode that follows ``message`` (just executed and forwarded as
    ``forwarded``), or None when the loop would not carry it exactly as the lane did."""
    state = message.state
    if (message.kind is not MessageKind.DECODE_EMBD or not state.flags & DIRECT_RETURN_FLAG
            or message.token_count != 1 or message.sampling is not None
            or message.chat_sampling_metadata is not None or state.activation_row_multiplier != 1
            or message.positions.shape[0] != 0 or out_dtype not in _CARRIED_DTYPES):
        return None
    try:
        in_dtype = WireDType(state.reserved)
    except ValueError:
        return None
    if not executor.is_first and in_dtype not in _CARRIED_DTYPES:
        return None
    row_batch = getattr(executor.context, "row_batch", None)
    seq = executor.session_seq(session_key)
    if row_batch is None or seq is None:  # the null runtime, or a session already released
        return None
    next_position = executor.context.length(seq)
    if next_position != message.pos_start + 1:
        return None
    in_template = codec.encode_message(message, in_dtype, width)
    try:
        _implementation.template_layout(in_template, forwarded, width=width, first=executor.is_first)
    except ValueError:
        return None
    if 0 < position_end <= next_position:
        return None
    return RelayPlan(in_template, forwarded, seq, next_position)


class RelayRun:
    """One hand-over of a lane's upstream reading to the loop (see the module header).

    Args:
        plan: from :func:`relay_plan`.
        upstream / downstream: the lane's socket I/O (both ``is_socket``).
        reader: the lane's message reader (empty: the caller checked).
        downstream_name: for the error of a failed write.
    """

    def __init__(self, plan: RelayPlan, *, executor: "Executor", scheduler: "Scheduler", stats: "StageStats",
                 upstream: "SocketIO", downstream: "SocketIO", reader: "MessageReader", downstream_name: str,
                 width: int, position_end: int) -> None:
        self._executor, self._scheduler, self._stats = executor, scheduler, stats
        self._upstream, self._downstream, self._reader = upstream, downstream, reader
        self._downstream_name = downstream_name
        self._stop = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._rows = executor.context.row_batch(plan.seq)  # type: ignore[attr-defined]
        self._relay: Any = _implementation.DecodeRelay(
            upstream_fd=upstream.fileno(), downstream_fd=downstream.fileno(), stop_fd=self._stop,
            in_template=plan.in_template, out_template=plan.out_template, width=width,
            first=executor.is_first, n_vocab=executor.n_vocab, next_position=plan.next_position,
            position_end=position_end, activation_limit=ACTIVATION_LIMIT, runtime=self._rows, max_steps=MAX_STEPS)
        self.steps = 0

    def close(self) -> None:
        """Release the stop descriptor of a run that never ran."""
        if self._stop >= 0:
            os.close(self._stop)
            self._stop = -1

    def stop(self) -> None:
        """Ask the loop to end between frames (any thread; idempotent)."""
        if self._stop >= 0:
            os.eventfd_write(self._stop, 1)

    def idle_since(self) -> float:
        """When the loop last began receiving a frame, on trio's clock (the idle timeout)."""
        return trio.current_time() - (time.monotonic_ns() - self._relay.last_frame_ns) / 1e9

    async def run(self) -> None:
        """Relay until the loop hands back; the reader then holds what it did not carry.

        Raises:
            DownstreamLost: writing downstream failed (named as for any forward).
        """
        pending = b""
        try:
            while True:
                outcome = await self._run_once(pending)
                self._account(outcome)
                log.debug("decode relay (%s): %d tokens, then %s with %d bytes unread", IMPLEMENTATION,
                          outcome.steps, _OUTCOMES[outcome.status], len(outcome.leftover))
                pending = outcome.leftover
                if outcome.status != _implementation.STEP_LIMIT:
                    break
        finally:
            self.close()
        if pending:  # (an empty chunk would tell the decoder the stream ended)
            self._reader.decoder.receive_data(pending)  # type: ignore[attr-defined]
        self._upstream.mark_drained()
        if outcome.status == _implementation.DOWNSTREAM_FAILED:
            raise write_failed(self._downstream_name, downstream=True) from trio.BrokenResourceError(
                "the decode relay's write failed")

    async def _run_once(self, pending: bytes) -> Any:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_cancelled)
            # never abandoned: a cancel stops the loop (above) and waits for the thread to return
            outcome = await trio.to_thread.run_sync(self._relay.run, pending)
            nursery.cancel_scope.cancel()
        return outcome

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.stop()

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
        stats.decode_relay_steps += steps
        stats.messages += steps
        stats.decode_items += steps
        stats.write_throughs += steps
        stats.native_batches += steps
        stats.compute_us += outcome.compute_us
        stats.forward_write_us += outcome.write_us
        per_step = outcome.compute_us // steps
        for _ in range(steps):
            stats.observe_decode_batch(1)
            stats.compute_histogram.observe(per_step)
            stats.queue_histogram.observe(0)
        self._reader.last_frame = trio.current_time()
        stats.touch()
