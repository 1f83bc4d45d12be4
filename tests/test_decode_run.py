"""Decode runs (docs/protocol.md §11): the run's rules without a socket, then chains.

The first tests parse hostile run requests and step a :class:`DecodeRun` by hand.  The chain tests
run null-runtime stage servers in this trio run, comparing a run's tokens with the per-token
path's over 1-4 stages with the lane shortcuts on and off, ending runs early (a Stop, a lost
upstream) and refusing every misuse while the lane's other sessions carry on.  The f32 exactness
of the real tiny llama over stage processes is marked slow like tests/test_stage_chain.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from skippy.codec.decode_run import MAX_RUN_STOP_TOKENS, MAX_RUN_TOKENS, DecodeRunRequest
from skippy.codec.protocol import MessageKind, StageMessage, StateHeader, WireDType
from skippy.codec.protocol_ext import (
    DECODE_RUN_FEATURE,
    DECODE_RUN_FLAG,
    DECODE_RUN_METADATA_KEY,
    SKIPPY_EXTENSIONS_FLAG,
    ErrorCode,
)
from skippy.driver import StageClient
from skippy.driver.client import StageRemoteError
from skippy.lane.decode_run import DecodeRun
from skippy.stage.transport import codec

sys.path.insert(0, str(Path(__file__).parent))
from stage_helpers import inprocess_chain, reference_greedy, stage_chain, wait_for_stats  # noqa: E402

SPLITS = {1: ["0:4"], 2: ["0:2", "2:4"], 3: ["0:1", "1:2", "2:4"], 4: ["0:1", "1:2", "2:3", "3:4"]}
PROMPT = [1, 2, 3, 4, 5, 6, 7]


# -- the run request, sans-IO ------------------------------------------------------------------
def test_a_request_round_trips_through_its_metadata() -> None:
    request = DecodeRunRequest(40, frozenset({2, 106}))
    assert json.loads(request.metadata()) == {DECODE_RUN_METADATA_KEY: {"max_tokens": 40, "stop_tokens": [2, 106]}}
    assert DecodeRunRequest.from_metadata(request.metadata()) == request


@pytest.mark.parametrize(("metadata", "named"), [
    (None, "not JSON"),
    ("{", "not JSON"),
    ("[]", f"no {DECODE_RUN_METADATA_KEY} object"),
    ('{"other": 1}', f"no {DECODE_RUN_METADATA_KEY} object"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {}}), "max_tokens must be an integer"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 0}}), "max_tokens must be an integer"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": MAX_RUN_TOKENS + 1}}), "max_tokens must be an integer"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": True}}), "max_tokens must be an integer"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 4.0}}), "max_tokens must be an integer"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 4, "stop_tokens": 2}}), "must be a list"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 4, "stop_tokens": [-1]}}), "token ids in"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 4, "stop_tokens": [1 << 31]}}), "token ids in"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 4, "stop_tokens": ["2"]}}), "token ids in"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 4, "stop_tokens": [False]}}), "token ids in"),
    (json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": 4, "stop_tokens": list(range(MAX_RUN_STOP_TOKENS + 1))}}),
     f"at most {MAX_RUN_STOP_TOKENS}"),
])
def test_a_bad_request_is_refused_naming_the_field(metadata: str | None, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        DecodeRunRequest.from_metadata(metadata)


def _flagged(position: int = 9, token: int = 42, decode_step: int = 0) -> StageMessage:
    template = StateHeader.for_kind(MessageKind.DECODE_EMBD)
    state = StateHeader(version=template.version, phase=template.phase,
                        flags=template.flags | SKIPPY_EXTENSIONS_FLAG | DECODE_RUN_FLAG,
                        decode_step=decode_step, current_token=token, reserved=template.reserved)
    return StageMessage(MessageKind.DECODE_EMBD, pos_start=position, token_count=1, state=state, request_id=3,
                        session_id=5, chat_sampling_metadata=DecodeRunRequest(4).metadata(),
                        tokens=np.array((token,), dtype=np.int32))


def test_a_run_steps_one_position_at_a_time_until_its_budget() -> None:
    flagged = _flagged()
    run = DecodeRun(flagged, DecodeRunRequest(4))
    first = run.first_message(flagged)
    # what the stage executes and forwards: the same decode without the flag or the metadata
    assert not first.state.flags & DECODE_RUN_FLAG and first.state.flags & SKIPPY_EXTENSIONS_FLAG
    assert first.chat_sampling_metadata is None and first.pos_start == 9 and list(first.tokens) == [42]
    steps = [run.advance(token) for token in (100, 101, 102, 103)]
    assert steps[-1] is None and run.over and run.steps == 4
    for index, step in enumerate(steps[:-1]):
        assert step is not None
        assert step.kind == MessageKind.DECODE_EMBD and step.session_id == 5 and step.request_id == 3
        assert step.pos_start == 10 + index and list(step.tokens) == [100 + index]
        assert step.state.current_token == 100 + index and step.state.decode_step == 1 + index
        assert not step.state.flags & DECODE_RUN_FLAG and step.chat_sampling_metadata is None
        # the step encodes as any decode (its header passes the codec's checks)
        assert len(codec.encode_message(step, WireDType.F32, 0)) > 0


def test_a_run_ends_after_a_stop_token_or_when_cancelled() -> None:
    run = DecodeRun(_flagged(), DecodeRunRequest(100, frozenset({7})))
    assert run.advance(3) is not None and run.advance(7) is None and run.over
    run = DecodeRun(_flagged(), DecodeRunRequest(100))
    assert run.advance(3) is not None
    run.cancelled = True
    assert run.advance(4) is None and run.over


# -- chains of null stage servers in this process --------------------------------------------------
@pytest.mark.parametrize(("stages", "shortcuts"), [(1, True), (2, True), (4, True), (1, False), (4, False)])
async def test_a_run_gives_the_per_token_tokens(stages: int, shortcuts: bool) -> None:
    async with inprocess_chain(SPLITS[stages], write_through=shortcuts, inline_hand_offs=shortcuts,
                               inline_decode=shortcuts) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            plain = await client.generate_greedy(1, PROMPT, 16, chunk_size=3)
            run = await client.generate_greedy(2, PROMPT, 16, chunk_size=3, run=True)
            assert run == plain and client.run_overshoot == 0
            await trio.sleep(0.05)
            assert all(lane.inflight == 0 for server in servers for lane in server.connections)
        first = servers[0]
        # one run; its steps after the flagged one were started by the first stage itself
        assert first.stats.decode_runs == 1 and first.stats.decode_run_steps == 14
        assert all(server.stats.decode_runs == 0 for server in servers[1:])
        assert all(server.stats.connection_errors == 0 for server in servers)


async def test_a_run_ends_at_a_stop_token() -> None:
    async with inprocess_chain(SPLITS[2]) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            plain = await client.generate_greedy(1, PROMPT, 12, chunk_size=3)
            await client.configure(2, prompt_token_count=len(PROMPT))
            token = (await client.prefill(2, PROMPT, chunk_size=3)).token
            stop = plain[5]
            tokens = [token, (await client.start_run(2, token, len(PROMPT), max_tokens=50,
                                                     stop_tokens=frozenset({stop}))).predicted]
            while client.running:
                tokens.append((await client.next_run_token(2)).predicted)
            assert tokens == plain[:plain.index(stop) + 1]
            await client.stop(2)
            assert client.run_overshoot == 0


async def test_a_stop_ends_a_run_early_and_the_lane_carries_on() -> None:
    async with inprocess_chain(SPLITS[3]) as servers:
        first = servers[0]
        async with await StageClient.connect(first.address) as client:
            reference = await client.generate_greedy(1, PROMPT, 20, chunk_size=3)
            await client.configure(2, prompt_token_count=len(PROMPT))
            token = (await client.prefill(2, PROMPT, chunk_size=3)).token
            tokens = [token, (await client.start_run(2, token, len(PROMPT), max_tokens=100_000)).predicted]
            for _ in range(4):
                tokens.append((await client.next_run_token(2)).predicted)
            await client.stop(2)  # drops the predictions of steps already started, then the Stop's ACK
            assert not client.running and tokens == reference[:6]
            assert client.run_overshoot <= 2
            steps = first.stats.decode_run_steps
            await trio.sleep(0.1)
            assert first.stats.decode_run_steps == steps  # no step started after the Stop
            # the same lane: a new session (and a plain decode) as if nothing happened
            assert await client.generate_greedy(3, PROMPT, 20, chunk_size=3, run=True) == reference
            assert await client.generate_greedy(4, PROMPT, 20, chunk_size=3) == reference
        await trio.sleep(0.05)
        assert all(server.stats.sessions_in_use == 0 for server in servers)
        assert all(server.stats.connection_errors == 0 for server in servers)


@pytest.mark.parametrize("stages", [1, 3])
async def test_end_run_leaves_the_kv_of_the_per_token_loop_and_the_session_goes_on(stages: int,
                                                                                    tiny_llama: Path) -> None:
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599]
    reference = reference_greedy(tiny_llama, prompt, 20, chunk_size=4)
    async with inprocess_chain(SPLITS[stages], model=str(tiny_llama), ctx_size=512) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            await client.configure(1, prompt_token_count=len(prompt))
            tokens = [(await client.prefill(1, prompt, chunk_size=4)).token]
            tokens.append((await client.start_run(1, tokens[-1], len(prompt), max_tokens=100)).predicted)
            for _ in range(5):
                tokens.append((await client.next_run_token(1)).predicted)
            await trio.sleep(0.05)  # the stage runs ahead meanwhile: its steps wrote past the driver
            position = await client.end_run(1)
            assert position == len(prompt) + len(tokens) - 1 and not client.running
            for server in servers:  # the cells the run's last steps wrote past the driver are gone
                await server.refresh_runtime_stats()
                assert server.stats.kv_cells_used == position
            # every stage's KV is the per-token loop's: the session goes on where the driver is
            while len(tokens) < 12:
                tokens.append((await client.decode(1, tokens[-1], len(prompt) + len(tokens) - 1)).predicted)
            tokens.append((await client.start_run(1, tokens[-1], len(prompt) + len(tokens) - 1,
                                                  max_tokens=20 - len(tokens))).predicted)
            while client.running:
                tokens.append((await client.next_run_token(1)).predicted)
            assert tokens == reference
            await client.stop(1)


async def test_a_lost_upstream_ends_its_run_and_frees_the_session() -> None:
    async with inprocess_chain(SPLITS[2]) as servers:
        first = servers[0]
        client = await StageClient.connect(first.address)
        await client.configure(1, prompt_token_count=len(PROMPT))
        token = (await client.prefill(1, PROMPT, chunk_size=3)).token
        await client.start_run(1, token, len(PROMPT), max_tokens=100_000)
        await client.next_run_token(1)
        await client.aclose()
        with trio.fail_after(5):
            while first.stats.sessions_in_use or servers[1].stats.sessions_in_use or first.connections:
                await trio.sleep(0.02)
        steps = first.stats.decode_run_steps
        await trio.sleep(0.2)
        assert first.stats.decode_run_steps == steps and steps < 1000


def _run_message(token: int, position: int, *, kind: MessageKind = MessageKind.DECODE_EMBD,
                 metadata: str | None = None, session_id: int = 1) -> bytes:
    template = StateHeader.for_kind(kind)
    state = StateHeader(version=template.version, phase=template.phase,
                        flags=template.flags | SKIPPY_EXTENSIONS_FLAG | DECODE_RUN_FLAG, decode_step=-1,
                        current_token=token, reserved=template.reserved)
    message = StageMessage(kind, pos_start=position, token_count=1, state=state, session_id=session_id,
                           chat_sampling_metadata=DecodeRunRequest(8).metadata() if metadata is None else metadata,
                           tokens=np.array((token,), dtype=np.int32))
    return codec.encode_message(message, WireDType.F32, 0)


@pytest.mark.parametrize(("case", "named"), [
    ("prefill", "a decode run starts with a DecodeEmbd only"),
    ("metadata", f"no {DECODE_RUN_METADATA_KEY} object"),
    ("budget", "max_tokens must be an integer"),
    ("middle", "only the chain's first stage runs a decode loop"),
])
async def test_a_misused_run_is_refused_naming_why_and_the_other_lanes_carry_on(case: str, named: str) -> None:
    async with inprocess_chain(SPLITS[2]) as servers:
        target = servers[1] if case == "middle" else servers[0]
        async with await StageClient.connect(target.address) as bad, \
                await StageClient.connect(servers[0].address) as good:
            reference = await good.generate_greedy(1, PROMPT, 10, chunk_size=3)
            await bad.configure(1, prompt_token_count=len(PROMPT))
            # (a middle stage cannot prefill tokens: it is refused before anything runs anyway)
            token = 5 if case == "middle" else (await bad.prefill(1, PROMPT, chunk_size=3)).token
            if case == "prefill":
                frame = _run_message(token, len(PROMPT), kind=MessageKind.PREFILL_EMBD)
            elif case == "metadata":
                frame = _run_message(token, len(PROMPT), metadata='{"x": 1}')
            elif case == "budget":
                frame = _run_message(token, len(PROMPT), metadata=json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": -3}}))
            else:
                frame = _run_message(token, len(PROMPT))
            await bad.send_raw(frame)
            with trio.fail_after(5), pytest.raises(StageRemoteError, match=named) as raised:
                await bad.receive()
            assert raised.value.code is ErrorCode.STATE_MISMATCH
            assert await good.generate_greedy(2, PROMPT, 10, chunk_size=3, run=True) == reference


async def test_a_run_and_a_direct_return_session_do_not_mix() -> None:
    async with inprocess_chain(SPLITS[2]) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            await client.configure(1, prompt_token_count=len(PROMPT))
            assert await client.open_direct_return(servers[-1].address, 1)
            token = (await client.prefill(1, PROMPT, chunk_size=3)).token
            with pytest.raises(ValueError, match="direct-return"):
                await client.start_run(1, token, len(PROMPT), max_tokens=4)
            await client.stop(1)


# -- stage processes on the real tiny llama ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 4])
async def test_f32_chain_matches_the_unsplit_model_with_decode_runs(stages: int, tiny_llama: Path,
                                                                   tmp_path: Path) -> None:
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354]
    reference = reference_greedy(tiny_llama, prompt, 24, chunk_size=5)
    flags = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "8"]
    async with stage_chain(str(tiny_llama), SPLITS[stages], tmp_path, flags) as chain:
        async with await StageClient.connect(chain[0].address) as client:
            assert await client.generate_greedy(1, prompt, 24, chunk_size=5, run=True) == reference
        await wait_for_stats(chain[0], lambda stats: stats["decode_run_steps"] == 22)


# -- the driver's generation loop --------------------------------------------------------------------
@pytest.mark.parametrize("stages", [1, pytest.param(3, marks=pytest.mark.slow)])
async def test_the_generator_decodes_as_runs_with_the_per_token_results(stages: int, tiny_llama: Path) -> None:
    from skippy.driver.generator import Generator, GenerationRequest
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
                # a stop string cut in the middle of the run: the predictions already made are dropped
                stop_at = generator.tokenizer.piece(plain_stop.tokens[6]).decode("utf-8", "replace")
                requests.append(GenerationRequest(prompt, 20, stop=(stop_at,), speculation=False))
                results = {}
                for runs in (False, True):
                    generator.decode_runs = runs
                    results[runs] = [await generator.generate(client, request, 10 * index + runs)
                                     for index, request in enumerate(requests)]
        for plain, run in zip(results[False], results[True]):
            assert (run.tokens, run.text, run.finish_reason) == (plain.tokens, plain.text, plain.finish_reason)
            assert run.logprobs == plain.logprobs
        assert results[True][-1].finish_reason == "stop" and len(results[True][-1].tokens) < 20
        # every request of the second pass ran as one run on the first stage (as did the one that
        # found the stop string), none of the first pass
        assert servers[0].stats.decode_runs == len(requests) + 1
        assert all(server.stats.sessions_in_use == 0 for server in servers)
    finally:
        generator.close()


# -- a one-stage chain's run on the data plane (the real tiny llama, this trio run) -----------------
@pytest.fixture(params=["cython", "python"])
def relay_implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which loop carries the data plane's runs: the Cython module or its twin."""
    from skippy.stage import _relay_py, decode_relay

    if request.param == "python":
        monkeypatch.setattr(decode_relay, "_implementation", _relay_py)
    elif decode_relay.IMPLEMENTATION != "cython":
        pytest.skip("skippy.stage._relay not built")
    return str(request.param)


