"""The driver's end and the stage's end of a lane, in memory, on the same rules (h11's pair test).

A :class:`~skippy.lane.driver.DriverLane` sends every kind a stage serves, encoded with the wire
codec; a final stage's :class:`~skippy.lane.protocol.StageLane` decodes them, does what its rules
say (early ACKs, answers, the direct-return path into a return lane) with a stand-in compute, and
writes its replies in message order; the driver matches every reply to the message it answers.
No socket, no runtime.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skippy.codec import wire as codec
from skippy.codec.protocol import END_OF_STREAM, NEED_DATA, MessageKind, ReplyKind, StageMessage, StageReply, WireDType
from skippy.codec.protocol_ext import DIRECT_RETURN_FLAG, SKIPPY_EXTENSIONS_FLAG
from skippy.lane.driver import DriverLane, LaneMismatch, expected_replies
from skippy.lane.protocol import RULES, Answer, Handling, ReplyUpstream, StageLane

WIDTH = 4


def _message(kind: MessageKind, *, session: int = 1, position: int = 0, count: int = 1, direct: bool = False
             ) -> StageMessage:
    tokens = np.arange(1, count + 1, dtype=np.int32) if kind in (
        MessageKind.PREFILL_EMBD, MessageKind.PREFILL_FINAL_EMBD, MessageKind.DECODE_EMBD, MessageKind.DECODE_READOUT,
        MessageKind.DECODE_LIGHT_CTX, MessageKind.DECODE_REPLAY_EMBD, MessageKind.DECODE_REPLAY_FINAL_EMBD,
        MessageKind.VERIFY_WINDOW, MessageKind.PROBE_PREFILL, MessageKind.RESTORE_PREFILL,
        MessageKind.TRY_RESTORE_PREFILL, MessageKind.TRY_RESTORE_PREFILL_DECODE) else np.zeros(0, np.int32)
    message = StageMessage.create(kind, pos_start=position, token_count=count if tokens.size else 0,
                                  session_id=session, tokens=tokens)
    flags = message.state.flags | SKIPPY_EXTENSIONS_FLAG | (DIRECT_RETURN_FLAG if direct else 0)
    return dataclasses.replace(message, state=dataclasses.replace(message.state, flags=flags))


class Pair:
    """A driver lane and a final stage's lane joined by bytes (a chain lane and return lanes)."""

    def __init__(self) -> None:
        self.driver = DriverLane()
        self.stage = StageLane(1, 2)
        self.chain = codec.ReplyDecoder(extensions=True)
        self.returns: dict[int, codec.ReplyDecoder] = {}
        self.answered: list[tuple[MessageKind, ReplyKind, int | None]] = []

    def open_return_lane(self, session: int) -> None:
        lane = StageLane(2, 2)
        opener = _message(MessageKind.PREDICTION_RETURN_OPEN, session=session, direct=True)
        dispatch, _ = lane.received(self._wire(opener), run_flagged=False, is_first=True)
        assert dispatch is not None and dispatch.rule.handling is Handling.RETURN_OPEN and lane.return_lane
        action = lane.computed(dispatch, has_downstream=False, forwarded=False)
        assert action == ReplyUpstream(Answer.ACK)
        decoder = self.returns[session] = codec.ReplyDecoder(extensions=True)
        decoder.receive_data(self._written(lane, dispatch.ticket, StageReply.ack()))  # type: ignore[arg-type]
        assert decoder.next_reply().kind == ReplyKind.ACK  # type: ignore[union-attr]
        self.driver.return_lane_opened(session)

    @staticmethod
    def _wire(message: StageMessage) -> StageMessage:
        decoder = codec.MessageDecoder(WIDTH)
        decoder.receive_data(codec.encode_message(message, WireDType.F32, WIDTH))
        decoded = decoder.next_message()
        assert isinstance(decoded, StageMessage)
        return decoded

    @staticmethod
    def _written(lane: StageLane, ticket: object, reply: StageReply) -> bytes:
        due = lane.reply_ready(ticket, reply)  # type: ignore[arg-type]
        data = b"".join(codec.encode_reply(t.reply) for t in due)  # type: ignore[arg-type]
        while due:
            due = lane.replies_written(len(due))
            data += b"".join(codec.encode_reply(t.reply) for t in due)  # type: ignore[arg-type]
        return data

    def send(self, *messages: StageMessage) -> None:
        """The driver sends ``messages`` at once; the stage handles them in order."""
        for message in messages:
            self.driver.sent(message)
        for message in messages:
            dispatch, _ = self.stage.received(self._wire(message), run_flagged=False, is_first=True)
            assert dispatch is not None
            if dispatch.early_ack:
                self.chain.receive_data(self._written(self.stage, dispatch.ticket, StageReply.ack()))
            action = self.stage.computed(dispatch, has_downstream=False)
            if type(action) is not ReplyUpstream:
                continue
            if action.answer is Answer.ACK or dispatch.rule.answer is Answer.PREDICTION_OR_ACK:
                reply = StageReply.ack()  # (a prefix-cache miss on a TryRestorePrefillDecode)
            elif action.window:
                reply = StageReply.predicted_token_vector((5,) * dispatch.message.token_count,
                                                          window_id=dispatch.message.state.seq_id)
            else:
                reply = StageReply.predicted_token(7)
            if action.direct:
                self.returns[dispatch.message.session_id].receive_data(codec.encode_reply(reply))
                self.stage.direct_done()
            else:
                self.chain.receive_data(self._written(self.stage, dispatch.ticket, reply))
        self._read(self.chain, None)
        for session, decoder in self.returns.items():
            self._read(decoder, session)

    def _read(self, decoder: codec.ReplyDecoder, lane: int | None) -> None:
        while (reply := decoder.next_reply()) is not NEED_DATA and reply is not END_OF_STREAM:
            assert isinstance(reply, StageReply)
            owed = self.driver.replied(reply, lane)
            self.answered.append((MessageKind(owed.message.kind), ReplyKind(reply.kind), lane))


