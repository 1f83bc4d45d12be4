"""Sparse attention splits: the selection is in effect, and a cut never separates a layer from
the selection it reuses.

`test_arch_exactness.py` proves the splits of the sparse-attention families bitwise equal to
unsplit. The controls here show that the tiny models do attend sparsely there: with the
indexer's top-k (8) raised past the cache the logits of the rows that see no more than 8
positions stay the same and later rows change, so the 20-token prompt makes the indexer drop
positions (dots3note's one sparse layer included). MiniMax sparse attention (minimax-m3) runs
only with flash attention and one sequence per cache stream (else llama.cpp falls back to dense
attention, which is what the exactness suite's chains check); here its chains run that way, its
top-2 blocks of 4 positions drop positions past the 8th, and its splits are bitwise equal to
unsplit as well. GLM-5.2's layout (glm-dsa with a 1M training context) has "shared" indexer layers
that attend to the previous full layer's selection: a range starting at one is refused naming the
legal cuts (skippy.runtime.cuts groups them), and cuts before full layers stay exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from chain_helpers import InProcessChain, greedy_run
from test_arch_exactness import LONG_PROMPT, STEPS, THREADS

from skippy.models import ensure_model, tiny
from skippy.models.blocks_moe import GLM_5_2_CONTEXT, glm_dsa_indexer_is_full
from skippy.runtime import LayerRangeError, Model
from skippy.runtime.cuts import KvGroup, kv_groups, legal_cuts
from skippy.runtime.local import LocalChain, Split
from skippy.runtime.offload import OffloadSettings

#: The sparse-attention families (the fast suite checks deepseek32's selection).
SPARSE = ["deepseek32", "glm-dsa", "dots3note", "minimax-m3"]
#: Families whose sparse path needs flash attention and one sequence per stream.
FLASH_ONLY = {"minimax-m3"}
SPLITS = [[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]


class FlashChain(InProcessChain):
    """A chain whose contexts run flash attention on the CPU with one sequence each."""

    def __init__(self, path: Path, splits: Split) -> None:
        LocalChain.__init__(
            self, path, splits, n_ctx=512, max_sessions=1, n_batch=64, threads=THREADS,
            offload=OffloadSettings(devices=("none",), flash_attn="on"),
        )


def chain_of(arch: str, path: Path, splits: Split) -> InProcessChain:
    if arch in FLASH_ONLY:
        return FlashChain(path, splits)
    return InProcessChain(path, splits, threads=THREADS)


@pytest.mark.parametrize(
    "arch",
    [pytest.param(a, marks=() if a == "deepseek32" else (pytest.mark.slow,)) for a in SPARSE],
)
def test_sparse_selection_is_in_effect(arch: str) -> None:
    spec = tiny(arch)  # type: ignore[arg-type]
    dense = dataclasses.replace(spec, indexer_top_k=4096)  # more than the cache: keeps every key
    n = len(LONG_PROMPT)
    rows = {}
    for label, s in (("sparse", spec), ("dense", dense)):
        with chain_of(arch, ensure_model(s), [(0, s.n_layer)]) as whole:
            rows[label] = whole.decode(LONG_PROMPT, list(range(n)), [0] * n, [True] * n)
    keep = spec.indexer_top_k * (spec.indexer_block_size or 1)  # MSA counts blocks
    assert keep < n
    for row in range(keep):
        np.testing.assert_allclose(rows["sparse"][row], rows["dense"][row], rtol=0, atol=1e-4)
    late = max(float(np.abs(rows["sparse"][r] - rows["dense"][r]).max()) for r in range(keep, n))
    assert late > 1e-3, "the indexer's top-k drops nothing"


@pytest.mark.slow
def test_glm_5_2_cuts_before_full_indexer_layers_only() -> None:
    spec = dataclasses.replace(tiny("glm-dsa"), context_length=GLM_5_2_CONTEXT)
    full = [glm_dsa_indexer_is_full(spec, layer) for layer in range(spec.n_layer)]
    assert full == [True, True, True, False]  # layer 3 reuses layer 2's selection
    path = ensure_model(spec)
    with InProcessChain(path, [(0, spec.n_layer)], threads=THREADS) as whole:
        expected, expected_tokens = greedy_run(whole, LONG_PROMPT, steps=STEPS)
    # the shared layer changes the model: the GLM-5 layout (own indexer everywhere) differs
    glm_5 = ensure_model(tiny("glm-dsa"))
    with InProcessChain(glm_5, [(0, spec.n_layer)], threads=THREADS) as other:
        own, _ = greedy_run(other, LONG_PROMPT, steps=0)
    assert max(float(np.abs(a - b).max()) for a, b in zip(own, expected)) > 1e-3
    for split in ([(0, 3), (3, 4)], [(0, 1), (1, 3), (3, 4)]):
        reason = r"a cut at layer 3 separates layers that share indexer top-k .* the nearest legal cuts? (are|is) 2"
        with pytest.raises(LayerRangeError, match=reason):
            InProcessChain(path, split, threads=THREADS)
    for split in ([(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)]):
        with InProcessChain(path, split, threads=THREADS) as stages:
            logits, tokens = greedy_run(stages, LONG_PROMPT, steps=STEPS)
        assert tokens == expected_tokens
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}"


def test_glm_5_2_shared_indexer_layers_group_with_their_full_layer() -> None:
    """glm-dsa without ``attention.indexer.types``: llama.cpp takes GLM-5.2's types (layers 0, 1
    full, then one in 4) at a training context of 1M or more, else every indexer full; the file's
    own types win either way."""
    meta: dict[str, object] = {"glm-dsa.attention.indexer.top_k": 8, "glm-dsa.context_length": GLM_5_2_CONTEXT}
    assert kv_groups("glm-dsa", 4, meta) == (KvGroup(2, 4, 3, "the indexer top-k"),)
    assert kv_groups("glm-dsa", 10, meta) == (KvGroup(2, 6, 3, "the indexer top-k"),
                                              KvGroup(6, 10, 7, "the indexer top-k"))
    assert legal_cuts(10, kv_groups("glm-dsa", 10, meta)) == [1, 2, 6]
    assert kv_groups("glm-dsa", 4, {**meta, "glm-dsa.context_length": GLM_5_2_CONTEXT - 1}) == ()
    assert kv_groups("glm-dsa", 4, {**meta, "glm-dsa.attention.indexer.types": (1, 1, 1, 1)}) == ()
    assert kv_groups("glm-dsa", 4, {**meta, "glm-dsa.attention.indexer.top_k": 0}) == ()


@pytest.mark.parametrize("layers", ["3:4", "0:3", "1:3"])
def test_glm_5_2_refuses_a_cut_before_a_shared_layer_naming_the_legal_ones(layers: str) -> None:
    path = ensure_model(dataclasses.replace(tiny("glm-dsa"), context_length=GLM_5_2_CONTEXT))
    with pytest.raises(LayerRangeError, match=r"cut at layer 3 .*share indexer top-k .*nearest legal cuts? (are|is) 2"):
        Model(path, layers)
    with Model(path, "2:4") as tail:  # the legal cut loads
        assert tail.layers.start == 2


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=() if d == "F32" else (pytest.mark.slow,))
                                   for d in ("F32", "F16", "Q8_0")])
def test_msa_splits_are_bitwise_equal_with_flash_attention(dtype: str) -> None:
    spec = tiny("minimax-m3", dtype=dtype)  # type: ignore[arg-type]
    path = ensure_model(spec)
    with FlashChain(path, [(0, spec.n_layer)]) as whole:
        expected, expected_tokens = greedy_run(whole, LONG_PROMPT, steps=STEPS)
    assert float(np.std(expected[-1])) > 0.02
    for split in SPLITS:
        with FlashChain(path, split) as stages:
            logits, tokens = greedy_run(stages, LONG_PROMPT, steps=STEPS)
        assert tokens == expected_tokens
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: {np.abs(got - want).max()}"
