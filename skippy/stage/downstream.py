"""A lane's downstream half (I/O only): the stream to the next stage, its forward task and its relay task.

Strategy (steps 3 and 4 of :mod:`skippy.stage.connection`; the state and rules are the lane's,
:class:`~skippy.lane.protocol.StageLane`): :meth:`DownstreamLink.connect` dials the downstream
(the launcher's ``--downstream-file`` first), checks its identity (docs/protocol.md §9) and starts
two tasks.  The **forward step** (:meth:`DownstreamLink.compute_and_forward` for an executed
message, :meth:`DownstreamLink.forward` for any frame) goes where placement() puts it: the
runtime thread writes a frame the moment its compute ends (:meth:`DownstreamLink.write_through`),
the handling task writes it itself while the forward task is idle and no credit or simulated
wire delays it (:meth:`DownstreamLink.write`), or it is queued (:meth:`DownstreamLink.queue`) to
the **forward task**, which takes frames in order, waits for a reply credit for a credited frame
and writes each.  The **relay task** reads the downstream's replies and reports each to the
lane (``downstream_replied``): an absorbed ACK's credit wakes the forward task, anything else is
answered upstream by the upstream half (``relay_reply``).  The relay parks on the socket, not on
a channel (an idle lane notices a lost downstream at once); the forward task cancels that wait
when it ends with nothing left to answer, and the decode relay hop by hop
(:mod:`skippy.stage.decode_relay`) moves it off the socket while its loop reads the replies
(:meth:`DownstreamLink.pause_relay`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from time import perf_counter_ns
from typing import Awaitable, Callable

import trio

from skippy.codec.protocol import StageReply
from skippy.codec.protocol_ext import SKIPPY_EXTENSIONS_FLAG, Annotation, TimingsFrame, with_extensions_flag
from skippy.lane import messages as lane_messages
from skippy.lane.placement import Facts, Performer, Step, placement
from skippy.lane.protocol import RULES, Dispatch, Expect, Forward, Relay, SendDownstream, StageLane
from skippy.lane.work import WorkItem, WorkResult
from skippy.net.socket_io import SocketIO
from skippy.stage import control
from skippy.stage.lane import LaneSettings, now_us, put, take
from skippy.stage.scheduler import Scheduler
from skippy.stage.stats import StageStats
from skippy.stage.transport import ReplyReader, codec, connect_stage, send_frame
from skippy.stage.write_through import StreamGate, WriteThrough

__all__ = ["DownstreamLink"]

log = logging.getLogger("skippy.stage")

#: Answers a relayed reply upstream: (relay, reply, its Timings frame, wait_us, its §10 frames).
Answer = Callable[[Relay, StageReply, "TimingsFrame | None", int, tuple[Annotation, ...]], Awaitable[None]]
#: The facts placement() decides from, now (the connection's ``_facts``; keywords: the message's part).
FactsNow = Callable[..., Facts]


class DownstreamLink:
    """The downstream stream of one lane and the two tasks that write and read it.

    Args:
        lane: the lane's state and rules.
        settings / stats: the stage's lane settings and counters.
        answer: answers a relayed reply upstream (the upstream half's).
        direct_left: a direct-return frame is written (the lane counted it; receiving may go on).
        facts: the facts placement() decides from, now (the connection's).
    """

    def __init__(self, lane: StageLane, settings: LaneSettings, stats: StageStats, answer: Answer,
                 direct_left: Callable[[], None], facts: FactsNow) -> None:
        self.lane = lane
        self.settings = settings
        self.stats = stats
        self._answer = answer
        self._direct_left = direct_left
        self._facts = facts
        self.stream: trio.abc.Stream | None = None
        self.io: SocketIO | None = None
        self.name = str(settings.downstream) if settings.downstream is not None else ""
        #: A plain socket (a fact for placement(): only those may be written by the data plane).
        self.socket = False
        #: The forward task's channel (None until the first message opens the link).
        self.channel: trio.MemorySendChannel[Forward] | None = None
        #: Set (and dropped) when an absorbed ACK returns a credit the forward task waits for.
        self._credit_returned: trio.Event | None = None
        #: The relay task's scope, and whether it is parked waiting with nothing expected.
        self._relay_scope = trio.CancelScope()
        self._relay_idle = False
        #: The relay task's reader (its decoder takes back a reply the decode relay did not carry).
        self.reader: ReplyReader | None = None
        #: While the decode relay reads the replies: the relay task's parked wait (cancelled to
        #: move it off the socket), set when it is off, set to give the socket back.
        self._parked: trio.CancelScope | None = None
        self._off: trio.Event | None = None
        self._resume: trio.Event | None = None

    async def connect(self, nursery: trio.Nursery) -> None:
        """Dial the downstream, check it (§9), and start the forward and relay tasks in ``nursery``."""
        settings = self.settings
        address = settings.downstream
        dialled: list[object] = [address]
        resolve = None
        if settings.downstream_file is not None:  # re-wired by a launcher (--downstream-file)
            def resolve() -> object:  # read at every attempt: the launcher may move it while this dials
                dialled[0] = _read_downstream_file(settings.downstream_file) or settings.downstream
                return dialled[0]

            address = resolve()
        assert address is not None
        self.stream = await connect_stage(address, settings.connect_timeout,  # type: ignore[arg-type]
                                          tls=settings.downstream_tls, resolve=resolve)  # type: ignore[arg-type]
        address = dialled[0]
        if settings.downstream_file is not None:
            self.name = str(address)
        self.io = SocketIO(self.stream)
        self.socket = self.io.is_socket
        if settings.identities is not None:  # docs/protocol.md §9: same model, ranges that meet
            await settings.identities.verify(address)  # type: ignore[attr-defined]
        send, receive = trio.open_memory_channel[Forward](max(1, settings.max_inflight))
        nursery.start_soon(self.forward_activations, receive)
        nursery.start_soon(self.relay_replies)
        self.channel = send

    async def queue(self, item: Forward) -> None:
        """Hand ``item`` to the forward task (written in order, after its credit)."""
        assert self.channel is not None
        self.lane.forward_backlog += 1
        await put(self.channel, item)

    async def close(self) -> None:
        """No more frames: the forward task ends once the queued ones are written."""
        if self.channel is not None:
            await self.channel.aclose()

    # -- step 3: forward ---------------------------------------------------------------------
    async def compute_and_forward(self, parts: control.StageParts, gate: StreamGate, dispatch: Dispatch,
                                  action: SendDownstream, item: WorkItem, received_us: int) -> None:
        """Execute ``item`` (``dispatch``'s work) and forward its activations as ``action`` says: the
        runtime thread writes the frame the moment its compute ends (:meth:`write_through`), or the
        result is forwarded from here (:meth:`forward`), as placement() chooses."""
        message, key, scheduler = dispatch.message, dispatch.key, parts.scheduler
        facts = self._facts(before_compute=True, credited=action.expect is Expect.ABSORB_ACK)
        if placement(Step.WRITE_DOWN, dispatch.rule, facts) is Performer.RUNTIME_THREAD:
            forward = Forward(message, action.expect, dispatch.ticket, key, received_us, trio.current_time(),
                              direct=dispatch.direct)
            await self.write_through(gate, scheduler, forward, item)
            return
        result, queue_us = await scheduler.execute(item)
        control.note_recorded(parts, result, message)
        outgoing = lane_messages.forwarded(message, result, self.settings.wire_dtype, scheduler.executor.output_flag)
        await self.forward(Forward(outgoing, action.expect, dispatch.ticket, key, received_us, trio.current_time(),
                                   result.compute_us, queue_us, result.batch_size, direct=dispatch.direct))

    async def forward(self, item: Forward) -> None:
        """Send ``item`` downstream: queued to the forward task, or (shortcut) written here when the
        forward task is idle, the frame needs no credit and no simulated wire delays it.

        Writing here keeps frame order and a single writer: only the one task handling messages
        calls this, so with nothing queued to the forward task no other write can start before
        this one ends.
        """
        if placement(Step.WRITE_DOWN, None, self._facts(credited=item.expect is Expect.ABSORB_ACK)) \
                is Performer.HANDLING_TASK:
            self.lane.forward_backlog = 1
            try:
                await self.write(item)
            finally:
                self.lane.forward_backlog = 0
            return
        await self.queue(item)

    async def forward_activations(self, forwards: trio.MemoryReceiveChannel[Forward]) -> None:
        lane, stats = self.lane, self.stats
        try:
            async with forwards:
                while True:
                    try:
                        item = await take(forwards)
                    except trio.EndOfChannel:  # compute finished
                        return
                    if item.expect is Expect.ABSORB_ACK:
                        if not lane.take_credit():
                            stats.credit_waits += 1
                            while not lane.take_credit():
                                self._credit_returned = trio.Event()
                                await self._credit_returned.wait()
                        if lane.credits_in_use > stats.max_pending_prefill_acks:
                            stats.max_pending_prefill_acks = lane.credits_in_use
                            stats.touch()
                    await self.write(item)
                    lane.forward_backlog -= 1
        finally:
            lane.forwarding_done = True
            if not lane.expecting and self._relay_idle:
                self._relay_scope.cancel()  # the relay waits for a reply nobody will send

    async def write(self, item: Forward) -> None:
        """Encode ``item``'s frame in the wire dtype, note its expected reply, write it downstream."""
        io = self.io
        assert io is not None
        message = item.message
        if not message.state.flags & SKIPPY_EXTENSIONS_FLAG:  # §2: always flag downstream
            message = item.message = with_extensions_flag(message)
        frame = codec.encode_message(message, self.settings.wire_dtype, self.settings.width)
        item.frame_bytes = len(frame)
        self.lane.frame_forwarding(item)
        item.sent_us = started = now_us()
        wire = self.settings.wire
        if wire.active:
            await wire.write(io, frame, self.name, item.enqueued_at)
        else:
            await send_frame(io, frame, self.name, downstream=True)
        item.write_us = now_us() - started
        self.stats.forward_write_us += item.write_us
        if item.direct:
            self.lane.direct_written(item)
            self._direct_left()

    async def write_through(self, gate: StreamGate, scheduler: Scheduler, forward: Forward, item: WorkItem) -> None:
        """Execute ``item`` and have the runtime thread write ``forward``'s frame the moment its
        compute ends (:mod:`skippy.stage.write_through`; placement chose it: nothing is queued to
        the forward task, which stays idle until the frame is out)."""
        message, lane, settings = forward.message, self.lane, self.settings
        wire_dtype, width, output_flag = settings.wire_dtype, settings.width, scheduler.executor.output_flag

        def build(result: WorkResult, queue_us: int) -> bytes:  # runtime thread
            outgoing = forward.message = lane_messages.forwarded(message, result, wire_dtype, output_flag)
            forward.compute_us, forward.queue_us, forward.batch_size = result.compute_us, queue_us, result.batch_size
            frame = codec.encode_message(outgoing, wire_dtype, width)
            forward.frame_bytes = len(frame)
            # Set before the write: the socket send releases the GIL, and the downstream's reply can
            # reach the relay task before sent() below runs; its wait was then measured from 0.
            forward.sent_us = perf_counter_ns() // 1000  # now_us(), inline on the decode walk
            return frame

        def sent(sent_us: int, write_us: int) -> None:  # runtime thread
            forward.sent_us, forward.write_us = sent_us, write_us

        assert self.io is not None
        through = WriteThrough(gate, self.io, build, sent)
        lane.forward_backlog = 1  # this lane's downstream writer until the frame is out
        lane.frame_forwarding(forward)  # before the frame can leave: its reply must find it
        await scheduler.execute(item, through)
        forward.write_us += await through.finish(self.name, downstream=True)
        lane.forward_backlog = 0
        self.stats.forward_write_us += forward.write_us
        self.stats.write_throughs += 1
        if forward.direct:  # shortcut 3 may carry the next ones from its frame
            lane.direct_written(forward, through.frame if settings.decode_relay else None)
            self._direct_left()
        elif (settings.decode_relay and forward.ticket is not None and RULES[forward.ticket.kind].relay
              and forward.ticket.run is None):  # hop by hop: once its reply is relayed (the connection's)
            lane.relay_frame = through.frame

    # -- step 4: relay -----------------------------------------------------------------------
    async def relay_replies(self) -> None:
        io = self.io
        assert io is not None
        with self._relay_scope:  # cancelled only while parked with nothing expected: then it ends
            self.reader = ReplyReader(io, self.name)
            await self._relay(self.reader)

    async def pause_relay(self) -> bool:
        """Move the relay task off the socket (waiting there for a reply's first byte: nothing of a
        reply read) until :meth:`resume_relay`: the decode relay reads the replies meanwhile (the
        lane's in flight too, :meth:`~skippy.lane.protocol.StageLane.hand_over`).  False: it is
        not waiting so (nothing is paused)."""
        parked, reader = self._parked, self.reader
        if parked is None or reader is None or reader.mid_reply:
            return False
        self._off, self._resume = trio.Event(), trio.Event()
        parked.cancel()
        await self._off.wait()
        if self._parked is None and self._resume is not None:
            if not reader.mid_reply:
                return True
            self.resume_relay()  # (part of a reply came before the cancel: the relay task reads on)
        return False

    def resume_relay(self) -> None:
        """Give the socket back to the relay task (after :meth:`pause_relay` returned True)."""
        resume, self._resume = self._resume, None
        if resume is not None:
            resume.set()

    async def _relay(self, reader: ReplyReader) -> None:
        lane, stats = self.lane, self.stats
        while True:
            expecting = lane.expecting
            if not expecting and lane.forwarding_done:
                return
            self._relay_idle = not expecting
            parked = self._parked = trio.CancelScope()
            try:
                with parked:  # (the decode relay may move it off the socket, replies expected or not)
                    reply, timings = await reader.next()
            finally:
                self._relay_idle = False
                self._parked = None
                off, self._off = self._off, None
                if off is not None:
                    if not parked.cancelled_caught:
                        self._resume = None  # (pause_relay sees it did not pause)
                    off.set()
            if parked.cancelled_caught:  # the decode relay reads the replies: wait for the socket
                resume = self._resume
                if resume is not None:
                    await resume.wait()
                continue
            relay = lane.downstream_replied(reply, self.name)
            item = relay.forward
            wait_us = max(0, now_us() - item.sent_us - item.write_us)
            stats.downstream_wait_us += wait_us
            stats.downstream_wait_histogram.observe(wait_us)
            if relay.absorb:  # an early-ACKed chunk's ACK: its stats kept, its credit back
                lane.absorbed(item, reply, wait_us)
                if self._credit_returned is not None:
                    self._credit_returned.set()
                    self._credit_returned = None
            else:
                await self._answer(relay, reply, timings, wait_us, reader.annotations)


def _read_downstream_file(path: object) -> object | None:
    """The address in a ``--downstream-file`` (None while it is missing, empty or unreadable)."""
    from skippy.net.address import Address

    try:
        text = Path(str(path)).read_text().strip()
        return Address.parse(text) if text else None
    except (OSError, ValueError) as exc:  # not written yet / half written: keep the configured one
        log.warning("downstream file %s unreadable (%s); using --downstream", path, exc)
        return None
