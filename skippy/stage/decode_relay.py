"""The lane's side of the decode relay: when a session's decode may leave Python, and how it comes back.

Strategy: once a session decodes steadily (or verifies speculative windows steadily: the same
steps on a window's rows), every token is the same steps on a stage: with
direct return (docs/protocol.md §8) read, compute, write (downstream; on the final stage, the
prediction into the session's return lane); hop by hop read, compute, write downstream, read
the downstream's reply, add this stage's share (its Timings record) and write it upstream (the
final stage: read, compute, sample, write its reply upstream).  After the lane has handled such a
message in full (its one path: the protocol, the executor, the write-through, the reply relayed
upstream or the direct reply), :func:`relay_plan` decides whether the
next ones may go through :mod:`skippy.stage._relay` (its ``nogil`` loop; the twin ``skippy.stage._relay_py``
with ``SKIPPY_NO_EXTENSIONS=1``): the lane must have nothing queued, in flight or buffered (hop
by hop on a non-final stage, messages in flight are allowed when the run may take them over,
``StageLane.adoptable``: a pipelining upstream, such as the driver's speculation, never lets the
lane go quiet), no other lane may have brought work lately (``Scheduler.hold``: their rows batch instead), both
streams must be plain sockets with no simulated wire, the message of a kind whose rule has
``relay`` (a DecodeEmbd's one row, or a VerifyWindow of at most ``n_batch`` rows, which the
executor runs as one batch) in f32/f16 with no sampling or metadata section, the runtime a
native context, and on the final stage the session's sampler one the loop can run as the
executor would (no grammar, no logprobs); a one-stage chain's stage, first and final, takes the
token ids and answers with its own pick, as either stage alone does.  The run carries messages of the template's kind
and of the other kind whose plan the lane kept from the last message of it it handled for the
session (``StageLane.relay_kinds``: a decode's and a window's, so the driver's speculation, whose
windows change size and alternate with decodes, rides one run), a window's of any rows up to
the batch (the runtime's :class:`~skippy.runtime.row_batch.RowBatch` holds ``n_batch`` rows); a
rollback (rejected drafts) is trimmed in the loop as the executor's auto-align trims it.  Hop by
hop the templates are the last message of the kind whose reply came back (:class:`HopReplies`;
until the kind's first reply, the lane waits for it unless the upstream sends more).  Then
:func:`carry` holds the scheduler's runtime (and, on the final stage, the return lane's lock; hop
by hop it moves the downstream link's relay task off the socket at a reply's boundary and takes
the lane's messages in flight over, :meth:`RelayRun.adopt`), runs the loop on the runtime thread
(where every batch runs) and waits; the loop answers the replies of the messages it took over
first, in order.

A one-stage chain's decode run (docs/protocol.md §11) rides the same loop without reading the
upstream: :meth:`UpstreamLink.carry_run <skippy.stage.upstream.UpstreamLink.carry_run>` hands it
the run's next step (``run``), and the loop computes each step, answers it upstream and makes the
next one from its pick until the run's budget or a stop token; a message from upstream (the
receiving task writes the stop descriptor and waits for the loop), another lane's work or
``max_steps`` hand the run back between steps, and the lane's path takes the next one.

Whatever the loop does not carry comes back unread (:mod:`skippy.stage._relay`'s header): the lane
feeds those bytes to its reader and goes on as if the loop had never run, so every refusal,
rollback and error keeps its one path.  Hop by hop, a downstream reply the loop does not carry
(another shape, an Error frame, a lost downstream, or a stop while it waits) comes back the same
way: :meth:`RelayRun.run` gives the lane back the messages it took over and not answered (the
oldest in flight, ``StageLane.take_back``), tells it the loop's own messages in flight (the loop
pipelines: a message arriving while replies are outstanding is forwarded at once) were received,
computed and forwarded (the events they would have had), feeds what was read of the reply to the downstream
link's reader and gives it the socket back, and the reply takes the lane's path.  The run ends early when anything else needs the
runtime (the scheduler writes the stop descriptor), when the lane is cancelled or its return
lane closes (the abort descriptor, which also cuts a write waiting on a full socket; the wait
for the thread is never abandoned, so no socket is closed under it), and every ``max_steps``
tokens so the stage's statistics stay current.  A socket the loop writes that has no room (a
reader that fell behind: the next stage, or an upstream slow to read its answers) is waited for
in the loop's poll before it computes, never inside a write: a slow reader keeps the run (hop by
hop its replies are still read and answered meanwhile), and the scheduler's stop still ends it,
so a reader that stopped reading waits on the lane's path, in trio, while the runtime serves the
stage's other lanes.  On a non-final stage the loop also keeps the
output row of each step it computes; after every run they go into the stage's activation log
(skippy.stage.activation_log), as the executor's rows do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import trio

from skippy.codec import _frame_layout as layout
from skippy.codec.protocol import MessageKind, StageMessage, WireDType
from skippy.codec.protocol_ext import DIRECT_RETURN_FLAG
from skippy.lane.errors import ReturnLaneLost
from skippy.lane.protocol import RULES, Forward, SendDownstream
from skippy.stage import extensions
from skippy.stage.executor import ACTIVATION_LIMIT
from skippy.stage.transport import codec, write_failed

if TYPE_CHECKING:
    from skippy.lane.protocol import StageLane, Ticket
    from skippy.lane.replies import Reply
    from skippy.lane.timings import DirectTimings
    from skippy.stage.downstream import DownstreamLink
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

__all__ = ["IMPLEMENTATION", "HopReplies", "RelayPlan", "RelayRun", "carry", "relay_plan"]

log = logging.getLogger("skippy.stage")

_OUTCOMES = {_implementation.HANDED_BACK: "handed back", _implementation.STOPPED: "stopped",
             _implementation.STEP_LIMIT: "step limit", _implementation.DOWNSTREAM_FAILED: "downstream write failed",
             _implementation.ABORTED: "aborted", _implementation.REPLY_PENDING: "reply handed back",
             _implementation.UPSTREAM_FAILED: "upstream write failed", _implementation.RUN_ENDED: "run ended"}

#: Rows one run relays before handing its counts to the stage's statistics.
MAX_STEPS = 1024
#: The fields a forwarded frame keeps from the message it forwards: (offset, size).
_SAME = ((layout.POS_START, 4), (layout.DECODE_STEP, 8), (layout.REQUEST_ID, 16))
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
    #: Hop by hop on a non-final stage: the downstream's reply to ``message`` and this stage's
    #: answer upstream, as the lane wrote it (b"": direct return, or the final stage).
    reply_in: bytes = b""
    reply_out: bytes = b""
    #: docs/protocol.md §8 (else hop by hop: every token is answered upstream).
    direct: bool = True
    #: The executor's key of the session (its activation log's too).
    session_key: int = 0
    #: The rows of each message, and whether they are verify windows.
    rows: int = 1
    window: bool = False


def relay_plan(message: StageMessage, forwarded: bytes, *, executor: "Executor", session_key: int,
               width: int, out_dtype: WireDType, position_end: int,
               replies: tuple[bytes, bytes] | None = None, last: StageMessage | None = None) -> RelayPlan | None:
    """The plan for relaying the decode that follows ``message`` (just executed and forwarded as
    ``forwarded``; on the final stage, answered with the reply ``forwarded`` is the template of;
    hop by hop on a non-final stage, ``replies``: the downstream's reply and this stage's answer),
    or None when the loop would not carry it exactly as the lane did.  ``last``: hop by hop, the
    message the lane handled last when ``message`` (the template, whose reply came back) is an
    earlier one of the session (the messages after it are in flight: the run takes them over)."""
    state = message.state
    final = executor.is_last
    direct = bool(state.flags & DIRECT_RETURN_FLAG)
    rule = RULES.get(MessageKind(message.kind))
    rows = message.token_count
    if (rule is None or not rule.relay or (not direct and not final and replies is None)
            or not 1 <= rows <= (getattr(executor.context, "n_batch", 1) if rule.window else 1)
            or message.sampling is not None
            or message.chat_sampling_metadata is not None or state.activation_row_multiplier != 1
            or message.positions.shape[0] != 0 or (not final and out_dtype not in _CARRIED_DTYPES)
            or getattr(executor, "reads_tokens", False)
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
    if getattr(executor.context, "split_head", False):
        return None  # a split head runs its head beside the layers in decode() (issue 31)
    row_batch = getattr(executor.context, "row_batch", None)
    seq = executor.session_seq(session_key)
    sampler = executor.relay_sampler(session_key) if final else None
    if row_batch is None or seq is None or (final and sampler is None):
        return None  # the null runtime, a session already released, or tokens the loop cannot pick
    next_position = executor.context.length(seq)
    if last is None:
        last = message
    if next_position != last.pos_start + last.token_count or last.session_id != message.session_id:
        return None
    in_template = codec.encode_message(message, in_dtype, width)
    if not final and any(forwarded[start:start + size] != in_template[start:start + size] for start, size in _SAME):
        return None  # not this message's frame (a template left by another)
    reply_in, reply_out = replies if replies is not None and not direct and not final else (b"", b"")
    try:
        shape = _implementation.template_layout(in_template, forwarded, width=width, first=executor.is_first,
                                                final=final)
        if reply_in:
            _implementation.hop_layout(reply_in, reply_out, rows=shape.rows, window=shape.window)
    except ValueError:
        return None
    if 0 < position_end <= next_position:
        return None
    return RelayPlan(in_template, forwarded, seq, next_position, sampler, reply_in, reply_out, direct, session_key,
                     rows, rule.window)


def _other_kind(plan: RelayPlan, lane: "StageLane | None") -> RelayPlan | None:
    """The lane's last plan of the other kind (a decode's for a window's, or the reverse) for the
    same session and path, so the run carries both; ``plan`` becomes the lane's of its kind."""
    if lane is None:
        return None
    kinds: dict[bool, Any] = lane.relay_kinds  # type: ignore[assignment]
    other = kinds.get(not plan.window)
    if other is not None and (other.session_key != plan.session_key or other.seq != plan.seq
                              or other.direct != plan.direct or other.sampler is not plan.sampler
                              or bool(other.reply_in) != bool(plan.reply_in)):
        kinds.clear()  # another session's (or path's): the run carries one kind until it comes again
        other = None
    kinds[plan.window] = plan
    return other


