"""A lane's upstream half (I/O only): the stream from the previous stage (or the driver), its
reader, and every write on it -- the reply writer, direct replies into return lanes, the close.

Strategy (steps 1 and 5 of :mod:`skippy.stage.connection`; the state and rules are the lane's,
:class:`~skippy.lane.protocol.StageLane`, every reply's bytes :mod:`skippy.lane.replies`'; a
heartbeat lane, §13, is answered by :meth:`UpstreamLink.answer_heartbeats`):
:meth:`UpstreamLink.compute_and_answer` executes a message due a reply here and answers it,
:meth:`UpstreamLink.reply` gives the lane a ticket's reply; ``reply_ready`` hands back the
replies now due, in message order, and the task that got them (the **writer token**) writes them
as one frame and reports ``replies_written`` until none is due: one writer on the upstream
stream at a time, whichever task finished first.  The runtime thread may write a final stage's
lone PredictedToken itself (:meth:`UpstreamLink.reply_through`, when placement() chose it and
the ticket is next in line: it holds the token).  A predicted reply carries its Timings frame on a
negotiated lane.  Direct return (``docs/protocol.md`` §8, :mod:`skippy.stage.direct_return`):
this lane may become a session's return lane (:meth:`UpstreamLink.return_open`), and a final
stage writes a flagged message's prediction into its session's return lane
(:meth:`UpstreamLink.reply_direct`).  Decode runs (§11): a run's predicted step queues the next
one before its reply is written (:meth:`UpstreamLink.run_step` wakes the compute task); on a
one-stage chain whose lane holds nothing but the run, the data plane drives its next steps
(:meth:`UpstreamLink.carry_run`: the runtime thread makes each step from its own pick and writes
its reply; a message from upstream stops it between steps, :attr:`UpstreamLink.run_carry`).

The lane closes with :meth:`UpstreamLink.close`: the return lanes first, then the Error frame,
never after a reply cut mid-frame (``torn``).
"""

from __future__ import annotations

from typing import Callable

import trio

from skippy.codec.protocol import EMPTY_REPLY_STATS, ReplyStats, StageMessage, StageReply
from skippy.codec.protocol_ext import Annotation, ErrorFrame, TimingsFrame
from skippy.lane import replies
from skippy.lane.errors import ReturnLaneLost, UnsupportedKind
from skippy.lane.placement import Facts, Performer, Step, placement
from skippy.lane.protocol import RULES, Answer, Dispatch, Relay, ReplyUpstream, Ticket
from skippy.lane.stats import merge_stats
from skippy.lane.work import WorkItem, WorkResult
from skippy.net.socket_io import SocketIO
from skippy.stage import control, direct_return, extensions, liveness
from skippy.stage.control import OwnPart, StageParts
from skippy.codec.protocol import WireDType
from skippy.stage.decode_relay import HopReplies, RelayRun, carry, relay_plan
from skippy.stage.direct_return import ReturnHub, ReturnLane
from skippy.stage.extensions import StageIdentity
from skippy.stage.lane import now_us
from skippy.stage.limits import BufferBudget, StageLimits
from skippy.stage.transport import MessageReader, codec, send_frame
from skippy.stage.write_through import StreamGate, WriteThrough

__all__ = ["UpstreamLink"]

#: The compute task's wake-up channel: a queued message, or None (a decode run's step is queued).
Wake = trio.MemorySendChannel[tuple[Dispatch, int, int] | None]


