"""A prefix-cache hit gives the uncached run's tokens, on one stage, per family at risk.

The sparse-attention families whose lightning indexer sums ReLU scores (deepseek32 and the
families built on its indexer) keep keys tied at score 0 by their KV cell order (llama.cpp's
top-k is an unstable partial sort over the cells), so the same prompt at other cells selects
other positions: a restored prefix keeps the cached entry's cells and an uncached run gets fresh
ones (Qwen4-exp's block-pooled indexer sums ReLU scores too).  Their stages therefore run without the prefix cache (``skippy.cache.prefix_cache_refusal``,
logged); the families with other selections (Kimi-K3, GLM-5 Next) keep it, and a hit there equals
the uncached answer.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from chain_helpers import InProcessChain
from skippy.cache import prefix_cache_refusal
from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.models import ensure_model, tiny
from stage_helpers import inprocess_chain

PAGE = 8
FIRST = (1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243, 310, 278, 7934, 29889, 450)
#: the families whose cache is off, and the ones that keep it
OFF = ["deepseek32", "glm-dsa", "dots3note", "hy_v4", "deepseek4", "qwen4exp"]
ON = ["kimi-k3", "glm5-next"]


#: per follow-up prompt: the tokens with the cache asked for, the cached length, the tokens without
Runs = list[tuple[list[int], int, list[int]]]


async def _cached_and_plain(arch: str, caplog: pytest.LogCaptureFixture) -> tuple[Runs, bool]:
    path = ensure_model(tiny(arch))  # type: ignore[arg-type]
    generator = Generator.from_model(path, n_ctx=512, chunk_size=8, credit=2)
    generator.cache_page_size = PAGE
    runs: Runs = []
    try:
        with caplog.at_level(logging.WARNING, logger="skippy.stage"):
            async with inprocess_chain(["0:4"], model=str(path), ctx_size=512, cache_page_size=PAGE,
                                       threads=1) as servers:
                async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
                    session = iter(range(1, 100))

                    async def run(prompt: tuple[int, ...], cache: bool) -> tuple[list[int], int]:
                        request = GenerationRequest(prompt, 6, speculation=False, prefix_cache=cache)
                        done = await generator.generate(client, request, next(session))
                        return list(done.tokens), done.cached_tokens

                    await run(FIRST, True)
                    for prompt in ((*FIRST[:2 * PAGE], 13, 450, 4996), FIRST[:2 * PAGE + 1]):
                        cached, hit = await run(prompt, True)
                        plain, _ = await run(prompt, False)
                        runs.append((cached, hit, plain))
                cache = servers[0].executor.cache
                assert cache is None or cache.stats.errors == 0
                has_cache = cache is not None
    finally:
        generator.close()
    return runs, has_cache


@pytest.mark.parametrize("arch", ON)
async def test_a_hit_equals_the_uncached_answer(arch: str, caplog: pytest.LogCaptureFixture) -> None:
    assert prefix_cache_refusal(arch) is None
    runs, has_cache = await _cached_and_plain(arch, caplog)
    assert has_cache
    for cached, hit, plain in runs:
        assert hit == 2 * PAGE and cached == plain


def test_every_family_at_risk_is_refused_the_cache() -> None:
    """The refusal table (the runs below check its effect end to end, one family in the fast suite)."""
    assert [arch for arch in OFF if prefix_cache_refusal(arch) is None] == []
    assert [arch for arch in ON if prefix_cache_refusal(arch) is not None] == []


@pytest.mark.parametrize("arch", [pytest.param(arch, marks=() if arch == OFF[0] else (pytest.mark.slow,))
                                  for arch in OFF])
async def test_a_sparse_selection_stage_runs_without_the_cache(arch: str, caplog: pytest.LogCaptureFixture) -> None:
    runs, has_cache = await _cached_and_plain(arch, caplog)
    assert not has_cache
    assert any(f"prefix cache off: {arch}: its lightning indexer" in r.getMessage() for r in caplog.records)
    for cached, hit, plain in runs:
        assert hit == 0 and cached == plain


def test_deepseek32_selection_depends_on_where_the_cells_lie() -> None:
    """Why the cache is off: the same 19 tokens at cells 0.. and at cells 5.. (another session's
    five cells before them) give other logits, far beyond float reordering."""
    path = ensure_model(tiny("deepseek32"))
    prompt = [*FIRST[:16], 13, 450, 4996]

    def logits(chain: InProcessChain, seq: int) -> list[np.ndarray]:
        return chain.decode(prompt, list(range(len(prompt))), [seq] * len(prompt), [True] * len(prompt))

    with InProcessChain(path, [(0, 4)], threads=1) as chain:
        first = logits(chain, 0)
        chain.contexts[0].remove(0)
        chain.decode(prompt[:5], list(range(5)), [1] * 5, [False] * 5)
        moved = logits(chain, 2)
    assert max(float(np.abs(a - b).max()) for a, b in zip(first, moved)) > 0.1


def test_deepseek4_copy_rolled_back_through_a_checkpoint_equals_a_fresh_run() -> None:
    """Patch 0015: seq_cp copies DeepSeek V4's compressed caches and compressor states at once,
    so the rollback of the copy (a checkpoint at 8, then 4 rows decoded again) is not undone by
    a late stream copy of the source's state at the next decode."""
    path = ensure_model(tiny("deepseek4"))
    tokens = [*FIRST, 13, 450, 4996]

    def prefill(chain: InProcessChain, seq: int, end: int) -> None:
        for begin in range(0, end, 8):
            stop = min(end, begin + 8)
            chain.decode(tokens[begin:stop], list(range(begin, stop)), [seq] * (stop - begin), [True] * (stop - begin))

    with InProcessChain(path, [(0, 4)], threads=1) as chain:
        context = chain.contexts[0]
        prefill(chain, 0, 17)
        context.copy(0, 1, 0, 12)
        assert context.length(1) == 12 and context.rollback_stats.replayed_rows == 4
        copied = chain.decode(tokens[12:15], [12, 13, 14], [1] * 3, [True] * 3)
        context.remove(0)
        context.remove(1)
        prefill(chain, 2, 12)
        fresh = chain.decode(tokens[12:15], [12, 13, 14], [2] * 3, [True] * 3)
    assert all(np.array_equal(a, b) for a, b in zip(copied, fresh, strict=True))