class HopReplies:
    """Hop by hop on a non-final stage, the templates of the replies: each plain decode's (or
    verify window's) message the lane handled and forwarded (:meth:`handled`), and once its reply
    is relayed upstream (:meth:`relayed`) the last one of each kind with both replies as the lane
    wrote them, for :func:`relay_plan`; the receiving task waits for its message's
    (:meth:`wait`) while the upstream sends nothing more."""

    #: Messages handled whose replies are still to come, kept at most.
    LIMIT = 16

    def __init__(self) -> None:
        self._handled: dict[Ticket, tuple[int, StageMessage, bytes]] = {}
        #: By kind (a window's: True): (session key, message, frame forwarded, reply in, reply out).
        self._kinds: dict[bool, tuple[int, StageMessage, bytes, "Reply", "Reply"]] = {}
        self._last: "Ticket | None" = None
        self._waiter: trio.CancelScope | None = None

    def handled(self, ticket: "Ticket | None", key: int, message: StageMessage, frame: bytes) -> None:
        """``ticket``'s ``message`` (of session ``key``) was forwarded as ``frame``."""
        if ticket is None:
            return
        handled = self._handled
        if len(handled) >= self.LIMIT:  # (replies the lane never relayed: a run answered them)
            del handled[next(iter(handled))]
        handled[ticket] = (key, message, frame)

    def relayed(self, ticket: "Ticket", reply_in: "Reply", reply_out: "Reply") -> None:
        """``ticket``'s reply: the downstream's ``reply_in`` answered upstream as ``reply_out``
        (each a reply, its Timings frame and its §10 frames; call before writing it)."""
        entry = self._handled.pop(ticket, None)
        if entry is not None:
            key, message, frame = entry
            self._kinds[RULES[ticket.kind].window] = (key, message, frame, reply_in, reply_out)
        self._last = ticket

    def written(self) -> None:
        """The reply reported last is written: a waiting :meth:`wait` returns."""
        if self._waiter is not None:
            self._waiter.cancel()

    async def wait(self, ticket: "Ticket | None", upstream_fd: int) -> None:
        """Return once ``ticket``'s reply is written upstream, or the upstream sends more first
        (a pipelining upstream: the run takes the messages in flight over)."""
        if self._last is not ticket:
            with trio.CancelScope() as scope:
                self._waiter = scope
                try:
                    await trio.lowlevel.wait_readable(upstream_fd)
                finally:
                    self._waiter = None

    def template(self, key: int, window: bool) -> tuple[StageMessage, bytes, tuple[bytes, bytes]] | None:
        """The last message of session ``key`` of the kind (``window``) whose reply was relayed:
        the message, its forwarded frame and its replies' bytes (None: none yet)."""
        kept = self._kinds.get(window)
        if kept is None or kept[0] != key:
            return None
        return kept[1], kept[2], (extensions.reply_bytes(*kept[3]), extensions.reply_bytes(*kept[4]))


