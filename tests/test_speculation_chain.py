"""Speculative decoding through real stage chains (``python -m skippy.stage`` processes, tiny llama).

* Greedy outputs with speculation equal those without, token for token, on 1-, 2- and 4-stage
  chains, for prompts whose greedy continuation repeats (a code prompt and a period-3 "quoting"
  prompt: drafts get accepted) and for ones that do not; and every stage's KV after the request
  (read from its ``--stats-file`` ``kv_cells_used`` just before Stop) is as long as without
  speculation, including runs cut by a stop string and by ``max_tokens``.
* Sampled requests (fixed seeds, vocabulary restricted to two tokens with ``logit_bias`` +
  ``top_k``) follow the target distribution: the joint law of the first five tokens over many
  trials against the exact law computed from the unsplit model (chi-square, p > 1e-9).
* Faults: the final stage killed with windows in flight fails the request within seconds with a
  clear error; a fake first stage answering two windows in swapped order fails the lane with
  "verify window reply out of order".
"""

from __future__ import annotations

import functools
import itertools
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest
import trio

from skippy.codec.protocol import READY_BYTES, MessageKind, StageMessage, StageReply
from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.driver.client import StageClientError, StageLost
from skippy.driver.speculation import ControllerConfig
from skippy.net.address import Address
from skippy.net.socket_io import SocketIO
from skippy.runtime import Model, SamplingParams, StageContext
from skippy.stage.transport import MessageReader

from skippy.codec import wire as codec

from conftest import PROMPT
from stage_helpers import StageProcess, stage_chain
from test_speculation_acceptance import chi_square_p_value

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
QUOTE = 'He said "to be or not to be, that is the question" and she said "to be or not to be, that is'
#: The tiny llama answers this with a period-3 loop (quoting its own output).
LOOP = [1] + [29871] * 24
SPLITS = {1: ["0:4"], 2: ["0:2", "2:4"], 4: ["0:1", "1:2", "2:3", "3:4"]}


@pytest.fixture(scope="module")
def generator(tiny_llama: Path) -> Iterator[Generator]:
    gen = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=16, credit=2)
    yield gen
    gen.close()


#: A session id no request uses: :class:`ProbingClient` stops it to end the stages' decode relays.
IDLE_SESSION = 1 << 40


class ProbingClient(StageClient):
    """A lane that reads every stage's KV cell count just before it sends Stop.

    A decode relay still holding a stage's runtime keeps its stats file from reading the figures
    until it has waited ``skippy.stage.server.RELAY_IDLE_READ_S`` (0.5 s) for its next frame; a
    Stop of a session that does not exist, sent first on the same lane, ends the relay on every
    stage at once (the loop hands back a frame it does not carry) and changes no KV."""

    stages: Sequence[StageProcess] = ()
    kv: list[int] = []

    async def stop(self, session_id: int, *, request_id: int = 0) -> StageReply:
        await super().stop(IDLE_SESSION)
        self.kv = await settled_kv(self.stages)
        return await super().stop(session_id, request_id=request_id)


async def settled_kv(stages: Sequence[StageProcess]) -> list[int]:
    """Every stage's ``kv_cells_used`` from a stats file refreshed after this call began (the
    files are rewritten every 0.1 s, each with the ``time.time()`` taken before its refresh; the
    request's last exchange was acknowledged before this is called, so such a refresh sees its
    final KV)."""
    asked = time.time()
    with trio.fail_after(30):
        while True:
            await trio.sleep(0.05)
            try:
                files = [stage.stats() for stage in stages]
            except (OSError, ValueError):
                continue
            if all(float(data.get("refreshed_at", 0)) > asked for data in files):  # type: ignore[arg-type]
                return [int(data["kv_cells_used"]) for data in files]  # type: ignore[call-overload]


async def run_probed(generator: Generator, stages: Sequence[StageProcess], request: GenerationRequest,
                     session: int) -> tuple[list[int], list[int], object]:
    assert stages[0].address is not None
    client = await ProbingClient.connect(stages[0].address)
    client.stages = stages
    async with client:
        completion = await generator.generate(client, request, session)
    return completion.tokens, client.kv, completion.speculation


