"""A stage's half of liveness (``docs/protocol.md`` §13): answering heartbeats, watching its downstream.

Strategy:

* **Answering** (:func:`answer_heartbeats`): a lane whose first message is a heartbeat becomes a
  heartbeat lane; the receiving task (the event loop, never the runtime thread) answers it and
  every later heartbeat with a v11 Ack.  The lane brings no work (it rests in the scheduler's
  registry, so the decode shortcuts that need "this lane is the stage's only work" still apply)
  and carries nothing else: any other message closes it.
* **Watching** (:func:`watch_downstream`): a stage with a downstream heartbeats it
  (:func:`skippy.net.liveness.heartbeat`) for as long as it serves.  When the downstream is lost
  (closed, or silent for ``--heartbeat-timeout`` seconds: a stopped process or a partitioned
  host), every lane that has a downstream link is closed with ``DownstreamLost`` naming it, so its
  Error frame (``DOWNSTREAM_LOST``, origin = the lost stage's index and address) reaches the driver
  at once rather than when a reply would time out.  The watch then dials the same address again
  (the launcher's replacement listens there, or the ``--downstream-file`` names a new one).  A
  downstream that does not answer heartbeats (an older or plain v11 stage) is not watched (asked
  again every 10 s); one that answered before and now says nothing from its READY on is hung.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import trio

from skippy.codec.protocol import StageReply
from skippy.codec.protocol_ext import is_liveness_query
from skippy.lane.errors import DownstreamLost, InvalidMessage
from skippy.net.liveness import PERIOD, HeartbeatRefused, Loss, heartbeat
from skippy.net.address import Address
from skippy.net.socket_io import SocketIO
from skippy.stage.extensions import identity_for
from skippy.stage.transport import MessageReader, codec, send_frame

if TYPE_CHECKING:
    from skippy.stage.server import StageServer

log = logging.getLogger("skippy.stage")

_ACK = codec.encode_reply(StageReply.ack())
#: Seconds between dials of a downstream that is not up (yet, or again).
REDIAL = 0.1
#: Seconds before asking again a downstream that refused heartbeats (it may be replaced by one that answers).
REFUSED_RECHECK = 10.0


async def answer_heartbeats(reader: MessageReader, io: SocketIO, peer: str, release: Callable[[int], None]) -> None:
    """Answer the heartbeat just read and every later one until the peer closes the lane.

    Raises:
        InvalidMessage: anything but a heartbeat on the lane (it closes with an Error frame).
    """
    await send_frame(io, _ACK, peer, downstream=False)
    while True:
        message = await reader.next()
        if message is None:
            return
        release(reader.take_reserved() if reader.reserved else 0)
        if not is_liveness_query(message):
            raise InvalidMessage(f"{message.kind.reference_name} on a heartbeat lane: it carries heartbeats only "
                                 "(docs/protocol.md §13)")
        await send_frame(io, _ACK, peer, downstream=False)


def _downstream(server: StageServer) -> Address | None:
    from skippy.stage.downstream import _read_downstream_file

    settings = server.settings
    if settings.downstream_file is not None:
        found = _read_downstream_file(settings.downstream_file)
        if found is not None:
            return found  # type: ignore[return-value]
    return settings.downstream


async def watch_downstream(server: StageServer, silence: float) -> None:
    """Heartbeat the downstream while the stage serves; close the lanes using it when it is lost."""
    refused: dict[str, float] = {}
    answered: set[str] = set()  # addresses that answered heartbeats before: silence there is a hang
    while True:
        address = _downstream(server)
        if address is None:
            return
        key = str(address)
        if trio.current_time() < refused.get(key, -1.0):
            await trio.sleep(REDIAL)
            continue
        try:
            loss = await heartbeat(address, silence=silence, period=min(PERIOD, silence / 4),
                                   tls=server.settings.downstream_tls)
        except HeartbeatRefused as exc:
            if not (exc.silent and key in answered):
                log.info("downstream stage %s does not answer heartbeats (%s): not watched", address, exc)
                refused[key] = trio.current_time() + REFUSED_RECHECK
                continue
            loss = Loss(address, "silent", str(exc), time.monotonic(), time.monotonic())
        except OSError:  # not up: lanes that dial it fail on their own; a replacement will be
            await trio.sleep(REDIAL)
            continue
        answered.add(key)
        index = identity_for(server.executor).index
        name = f"stage {index + 1} ({address})" if index >= 0 else f"stage {address}"
        log.warning("downstream %s lost: %s; closing the lanes that use it", name, loss.describe())
        error = DownstreamLost(f"downstream {name} lost: {loss.describe()}")
        for connection in list(server.connections):
            if connection.link.stream is not None:
                connection.abort(error)
        server.stats.touch()