def test_qwen4exp_copied_prefix_hashes_its_ngrams_as_a_fresh_run() -> None:
    """Qwen4-exp's n-gram embeddings (PLE) hash each token with the predecessors its KV cells
    recorded: a session copied from a longer one's prefix (what a prefix-cache hit restores: the
    copied cells, the recurrent state rolled back through a checkpoint) gives a fresh run's logits
    bitwise.  The model has delta-net layers only (full attention every 5th of 4 layers): the
    indexer of its attention layers, whose selection depends on the cells' order (why the cache
    is off for the family), plays no part, and the cells are the PLE input's alone."""
    path = ensure_model(dataclasses.replace(tiny("qwen4exp"), full_attention_interval=5))
    tokens = [*FIRST, 13, 450, 4996]

    def prefill(chain: InProcessChain, seq: int, end: int) -> None:
        for begin in range(0, end, 8):
            stop = min(end, begin + 8)
            chain.decode(tokens[begin:stop], list(range(begin, stop)), [seq] * (stop - begin), [True] * (stop - begin))

    with InProcessChain(path, [(0, 4)], threads=1) as chain:
        context = chain.contexts[0]
        prefill(chain, 0, 20)
        context.copy(0, 1, 0, 12)
        assert context.length(1) == 12 and context.rollback_stats.replayed_rows > 0
        copied = chain.decode(tokens[12:16], [12, 13, 14, 15], [1] * 4, [True] * 4)
        context.remove(0)
        context.remove(1)
        prefill(chain, 2, 12)
        fresh = chain.decode(tokens[12:16], [12, 13, 14, 15], [2] * 4, [True] * 4)
    assert all(np.array_equal(a, b) for a, b in zip(copied, fresh, strict=True))
