"""One upstream connection (a lane): its lifetime, receive loop and dispatch; the lane's state and
rules are :mod:`skippy.lane`, its bytes move in its two halves.

Strategy (the reference's ``handle_binary_connection``, restructured for trio): a
:class:`Connection` owns the lane's tasks and a :class:`~skippy.lane.protocol.StageLane` (all of
the lane's state); it feeds the lane every event and hands the actions it returns to the half
that carries them out: :mod:`skippy.stage.upstream` (the reader, heartbeats, the reply writer,
return lanes) or :mod:`skippy.stage.downstream` (the forward step, the forward and relay tasks).
Every message takes the same steps:

1. **receive** (``receive_messages``): read and decode a frame, ``received`` → a
   :class:`~skippy.lane.protocol.Dispatch` (or a typed refusal, which closes the lane); an early
   ACK is replied at once.  Reading pauses while ``REPLY_QUEUE`` replies wait to be written.
2. **handle** (``_handle``): the stage's own part by the rule's handling (the scheduler executes;
   control kinds are plain functions of :mod:`skippy.stage.control`), then ``computed`` → forward
   downstream (``DownstreamLink.compute_and_forward`` / ``forward``), reply upstream
   (``UpstreamLink.compute_and_answer`` / ``answer_own``), or nothing.
3. **forward** and 4. **relay**: the downstream half writes frames in order with their reply
   credits and reads the downstream's replies, answered upstream with this stage's share.
5. **reply**: the upstream half writes the replies now due, in message order (one writer).

Who performs a step (the receiving task, the compute or forward task, the runtime thread through
:mod:`skippy.stage.write_through`, the data plane of :mod:`skippy.stage.decode_relay`) is
:func:`skippy.lane.placement.placement`'s choice alone, from the facts ``_facts`` gathers (both
halves ask it).

Any failure cancels the lane's other tasks; the lane is closed with one log line naming the
reason (``extensions.closing_error``), its sessions are released, its return lanes closed (with
the Error frame on a negotiated lane), and its downstream lane closed, which cascades the close
down the chain; the stage carries on.  Direct return (§8) and decode runs (§11) are the upstream
half's and the lane's.
"""

from __future__ import annotations

import functools
import itertools
import logging
from time import perf_counter_ns

import trio

from skippy.codec.protocol import StageReply
from skippy.codec.protocol_ext import (
    DECODE_RUN_FLAG, LIVENESS_FLAG, ErrorCode, ErrorFrame, ExtensionNegotiation, is_liveness_query,
)
from skippy.lane import messages as lane_messages
from skippy.lane.errors import StageError
from skippy.lane.placement import Facts, Performer, Step, placement
from skippy.lane.protocol import Dispatch, Forward, Handling, ReplyUpstream, SendDownstream, StageLane
from skippy.net.socket_io import SocketIO
from skippy.stage import control, extensions
from skippy.stage.control import OWN_PARTS
from skippy.stage.decode_relay import HopReplies, RelayRun, carry, relay_plan
from skippy.stage.direct_return import ReturnHub, ReturnLane
from skippy.stage.downstream import DownstreamLink
from skippy.stage.executor import sampling_params
from skippy.stage.lane import LaneSettings, put, take
from skippy.stage.limits import BufferBudget, IdleLane, StageLimits
from skippy.stage.scheduler import Scheduler
from skippy.stage.stats import StageStats
from skippy.stage.transport import MessageReader
from skippy.stage.upstream import UpstreamLink

log = logging.getLogger("skippy.stage")

__all__ = ["Connection", "LaneSettings"]

#: Messages buffered between receive and compute (small: this is the backpressure).
MESSAGE_QUEUE = 2
#: Replies that may wait for their turn before the lane reads no further message.
REPLY_QUEUE = 16