ONE_STAGE_PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599]


async def _start(client: StageClient, session: int, *, max_tokens: int, stop_tokens: frozenset[int] = frozenset()
                 ) -> list[int]:
    await client.configure(session, prompt_token_count=len(ONE_STAGE_PROMPT))
    tokens = [(await client.prefill(session, ONE_STAGE_PROMPT, chunk_size=4)).token]
    tokens.append((await client.start_run(session, tokens[-1], len(ONE_STAGE_PROMPT), max_tokens=max_tokens,
                                          stop_tokens=stop_tokens)).predicted)
    return tokens


async def test_a_one_stage_run_on_the_data_plane_gives_the_lanes_tokens_to_its_budget_or_stop_token(
        tiny_llama: Path, relay_implementation: str) -> None:
    """The data plane drives the run's steps after its first or second (each from the last one's pick):
    the unsplit tokens, the lane's step count, to the budget and to a stop token, with no
    overshoot; with the relay off the lane drives every step."""
    reference = reference_greedy(tiny_llama, ONE_STAGE_PROMPT, 30, chunk_size=4)
    for relay in (True, False):
        async with inprocess_chain(SPLITS[1], model=str(tiny_llama), ctx_size=512, decode_relay=relay) as servers:
            stage = servers[0]
            async with await StageClient.connect(stage.address) as client:
                tokens = await _start(client, 1, max_tokens=29)
                while client.running:
                    tokens.append((await client.next_run_token(1)).predicted)
                assert tokens == reference and client.run_overshoot == 0
                await client.stop(1)
                carried = stage.stats.decode_relay_steps
                assert stage.stats.decode_run_steps == 28
                assert (carried >= 27) if relay else carried == 0, carried  # (the lane's path: the first one or two)
                stop = reference[16]
                tokens = await _start(client, 2, max_tokens=100, stop_tokens=frozenset({stop}))
                while client.running:
                    tokens.append((await client.next_run_token(2)).predicted)
                assert tokens == reference[:reference.index(stop) + 1] and client.run_overshoot == 0
                await client.stop(2)
                assert (stage.stats.decode_relay_steps > carried) == relay
                # the runtime's busy time counts the data plane's computes as the lane's
                assert stage.stats.runtime_busy_us >= stage.stats.compute_us > 0
            await trio.sleep(0.05)
            assert stage.stats.sessions_in_use == 0 and stage.stats.connection_errors == 0