class RelayRun:
    """One hand-over of a lane's upstream reading to the loop (see the module header).

    Args:
        plan: from :func:`relay_plan`.
        upstream / downstream: the lane's socket I/O (both ``is_socket``; a final stage's
            downstream is the session's return lane, whose lock the caller holds).
        reader: the lane's message reader (empty: the caller checked).
        downstream_name: for the error of a failed write.
        run: a one-stage chain's decode run the loop drives (docs/protocol.md §11): its next
            step's frame, the predictions left and its stop tokens (the loop's ``run``).
    """

    def __init__(self, plan: RelayPlan, *, executor: "Executor", scheduler: "Scheduler", stats: "StageStats",
                 upstream: "SocketIO", downstream: "SocketIO", reader: "MessageReader", downstream_name: str,
                 width: int, position_end: int, lane: "StageLane | None" = None,
                 link: "DownstreamLink | None" = None, upstream_name: str = "",
                 run: tuple[bytes, int, tuple[int, ...]] | None = None) -> None:
        self._executor, self._scheduler, self._stats = executor, scheduler, stats
        self._upstream, self._downstream, self._reader = upstream, downstream, reader
        self._downstream_name, self._upstream_name = downstream_name, upstream_name
        self._lane, self._width = lane, width
        #: Hop by hop on a non-final stage: the downstream link whose replies the loop reads.
        self.link = link if plan.reply_in else None
        self.final = plan.sampler is not None
        self.direct = plan.direct
        if not plan.direct and not self.final and (lane is None or link is None):
            raise ValueError("a hop-by-hop relay on a non-final stage needs its lane and downstream link")
        #: A non-final stage's activation log gets the rows the loop computed (after each run).
        self._log = executor.activation_log if not self.final and executor.activation_log.enabled else None
        self._session_key = plan.session_key
        self._stop = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._abort = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        other = _other_kind(plan, lane)
        try:  # a batch of the most rows a message may have (a window's up to n_batch)
            self._rows = executor.context.row_batch(  # type: ignore[attr-defined]
                plan.seq, plan.sampler, max(plan.rows, int(getattr(executor.context, "n_batch", 1))))
            self._relay: Any = _implementation.DecodeRelay(
                upstream_fd=upstream.fileno(), downstream_fd=downstream.fileno(), stop_fd=self._stop,
                abort_fd=self._abort, in_template=plan.in_template, out_template=plan.out_template, width=width,
                first=executor.is_first, n_vocab=executor.n_vocab, next_position=plan.next_position,
                position_end=position_end, activation_limit=ACTIVATION_LIMIT, runtime=self._rows, final=self.final,
                max_steps=MAX_STEPS, reply_in=plan.reply_in, reply_out=plan.reply_out,
                other=None if other is None else (other.in_template, other.out_template, other.reply_in,
                                                  other.reply_out),
                log_rows=self._log is not None, **({} if run is None else {"run": run}))
        except BaseException:
            self.close()
            raise
        #: Messages relayed, and their compute and downstream-write time (microseconds): the lane
        #: adds them to the session's direct-return timings (docs/protocol.md §8).
        self.steps = self.compute_us = self.write_us = 0
        #: The outcome of a run whose wait was cancelled, to account before the lane closes.
        self._unaccounted: Any = None
        #: The runtime thread's CPU time in the last loop run (microseconds).
        self._cpu_us = 0
        #: Hop by hop: the lane's messages in flight the run took over and has not answered yet.
        self._adopted: "tuple[Forward, ...]" = ()

    def adopt(self) -> bool:
        """Hop by hop, with the downstream link's relay task off the socket: take the lane's
        messages in flight over (:meth:`~skippy.lane.protocol.StageLane.hand_over`; the run answers
        their replies first).  False: the run may not start (the lane keeps them)."""
        lane = self._lane
        if self.link is None or lane is None:
            return True
        forwards = lane.hand_over(self._session_key)
        if forwards is None:
            return False
        if len(forwards) >= _implementation.MAX_IN_FLIGHT or not all(
                forward.ticket is not None and self._relay.adopts(int(forward.ticket.kind), forward.message.token_count)
                for forward in forwards):
            lane.take_back(forwards)
            return False
        self._adopted = forwards
        return True

    def run_progress(self) -> tuple[int, int, bool]:
        """A decode run's: the steps the loop computed and answered, the last one's pick (-1:
        none) and whether that was the run's last prediction."""
        relay = self._relay
        return int(relay.run_steps), int(relay.run_token), bool(relay.run_over)

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
        adopted = tuple((int(forward.ticket.kind), forward.message.token_count, forward.compute_us,  # type: ignore[union-attr]
                         forward.write_us, forward.sent_us, (forward.sent_us + forward.write_us) * 1000,
                         forward.received_us * 1000) for forward in self._adopted)
        try:
            while True:
                outcome = await self._run_once(pending, adopted)
                adopted = ()
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
            if self._adopted:  # taken over and not answered: the oldest in flight, the lane's again
                self._lane.take_back(self._adopted)  # type: ignore[union-attr]
                self._adopted = ()
            self.close()
        if outcome.status == _implementation.REPLY_PENDING:
            pending = self._take_over(outcome)
        if pending:  # (an empty chunk would tell the decoder the stream ended)
            self._reader.decoder.receive_data(pending)  # type: ignore[attr-defined]
        self._upstream.mark_drained()
        if outcome.status == _implementation.UPSTREAM_FAILED:
            raise write_failed(self._upstream_name, downstream=False) from trio.BrokenResourceError(
                "the decode relay's reply write failed or was cut off")
        if outcome.status in (_implementation.DOWNSTREAM_FAILED, _implementation.ABORTED):
            cause = trio.BrokenResourceError("the decode relay's write failed or was cut off")
            if self.final and self.direct:
                raise ReturnLaneLost(f"the return lane to {self._downstream_name} failed a write or closed "
                                     "during one") from cause
            raise write_failed(self._downstream_name, downstream=not self.final) from cause  # (hop by hop: upstream)

    def _take_over(self, outcome: Any) -> bytes:
        """Hop by hop: the messages at the head of ``outcome.leftover`` (``outcome.in_flight``)
        were computed and forwarded, the oldest one's reply not carried: tell the lane so (the
        events its own path has, message by message) and hand what was read of that reply to the
        downstream link's reader; returns the upstream bytes after them."""
        lane, link = self._lane, self.link
        assert lane is not None and link is not None
        rest = outcome.leftover
        stats = self._stats
        computed = False
        for length, compute_us, write_us, sent_us in outcome.in_flight:
            if not length:  # taken over from the lane: it has it back (run)
                continue
            computed = True
            frame, rest = rest[:length], rest[length:]
            decoder = codec.MessageDecoder(self._width)
            decoder.receive_data(frame)
            message = decoder.next_message()
            assert isinstance(message, StageMessage)  # the loop matched it against its template
            dispatch, _ = lane.received(message, run_flagged=False, is_first=self._executor.is_first)
            assert dispatch is not None
            action = lane.computed(dispatch, has_downstream=True)
            assert type(action) is SendDownstream
            forward = Forward(message, action.expect, dispatch.ticket, dispatch.key, sent_us, trio.current_time(),
                              compute_us, 0, 1, sent_us, write_us)
            lane.frame_forwarding(forward)
            stats.messages += 1
            if dispatch.rule.window:
                stats.verify_windows += 1
            else:
                stats.decode_items += 1
            stats.native_batches += 1
            stats.compute_us += compute_us
            stats.write_throughs += 1
            stats.forward_write_us += write_us
            self._executor.resume_stats.computed_positions += message.token_count
        if computed:
            self._rows.finished(1, outcome.last_rows)
        if outcome.reply_leftover:
            link.reader.decoder.receive_data(outcome.reply_leftover)  # type: ignore[union-attr]
        return rest

    async def _run_once(self, pending: bytes, adopted: tuple[tuple[int, ...], ...] = ()) -> Any:
        def relay() -> Any:  # the runtime thread: the outcome is kept even if the wait is cancelled
            cpu = time.thread_time_ns()
            outcome = self._relay.run(pending, adopted)
            self._cpu_us = (time.thread_time_ns() - cpu) // 1000
            self._unaccounted = outcome
            return outcome

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_cancelled)
            # never abandoned: a cancel ends the loop (above) and waits for the thread to return;
            # on the runtime thread, as every batch: one OpenMP pool per stage (skippy.stage.scheduler)
            outcome = await self._scheduler.run_native(relay)
            nursery.cancel_scope.cancel()
        return outcome

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.stop()
            self.abort()

    def _account(self, outcome: Any) -> None:
        if self._log is not None:  # the rows this run computed, into the log as the executor's are
            for start, count, rows in self._relay.take_log():
                self._log.record(self._session_key, start, count,
                                 np.frombuffer(rows, dtype="<f4").reshape(count, self._width))
        steps = outcome.steps
        self.steps += steps
        stats = self._stats
        stats.decode_relay_runs += 1
        # the runtime's busy time: the loop's computes (not its waits for the upstream), its CPU
        stats.runtime_busy_us += outcome.compute_us
        stats.runtime_cpu_us += self._cpu_us
        self._cpu_us = 0
        if outcome.adopted:  # the lane's messages the run took over, answered
            self._lane.adopted_answered(outcome.adopted)  # type: ignore[union-attr]
            self._adopted = self._adopted[outcome.adopted:]
        if outcome.trims:  # rollbacks trimmed in the loop, as the scheduler counts the executor's
            stats.auto_aligns += outcome.trims
            stats.trimmed_tokens += outcome.trimmed
        self._upstream.bytes_in += outcome.bytes_in
        self._downstream.bytes_out += outcome.bytes_out
        if self.link is not None:  # hop by hop: the replies read and answered
            self._downstream.bytes_in += outcome.replies_in
            self._upstream.bytes_out += outcome.replies_out
        if not steps:
            return
        self._rows.finished(steps, outcome.last_rows)
        self.compute_us += outcome.compute_us
        self.write_us += outcome.write_us
        windows = outcome.windows
        decodes = steps - windows
        stats.decode_relay_windows += windows
        stats.verify_windows += windows
        stats.decode_relay_steps += decodes
        stats.decode_items += decodes
        stats.messages += steps
        stats.native_batches += steps
        stats.compute_us += outcome.compute_us
        self._executor.resume_stats.computed_positions += outcome.rows
        if self.final and self.direct:
            stats.direct_replies += steps
        else:  # (the lane writes a window's reply from its handling task)
            stats.write_throughs += decodes if self.final else steps
            if not self.final:
                stats.forward_write_us += outcome.write_us
        if self.link is not None:
            stats.downstream_wait_us += outcome.wait_us
            for _ in range(steps):
                stats.downstream_wait_histogram.observe(outcome.wait_us // steps)
        per_step = outcome.compute_us // steps
        for _ in range(decodes):  # (a window runs alone, not in a decode batch)
            stats.observe_decode_batch(1)
        for _ in range(steps):
            stats.compute_histogram.observe(per_step)
            stats.queue_histogram.observe(0)
        self._reader.last_frame = trio.current_time()
        stats.touch()


async def carry(run: RelayRun, *, scheduler: "Scheduler", lane_id: int, session_key: int,
                return_lane: "ReturnLane | None", timings: "DirectTimings",
                running: Callable[[RelayRun | None], None]) -> bool:
    """Run ``run`` while this lane is the stage's only work (``Scheduler.hold``; else it is
    closed unrun): on the final stage with direct return as the return lane's one writer (its
    close aborts the run); hop by hop on a non-final stage as the downstream's one reader (the
    link's relay task parks off the socket until the run ends; if it cannot, the run is closed
    unrun); with direct return elsewhere adding what it carried to the session's direct-return
    ``timings``.  ``running`` is told the run reading the upstream (the watchdog's idle clock),
    then None.  Returns whether the run ran."""
    if not scheduler.hold(run.stop, lane_id, run.idle_since):
        run.close()
        return False
    link = run.link
    if link is not None and not await link.pause_relay():
        scheduler.release_hold()
        run.close()
        return False
    if link is not None and not run.adopt():
        link.resume_relay()
        scheduler.release_hold()
        run.close()
        return False
    running(run)
    try:
        if return_lane is None:
            try:
                await run.run()
            finally:
                if run.direct:
                    timings.add(session_key, compute_us=run.compute_us, write_us=run.write_us, messages=run.steps)
                if link is not None:  # after the run handed back a reply in flight: the relay task reads it
                    link.resume_relay()
            return True
        async with return_lane.lock:  # the return lane's one writer until the run ends
            return_lane.relay_abort = run.abort
            try:
                await run.run()
            finally:
                return_lane.relay_abort = None
        return True
    finally:
        running(None)
        scheduler.release_hold()
