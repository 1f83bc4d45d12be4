"""The lane's sans-IO rules package (skippy.lane): its parts, without sockets, and its imports."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from skippy.codec.protocol import EMPTY_REPLY_STATS, MessageKind, StageMessage, StageReply
from skippy.codec.protocol_ext import (
    DECODE_RUN_FLAG, DECODE_RUN_METADATA_KEY, DIRECT_RETURN_FLAG, MODEL_IDENTITY_FLAG, SKIPPY_EXTENSIONS_FLAG,
    LogprobsFrame, TimingRecord, TimingsFrame, TokenLogprobs, identity_query,
)
from skippy.lane import replies
from skippy.lane.errors import InvalidMessage, Overloaded, StageError, UnsupportedKind
from skippy.lane.placement import FACTS_READ, Facts, Performer, Step, placement
from skippy.lane.protocol import RULES, Forward, Handling, Relay, SendDownstream, StageLane
from skippy.lane.timings import DirectTimings
from skippy.lane.work import WorkResult


def test_direct_timings_sum_per_session_and_are_taken_once() -> None:
    totals = DirectTimings()
    totals.add(7, compute_us=10, write_us=2, queue_us=1, batch_size=1)
    totals.add(7, compute_us=30, write_us=3, queue_us=-5, batch_size=4, messages=3)  # a relay run's 3
    totals.add(8, compute_us=1, write_us=1)
    assert totals.take(7, stage_index=1, layer_start=2, layer_end=4) == TimingRecord(1, 2, 4, 4, 40, 5, 0, 1)
    assert totals.take(7, stage_index=1, layer_start=2, layer_end=4) is None  # taken: the next Stop has none
    totals.add(9, compute_us=0, write_us=0, messages=0)  # a relay run that carried nothing
    assert totals.take(9, stage_index=0, layer_start=0, layer_end=2) is None
    totals.discard(8)
    assert len(totals) == 0
    assert totals.take(5, stage_index=-1, layer_start=0, layer_end=1) is None


def test_the_lane_package_imports_nothing_heavy() -> None:
    """lane ↛ trio / net / runtime: the rules load in a fresh interpreter without them."""
    package = Path(__file__).resolve().parent.parent / "skippy" / "lane"
    names = sorted(f"skippy.lane.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__")
    assert {"skippy.lane.protocol", "skippy.lane.messages", "skippy.lane.errors"} <= set(names)
    code = f"import sys, json; import {', '.join(names)}; print(json.dumps(sorted(sys.modules)))"
    modules = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                        text=True).stdout)
    heavy = [name for name in modules if name.split(".")[0] in ("trio", "socket", "ssl", "cffi", "_cffi_backend")
             or name.startswith(("skippy.stage", "skippy.runtime", "skippy.net", "skippy.driver", "skippy._llama"))]
    assert heavy == []


# -- placement: who performs each step (every combination of the facts) -----------------------


#: One rule per distinct (write_through_down, write_through_up): what placement reads of a rule.
_RULES = [None, *{(rule.write_through_down, rule.write_through_up): rule for rule in RULES.values()
                  if rule.handling is not Handling.REFUSE}.values()]


def _every_facts(step: Step) -> list[Facts]:
    """Every combination of the facts ``step`` reads (the rest at their defaults)."""
    fields = FACTS_READ[step]
    return [Facts(**dict(zip(fields, values))) for values in itertools.product((False, True), repeat=len(fields))]


def test_placement_reads_only_the_facts_it_names() -> None:
    """Flipping a fact a step does not read never changes who performs it (every step, rule and
    combination of what it reads, each unread fact flipped alone and all of them at once)."""
    for step in Step:
        unread = [name for name in Facts._fields if name not in FACTS_READ[step]]
        for rule in _RULES:
            for facts in _every_facts(step):
                who = placement(step, rule, facts)
                flipped_all = facts._replace(**{name: not getattr(facts, name) for name in unread})
                assert placement(step, rule, flipped_all) is who, (step, facts)
                for name in unread:
                    assert placement(step, rule, facts._replace(**{name: not getattr(facts, name)})) is who


def test_placement_keeps_one_writer_per_stream_credits_and_plain_sockets() -> None:
    """Every (step, rule, facts): the module header's invariants hold, and every performer a
    step may have is reached by some facts."""
    reached: dict[Step, set[Performer]] = {step: set() for step in Step}
    for step in Step:
        for rule in _RULES:
            for facts in _every_facts(step):
                who = placement(step, rule, facts)
                reached[step].add(who)
                if who is Performer.RECEIVING_TASK:  # inline: nothing queued, not early-ACKed
                    assert facts.inline_hand_offs and facts.compute_idle and not facts.early_ack
                if who in (Performer.HANDLING_TASK, Performer.RUNTIME_THREAD) and step is Step.WRITE_DOWN:
                    assert facts.forward_idle and not facts.credited and not facts.wire_delay
                if who is Performer.RUNTIME_THREAD:
                    assert facts.write_through and facts.before_compute and rule is not None
                    if step is Step.WRITE_DOWN:
                        assert rule.write_through_down and facts.downstream_socket
                    else:
                        assert rule.write_through_up and facts.reply_next and facts.upstream_socket
                        assert not facts.reply_delay and not facts.direct
                if who is Performer.DATA_PLANE:
                    assert facts.decode_relay and facts.template and (facts.quiet or facts.adoptable)
                    assert facts.upstream_socket and facts.downstream_socket
                    assert not facts.wire_delay and not facts.reply_delay
                if facts.credited and step is Step.WRITE_DOWN:
                    assert who is Performer.FORWARD_TASK
    assert reached == {
        Step.HANDLE: {Performer.RECEIVING_TASK, Performer.COMPUTE_TASK},
        Step.WRITE_DOWN: {Performer.RUNTIME_THREAD, Performer.HANDLING_TASK, Performer.FORWARD_TASK},
        Step.WRITE_UP: {Performer.RUNTIME_THREAD, Performer.HANDLING_TASK},
        Step.CARRY_NEXT: {Performer.DATA_PLANE, Performer.NOBODY},
    }


def test_with_every_shortcut_off_each_step_takes_the_plain_performer() -> None:
    plain = {Step.HANDLE: Performer.COMPUTE_TASK, Step.WRITE_DOWN: Performer.FORWARD_TASK,
             Step.WRITE_UP: Performer.HANDLING_TASK, Step.CARRY_NEXT: Performer.NOBODY}
    off = {"inline_hand_offs": False, "write_through": False, "decode_relay": False}
    for step in Step:
        for facts in _every_facts(step):
            for rule in _RULES:
                assert placement(step, rule, facts._replace(**off)) is plain[step]


@pytest.mark.parametrize("kind", [MessageKind.DECODE_EMBD, MessageKind.VERIFY_WINDOW, MessageKind.PREFILL_EMBD,
                                  MessageKind.STOP])
def test_each_kind_is_written_by_the_runtime_thread_only_when_its_rule_says(kind: MessageKind) -> None:
    rule = RULES[kind]
    down = placement(Step.WRITE_DOWN, rule, Facts(before_compute=True, credited=rule.credit))
    up = placement(Step.WRITE_UP, rule, Facts(before_compute=True, reply_next=True))
    assert (down is Performer.RUNTIME_THREAD) == rule.write_through_down
    assert (up is Performer.RUNTIME_THREAD) == rule.write_through_up
    # once computed, only a task writes (and a busy forwarder keeps the order)
    assert placement(Step.WRITE_DOWN, rule, Facts(credited=rule.credit)) is (
        Performer.FORWARD_TASK if rule.credit else Performer.HANDLING_TASK)
    assert placement(Step.WRITE_DOWN, rule, Facts(forward_idle=False)) is Performer.FORWARD_TASK


# -- StageLane: the lane's own state (sans-IO) -------------------------------------------------

def _message(kind: MessageKind, session: int = 1, *, flags: int = SKIPPY_EXTENSIONS_FLAG, metadata: str | None = None,
             position: int = 4) -> StageMessage:
    message = StageMessage.create(kind, pos_start=position, token_count=1, session_id=session,
                                  tokens=np.asarray([7], dtype=np.int32), state_changes={"current_token": 7})
    header = message.state
    message = dataclasses.replace(message, state=dataclasses.replace(header, flags=header.flags | flags),
                                  chat_sampling_metadata=metadata)
    return message


def test_sessions_are_namespaced_by_lane_and_bounded_by_its_quota() -> None:
    lane = StageLane(3, 1, session_quota=2, peer="u:1")
    first, second = lane.key_of(1), lane.key_of(2)
    assert first >> 64 == 3 and first & 0xFFFF == 1
    lane.claim(first)
    lane.claim(first)  # the same session again: no new claim
    lane.claim(second)
    with pytest.raises(Overloaded, match="already holds 2 sessions"):
        lane.claim(lane.key_of(9))
    assert lane.has_session(1) and not lane.has_session(9)


def test_an_identity_query_is_answered_only_as_the_first_message() -> None:
    lane = StageLane(1, 1)
    assert lane.received(identity_query(), run_flagged=False, is_first=True) == (None, None)
    assert lane.identity_aware and not lane.lane_used
    lane = StageLane(1, 1)
    dispatch, _ = lane.received(_message(MessageKind.DECODE_EMBD), run_flagged=False, is_first=True)
    assert dispatch is not None and dispatch.key == lane.key_of(1) and not lane.identity_aware
    with pytest.raises(UnsupportedKind):  # not the first message: the rules refuse it
        lane.received(identity_query(), run_flagged=False, is_first=True)
    aware = StageLane(1, 1)
    dispatch, _ = aware.received(_message(MessageKind.DECODE_EMBD, flags=MODEL_IDENTITY_FLAG), run_flagged=False,
                                 is_first=True)
    assert dispatch is not None and aware.identity_aware  # it is sent MODEL_MISMATCH from now on


def test_a_decode_run_starts_steps_and_any_message_for_its_session_ends_it() -> None:
    lane = StageLane(1, 1)
    metadata = json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 3, "stop_tokens": [99]}})
    flagged = _message(MessageKind.DECODE_EMBD, flags=SKIPPY_EXTENSIONS_FLAG | DECODE_RUN_FLAG, metadata=metadata)
    dispatch, run = lane.received(flagged, run_flagged=True, is_first=True)
    assert dispatch is not None and run is not None and lane.runs == {1: run} and not lane.quiet
    assert not dispatch.message.state.flags & DECODE_RUN_FLAG and dispatch.message.chat_sampling_metadata is None
    assert dispatch.ticket is not None and dispatch.ticket.run is run
    first, step = lane.run_predicted(dispatch.ticket, 5, 0)
    assert first and step is not None and step.message.pos_start == 5 and lane.compute_backlog == 1
    assert lane.run_steps[0][0] is step
    again, _ = lane.run_predicted(step.ticket, 6, 0)  # type: ignore[arg-type]
    assert not again
    lane.received(_message(MessageKind.STOP), run_flagged=False, is_first=True)
    assert not lane.runs and run.cancelled


@pytest.mark.parametrize("case, is_first, flags, kind, text", [
    ("not first", False, SKIPPY_EXTENSIONS_FLAG, MessageKind.DECODE_EMBD, "only the chain's first stage"),
    ("not negotiated", True, 0, MessageKind.DECODE_EMBD, "did not negotiate"),
    ("another kind", True, SKIPPY_EXTENSIONS_FLAG, MessageKind.DECODE_READOUT, "starts with a DecodeEmbd only"),
    ("bad section", True, SKIPPY_EXTENSIONS_FLAG, MessageKind.DECODE_EMBD, "refused"),
])
def test_a_decode_run_refusal_names_its_reason(case: str, is_first: bool, flags: int, kind: MessageKind,
                                               text: str) -> None:
    metadata = "{}" if case == "bad section" else json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 2}})
    message = _message(kind, flags=flags | DECODE_RUN_FLAG, metadata=metadata)
    with pytest.raises(InvalidMessage, match=text):
        StageLane(1, 1).received(message, run_flagged=True, is_first=is_first)


def test_the_lane_is_quiet_only_with_nothing_queued_in_flight_or_running() -> None:
    lane = StageLane(1, 1)
    assert lane.quiet
    dispatch, _ = lane.received(_message(MessageKind.DECODE_EMBD), run_flagged=False, is_first=True)
    assert dispatch is not None
    assert not lane.quiet and lane.reply_next(dispatch.ticket) and not lane.reply_next(None)
    assert lane.claim_reply_write(dispatch.ticket)  # type: ignore[arg-type]
    assert not lane.reply_next(dispatch.ticket)
    lane.replies_written(1)
    assert lane.quiet
    lane.forward_backlog = 1
    assert not lane.quiet


def _forwarded(lane: StageLane, kind: MessageKind, session: int = 1) -> Forward:
    """A message received, computed and forwarded hop by hop (its prediction expected back)."""
    dispatch, _ = lane.received(_message(kind, session), run_flagged=False, is_first=False)
    assert dispatch is not None
    action = lane.computed(dispatch, has_downstream=True)
    assert isinstance(action, SendDownstream)
    forward = Forward(dispatch.message, action.expect, dispatch.ticket, dispatch.key, 0, 0.0)
    lane.frame_forwarding(forward)
    return forward


def test_a_run_takes_over_only_a_sessions_forwarded_predictions_in_order() -> None:
    """A pipelining upstream never lets a lane go quiet: a data-plane run may start anyway when
    everything in flight is the session's decodes and windows forwarded, their predictions
    expected in order, nothing else queued, nobody writing, no stats pending (``adoptable``);
    the run takes them over, says how many it answered and gives the rest back in order."""
    lane = StageLane(1, 1)
    key = lane.key_of(1)
    assert lane.hand_over(key) == ()  # a quiet lane: nothing to take over
    forwards = [_forwarded(lane, MessageKind.DECODE_EMBD), _forwarded(lane, MessageKind.VERIFY_WINDOW),
                _forwarded(lane, MessageKind.DECODE_EMBD)]
    assert not lane.quiet and lane.adoptable(key) and not lane.adoptable(lane.key_of(2))
    assert lane.hand_over(key) == tuple(forwards) and lane.inflight == 3 and not lane.expecting
    lane.adopted_answered(1)
    lane.take_back(tuple(forwards[1:]))
    assert lane.inflight == 2 and lane.adoptable(key)
    relay = lane.downstream_replied(StageReply.predicted_token(5), "d")  # the oldest taken back first
    assert relay.forward is forwards[1] and relay.prediction
    with pytest.raises(RuntimeError, match="out of order"):
        lane.take_back((forwards[0],))


@pytest.mark.parametrize("case", ["compute queued", "forward queued", "writing", "stats pending", "credit",
                                  "another session", "a stop", "an early-ACKed chunk", "answered", "direct"])
def test_a_run_takes_over_nothing_else(case: str) -> None:
    lane = StageLane(1, 2)
    key = lane.key_of(1)
    forward = _forwarded(lane, MessageKind.VERIFY_WINDOW)
    assert lane.adoptable(key)
    if case == "compute queued":
        lane.compute_backlog = 1
    elif case == "forward queued":
        lane.forward_backlog = 1
    elif case == "writing":
        lane.reply_ready(forward.ticket, StageReply.predicted_token(1))  # type: ignore[arg-type]
    elif case == "stats pending":
        lane.stash_stats(dataclasses.replace(EMPTY_REPLY_STATS, prefill_edge_write_us_max=3))
    elif case == "credit":
        assert lane.take_credit()
    elif case == "another session":
        _forwarded(lane, MessageKind.DECODE_EMBD, session=2)
    elif case == "a stop":
        _forwarded(lane, MessageKind.STOP)
    elif case == "an early-ACKed chunk":
        _forwarded(lane, MessageKind.PREFILL_EMBD)
    elif case == "answered":
        lane.claim_reply_write(forward.ticket)  # type: ignore[arg-type]
    else:
        dispatch, _ = lane.received(_message(MessageKind.DECODE_EMBD, flags=SKIPPY_EXTENSIONS_FLAG | DIRECT_RETURN_FLAG),
                                    run_flagged=False, is_first=False)
        assert dispatch is not None and dispatch.direct
    assert not lane.adoptable(key) and lane.hand_over(key) is None
    assert lane.expecting  # nothing was taken


# -- replies: every reply a stage builds (skippy.lane.replies) ----------------------------------


@dataclasses.dataclass
class _Identity:
    index: int = 1
    layer_start: int = 2
    layer_end: int = 4


def test_the_final_prediction_carries_its_record_and_logprobs_on_a_negotiated_lane_only() -> None:
    lane = StageLane(1, 1)
    dispatch, _ = lane.received(_message(MessageKind.DECODE_EMBD), run_flagged=False, is_first=True)
    assert dispatch is not None
    rows = [TokenLogprobs(9, -0.5, ((9, -0.5), (3, -1.0)))]
    result = WorkResult(tokens=[4, 9], batch_size=2, compute_us=30, logprobs=rows)  # type: ignore[arg-type]
    reply, timings, annotations = replies.prediction(dispatch, result, EMPTY_REPLY_STATS, identity=_Identity(),
                                                     queue_us=-3, negotiated=True)
    assert reply == StageReply.predicted_token(9, stats=EMPTY_REPLY_STATS)
    assert timings == TimingsFrame((TimingRecord(1, 2, 4, 2, 30, 0, 0, 0),))  # queue clamped to 0
    assert annotations == (LogprobsFrame(2, tuple(rows)),)
    assert replies.prediction(dispatch, result, EMPTY_REPLY_STATS, identity=_Identity(), queue_us=0,
                              negotiated=False)[1:] == (None, ())
    with pytest.raises(StageError, match="DecodeEmbd produced no prediction"):
        replies.prediction(dispatch, WorkResult(), EMPTY_REPLY_STATS, identity=_Identity(), queue_us=0,
                           negotiated=True)
    window, _, _ = replies.prediction(dispatch, result, EMPTY_REPLY_STATS, identity=_Identity(), queue_us=0,
                                      negotiated=False, window=True, total_us=50)
    assert window.predicted_tokens == (4, 9) and window.stats.verify_window_total_us == 50
    assert window.stats.verify_window_token_count == 2 and window.stats.verify_window_stage_count == 1
    template, record = replies.prediction_template(_Identity(), negotiated=True)
    assert template.predicted == 0 and record == TimingsFrame((TimingRecord(1, 2, 4, 1, 0, 0, 0, 0),))


def _relay(kind: MessageKind, reply: StageReply, *, flags: int = SKIPPY_EXTENSIONS_FLAG) -> tuple[StageLane, Relay]:
    """A lane with a downstream that forwarded one ``kind`` message and read ``reply`` for it."""
    lane = StageLane(1, 1)
    dispatch, _ = lane.received(_message(kind, flags=flags), run_flagged=False, is_first=False)
    assert dispatch is not None
    action = lane.computed(dispatch, has_downstream=True)
    assert type(action) is SendDownstream
    forward = Forward(dispatch.message, action.expect, dispatch.ticket, dispatch.key, 100, 0.0, compute_us=20,
                      queue_us=2, batch_size=1, write_us=5, frame_bytes=64)
    lane.frame_forwarding(forward)
    return lane, lane.downstream_replied(reply, "d:1")


def test_a_relayed_prediction_appends_this_stages_record_and_drops_annotations_for_v11() -> None:
    downstream = TimingsFrame((TimingRecord(2, 4, 6, 1, 40, 0, 0, 0),))
    accepted = replies.RUN_ACCEPTED
    lane, relay = _relay(MessageKind.DECODE_EMBD, StageReply.predicted_token(8))
    assert relay.prediction and not relay.absorb
    reply, timings, annotations = replies.relayed(lane, relay, relay_reply := StageReply.predicted_token(8),
                                                  relay_reply.stats, downstream, accepted, identity=_Identity(),
                                                  wait_us=7, now_us=200)
    assert reply is relay_reply and annotations == accepted  # nothing merged: the decoded reply as it came
    assert timings == TimingsFrame((*downstream.records, TimingRecord(1, 2, 4, 1, 20, 5, 7, 2)))
    v11, plain = _relay(MessageKind.DECODE_EMBD, StageReply.predicted_token(8), flags=0)
    assert replies.relayed(v11, plain, StageReply.predicted_token(8), EMPTY_REPLY_STATS, downstream, accepted,
                           identity=_Identity(), wait_us=7, now_us=200)[1:] == (None, ())
    lane, relay = _relay(MessageKind.VERIFY_WINDOW, StageReply.predicted_token_vector((1, 2), window_id=0))
    reply, _, _ = replies.relayed(lane, relay, StageReply.predicted_token_vector((1, 2), window_id=0),
                                  EMPTY_REPLY_STATS, None, (), identity=_Identity(), wait_us=7, now_us=200)
    assert reply.stats.verify_window_total_us == 100 and reply.stats.verify_window_downstream_wait_us == 7


def test_a_stop_ack_carries_the_sessions_direct_return_totals_once() -> None:
    lane, relay = _relay(MessageKind.STOP, StageReply.ack())
    assert relay.release and not relay.prediction
    lane.direct_timings.add(relay.forward.session, compute_us=10, write_us=1, queue_us=1)
    reply, timings, _ = replies.relayed(lane, relay, StageReply.ack(), EMPTY_REPLY_STATS, None, (),
                                        identity=_Identity(), wait_us=0, now_us=0)
    assert reply == StageReply.ack() and timings == TimingsFrame((TimingRecord(1, 2, 4, 1, 10, 1, 0, 1),))
    assert replies.relayed(lane, relay, StageReply.ack(), EMPTY_REPLY_STATS, None, (), identity=_Identity(),
                           wait_us=0, now_us=0)[1] is None  # taken: a second Stop has none


def test_an_absorbed_ack_keeps_its_stats_and_the_edge_transport_for_the_next_reply() -> None:
    lane = StageLane(1, 1)
    dispatch, _ = lane.received(_message(MessageKind.PREFILL_EMBD), run_flagged=False, is_first=False)
    assert dispatch is not None and dispatch.early_ack
    action = lane.computed(dispatch, has_downstream=True)
    assert type(action) is SendDownstream
    forward = Forward(dispatch.message, action.expect, dispatch.ticket, dispatch.key, 0, 0.0, write_us=5,
                      frame_bytes=64)
    assert lane.take_credit()
    lane.frame_forwarding(forward)
    relay = lane.downstream_replied(StageReply.ack(), "d:1")
    assert relay.absorb and lane.credits_in_use == 0
    lane.absorbed(relay.forward, StageReply.ack(), wait_us=9)
    stats = lane.take_stats()
    assert stats.prefill_edge_observation_count == 1 and stats.prefill_edge_activation_bytes_max == 64
    assert stats.prefill_edge_write_us_max == 5 and stats.prefill_edge_wait_us_max == 9


@pytest.mark.parametrize("kind", list(MessageKind))
def test_a_rule_is_a_prefill_exactly_for_the_prefill_kinds(kind: MessageKind) -> None:
    assert RULES[kind].prefill == kind.is_prefill


def test_a_written_direct_frame_leaves_the_stage_counts_for_the_stop_and_may_be_the_template() -> None:
    lane = StageLane(1, 1)
    dispatch, _ = lane.received(_message(MessageKind.DECODE_EMBD, flags=SKIPPY_EXTENSIONS_FLAG | DIRECT_RETURN_FLAG),
                                run_flagged=False, is_first=False)
    assert dispatch is not None and dispatch.direct and lane.inflight == 1
    forward = Forward(dispatch.message, None, None, dispatch.key, 0, 0.0, compute_us=9, write_us=2, batch_size=1,
                      direct=True)
    lane.direct_written(forward, b"frame")
    assert lane.inflight == 0 and len(lane.direct_timings) == 1
    message = dispatch.message
    assert lane.take_template(message) == (b"frame", None) and lane.take_template(message) == (None, None)  # taken once
    assert lane.direct_timings.take(dispatch.key, stage_index=1, layer_start=0, layer_end=2) == TimingRecord(
        1, 0, 2, 1, 9, 2, 0, 0)


def test_every_decodes_and_windows_template_is_offered() -> None:
    """The driver's verify windows change size and alternate with decodes: the data plane's run
    carries windows of any rows and decodes interleaved, so every message the lane handled leaves
    its template (taken once)."""
    lane = StageLane(1, 1)
    windows = [StageMessage.create(MessageKind.VERIFY_WINDOW, pos_start=0, token_count=rows, session_id=1,
                                   tokens=np.zeros(rows, dtype=np.int32)) for rows in (3, 3, 5, 3, 3)]
    decode = _message(MessageKind.DECODE_EMBD)
    offered = []
    for message in [windows[0], windows[1], decode, windows[2], windows[3], windows[4], decode]:
        lane.relay_frame = b"frame"
        offered.append(lane.take_template(message)[0] is not None)
        offered.append(lane.take_template(message)[0] is not None)
    assert offered == [True, False] * 7
