"""Every API feature on every chain path: the answer is the unsplit model's, byte for byte.

A path is how a request's messages and predictions travel: hop by hop with decode runs or one
DecodeEmbd per token, or with direct return (the default on chains of two stages or more) with
or without the stages' decode relay, on 2-, 3- and 4-stage chains.  A feature is what the request
asks: ``n`` choices (forks of the first choice's session), completions' ``best_of``, seeded
sampling, logprobs, a GBNF grammar, stop strings, streaming, speculation.  Each (path, feature)
answer must equal the one-stage chain's for the same request (same chunking, f32 wire: bitwise
the same logits), so a path that breaks a feature fails here, whatever the feature.  On top,
greedy choices equal the ``n = 1`` answer, and a seeded request's first choice equals the ``n = 1``
request with the same seed (the first choice is not a fork).

The chains run in this process (``inprocess_chain``) on the tiny generated llama; the API app is
driven through httpx's ASGI transport.  Responses are compared without their ids, timestamps and
timing figures.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

from skippy.api.app import ChainService, create_app
from skippy.api.lanes import LanePool
from skippy.driver.client import StageClient
from skippy.driver.generator import GenerationRequest, Generator

from stage_helpers import inprocess_chain

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
SPLITS = {1: ["0:4"], 2: ["0:2", "2:4"], 3: ["0:1", "1:3", "3:4"], 4: ["0:1", "1:2", "2:3", "3:4"]}


@dataclasses.dataclass(frozen=True)
class Path_:
    """One way through the chain."""

    direct_return: bool
    decode_runs: bool
    decode_relay: bool

    def __str__(self) -> str:
        route = "direct" if self.direct_return else "hop"
        return f"{route}-{'runs' if self.decode_runs else 'tokens'}-{'relay' if self.decode_relay else 'norelay'}"


PATHS = [
    Path_(direct_return=True, decode_runs=True, decode_relay=True),  # the default on >= 2 stages
    Path_(direct_return=True, decode_runs=True, decode_relay=False),
    Path_(direct_return=False, decode_runs=True, decode_relay=True),
    Path_(direct_return=False, decode_runs=False, decode_relay=True),
]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10, **fields}


SEEDED = {"temperature": 0.9, "top_k": 40, "seed": 1234}
#: (endpoint, body): the features crossed with every path.
FEATURES: dict[str, tuple[str, dict[str, Any]]] = {
    "greedy n=1": ("completions", completion(temperature=0)),
    "greedy n=3": ("completions", completion(temperature=0, n=3)),
    "seeded n=1": ("completions", completion(**SEEDED)),
    "seeded n=3": ("completions", completion(**SEEDED, n=3)),
    "seeded n=1, seed + 1": ("completions", completion(**{**SEEDED, "seed": SEEDED["seed"] + 1})),
    "seeded n=1, seed + 2": ("completions", completion(**{**SEEDED, "seed": SEEDED["seed"] + 2})),
    "best_of=3": ("completions", completion(**SEEDED, best_of=3)),
    "logprobs n=2": ("completions", completion(**SEEDED, n=2, logprobs=2)),
    "stop n=2": ("completions", completion(temperature=0, n=2, stop=["e"])),
    "grammar n=2": ("completions", completion(**SEEDED, n=2, grammar='root ::= [a-z ]+ "."')),
    "chat n=2": ("chat/completions", chat(**SEEDED, n=2, top_logprobs=1, logprobs=True)),
    "chat stream n=3": ("chat/completions", chat(**SEEDED, n=3, stream=True)),
    "completions stream n=2": ("completions", completion(temperature=0, n=2, stream=True)),
    "speculation": ("completions", completion(temperature=0, speculation=True)),
    # llama-server's names for served fields
    "llama fields": ("completions", {"model": MODEL, "prompt": PROMPT, "n_predict": 12, "cache_prompt": False,
                                     "temperature": 0}),
    "ignore_eos n=2": ("chat/completions", chat(**SEEDED, n=2, ignore_eos=True)),
    "json_schema": ("chat/completions", chat(**SEEDED, max_tokens=30, json_schema={
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})),
    "json_schema as response_format": ("chat/completions", chat(**SEEDED, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "json_schema", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}})),
}

#: Fields that differ between runs or chains by design (speculation counters depend on the stage count).
_VOLATILE = {"id", "created", "skippy_timing", "skippy_speculation", "system_fingerprint"}


def stable(value: Any) -> Any:
    """``value`` without ids, timestamps and timings."""
    if isinstance(value, dict):
        return {key: stable(item) for key, item in value.items() if key not in _VOLATILE}
    if isinstance(value, list):
        return [stable(item) for item in value]
    return value


def answer(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        return [stable(json.loads(line[6:])) for line in response.text.splitlines()
                if line.startswith("data: {")]
    return stable(response.json())


def texts(result: Any) -> list[str]:
    return [choice.get("text", choice.get("message", {}).get("content")) for choice in result["choices"]]


@pytest.fixture(scope="module")
def generator(tiny_llama: Path) -> Iterator[Generator]:
    gen = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=5)  # a fixed chunking: bitwise comparable
    gen.prefix_cache = False  # every request computes its prompt the same way
    yield gen
    gen.close()


async def answers(generator: Generator, tiny_llama: Path, stages: int, path: Path_ | None) -> dict[str, Any]:
    """Each feature's answer on a chain of ``stages`` stages taking ``path`` (None: hop by hop)."""
    async with inprocess_chain(SPLITS[stages], model=str(tiny_llama), ctx_size=512,
                               decode_relay=path is None or path.decode_relay) as servers:
        generator.direct_return = (lambda: servers[-1].address) if path is not None and path.direct_return else None
        generator.decode_runs = path is None or path.decode_runs
        pool = LanePool(servers[0].address, max_lanes=1)
        try:
            app = create_app(ChainService(generator, pool, MODEL))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy") as http:
                results = {name: answer(await http.post(f"/v1/{endpoint}", json=body))
                           for name, (endpoint, body) in FEATURES.items()}
        finally:
            await pool.aclose()
            generator.direct_return, generator.decode_runs = None, True
        first, final = servers[0].stats, servers[-1].stats
        if path is not None and path.direct_return:
            assert final.direct_replies > 0
            if path.decode_relay:  # the relay carried decodes, the forks' included
                assert first.decode_relay_steps > 0
        if path is not None and not path.direct_return and path.decode_runs:
            assert first.decode_runs > 0
        assert first.forked_sessions > 0 and final.forked_sessions == first.forked_sessions
        assert all(server.stats.sessions_in_use == 0 for server in servers)
    return results