@pytest.mark.parametrize("stage_count", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)])
async def test_greedy_speculation_is_exact_and_leaves_the_same_kv(generator: Generator, tiny_llama: Path,
                                                                  tmp_path: Path, stage_count: int) -> None:
    cases = [("code", tuple(generator.encode(CODE)), 48, True), ("loop", tuple(LOOP), 48, True),
             ("quote", tuple(generator.encode(QUOTE)), 24, False), ("prompt", tuple(PROMPT), 24, False)]
    async with stage_chain(str(tiny_llama), SPLITS[stage_count], tmp_path) as stages:
        session = 100
        for name, prompt, max_tokens, repetitive in cases:
            plain = GenerationRequest(prompt, max_tokens, speculation=False)
            generator.decode_runs = False  # the per-token loop: the KV reference
            tokens, kv, usage = await run_probed(generator, stages, plain, session)
            assert usage is None
            assert kv == [len(prompt) + len(tokens) - 1] * stage_count
            generator.decode_runs = True  # docs/protocol.md §11: a run's tokens are the same (its KV
            # may run ahead of the driver until the Stop: not compared)
            assert (await run_probed(generator, stages, plain, session + 2))[0] == tokens, name
            fast = GenerationRequest(prompt, max_tokens, speculation=True)
            spec_tokens, spec_kv, spec_usage = await run_probed(generator, stages, fast, session + 1)
            assert spec_tokens == tokens, name
            assert spec_kv == kv, name
            if repetitive:
                assert spec_usage.accepted > 0, (name, spec_usage)  # type: ignore[attr-defined]
            if name == "loop":  # cut by a stop string in the middle of an accepted run
                piece = generator.tokenizer.piece(tokens[20]).decode("utf-8", "replace")
                stops = GenerationRequest(prompt, max_tokens, stop=(piece,), speculation=False)
                generator.decode_runs = False
                cut, cut_kv, _ = await run_probed(generator, stages, stops, session + 2)
                generator.decode_runs = True
                spec_cut, spec_cut_kv, _ = await run_probed(
                    generator, stages, GenerationRequest(prompt, max_tokens, stop=(piece,), speculation=True),
                    session + 3)
                assert (spec_cut, spec_cut_kv) == (cut, cut_kv)
                assert len(cut) < 20
            session += 4


