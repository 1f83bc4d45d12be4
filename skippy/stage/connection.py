"""One upstream connection (a lane): I/O only; the lane's state and rules are :mod:`skippy.lane`.

Strategy (the reference's ``handle_binary_connection``, restructured for trio): a
:class:`Connection` owns the lane's upstream stream, its tasks and a
:class:`~skippy.lane.protocol.StageLane` (all of the lane's state); it feeds the lane every event
and carries out the actions it returns.  Every message takes the same steps:

1. **receive** (``receive_messages``): read and decode a frame, ``received`` → a
   :class:`~skippy.lane.protocol.Dispatch` (or a typed refusal, which closes the lane); an early
   ACK is replied at once.  Reading pauses while ``REPLY_QUEUE`` replies wait to be written.
2. **handle** (``_handle``): the stage's own part by the rule's handling (the scheduler executes;
   control kinds are plain functions of :mod:`skippy.stage.control`), then ``computed`` →
   forward downstream, reply upstream, or nothing.
3. **forward** and 4. **relay**: the downstream half (:mod:`skippy.stage.downstream`) writes
   frames in order with their reply credits and reads the downstream's replies; a reply is
   answered upstream with this stage's share (:func:`skippy.lane.replies.relayed`).
5. **reply**: ``reply_ready`` hands back the replies now due, in message order; the task that got
   them writes them and reports ``replies_written`` (one writer on the upstream stream at a time).

Who performs a step (the receiving task, the compute or forward task, the runtime thread through
:mod:`skippy.stage.write_through`, the data plane of :mod:`skippy.stage.decode_relay`) is
:func:`skippy.lane.placement.placement`'s choice alone, from the facts ``_facts`` gathers; every
reply's bytes come from :mod:`skippy.lane.replies`, whoever writes them.

Any failure cancels the lane's other tasks; the lane is closed with one log line naming the
reason (``extensions.closing_error``), its sessions are released, its return lanes closed, and
its downstream lane closed, which cascades the close down the chain; the stage carries on.  A
lane whose upstream negotiated the extensions (``docs/protocol.md`` §2-§4) ends with an Error
frame; its predicted replies carry Timings frames.  Direct return (§8,
:mod:`skippy.stage.direct_return`): a lane opened by a flagged PredictionReturnOpen becomes a
session's return lane; a flagged predicted kind is forwarded expecting nothing back, and the final
stage writes its prediction into the return lane (``_reply_direct``).  Decode runs (§11): the
first stage drives the loop; each predicted step queues the next (``_run_step``).
"""

from __future__ import annotations

import functools
import itertools
import logging
from time import perf_counter_ns

import trio

from skippy.codec.protocol import EMPTY_REPLY_STATS, MessageKind, ReplyStats, StageReply
from skippy.codec.protocol_ext import (
    DECODE_RUN_FLAG, Annotation, ErrorCode, ErrorFrame, ExtensionNegotiation, TimingsFrame,
)
from skippy.lane import messages as lane_messages
from skippy.lane import replies
from skippy.lane.errors import ReturnLaneLost, StageError, UnsupportedKind
from skippy.lane.placement import Facts, Performer, Step, placement
from skippy.lane.protocol import (
    Answer, Dispatch, Expect, Forward, Handling, Relay, ReplyUpstream, SendDownstream, StageLane, Ticket,
)
from skippy.lane.stats import merge_stats
from skippy.net.socket_io import SocketIO
from skippy.stage import control, direct_return, extensions
from skippy.stage.control import OWN_PARTS, OwnPart
from skippy.stage.decode_relay import HopReplies, RelayRun, carry, relay_plan
from skippy.stage.direct_return import ReturnHub, ReturnLane
from skippy.stage.downstream import DownstreamLink
from skippy.stage.executor import WorkItem, WorkResult, sampling_params
from skippy.stage.lane import LaneSettings, now_us, put, take
from skippy.stage.limits import BufferBudget, IdleLane, StageLimits
from skippy.stage.scheduler import Scheduler
from skippy.stage.stats import StageStats
from skippy.stage.transport import MessageReader, codec, send_frame
from skippy.stage.write_through import StreamGate, WriteThrough

log = logging.getLogger("skippy.stage")

__all__ = ["Connection", "LaneSettings"]