def test_every_kind_a_stage_serves_is_answered_as_the_driver_expects() -> None:
    pair = Pair()
    pair.send(_message(MessageKind.CONFIGURE_GENERATION))
    pair.send(_message(MessageKind.PREFILL_EMBD, count=4), _message(MessageKind.PREFILL_EMBD, position=4, count=4),
              _message(MessageKind.PREFILL_FINAL_EMBD, position=8, count=2))
    pair.send(_message(MessageKind.DECODE_EMBD, position=10), _message(MessageKind.VERIFY_WINDOW, position=11, count=3),
              _message(MessageKind.RETIRE_VERIFY_WINDOW, position=11, count=3))
    pair.send(*(_message(kind, position=11) for kind in (
        MessageKind.DECODE_READOUT, MessageKind.DECODE_LIGHT_CTX, MessageKind.DECODE_REPLAY_EMBD,
        MessageKind.DECODE_REPLAY_FINAL_EMBD, MessageKind.TRIM_SESSION, MessageKind.PROBE_PREFILL,
        MessageKind.RESTORE_PREFILL, MessageKind.TRY_RESTORE_PREFILL, MessageKind.TRY_RESTORE_PREFILL_DECODE)))
    pair.open_return_lane(1)
    pair.send(_message(MessageKind.DECODE_EMBD, position=12, direct=True),
              _message(MessageKind.VERIFY_WINDOW, position=13, count=2, direct=True),
              _message(MessageKind.TRIM_SESSION, direct=True))  # (a control kind: the flag means nothing)
    pair.send(_message(MessageKind.STOP))
    assert pair.driver.owed() == 0 and pair.driver.owed(1) == 0 and pair.stage.inflight == 0
    served = {kind for kind, rule in RULES.items() if rule.handling not in (Handling.REFUSE, Handling.RETURN_OPEN)}
    answered = {kind for kind, _, _ in pair.answered}
    assert answered == served - {MessageKind.RETIRE_VERIFY_WINDOW}  # the one kind never answered
    assert (MessageKind.DECODE_EMBD, ReplyKind.PREDICTED_TOKEN, 1) in pair.answered
    assert (MessageKind.VERIFY_WINDOW, ReplyKind.PREDICTED_TOKENS, 1) in pair.answered
    # the flagged trim is answered on the chain lane, the flagged decode and window on the return lane
    assert pair.answered[-4:-1] == [(MessageKind.TRIM_SESSION, ReplyKind.ACK, None),
                                    (MessageKind.DECODE_EMBD, ReplyKind.PREDICTED_TOKEN, 1),
                                    (MessageKind.VERIFY_WINDOW, ReplyKind.PREDICTED_TOKENS, 1)]


def test_the_driver_refuses_a_reply_the_rules_do_not_allow() -> None:
    driver = DriverLane()
    with pytest.raises(LaneMismatch, match="with no message owed a reply"):
        driver.replied(StageReply.ack())
    driver.sent(_message(MessageKind.DECODE_EMBD))
    with pytest.raises(LaneMismatch, match="Ack on the chain lane answers DecodeEmbd; expected PredictedToken"):
        driver.replied(StageReply.ack())
    assert driver.owed() == 1  # the message is still owed its reply
    with pytest.raises(LaneMismatch, match="has no return lane open"):
        driver.sent(_message(MessageKind.DECODE_EMBD, direct=True))
    with pytest.raises(LaneMismatch, match="refused by every stage"):
        driver.sent(_message(MessageKind.STATE_EXPORT))
    driver.return_lane_opened(3)
    driver.sent(_message(MessageKind.DECODE_EMBD, session=3, direct=True))
    with pytest.raises(LaneMismatch, match="on the chain lane answers DecodeEmbd"):
        driver.replied(StageReply.predicted_token_vector((1,)))
    assert driver.replied(StageReply.predicted_token(4), 3).lane == 3
    driver.return_lane_closed(3)
    assert driver.owed(3) == 0


@pytest.mark.parametrize("kind", sorted(RULES, key=int))
def test_expected_replies_follow_each_rule(kind: MessageKind) -> None:
    rule = RULES[kind]
    if rule.handling is Handling.REFUSE:
        with pytest.raises(LaneMismatch):
            expected_replies(_message(kind))
        return
    kinds = expected_replies(_message(kind))
    assert bool(kinds) == rule.answered
    if rule.window:
        assert kinds == (ReplyKind.PREDICTED_TOKENS,)
