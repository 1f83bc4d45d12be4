"""The prefix KV cache across a chain (issue 6): exactness with the cache on and off, namespaces,
no leaks, bad input.

Real stage processes on the generated tiny llama (2 stages, f32 wire, page size 16) are driven by
the ``Generator`` with greedy sampling; every cached run is compared with the same request opted
out of the cache (no lookup, no record) on the same chain. The leak and corruption checks run
in-process on the null runtime, where the stages' caches can be inspected directly.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import numpy as np
import pytest
import trio
from contextlib import asynccontextmanager

from skippy.codec.protocol import MessageKind, ReplyKind, StageMessage
from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.driver import prefix

from stage_helpers import StageProcess, inprocess_chain, stage_chain

PAGE = 16
SPLIT = ["0:2", "2:4"]
FLAGS = ["--cache-page-size", str(PAGE), "--ctx-size", "1024", "--batch-size", "64"]


@pytest.fixture(scope="module")
def generator(tiny_llama: Path) -> Iterator[Generator]:
    gen = Generator.from_model(tiny_llama, n_ctx=1024, chunk_size=32, credit=2)
    gen.cache_page_size = PAGE
    yield gen
    gen.close()


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(count)]


class Runner:
    """Runs requests on one lane, each once with the cache and once opted out."""

    def __init__(self, generator: Generator, client: StageClient) -> None:
        self.generator = generator
        self.client = client
        self.session = 0

    async def run(self, prompt: list[int], *, cache: bool = True, namespace: str | None = None,
                  steps: int = 6) -> tuple[list[int], int]:
        self.session += 1
        request = GenerationRequest(tuple(prompt), steps, speculation=False, prefix_cache=cache,
                                    cache_namespace=namespace)
        completion = await self.generator.generate(self.client, request, self.session)
        return completion.tokens, completion.cached_tokens

    async def check(self, prompt: list[int], *, namespace: str | None = None) -> int:
        """Cached run == uncached run; returns the cached tokens."""
        cached, hit = await self.run(prompt, namespace=namespace)
        plain, none = await self.run(prompt, cache=False)
        assert none == 0
        assert cached == plain, f"cache changed the output (hit {hit} of {len(prompt)})"
        return hit


@asynccontextmanager
async def chain_runner(tiny_llama: Path, generator: Generator, tmp_path: Path,
                       extra: list[str] = []) -> AsyncIterator[tuple[Runner, list[StageProcess]]]:
    async with stage_chain(str(tiny_llama), SPLIT, tmp_path, [*FLAGS, *extra]) as stages:
        assert stages[0].address is not None
        async with await StageClient.connect(stages[0].address, reply_timeout=60) as client:
            yield Runner(generator, client), stages


@pytest.mark.slow
async def test_outputs_identical_with_the_cache_on_and_off(tiny_llama: Path, generator: Generator,
                                                           tmp_path: Path) -> None:
    rng = random.Random(1)
    async with chain_runner(tiny_llama, generator, tmp_path) as (runner, stages):
        # The same prompt twice: the second restores every full page of prompt[:-1].
        prompt = tokens(rng, 3 * PAGE + 5)
        assert await runner.check(prompt) == 0
        assert await runner.check(prompt) == 3 * PAGE
        # A shared 3-page system prompt with different user turns: a partial hit on every stage.
        system = tokens(rng, 3 * PAGE)
        first = await runner.check(system + tokens(rng, 21))
        assert first == 0
        for _ in range(3):
            assert await runner.check(system + tokens(rng, rng.randrange(5, 40))) == 3 * PAGE
        # A conversation growing turn by turn: each turn restores the previous turns.
        conversation = tokens(rng, 10)
        hits = []
        for _ in range(4):
            conversation += tokens(rng, 20)
            hits.append(await runner.check(conversation))
            conversation += tokens(rng, 6)  # the assistant's reply, part of the next prompt
        assert hits[0] == 0 and all(b > a for a, b in zip(hits[1:], hits[2:])) and hits[-1] > 0
        # the stats files are rewritten every 0.1 s: wait for the last requests to show
        with trio.move_on_after(5):
            while True:
                stats = [stage.stats()["prefix_cache"] for stage in stages]
                if all(s["hits"] >= 6 and s["records"] >= 3 for s in stats):  # type: ignore[index]
                    break
                await trio.sleep(0.05)
        assert all(s["hits"] >= 6 and s["records"] >= 3 for s in stats), stats  # type: ignore[index]


@pytest.mark.slow
async def test_namespaces_are_isolated_on_every_stage(tiny_llama: Path, generator: Generator,
                                                      tmp_path: Path) -> None:
    rng = random.Random(2)
    prompt = tokens(rng, 2 * PAGE + 3)
    async with chain_runner(tiny_llama, generator, tmp_path) as (runner, _):
        assert await runner.check(prompt, namespace="alice") == 0
        assert await runner.check(prompt, namespace="bob") == 0  # same prompt, other key: a miss
        assert await runner.check(prompt, namespace="alice") == 2 * PAGE
        assert await runner.check(prompt) == 0  # the default namespace is another tenant too


@pytest.mark.slow
async def test_random_prompts_under_a_budget_that_evicts_and_spills(tiny_llama: Path, generator: Generator,
                                                                    tmp_path: Path) -> None:
    rng = random.Random(3)
    prefixes = [tokens(rng, rng.choice([PAGE, 2 * PAGE, 3 * PAGE + 4])) for _ in range(5)]
    budget = ["--cache-slots", "2", "--cache-resident-tokens", "80", "--cache-spill-entries", "3"]
    async with chain_runner(tiny_llama, generator, tmp_path, budget) as (runner, stages):
        hits = 0
        for _ in range(50):
            prompt = rng.choice(prefixes) + tokens(rng, rng.randrange(1, 2 * PAGE))
            hits += await runner.check(prompt) > 0
        assert hits > 10
        await trio.sleep(0.3)  # the stats files are rewritten every 0.1 s
        for stage in stages:
            stats: Any = stage.stats()["prefix_cache"]
            assert stats["evictions"] > 0 and stats["spills"] > 0 and stats["spill_restores"] > 0, stats
            assert stats["resident_entries"] <= 2 and stats["resident_tokens"] <= 80 and stats["spill_entries"] <= 3


def control(kind: MessageKind, session: int, values: list[int], *, flagged: bool = True) -> StageMessage:
    message = prefix.control_message(kind, session, values, prefix.metadata(prefix.CacheRequest(page_size=PAGE)))
    if not flagged:
        message = StageMessage.create(kind, session_id=session, tokens=np.asarray(values, dtype=np.int32),
                                      token_count=len(values))
    return message


@pytest.mark.slow
async def test_bad_prefix_requests_miss_and_never_change_the_answer(tiny_llama: Path, generator: Generator,
                                                                   tmp_path: Path) -> None:
    rng = random.Random(4)
    prompt = tokens(rng, 3 * PAGE + 2)
    async with chain_runner(tiny_llama, generator, tmp_path) as (runner, _):
        client = runner.client
        await runner.run(prompt[:PAGE + 1])  # caches one page
        # A plain v11 peer's probe and restore (no PREFIX_EXTENT flag): a clear miss, not forwarded.
        for kind in (MessageKind.PROBE_PREFILL, MessageKind.TRY_RESTORE_PREFILL, MessageKind.RESTORE_PREFILL):
            reply = await client.request(control(kind, 99, prompt[:PAGE], flagged=False), ReplyKind.ACK)
            assert reply.stats.kv_hit_stage_mask == 0 and reply.stats.kv_lookup_misses == 1
        # ... and its fused restore-decode of a cached prefix: a miss ACK too, nothing restored or decoded.
        plain18 = prefix.restore_decode_message(99, prompt[:PAGE + 1], "")
        plain18 = dataclasses.replace(plain18, state=dataclasses.replace(plain18.state, flags=0))
        reply = await client.request(plain18, ReplyKind.ACK)
        assert reply.stats.kv_hit_stage_mask == 0 and reply.stats.kv_lookup_misses == 1
        # A restore of more tokens than are cached: a miss on the first stage, nothing restored.
        await client.configure(98)
        reply = await client.request(control(MessageKind.TRY_RESTORE_PREFILL, 98, prompt[:3 * PAGE]), ReplyKind.ACK)
        assert reply.stats.kv_hit_stage_mask & 1 == 0 and reply.stats.kv_imported_tokens == 0
        # A fused restore-decode whose prefix is not cached: a miss ACK; with token_count != 1 an error.
        reply = await client.request(prefix.restore_decode_message(98, prompt[:2 * PAGE + 1], ""), ReplyKind.ACK)
        assert reply.stats.kv_hit_stage_mask == 0 and reply.stats.kv_lookup_misses == 1
        reply = await client.request(control(MessageKind.TRY_RESTORE_PREFILL_DECODE, 98, prompt[:PAGE + 1]),
                                     ReplyKind.ACK)
        assert reply.stats.kv_hit_stage_mask == 0 and reply.stats.kv_lookup_errors == 1
        # A token sideband that disagrees with token_count: an error miss.
        bad = control(MessageKind.PROBE_PREFILL, 98, prompt[:PAGE])
        reply = await client.request(dataclasses.replace(bad, token_count=PAGE + 3), ReplyKind.ACK)
        assert reply.stats.kv_lookup_errors == 1 and reply.stats.kv_hit_stage_mask == 0
        # The session prefills in full afterwards and answers as without a cache.
        result = await client.prefill(98, prompt, chunk_size=32)
        await client.stop(98)
        plain, _ = await runner.run(prompt, cache=False, steps=1)
        assert [result.token] == plain
        assert await runner.check(prompt) == 3 * PAGE  # session 98's full prefill was recorded


# -- in-process, null runtime ----------------------------------------------------------------

NULL_SPLIT = ["0:2", "2:4"]


@pytest.mark.slow
async def test_no_leak_after_500_requests() -> None:
    rng = random.Random(5)
    prefixes = [[rng.randrange(1, 999) for _ in range(rng.randrange(4, 40))] for _ in range(7)]
    settings = {"cache_page_size": 4, "cache_slots": 3, "cache_resident_tokens": 48, "cache_spill_entries": 4,
                "max_sessions": 4}
    async with inprocess_chain(NULL_SPLIT, **settings) as servers:
        assert servers[0].address is not None
        hits = 0
        async with await StageClient.connect(servers[0].address) as client:
            for index in range(500):
                prompt = rng.choice(prefixes) + [rng.randrange(1, 999) for _ in range(rng.randrange(1, 9))]
                cache = prefix.CacheRequest(page_size=4, namespace=rng.choice([None, "a", "b"]),
                                            enabled=index % 10 != 0)
                result = await prefix.prefill(client, index % 3 + 1, prompt, sampling=None, cache=cache,
                                              chunk_size=8, credit=2)
                assert result.result.token == prompt[-1] + 1
                hits += result.cached_tokens > 0
                await client.stop(index % 3 + 1)
        assert hits > 50
        for server in servers:
            executor = server.executor
            cache = executor.cache
            assert cache is not None and executor.session_count == 0 and cache.holds == 0
            context: Any = executor.context
            assert context.sessions_in_use == len(cache.cache_seqs)  # only the cache's reserved ids
            stats = cache.stats
            assert stats.evictions > 0 and stats.spills > 0
            assert stats.resident_tokens <= 48 and stats.spill_entries <= 4
            assert context.kv_cells_used() == stats.resident_tokens  # no session keeps a cell


async def test_a_corrupted_spilled_state_is_a_miss() -> None:
    settings = {"cache_page_size": 4, "cache_slots": 1}
    first, second = list(range(1, 14)), list(range(101, 114))
    async with inprocess_chain(NULL_SPLIT, **settings) as servers:
        assert servers[0].address is not None
        async with await StageClient.connect(servers[0].address) as client:
            async def serve(prompt: list[int]) -> int:
                result = await prefix.prefill(client, 1, prompt, sampling=None,
                                              cache=prefix.CacheRequest(page_size=4), chunk_size=8, credit=2)
                await client.stop(1)
                assert result.result.token == prompt[-1] + 1
                return result.cached_tokens

            await serve(first)
            await serve(second)  # one resident slot: the first prompt's entry is spilled
            cache = servers[1].executor.cache
            assert cache is not None and cache.stats.spills == 1
            spilled = [entry for entry in cache.entries() if entry.seq is None]
            assert len(spilled) == 1 and spilled[0].blob is not None
            spilled[0].blob = spilled[0].blob[:-4] + b"\0\0\0\0"
            # M = 12 = len(first) - 1: TryRestorePrefillDecode. Stage 0 restores and decodes, stage 1
            # refuses the corrupt state: stage 0 empties the session, the driver prefills in full.
            assert await serve(first) == 0
            assert cache.stats.errors == 1
            assert [server.stats.restore_decodes for server in servers] == [1, 0]
            for server in servers:
                assert server.executor.session_count == 0
            assert await serve(first) == 12  # recorded again by the full prefill; now fused on both
            assert [server.stats.restore_decodes for server in servers] == [2, 1]


async def test_fused_restore_decode_matches_the_uncached_answer(tiny_llama: Path, generator: Generator,
                                                                tmp_path: Path) -> None:
    """A prompt whose all-but-last token is cached takes TryRestorePrefillDecode (18) on every stage."""
    rng = random.Random(6)
    async with chain_runner(tiny_llama, generator, tmp_path) as (runner, stages):
        for pages in (1, 2, 3):
            prompt = tokens(rng, pages * PAGE + 1)
            assert await runner.check(prompt) == 0
            assert await runner.check(prompt) == pages * PAGE  # M = len(prompt) - 1: the fused path
        # a partial hit (M < len(prompt) - 1) still takes TryRestorePrefill + the suffix prefill
        conversation = tokens(rng, PAGE + 1)
        assert await runner.check(conversation) == 0
        assert await runner.check(conversation[:-1] + tokens(rng, PAGE + 1)) == PAGE
        # the reply of the fused message itself: PredictedToken with every stage's bit and M imported
        prompt = tokens(rng, 2 * PAGE + 1)
        await runner.run(prompt)
        result = await prefix.prefill(runner.client, 500, prompt, sampling=None,
                                      cache=prefix.CacheRequest(page_size=PAGE), chunk_size=32, credit=2)
        await runner.client.stop(500)
        reply = result.result.reply
        assert result.cached_tokens == 2 * PAGE and not result.result.acks
        assert reply.kind == ReplyKind.PREDICTED_TOKEN and reply.stats.kv_hit_stage_mask == 0b11
        assert reply.stats.kv_imported_tokens == 2 * 2 * PAGE  # summed over both stages
        plain, _ = await runner.run(prompt, cache=False, steps=1)
        assert [reply.predicted] == plain
        with trio.move_on_after(5):
            while not all(stage.stats()["restore_decodes"] == 4 for stage in stages):
                await trio.sleep(0.05)
        assert [stage.stats()["restore_decodes"] for stage in stages] == [4, 4]  # 3 checks + the direct one
