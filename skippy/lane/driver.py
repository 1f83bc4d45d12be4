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

Decode runs (docs/protocol.md §11, the stage's side is :mod:`skippy.lane.decode_run`): a
DecodeEmbd flagged ``DECODE_RUN`` is owed one PredictedToken; when the stage says it runs it
(the SamplingAccepted frame before that reply carries ``DECODE_RUN_FEATURE``: ``replied``'s
``features``) the lane holds a :class:`DriverRun`, and every following PredictedToken on the chain
lane is the run's next prediction, until the run ends by the same rules as the stage's (its budget,
a stop token).  A message for the run's session ends it early: the predictions of steps the stage
had started come before that message's reply and are marked ``overshoot`` (counted, dropped).
What the stage's order would make ambiguous is refused when sent: any other message while a run
starts or runs (its replies would interleave with the run's), and a message for the run's
session that is answered by a prediction or not at all.
"""

from __future__ import annotations

import collections
from typing import Final, NamedTuple, final

from skippy.codec.decode_run import DecodeRunRequest
from skippy.codec.protocol import MessageKind, ReplyKind, StageMessage, StageReply
from skippy.codec.protocol_ext import DECODE_RUN_FEATURE, DECODE_RUN_FLAG, DIRECT_RETURN_FLAG
from skippy.lane.protocol import RULES, Answer, Handling, KindRule

__all__ = ["DriverLane", "DriverRun", "LaneMismatch", "Owed", "expected_replies"]

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
    try:
        kinds = _EXPECTED[message.kind]
    except KeyError:
        raise LaneMismatch(f"unknown message kind {message.kind}") from None
    if kinds is None:
        kind = MessageKind(message.kind)
        raise LaneMismatch(f"{kind.reference_name} is refused by every stage: {RULES[kind].refusal}")
    return kinds


def _replies_of(rule: KindRule) -> tuple[ReplyKind, ...] | None:
    if rule.handling is Handling.REFUSE:
        return None
    answer = rule.answer
    if answer is Answer.NONE:
        return ()
    if answer is Answer.ACK:
        return _ACK
    if answer is Answer.PREDICTION:
        return _TOKENS if rule.window else _TOKEN
    return _EITHER


#: The reply kinds per kind, None for a refused kind (the per-token path: one dict lookup).
_EXPECTED: Final[dict[int, tuple[ReplyKind, ...] | None]] = {
    int(kind): _replies_of(rule) for kind, rule in RULES.items()}


class DriverRun:
    """The driver's view of a decode run the first stage runs (§11): predictions still to come.

    Args:
        message: the run's flagged DecodeEmbd.
        request: what it asks for (its budget, its stop tokens).
    """

    __slots__ = ("message", "session_id", "left", "stop_tokens", "position")

    def __init__(self, message: StageMessage, request: DecodeRunRequest) -> None:
        self.message = message
        self.session_id = message.session_id
        #: Predictions still to come, the one in flight included.
        self.left = request.max_tokens
        self.stop_tokens = request.stop_tokens
        #: The position the next prediction would be fed at (the KV length the per-token loop leaves).
        self.position = message.pos_start

    def advance(self, token: int) -> bool:
        """One prediction arrived; whether the run goes on (the stage's rule, :meth:`DecodeRun.advance`)."""
        self.left -= 1
        self.position += 1
        return self.left > 0 and token not in self.stop_tokens


@final
class Owed(NamedTuple):
    """A message still owed a reply: what it was, the kinds that may answer it, on which lane
    (None: the chain lane; else the session whose return lane carries it)."""

    message: StageMessage
    kinds: tuple[ReplyKind, ...]
    lane: int | None
    #: §11: the decode run the reply belongs to: the one a flagged DecodeEmbd asks for, or the
    #: run whose next prediction it is (None: not a run's).
    run: DriverRun | None = None
    #: §11: a prediction of a step the stage started before the message that ended its run (drop it).
    overshoot: bool = False


class DriverLane:
    """The driver's end of one chain lane and its sessions' return lanes (see the module header)."""

    __slots__ = ("_owed", "direct_sessions", "run", "_starting", "_ender", "run_overshoot")

    def __init__(self) -> None:
        #: Messages owed a reply, per lane (None: the chain lane), in send order.
        self._owed: dict[int | None, collections.deque[Owed]] = {None: collections.deque()}
        #: Sessions whose flagged messages are answered over their return lane (§8).
        self.direct_sessions: set[int] = set()
        #: §11: the run in progress on the chain lane (None: none); the flagged message still owed
        #: its first reply; the message that ended a run, its overshoot still to drop before its reply.
        self.run: DriverRun | None = None
        self._starting: Owed | None = None
        self._ender: Owed | None = None
        #: §11: predictions read and dropped because a message ended their run early.
        self.run_overshoot = 0

    def direct(self, kind: MessageKind, session_id: int) -> bool:
        """Whether a message of ``kind`` for ``session_id`` is sent flagged for direct return (its
        kind's row allows it and the session's return lane is open)."""
        return session_id in self.direct_sessions and RULES[kind].direct_return

    def owed(self, lane: int | None = None) -> int:
        """Replies still to come on ``lane`` (None: the chain lane)."""
        queue = self._owed.get(lane)
        return len(queue) if queue is not None else 0

    def sent(self, message: StageMessage) -> Owed | None:
        """``message`` was sent on the chain lane: what it is owed (None: no reply).

        Raises:
            LaneMismatch: a refused kind, a direct-return flag on a session with no return lane,
                or a message a decode run makes ambiguous (see the module header).
        """
        kinds = expected_replies(message)
        run: DriverRun | None = None
        if self.run is not None or self._starting is not None:
            self._run_interrupted(message, kinds)
        elif message.state.flags & DECODE_RUN_FLAG:
            run = self._run_of(message)
        if not kinds:
            return None
        lane: int | None = None
        if message.state.flags & DIRECT_RETURN_FLAG and RULES[message.kind].direct_return:
            if message.session_id not in self.direct_sessions:
                raise LaneMismatch(f"{MessageKind(message.kind).reference_name} flagged for direct return, but "
                                   f"session {message.session_id} has no return lane open")
            lane = message.session_id
        owed = Owed(message, kinds, lane, run)
        self._owed.setdefault(lane, collections.deque()).append(owed)
        if run is not None:
            self._starting = owed
        elif self.run is not None:  # (_run_interrupted let it through: it ends the run)
            self._ender, self.run = owed, None
        return owed

    def _run_of(self, message: StageMessage) -> DriverRun:
        """The run a flagged message asks for (the stage's checks of :mod:`skippy.lane.protocol`)."""
        where = f"{MessageKind(message.kind).reference_name} with the decode-run flag"
        if not RULES[message.kind].decode_run:
            raise LaneMismatch(f"{where}: a decode run starts with a DecodeEmbd only")
        if message.state.flags & DIRECT_RETURN_FLAG:
            raise LaneMismatch(f"{where}: a decode run cannot also ask for direct return")
        try:
            return DriverRun(message, DecodeRunRequest.from_metadata(message.chat_sampling_metadata))
        except ValueError as exc:
            raise LaneMismatch(f"{where}: {exc}") from None

    def _run_interrupted(self, message: StageMessage, kinds: tuple[ReplyKind, ...]) -> None:
        """``message`` is sent while a run starts or runs: let through only what ends it unambiguously."""
        name = MessageKind(message.kind).reference_name
        if self._starting is not None:
            raise LaneMismatch(f"{name} sent before the decode run of session {self._starting.message.session_id} "
                               "answered its first step")
        run = self.run
        assert run is not None
        if message.session_id != run.session_id:
            raise LaneMismatch(f"{name} for session {message.session_id} while the decode run of session "
                               f"{run.session_id} is in progress: its reply would interleave with the run's")
        if not kinds or ReplyKind.PREDICTED_TOKEN in kinds:
            raise LaneMismatch(f"{name} would end the decode run of session {run.session_id} with no reply "
                               "telling the run's last predictions from its own: end the run first (Stop or Trim)")

    def replied(self, reply: StageReply, lane: int | None = None, *, features: int = 0) -> Owed:
        """A reply was read on ``lane`` (None: the chain lane): the message it answers
        (``features``: those of the SamplingAccepted frame before it, 0 when none came).

        Raises:
            LaneMismatch: nothing is owed a reply there, or the reply is of a kind the oldest
                message owed one (or the run in progress) cannot take.
        """
        queue = self._owed.get(lane)
        where = "the chain lane" if lane is None else f"session {lane}'s return lane"
        if lane is None and self.run is not None and not queue:  # §11: the run's next prediction
            run = self.run
            if reply.kind != ReplyKind.PREDICTED_TOKEN:
                self.run = None
                raise LaneMismatch(f"{ReplyKind(reply.kind).reference_name} on {where} inside the decode run of "
                                   f"session {run.session_id}")
            if not run.advance(reply.predicted):
                self.run = None
            return Owed(run.message, _TOKEN, None, run)
        if not queue:
            raise LaneMismatch(f"{ReplyKind(reply.kind).reference_name} on {where} with no message owed a reply")
        owed = queue[0]
        ender = self._ender
        if ender is owed and reply.kind == ReplyKind.PREDICTED_TOKEN and ReplyKind.PREDICTED_TOKEN not in owed.kinds:
            self.run_overshoot += 1  # a step the stage started before the message that ended its run
            return Owed(owed.message, _TOKEN, None, None, overshoot=True)
        if reply.kind not in owed.kinds:
            raise LaneMismatch(f"{ReplyKind(reply.kind).reference_name} on {where} answers "
                               f"{MessageKind(owed.message.kind).reference_name}; expected "
                               + " or ".join(ReplyKind(kind).reference_name for kind in owed.kinds))
        queue.popleft()
        if ender is owed:
            self._ender = None
        elif owed.lane is not None and owed.message.kind == MessageKind.PREDICTION_RETURN_OPEN:  # its open
            self.return_lane_opened(owed.lane)
        elif owed is self._starting:
            self._starting = None
            run = owed.run
            assert run is not None
            if features & DECODE_RUN_FEATURE and run.advance(reply.predicted):
                self.run = run  # the stage runs it (a stage that does not answered one step)
        return owed

    def return_lane_opening(self, message: StageMessage) -> Owed:
        """A PredictionReturnOpen was sent on a new return lane for its session: it is owed an ACK
        there, and the session's flagged messages are answered over that lane once it comes.

        Raises:
            LaneMismatch: the session has a return lane, or one is opening.
        """
        session_id = message.session_id
        if session_id in self.direct_sessions or self._owed.get(session_id):
            raise LaneMismatch(f"session {session_id} already has a return lane")
        owed = Owed(message, _ACK, session_id)
        self._owed[session_id] = collections.deque((owed,))
        return owed

    def return_lane_opened(self, session_id: int) -> None:
        """Session ``session_id``'s return lane was ACKed: its flagged messages are answered there."""
        self.direct_sessions.add(session_id)
        self._owed.setdefault(session_id, collections.deque())

    def return_lane_closed(self, session_id: int) -> None:
        """Session ``session_id``'s return lane is gone (what it still owed is forgotten)."""
        self.direct_sessions.discard(session_id)
        self._owed.pop(session_id, None)