async def test_a_stop_or_end_run_during_a_data_plane_run_ends_it_between_steps(
        tiny_llama: Path, relay_implementation: str) -> None:
    """A message from upstream stops the loop between steps: a Stop ends the run (no step after
    it, the lane carries on with a new run); ``end_run`` trims to the driver's position and the
    session goes on where the driver is."""
    reference = reference_greedy(tiny_llama, ONE_STAGE_PROMPT, 24, chunk_size=4)
    async with inprocess_chain(SPLITS[1], model=str(tiny_llama), ctx_size=512) as servers:
        stage = servers[0]
        async with await StageClient.connect(stage.address) as client:
            tokens = await _start(client, 1, max_tokens=100_000)
            for _ in range(6):
                tokens.append((await client.next_run_token(1)).predicted)
            await trio.sleep(0.05)  # the loop runs ahead meanwhile
            await client.stop(1)
            assert not client.running and tokens == reference[:8]
            assert stage.stats.decode_relay_steps > 0
            steps = stage.stats.decode_run_steps
            await trio.sleep(0.1)
            assert stage.stats.decode_run_steps == steps  # no step started after the Stop
            tokens = await _start(client, 2, max_tokens=100)
            for _ in range(5):
                tokens.append((await client.next_run_token(2)).predicted)
            await trio.sleep(0.05)
            position = await client.end_run(2)
            assert position == len(ONE_STAGE_PROMPT) + len(tokens) - 1 and not client.running
            await stage.refresh_runtime_stats()
            assert stage.stats.kv_cells_used == position
            while len(tokens) < 12:
                tokens.append((await client.decode(2, tokens[-1], len(ONE_STAGE_PROMPT) + len(tokens) - 1)).predicted)
            tokens.append((await client.start_run(2, tokens[-1], len(ONE_STAGE_PROMPT) + len(tokens) - 1,
                                                  max_tokens=24 - len(tokens))).predicted)
            while client.running:
                tokens.append((await client.next_run_token(2)).predicted)
            assert tokens == reference
            await client.stop(2)
        await trio.sleep(0.05)
        await stage.refresh_runtime_stats()
        assert stage.stats.sessions_in_use == 0 and stage.stats.connection_errors == 0


