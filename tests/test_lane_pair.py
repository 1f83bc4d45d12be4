"""The driver's end and the stage's end of a lane, in memory, on the same rules (h11's pair test).

A :class:`~skippy.lane.driver.DriverLane` sends every kind a stage serves, encoded with the wire
codec; a one-stage chain's :class:`~skippy.lane.protocol.StageLane` (first and final) decodes them,
does what its rules say (early ACKs, answers, the direct-return path into a return lane, the decode
runs it drives) with a stand-in compute, and writes its replies in message order with their
SamplingAccepted frames; the driver matches every reply to the message it answers, as
:class:`skippy.driver.client.StageClient` does.  No socket, no runtime.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skippy.codec import wire as codec
from skippy.codec.decode_run import DecodeRunRequest
from skippy.codec.protocol import END_OF_STREAM, NEED_DATA, MessageKind, ReplyKind, StageMessage, StageReply, WireDType
from skippy.codec.protocol_ext import (
    DECODE_RUN_FEATURE, DECODE_RUN_FLAG, DIRECT_RETURN_FLAG, SKIPPY_EXTENSIONS_FLAG, SamplingAcceptedFrame,
)
from skippy.lane import replies
from skippy.lane.driver import DriverLane, LaneMismatch, expected_replies
from skippy.lane.errors import InvalidMessage
from skippy.lane.protocol import RULES, Answer, Dispatch, Handling, ReplyUpstream, StageLane, Ticket

WIDTH = 4


def _message(kind: MessageKind, *, session: int = 1, position: int = 0, count: int = 1, direct: bool = False,
             run: DecodeRunRequest | None = None) -> StageMessage:
    tokens = np.arange(1, count + 1, dtype=np.int32) if kind in (
        MessageKind.PREFILL_EMBD, MessageKind.PREFILL_FINAL_EMBD, MessageKind.DECODE_EMBD, MessageKind.DECODE_READOUT,
        MessageKind.DECODE_LIGHT_CTX, MessageKind.DECODE_REPLAY_EMBD, MessageKind.DECODE_REPLAY_FINAL_EMBD,
        MessageKind.VERIFY_WINDOW, MessageKind.PROBE_PREFILL, MessageKind.RESTORE_PREFILL,
        MessageKind.TRY_RESTORE_PREFILL, MessageKind.TRY_RESTORE_PREFILL_DECODE) else np.zeros(0, np.int32)
    message = StageMessage.create(kind, pos_start=position, token_count=count if tokens.size else 0,
                                  session_id=session, tokens=tokens,
                                  chat_sampling_metadata=None if run is None else run.metadata())
    flags = message.state.flags | SKIPPY_EXTENSIONS_FLAG | (DIRECT_RETURN_FLAG if direct else 0)
    if run is not None:  # docs/protocol.md §11: what StageClient.start_run sends
        flags |= DECODE_RUN_FLAG
    return dataclasses.replace(message, state=dataclasses.replace(message.state, flags=flags))


def _token(message: StageMessage) -> int:
    """The stand-in compute's prediction: a function of the position it is fed at."""
    return 100 + message.pos_start + message.token_count