#: Messages buffered between receive and compute (small: this is the backpressure).
MESSAGE_QUEUE = 2
#: Replies that may wait for their turn before the lane reads no further message.
REPLY_QUEUE = 16

_connection_ids = itertools.count(1)

class Connection:
    """Serves one upstream lane until it closes or fails.

    Args:
        upstream: the accepted stream (READY already sent; a TLS stream on a TLS link).
        peer: the upstream address, for logs.
        settings: the stage's lane settings.
        scheduler: the stage's scheduler.
        stats: the stage's counters.
        returns: the stage's return lanes (docs/protocol.md §8; None: direct return is refused).
        budget: the stage's buffer budget (:mod:`skippy.stage.limits`; None: unlimited).
    """

    def __init__(self, upstream: trio.abc.Stream, peer: str, settings: LaneSettings,
                 scheduler: Scheduler, stats: StageStats, returns: ReturnHub | None = None,
                 budget: BufferBudget | None = None) -> None:
        self.id = next(_connection_ids)
        self.upstream = upstream
        self.peer = peer
        self.settings = settings
        self.scheduler = scheduler
        self.stats = stats
        #: All of the lane's state and rules (sans-IO): :mod:`skippy.lane`.
        self.lane = StageLane(self.id, settings.credit_limit, REPLY_QUEUE, session_quota=settings.session_quota,
                              peer=peer)
        #: The downstream half: its stream and its forward and relay tasks (:mod:`skippy.stage.downstream`).
        self.link = DownstreamLink(self.lane, settings, stats, self._relay_reply, self._direct_left)
        self.identity = extensions.identity_for(scheduler.executor)
        #: What the control kinds' own parts work on (:mod:`skippy.stage.control`).
        self._stage = control.StageParts(scheduler, settings, stats, self.lane)
        self._upstream_io = SocketIO(upstream)
        #: Facts of the lane's streams for placement(), fixed for its life: a plain socket
        #: upstream, a simulated wire downstream (benchmarks).
        self._upstream_socket = self._upstream_io.is_socket
        self._wire_delay = settings.wire.active
        #: Set (and dropped) when replies are written while the receiver is paused for them.
        self._replies_written: trio.Event | None = None
        #: An upstream write was interrupted mid-frame: no Error frame may follow it.
        self._upstream_torn = False
        #: The write-through answering upstream, from its submission until its reply is out.
        self._upstream_through: WriteThrough | None = None
        #: What this lane's write-throughs write under (closed before the lane's streams are).
        self._gate = StreamGate()
        self.returns = returns
        #: docs/protocol.md §8: this lane is a session's return lane (set by its open).
        self._return_lane: ReturnLane | None = None
        #: :mod:`skippy.stage.limits`: the stage's buffer budget, the bytes this lane holds of it
        #: (frames received and not yet handled), the upstream reader (its frame timings), and
        #: the limit the watchdog found passed (the lane closes with it).
        self.budget = budget
        self._held = 0
        self._reader: MessageReader | None = None
        self._aborted: StageError | None = None
        self._serve_scope: trio.CancelScope | None = None
        self._last_reply = trio.current_time()
        #: docs/protocol.md §11: the channel handle that wakes the compute task for a run's step.
        self._wake_compute: trio.MemorySendChannel[tuple[Dispatch, int, int] | None] | None = None
        #: The decode relay's run reading the upstream now (:mod:`skippy.stage.decode_relay`).
        self._relay_run: RelayRun | None = None
        #: Hop by hop: the last plain decode's reply as relayed upstream (the relay's templates).
        self._hop_replies = HopReplies()

    @property
    def inflight(self) -> int:
        """Messages received whose reply has not been written yet (0: the lane is idle)."""
        return self.lane.inflight

    @property
    def extensions(self) -> ExtensionNegotiation:
        return self.lane.extensions

    def has_session(self, session_id: int) -> bool:
        """Whether ``session_id`` is open on this lane (the return hub's owner lookup)."""
        return self.lane.has_session(session_id)

    def _facts(self, *, early_ack: bool = False, credited: bool = False, direct: bool = False,
               before_compute: bool = False, reply_next: bool = False, template: bool = False,
               downstream_socket: bool | None = None, quiet: bool = True) -> Facts:
        """What :func:`~skippy.lane.placement.placement` decides from, now (the message's part given)."""
        settings, lane = self.settings, self.lane
        if downstream_socket is None:
            downstream_socket = self.link.socket
        return Facts(settings.inline_hand_offs, settings.write_through, settings.decode_relay,
                     self._upstream_socket, downstream_socket, self._wire_delay, settings.reply_delay_s > 0,
                     settings.downstream is None or self.link.channel is not None, lane.compute_backlog == 0,
                     lane.forward_backlog == 0, quiet, early_ack, credited, direct, before_compute, reply_next,
                     template)

    # -- lifetime ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the lane; never raises except Cancelled (failures are logged and counted)."""
        self.scheduler.lanes.opened(self.id)
        self.stats.connections_open += 1
        self.stats.connections_total += 1
        self.stats.touch()
        error: ErrorFrame | None = None
        try:
            await self._serve()
            if self._aborted is not None:  # the watchdog cancelled the lane: say why
                raise self._aborted
        except* trio.Cancelled:  # only the server cancels a lane: it is draining (SIGTERM)
            error = extensions.shutting_down_frame(self.identity.index, self._own_address())
            raise
        except* Exception as group:  # any failure closes this lane only; it is logged and reported
            # a lane the watchdog aborted fails wherever its tasks were: the limit it passed is the reason
            leaves = [self._aborted] if self._aborted is not None else extensions.leaves(group)
            self.stats.connection_errors += 1
            idle = all(isinstance(exc, IdleLane) for exc in leaves)
            error = extensions.closing_error(leaves, log, self.id, self.peer, idle=idle,
                                             identity_aware=self.lane.identity_aware, index=self.identity.index,
                                             address=self._own_address(), downstream_address=self.link.name)
            self.stats.errors_by_code[ErrorCode(error.code).name.lower()] += 1
        finally:
            self._gate.close()  # a write-through still queued must not write from here on
            # A write-through that started may have written part of its reply (its emit runs
            # only once the compute is done: a refusal before that has written nothing).
            with trio.CancelScope(shield=True):
                if self.returns is not None and await direct_return.close_lanes(self.returns, self._return_lane,
                                                                                self.id, error):
                    self._upstream_torn = True
                through = self._upstream_through
                torn = self._upstream_torn or (through is not None and through.ran)
                if error is not None and self.extensions.enabled and not torn:
                    await extensions.send_error(self._upstream_io, error, self.id)
                await self._cleanup()

    async def _answer_identity(self) -> None:
        """docs/protocol.md §9: the lane's first message was an identity query: answer the
        Identity frame (when this stage has one) and close the lane."""
        identity = self.settings.identity
        if identity is not None:
            await send_frame(self._upstream_io, codec.encode_identity(identity), self.peer,  # type: ignore[arg-type]
                             downstream=False)

    @property
    def upstream_io(self) -> SocketIO:
        """The upstream lane's socket I/O (its byte counts feed the stage's metrics)."""
        return self._upstream_io

    @property
    def downstream_io(self) -> SocketIO | None:
        """The downstream lane's socket I/O, once connected."""
        return self.link.io

    def _own_address(self) -> str:
        try:
            host, port = getattr(self.upstream, "transport_stream", self.upstream).socket.getsockname()[:2]
        except (OSError, AttributeError):  # closed, or not a socket stream
            return ""
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def _cleanup(self) -> None:
        if self.budget is not None:
            reader = self._reader
            self.budget.release(self._held + (reader.take_reserved() if reader is not None else 0))
            self._held = 0
        orphans = await control.release_orphans(self._stage, self.id)
        for stream in (self.link.stream, self.upstream):
            if stream is not None:
                with trio.move_on_after(1):
                    await trio.aclose_forcefully(stream)
        self.scheduler.lanes.resting(self.id)
        self.stats.connections_open -= 1
        if self._return_lane is not None:
            self.stats.return_lanes_open -= 1
        self.stats.touch()
        log.debug("lane %d from %s closed (%d orphan sessions released)", self.id, self.peer, orphans)

    async def _serve(self) -> None:
        messages_send, messages_receive = trio.open_memory_channel[tuple[Dispatch, int, int] | None](MESSAGE_QUEUE)
        self._wake_compute = messages_send.clone()  # closed with the receiving side (receive_messages)
        async with trio.open_nursery() as nursery:
            self._serve_scope = nursery.cancel_scope
            nursery.start_soon(self.compute_messages, messages_receive, nursery)
            nursery.start_soon(self.receive_messages, messages_send)

    # -- limits (skippy.stage.limits) ----------------------------------------------------------
    def overdue(self, now: float, limits: StageLimits) -> Exception | None:
        """The read or idle timeout this lane has passed (the server's watchdog asks), or None."""
        reader = self._reader
        if reader is None or self._return_lane is not None:  # a return lane only waits for writes into it
            return None
        decoder = reader.decoder
        protocol = self.lane
        busy = protocol.inflight or protocol.expecting or self.lane.compute_backlog
        idle = None if busy else max(reader.last_frame, self._last_reply)
        if self._relay_run is not None:  # the relay reads the upstream: its last frame counts
            idle = max(idle or 0.0, self._relay_run.idle_since())
        return limits.overdue(now, frame_started=reader.frame_started,
                              buffered=decoder.buffered_bytes,  # type: ignore[attr-defined]
                              needed=decoder.bytes_needed, idle_since=idle)  # type: ignore[attr-defined]

    def abort(self, error: StageError) -> None:
        """Close the lane for ``error`` (a limit passed): its tasks are cancelled, it is reported."""
        if self._aborted is None and self._serve_scope is not None:
            self._aborted = error
            self._serve_scope.cancel()

    def _release_held(self, held: int) -> None:
        if held:
            self._held -= held
            self.budget.release(held)  # type: ignore[union-attr]

    # -- step 1: receive ---------------------------------------------------------------------
    async def receive_messages(self, messages: trio.MemorySendChannel[tuple[Dispatch, int, int] | None]) -> None:
        settings = self.settings
        reader = self._reader = MessageReader(self._upstream_io, self.peer, settings.width,
                                              max_frame_bytes=settings.max_frame_bytes or None, budget=self.budget)
        try:
            async with messages:
                await self._receive_loop(reader, messages)
        finally:
            self.lane.end_runs()  # §11: a run ends with its upstream (no step starts after)
            if self._wake_compute is not None:  # §11: the decode runs' wake-ups end with the upstream
                self._wake_compute.close()

    async def _receive_loop(self, reader: MessageReader,
                            messages: trio.MemorySendChannel[tuple[Dispatch, int, int] | None]) -> None:
        protocol = self.lane
        while True:
            while protocol.receiving_paused:  # the backpressure of an upstream not reading replies
                self._replies_written = trio.Event()
                await self._replies_written.wait()
            message = await reader.next()
            if message is None:
                return
            received_us = perf_counter_ns() // 1000  # now_us(), inline on the decode walk
            held = reader.take_reserved() if reader.reserved else 0
            self._held += held
            if self.identity.index < 0:
                self.identity.observe(message)
            dispatch, run = protocol.received(message, run_flagged=bool(message.state.flags & DECODE_RUN_FLAG),
                                              is_first=self.scheduler.executor.is_first)
            if dispatch is None:  # docs/protocol.md §9: an identity query, answered; the lane ends
                await self._answer_identity()
                return
            self.stats.messages += 1
            if run is not None:
                self.stats.decode_runs += 1
            if dispatch.early_ack:
                assert dispatch.ticket is not None
                self.stats.early_acks += 1
                await self._reply(dispatch.ticket, StageReply.ack())
            facts = self._facts(early_ack=dispatch.early_ack)
            if placement(Step.HANDLE, dispatch.rule, facts) is Performer.RECEIVING_TASK:
                try:
                    await self._handle(dispatch, received_us)  # shortcut: the compute task is idle
                finally:
                    self._release_held(held)
                if protocol.relay_frame is not None:  # shortcut 3: the next decodes may leave Python
                    await self._relay_decode(reader, dispatch)
            else:
                self.lane.compute_backlog += 1
                await put(messages, (dispatch, received_us, held))

    async def _relay_decode(self, reader: MessageReader, dispatch: Dispatch) -> None:
        """Shortcut 3 (:mod:`skippy.stage.decode_relay`): ``dispatch`` was a decode, forwarded by
        write-through (or, on the final stage, answered upstream or into its return lane); once
        answered (hop by hop), while this lane is the stage's only work, relay the ones that
        follow it outside Python.  Whatever the relay does not carry is left in ``reader``."""
        state = self.lane
        frame, lane = state.take_template()
        assert lane is None or isinstance(lane, ReturnLane)
        upstream, settings = self._upstream_io, self.settings
        executor = self.scheduler.executor
        hop = not dispatch.direct
        final = hop and executor.is_last
        downstream = lane.io if lane is not None else upstream if final else self.link.io
        replies = None
        if (hop and not final and frame is not None and upstream.is_socket
                and not reader.decoder.buffered_bytes):  # type: ignore[attr-defined]  # once its reply is written
            replies = await self._hop_replies.wait(dispatch.ticket, upstream.fileno())
            frame = frame if replies is not None else None
        free = downstream is not None and downstream.is_socket and (
            lane is None or not (lane.closed or lane.lock.locked()))
        facts = self._facts(template=frame is not None, downstream_socket=free,
                            quiet=state.quiet and not reader.decoder.buffered_bytes)  # type: ignore[attr-defined]
        if placement(Step.CARRY_NEXT, None, facts) is not Performer.DATA_PLANE:
            return
        assert frame is not None and downstream is not None
        plan = relay_plan(dispatch.message, frame, executor=executor, session_key=dispatch.key,
                          width=settings.width, out_dtype=settings.wire_dtype, position_end=settings.max_rows,
                          replies=replies)
        if plan is None:
            return
        run = RelayRun(plan, executor=executor, scheduler=self.scheduler, stats=self.stats, upstream=upstream,
                       downstream=downstream, reader=reader,
                       downstream_name=self.peer if final else self.link.name if lane is None else lane.peer,
                       width=settings.width, position_end=settings.max_rows, lane=state, link=self.link,
                       upstream_name=self.peer)
        await carry(run, scheduler=self.scheduler, lane_id=self.id, session_key=dispatch.key, return_lane=lane,
                    timings=self.lane.direct_timings, running=functools.partial(setattr, self, "_relay_run"))

    # -- decode runs (docs/protocol.md §11, skippy.lane.decode_run) ---------------------------
    def _run_step(self, ticket: Ticket, token: int) -> tuple[Annotation, ...]:
        """A decode run's step predicted ``token`` (its reply is about to be answered): the lane
        queues the next step, unless the run is over (the compute task is woken for it); returns
        the frames its reply carries (the first reply says the stage runs it)."""
        first, step = self.lane.run_predicted(ticket, token, now_us())
        if step is not None:
            self.stats.decode_run_steps += 1
            wake = self._wake_compute
            if wake is not None:
                try:
                    wake.send_nowait(None)
                except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                    pass  # busy (it takes run_steps first when it comes back), or the lane is ending
        return replies.RUN_ACCEPTED if first else ()

    # -- step 5: reply -----------------------------------------------------------------------
    async def _reply(self, ticket: Ticket, reply: StageReply, timings: TimingsFrame | None = None,
                     annotations: tuple[Annotation, ...] = ()) -> None:
        """Answer ``ticket`` (``timings``: its Timings frame, ``annotations``: its §10 frames;
        negotiated lanes only), and write every reply that is now due if this task got the
        writer token."""
        await self._write_due(self.lane.reply_ready(ticket, reply, timings, annotations))

    async def _write_due(self, due: list[Ticket]) -> None:
        protocol = self.lane
        if due:
            self._last_reply = trio.current_time()
        while due:
            if len(due) == 1:
                frame = extensions.reply_bytes(due[0].reply, due[0].timings, due[0].annotations)  # type: ignore[arg-type]
            else:
                frame = b"".join(extensions.reply_bytes(t.reply, t.timings, t.annotations)  # type: ignore[arg-type]
                                 for t in due)
            if self.settings.reply_delay_s:  # the simulated wire, upstream direction (benchmarks)
                await trio.sleep(self.settings.reply_delay_s)
            self._upstream_torn = True  # until the whole frame is out: a cancel may cut it
            await send_frame(self._upstream_io, frame, self.peer, downstream=False)
            self._upstream_torn = False
            due = protocol.replies_written(len(due))
        if self._replies_written is not None:
            self._replies_written.set()
            self._replies_written = None

    # -- step 2: handle ----------------------------------------------------------------------
    async def compute_messages(self, messages: trio.MemoryReceiveChannel[tuple[Dispatch, int, int] | None],
                               nursery: trio.Nursery) -> None:
        run_steps = self.lane.run_steps
        try:
            async with messages:
                while True:
                    if run_steps:  # §11: a decode run's next step (made before anything queued behind it)
                        # one run-loop pass first: a step may run entirely on this thread (inline
                        # decode), and the receiving task must see a Stop that ends the run
                        await trio.lowlevel.checkpoint()
                        dispatch, received_us, held = run_steps.popleft()
                    else:
                        try:
                            entry = await take(messages)
                        except trio.EndOfChannel:  # upstream finished
                            return
                        if entry is None:  # a decode run's wake-up: its step is in run_steps
                            continue
                        dispatch, received_us, held = entry
                    try:
                        if self.link.channel is None and self.settings.downstream is not None:
                            await self.link.connect(nursery)
                        await self._handle(dispatch, received_us)
                    finally:
                        self._release_held(held)
                    self.lane.compute_backlog -= 1
        finally:
            await self.link.close()

    async def _handle(self, dispatch: Dispatch, received_us: int) -> None:
        """The stage's own part of a message (by its rule's handling), then what ``computed`` says."""
        key = dispatch.key
        handling = dispatch.rule.handling
        if handling is Handling.EXECUTE:
            await self._execute(dispatch, key, received_us)
            return
        forward = Forward(dispatch.message, None, dispatch.ticket, key, received_us, 0.0)
        if handling is Handling.RETURN_OPEN:
            own = await self._return_open(dispatch)
        else:
            own = await OWN_PARTS[handling](self._stage, dispatch, key, forward, forwarding=self.link.channel is not None)
        action = self.lane.computed(dispatch, has_downstream=self.link.channel is not None,
                                        local_hit=own.result is not None, forwarded=own.forwarded)
        if type(action) is SendDownstream:
            forward.expect = action.expect
            forward.enqueued_at = trio.current_time()
            await self._forward(forward)
        elif type(action) is ReplyUpstream:
            assert dispatch.ticket is not None
            stats = self.lane.take_stats()
            if own.stats is not EMPTY_REPLY_STATS:
                stats = stats.merge(own.stats)
            if action.answer is Answer.ACK or own.result is None:
                annotations = own.annotations if self.extensions.enabled else ()
                await self._reply(dispatch.ticket, StageReply.ack(stats), None, annotations)
            else:  # the final stage's fused restore-decode: its prediction
                await self._reply_prediction(dispatch, action, own.result, received_us, 0, stats)

    async def _return_open(self, dispatch: Dispatch) -> OwnPart:
        """docs/protocol.md §8: this lane becomes the return lane of the session it names (the
        protocol checked that it is the lane's first message and flagged); ACKed, not forwarded."""
        message = dispatch.message
        if self.returns is None or self.settings.downstream is not None:
            raise UnsupportedKind("PredictionReturnOpen refused: direct return is served by the final stage only")
        lane = ReturnLane(self.upstream, self._upstream_io, self.peer, extensions=self.extensions.enabled,
                          session_id=message.session_id, request_id=message.request_id)
        self.returns.open(lane)
        self._return_lane = lane
        self.stats.return_lanes += 1
        self.stats.return_lanes_open += 1
        self.scheduler.lanes.resting(self.id)  # not a lane that brings work (the scheduler's policy)
        return OwnPart(forwarded=False)

    async def _execute(self, dispatch: Dispatch, key: int, received_us: int) -> None:
        kind, rule, message = dispatch.kind, dispatch.rule, dispatch.message
        item = lane_messages.work_item(dispatch, key, is_first=self.scheduler.executor.is_first,
                                       width=self.settings.width, max_rows=self.settings.max_rows,
                                       reads_tokens=self.scheduler.executor.reads_tokens,
                                       sideband_flag=self.scheduler.executor.sideband_flag,
                                       sampling=sampling_params)
        if key not in self.lane.sessions:  # a new session (the lane's quota)
            self.lane.claim(key)
        if rule.prefill:
            self.stats.prefill_chunks += 1
            self.stats.prefill_tokens += message.token_count
        elif rule.window:
            self.stats.verify_windows += 1
        else:
            self.stats.decode_items += 1
        # An executable kind's next step does not depend on its result: known before it runs.
        action = self.lane.computed(dispatch, has_downstream=self.link.channel is not None)
        if type(action) is SendDownstream:
            facts = self._facts(before_compute=True, credited=action.expect is Expect.ABSORB_ACK)
            if placement(Step.WRITE_DOWN, rule, facts) is Performer.RUNTIME_THREAD:
                forward = Forward(message, action.expect, dispatch.ticket, key, received_us, trio.current_time(),
                                  direct=dispatch.direct)
                await self.link.write_through(self._gate, self.scheduler, forward, item)
                return
            result, queue_us = await self.scheduler.execute(item)
            control.note_recorded(self._stage, result, message)
            outgoing = lane_messages.forwarded(message, result, self.settings.wire_dtype,
                                               self.scheduler.executor.output_flag)
            await self._forward(Forward(outgoing, action.expect, dispatch.ticket, key, received_us, trio.current_time(),
                                        result.compute_us, queue_us, result.batch_size, direct=dispatch.direct))
            return
        ticket = dispatch.ticket
        if (type(action) is ReplyUpstream and placement(Step.WRITE_UP, rule, self._facts(
                before_compute=True, direct=dispatch.direct, reply_next=self.lane.reply_next(ticket)))
                is Performer.RUNTIME_THREAD):
            assert ticket is not None and self.lane.claim_reply_write(ticket)
            await self._reply_through(dispatch, item, ticket)
            return
        result, queue_us = await self.scheduler.execute(item)
        control.note_recorded(self._stage, result, message)
        if type(action) is ReplyUpstream:
            if action.direct:
                await self._reply_direct(dispatch, action, result, received_us, queue_us)
                return
            assert ticket is not None
            if action.answer is Answer.ACK:
                await self._reply(ticket, StageReply.ack(self.lane.take_stats()))
            else:
                await self._reply_prediction(dispatch, action, result, received_us, queue_us,
                                             self.lane.take_stats())

    async def _reply_prediction(self, dispatch: Dispatch, action: ReplyUpstream, result: WorkResult,
                                received_us: int, queue_us: int, stats: ReplyStats) -> None:
        """The final stage's predicted reply (PredictedTokens for a verify window), with its
        Timings frame on a negotiated lane (docs/protocol.md §4: the producing stage starts it)."""
        assert dispatch.ticket is not None
        reply, timings, annotations = replies.prediction(
            dispatch, result, stats, identity=self.identity, queue_us=queue_us, negotiated=self.extensions.enabled,
            window=action.window, total_us=now_us() - received_us)
        if dispatch.ticket.run is not None:  # §11: the run's next step starts before this reply is out
            annotations += self._run_step(dispatch.ticket, reply.predicted)
        await self._reply(dispatch.ticket, reply, timings, annotations)

    async def _reply_direct(self, dispatch: Dispatch, action: ReplyUpstream, result: WorkResult,
                            received_us: int, queue_us: int) -> None:
        """docs/protocol.md §8: the final stage's prediction, written into the session's return
        lane (with its Timings frame when that lane negotiated the extensions)."""
        message = dispatch.message
        lane = None if self.returns is None else self.returns.get(self.id, message.session_id)
        if lane is None:
            raise ReturnLaneLost(f"{dispatch.kind.reference_name} of session {message.session_id} asks for direct "
                                 "return, but no return lane is open for it on this stage")
        reply, timings, annotations = replies.prediction(
            dispatch, result, self.lane.take_stats(), identity=self.identity, queue_us=queue_us,
            negotiated=lane.extensions, window=action.window, total_us=now_us() - received_us)
        await lane.send(extensions.reply_bytes(reply, timings, annotations), self.settings.reply_delay_s)
        self.stats.direct_replies += 1
        self.lane.direct_done()
        self._direct_left()
        if self.settings.decode_relay and not annotations and dispatch.kind is MessageKind.DECODE_EMBD:
            # shortcut 3 may answer the next ones: their reply as the lane would write it
            self.lane.relay_lane = lane
            self.lane.relay_frame = extensions.reply_bytes(
                *replies.prediction_template(self.identity, negotiated=lane.extensions))

    def _direct_left(self) -> None:
        """A direct-return message left this stage (the lane counted it): receiving may go on."""
        if self._replies_written is not None:
            self._replies_written.set()
            self._replies_written = None

    async def _reply_through(self, dispatch: Dispatch, item: WorkItem, ticket: Ticket) -> None:
        """Execute ``item`` on the final stage and have the runtime thread write its PredictedToken
        upstream (the caller holds the writer token for ``ticket``)."""
        stats = self.lane.take_stats()
        extensions_on = self.extensions.enabled

        def build(result: WorkResult, queue_us: int) -> bytes:  # runtime thread
            ticket.reply, ticket.timings, annotations = replies.prediction(
                dispatch, result, stats, identity=self.identity, queue_us=queue_us, negotiated=extensions_on)
            if annotations:
                ticket.annotations = annotations
            if run is not None and not run.announced:  # §11: the run's first reply says it runs
                ticket.annotations += replies.RUN_ACCEPTED
            return extensions.reply_bytes(ticket.reply, ticket.timings, ticket.annotations)

        run = ticket.run
        through = self._upstream_through = WriteThrough(self._gate, self._upstream_io, build)
        await self.scheduler.execute(item, through)
        if run is not None and ticket.reply is not None:  # §11: the run's next step
            self._run_step(ticket, ticket.reply.predicted)
        self._upstream_torn = True  # until the whole reply is out: a cancel may cut it
        await through.finish(self.peer, downstream=False)
        self._upstream_torn = False
        self._upstream_through = None
        self.stats.write_throughs += 1
        await self._write_due(self.lane.replies_written(1))
        if (self.settings.decode_relay and run is None and not ticket.annotations
                and dispatch.kind is MessageKind.DECODE_EMBD):  # shortcut 3 may answer the next ones
            self.lane.relay_frame = extensions.reply_bytes(
                *replies.prediction_template(self.identity, negotiated=extensions_on))

    # -- step 3: forward ---------------------------------------------------------------------
    async def _forward(self, item: Forward) -> None:
        """Send ``item`` downstream: queued to the forwarder, or (shortcut) written here when the
        forwarder is idle, the frame needs no credit and no simulated wire delays it.

        Writing here keeps frame order and a single writer: only the one task handling messages
        calls this, so with nothing queued to the forwarder no other write can start before this
        one ends.
        """
        if placement(Step.WRITE_DOWN, None, self._facts(credited=item.expect is Expect.ABSORB_ACK)) \
                is Performer.HANDLING_TASK:
            self.lane.forward_backlog = 1
            try:
                await self.link.write(item)
            finally:
                self.lane.forward_backlog = 0
            return
        await self.link.queue(item)

    async def _relay_reply(self, relay: Relay, reply: StageReply, timings: TimingsFrame | None, wait_us: int,
                           annotations: tuple[Annotation, ...] = ()) -> None:
        """Answer the forwarded message's ticket with the downstream's reply, this stage's share added
        (:func:`skippy.lane.replies.relayed`; a stopped session released first)."""
        item = relay.forward
        assert item.ticket is not None
        stats = merge_stats(self.lane.take_stats(), reply.stats)
        if item.on_reply is not None:
            stats = await item.on_reply(stats)
        if relay.release:
            await control.release(self._stage, item.session)
        received = reply, timings, annotations
        reply, timings, annotations = replies.relayed(self.lane, relay, reply, stats, timings, annotations,
                                                      identity=self.identity, wait_us=wait_us, now_us=now_us())
        if relay.prediction and item.ticket.run is not None:  # §11: the run's next step starts before the reply
            annotations += self._run_step(item.ticket, reply.predicted)
        hop = self.settings.decode_relay and item.ticket.run is None and item.ticket.kind is MessageKind.DECODE_EMBD
        if hop:  # shortcut 3 may answer the next ones: their replies as the lane writes them
            self._hop_replies.relayed(item.ticket, received, (reply, timings, annotations))
        await self._reply(item.ticket, reply, timings, annotations)
        if hop:
            self._hop_replies.written()