async def test_other_lanes_and_the_step_limit_hand_a_data_plane_run_back_to_the_lane(
        tiny_llama: Path, relay_implementation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another lane's work stops the loop between steps (the run's next steps take the lane's
    path, batched with the other lane's rows, and the data plane takes the run again once the
    other lane is quiet); every five steps the loop hands its counts over and goes on: both
    sessions get the unsplit tokens."""
    from skippy.stage import decode_relay

    monkeypatch.setattr(decode_relay, "MAX_STEPS", 5)
    monkeypatch.setattr("skippy.stage.scheduler.RECENT_WORK_S", 0.05)
    reference = reference_greedy(tiny_llama, ONE_STAGE_PROMPT, 400, chunk_size=4)
    async with inprocess_chain(SPLITS[1], model=str(tiny_llama), ctx_size=512) as servers:
        stage = servers[0]
        async with await StageClient.connect(stage.address) as running, \
                await StageClient.connect(stage.address) as other:
            tokens = await _start(running, 1, max_tokens=399)
            for _ in range(6):
                tokens.append((await running.next_run_token(1)).predicted)
            assert await other.generate_greedy(7, ONE_STAGE_PROMPT, 8, chunk_size=4) == reference[:8]
            while running.running:
                tokens.append((await running.next_run_token(1)).predicted)
            assert tokens == reference
            await running.stop(1)
        stats = stage.stats
        assert stats.decode_run_steps == 398
        assert stats.decode_relay_runs >= 300 // 5, stats.decode_relay_runs
        assert stats.decode_run_steps - stats.decode_relay_steps > 2  # (the lane's path took steps beside the other's)
        await trio.sleep(0.05)
        await stage.refresh_runtime_stats()
        assert stats.sessions_in_use == 0 and stats.connection_errors == 0


async def test_a_lost_upstream_ends_a_data_plane_run_and_frees_the_session(tiny_llama: Path,
                                                                          relay_implementation: str) -> None:
    async with inprocess_chain(SPLITS[1], model=str(tiny_llama), ctx_size=512) as servers:
        stage = servers[0]
        client = await StageClient.connect(stage.address)
        await _start(client, 1, max_tokens=100_000)
        for _ in range(4):
            await client.next_run_token(1)
        await client.aclose()
        with trio.fail_after(5):
            while stage.stats.sessions_in_use or stage.connections:
                await trio.sleep(0.02)
        assert stage.stats.decode_relay_steps > 0
        steps = stage.stats.decode_run_steps
        await trio.sleep(0.2)
        assert stage.stats.decode_run_steps == steps and steps < 1000


async def test_an_upstream_that_stops_reading_a_data_plane_run_does_not_hold_the_runtime(
        tiny_llama: Path, relay_implementation: str) -> None:
    """A driver that stops reading its run's predictions (its socket's buffers full): the loop
    hands the run back before a step whose reply has no room (the lane's path waits for the
    reader, not the runtime), so another lane's request is served meanwhile."""
    import socket

    async with inprocess_chain(SPLITS[1], model=str(tiny_llama), ctx_size=8192) as servers:
        stage = servers[0]
        async with await StageClient.connect(stage.address) as silent, \
                await StageClient.connect(stage.address) as other:
            silent.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            for connection in stage.connections:  # the stage's side of every lane: small send buffers
                connection.up.io.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            await _start(silent, 1, max_tokens=8000)  # then reads nothing more
            reference = reference_greedy(tiny_llama, ONE_STAGE_PROMPT, 8, chunk_size=4)
            with trio.fail_after(30):  # until the silent run's replies fill the buffers
                steps = -1
                while steps != stage.stats.decode_run_steps:
                    steps = stage.stats.decode_run_steps
                    await trio.sleep(0.3)
            with trio.fail_after(10):
                assert await other.generate_greedy(7, ONE_STAGE_PROMPT, 8, chunk_size=4) == reference
            # the data plane carried the silent run until its replies had no room; it still waits
            assert stage.stats.decode_relay_steps > 0 and stage.stats.decode_run_steps < 7999
