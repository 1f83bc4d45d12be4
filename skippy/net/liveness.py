"""Liveness: heartbeats to a stage, and the chain's "stage lost / stage ready again" events.

Strategy (the wire side is ``docs/protocol.md`` §13):

* **Heartbeats** (:func:`heartbeat`): a small connection of its own to the watched stage.  Dial,
  read READY, then send a heartbeat (a PredictionReturnOpen flagged ``SKIPPY_EXTENSIONS |
  LIVENESS``) every ``period`` seconds; the stage answers each with a v11 Ack from its event loop
  (never its runtime thread, so a long prefill does not delay the answer).  The watch ends with a
  :class:`Loss`: ``closed`` when the connection ends or is reset (a killed process: the kernel
  closes its sockets, so this is seen at once), ``silent`` when no Ack came for ``silence``
  seconds (a stopped process or a partitioned host, which TCP keepalive cannot see: the kernel
  still ACKs).  Nothing of it touches a lane, so the decode path pays nothing.
* **Older peers**: an older skippy stage refuses the heartbeat with an Error frame and a plain v11
  stage parks it unanswered; either way the first heartbeat gets no Ack, and :func:`heartbeat`
  raises :class:`HeartbeatRefused` (the caller stops watching that peer) instead of reporting a loss.
* **Events** (:class:`ChainEvents`): whoever replaces stages (``skippy up``,
  :mod:`skippy.deploy.launch`) publishes :class:`StageEvent` records; the API's health and a
  resuming driver read them: :meth:`ChainEvents.lost` (which stages are down now),
  :meth:`ChainEvents.wait_ready` (until a stage is back), :meth:`ChainEvents.subscribe` (every event).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import ssl
import time
from typing import Final, Literal

import trio

from skippy.codec import wire as codec
from skippy.codec.protocol import END_OF_STREAM, NEED_DATA, StageReply, WireDType, WireError, check_ready
from skippy.codec.protocol_ext import ErrorFrame, liveness_query
from skippy.net.address import Address
from skippy.net.socket_io import set_no_delay
from skippy.net.tls import handshake_as_client

log = logging.getLogger("skippy.liveness")

#: Seconds between heartbeats.
PERIOD: Final = 0.3
#: Seconds without an Ack after which a stage is lost (detection of a hang within PERIOD more).
SILENCE: Final = 1.2
#: Seconds to dial a stage and read its READY.
CONNECT_TIMEOUT: Final = 2.0

LossReason = Literal["closed", "silent"]


class HeartbeatRefused(Exception):
    """The peer does not answer heartbeats (a plain v11 or an older skippy stage): not a loss.

    ``silent``: it said nothing at all (a v11 stage parks the heartbeat; a stage stopped right
    after READY looks the same), rather than refusing or closing.
    """

    def __init__(self, text: str, *, silent: bool = False) -> None:
        super().__init__(text)
        self.silent = silent


@dataclasses.dataclass(frozen=True, slots=True)
class Loss:
    """How a watched stage was lost."""

    address: Address
    reason: LossReason
    detail: str
    #: ``time.monotonic()`` of the last Ack (the last sign of life) and of the detection.
    last_seen: float
    detected: float

    def describe(self) -> str:
        if self.reason == "silent":
            return f"{self.address} answered no heartbeat for {self.detected - self.last_seen:.2f} s ({self.detail})"
        return f"{self.address} closed its heartbeat connection ({self.detail})"


async def heartbeat(address: Address, *, period: float = PERIOD, silence: float = SILENCE,
                    connect_timeout: float = CONNECT_TIMEOUT, tls: ssl.SSLContext | None = None,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> Loss:
    """Watch the stage at ``address`` until it is lost; ``task_status`` is started at its first Ack.

    Returns:
        The loss (``closed`` or ``silent``).

    Raises:
        OSError: the stage cannot be dialled, or closed before READY; TimeoutError (an OSError):
            the dial or READY took longer than ``connect_timeout`` (what a stopped process does).
        HeartbeatRefused: it answered the first heartbeat with something else than an Ack, or
            not within ``silence`` (module notes: an older peer).
    """
    with trio.move_on_after(connect_timeout) as dialled:
        stream: trio.abc.Stream = await trio.open_tcp_stream(address.host, address.port)
        set_no_delay(stream)  # type: ignore[arg-type]
        if tls is not None:
            stream = await handshake_as_client(stream, tls, address.host)  # type: ignore[arg-type]
        ready = b""
        try:
            while len(ready) < 4:
                chunk = await stream.receive_some(4 - len(ready))
                if not chunk:
                    raise OSError(f"stage {address} closed the connection before READY")
                ready += chunk
            check_ready(ready)
        except (WireError, trio.BrokenResourceError) as exc:
            await trio.aclose_forcefully(stream)
            raise OSError(f"{address}: no READY ({exc})") from exc
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
    if dialled.cancelled_caught:
        raise TimeoutError(f"stage {address} gave no READY within {connect_timeout:g} s")
    ping = codec.encode_message(liveness_query(), WireDType.F32, 0)
    decoder = codec.ReplyDecoder(extensions=True)
    async with stream:
        async with trio.open_nursery() as nursery:  # raises nothing of its own: the outcome is returned below
            nursery.start_soon(_send_beats, stream, ping, period)
            try:
                outcome = await _read_acks(stream, decoder, address, silence, task_status)
            finally:
                nursery.cancel_scope.cancel()
    if isinstance(outcome, HeartbeatRefused):
        raise outcome
    return outcome


async def _send_beats(stream: trio.abc.Stream, ping: bytes, period: float) -> None:
    """A heartbeat every ``period`` seconds until the stream breaks (the reader then sees why)."""
    try:
        while True:
            await stream.send_all(ping)
            await trio.sleep(period)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


async def _read_acks(stream: trio.abc.Stream, decoder: codec.ReplyDecoder, address: Address, silence: float,
                     task_status: trio.TaskStatus[None]) -> Loss | HeartbeatRefused:
    """Read Acks until the stage is lost (the Loss) or turns out not to answer heartbeats."""
    last_seen = time.monotonic()
    answered = 0

    def lost(reason: LossReason, detail: str) -> Loss:
        return Loss(address, reason, detail, last_seen, time.monotonic())

    while True:
        data = None
        with trio.move_on_after(max(0.0, last_seen + silence - time.monotonic())):
            try:
                data = await stream.receive_some(4096)
            except (trio.BrokenResourceError, OSError) as exc:
                if not answered:
                    return HeartbeatRefused(f"{address} reset the heartbeat lane unanswered: {exc}")
                return lost("closed", f"reset: {exc}")
        if data is None:
            if not answered:
                return HeartbeatRefused(f"{address} answered no heartbeat within {silence:g} s", silent=True)
            return lost("silent", f"last Ack {time.monotonic() - last_seen:.2f} s ago")
        if not data:
            if not answered:
                return HeartbeatRefused(f"{address} closed the heartbeat lane unanswered")
            return lost("closed", "end of stream")
        decoder.receive_data(data)
        while True:
            try:
                frame = decoder.next_reply()
            except WireError as exc:
                return HeartbeatRefused(f"{address} answered a heartbeat with an invalid frame: {exc}")
            if frame is NEED_DATA or frame is END_OF_STREAM:
                break
            if type(frame) is StageReply:
                last_seen = time.monotonic()
                answered += 1
                if answered == 1:
                    task_status.started()
            elif isinstance(frame, ErrorFrame):
                if not answered:
                    return HeartbeatRefused(f"{address} refused heartbeats: {frame.describe()}")
                return lost("closed", frame.describe())


@dataclasses.dataclass(frozen=True, slots=True)
class StageEvent:
    """Stage ``index`` (at ``address``) was lost, or is ready again (a replacement on the same address)."""

    kind: Literal["lost", "ready"]
    index: int
    address: Address
    #: ``time.monotonic()`` and ``time.time()`` of the event.
    at: float
    wall: float
    #: Why it was lost, or how it came back ("restarted", "standby"), with the figures.
    detail: str = ""
    #: For a "ready" event: seconds from the loss to ready again (nan otherwise).
    outage_s: float = math.nan

    def __str__(self) -> str:
        if self.kind == "lost":
            return f"stage {self.index} ({self.address}) lost: {self.detail}"
        return f"stage {self.index} ({self.address}) ready again after {self.outage_s:.2f} s: {self.detail}"


class ChainEvents:
    """The chain's loss and recovery events (published by a launcher, read by the API and driver)."""

    def __init__(self, history: int = 256) -> None:
        self.history: collections.deque[StageEvent] = collections.deque(maxlen=history)
        self._lost: dict[int, StageEvent] = {}
        self._changed = trio.Event()
        self._subscribers: list[trio.MemorySendChannel[StageEvent]] = []

    def lost(self) -> dict[int, StageEvent]:
        """The stages lost now (index → its loss event)."""
        return dict(self._lost)

    def publish(self, event: StageEvent) -> None:
        """Record ``event`` and wake every waiter (sync: callable from any task of the run)."""
        self.history.append(event)
        if event.kind == "lost":
            self._lost[event.index] = event
        else:
            self._lost.pop(event.index, None)
        changed, self._changed = self._changed, trio.Event()
        changed.set()
        for channel in list(self._subscribers):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:  # a subscriber that does not read loses events, never blocks this
                pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(channel)

    def subscribe(self, buffer: int = 64) -> trio.MemoryReceiveChannel[StageEvent]:
        """Every event published from now on (close the channel when done)."""
        send, receive = trio.open_memory_channel[StageEvent](buffer)
        self._subscribers.append(send)
        return receive

    async def wait_ready(self, index: int) -> StageEvent | None:
        """Until stage ``index`` is not lost; its "ready" event (None: it was not lost)."""
        if index not in self._lost:
            return None
        while index in self._lost:
            await self._changed.wait()
        return next((e for e in reversed(self.history) if e.index == index and e.kind == "ready"), None)

    async def wait_lost(self, index: int | None = None) -> StageEvent:
        """Until stage ``index`` (any stage: None) is lost; its "lost" event."""
        while True:
            for event in self._lost.values():
                if index is None or event.index == index:
                    return event
            await self._changed.wait()