#: The one-stage chain's answers, computed once per test session (trio fixtures are per test).
_UNSPLIT: dict[str, Any] = {}


async def unsplit(generator: Generator, tiny_llama: Path) -> dict[str, Any]:
    if not _UNSPLIT:
        _UNSPLIT.update(await answers(generator, tiny_llama, 1, None))
        check_choices(_UNSPLIT)
    return _UNSPLIT


def check_choices(results: dict[str, Any]) -> None:
    """Greedy choices equal the n=1 answer; seeded choice ``i`` is the n=1 answer with seed ``seed + i``.

    (The forks compute their last prompt token as a one-row batch where the n=1 request computes
    it inside its last prefill chunk; on this model and build the logits agree bitwise, so the
    samples do.  tests/test_api_choices.py notes that on other weights the last bits may not.)"""
    single = texts(results["greedy n=1"])[0]
    assert texts(results["greedy n=3"]) == [single] * 3
    assert texts(results["stop n=2"])[0] == texts(results["stop n=2"])[1]
    seeded = texts(results["seeded n=3"])
    assert seeded == [texts(results[name])[0] for name in ("seeded n=1", "seeded n=1, seed + 1", "seeded n=1, seed + 2")]
    assert len(set(seeded)) > 1, seeded
    assert [choice["index"] for choice in results["seeded n=3"]["choices"]] == [0, 1, 2]
    assert results["seeded n=3"]["usage"]["completion_tokens"] == 3 * 12
    assert texts(results["llama fields"]) == texts(results["greedy n=1"])
    assert results["ignore_eos n=2"]["usage"]["completion_tokens"] == 2 * 10
    assert texts(results["json_schema"]) == texts(results["json_schema as response_format"])


@pytest.mark.parametrize("stages", [2, *(pytest.param(count, marks=pytest.mark.slow) for count in (3, 4))])
@pytest.mark.parametrize("path", [PATHS[0], *(pytest.param(path, marks=pytest.mark.slow) for path in PATHS[1:])],
                         ids=str)
