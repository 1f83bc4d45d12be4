"""One upstream connection (a lane): one nursery, four tasks, small bounded channels between them.

Strategy (the behaviour of the reference's ``handle_binary_connection``, restructured for trio):

* ``receive_messages`` reads and decodes frames, refuses kinds and headers the stage does not
  serve, and gives every message that expects an answer a *reply slot*, queued to the upstream
  writer in message order.  A non-final prefill chunk's slot is filled with an ACK at once: the
  early ACK, sent before compute.  When the lane is idle (no reply outstanding) the slot is
  *direct* instead: nothing is ahead of it, so whichever task fills it writes the reply itself,
  and the writer task is not woken at all (the decode hot path: one message in flight).
* ``compute_messages`` handles each message in order: session control and generation control go
  to the scheduler (trim / configure / release), prefix-cache control goes to
  :mod:`skippy.stage.prefix_control` (a miss ACK, or a forward whose reply it rewrites; a
  TryRestorePrefillDecode hit is answered like a decode: the last stage's PredictedToken, relayed
  up as ``Expect.RELAY_EITHER``, which also takes a miss ACK), executable kinds are
  auto-aligned and run by the scheduler.  The final stage fills the slot with its
  PredictedToken(s) or ACK; other stages hand the output to the forwarder.
* ``forward_activations`` encodes frames in the wire dtype and writes them downstream (through
  the optional simulated wire).  Early-ACKed chunks take a *reply credit* first, so at most
  ``credit_limit`` of them are unacknowledged downstream.  Before writing a frame it records what
  its reply means in the ``expected`` queue.
* ``relay_replies`` reads downstream replies, in the order frames were written: the ACKs of
  early-ACKed chunks are absorbed (their stats kept for the next reply, their credit returned);
  everything else is relayed upstream with this stage's timings merged into the stats.  A Stop's
  session is released after the downstream ACK, before the ACK goes upstream.  It parks on the
  downstream socket, not on a channel: its work arrives as bytes, so a channel hop first would
  only wake it to park again (and an idle lane notices a lost downstream at once).  The forwarder
  cancels that wait when it finishes with nothing left to answer.
* ``write_replies`` writes queued slots in order; a direct slot's reply is written by its filler,
  and the writer waits for it before writing anything behind it.  So the upstream stream has one
  writer at a time, and replies keep message order whatever finishes first.

Channel hand-offs use ``send_nowait`` / ``receive_nowait`` first and park only when the channel
is full / empty: a plain ``send`` / ``receive`` is a checkpoint even when it need not wait, and
each checkpoint is a trip through trio's run loop (see :mod:`skippy.stage.transport` for the
socket side of the same saving).  The bounds, and so the backpressure, are unchanged.

Hops that would only add run-loop passes are skipped when nothing is queued, in the same spirit
as the direct slot (each hop is a pass, and on the decode path every pass finds its code cold):

* *idle-lane fast path*: a message arriving while the compute task has nothing queued (and that
  is not an early-ACKed chunk, which receiving must run ahead of) is handled on the receiving
  task itself;
* a frame for an idle forwarder is written by the task that produced it;
* *write-through* (:mod:`skippy.stage.write_through`): a decode-like item whose frame has the
  stream to itself (an idle forwarder downstream; the direct slot of a final stage's
  PredictedToken) is written by the runtime thread the moment its compute ends, before the trio
  side hears of it: that hand-back was the largest piece of a stage's time on the chain's
  critical path.

Each still keeps one writer per stream and message order: only one task handles messages at a
time (``_compute_backlog``), and a stream is written by a shortcut only when nothing is queued
for it (``_forward_backlog``, the direct slot).

Any failure (a malformed
frame, a refused kind, a runtime error, a lost downstream) raises out of the nursery, which
cancels the other tasks; the connection is closed with one log line naming the reason, sessions
it opened are released, and its downstream lane is closed, which cascades the close down the
chain.  The stage and its other connections carry on.

Negotiated extensions (``docs/protocol.md`` §2-§4, helpers in :mod:`skippy.stage.extensions`):
every message sent downstream carries the extension flag and the downstream lane decodes Error
and Timings frames.  When this lane's upstream flagged its messages, a predicted reply is
preceded by a Timings frame (this stage's record appended to the downstream's, in the same
write), and a lane closed for a nameable reason (or by a drain) ends with an Error frame: a
downstream Error relayed unchanged, a lost downstream as ``DOWNSTREAM_LOST`` naming it.  An
upstream that never flagged sees plain v11 only.  Per-stage timings reach the driver through
those frames (``StageClient.take_timings``); the v11 ``verify_window_*`` stats keep their
reference meaning and are filled for VerifyWindow replies only (``timing_stats``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging

import numpy as np
import trio

from skippy.protocol import (
    EMPTY_REPLY_STATS,
    MessageKind,
    ReplyKind,
    ReplyStats,
    StageMessage,
    StageReply,
    StateHeader,
)
from skippy.protocol_ext import (
    SKIPPY_EXTENSIONS_FLAG,
    ErrorFrame,
    ExtensionNegotiation,
    TimingsFrame,
    append_timing,
    with_extensions_flag,
)
from skippy.stage import extensions
from skippy.stage.errors import DownstreamError, DownstreamLost, StageError, StateMismatch, UnsupportedKind
from skippy.stage import prefix_control
from skippy.stage.executor import Outputs, WorkItem, WorkResult, sampling_params
from skippy.stage.lane import Expect, Forward, LaneSettings, ReplySlot, merge_stats, now_us, put, take, timing_stats
from skippy.stage.scheduler import Scheduler
from skippy.stage.stats import StageStats
from skippy.stage.write_through import StreamGate, WriteThrough
from skippy.stage.transport import (
    MessageReader,
    ReplyReader,
    SocketIO,
    codec,
    connect_stage,
    send_frame,
)

log = logging.getLogger("skippy.stage")

#: Messages buffered between receive and compute (small: this is the backpressure).
MESSAGE_QUEUE = 2
#: Upstream replies that may wait for their turn.
REPLY_QUEUE = 16

_connection_ids = itertools.count(1)

_REFUSED_KINDS = {
    MessageKind.STATE_IMPORT: "binary state import is no longer supported by the skippy runtime ABI",
    MessageKind.STATE_EXPORT: "binary state export is no longer supported by the skippy runtime ABI",
    MessageKind.PREDICTION_RETURN_OPEN: "direct prediction return (PredictionReturnOpen) is not supported by this stage",
}
_CONTROL_KINDS = frozenset({
    MessageKind.STOP, MessageKind.TRIM_SESSION, MessageKind.CONFIGURE_GENERATION,
    MessageKind.RETIRE_VERIFY_WINDOW, MessageKind.PROBE_PREFILL, MessageKind.RESTORE_PREFILL,
    MessageKind.TRY_RESTORE_PREFILL, MessageKind.TRY_RESTORE_PREFILL_DECODE,
})
#: Kinds a final stage answers through write-through: a PredictedToken and nothing else to add.
_WRITE_THROUGH_FINAL_KINDS = frozenset({
    MessageKind.DECODE_EMBD, MessageKind.DECODE_READOUT, MessageKind.DECODE_LIGHT_CTX,
})
_INT32 = np.dtype(np.int32)
_FLOAT32 = np.dtype(np.float32)
#: (kind, phase, flags) triples already checked and accepted (shared by every lane).
_ACCEPTED_HEADERS: set[tuple[int, int, int]] = set()
_OUTPUTS = {
    MessageKind.PREFILL_EMBD: Outputs.NONE,
    MessageKind.DECODE_REPLAY_EMBD: Outputs.NONE,
    MessageKind.VERIFY_WINDOW: Outputs.ALL,
}


class Connection:
    """Serves one upstream lane until it closes or fails.

    Args:
        upstream: the accepted stream (READY already sent).
        peer: the upstream address, for logs.
        settings: the stage's lane settings.
        scheduler: the stage's scheduler.
        stats: the stage's counters.
    """

    def __init__(self, upstream: trio.SocketStream, peer: str, settings: LaneSettings,
                 scheduler: Scheduler, stats: StageStats) -> None:
        self.id = next(_connection_ids)
        self.upstream = upstream
        self.peer = peer
        self.settings = settings
        self.scheduler = scheduler
        self.stats = stats
        self.sessions: set[int] = set()
        self.downstream: trio.SocketStream | None = None
        self.downstream_name = str(settings.downstream) if settings.downstream is not None else ""
        self._credits = trio.Semaphore(settings.credit_limit)
        self._pending_stats: ReplyStats = EMPTY_REPLY_STATS
        self._upstream_io = SocketIO(upstream)
        self._downstream_io: SocketIO | None = None
        #: Forwarded frames whose downstream reply has not been read, in write order.
        self._expected: collections.deque[Forward] = collections.deque()
        self._forwarding_done = False
        #: The relay's scope, and whether it is parked waiting with nothing expected.
        self._relay_scope = trio.CancelScope()
        self._relay_idle = False
        #: The direct slot being answered (at most one: one is made only on an idle lane).
        self._direct: ReplySlot | None = None
        #: Messages received whose reply has not been written yet (0: the lane is idle).
        self.inflight = 0
        #: docs/protocol.md §2: whether this upstream flagged its messages (Error / Timings allowed).
        self.extensions = ExtensionNegotiation()
        self.identity = extensions.identity_for(scheduler.executor)
        #: An upstream write was interrupted mid-frame: no Error frame may follow it.
        self._upstream_torn = False
        #: The downstream lane's channel to the forwarder (None until the first message opens it).
        self._forwards: trio.MemorySendChannel[Forward] | None = None
        #: Messages handed to the compute task and not finished (0: it is idle, nothing queued).
        self._compute_backlog = 0
        #: Frames handed to the forwarder and not yet written (0: it is idle, nothing queued).
        self._forward_backlog = 0
        #: What this lane's write-throughs write under (closed before the lane's streams are).
        self._gate = StreamGate()

    # -- lifetime ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the lane; never raises except Cancelled (failures are logged and counted)."""
        self.stats.connections_open += 1
        self.stats.connections_total += 1
        self.stats.touch()
        error: ErrorFrame | None = None
        try:
            await self._serve()
        except* trio.Cancelled:  # only the server cancels a lane: it is draining (SIGTERM)
            error = extensions.shutting_down_frame(self.identity.index, self._own_address())
            raise
        except* Exception as group:
            leaves = _leaves(group)
            reason = "; ".join(_describe(exc) for exc in leaves)
            self.stats.connection_errors += 1
            log.error("closing lane %d from %s: %s", self.id, self.peer, reason)
            cause = next((exc for exc in leaves if isinstance(exc, DownstreamError)), leaves[0])
            error = extensions.error_frame(cause, _describe(cause), index=self.identity.index,
                                           address=self._own_address(), downstream_address=self.downstream_name)
        finally:
            self._gate.close()  # a write-through still queued must not write from here on
            with trio.CancelScope(shield=True):
                if error is not None and self.extensions.enabled and not self._upstream_torn:
                    await self._send_error(error)
                await self._cleanup()

    def _own_address(self) -> str:
        try:
            host, port = self.upstream.socket.getsockname()[:2]
        except (OSError, AttributeError):  # closed, or not a socket stream
            return ""
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def _send_error(self, error: ErrorFrame) -> None:
        """docs/protocol.md §3: the Error frame, last thing on the lane (best effort, bounded)."""
        try:
            frame = codec.encode_error(error)
            with trio.move_on_after(0.5):
                await self._upstream_io.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ValueError) as exc:
            log.debug("lane %d: could not send the Error frame: %s", self.id, exc)

    async def _cleanup(self) -> None:
        orphans = sorted(self.sessions)
        self.sessions.clear()
        for key in orphans:
            try:
                released = await self.scheduler.call(functools.partial(self.scheduler.executor.release, key))
            except StageError as exc:  # a release that fails must not stop the others
                log.warning("lane %d: releasing session %d failed: %s", self.id, key & ((1 << 64) - 1), exc)
                continue
            if released:
                self.stats.orphan_sessions_released += 1
        for stream in (self.downstream, self.upstream):
            if stream is not None:
                with trio.move_on_after(1):
                    await trio.aclose_forcefully(stream)
        self.stats.connections_open -= 1
        self.stats.touch()
        log.debug("lane %d from %s closed (%d orphan sessions released)", self.id, self.peer, len(orphans))

    async def _serve(self) -> None:
        messages_send, messages_receive = trio.open_memory_channel[tuple[StageMessage, ReplySlot | None, int]](MESSAGE_QUEUE)
        slots_send, slots_receive = trio.open_memory_channel[ReplySlot](REPLY_QUEUE)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.write_replies, slots_receive)
            nursery.start_soon(self.compute_messages, messages_receive, nursery)
            nursery.start_soon(self.receive_messages, messages_send, slots_send)

    async def _open_downstream(self, nursery: trio.Nursery) -> trio.MemorySendChannel[Forward]:
        address = self.settings.downstream
        assert address is not None
        self.downstream = await connect_stage(address, self.settings.connect_timeout)  # type: ignore[arg-type]
        self._downstream_io = SocketIO(self.downstream)
        forwards_send, forwards_receive = trio.open_memory_channel[Forward](max(1, self.settings.max_inflight))
        nursery.start_soon(self.forward_activations, forwards_receive)
        nursery.start_soon(self.relay_replies)
        self._forwards = forwards_send
        return forwards_send

    # -- tasks -------------------------------------------------------------------------------
    async def receive_messages(self, messages: trio.MemorySendChannel[tuple[StageMessage, ReplySlot | None, int]],
                               slots: trio.MemorySendChannel[ReplySlot]) -> None:
        reader = MessageReader(self._upstream_io, self.peer, self.settings.width)
        async with messages, slots:
            while True:
                message = await reader.next()
                if message is None:
                    return
                received_us = now_us()
                self.extensions.observe(message)
                if self.identity.index < 0:
                    self.identity.observe(message)
                self._check_message(message)
                self.stats.messages += 1
                slot = None
                if message.kind is not MessageKind.RETIRE_VERIFY_WINDOW:
                    if self.inflight == 0:  # idle lane: nothing ahead, the filler writes the reply
                        slot = self._direct = ReplySlot(direct=True)
                        self.inflight += 1
                    else:
                        slot = ReplySlot()
                        self.inflight += 1
                        await put(slots, slot)
                    if message.kind is MessageKind.PREFILL_EMBD:
                        self.stats.early_acks += 1
                        await self._reply(slot, StageReply.ack())
                if (self._compute_backlog == 0 and message.kind is not MessageKind.PREFILL_EMBD
                        and (self._forwards is not None or self.settings.downstream is None)):
                    # Idle-lane fast path: nothing is queued ahead, so handling it here keeps
                    # message order and saves the hop to the compute task (a run-loop pass).
                    # Early-ACKed chunks still go through it: receiving must run ahead of them.
                    await self._handle(message, slot, received_us, self._forwards)
                else:
                    self._compute_backlog += 1
                    await put(messages, (message, slot, received_us))

    def _check_message(self, message: StageMessage) -> None:
        state = message.state
        # Plain ints as the key: an IntEnum hashes through a Python-level __hash__.
        header = (int(message.kind), int(state.phase), int(state.flags))
        if header in _ACCEPTED_HEADERS:  # the per-token path
            return
        kind = MessageKind(message.kind)
        refused = _REFUSED_KINDS.get(kind)
        if refused is not None:
            raise UnsupportedKind(f"{kind.reference_name} refused: {refused}")
        if kind not in _CONTROL_KINDS and not state.matches_kind(kind):
            raise StateMismatch(
                f"binary stage state does not match message kind {kind.reference_name} "
                f"(phase {state.phase}, flags {state.flags:#x})"
            )
        if len(_ACCEPTED_HEADERS) < 256:  # bounded: a peer could vary the flag bits at will
            _ACCEPTED_HEADERS.add(header)

    async def write_replies(self, slots: trio.MemoryReceiveChannel[ReplySlot]) -> None:
        async with slots:
            while True:
                try:
                    slot = await take(slots)
                except trio.EndOfChannel:  # the receiver is done: no more replies
                    return
                if slot.reply is None:
                    await slot.wait_event().wait()
                ahead = self._direct
                if ahead is not None:  # an older direct reply is still being written
                    await ahead.wait_event().wait()
                assert slot.reply is not None
                await self._write_upstream(extensions.reply_bytes(slot.reply, slot.timings))
                self.inflight -= 1

    async def _write_upstream(self, frame: bytes) -> None:
        self._upstream_torn = True  # until the whole frame is out: a cancel may cut it
        await send_frame(self._upstream_io, frame, self.peer, downstream=False)
        self._upstream_torn = False

    async def _reply(self, slot: ReplySlot, reply: StageReply, timings: TimingsFrame | None = None) -> None:
        """Fill ``slot`` (``timings``: its Timings frame, negotiated lanes only); a direct slot's
        reply is written here and now."""
        slot.reply = reply
        slot.timings = timings
        if slot.direct:
            await self._write_upstream(extensions.reply_bytes(reply, timings))
            self.inflight -= 1
            self._direct = None
        if slot.event is not None:
            slot.event.set()

    async def compute_messages(self, messages: trio.MemoryReceiveChannel[tuple[StageMessage, ReplySlot | None, int]],
                               nursery: trio.Nursery) -> None:
        forwards: trio.MemorySendChannel[Forward] | None = None
        try:
            async with messages:
                while True:
                    try:
                        message, slot, received_us = await take(messages)
                    except trio.EndOfChannel:  # upstream finished
                        return
                    if forwards is None and self.settings.downstream is not None:
                        forwards = await self._open_downstream(nursery)
                    await self._handle(message, slot, received_us, forwards)
                    self._compute_backlog -= 1
        finally:
            if forwards is not None:
                await forwards.aclose()

    def _session_key(self, message: StageMessage) -> int:
        # Sessions are namespaced by connection: a lane's disconnect releases only its own.
        key = (self.id << 64) | (message.session_id or 0)
        return key

    async def _handle(self, message: StageMessage, slot: ReplySlot | None, received_us: int,
                      forwards: trio.MemorySendChannel[Forward] | None) -> None:
        kind = message.kind if type(message.kind) is MessageKind else MessageKind(message.kind)
        key = self._session_key(message)
        executor = self.scheduler.executor

        def forward(expect: Expect | None, outgoing: StageMessage = message) -> Forward:
            return Forward(outgoing, expect, slot, key, received_us, trio.current_time())

        if kind is MessageKind.STOP:
            if forwards is not None:
                await self._forward(forwards, forward(Expect.STOP_ACK))
            else:
                await self._release(key)
                assert slot is not None
                await self._reply(slot, StageReply.ack(self._take_pending()))
            return
        if kind is MessageKind.RETIRE_VERIFY_WINDOW:
            if message.pos_start < 0 or message.token_count < 0:
                raise StageError(f"RetireVerifyWindow with negative position/count ({message.pos_start}, {message.token_count})")
            if forwards is not None:
                await self._forward(forwards, forward(None))
            return
        assert slot is not None
        if kind.is_prefix_cache_control:  # docs/prefix-cache.md §6; see skippy.stage.prefix_control
            self.sessions.add(key)
            outcome = await prefix_control.handle(self.scheduler, message, key, has_downstream=forwards is not None,
                                                  wire_dtype=self.settings.wire_dtype)
            self.stats.touch()
            result = outcome.result
            if result is not None:  # a TryRestorePrefillDecode hit on this stage
                self.stats.restore_decodes += 1
                self._note_recorded(result, message)
            if outcome.forward is None or forwards is None:
                stats = self._take_pending().merge(outcome.stats)
                if result is None:
                    await self._reply(slot, StageReply.ack(stats))
                else:  # the last stage: the fused decode's prediction
                    await self._reply_final(kind, message, slot, result, received_us, False, stats=stats)
            else:
                await self._forward(forwards, Forward(
                    outcome.forward, Expect.RELAY_ACK if result is None else Expect.RELAY_EITHER, slot, key,
                    received_us, trio.current_time(), result.compute_us if result else 0, 0,
                    result.batch_size if result else 0, on_reply=outcome.on_reply))
            return
        if kind is MessageKind.TRIM_SESSION:
            trimmed = await self.scheduler.call(lambda: executor.trim(key, message.token_count))
            self.stats.trimmed_tokens += trimmed
            await self._control_done(slot, forwards, forward)
            return
        if kind is MessageKind.CONFIGURE_GENERATION:
            params = sampling_params(message.sampling)
            self.sessions.add(key)
            await self.scheduler.call(lambda: executor.configure(key, params))
            cache_settings = prefix_control.prefix_settings(message.chat_sampling_metadata)
            if cache_settings is not None and executor.cache is not None:
                await self.scheduler.call(lambda: executor.configure_prefix(key, *cache_settings))
            await self._control_done(slot, forwards, forward)
            return
        await self._execute(kind, message, slot, key, received_us, forwards)

    async def _control_done(self, slot: ReplySlot, forwards: trio.MemorySendChannel[Forward] | None,
                            forward: object) -> None:
        if forwards is not None:
            await self._forward(forwards, forward(Expect.RELAY_ACK))  # type: ignore[operator]
        else:
            await self._reply(slot, StageReply.ack(self._take_pending()))

    async def _release(self, key: int) -> None:
        self.sessions.discard(key)
        executor = self.scheduler.executor
        if await self.scheduler.call(lambda: executor.release(key)):
            self.stats.sessions_released += 1
            self.stats.touch()

    def _take_pending(self) -> ReplyStats:
        stats, self._pending_stats = self._pending_stats, EMPTY_REPLY_STATS
        return stats

    def _work_item(self, kind: MessageKind, message: StageMessage, key: int) -> WorkItem:
        count = message.token_count
        if count <= 0:
            raise StageError(f"{kind.reference_name} with token_count {count}: nothing to execute")
        # Decoded frames carry int32 / float32 arrays already: no conversion on the per-token path.
        tokens = message.tokens
        if tokens.dtype is not _INT32:  # builtin dtypes are singletons: identity is the cheap test
            tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.shape[0] == 0 and count == 1 and message.state.current_token >= 0:
            tokens = np.asarray([message.state.current_token], dtype=np.int32)
        positions = message.positions
        if positions.shape[0] != count:
            if message.pos_start < 0:
                raise StageError(f"{kind.reference_name} with negative pos_start {message.pos_start}")
            positions = np.arange(message.pos_start, message.pos_start + count, dtype=np.int32)
        elif positions.dtype is not _INT32:
            positions = np.asarray(positions, dtype=np.int32)
        is_first = self.scheduler.executor.is_first
        activations = None
        if not is_first:
            activations = message.activation
            if activations is None:
                raise StageError(
                    f"{kind.reference_name} without an activation (source_stage_index "
                    f"{message.state.source_stage_index}) reached a stage that does not start at layer 0"
                )
            if activations.dtype is not _FLOAT32:
                activations = np.asarray(activations, dtype=np.float32)
            if activations.shape != (count, self.settings.width):
                raise StageError(
                    f"activation of shape {activations.shape} does not match token_count {count} x width {self.settings.width}"
                )
        elif tokens.shape[0] != count:
            raise StageError(f"{kind.reference_name}: {tokens.shape[0]} token ids for token_count {count}")
        prefill = kind.is_prefill
        return WorkItem(
            key, positions, tokens if is_first else None, activations, message.authoritative_session_position,
            _OUTPUTS.get(kind, Outputs.LAST),
            None if message.sampling is None else sampling_params(message.sampling),
            tokens if prefill and tokens.shape[0] == count else None,
            prefill, kind is MessageKind.PREFILL_FINAL_EMBD,
        )

    async def _execute(self, kind: MessageKind, message: StageMessage, slot: ReplySlot, key: int,
                       received_us: int, forwards: trio.MemorySendChannel[Forward] | None) -> None:
        item = self._work_item(kind, message, key)
        self.sessions.add(key)
        if kind.is_prefill:
            self.stats.prefill_chunks += 1
        elif kind is MessageKind.VERIFY_WINDOW:
            self.stats.verify_windows += 1
        else:
            self.stats.decode_items += 1
        if forwards is not None:
            if (not kind.is_prefill and self._forward_backlog == 0 and not self.settings.wire.active
                    and self._downstream_io is not None and self._downstream_io.is_socket):
                await self._forward_through(kind, message, item, slot, key, received_us)
                return
        elif slot is self._direct and kind in _WRITE_THROUGH_FINAL_KINDS and self._upstream_io.is_socket:
            await self._reply_through(kind, item, slot)
            return
        result, queue_us = await self.scheduler.execute(item)
        self._note_recorded(result, message)
        early_acked = kind is MessageKind.PREFILL_EMBD
        if forwards is None:
            await self._reply_final(kind, message, slot, result, received_us, early_acked, queue_us)
            return
        if result.activations is None:
            raise StageError("stage has a downstream but produced no activation")
        outgoing = self._outgoing(message, result.activations)
        if early_acked:
            expect = Expect.ABSORB_ACK
        elif kind.requires_predicted_reply:
            expect = Expect.RELAY_PREDICTION
        else:
            expect = Expect.RELAY_ACK
        await self._forward(forwards, Forward(outgoing, expect, slot, key, received_us, trio.current_time(),
                                     result.compute_us, queue_us, result.batch_size))

    def _outgoing(self, message: StageMessage, activations: np.ndarray) -> StageMessage:
        """The message to forward: this stage's activation, the source index advanced, flagged."""
        # Built field by field: two dataclasses.replace calls per message cost more (fields() walk).
        state = message.state
        return StageMessage(
            kind=message.kind, pos_start=message.pos_start, token_count=message.token_count,
            state=StateHeader(
                version=state.version, seq_id=state.seq_id, phase=state.phase,
                flags=state.flags | SKIPPY_EXTENSIONS_FLAG, checkpoint_generation=state.checkpoint_generation,
                prompt_token_count=state.prompt_token_count, decode_step=state.decode_step,
                current_token=state.current_token, source_stage_index=state.source_stage_index + 1,
                reserved=int(self.settings.wire_dtype)),
            request_id=message.request_id, session_id=message.session_id, sampling=message.sampling,
            chat_sampling_metadata=None, tokens=message.tokens, positions=message.positions,
            activation=activations, raw_bytes=message.raw_bytes,
        )

    async def _forward_through(self, kind: MessageKind, message: StageMessage, item: WorkItem,
                               slot: ReplySlot | None, key: int, received_us: int) -> None:
        """Execute ``item`` and have the runtime thread write its frame downstream
        (:mod:`skippy.stage.write_through`; the caller checked that nothing else is queued)."""
        expect = Expect.RELAY_PREDICTION if kind.requires_predicted_reply else Expect.RELAY_ACK
        forward = Forward(message, expect, slot, key, received_us, trio.current_time())
        width, wire_dtype = self.settings.width, self.settings.wire_dtype

        def build(result: WorkResult, queue_us: int) -> bytes:  # runtime thread
            if result.activations is None:
                raise StageError("stage has a downstream but produced no activation")
            forward.compute_us, forward.queue_us, forward.batch_size = result.compute_us, queue_us, result.batch_size
            outgoing = forward.message = self._outgoing(message, result.activations)
            frame = codec.encode_message(outgoing, wire_dtype, width)
            forward.frame_bytes = len(frame)
            return frame

        def sent(sent_us: int, write_us: int) -> None:  # runtime thread
            forward.sent_us, forward.write_us = sent_us, write_us

        assert self._downstream_io is not None
        through = item.emit = WriteThrough(self._gate, self._downstream_io, build, sent)
        self._forward_backlog = 1  # this lane's downstream writer until the frame is out
        self._expected.append(forward)  # before the frame can leave: its reply must find it
        await self.scheduler.execute(item)
        forward.write_us += await through.finish(self.downstream_name, downstream=True)
        self._forward_backlog = 0
        self.stats.forward_write_us += forward.write_us
        self.stats.write_throughs += 1

    async def _reply_through(self, kind: MessageKind, item: WorkItem, slot: ReplySlot) -> None:
        """Execute ``item`` on the final stage and have the runtime thread write its
        PredictedToken upstream (the lane's direct slot: no other reply may be written first)."""
        stats = self._take_pending()
        extensions_on = self.extensions.enabled

        def build(result: WorkResult, queue_us: int) -> bytes:  # runtime thread
            if not result.tokens:
                raise StageError(f"{kind.reference_name} produced no prediction")
            timings = None
            if extensions_on:  # docs/protocol.md §4: the producing stage starts the frame
                timings = TimingsFrame((extensions.own_record(
                    self.identity, batch_size=result.batch_size, compute_us=result.compute_us, queue_us=queue_us),))
            slot.reply, slot.timings = StageReply.predicted_token(result.tokens[-1], stats=stats), timings
            return extensions.reply_bytes(slot.reply, timings)

        through = item.emit = WriteThrough(self._gate, self._upstream_io, build)
        self._upstream_torn = True  # until the whole reply is out: a cancel may cut it
        await self.scheduler.execute(item)
        await through.finish(self.peer, downstream=False)
        self._upstream_torn = False
        self.stats.write_throughs += 1
        self.inflight -= 1
        self._direct = None
        if slot.event is not None:
            slot.event.set()

    def _note_recorded(self, result: WorkResult, message: StageMessage) -> None:
        if result.recorded_tokens:  # the prefix cache recorded this prompt: say so upstream
            page_size = self.scheduler.executor.cache.page_size if self.scheduler.executor.cache else 1
            index = min(max(0, message.state.source_stage_index + 1), 62)
            self._pending_stats = self._pending_stats.merge(ReplyStats(
                kv_recorded_pages=result.recorded_tokens // page_size,
                kv_recorded_bytes=result.recorded_tokens * self.scheduler.executor.kv_bytes_per_cell,
                kv_record_stage_mask=1 << index))

    async def _reply_final(self, kind: MessageKind, message: StageMessage, slot: ReplySlot, result: WorkResult,
                           received_us: int, early_acked: bool, queue_us: int = 0,
                           stats: ReplyStats | None = None) -> None:
        if early_acked:
            return
        stats = self._take_pending() if stats is None else stats
        if not (kind.requires_predicted_reply or kind is MessageKind.TRY_RESTORE_PREFILL_DECODE):
            await self._reply(slot, StageReply.ack(stats))
            return
        if kind is MessageKind.VERIFY_WINDOW:  # the reference's verify-window stats
            stats = timing_stats(stats, compute_us=result.compute_us, write_us=0, wait_us=0,
                                 total_us=now_us() - received_us, batch_size=result.batch_size)
        timings = None
        if self.extensions.enabled:  # docs/protocol.md §4: the producing stage starts the frame
            timings = TimingsFrame((extensions.own_record(
                self.identity, batch_size=result.batch_size, compute_us=result.compute_us, queue_us=queue_us),))
        if kind is MessageKind.VERIFY_WINDOW:
            stats = dataclasses.replace(
                stats, verify_window_request_count=stats.verify_window_request_count + 1,
                verify_window_token_count=stats.verify_window_token_count + len(result.tokens),
                verify_window_max_tokens=max(stats.verify_window_max_tokens, len(result.tokens)),
            )
            await self._reply(slot, StageReply.predicted_token_vector(
                tuple(result.tokens), window_id=message.state.seq_id, stats=stats), timings)
            return
        if not result.tokens:
            raise StageError(f"{kind.reference_name} produced no prediction")
        await self._reply(slot, StageReply.predicted_token(result.tokens[-1], stats=stats), timings)

    async def _forward(self, forwards: trio.MemorySendChannel[Forward], item: Forward) -> None:
        """Send ``item`` downstream: written here when the forwarder is idle, else queued to it.

        Writing here saves the hop to the forwarder task (a run-loop pass per message).  It keeps
        frame order and a single writer: only the one task handling messages (the compute task,
        or the receiver on its idle-lane fast path; never both, see ``_compute_backlog``) calls
        this, so with nothing queued to the forwarder no other write can start before this one
        ends.  Early-ACKed chunks (they take a reply credit) and simulated wires always queue.
        """
        if self._forward_backlog == 0 and item.expect is not Expect.ABSORB_ACK and not self.settings.wire.active:
            self._forward_backlog = 1
            try:
                await self._write_forward(item)
            finally:
                self._forward_backlog = 0
            return
        self._forward_backlog += 1
        await put(forwards, item)

    async def forward_activations(self, forwards: trio.MemoryReceiveChannel[Forward]) -> None:
        limit = self.settings.credit_limit
        try:
            async with forwards:
                while True:
                    try:
                        item = await take(forwards)
                    except trio.EndOfChannel:  # compute finished
                        return
                    if item.expect is Expect.ABSORB_ACK:
                        if self._credits.value == 0:
                            self.stats.credit_waits += 1
                        await self._credits.acquire()
                        pending = limit - self._credits.value
                        if pending > self.stats.max_pending_prefill_acks:
                            self.stats.max_pending_prefill_acks = pending
                            self.stats.touch()
                    await self._write_forward(item)
                    self._forward_backlog -= 1
        finally:
            self._forwarding_done = True
            if not self._expected and self._relay_idle:
                self._relay_scope.cancel()  # the relay waits for a reply nobody will send

    async def _write_forward(self, item: Forward) -> None:
        """Encode ``item``'s frame in the wire dtype, note its expected reply, write it downstream."""
        io = self._downstream_io
        assert io is not None
        message = item.message
        if not message.state.flags & SKIPPY_EXTENSIONS_FLAG:  # §2: always flag downstream
            message = item.message = with_extensions_flag(message)
        frame = codec.encode_message(message, self.settings.wire_dtype, self.settings.width)
        item.frame_bytes = len(frame)
        if item.expect is not None:
            self._expected.append(item)
        item.sent_us = started = now_us()
        wire = self.settings.wire
        if wire.active:
            await wire.write(io, frame, self.downstream_name, item.enqueued_at)
        else:
            await send_frame(io, frame, self.downstream_name, downstream=True)
        item.write_us = now_us() - started
        self.stats.forward_write_us += item.write_us

    async def relay_replies(self) -> None:
        io = self._downstream_io
        assert io is not None
        with self._relay_scope:  # cancelled only while parked with nothing expected: then it ends
            await self._relay(ReplyReader(io, self.downstream_name))

    async def _relay(self, reader: ReplyReader) -> None:
        expected = self._expected
        while True:
            if expected:
                reply, timings = await reader.next()
            else:
                if self._forwarding_done:
                    return
                self._relay_idle = True
                try:
                    reply, timings = await reader.next()
                finally:
                    self._relay_idle = False
                if not expected:
                    raise DownstreamLost(
                        f"downstream stage {self.downstream_name} sent {ReplyKind(reply.kind).reference_name} "
                        "with no frame outstanding"
                    )
            item = expected.popleft()
            wait_us = max(0, now_us() - item.sent_us - item.write_us)
            self.stats.downstream_wait_us += wait_us
            expect = item.expect
            if expect is Expect.RELAY_PREDICTION:
                if reply.kind not in (ReplyKind.PREDICTED_TOKEN, ReplyKind.PREDICTED_TOKENS):
                    raise DownstreamLost(
                        f"downstream stage {self.downstream_name} answered {ReplyKind(reply.kind).reference_name} "
                        f"to {MessageKind(item.message.kind).reference_name}; expected a prediction"
                    )
            elif reply.kind != ReplyKind.ACK and not (
                    expect is Expect.RELAY_EITHER and reply.kind == ReplyKind.PREDICTED_TOKEN):
                raise DownstreamLost(
                    f"downstream stage {self.downstream_name} answered {ReplyKind(reply.kind).reference_name} "
                    f"to {MessageKind(item.message.kind).reference_name}; expected downstream ACK"
                )
            if expect is Expect.ABSORB_ACK:
                self._pending_stats = self._pending_stats.merge(reply.stats).observe_prefill_edge_transport(
                    item.message.state.source_stage_index, item.write_us, wait_us, item.frame_bytes
                )
                self._credits.release()
                continue
            assert item.slot is not None
            stats = merge_stats(self._take_pending(), reply.stats)
            if item.on_reply is not None:
                stats = await item.on_reply(stats)
            if expect is Expect.STOP_ACK:
                await self._release(item.session)
            if expect is Expect.RELAY_PREDICTION or reply.kind == ReplyKind.PREDICTED_TOKEN:
                if item.message.kind == MessageKind.VERIFY_WINDOW:  # the reference's verify-window stats
                    stats = timing_stats(stats, compute_us=item.compute_us, write_us=item.write_us,
                                         wait_us=wait_us, total_us=now_us() - item.received_us,
                                         batch_size=item.batch_size)
                if self.extensions.enabled:  # docs/protocol.md §4: append this stage's record
                    timings = append_timing(timings, extensions.own_record(
                        self.identity, batch_size=item.batch_size, compute_us=item.compute_us,
                        write_us=item.write_us, wait_us=wait_us, queue_us=item.queue_us))
                else:
                    timings = None
                if stats is not reply.stats:  # the hot path merges nothing: keep the decoded reply
                    reply = dataclasses.replace(reply, stats=stats)
                await self._reply(item.slot, reply, timings)
            else:
                await self._reply(item.slot, StageReply.ack(stats))


def _leaves(group: BaseExceptionGroup[Exception]) -> list[BaseException]:
    result: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            result += _leaves(exc)
        else:
            result.append(exc)
    return result


def _describe(exc: BaseException) -> str:
    if isinstance(exc, StageError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
