"""The sans-IO lane protocol (:mod:`skippy.lane.protocol`): every kind's rule and every error
path, without a socket, a task or a clock."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from skippy.codec.protocol import MessageKind, ReplyKind, ReplyStats, StageMessage, StageReply
from skippy.codec.protocol_ext import SKIPPY_EXTENSIONS_FLAG, ErrorCode, TimingRecord, TimingsFrame
from skippy.lane.errors import DownstreamLost, InvalidMessage, UnsupportedKind
from skippy.lane.protocol import (
    RULES,
    Answer,
    Dispatch,
    Expect,
    Forward,
    Handling,
    LaneProtocol,
    Outputs,
    Relay,
    ReplyUpstream,
    SendDownstream,
    Ticket,
)

K = MessageKind
REFUSED = {K.STATE_IMPORT, K.STATE_EXPORT, K.PREDICTION_RETURN_OPEN}
SERVED = [kind for kind in MessageKind if kind not in REFUSED]

#: kind -> (early ACK, auto-align, outputs, expectation of the downstream reply to its frame,
#: what a final stage answers after its own part).
EXPECTED = {
    K.PREFILL_EMBD: (True, False, Outputs.NONE, Expect.ABSORB_ACK, None),
    K.PREFILL_FINAL_EMBD: (False, False, Outputs.LAST, Expect.RELAY_PREDICTION, ReplyUpstream(Answer.PREDICTION)),
    K.DECODE_EMBD: (False, True, Outputs.LAST, Expect.RELAY_PREDICTION, ReplyUpstream(Answer.PREDICTION)),
    K.DECODE_READOUT: (False, True, Outputs.LAST, Expect.RELAY_PREDICTION, ReplyUpstream(Answer.PREDICTION)),
    K.DECODE_LIGHT_CTX: (False, True, Outputs.LAST, Expect.RELAY_PREDICTION, ReplyUpstream(Answer.PREDICTION)),
    K.DECODE_REPLAY_EMBD: (False, False, Outputs.NONE, Expect.RELAY_ACK, ReplyUpstream(Answer.ACK)),
    K.DECODE_REPLAY_FINAL_EMBD: (False, False, Outputs.LAST, Expect.RELAY_PREDICTION,
                                 ReplyUpstream(Answer.PREDICTION)),
    K.VERIFY_WINDOW: (False, True, Outputs.ALL, Expect.RELAY_PREDICTION, ReplyUpstream(Answer.PREDICTION, window=True)),
    K.STOP: (False, False, Outputs.LAST, Expect.STOP_ACK, ReplyUpstream(Answer.ACK)),
    K.TRIM_SESSION: (False, False, Outputs.LAST, Expect.RELAY_ACK, ReplyUpstream(Answer.ACK)),
    K.CONFIGURE_GENERATION: (False, False, Outputs.LAST, Expect.RELAY_ACK, ReplyUpstream(Answer.ACK)),
    K.RETIRE_VERIFY_WINDOW: (False, False, Outputs.LAST, None, None),
    K.PROBE_PREFILL: (False, False, Outputs.LAST, Expect.RELAY_ACK, ReplyUpstream(Answer.ACK)),
    K.RESTORE_PREFILL: (False, False, Outputs.LAST, Expect.RELAY_ACK, ReplyUpstream(Answer.ACK)),
    K.TRY_RESTORE_PREFILL: (False, False, Outputs.LAST, Expect.RELAY_ACK, ReplyUpstream(Answer.ACK)),
    K.TRY_RESTORE_PREFILL_DECODE: (False, False, Outputs.LAST, Expect.RELAY_ACK, ReplyUpstream(Answer.ACK)),
}


def message(kind: MessageKind, pos_start: int = 3, **changes: object) -> StageMessage:
    return StageMessage.create(kind, pos_start=pos_start, token_count=1, session_id=1, **changes)


def forward(expect: Expect | None, kind: MessageKind = K.DECODE_EMBD, ticket: Ticket | None = None) -> Forward:
    return Forward(message(kind), expect, ticket, 1, 0, 0.0)


def test_one_rule_per_kind_and_it_agrees_with_the_protocol_predicates() -> None:
    assert set(RULES) == set(MessageKind)
    assert set(EXPECTED) == set(SERVED)
    for kind, rule in RULES.items():
        if kind is K.PREDICTION_RETURN_OPEN:  # refused except as a return lane's open (tests/test_direct_return.py)
            assert rule.handling is Handling.RETURN_OPEN and rule.refusal
            continue
        if kind in REFUSED:
            assert rule.handling is Handling.REFUSE and rule.refusal and not rule.answered
            continue
        assert (rule.answer is Answer.PREDICTION) == kind.requires_predicted_reply, kind
        assert rule.auto_align == kind.carries_authoritative_position, kind
        assert (rule.handling is Handling.EXECUTE) == rule.checks_header, kind
        assert (rule.handling is Handling.PREFIX_CONTROL) == kind.is_prefix_cache_control, kind
        assert rule.credit == rule.early_ack == (kind is K.PREFILL_EMBD), kind
        assert rule.window == (kind is K.VERIFY_WINDOW)
        # the runtime thread writes frames of non-prefill executable kinds, and only a plain
        # decode's reply on the final stage
        assert rule.write_through_down == (rule.handling is Handling.EXECUTE and not kind.is_prefill), kind
        assert rule.write_through_up == (kind in {K.DECODE_EMBD, K.DECODE_READOUT, K.DECODE_LIGHT_CTX}), kind
        # the data plane carries a session's steady decodes and verify windows (skippy.stage.decode_relay)
        assert rule.relay == (kind in {K.DECODE_EMBD, K.VERIFY_WINDOW}), kind


@pytest.mark.parametrize("kind", SERVED, ids=lambda kind: kind.reference_name)
def test_every_served_kind_follows_its_rule(kind: MessageKind) -> None:
    early_ack, auto_align, outputs, expect, final_action = EXPECTED[kind]
    lane = LaneProtocol(credit_limit=2)
    dispatch = lane.message_received(message(kind))
    assert isinstance(dispatch, Dispatch) and dispatch.kind is kind and dispatch.rule is RULES[kind]
    assert dispatch.early_ack is early_ack
    assert dispatch.align_to == (3 if auto_align else None)
    assert dispatch.rule.outputs is outputs
    answered = kind is not K.RETIRE_VERIFY_WINDOW
    assert (dispatch.ticket is not None) is answered and lane.inflight == int(answered)
    assert lane.computed(dispatch, has_downstream=True) == SendDownstream(expect)
    assert lane.computed(dispatch, has_downstream=False) == final_action


def test_a_negative_position_is_not_authoritative() -> None:
    dispatch = LaneProtocol(1).message_received(message(K.DECODE_EMBD, pos_start=-1))
    assert dispatch.align_to is None


def test_try_restore_prefill_decode_answers_by_where_it_hit() -> None:
    lane = LaneProtocol(1)
    dispatch = lane.message_received(message(K.TRY_RESTORE_PREFILL_DECODE))
    # a local hit is forwarded as a decode (prediction or miss ACK back), or, on the final
    # stage, answered with its own prediction; a local miss is ACKed here and not forwarded
    assert lane.computed(dispatch, has_downstream=True, local_hit=True) == SendDownstream(Expect.RELAY_EITHER)
    assert lane.computed(dispatch, has_downstream=False, local_hit=True) == ReplyUpstream(Answer.PREDICTION)
    assert lane.computed(dispatch, has_downstream=True, forwarded=False) == ReplyUpstream(Answer.ACK)


@pytest.mark.parametrize("kind", sorted(REFUSED), ids=lambda kind: kind.reference_name)
def test_refused_kinds_raise_unsupported_kind(kind: MessageKind) -> None:
    lane = LaneProtocol(1)
    with pytest.raises(UnsupportedKind, match="refused") as raised:
        lane.message_received(message(kind, raw_bytes=b"ab") if kind is K.STATE_IMPORT else message(kind))
    assert raised.value.code is ErrorCode.UNSUPPORTED_KIND
    assert lane.inflight == 0


def test_a_header_that_does_not_match_the_kind_is_invalid() -> None:
    lane = LaneProtocol(1)
    prefill_header = StageMessage.create(K.PREFILL_EMBD).state
    bad = dataclasses.replace(message(K.DECODE_EMBD), state=prefill_header)
    with pytest.raises(InvalidMessage, match="does not match message kind DecodeEmbd") as raised:
        lane.message_received(bad)
    assert raised.value.code is ErrorCode.STATE_MISMATCH
    # control kinds are not checked: any header will do
    stop = dataclasses.replace(StageMessage.stop(session_id=1), state=prefill_header)
    assert lane.message_received(stop).rule.handling is Handling.STOP
    # an accepted header is remembered, and still names the kind's rule
    first = lane.message_received(message(K.DECODE_EMBD))
    again = lane.message_received(message(K.DECODE_EMBD))
    assert first.rule is again.rule is RULES[K.DECODE_EMBD]


def test_the_extension_flag_negotiates_the_lane() -> None:
    lane = LaneProtocol(1)
    lane.message_received(message(K.CONFIGURE_GENERATION))
    assert not lane.extensions.enabled
    flagged = message(K.CONFIGURE_GENERATION, state_changes={"flags": SKIPPY_EXTENSIONS_FLAG})
    lane.message_received(flagged)
    lane.message_received(message(K.CONFIGURE_GENERATION))
    assert lane.extensions.enabled  # for the lane's life


def test_replies_leave_in_message_order_with_one_writer() -> None:
    lane = LaneProtocol(1)
    verify, chunk, decode = (lane.message_received(message(kind)).ticket
                             for kind in (K.VERIFY_WINDOW, K.PREFILL_EMBD, K.DECODE_EMBD))
    assert verify is not None and chunk is not None and decode is not None and lane.inflight == 3
    ack = StageReply.ack()
    assert lane.reply_ready(chunk, ack) == []  # the early ACK waits for the window's reply
    timings = TimingsFrame((TimingRecord(0, 0, 4),))
    window = StageReply.predicted_token_vector((1, 2), window_id=7)
    assert lane.reply_ready(verify, window, timings) == [verify, chunk]  # this caller writes both
    assert verify.reply is window and verify.timings is timings
    assert lane.reply_ready(decode, StageReply.predicted_token(9)) == []  # someone is writing
    assert lane.replies_written(2) == [decode]  # ... and writes this one next
    assert lane.inflight == 1
    assert lane.replies_written(1) == [] and lane.inflight == 0


def test_a_write_elsewhere_claims_the_writer_token_only_when_next_in_line() -> None:
    lane = LaneProtocol(1)
    first = lane.message_received(message(K.CONFIGURE_GENERATION)).ticket
    second = lane.message_received(message(K.DECODE_EMBD)).ticket
    assert first is not None and second is not None
    assert not lane.claim_reply_write(second)  # not next in line
    due = lane.reply_ready(first, StageReply.ack())
    assert due == [first]
    assert not lane.claim_reply_write(second)  # next, but the first is still being written
    assert lane.replies_written(1) == []
    assert lane.claim_reply_write(second)
    third = lane.message_received(message(K.PREFILL_EMBD)).ticket
    assert third is not None
    assert lane.reply_ready(third, StageReply.ack()) == []  # behind the claimed write
    assert lane.replies_written(1) == [third]
    assert lane.replies_written(1) == [] and lane.inflight == 0


def test_misused_replies_are_bugs_not_refusals() -> None:
    lane = LaneProtocol(1)
    ticket = lane.message_received(message(K.STOP)).ticket
    assert ticket is not None
    with pytest.raises(RuntimeError, match="without the writer token"):
        lane.replies_written(1)
    lane.reply_ready(ticket, StageReply.ack())
    with pytest.raises(RuntimeError, match="Stop answered twice"):
        lane.reply_ready(ticket, StageReply.ack())
    with pytest.raises(ValueError, match="credit_limit"):
        LaneProtocol(0)
    with pytest.raises(ValueError, match="reply_limit"):
        LaneProtocol(1, reply_limit=0)


def test_receiving_pauses_while_too_many_replies_wait() -> None:
    lane = LaneProtocol(1, reply_limit=2)
    first = lane.message_received(message(K.DECODE_EMBD)).ticket
    lane.message_received(message(K.RETIRE_VERIFY_WINDOW))  # not answered: does not count
    assert not lane.receiving_paused
    lane.message_received(message(K.DECODE_EMBD))
    assert lane.receiving_paused
    assert first is not None and lane.reply_ready(first, StageReply.predicted_token(1)) == [first]
    assert lane.receiving_paused  # taken for writing, not yet written
    lane.replies_written(1)
    assert not lane.receiving_paused


def test_credits_bound_the_credited_frames_and_absorbed_acks_return_them() -> None:
    lane = LaneProtocol(credit_limit=2)
    chunks = [forward(Expect.ABSORB_ACK, K.PREFILL_EMBD) for _ in range(3)]
    assert lane.take_credit() and lane.take_credit()
    assert not lane.take_credit() and lane.credits_in_use == 2
    for chunk in chunks[:2]:
        lane.frame_forwarding(chunk)
    assert lane.expecting
    relay = lane.downstream_replied(StageReply.ack(), "d:1")
    assert relay == Relay(chunks[0], absorb=True) and lane.credits_in_use == 1
    assert lane.take_credit()


@pytest.mark.parametrize(
    "expect, reply, relay",
    [
        (Expect.RELAY_ACK, StageReply.ack(), {}),
        (Expect.STOP_ACK, StageReply.ack(), {"release": True}),
        (Expect.RELAY_PREDICTION, StageReply.predicted_token(4), {"prediction": True}),
        (Expect.RELAY_PREDICTION, StageReply.predicted_token_vector((4, 5), window_id=1), {"prediction": True}),
        (Expect.RELAY_EITHER, StageReply.predicted_token(4), {"prediction": True}),
        (Expect.RELAY_EITHER, StageReply.ack(), {}),
    ],
)
def test_downstream_replies_are_matched_to_their_frames(expect: Expect, reply: StageReply,
                                                        relay: dict[str, bool]) -> None:
    lane = LaneProtocol(1)
    ticket = Ticket(K.DECODE_EMBD)
    sent = forward(expect, ticket=ticket)
    lane.frame_forwarding(sent)
    lane.frame_forwarding(forward(None, K.RETIRE_VERIFY_WINDOW))  # no reply expected: not queued
    assert lane.downstream_replied(reply, "d:1") == Relay(sent, **relay)
    assert not lane.expecting


@pytest.mark.parametrize(
    "expect, reply, reason",
    [
        (None, StageReply.ack(), "sent Ack with no frame outstanding"),
        (Expect.RELAY_PREDICTION, StageReply.ack(), "answered Ack to DecodeEmbd; expected a prediction"),
        (Expect.RELAY_ACK, StageReply.predicted_token(4), "answered PredictedToken to DecodeEmbd; expected downstream ACK"),
        (Expect.ABSORB_ACK, StageReply.predicted_token(4), "expected downstream ACK"),
        (Expect.STOP_ACK, StageReply.predicted_token(4), "expected downstream ACK"),
        (Expect.RELAY_EITHER, StageReply.predicted_token_vector((4,), window_id=1), "expected downstream ACK"),
    ],
)
def test_a_reply_out_of_protocol_is_a_lost_downstream(expect: Expect | None, reply: StageReply, reason: str) -> None:
    lane = LaneProtocol(1)
    if expect is not None:
        lane.frame_forwarding(forward(expect))
    with pytest.raises(DownstreamLost, match=reason) as raised:
        lane.downstream_replied(reply, "10.0.0.2:9")
    assert "downstream stage 10.0.0.2:9" in str(raised.value)
    assert raised.value.code is ErrorCode.DOWNSTREAM_LOST


def test_stats_are_kept_for_the_next_reply() -> None:
    lane = LaneProtocol(1)
    lane.stash_stats(ReplyStats(kv_lookup_hits=1))
    lane.stash_stats(ReplyStats(kv_lookup_hits=2, kv_hit_stage_mask=4))
    stats = lane.take_stats()
    assert stats.kv_lookup_hits == 3 and stats.kv_hit_stage_mask == 4
    assert lane.take_stats() == ReplyStats()


def test_reply_kinds_compare_as_plain_ints_too() -> None:
    lane = LaneProtocol(1)
    sent = forward(Expect.RELAY_PREDICTION)
    lane.frame_forwarding(sent)
    reply = dataclasses.replace(StageReply.predicted_token(4), kind=int(ReplyKind.PREDICTED_TOKEN))
    assert lane.downstream_replied(reply, "d:1").prediction


_SANS_IO_IMPORTS = {
    "protocol.py": {"__future__", "collections", "dataclasses", "enum", "typing", "skippy.codec.protocol",
                    "skippy.codec.protocol_ext", "skippy.lane.errors", "skippy.lane.decode_run", "skippy.lane.timings",
                    "skippy.codec.decode_run"},
    "placement.py": {"__future__", "enum", "typing", "skippy.lane.protocol"},
    # docs/protocol.md §11: the decode run's rules, sans-IO like the protocol that holds them
    "decode_run.py": {"__future__", "dataclasses", "json", "typing", "numpy", "skippy.codec.protocol",
                      "skippy.codec.protocol_ext", "skippy.codec.decode_run"},
}


@pytest.mark.parametrize("module", sorted(_SANS_IO_IMPORTS))
def test_the_protocol_modules_do_no_io(module: str) -> None:
    source = Path(__file__).resolve().parent.parent / "skippy" / "lane" / module
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            imported.add(node.module)
    allowed = _SANS_IO_IMPORTS[module]
    assert imported <= allowed, imported - allowed


# -- what a lane builds from a message (skippy.lane.messages): pure, refusals typed ----------

def _dispatch(kind: MessageKind, **changes: object) -> Dispatch:
    return LaneProtocol(1).message_received(StageMessage.create(kind, session_id=1, **changes))


@pytest.mark.parametrize(
    "is_first, changes, reason",
    [
        (True, {"token_count": 0}, "with token_count 0: nothing to execute"),
        (True, {"token_count": 2, "pos_start": -1, "tokens": np.asarray([1, 2], dtype=np.int32)},
         "with negative pos_start -1"),
        (True, {"token_count": 2, "tokens": np.asarray([1], dtype=np.int32)}, "1 token ids for token_count 2"),
        (False, {"token_count": 1}, "without an activation"),
        (False, {"token_count": 1, "activation": np.zeros((1, 3), dtype=np.float32)},
         r"activation of shape \(1, 3\) does not match token_count 1 x width 4"),
    ],
)
def test_a_message_the_stage_cannot_run_is_refused_before_it_runs(is_first: bool, changes: dict[str, object],
                                                                  reason: str) -> None:
    from skippy.lane.messages import work_item

    with pytest.raises(InvalidMessage, match=reason) as raised:
        work_item(_dispatch(K.PREFILL_EMBD, **changes), 7, is_first=is_first, width=4)
    assert raised.value.code is ErrorCode.STATE_MISMATCH


def test_a_work_item_carries_what_the_rule_says() -> None:
    from skippy.lane.messages import work_item

    decode = work_item(_dispatch(K.DECODE_EMBD, pos_start=5, token_count=1, state_changes={"current_token": 9}),
                       7, is_first=True, width=4)
    assert decode.session == 7 and decode.align_to == 5 and decode.tokens is not None and decode.tokens.tolist() == [9]
    assert decode.positions.tolist() == [5] and decode.outputs is Outputs.LAST and decode.batchable
    window = work_item(_dispatch(K.VERIFY_WINDOW, pos_start=2, token_count=2, activation=np.ones((2, 4), np.float32)),
                       7, is_first=False, width=4)
    assert window.outputs is Outputs.ALL and not window.batchable and window.tokens is None
    chunk = work_item(_dispatch(K.PREFILL_FINAL_EMBD, token_count=2, tokens=np.asarray([3, 4], dtype=np.int32)),
                      7, is_first=True, width=4)
    assert chunk.prefill and chunk.final_prefill and chunk.prompt_tokens is not None


def test_the_forwarded_message_advances_the_source_and_is_flagged() -> None:
    from skippy.codec.protocol import WireDType
    from skippy.lane.messages import outgoing

    original = StageMessage.create(K.DECODE_EMBD, pos_start=3, token_count=1, session_id=4, chat_sampling_metadata="x",
                                   state_changes={"source_stage_index": 0})
    sent = outgoing(original, np.ones((1, 4), np.float32), WireDType.F16)
    assert sent.state.source_stage_index == 1 and sent.state.flags & SKIPPY_EXTENSIONS_FLAG
    assert sent.state.reserved == int(WireDType.F16) and sent.chat_sampling_metadata is None
    assert (sent.kind, sent.pos_start, sent.session_id) == (K.DECODE_EMBD, 3, 4)


def test_the_final_stage_prediction() -> None:
    from skippy.lane.errors import StageError
    from skippy.stage.executor import WorkResult
    from skippy.lane.messages import final_prediction

    result = WorkResult(None, [5, 6, 7], 1, 40)
    window = final_prediction(_dispatch(K.VERIFY_WINDOW, state_changes={"seq_id": 42}), result, ReplyStats(),
                              window=True, total_us=90)
    assert window.kind == ReplyKind.PREDICTED_TOKENS and window.window_id == 42
    assert window.predicted_tokens == (5, 6, 7)
    stats = window.stats
    assert (stats.verify_window_compute_us, stats.verify_window_total_us, stats.verify_window_stage_count) == (40, 90, 1)
    assert (stats.verify_window_request_count, stats.verify_window_token_count) == (1, 3)
    decode = final_prediction(_dispatch(K.DECODE_EMBD), result, ReplyStats(kv_lookup_hits=1), window=False, total_us=0)
    assert decode.kind == ReplyKind.PREDICTED_TOKEN and decode.predicted == 7 and decode.stats.kv_lookup_hits == 1
    with pytest.raises(StageError, match="DecodeEmbd produced no prediction"):
        final_prediction(_dispatch(K.DECODE_EMBD), WorkResult(), ReplyStats(), window=False, total_us=0)