async def test_every_feature_on_every_path_is_the_unsplit_answer(generator: Generator, tiny_llama: Path,
                                                                 stages: int, path: Path_) -> None:
    reference = await unsplit(generator, tiny_llama)
    results = await answers(generator, tiny_llama, stages, path)
    for name in FEATURES:
        assert results[name] == reference[name], name


async def test_a_fork_takes_its_own_return_lane_and_a_fork_not_every_stage_made_is_undone(
        generator: Generator, tiny_llama: Path) -> None:
    """The driver's side, on the default path (direct return): a fork opens its own return lane
    while its parent's stays open, and a fork whose ACK does not show every stage forking (here:
    the driver expects a stage too many) is trimmed away on every stage and prefilled in full,
    with the same tokens."""
    prompt = tuple(generator.encode(PROMPT))
    request = GenerationRequest(prompt, 10, speculation=False)
    async with inprocess_chain(SPLITS[2], model=str(tiny_llama), ctx_size=512) as servers:
        generator.direct_return = lambda: servers[-1].address
        try:
            async with await StageClient.connect(servers[0].address) as client:
                single = await generator.generate(client, request, 1)
                parent = generator.start(client, request, 2)
                await parent.__anext__()
                assert client.direct_sessions == {2}
                undone = await generator.start(client, request, 3, fork=(2, 3)).run()
                forked = await generator.start(client, request, 4, fork=(2, 2)).run()
                rest = await parent.run()
                assert not client.direct_sessions
        finally:
            generator.direct_return = None
        first, final = servers[0].stats, servers[-1].stats
        assert final.return_lanes == 4  # every session returned directly, the forks included
        assert first.forked_sessions == 2 and final.forked_sessions == 2
        assert all(server.stats.sessions_in_use == 0 for server in servers)
    assert undone.tokens == forked.tokens == rest.tokens == single.tokens
    assert (undone.cached_tokens, forked.cached_tokens) == (0, len(prompt) - 1)


async def _timing(generator: Generator, tiny_llama: Path, stages: int, *, direct: bool, relay: bool
                  ) -> dict[str, Any]:
    """``usage.skippy_timing`` of one seeded completion on a chain of ``stages`` stages."""
    async with inprocess_chain(SPLITS[stages], model=str(tiny_llama), ctx_size=512, decode_relay=relay) as servers:
        generator.direct_return = (lambda: servers[-1].address) if direct else None
        pool = LanePool(servers[0].address, max_lanes=1)
        try:
            app = create_app(ChainService(generator, pool, MODEL))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy") as http:
                response = await http.post("/v1/completions", json=completion(**SEEDED))  # (greedy speculates)
        finally:
            await pool.aclose()
            generator.direct_return = None
        assert response.status_code == 200, response.text
        if direct:
            assert servers[-1].stats.direct_replies > 0
            assert (servers[0].stats.decode_relay_steps > 0) == relay  # the relay's tokens are counted too
        timing: dict[str, Any] = response.json()["usage"]["skippy_timing"]
        return timing


@pytest.mark.parametrize("stages, relay", [(2, True), (2, False), pytest.param(3, True, marks=pytest.mark.slow)])
async def test_usage_lists_every_stage_with_direct_return(generator: Generator, tiny_llama: Path, stages: int,
                                                          relay: bool) -> None:
    """docs/protocol.md §8: with direct return no stage but the final one answers a prediction, so
    the upstream stages' records come as their session totals with the Stop's ACK; the response
    lists every stage's compute, wire and queue time, as hop by hop does."""
    hop = await _timing(generator, tiny_llama, stages, direct=False, relay=relay)
    direct = await _timing(generator, tiny_llama, stages, direct=True, relay=relay)
    ranges = [{"stage": index, "layers": layers} for index, layers in enumerate(SPLITS[stages])]
    for timing in (hop, direct):
        assert timing["stage_count"] == stages, timing
        assert [{"stage": s["stage"], "layers": s["layers"]} for s in timing["stages"]] == ranges
        assert all(stage["compute_ms"] > 0 for stage in timing["stages"]), timing
        # every boundary's write is counted on the stage above it
        assert all(stage["forward_write_ms"] > 0 for stage in timing["stages"][:-1]), timing
        assert set(timing["stages"][0]) >= {"queue_wait_ms", "downstream_wait_ms", "max_batch_size"}
    # the upstream stages' compute covers the whole request (prefill included), as hop by hop
    assert direct["stage_compute_ms"] > direct["stages"][-1]["compute_ms"]