_connection_ids = itertools.count(1)
#: What the receiving task hands the compute task: (dispatch, received_us, held bytes), or None
#: (a decode run's wake-up: its step waits in ``lane.run_steps``).
_Entry = tuple[Dispatch, int, int] | None


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
        self.identity = extensions.identity_for(scheduler.executor)
        #: What the control kinds' own parts work on (:mod:`skippy.stage.control`).
        self._stage = control.StageParts(scheduler, settings, stats, self.lane)
        #: The two halves: the upstream stream, its reader and replies; the downstream stream
        #: and its forward and relay tasks.
        self.up = UpstreamLink(upstream, peer, self._stage, self.identity, returns, budget, self._facts)
        self.link = DownstreamLink(self.lane, settings, stats, self.up.relay_reply, self.up.direct_left, self._facts)
        self._upstream_io = self.up.io
        #: Facts of the lane's streams for placement(), fixed for its life: a plain socket
        #: upstream, a simulated wire downstream (benchmarks).
        self._upstream_socket = self._upstream_io.is_socket
        self._wire_delay = settings.wire.active
        self._aborted: StageError | None = None
        self._serve_scope: trio.CancelScope | None = None
        #: The decode relay's run reading the upstream now (:mod:`skippy.stage.decode_relay`).
        self._relay_run: RelayRun | None = None
        #: Hop by hop: the last plain decode's reply as relayed upstream (the relay's templates).
        self._hop_replies = self.up.hop_replies = HopReplies()

    @property
    def inflight(self) -> int:
        """Messages received whose reply has not been written yet (0: the lane is idle)."""
        return self.lane.inflight

    @property
    def extensions(self) -> ExtensionNegotiation:
        return self.lane.extensions

    @property
    def upstream_io(self) -> SocketIO:
        """The upstream lane's socket I/O (its byte counts feed the stage's metrics)."""
        return self._upstream_io

    @property
    def downstream_io(self) -> SocketIO | None:
        """The downstream lane's socket I/O, once connected."""
        return self.link.io

    def has_session(self, session_id: int) -> bool:
        """Whether ``session_id`` is open on this lane (the return hub's owner lookup)."""
        return self.lane.has_session(session_id)

    def _facts(self, *, early_ack: bool = False, credited: bool = False, direct: bool = False,
               before_compute: bool = False, reply_next: bool = False, template: bool = False,
               downstream_socket: bool | None = None, quiet: bool = True, adoptable: bool = False) -> Facts:
        """What :func:`~skippy.lane.placement.placement` decides from, now (the message's part given)."""
        settings, lane = self.settings, self.lane
        if downstream_socket is None:
            downstream_socket = self.link.socket
        return Facts(settings.inline_hand_offs, settings.write_through, settings.decode_relay,
                     self._upstream_socket, downstream_socket, self._wire_delay, settings.reply_delay_s > 0,
                     settings.downstream is None or self.link.channel is not None, lane.compute_backlog == 0,
                     lane.forward_backlog == 0, quiet, adoptable, early_ack, credited, direct, before_compute,
                     reply_next, template)

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
            error = extensions.shutting_down_frame(self.identity.index, self.up.own_address())
            raise
        except* Exception as group:  # any failure closes this lane only; it is logged and reported
            # a lane the watchdog aborted fails wherever its tasks were: the limit it passed is the reason
            leaves = [self._aborted] if self._aborted is not None else extensions.leaves(group)
            self.stats.connection_errors += 1
            idle = all(isinstance(exc, IdleLane) for exc in leaves)
            error = extensions.closing_error(leaves, log, self.id, self.peer, idle=idle,
                                             identity_aware=self.lane.identity_aware, index=self.identity.index,
                                             address=self.up.own_address(), downstream_address=self.link.name)
            self.stats.errors_by_code[ErrorCode(error.code).name.lower()] += 1
        finally:
            await self.up.close(error)
            with trio.CancelScope(shield=True):
                # docs/protocol.md §14: a lane lost with the chain (its downstream, or, behind the
                # first stage, its upstream stage) parks the sessions their driver resumes
                lost = not self.scheduler.executor.is_first or (
                    error is not None and error.code == ErrorCode.DOWNSTREAM_LOST)
                await self._cleanup(lost=lost)

    async def _cleanup(self, *, lost: bool = False) -> None:
        self.up.release_all()
        orphans = await control.release_orphans(self._stage, self.id, lost=lost)
        for stream in (self.link.stream, self.upstream):
            if stream is not None:
                with trio.move_on_after(1):
                    await trio.aclose_forcefully(stream)
        self.scheduler.lanes.resting(self.id)
        self.stats.connections_open -= 1
        self.stats.touch()
        log.debug("lane %d from %s closed (%d orphan sessions released)", self.id, self.peer, orphans)

    async def _serve(self) -> None:
        messages_send, messages_receive = trio.open_memory_channel[_Entry](MESSAGE_QUEUE)
        self.up.wake_compute = messages_send.clone()  # closed with the receiving side (receive_messages)
        async with trio.open_nursery() as nursery:
            self._serve_scope = nursery.cancel_scope
            nursery.start_soon(self.compute_messages, messages_receive, nursery)
            nursery.start_soon(self.receive_messages, messages_send)

    # -- limits (skippy.stage.limits) ----------------------------------------------------------
    def overdue(self, now: float, limits: StageLimits) -> Exception | None:
        """The read or idle timeout this lane has passed (the server's watchdog asks), or None."""
        relay = self._relay_run or self.up.run_carry
        return self.up.overdue(now, limits, None if relay is None else relay.idle_since())

    def abort(self, error: StageError) -> None:
        """Close the lane for ``error`` (a limit passed): its tasks are cancelled, it is reported."""
        if self._aborted is None and self._serve_scope is not None:
            self._aborted = error
            self._serve_scope.cancel()

    # -- step 1: receive ---------------------------------------------------------------------
    async def receive_messages(self, messages: trio.MemorySendChannel[_Entry]) -> None:
        reader = self.up.open_reader()
        try:
            async with messages:
                await self._receive_loop(reader, messages)
        finally:
            self.lane.end_runs()  # §11: a run ends with its upstream (no step starts after)
            if self.up.wake_compute is not None:  # §11: the decode runs' wake-ups end with the upstream
                self.up.wake_compute.close()

    async def _receive_loop(self, reader: MessageReader, messages: trio.MemorySendChannel[_Entry]) -> None:
        protocol, up = self.lane, self.up
        while True:
            if protocol.receiving_paused:  # the backpressure of an upstream not reading replies
                await up.replies_wanted()
            message = await reader.next()
            if message is None:
                return
            received_us = perf_counter_ns() // 1000  # now_us(), inline on the decode walk
            held = reader.take_reserved() if reader.reserved else 0
            up.held += held
            if not protocol.lane_used and message.state.flags & LIVENESS_FLAG and is_liveness_query(message):
                await up.answer_heartbeats(reader, message, held)  # docs/protocol.md §13: a heartbeat lane
                return
            if self.identity.index < 0:
                self.identity.observe(message)
            carrying = up.run_carry
            if carrying is not None:  # §11: the data plane drives a run; it ends between steps
                carrying.stop()
            dispatch, run = protocol.received(message, run_flagged=bool(message.state.flags & DECODE_RUN_FLAG),
                                              is_first=self.scheduler.executor.is_first)
            carried = up.run_carried
            if carried is not None:  # (its last steps' replies are out before anything of this message)
                await carried.wait()
            if dispatch is None:  # docs/protocol.md §9: an identity query, answered; the lane ends
                await up.answer_identity()
                return
            self.stats.messages += 1
            if run is not None:
                self.stats.decode_runs += 1
            if dispatch.early_ack:
                assert dispatch.ticket is not None
                self.stats.early_acks += 1
                await up.reply(dispatch.ticket, StageReply.ack())
            facts = self._facts(early_ack=dispatch.early_ack)
            if placement(Step.HANDLE, dispatch.rule, facts) is Performer.RECEIVING_TASK:
                up.receiving_inline = True
                try:
                    await self._handle(dispatch, received_us)  # shortcut: the compute task is idle
                finally:
                    up.receiving_inline = False
                    up.release_held(held)
                if protocol.relay_frame is not None:  # shortcut 3: the next decodes may leave Python
                    await self._relay_decode(reader, dispatch)
            else:
                self.lane.compute_backlog += 1
                await put(messages, (dispatch, received_us, held))

    async def _relay_decode(self, reader: MessageReader, dispatch: Dispatch) -> None:
        """Shortcut 3 (:mod:`skippy.stage.decode_relay`): ``dispatch`` was a decode, forwarded by
        write-through (or, on the final stage, answered upstream or into its return lane); once
        answered (hop by hop), while this lane is the stage's only work, relay the ones that
        follow it outside Python (hop by hop from the last of its kind whose reply came back; the
        messages still in flight, a pipelining upstream's, are the run's to answer first).
        Whatever the relay does not carry is left in ``reader``."""
        state = self.lane
        frame, lane = state.take_template(dispatch.message)
        assert lane is None or isinstance(lane, ReturnLane)
        if self.scheduler.others_working(self.id):  # many sessions: their rows batch, a relay would be refused
            return
        upstream, settings = self._upstream_io, self.settings
        executor = self.scheduler.executor
        hop = not dispatch.direct
        final = hop and executor.is_last
        downstream = lane.io if lane is not None else upstream if final else self.link.io
        replies = None
        template = dispatch.message
        buffered = bool(reader.decoder.buffered_bytes)  # type: ignore[attr-defined]
        if hop and not final and frame is not None:
            hops = self._hop_replies
            hops.handled(dispatch.ticket, dispatch.key, dispatch.message, frame)  # (a template once answered)
            if upstream.is_socket and not buffered:
                kept = hops.template(dispatch.key, dispatch.rule.window)
                if kept is None:  # the kind's first: once its reply is written, or more comes
                    await hops.wait(dispatch.ticket, upstream.fileno())
                    kept = hops.template(dispatch.key, dispatch.rule.window)
                template, frame, replies = kept if kept is not None else (template, None, None)
            else:
                frame = None
        free = downstream is not None and downstream.is_socket and (
            lane is None or not (lane.closed or lane.lock.locked()))
        quiet = state.quiet and not buffered
        facts = self._facts(template=frame is not None, downstream_socket=free, quiet=quiet,
                            adoptable=not quiet and not buffered and replies is not None
                            and state.adoptable(dispatch.key))
        if placement(Step.CARRY_NEXT, None, facts) is not Performer.DATA_PLANE:
            return
        assert frame is not None and downstream is not None
        plan = relay_plan(template, frame, executor=executor, session_key=dispatch.key,
                          width=settings.width, out_dtype=settings.wire_dtype, position_end=settings.max_rows,
                          replies=replies, last=dispatch.message)
        if plan is None:
            return
        run = RelayRun(plan, executor=executor, scheduler=self.scheduler, stats=self.stats, upstream=upstream,
                       downstream=downstream, reader=reader,
                       downstream_name=self.peer if final else self.link.name if lane is None else lane.peer,
                       width=settings.width, position_end=settings.max_rows, lane=state, link=self.link,
                       upstream_name=self.peer)
        await carry(run, scheduler=self.scheduler, lane_id=self.id, session_key=dispatch.key, return_lane=lane,
                    timings=self.lane.direct_timings, running=functools.partial(setattr, self, "_relay_run"))

    # -- step 2: handle ----------------------------------------------------------------------
    async def compute_messages(self, messages: trio.MemoryReceiveChannel[_Entry], nursery: trio.Nursery) -> None:
        lane = self.lane
        try:
            async with messages:
                while True:
                    if lane.run_steps:  # §11: a decode run's next step (made before anything queued behind it)
                        # one run-loop pass first: a step may run entirely on this thread (inline
                        # decode), and the receiving task must see a Stop that ends the run
                        await trio.lowlevel.checkpoint()
                        dispatch, received_us, held = lane.run_steps.popleft()
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
                        self.up.release_held(held)
                    lane.compute_backlog -= 1
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
            own = self.up.return_open(dispatch)
            self.scheduler.lanes.resting(self.id)  # not a lane that brings work (the scheduler's policy)
        else:
            own = await OWN_PARTS[handling](self._stage, dispatch, key, forward, forwarding=self.link.channel is not None)
        action = self.lane.computed(dispatch, has_downstream=self.link.channel is not None,
                                    local_hit=own.result is not None, forwarded=own.forwarded)
        if type(action) is SendDownstream:
            forward.expect = action.expect
            forward.enqueued_at = trio.current_time()
            await self.link.forward(forward)
        elif type(action) is ReplyUpstream:
            await self.up.answer_own(dispatch, action, own, received_us)

    async def _execute(self, dispatch: Dispatch, key: int, received_us: int) -> None:
        rule, message = dispatch.rule, dispatch.message
        executor = self.scheduler.executor
        item = lane_messages.work_item(dispatch, key, is_first=executor.is_first, width=self.settings.width,
                                       max_rows=self.settings.max_rows, reads_tokens=executor.reads_tokens,
                                       sideband_flag=executor.sideband_flag, sampling=sampling_params)
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
        if type(action) is SendDownstream:  # step 3 (the downstream half)
            await self.link.compute_and_forward(self._stage, self.up.gate, dispatch, action, item, received_us)
        else:  # step 5 (the upstream half), or no reply due
            await self.up.compute_and_answer(dispatch, action if type(action) is ReplyUpstream else None, item,
                                             received_us)