class Pair:
    """A driver lane and a final stage's lane joined by bytes (a chain lane and return lanes)."""

    def __init__(self) -> None:
        self.driver = DriverLane()
        self.stage = StageLane(1, 2)
        self.chain = codec.ReplyDecoder(extensions=True)
        self.returns: dict[int, codec.ReplyDecoder] = {}
        #: (the message kind answered, the reply's kind, its lane, its prediction or -1; a run's
        #: overshoot is answered as None).
        self.answered: list[tuple[MessageKind | None, ReplyKind, int | None, int]] = []
        self._features: dict[int | None, int] = {}

    def open_return_lane(self, session: int) -> None:
        """The driver opens session ``session``'s return lane (a lane of its own to the final stage)."""
        lane = StageLane(2, 2)
        opener = _message(MessageKind.PREDICTION_RETURN_OPEN, session=session, direct=True)
        self.driver.return_lane_opening(opener)
        assert not self.driver.direct(MessageKind.DECODE_EMBD, session)  # not before its ACK
        dispatch, _ = lane.received(self._wire(opener), run_flagged=False, is_first=True)
        assert dispatch is not None and dispatch.rule.handling is Handling.RETURN_OPEN and lane.return_lane
        action = lane.computed(dispatch, has_downstream=False, forwarded=False)
        assert action == ReplyUpstream(Answer.ACK)
        decoder = self.returns[session] = codec.ReplyDecoder(extensions=True)
        decoder.receive_data(self._written(lane, dispatch.ticket, StageReply.ack()))  # type: ignore[arg-type]
        self._read(decoder, session)
        assert self.driver.direct(MessageKind.DECODE_EMBD, session)
        assert not self.driver.direct(MessageKind.TRIM_SESSION, session)  # (not a direct-return kind)

    @staticmethod
    def _wire(message: StageMessage) -> StageMessage:
        decoder = codec.MessageDecoder(WIDTH)
        decoder.receive_data(codec.encode_message(message, WireDType.F32, WIDTH))
        decoded = decoder.next_message()
        assert isinstance(decoded, StageMessage)
        return decoded

    @staticmethod
    def _written(lane: StageLane, ticket: object, reply: StageReply, annotations: tuple[object, ...] = ()) -> bytes:
        def frames(tickets: list[Ticket]) -> bytes:
            return b"".join(b"".join(codec.encode_sampling_accepted(a) for a in t.annotations)  # type: ignore[arg-type]
                            + codec.encode_reply(t.reply) for t in tickets)  # type: ignore[arg-type]

        due = lane.reply_ready(ticket, reply, None, annotations)  # type: ignore[arg-type]
        data = frames(due)
        while due:
            due = lane.replies_written(len(due))
            data += frames(due)
        return data

    def send(self, *messages: StageMessage) -> None:
        """The driver sends ``messages`` at once; the stage handles them in order."""
        for message in messages:
            self.driver.sent(message)
        self.deliver(*messages)
        self.read()

    def deliver(self, *messages: StageMessage) -> None:
        """The stage receives and handles ``messages`` (the driver has sent them); a decode run's
        steps wait in ``run_steps`` for :meth:`step`."""
        for message in messages:
            wired = self._wire(message)
            dispatch, _ = self.stage.received(wired, run_flagged=bool(wired.state.flags & DECODE_RUN_FLAG),
                                              is_first=True)
            assert dispatch is not None
            if dispatch.early_ack:
                self.chain.receive_data(self._written(self.stage, dispatch.ticket, StageReply.ack()))
            self._compute(dispatch)

    def step(self, count: int = 1) -> int:
        """The stage computes up to ``count`` queued steps of its decode runs; how many it did."""
        done = 0
        while done < count and self.stage.run_steps:
            dispatch, _, _ = self.stage.run_steps.popleft()
            self.stage.compute_backlog -= 1
            self._compute(dispatch)
            done += 1
        return done

    def _compute(self, dispatch: Dispatch) -> None:
        action = self.stage.computed(dispatch, has_downstream=False)
        if type(action) is not ReplyUpstream:
            return
        annotations: tuple[object, ...] = ()
        if action.answer is Answer.ACK or dispatch.rule.answer is Answer.PREDICTION_OR_ACK:
            reply = StageReply.ack()  # (a prefix-cache miss on a TryRestorePrefillDecode)
        elif action.window:
            reply = StageReply.predicted_token_vector((5,) * dispatch.message.token_count,
                                                      window_id=dispatch.message.state.seq_id)
        else:
            reply = StageReply.predicted_token(_token(dispatch.message))
            ticket = dispatch.ticket
            if ticket is not None and ticket.run is not None:  # §11: the next step starts before the reply
                first, _ = self.stage.run_predicted(ticket, reply.predicted, 0)
                annotations = replies.RUN_ACCEPTED if first else ()
        if action.direct:
            self.returns[dispatch.message.session_id].receive_data(codec.encode_reply(reply))
            self.stage.direct_done()
        else:
            data = self._written(self.stage, dispatch.ticket, reply, annotations)
            if data:  # (b"" would be the end of the stream: nothing is due until the replies ahead are)
                self.chain.receive_data(data)

    def read(self) -> None:
        """The driver reads every reply written so far, on the chain lane and the return lanes."""
        self._read(self.chain, None)
        for session, decoder in self.returns.items():
            self._read(decoder, session)

    def _read(self, decoder: codec.ReplyDecoder, lane: int | None) -> None:
        while (reply := decoder.next_reply()) is not NEED_DATA and reply is not END_OF_STREAM:
            if isinstance(reply, SamplingAcceptedFrame):  # it annotates the next reply
                self._features[lane] = reply.features
                continue
            assert isinstance(reply, StageReply)
            owed = self.driver.replied(reply, lane, features=self._features.pop(lane, 0))
            kind = None if owed.overshoot else MessageKind(owed.message.kind)
            predicted = reply.predicted if reply.kind == ReplyKind.PREDICTED_TOKEN else -1
            self.answered.append((kind, ReplyKind(reply.kind), lane, predicted))


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
    served = {kind for kind, rule in RULES.items() if rule.handling is not Handling.REFUSE}  # (the open on its lane)
    answered = {kind for kind, _, _, _ in pair.answered}
    assert answered == served - {MessageKind.RETIRE_VERIFY_WINDOW}  # the one kind never answered
    # the flagged trim is answered on the chain lane, the flagged decode and window on the return lane
    assert [answer[:3] for answer in pair.answered[-4:-1]] == [
        (MessageKind.TRIM_SESSION, ReplyKind.ACK, None), (MessageKind.DECODE_EMBD, ReplyKind.PREDICTED_TOKEN, 1),
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


# -- decode runs (docs/protocol.md §11) and direct return (§8) through both ends ----------------------

def _prompted(pair: Pair, *, direct: bool = False) -> None:
    """Session 1 configured (its return lane opened when ``direct``) and its 6-token prompt in."""
    pair.send(_message(MessageKind.CONFIGURE_GENERATION))
    if direct:
        pair.open_return_lane(1)
    flagged = pair.driver.direct(MessageKind.PREFILL_FINAL_EMBD, 1)  # the driver flags by its rules, as StageClient
    assert flagged == direct and not pair.driver.direct(MessageKind.PREFILL_EMBD, 1)
    pair.send(_message(MessageKind.PREFILL_EMBD, count=4), _message(MessageKind.PREFILL_FINAL_EMBD, position=4,
                                                                     count=2, direct=flagged))


@pytest.mark.parametrize("stop_token", [None, 108])
def test_a_decode_run_ends_on_both_ends_at_its_budget_or_a_stop_token(stop_token: int | None) -> None:
    pair = Pair()
    _prompted(pair)
    request = DecodeRunRequest(5, frozenset(() if stop_token is None else (stop_token,)))
    pair.send(_message(MessageKind.DECODE_EMBD, position=6, run=request))  # its first reply says the stage runs it
    run = pair.driver.run
    assert run is not None and run.session_id == 1 and run.position == 7 and pair.stage.runs
    while pair.step():  # the stage feeds each prediction to the next step; the driver only reads
        pair.read()
    predictions = [p for kind, _, _, p in pair.answered if kind is MessageKind.DECODE_EMBD]
    assert predictions == ([107, 108] if stop_token else [107, 108, 109, 110, 111])
    assert pair.driver.run is None and not pair.stage.runs and not pair.stage.run_steps
    assert pair.driver.owed() == 0 and pair.stage.inflight == 0 and pair.driver.run_overshoot == 0
    pair.send(_message(MessageKind.DECODE_EMBD, position=6 + len(predictions)))  # the session goes on per token
    pair.send(_message(MessageKind.STOP))
    assert pair.answered[-2:] == [(MessageKind.DECODE_EMBD, ReplyKind.PREDICTED_TOKEN, None, 107 + len(predictions)),
                                  (MessageKind.STOP, ReplyKind.ACK, None, -1)]


def test_a_stop_ends_a_run_early_and_the_driver_drops_the_steps_the_stage_had_started() -> None:
    pair = Pair()
    _prompted(pair)
    pair.send(_message(MessageKind.DECODE_EMBD, position=6, run=DecodeRunRequest(100)))
    assert pair.step(2) == 2
    pair.read()
    run = pair.driver.run
    assert run is not None and run.position == 9  # three predictions read
    pair.step()  # the stage runs ahead: a fourth prediction written, a fifth step queued, unread
    stop = _message(MessageKind.STOP)
    pair.driver.sent(stop)
    assert pair.driver.run is None
    pair.deliver(stop)  # the run ends on the stage; the step it had queued is still answered, before the ACK
    assert pair.step(10) == 1 and not pair.stage.run_steps and not pair.stage.runs
    pair.read()
    assert pair.answered[-3:] == [(None, ReplyKind.PREDICTED_TOKEN, None, 110),
                                  (None, ReplyKind.PREDICTED_TOKEN, None, 111),
                                  (MessageKind.STOP, ReplyKind.ACK, None, -1)]
    assert pair.driver.run_overshoot == 2 and pair.driver.owed() == 0 and pair.stage.inflight == 0


def test_a_direct_return_session_through_both_ends() -> None:
    pair = Pair()
    _prompted(pair, direct=True)
    driver = pair.driver

    def message(kind: MessageKind, **fields: int) -> StageMessage:
        return _message(kind, direct=driver.direct(kind, 1), **fields)  # type: ignore[arg-type]

    pair.send(message(MessageKind.DECODE_EMBD, position=6), message(MessageKind.VERIFY_WINDOW, position=7, count=3),
              message(MessageKind.TRIM_SESSION, count=8), message(MessageKind.DECODE_EMBD, position=8))
    assert [answer[:3] for answer in pair.answered if answer[2] == 1] == [
        (MessageKind.PREDICTION_RETURN_OPEN, ReplyKind.ACK, 1), (MessageKind.PREFILL_FINAL_EMBD, ReplyKind.PREDICTED_TOKEN, 1),
        (MessageKind.DECODE_EMBD, ReplyKind.PREDICTED_TOKEN, 1), (MessageKind.VERIFY_WINDOW, ReplyKind.PREDICTED_TOKENS, 1),
        (MessageKind.DECODE_EMBD, ReplyKind.PREDICTED_TOKEN, 1)]
    assert [answer[:3] for answer in pair.answered if answer[2] is None] == [
        (MessageKind.CONFIGURE_GENERATION, ReplyKind.ACK, None), (MessageKind.PREFILL_EMBD, ReplyKind.ACK, None),
        (MessageKind.TRIM_SESSION, ReplyKind.ACK, None)]
    # a decode run cannot return directly: refused by both ends
    flagged_run = _message(MessageKind.DECODE_EMBD, position=9, direct=True, run=DecodeRunRequest(4))
    with pytest.raises(LaneMismatch, match="cannot also ask for direct return"):
        driver.sent(flagged_run)
    with pytest.raises(LaneMismatch, match="already has a return lane"):
        driver.return_lane_opening(_message(MessageKind.PREDICTION_RETURN_OPEN, direct=True))
    pair.send(_message(MessageKind.STOP))
    driver.return_lane_closed(1)
    assert not driver.direct(MessageKind.DECODE_EMBD, 1) and driver.owed() == 0 and driver.owed(1) == 0
    assert pair.stage.inflight == 0
    with pytest.raises(InvalidMessage, match="cannot also ask for direct return"):
        pair.stage.received(Pair._wire(flagged_run), run_flagged=True, is_first=True)


def test_the_driver_refuses_what_a_run_would_make_ambiguous() -> None:
    start = _message(MessageKind.DECODE_EMBD, position=4, run=DecodeRunRequest(10))
    driver = DriverLane()
    driver.sent(start)
    with pytest.raises(LaneMismatch, match="before the decode run of session 1 answered its first step"):
        driver.sent(_message(MessageKind.STOP))
    driver.replied(StageReply.predicted_token(5), features=DECODE_RUN_FEATURE)
    assert driver.run is not None and driver.run.position == 5 and driver.run.left == 9
    with pytest.raises(LaneMismatch, match="would interleave with the run's"):
        driver.sent(_message(MessageKind.STOP, session=2))
    for kind in (MessageKind.DECODE_EMBD, MessageKind.RETIRE_VERIFY_WINDOW, MessageKind.TRY_RESTORE_PREFILL_DECODE):
        with pytest.raises(LaneMismatch, match="end the run first"):
            driver.sent(_message(kind, position=5))
    assert driver.run is not None  # nothing refused was recorded
    with pytest.raises(LaneMismatch, match="Ack on the chain lane inside the decode run of session 1"):
        driver.replied(StageReply.ack())
    # a stage that does not say it runs the decode answered it as one step
    driver = DriverLane()
    driver.sent(start)
    assert driver.replied(StageReply.predicted_token(5)).run is not None and driver.run is None
    with pytest.raises(LaneMismatch, match="starts with a DecodeEmbd only"):
        driver.sent(_message(MessageKind.VERIFY_WINDOW, count=2, run=DecodeRunRequest(4)))
    assert driver.owed() == 0
