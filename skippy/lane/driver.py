"""The driver's end of a lane, on the stage's rules: what each message it sends is answered with.

Strategy (h11's client side of one connection; sans-IO like the stage's :class:`StageLane`): a
stage answers a message by its kind's row of :data:`~skippy.lane.protocol.RULES` -- an ACK, a
PredictedToken (PredictedTokens for a verify window), either (TryRestorePrefillDecode), or
nothing (RetireVerifyWindow) -- and, for a flagged message of a ``direct_return`` row, over the
session's return lane instead of the chain (docs/protocol.md §8).  :class:`DriverLane` reads the
same table: ``sent(message)`` records what the message is owed and where, in send order;
``replied(reply, lane)`` matches a reply read on the chain lane (``lane=None``) or on session
``lane``'s return lane to the oldest message owed one there, and refuses a reply nothing is owed
or one of the wrong kind.  The connection (:mod:`skippy.driver.client`) moves the bytes.
"""

from __future__ import annotations

import collections
from typing import Final, NamedTuple, final

from skippy.codec.protocol import MessageKind, ReplyKind, StageMessage, StageReply
from skippy.codec.protocol_ext import DIRECT_RETURN_FLAG
from skippy.lane.protocol import RULES, Answer, Handling

__all__ = ["DriverLane", "LaneMismatch", "Owed", "expected_replies"]

_ACK: Final = (ReplyKind.ACK,)
_TOKEN: Final = (ReplyKind.PREDICTED_TOKEN,)
_TOKENS: Final = (ReplyKind.PREDICTED_TOKENS,)
_EITHER: Final = (ReplyKind.PREDICTED_TOKEN, ReplyKind.ACK)


class LaneMismatch(Exception):
    """A reply the rules do not allow here (the stage broke the protocol: the lane is unusable)."""


def expected_replies(message: StageMessage) -> tuple[ReplyKind, ...]:
    """The reply kinds a stage answers ``message`` with, by its kind's rule (() when none).

    Raises:
        LaneMismatch: a kind the stages refuse (StateImport, StateExport).
    """
    rule = RULES[MessageKind(message.kind)]
    if rule.handling is Handling.REFUSE:
        raise LaneMismatch(f"{MessageKind(message.kind).reference_name} is refused by every stage: {rule.refusal}")
    answer = rule.answer
    if answer is Answer.NONE:
        return ()
    if answer is Answer.ACK:
        return _ACK
    if answer is Answer.PREDICTION:
        return _TOKENS if rule.window else _TOKEN
    return _EITHER


@final
class Owed(NamedTuple):
    """A message still owed a reply: what it was, the kinds that may answer it, on which lane
    (None: the chain lane; else the session whose return lane carries it)."""

    message: StageMessage
    kinds: tuple[ReplyKind, ...]
    lane: int | None


class DriverLane:
    """The driver's end of one chain lane and its sessions' return lanes (see the module header)."""

    __slots__ = ("_owed", "direct_sessions")

    def __init__(self) -> None:
        #: Messages owed a reply, per lane (None: the chain lane), in send order.
        self._owed: dict[int | None, collections.deque[Owed]] = {None: collections.deque()}
        #: Sessions whose flagged messages are answered over their return lane (§8).
        self.direct_sessions: set[int] = set()

    def owed(self, lane: int | None = None) -> int:
        """Replies still to come on ``lane`` (None: the chain lane)."""
        queue = self._owed.get(lane)
        return len(queue) if queue is not None else 0

    def sent(self, message: StageMessage) -> Owed | None:
        """``message`` was sent on the chain lane: what it is owed (None: no reply).

        Raises:
            LaneMismatch: a refused kind, or a direct-return flag on a session with no return lane.
        """
        kinds = expected_replies(message)
        if not kinds:
            return None
        lane: int | None = None
        if message.state.flags & DIRECT_RETURN_FLAG and RULES[MessageKind(message.kind)].direct_return:
            if message.session_id not in self.direct_sessions:
                raise LaneMismatch(f"{MessageKind(message.kind).reference_name} flagged for direct return, but "
                                   f"session {message.session_id} has no return lane open")
            lane = message.session_id
        owed = Owed(message, kinds, lane)
        self._owed.setdefault(lane, collections.deque()).append(owed)
        return owed

    def replied(self, reply: StageReply, lane: int | None = None) -> Owed:
        """A reply was read on ``lane`` (None: the chain lane): the message it answers.

        Raises:
            LaneMismatch: nothing is owed a reply there, or the reply is of a kind the oldest
                message owed one cannot take.
        """
        queue = self._owed.get(lane)
        where = "the chain lane" if lane is None else f"session {lane}'s return lane"
        if not queue:
            raise LaneMismatch(f"{ReplyKind(reply.kind).reference_name} on {where} with no message owed a reply")
        owed = queue[0]
        if reply.kind not in owed.kinds:
            raise LaneMismatch(f"{ReplyKind(reply.kind).reference_name} on {where} answers "
                               f"{MessageKind(owed.message.kind).reference_name}; expected "
                               + " or ".join(ReplyKind(kind).reference_name for kind in owed.kinds))
        queue.popleft()
        return owed

    def return_lane_opened(self, session_id: int) -> None:
        """Session ``session_id``'s return lane was ACKed: its flagged messages are answered there."""
        self.direct_sessions.add(session_id)
        self._owed.setdefault(session_id, collections.deque())

    def return_lane_closed(self, session_id: int) -> None:
        """Session ``session_id``'s return lane is gone (what it still owed is forgotten)."""
        self.direct_sessions.discard(session_id)
        self._owed.pop(session_id, None)