def target_law(path: Path, prompt: Sequence[int], pair: tuple[int, int], length: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every ``length``-token continuation over the two tokens of ``pair``."""
    a, b = pair
    law: dict[tuple[int, ...], float] = {}
    cache: dict[tuple[int, ...], float] = {}
    with Model(path) as model, StageContext(model, n_ctx=256, max_sessions=2, n_batch=64, threads=1) as ctx:
        def probability_of_a(prefix: tuple[int, ...]) -> float:
            if prefix not in cache:
                tokens = list(prompt) + list(prefix)
                seq = ctx.open_session()
                ctx.decode(tokens=tokens, positions=list(range(len(tokens))), seq_ids=[seq] * len(tokens),
                           outputs=[False] * (len(tokens) - 1) + [True])
                logits = ctx.logits(int(ctx.output_rows[-1]))
                ctx.close_session(seq)
                cache[prefix] = float(1.0 / (1.0 + np.exp(float(logits[b]) - float(logits[a]))))
            return cache[prefix]
        for combo in itertools.product(pair, repeat=length):
            p = 1.0
            for index, token in enumerate(combo):
                pa = probability_of_a(combo[:index])
                p *= pa if token == a else 1.0 - pa
            law[combo] = p
    return law


@pytest.mark.slow
async def test_sampled_speculation_keeps_the_target_distribution(tiny_llama: Path, tmp_path: Path) -> None:
    pair, length, trials = (30197, 24583), 5, 500
    prompt = tuple([1] + list(pair) * 10)
    law = target_law(tiny_llama, prompt, pair, length)
    # Speculate whenever a draft exists, several windows deep, so rejected rows consume draws.
    generator = Generator.from_model(tiny_llama, n_ctx=256, controller=ControllerConfig(
        min_gain=1.0, prior_acceptance=0.9, prior_weight=50.0, max_window=2))
    counts = {combo: 0 for combo in law}
    proposed = accepted = 0
    try:
        async with stage_chain(str(tiny_llama), SPLITS[2], tmp_path) as stages:
            assert stages[0].address is not None
            async with await StageClient.connect(stages[0].address) as client:
                for seed in range(trials):
                    sampling = SamplingParams(temperature=1.0, top_k=2, seed=seed,
                                              logit_bias=((pair[0], 100.0), (pair[1], 100.0)))
                    completion = await generator.generate(
                        client, GenerationRequest(prompt, length, sampling, speculation=True), 1000 + seed)
                    counts[tuple(completion.tokens)] += 1
                    assert completion.speculation is not None
                    proposed += completion.speculation.proposed
                    accepted += completion.speculation.accepted
    finally:
        generator.close()
    assert 0 < accepted < proposed, (accepted, proposed)  # windows ran, and some drafts were rejected
    combos = sorted(law)
    observed = np.array([counts[c] for c in combos], dtype=np.float64)
    expected = np.array([law[c] for c in combos])
    # Pool the cells expected below 5 observations so the chi-square approximation holds.
    small = expected * trials < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    assert chi_square_p_value(observed, expected / expected.sum()) > 1e-9


async def test_a_stage_lost_with_windows_in_flight_fails_the_request(generator: Generator, tiny_llama: Path,
                                                                    tmp_path: Path) -> None:
    async with stage_chain(str(tiny_llama), SPLITS[2], tmp_path) as stages:
        assert stages[0].address is not None
        client = await StageClient.connect(stages[0].address, reply_timeout=30)
        async with client:
            run = generator.start(client, GenerationRequest(tuple(generator.encode(CODE)), 400, speculation=True), 5)
            with trio.fail_after(30):
                while True:
                    await run.__anext__()
                    runner = run._runner
                    assert runner is not None
                    if runner.in_flight >= 1 and runner.decoder.usage.windows >= 3:
                        break
            stages[1].kill()
            with trio.fail_after(5), pytest.raises(StageClientError, match="closed|lost|failed") as caught:
                while True:
                    await run.__anext__()
            assert isinstance(caught.value, StageLost)
            assert run.result is None


async def fake_first_stage(stream: trio.SocketStream, token: int) -> None:
    """Speaks just enough of the protocol: ACKs control, predicts ``token`` forever, and answers
    verify windows in pairs, newest first (the fault under test)."""
    io = SocketIO(stream)
    await io.send_all(READY_BYTES)
    reader = MessageReader(io, "driver", 8)
    held: list[StageMessage] = []

    async def reply(answer: StageReply) -> None:
        await io.send_all(codec.encode_reply(answer))

    while (message := await reader.next()) is not None:
        kind = MessageKind(message.kind)
        if kind is MessageKind.VERIFY_WINDOW:
            held.append(message)
            if len(held) == 2:
                for window in reversed(held):
                    await reply(StageReply.predicted_token_vector((token,) * window.token_count,
                                                                  window_id=window.state.seq_id))
                held.clear()
        elif kind in (MessageKind.DECODE_EMBD, MessageKind.PREFILL_FINAL_EMBD):
            await trio.sleep(0.005)
            await reply(StageReply.predicted_token(token))
        elif kind is not MessageKind.RETIRE_VERIFY_WINDOW:
            await reply(StageReply.ack())


async def test_a_window_reply_out_of_order_fails_the_lane(tiny_llama: Path) -> None:
    token = 450
    generator = Generator.from_model(tiny_llama, n_ctx=256, controller=ControllerConfig(
        min_gain=1.0, prior_acceptance=0.9, prior_weight=50.0, max_window=4))
    try:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, functools.partial(fake_first_stage, token=token), 0,
                                  host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            client = await StageClient.connect(Address("127.0.0.1", port), reply_timeout=5)
            request = GenerationRequest(tuple([1] + [token] * 12), 64, speculation=True)
            with trio.fail_after(10), pytest.raises(StageClientError, match="verify window reply out of order"):
                await generator.generate(client, request, 9)
            with pytest.raises(StageLost):  # the lane was closed: it cannot be trusted any more
                await client.send(StageMessage.stop(session_id=9))
            nursery.cancel_scope.cancel()
    finally:
        generator.close()


async def test_the_api_reports_speculation_in_usage_and_metrics(tiny_llama: Path, tmp_path: Path) -> None:
    import httpx

    from skippy.api.server import model_id_for, serve_api

    async with stage_chain(str(tiny_llama), SPLITS[2], tmp_path) as stages:
        assert stages[0].address is not None
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve_api, tiny_llama, stages[0].address, port=0,
                                                        n_ctx=512, max_lanes=2))
            body = {"model": model_id_for(tiny_llama), "prompt": CODE, "max_tokens": 48, "temperature": 0}
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                default = (await http.post("/v1/completions", json=body)).json()
                off = (await http.post("/v1/completions", json={**body, "speculation": False})).json()
                bad = await http.post("/v1/completions", json={**body, "speculation": "yes"})
                metrics = (await http.get("/metrics")).text
            nursery.cancel_scope.cancel()
    assert default["choices"][0]["text"] == off["choices"][0]["text"]
    counters = default["usage"]["skippy_speculation"]
    assert 0 < counters["accepted"] <= counters["proposed"] and counters["windows"] > 0
    assert "skippy_speculation" not in off["usage"]
    assert bad.status_code == 422  # invalid parameter (the API answers 422 for a mistyped field)
    accepted = [line for line in metrics.splitlines() if line.startswith("skippy_speculation_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) == counters["accepted"]
