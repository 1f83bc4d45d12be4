"""Direct return on the final stage: the return lanes drivers open, and the writes into them.

Strategy (``docs/protocol.md`` §8; the per-kind rules are rows of
:data:`skippy.lane.protocol.RULES`): a driver that wants its predictions straight from the
final stage dials that stage and sends ``PredictionReturnOpen{request_id, session_id}`` with the
direct-return flag as the lane's first message.  That lane's upstream half
(:meth:`~skippy.stage.upstream.UpstreamLink.return_open`) registers a :class:`ReturnLane` here,
keyed by the **chain lane that carries the session** (the stage's one lane on which that session
id is open: the driver configured it first) and the session id, ACKs the open, and from then on
only reads (anything arriving is a refusal that closes the return lane alone).  A flagged message of a direct-return kind on that chain lane is answered
by writing the prediction (with the Timings frame, when the return lane negotiated the
extensions) into the return lane; no stage answers it up the chain.

Ownership and faults:

* A return lane is written by the chain lane that owns its session, under the return lane's lock
  (one writer at a time: the owner's handler, or the return lane's own Error frame at close).
* The owner closing (its upstream left, or it failed) closes its return lanes, with its Error
  frame when there is one, so a driver waiting on a return lane learns at once that the chain is
  gone.  A return lane closing (the driver left, or sent something) just unregisters it; a later
  flagged message for the session is then a refusal of the chain lane (:class:`ReturnLaneLost`).
* An open naming a session no lane has, or one that two lanes have (ambiguous), or a session that
  already has a return lane, is refused; other sessions carry on.
"""

from __future__ import annotations

from typing import Callable

import trio

from skippy.codec.protocol_ext import ErrorFrame
from skippy.lane.errors import InvalidMessage, ReturnLaneLost, StageError
from skippy.net.socket_io import SocketIO
from skippy.stage.extensions import send_error
from skippy.stage.transport import send_frame

__all__ = ["ReturnHub", "ReturnLane", "close_lanes"]


class ReturnLane:
    """One session's return lane (the stream a driver opened to the final stage)."""

    __slots__ = ("stream", "io", "peer", "extensions", "session_id", "request_id", "owner", "lock", "closed",
                 "relay_abort")

    def __init__(self, stream: trio.abc.Stream, io: SocketIO, peer: str, *, extensions: bool, session_id: int,
                 request_id: int) -> None:
        self.stream = stream
        self.io = io
        self.peer = peer
        #: The open carried the extension flag: Timings and Error frames may be sent on it.
        self.extensions = extensions
        self.session_id = session_id
        self.request_id = request_id
        #: Id of the chain lane that carries the session (set by :meth:`ReturnHub.open`).
        self.owner = -1
        self.lock = trio.Lock()
        self.closed = False
        #: Set while the chain lane's decode relay writes into this lane (it holds ``lock``): ends
        #: that run at once, even mid-write, so the lane can close (skippy.stage.decode_relay).
        self.relay_abort: Callable[[], None] | None = None

    async def send(self, frame: bytes, delay_s: float = 0.0) -> None:
        """Write one reply frame (``delay_s``: the simulated one-way wire delay, benchmarks).

        Raises:
            ReturnLaneLost: the return lane is closed or the write failed.
        """
        async with self.lock:
            if self.closed:
                raise ReturnLaneLost(f"the return lane of session {self.session_id} from {self.peer} is closed")
            if delay_s > 0:
                await trio.sleep(delay_s)
            try:
                await send_frame(self.io, frame, self.peer, downstream=False)
            except StageError as exc:  # the driver left or reset the return lane
                self.closed = True
                raise ReturnLaneLost(
                    f"the return lane of session {self.session_id} to {self.peer} failed a write") from exc


class ReturnHub:
    """The return lanes of one stage, by (owning chain lane id, session id).

    Args:
        owners_of: the ids of the chain lanes on which a session id is open.
    """

    __slots__ = ("_owners_of", "_lanes")

    def __init__(self, owners_of: Callable[[int], list[int]]) -> None:
        self._owners_of = owners_of
        self._lanes: dict[tuple[int, int], ReturnLane] = {}

    def __len__(self) -> int:
        return len(self._lanes)

    def open(self, lane: ReturnLane) -> None:
        """Register ``lane`` for its session.

        Raises:
            InvalidMessage: no lane has the session, more than one has it, or it has a return lane.
        """
        owners = self._owners_of(lane.session_id)
        if not owners:
            raise InvalidMessage(f"PredictionReturnOpen for unknown session {lane.session_id} "
                                 "(configure the session through the chain first)")
        if len(owners) > 1:
            raise InvalidMessage(f"PredictionReturnOpen for session {lane.session_id}, which {len(owners)} lanes "
                                 "carry: ambiguous")
        key = (owners[0], lane.session_id)
        if key in self._lanes:
            raise InvalidMessage(f"session {lane.session_id} already has a return lane")
        lane.owner = owners[0]
        self._lanes[key] = lane

    def get(self, owner: int, session_id: int) -> ReturnLane | None:
        """The return lane of ``session_id`` on chain lane ``owner`` (None: none is open)."""
        return self._lanes.get((owner, session_id))

    def remove(self, lane: ReturnLane) -> None:
        """Unregister ``lane`` (its own connection is closing); idempotent."""
        lane.closed = True
        if self._lanes.get((lane.owner, lane.session_id)) is lane:
            del self._lanes[lane.owner, lane.session_id]

    def detach(self, owner: int) -> list[ReturnLane]:
        """Unregister and return every return lane of chain lane ``owner`` (it is closing)."""
        lanes = [lane for key, lane in self._lanes.items() if key[0] == owner]
        for lane in lanes:
            del self._lanes[lane.owner, lane.session_id]
        return lanes


async def close_lanes(returns: ReturnHub, own: ReturnLane | None, lane_id: int, error: ErrorFrame | None) -> bool:
    """docs/protocol.md §8: a closing lane's return lanes.  A return lane (``own``) unregisters
    (a decode relay writing into it ends first) and waits for a prediction write in progress, so
    its own Error frame follows a whole reply; a chain lane (``lane_id``) closes its sessions'
    return lanes, each with its Error frame (when they negotiated it), so their drivers learn at
    once.  Returns True when ``own``'s write did not finish: no Error frame may follow it."""
    if own is not None:
        returns.remove(own)
        if own.relay_abort is not None:  # a decode relay writes into it: end that first
            own.relay_abort()
        with trio.move_on_after(0.5):  # a write into it that does not finish: no Error frame
            await own.lock.acquire()  # never released: nothing may write on it after the Error frame
            return False
        return True
    for lane in returns.detach(lane_id):
        async with lane.lock:
            lane.closed = True
            if error is not None and lane.extensions:
                await send_error(lane.io, error, lane_id)
        with trio.move_on_after(1):
            await trio.aclose_forcefully(lane.stream)
    return False