class UpstreamLink:
    """The upstream stream of one lane, its reader and its writes.

    Args:
        stream: the accepted stream (READY already sent; a TLS stream on a TLS link).
        peer: the upstream address, for logs.
        parts: the stage's scheduler, settings and counters, and the lane's state.
        identity: the stage's identity (Timings records, Error frames).
        returns: the stage's return lanes (None: direct return is refused).
        budget: the stage's buffer budget (None: unlimited).
        facts: the facts placement() decides from, now (the connection's ``_facts``).
    """

    def __init__(self, stream: trio.abc.Stream, peer: str, parts: StageParts, identity: StageIdentity,
                 returns: ReturnHub | None, budget: BufferBudget | None, facts: Callable[..., Facts]) -> None:
        self.stream = stream
        self._facts = facts
        self.peer = peer
        self.parts = parts
        self.lane = parts.lane
        self.settings = parts.settings
        self.stats = parts.stats
        self.identity = identity
        self.returns = returns
        self.budget = budget
        self.io = SocketIO(stream)
        #: The upstream reader (its frame timings) and the budget bytes of frames received and not
        #: yet handled (:mod:`skippy.stage.limits`).
        self.reader: MessageReader | None = None
        self.held = 0
        self.last_reply = trio.current_time()
        #: Set (and dropped) when replies are written while the receiver is paused for them.
        self._replies_written: trio.Event | None = None
        #: An upstream write was interrupted mid-frame: no Error frame may follow it.
        self.torn = False
        #: The write-through answering upstream, from its submission until its reply is out.
        self.through: WriteThrough | None = None
        #: What this lane's write-throughs write under (closed before the lane's streams are).
        self.gate = StreamGate()
        #: docs/protocol.md §8: this lane is a session's return lane (set by its open).
        self.return_lane: ReturnLane | None = None
        #: docs/protocol.md §11: wakes the compute task for a run's step.
        self.wake_compute: Wake | None = None
        #: Hop by hop: the last plain decode's reply as relayed upstream, for the decode relay's
        #: templates (:class:`skippy.stage.decode_relay.HopReplies`, set by the connection).
        self.hop_replies: HopReplies | None = None
        #: §11: the data plane's run driving a decode run's steps now (a message from upstream
        #: stops it; the receiving task waits for :attr:`run_carried` before handling it).
        self.run_carry: RelayRun | None = None
        self.run_carried: trio.Event | None = None
        #: The receiving task is handling a message itself (it must not drive a run: it would
        #: not read the upstream's Stop meanwhile).
        self.receiving_inline = False

    # -- step 1: the reader and its budget ---------------------------------------------------
    def open_reader(self) -> MessageReader:
        settings = self.settings
        self.reader = MessageReader(self.io, self.peer, settings.width,
                                    max_frame_bytes=settings.max_frame_bytes or None, budget=self.budget)
        return self.reader

    def release_held(self, held: int) -> None:
        if held:
            self.held -= held
            self.budget.release(held)  # type: ignore[union-attr]

    def release_all(self) -> None:
        """The lane is closing: every budget byte it holds goes back."""
        if self.budget is not None:
            reader = self.reader
            self.budget.release(self.held + (reader.take_reserved() if reader is not None else 0))
            self.held = 0

    async def replies_wanted(self) -> None:
        """Park the receiver while ``REPLY_QUEUE`` replies wait (the backpressure of an upstream
        not reading its replies)."""
        while self.lane.receiving_paused:
            self._replies_written = trio.Event()
            await self._replies_written.wait()

    def direct_left(self) -> None:
        """A direct-return message left this stage (the lane counted it), or replies were written:
        a receiver paused for them may go on."""
        if self._replies_written is not None:
            self._replies_written.set()
            self._replies_written = None

    def overdue(self, now: float, limits: StageLimits, relay_idle_since: float | None) -> Exception | None:
        """The read or idle timeout this lane has passed, or None (``relay_idle_since``: the last
        frame the decode relay read, while it reads the upstream)."""
        reader = self.reader
        if reader is None or self.return_lane is not None:  # a return lane only waits for writes into it
            return None
        decoder, lane = reader.decoder, self.lane
        busy = lane.inflight or lane.expecting or lane.compute_backlog
        idle = None if busy else max(reader.last_frame, self.last_reply)
        if relay_idle_since is not None:  # the relay reads the upstream: its last frame counts
            idle = max(idle or 0.0, relay_idle_since)
        return limits.overdue(now, frame_started=reader.frame_started,
                              buffered=decoder.buffered_bytes,  # type: ignore[attr-defined]
                              needed=decoder.bytes_needed, idle_since=idle)  # type: ignore[attr-defined]

    async def answer_heartbeats(self, reader: MessageReader, message: StageMessage, held: int) -> None:
        """docs/protocol.md §13: ``message`` opened a heartbeat lane; answer it and those that follow
        (until the upstream closes).  Not a lane of the chain: it is not counted as one."""
        self.release_held(held)
        self.lane.extensions.observe(message)  # flagged: a refusal is an Error frame
        self.parts.scheduler.lanes.resting(self.lane.lane_id)
        self.stats.connections_open -= 1
        self.stats.connections_total -= 1
        try:
            await liveness.answer_heartbeats(reader, self.io, self.peer, self.release_held)
        finally:
            self.stats.connections_open += 1  # the connection's cleanup takes it off again

    async def answer_identity(self) -> None:
        """docs/protocol.md §9: the lane's first message was an identity query: answer the
        Identity frame (when this stage has one); the lane then closes."""
        identity = self.settings.identity
        if identity is not None:
            await send_frame(self.io, codec.encode_identity(identity), self.peer,  # type: ignore[arg-type]
                             downstream=False)

    def own_address(self) -> str:
        """This stage's address on the upstream socket (for Error frames; "" when not a socket)."""
        try:
            host, port = getattr(self.stream, "transport_stream", self.stream).socket.getsockname()[:2]
        except (OSError, AttributeError):  # closed, or not a socket stream
            return ""
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    # -- step 5: reply -----------------------------------------------------------------------
    async def compute_and_answer(self, dispatch: Dispatch, action: ReplyUpstream | None, item: WorkItem,
                                 received_us: int) -> None:
        """Execute ``item`` (``dispatch``'s work) and answer it as ``action`` says (None: no reply is
        due): the runtime thread writes the reply the moment its compute ends (:meth:`reply_through`),
        or it is answered from here (:meth:`answer`), as placement() chooses."""
        ticket = dispatch.ticket
        if (action is not None and placement(Step.WRITE_UP, dispatch.rule, self._facts(
                before_compute=True, direct=dispatch.direct, reply_next=self.lane.reply_next(ticket)))
                is Performer.RUNTIME_THREAD):
            assert ticket is not None and self.lane.claim_reply_write(ticket)
            await self.reply_through(dispatch, item, ticket)
            return
        result, queue_us = await self.parts.scheduler.execute(item)
        control.note_recorded(self.parts, result, dispatch.message)
        if action is not None:
            await self.answer(dispatch, action, result, received_us, queue_us)

    async def answer(self, dispatch: Dispatch, action: ReplyUpstream, result: WorkResult, received_us: int,
                     queue_us: int) -> None:
        """The final stage answers an executed message: into its return lane (direct), an ACK, or
        its prediction."""
        if action.direct:
            await self.reply_direct(dispatch, action, result, received_us, queue_us)
            return
        assert dispatch.ticket is not None
        if action.answer is Answer.ACK:
            await self.reply(dispatch.ticket, StageReply.ack(self.lane.take_stats()))
        else:
            await self.reply_prediction(dispatch, action, result, received_us, queue_us, self.lane.take_stats())

    async def answer_own(self, dispatch: Dispatch, action: ReplyUpstream, own: OwnPart, received_us: int) -> None:
        """A control kind answered by this stage (it has no downstream, or no forward was due):
        its ACK with its own part's stats and frames, or a fused restore-decode's prediction."""
        assert dispatch.ticket is not None
        stats = self.lane.take_stats()
        if own.stats is not EMPTY_REPLY_STATS:
            stats = stats.merge(own.stats)
        if action.answer is Answer.ACK or own.result is None:
            annotations = own.annotations if self.lane.extensions.enabled else ()
            await self.reply(dispatch.ticket, StageReply.ack(stats), None, annotations)
        else:  # the final stage's fused restore-decode: its prediction
            await self.reply_prediction(dispatch, action, own.result, received_us, 0, stats)

    async def reply(self, ticket: Ticket, reply: StageReply, timings: TimingsFrame | None = None,
                    annotations: tuple[Annotation, ...] = ()) -> None:
        """Answer ``ticket`` (``timings``: its Timings frame, ``annotations``: its §10 frames;
        negotiated lanes only), and write every reply that is now due if this task got the
        writer token."""
        await self.write_due(self.lane.reply_ready(ticket, reply, timings, annotations))

    async def write_due(self, due: list[Ticket]) -> None:
        lane = self.lane
        if due:
            self.last_reply = trio.current_time()
        while due:
            if len(due) == 1:
                frame = extensions.reply_bytes(due[0].reply, due[0].timings, due[0].annotations)  # type: ignore[arg-type]
            else:
                frame = b"".join(extensions.reply_bytes(t.reply, t.timings, t.annotations)  # type: ignore[arg-type]
                                 for t in due)
            if self.settings.reply_delay_s:  # the simulated wire, upstream direction (benchmarks)
                await trio.sleep(self.settings.reply_delay_s)
            self.torn = True  # until the whole frame is out: a cancel may cut it
            await send_frame(self.io, frame, self.peer, downstream=False)
            self.torn = False
            due = lane.replies_written(len(due))
        self.direct_left()  # (the receiver waits for the same event)

    async def reply_prediction(self, dispatch: Dispatch, action: ReplyUpstream, result: WorkResult,
                               received_us: int, queue_us: int, stats: ReplyStats) -> None:
        """The final stage's predicted reply (PredictedTokens for a verify window), with its
        Timings frame on a negotiated lane (docs/protocol.md §4: the producing stage starts it)."""
        assert dispatch.ticket is not None
        reply, timings, annotations = replies.prediction(
            dispatch, result, stats, identity=self.identity, queue_us=queue_us,
            negotiated=self.lane.extensions.enabled, window=action.window, total_us=now_us() - received_us)
        run = dispatch.ticket.run
        carried = run is not None and not annotations and self.run_carriable(dispatch)
        if carried and not run.announced:  # §11: the run's first reply says the stage runs it
            annotations += replies.RUN_ACCEPTED
        elif run is not None and not carried:  # §11: the run's next step starts before this reply is out
            annotations += self.run_step(dispatch.ticket, reply.predicted)
        await self.reply(dispatch.ticket, reply, timings, annotations)
        if carried:
            await self.carry_run(dispatch, dispatch.ticket, reply.predicted)
        if self.settings.decode_relay and action.window and dispatch.rule.relay and not annotations:
            # shortcut 3 may answer the next windows (a window's reply is never written through)
            self.lane.relay_frame = extensions.reply_bytes(*replies.prediction_template(
                self.identity, negotiated=self.lane.extensions.enabled, rows=dispatch.message.token_count,
                window=True))

    async def reply_direct(self, dispatch: Dispatch, action: ReplyUpstream, result: WorkResult,
                           received_us: int, queue_us: int) -> None:
        """docs/protocol.md §8: the final stage's prediction, written into the session's return
        lane (with its Timings frame when that lane negotiated the extensions)."""
        message, lane_state = dispatch.message, self.lane
        lane = None if self.returns is None else self.returns.get(lane_state.lane_id, message.session_id)
        if lane is None:
            raise ReturnLaneLost(f"{dispatch.kind.reference_name} of session {message.session_id} asks for direct "
                                 "return, but no return lane is open for it on this stage")
        reply, timings, annotations = replies.prediction(
            dispatch, result, lane_state.take_stats(), identity=self.identity, queue_us=queue_us,
            negotiated=lane.extensions, window=action.window, total_us=now_us() - received_us)
        await lane.send(extensions.reply_bytes(reply, timings, annotations), self.settings.reply_delay_s)
        self.stats.direct_replies += 1
        lane_state.direct_done()
        self.direct_left()
        if self.settings.decode_relay and not annotations and dispatch.rule.relay:
            # shortcut 3 may answer the next ones: their reply as the lane would write it
            lane_state.relay_lane = lane
            lane_state.relay_frame = extensions.reply_bytes(*replies.prediction_template(
                self.identity, negotiated=lane.extensions, rows=dispatch.message.token_count, window=action.window))

    async def reply_through(self, dispatch: Dispatch, item: WorkItem, ticket: Ticket) -> None:
        """Execute ``item`` on the final stage and have the runtime thread write its PredictedToken
        upstream (the caller holds the writer token for ``ticket``)."""
        stats = self.lane.take_stats()
        extensions_on = self.lane.extensions.enabled

        def build(result: WorkResult, queue_us: int) -> bytes:  # runtime thread
            ticket.reply, ticket.timings, annotations = replies.prediction(
                dispatch, result, stats, identity=self.identity, queue_us=queue_us, negotiated=extensions_on)
            if annotations:
                ticket.annotations = annotations
            if run is not None and not run.announced:  # §11: the run's first reply says it runs
                ticket.annotations += replies.RUN_ACCEPTED
            return extensions.reply_bytes(ticket.reply, ticket.timings, ticket.annotations)

        run = ticket.run
        through = self.through = WriteThrough(self.gate, self.io, build)
        await self.parts.scheduler.execute(item, through)
        carried = run is not None and ticket.reply is not None and self.run_carriable(dispatch)
        if run is not None and ticket.reply is not None and not carried:  # §11: the run's next step
            self.run_step(ticket, ticket.reply.predicted)
        self.torn = True  # until the whole reply is out: a cancel may cut it
        await through.finish(self.peer, downstream=False)
        self.torn = False
        self.through = None
        self.stats.write_throughs += 1
        await self.write_due(self.lane.replies_written(1))
        if carried:
            assert ticket.reply is not None
            await self.carry_run(dispatch, ticket, ticket.reply.predicted)
        if (self.settings.decode_relay and run is None and not ticket.annotations
                and dispatch.rule.relay):  # shortcut 3 may answer the next ones
            self.lane.relay_frame = extensions.reply_bytes(
                *replies.prediction_template(self.identity, negotiated=extensions_on))

    async def relay_reply(self, relay: Relay, reply: StageReply, timings: TimingsFrame | None, wait_us: int,
                          annotations: tuple[Annotation, ...] = ()) -> None:
        """Answer the forwarded message's ticket with the downstream's reply, this stage's share added
        (:func:`skippy.lane.replies.relayed`; a stopped session released first)."""
        item, lane = relay.forward, self.lane
        assert item.ticket is not None
        stats = merge_stats(lane.take_stats(), reply.stats)
        if item.on_reply is not None:
            stats = await item.on_reply(stats)
        if relay.release:
            await control.release(self.parts, item.session)
        received = reply, timings, annotations
        reply, timings, annotations = replies.relayed(lane, relay, reply, stats, timings, annotations,
                                                      identity=self.identity, wait_us=wait_us, now_us=now_us())
        if relay.prediction and item.ticket.run is not None:  # §11: the run's next step starts before the reply
            annotations += self.run_step(item.ticket, reply.predicted)
        hops = self.hop_replies
        hop = (hops is not None and self.settings.decode_relay and item.ticket.run is None
               and RULES[item.ticket.kind].relay)
        if hop:  # shortcut 3 may answer the next ones: their replies as the lane writes them
            hops.relayed(item.ticket, received, (reply, timings, annotations))  # type: ignore[union-attr]
        await self.reply(item.ticket, reply, timings, annotations)
        if hop:
            hops.written()  # type: ignore[union-attr]

    def run_step(self, ticket: Ticket, token: int) -> tuple[Annotation, ...]:
        """A decode run's step predicted ``token`` (its reply is about to be answered): the lane
        queues the next step unless the run is over, and the compute task is woken for it;
        returns the frames its reply carries (the first reply says the stage runs it)."""
        first, step = self.lane.run_predicted(ticket, token, now_us())
        if step is not None:
            self.stats.decode_run_steps += 1
            self._wake_compute()
        return replies.RUN_ACCEPTED if first else ()

    def _wake_compute(self) -> None:
        wake = self.wake_compute
        if wake is not None:
            try:
                wake.send_nowait(None)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # busy (it takes run_steps first when it comes back), or the lane is ending

    def run_carriable(self, dispatch: Dispatch) -> bool:
        """§11: whether the data plane may drive the next steps of ``dispatch``'s run (decided
        before its reply is out; :meth:`carry_run` checks the lane once it is): the relay on, a
        one-stage chain's stage (first and final) on a plain socket with no simulated wire, and
        no frame beside the step's reply but the run's announcement."""
        ticket = dispatch.ticket
        executor = self.parts.scheduler.executor
        return (self.settings.decode_relay and not self.receiving_inline and ticket is not None and ticket.run is not None
                and ticket.annotations in ((), replies.RUN_ACCEPTED) and dispatch.rule.relay
                and executor.is_first and executor.is_last and self.settings.downstream is None
                and not self.settings.reply_delay_s and self.io.is_socket and self.reader is not None
                and not self.parts.scheduler.others_working(self.lane.lane_id))

    async def carry_run(self, dispatch: Dispatch, ticket: Ticket, token: int) -> None:
        """§11 on a one-stage chain: ``ticket``'s step (its reply out) predicted ``token``; while
        the lane holds nothing but the run, the data plane (:mod:`skippy.stage.decode_relay`)
        computes and answers its next steps, each from the last one's pick; the lane's path takes
        the step after the last it carried (or the next one, when it may not run)."""
        lane, run = self.lane, ticket.run
        assert run is not None
        message = lane.run_handover(ticket, token)
        if message is None:
            return
        steps, last, over = 0, -1, False
        relay = self._run_relay(dispatch, message) if lane.run_alone(run) else None
        if relay is not None:
            done = self.run_carried = trio.Event()
            try:
                ran = await carry(relay, scheduler=self.parts.scheduler, lane_id=lane.lane_id,
                                  session_key=dispatch.key, return_lane=None, timings=lane.direct_timings,
                                  running=self._carrying)
            finally:
                self.run_carried = None
                done.set()
            if ran:
                steps, last, over = relay.run_progress()
                self.stats.decode_run_steps += steps
        following = lane.run_carried(run, message, steps, last, over)
        if following is not None:
            lane.run_resume(run, following, now_us())
            self.stats.decode_run_steps += 1
            self._wake_compute()

    def _carrying(self, relay: RelayRun | None) -> None:
        self.run_carry = relay

    def _run_relay(self, dispatch: Dispatch, message: StageMessage) -> RelayRun | None:
        """The data plane's run for a decode run's step ``message`` (after ``dispatch``'s, the
        template), or None when the loop would not carry it exactly as the lane does."""
        settings, executor, run = self.settings, self.parts.scheduler.executor, message
        assert dispatch.ticket is not None and dispatch.ticket.run is not None and self.reader is not None
        if self.reader.decoder.buffered_bytes:  # type: ignore[attr-defined]
            return None  # (the upstream sent more: the lane reads it first)
        extensions_on = self.lane.extensions.enabled
        template = extensions.reply_bytes(*replies.prediction_template(self.identity, negotiated=extensions_on))
        plan = relay_plan(dispatch.message, template, executor=executor, session_key=dispatch.key,
                          width=settings.width, out_dtype=settings.wire_dtype, position_end=settings.max_rows)
        if plan is None:
            return None
        try:
            frame = codec.encode_message(run, WireDType(run.state.reserved), settings.width)
        except ValueError:
            return None
        decode_run = dispatch.ticket.run
        return RelayRun(plan, executor=executor, scheduler=self.parts.scheduler, stats=self.stats, upstream=self.io,
                        downstream=self.io, reader=self.reader, downstream_name=self.peer, width=settings.width,
                        position_end=settings.max_rows, upstream_name=self.peer,
                        run=(frame, decode_run.left, tuple(decode_run.stop_tokens)))

    # -- direct return (§8) ------------------------------------------------------------------
    def return_open(self, dispatch: Dispatch) -> OwnPart:
        """docs/protocol.md §8: this lane becomes the return lane of the session it names (the
        lane checked that it is the lane's first message and flagged); ACKed, not forwarded."""
        message = dispatch.message
        if self.returns is None or self.settings.downstream is not None:
            raise UnsupportedKind("PredictionReturnOpen refused: direct return is served by the final stage only")
        lane = ReturnLane(self.stream, self.io, self.peer, extensions=self.lane.extensions.enabled,
                          session_id=message.session_id, request_id=message.request_id)
        self.returns.open(lane)
        self.return_lane = lane
        self.stats.return_lanes += 1
        self.stats.return_lanes_open += 1
        return OwnPart(forwarded=False)

    # -- the close ---------------------------------------------------------------------------
    async def close(self, error: ErrorFrame | None) -> None:
        """The lane is closing (``error``: why, None for a clean end): no write-through may write
        from here on; its return lanes close (§8); the Error frame goes upstream on a negotiated
        lane, unless a write was cut mid-frame."""
        self.gate.close()  # a write-through still queued must not write from here on
        # A write-through that started may have written part of its reply (its emit runs
        # only once the compute is done: a refusal before that has written nothing).
        lane_id = self.lane.lane_id
        with trio.CancelScope(shield=True):
            if self.returns is not None and await direct_return.close_lanes(self.returns, self.return_lane,
                                                                            lane_id, error):
                self.torn = True
            through = self.through
            torn = self.torn or (through is not None and through.ran)
            if error is not None and self.lane.extensions.enabled and not torn:
                await extensions.send_error(self.io, error, lane_id)
        if self.return_lane is not None:
            self.stats.return_lanes_open -= 1
