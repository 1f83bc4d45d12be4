"""Every path that trims, on a hybrid chain (issue 25, deliver 2): stage servers in this trio run.

The tiny hybrids (Qwen3.5- and Nemotron-H-shaped) unsplit and as 3 stages (cut inside a run of Mamba layers and between a Mamba
and an attention layer), 1 thread:

* greedy speculation gives the tokens of speculation off, with drafts accepted and rejected (the
  tiny model's continuation does not loop, so an oracle proposer drafts the reference
  continuation with a wrong token in every third window: rejected drafts, stale windows, trims
  by the authoritative position);
* a decode run ended early leaves every stage's session at the driver's position (the stage
  statistics' KV cells and the session's held positions) and the session goes on exactly;
* ``n = 4`` forks of a prompt give the tokens of four ``n = 1`` requests, forked at the parent's
  last prefill chunk (a restore on every stage), or refused one position short of it (the fork
  would keep only the first row of a 2-row chunk: :mod:`skippy.runtime.rollback`);
* a prefix-cache hit reports ``cached_tokens > 0`` and gives the uncached answer.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import trio

from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.driver.speculation import decoder as decoder_module
from skippy.driver.speculation.proposer import NO_DRAFT, Draft, NgramProposer
from skippy.models import ensure_model, tiny
from skippy.runtime import SamplingParams

from stage_helpers import inprocess_chain, reference_greedy
from test_recurrent_rollback import HYBRIDS

SPLITS = {1: ["0:4"], 3: ["0:1", "1:3", "3:4"]}
PROMPT = (1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243, 310, 278, 7934, 29889, 450, 4996)
PAGE = 8
CHUNK = 8


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest) -> Path:
    return ensure_model(tiny(request.param))


@pytest.fixture(scope="module")
def generator(hybrid: Path) -> Iterator[Generator]:
    gen = Generator.from_model(hybrid, n_ctx=512, chunk_size=CHUNK, credit=2)
    gen.cache_page_size = PAGE
    yield gen
    gen.close()


def chain(hybrid: Path, stages: int, **settings: object):  # type: ignore[no-untyped-def]
    return inprocess_chain(SPLITS[stages], model=str(hybrid), ctx_size=512, cache_page_size=PAGE, threads=1,
                           **settings)


class OracleProposer(NgramProposer):
    """Drafts the reference continuation (``script``), every third draft with its second token wrong."""

    script: Sequence[int] = ()
    calls = itertools.count()

    def propose(self, max_tokens: int, *, tail: Sequence[int] = ()) -> Draft:
        at = len(self) + len(tail)
        tokens = list(self.script[at:at + max_tokens])
        if not tokens:
            return NO_DRAFT
        if next(self.calls) % 3 == 2 and len(tokens) > 1:
            tokens[1] = (tokens[1] + 1) % 32000
        return Draft(tuple(tokens), 8, at)


def positions_held(servers: Sequence[object]) -> list[int]:
    """Positions the one open session holds on each stage (session keys are per lane)."""
    out = []
    for server in servers:
        executor = server.executor  # type: ignore[attr-defined]
        (session,) = executor._sessions.values()
        out.append(executor.context.length(session.seq))
    return out


@pytest.mark.parametrize("stages", [1, pytest.param(3, marks=pytest.mark.slow)])
async def test_greedy_speculation_equals_speculation_off(hybrid: Path, generator: Generator, stages: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    steps = 40
    async with chain(hybrid, stages) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            generator.decode_runs = False
            plain = await generator.generate(client, GenerationRequest(PROMPT, steps, speculation=False), 1)
            OracleProposer.script = (*PROMPT, *plain.tokens)
            monkeypatch.setattr(decoder_module, "NgramProposer", OracleProposer)
            spec = await generator.generate(client, GenerationRequest(PROMPT, steps, speculation=True), 2)
            generator.decode_runs = True
        assert spec.tokens == plain.tokens
        usage = spec.speculation
        assert usage is not None and usage.accepted > 0 and usage.rollbacks > 0, usage
        for server in servers:
            stats = server.executor.context.rollback_stats
            assert stats.rollbacks > 0 and stats.refused == 0, stats


@pytest.mark.parametrize("stages", [1, pytest.param(3, marks=pytest.mark.slow)])
async def test_a_decode_run_ended_early_leaves_every_stage_at_the_driver(hybrid: Path, stages: int) -> None:
    prompt = list(PROMPT[:8])
    reference = reference_greedy(hybrid, prompt, 20, chunk_size=4)
    async with chain(hybrid, stages, prefix_cache=False) as servers:  # no cache entry holds cells
        async with await StageClient.connect(servers[0].address) as client:
            await client.configure(1, prompt_token_count=len(prompt))
            tokens = [(await client.prefill(1, prompt, chunk_size=4)).token]
            tokens.append((await client.start_run(1, tokens[-1], len(prompt), max_tokens=100)).predicted)
            for _ in range(5):
                tokens.append((await client.next_run_token(1)).predicted)
            with trio.fail_after(10):  # the stages run ahead of the driver meanwhile: wait until each has
                while True:
                    for server in servers:
                        await server.refresh_runtime_stats()
                    if all(server.stats.kv_cells_used > len(prompt) + len(tokens) - 1 for server in servers):
                        break
                    await trio.sleep(0.01)
            position = await client.end_run(1)
            assert position == len(prompt) + len(tokens) - 1
            for server in servers:
                await server.refresh_runtime_stats()
                assert server.stats.kv_cells_used == position
            assert positions_held(servers) == [position] * stages
            # the steps the stages ran past the driver were rolled back, not merely dropped
            assert all(server.stats.recurrent_rollback["rollbacks"] == 1 for server in servers)
            assert all(server.stats.recurrent_rollback["refused"] == 0 for server in servers)
            while len(tokens) < 12:
                tokens.append((await client.decode(1, tokens[-1], len(prompt) + len(tokens) - 1)).predicted)
            tokens.append((await client.start_run(1, tokens[-1], len(prompt) + len(tokens) - 1,
                                                  max_tokens=20 - len(tokens))).predicted)
            while client.running:
                tokens.append((await client.next_run_token(1)).predicted)
            assert tokens == reference
            await client.stop(1)


@pytest.mark.parametrize("stages", [1, pytest.param(3, marks=pytest.mark.slow)])
async def test_four_forks_equal_four_single_requests(hybrid: Path, generator: Generator, stages: int) -> None:
    greedy = GenerationRequest(PROMPT, 12, speculation=False)
    sampled = GenerationRequest(PROMPT, 12, speculation=False,
                                sampling=SamplingParams(temperature=1.0, top_k=40, seed=1234))
    async with chain(hybrid, stages) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            for request in (greedy, sampled):
                singles = [(await generator.generate(client, request, 10 + i)).tokens for i in range(4)]
                parent = generator.start(client, request, 1)
                await parent.__anext__()  # the prompt is prefilled once, its first token computed
                forks = []
                for index in range(3):
                    # as the API forks (at the parent's last prefill chunk), and (the first) one
                    # position short of the prompt, which would keep only the first row of the
                    # parent's 2-row last chunk: refused on every stage, the prompt computed in full
                    at = None if index == 0 else parent.fork_point
                    fork = generator.start(client, request, 2 + index, fork=(1, stages), fork_at=at)
                    forks.append((await fork.run()).tokens)
                    assert fork.cached_tokens == (0 if at is None else 16)  # the fork held on every stage
                forks.append((await parent.run()).tokens)
                assert forks == singles
        for server in servers:
            assert server.executor.context.rollback_stats.refused == 0


@pytest.mark.parametrize("stages", [1, pytest.param(3, marks=pytest.mark.slow)])
async def test_a_prefix_cache_hit_equals_the_uncached_answer(hybrid: Path, generator: Generator, stages: int) -> None:
    first = (*PROMPT, 29889)  # 19 tokens: two pages recorded
    follow_up = (*first, 13, 450, 4996)
    async with chain(hybrid, stages) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            await generator.generate(client, GenerationRequest(first, 4, speculation=False, prefix_cache=True), 1)
            cached = await generator.generate(client, GenerationRequest(follow_up, 8, speculation=False,
                                                                        prefix_cache=True), 2)
            plain = await generator.generate(client, GenerationRequest(follow_up, 8, speculation=False,
                                                                       prefix_cache=False), 3)
            # a prompt sharing only the first page: a recurrent state cannot be cut at a page inside
            # the entry, so this is a miss (the probe says so), with the uncached answer
            other = (*first[:PAGE], 13, 450, 4996, 29889, 13)
            shorter = await generator.generate(client, GenerationRequest(other, 8, speculation=False,
                                                                         prefix_cache=True), 4)
            other_plain = await generator.generate(client, GenerationRequest(other, 8, speculation=False,
                                                                             prefix_cache=False), 5)
        assert cached.cached_tokens == 2 * PAGE
        assert plain.cached_tokens == 0 and cached.tokens == plain.tokens
        assert shorter.cached_tokens == 0 and shorter.tokens == other_plain.tokens
        for server in servers:
            cache = server.executor.cache
            assert cache.stats.errors == 0 and cache.holds == 0
