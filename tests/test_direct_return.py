"""Direct return (docs/protocol.md §8): the rules without a socket, the return hub, and chains.

The protocol and hub tests need no socket or clock.  The chain tests run null-runtime stage
servers in this trio run (and null stage processes for the kill), comparing every token and
predicted reply with direct return on and off; the f32 exactness of the real tiny llama over 1-4
stage processes is marked slow like tests/test_stage_chain.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import trio

from skippy.codec.protocol import MessageKind, StageMessage
from skippy.codec.protocol_ext import ErrorCode, with_direct_return_flag
from skippy.driver import StageClient, StageLost
from skippy.driver.client import StageRemoteError
from skippy.lane.errors import InvalidMessage, UnsupportedKind
from skippy.lane.protocol import RULES, Answer, Handling, LaneProtocol, ReplyUpstream, SendDownstream
from skippy.stage.direct_return import ReturnHub, ReturnLane
from skippy.stage.transport import codec

sys.path.insert(0, str(Path(__file__).parent))
from stage_helpers import inprocess_chain, reference_greedy, stage_chain, wait_for_stats  # noqa: E402

K = MessageKind
DIRECT_KINDS = {K.PREFILL_FINAL_EMBD, K.DECODE_EMBD, K.DECODE_READOUT, K.DECODE_LIGHT_CTX,
                K.DECODE_REPLAY_FINAL_EMBD, K.VERIFY_WINDOW}
SPLITS = {1: ["0:4"], 2: ["0:2", "2:4"], 3: ["0:1", "1:2", "2:4"], 4: ["0:1", "1:2", "2:3", "3:4"]}
NULL_MODEL = "null:n_embd=8,n_layer=4,n_vocab=1000"


def message(kind: MessageKind, *, direct: bool = False, session_id: int = 1) -> StageMessage:
    created = StageMessage.create(kind, pos_start=3, token_count=1, session_id=session_id)
    return with_direct_return_flag(created) if direct else created


# -- the rules, sans-IO ---------------------------------------------------------------------------
def test_the_direct_return_rows_are_the_predicted_kinds_that_execute() -> None:
    assert {kind for kind, rule in RULES.items() if rule.direct_return} == DIRECT_KINDS
    for kind in DIRECT_KINDS:
        assert RULES[kind].answer is Answer.PREDICTION and RULES[kind].handling is Handling.EXECUTE
    assert RULES[K.PREDICTION_RETURN_OPEN].handling is Handling.RETURN_OPEN


@pytest.mark.parametrize("kind", sorted(DIRECT_KINDS), ids=lambda kind: kind.reference_name)
def test_a_flagged_prediction_takes_no_ticket_and_is_answered_on_the_return_lane(kind: MessageKind) -> None:
    lane = LaneProtocol(credit_limit=2)
    dispatch = lane.message_received(message(kind, direct=True))
    # no ticket: no reply goes up; in flight (a drain waits for it) until it leaves the stage
    assert dispatch.direct and dispatch.ticket is None and lane.inflight == 1
    lane.direct_done()
    assert lane.inflight == 0
    # a stage with a downstream forwards it and expects nothing back; the final stage answers
    # it over the return lane
    assert lane.computed(dispatch, has_downstream=True) == SendDownstream(None)
    assert lane.computed(dispatch, has_downstream=False) == ReplyUpstream(
        Answer.PREDICTION, window=kind is K.VERIFY_WINDOW, direct=True)
    # unflagged, the same kind keeps the hop-by-hop path
    plain = lane.message_received(message(kind))
    assert not plain.direct and plain.ticket is not None
    assert lane.computed(plain, has_downstream=False) == ReplyUpstream(Answer.PREDICTION,
                                                                       window=kind is K.VERIFY_WINDOW)


@pytest.mark.parametrize("kind", [K.PREFILL_EMBD, K.STOP, K.TRIM_SESSION, K.CONFIGURE_GENERATION, K.PROBE_PREFILL,
                                  K.TRY_RESTORE_PREFILL_DECODE, K.DECODE_REPLAY_EMBD],
                         ids=lambda kind: kind.reference_name)
def test_the_flag_changes_nothing_for_acked_kinds(kind: MessageKind) -> None:
    lane = LaneProtocol(credit_limit=2)
    dispatch = lane.message_received(message(kind, direct=True))
    assert not dispatch.direct and dispatch.ticket is not None  # middle stages still see their ACKs


def test_a_return_lane_is_opened_by_its_first_message_and_carries_nothing_else() -> None:
    lane = LaneProtocol(credit_limit=1)
    dispatch = lane.message_received(message(K.PREDICTION_RETURN_OPEN, direct=True))
    assert dispatch.rule.handling is Handling.RETURN_OPEN and dispatch.ticket is not None and lane.return_lane
    assert lane.computed(dispatch, has_downstream=False, forwarded=False) == ReplyUpstream(Answer.ACK)
    for kind in (K.DECODE_EMBD, K.PREDICTION_RETURN_OPEN, K.STOP):
        with pytest.raises(InvalidMessage, match="return lane") as raised:
            lane.message_received(message(kind, direct=True))
        assert raised.value.code is ErrorCode.STATE_MISMATCH


def test_a_return_open_without_the_flag_or_not_first_is_refused() -> None:
    with pytest.raises(UnsupportedKind, match="refused") as raised:
        LaneProtocol(1).message_received(message(K.PREDICTION_RETURN_OPEN))  # a v11 sender's open
    assert raised.value.code is ErrorCode.UNSUPPORTED_KIND
    lane = LaneProtocol(1)
    lane.message_received(message(K.CONFIGURE_GENERATION))
    with pytest.raises(UnsupportedKind, match="first message"):
        lane.message_received(message(K.PREDICTION_RETURN_OPEN, direct=True))
    assert not lane.return_lane


def _lane(session_id: int) -> ReturnLane:
    return ReturnLane(None, None, "peer", extensions=True, session_id=session_id, request_id=0)  # type: ignore[arg-type]


def test_the_hub_keys_return_lanes_by_the_lane_that_carries_the_session() -> None:
    carriers = {1: [10], 2: [10, 11], 3: [11]}
    hub = ReturnHub(lambda session: carriers.get(session, []))
    first, third = _lane(1), _lane(3)
    hub.open(first)
    hub.open(third)
    assert hub.get(10, 1) is first and hub.get(11, 3) is third and hub.get(11, 1) is None
    with pytest.raises(InvalidMessage, match="unknown session 9"):
        hub.open(_lane(9))
    with pytest.raises(InvalidMessage, match="ambiguous"):
        hub.open(_lane(2))
    with pytest.raises(InvalidMessage, match="already has a return lane"):
        hub.open(_lane(1))
    assert hub.detach(10) == [first] and hub.get(10, 1) is None and len(hub) == 1
    hub.remove(third)
    hub.remove(third)  # idempotent
    assert len(hub) == 0 and third.closed


# -- chains of null stage servers in this process ---------------------------------------------------
PROMPT = [1, 2, 3, 4, 5, 6, 7]


async def _generate(client: StageClient, session: int, final: object | None, steps: int = 12) -> list[int]:
    return await client.generate_greedy(session, PROMPT, steps, chunk_size=3, direct_return=final)  # type: ignore[arg-type]


@pytest.mark.parametrize(("stages", "shortcuts"), [(1, True), (2, True), (3, True), (4, True), (1, False), (4, False)])
async def test_direct_return_on_and_off_give_the_same_replies(stages: int, shortcuts: bool) -> None:
    # the lane shortcuts (bench/RESULTS-stage.md) on and off: the direct path is the same either way
    async with inprocess_chain(SPLITS[stages], write_through=shortcuts, inline_hand_offs=shortcuts,
                               inline_decode=shortcuts) as servers:
        final = servers[-1]
        async with await StageClient.connect(servers[0].address) as client:
            plain = await _generate(client, 1, None)
            direct = await _generate(client, 2, final.address)
            assert not client.direct_sessions  # stop closed it
            # prefill, decode and verify replies (tokens, window ids; stats carry timings)
            replies = {}
            for session, direct_on in ((3, False), (4, True)):
                await client.configure(session, prompt_token_count=len(PROMPT))
                if direct_on:
                    assert await client.open_direct_return(final.address, session)
                prefill = await client.prefill(session, PROMPT, chunk_size=3)
                decode = await client.decode(session, prefill.token, len(PROMPT))
                timings = client.last_timings
                assert timings is not None  # hop by hop every stage's record; direct, the final stage's
                assert [r.stage_index for r in timings.records] == (
                    [stages - 1] if direct_on else list(reversed(range(stages))))
                window = await client.verify(session, [decode.predicted, 5, 6], len(PROMPT) + 1, window_id=7)
                await client.stop(session)
                await trio.sleep(0.05)  # the stages finish their bookkeeping
                assert all(lane.inflight == 0 for server in servers for lane in server.connections)
                replies[direct_on] = (prefill.reply.predicted, decode.predicted, window.predicted, window.predicted_tokens, window.window_id)
        assert plain == direct and replies[True] == replies[False]
        assert final.stats.return_lanes == 2 and final.stats.direct_replies == 12 + 3
        assert all(server.stats.direct_replies == 0 for server in servers[:-1])
        assert all(server.stats.connection_errors == 0 for server in servers)


async def test_a_stage_that_is_not_final_refuses_the_open_and_the_session_stays_hop_by_hop() -> None:
    async with inprocess_chain(SPLITS[2]) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert not await client.open_direct_return(servers[0].address, 1)
            assert not client.direct_sessions
            result = await client.prefill(1, PROMPT, chunk_size=3)
            assert (await client.decode(1, result.token, len(PROMPT))).predicted >= 0
            await client.stop(1)
        assert servers[-1].stats.direct_replies == 0


async def test_an_unknown_session_is_refused_and_the_other_sessions_carry_on() -> None:
    async with inprocess_chain(SPLITS[3]) as servers:
        final = servers[-1]
        async with await StageClient.connect(servers[0].address) as client, \
                await StageClient.connect(servers[0].address) as other:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert await client.open_direct_return(final.address, 1)
            with pytest.raises(StageRemoteError, match="unknown session 99") as raised:
                await other.open_direct_return(final.address, 99)
            assert raised.value.code is ErrorCode.STATE_MISMATCH
            reference = await _generate(other, 2, None)
            result = await client.prefill(1, PROMPT, chunk_size=3)
            tokens = [result.token]
            for step in range(11):
                tokens.append((await client.decode(1, tokens[-1], len(PROMPT) + step)).predicted)
            await client.stop(1)
            assert tokens == reference
        assert final.stats.connection_errors == 1  # the refused return lane, nothing else


@pytest.mark.parametrize("garbage", [b"\xff" * 96, "message"], ids=["bytes", "a-message"])
async def test_a_return_lane_that_sends_anything_is_refused_and_the_others_carry_on(garbage: object) -> None:
    async with inprocess_chain(SPLITS[2]) as servers:
        final = servers[-1]
        async with await StageClient.connect(servers[0].address) as client, \
                await StageClient.connect(servers[0].address) as other:
            for session, lane in ((1, client), (2, other)):
                await lane.configure(session, prompt_token_count=len(PROMPT))
                assert await lane.open_direct_return(final.address, session)
            bad = other._returns.get(2)
            assert bad is not None
            if garbage == "message":
                frame = codec.encode_message(message(K.DECODE_EMBD, direct=True, session_id=2), 0, 0)
            else:
                frame = garbage  # type: ignore[assignment]
            await bad.stream.send_all(frame)  # type: ignore[arg-type]
            with trio.fail_after(2):
                with pytest.raises(StageRemoteError) as raised:
                    await other._receive_direct(2)
            code = ErrorCode.MALFORMED_FRAME if garbage != "message" else ErrorCode.STATE_MISMATCH
            assert raised.value.code is code and not other.direct_sessions
            # session 1 (its own return lane) and session 2 (now hop by hop) carry on
            result = await client.prefill(1, PROMPT, chunk_size=3)
            assert (await client.decode(1, result.token, len(PROMPT))).predicted >= 0
            await client.stop(1)
            result = await other.prefill(2, PROMPT, chunk_size=3)
            assert (await other.decode(2, result.token, len(PROMPT))).predicted >= 0
            await other.stop(2)
        assert final.stats.direct_replies == 2


async def test_a_lost_return_lane_fails_its_session_within_2_s_naming_the_stage() -> None:
    async with inprocess_chain(SPLITS[3]) as servers:
        final = servers[-1]
        async with await StageClient.connect(servers[0].address) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert await client.open_direct_return(final.address, 1)
            (lane,) = final.returns._lanes.values()
            await trio.aclose_forcefully(lane.stream)  # the final stage's end of the return lane goes
            started = time.monotonic()
            with pytest.raises(StageLost) as raised:
                await client.prefill(1, PROMPT, chunk_size=3)
            assert time.monotonic() - started < 2
            # the final stage refused the flagged message (no return lane any more): its Error
            # frame, relayed up the chain, names it
            assert raised.value.frame is not None and raised.value.frame.origin_stage_index == 2


# -- stage processes ------------------------------------------------------------------------------
async def test_a_killed_final_stage_fails_the_request_within_2_s_naming_it(tmp_path: Path) -> None:
    flags = ["--max-sessions", "4"]
    async with stage_chain(NULL_MODEL, SPLITS[4], tmp_path, flags) as chain:
        final = chain[-1]
        async with await StageClient.connect(chain[0].address) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert await client.open_direct_return(final.address, 1)
            result = await client.prefill(1, PROMPT, chunk_size=3)
            token = (await client.decode(1, result.token, len(PROMPT))).predicted
            final.kill()
            started = time.monotonic()
            with pytest.raises(StageLost) as raised:
                await client.decode(1, token, len(PROMPT) + 1)
            elapsed = time.monotonic() - started
    assert elapsed < 2, elapsed
    assert str(final.address.port) in str(raised.value), raised.value


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
async def test_f32_chain_matches_the_unsplit_model_with_direct_return(stages: int, tiny_llama: Path,
                                                                      tmp_path: Path) -> None:
    prompts = [[1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354], [1, 13, 4013, 338, 263, 1243]]
    reference = [reference_greedy(tiny_llama, prompt, 24, chunk_size=5) for prompt in prompts]
    flags = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "8"]
    async with stage_chain(str(tiny_llama), SPLITS[stages], tmp_path, flags) as chain:
        async with await StageClient.connect(chain[0].address) as client:
            for direct in (False, True):
                tokens = [await client.generate_greedy(index + 1, prompt, 24, chunk_size=5,
                                                       direct_return=chain[-1].address if direct else None)
                          for index, prompt in enumerate(prompts)]
                assert tokens == reference, direct
        await wait_for_stats(chain[-1], lambda stats: stats["direct_replies"] == 2 * 24)  # every prediction


# -- the driver's generation loop --------------------------------------------------------------------
@pytest.mark.parametrize("stages", [3, pytest.param(4, marks=pytest.mark.slow)])
async def test_the_generator_returns_directly_with_the_hop_by_hop_results(stages: int, tiny_llama: Path) -> None:
    """Generator.direct_return: requests that do not speculate open a return lane for their
    session; tokens, text, finish reasons and logprobs equal the hop-by-hop (and decode-run)
    results, every prediction came over a lane, and nothing is left open."""
    import dataclasses

    from skippy.driver.generator import GenerationRequest, Generator
    from skippy.runtime.sampling import SamplingParams

    generator = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=8)
    prompt = tuple(generator.encode("The quick brown fox"))
    sampled = SamplingParams(temperature=0.9, top_k=40, seed=11)
    requests = [GenerationRequest(prompt, 20, speculation=False),
                GenerationRequest(prompt, 20, sampling=sampled),
                GenerationRequest(prompt, 20, sampling=dataclasses.replace(sampled, repeat_penalty=1.3)),
                GenerationRequest(prompt, 16, speculation=False, logprobs=2)]
    try:
        async with inprocess_chain(SPLITS[stages], model=str(tiny_llama), ctx_size=512) as servers:
            async with await StageClient.connect(servers[0].address) as client:
                plain_stop = await generator.generate(client, GenerationRequest(prompt, 20, speculation=False), 90)
                stop_at = generator.tokenizer.piece(plain_stop.tokens[6]).decode("utf-8", "replace")
                requests.append(GenerationRequest(prompt, 20, stop=(stop_at,), speculation=False))
                results = {}
                for direct in (False, True):
                    generator.direct_return = (lambda: servers[-1].address) if direct else None
                    results[direct] = [await generator.generate(client, request, 10 * index + direct)
                                       for index, request in enumerate(requests)]
                assert not client.direct_sessions  # each request's lane closed at its stop
        for hop, direct in zip(results[False], results[True]):
            assert (direct.tokens, direct.text, direct.finish_reason) == (hop.tokens, hop.text, hop.finish_reason)
            assert direct.logprobs == hop.logprobs
        assert results[True][-1].finish_reason == "stop" and len(results[True][-1].tokens) < 20
        final = servers[-1].stats
        assert final.return_lanes == len(requests)
        # every prediction of the second pass (the first token of each included) came back directly
        assert final.direct_replies >= sum(len(result.tokens) for result in results[True])
        assert all(server.stats.sessions_in_use == 0 for server in servers)
    finally:
        generator.close()


def test_the_api_uses_direct_return_on_chains_of_two_or_more_known_stages() -> None:
    from skippy.api.lanes import LanePool, StageInfo
    from skippy.api.server import direct_return_source
    from skippy.net.address import Address

    def pool(count: int) -> LanePool:
        stages = [StageInfo(index, f"{index}:{index + 1}", Address("127.0.0.1", 7000 + index)) for index in range(count)]
        return LanePool(Address("127.0.0.1", 7000), stages=stages)

    given = Address("10.0.0.9", 7002)
    assert direct_return_source("auto", pool(1), None) is None  # one stage: its own reply is direct
    assert direct_return_source("auto", pool(0), None) is None
    two = direct_return_source("auto", pool(2), None)
    assert two is not None and two() == Address("127.0.0.1", 7001)
    three = pool(3)
    source = direct_return_source("auto", three, None)
    assert source is not None and source() == Address("127.0.0.1", 7002)
    three.stages = (*three.stages[:2], StageInfo(2, "2:3", Address("127.0.0.1", 7100)))  # a restarted final stage
    assert source() == Address("127.0.0.1", 7100)
    on = direct_return_source("on", pool(2), None)
    assert on is not None and on() == Address("127.0.0.1", 7001)
    given_source = direct_return_source("auto", pool(0), given)
    assert given_source is not None and given_source() == given
    assert direct_return_source("off", pool(4), given) is None
    with pytest.raises(ValueError, match="--final-stage"):
        direct_return_source("on", pool(0), None)
    with pytest.raises(ValueError, match="auto, on or off"):
        direct_return_source("sometimes", pool(3), None)
