"""Sparse attention splits: the selection is in effect, and a cut never separates a layer from
the selection it reuses.

`test_arch_exactness.py` proves the splits of the sparse-attention families bitwise equal to
unsplit. The controls here show that the tiny models do attend sparsely there: with the
indexer's top-k (8) raised past the cache the logits of the rows that see no more than 8
positions stay the same and later rows change, so the 20-token prompt makes the indexer drop
positions. GLM-5.2's layout (glm-dsa with a 1M training context) has "shared" indexer layers
that attend to the previous full layer's selection: a range starting at one is refused by the
loader with the reason, and cuts before full layers stay exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from chain_helpers import InProcessChain, greedy_run
from test_arch_exactness import LONG_PROMPT, STEPS, THREADS

from skippy.models import ensure_model, tiny
from skippy.models.blocks_moe import GLM_5_2_CONTEXT, glm_dsa_indexer_is_full
from skippy.runtime import ModelLoadError

#: The sparse-attention families (the fast suite checks deepseek32's selection).
SPARSE = ["deepseek32", "glm-dsa", "dots3note"]


@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=() if a == "deepseek32" else (pytest.mark.slow,)) for a in SPARSE]
)
def test_sparse_selection_is_in_effect(arch: str) -> None:
    spec = tiny(arch)  # type: ignore[arg-type]
    dense = dataclasses.replace(spec, indexer_top_k=4096)  # more than the cache: keeps every key
    n = len(LONG_PROMPT)
    rows = {}
    for label, s in (("sparse", spec), ("dense", dense)):
        with InProcessChain(ensure_model(s), [(0, s.n_layer)], threads=THREADS) as whole:
            rows[label] = whole.decode(LONG_PROMPT, list(range(n)), [0] * n, [True] * n)
    keep = spec.indexer_top_k
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
    with InProcessChain(ensure_model(tiny("glm-dsa")), [(0, spec.n_layer)], threads=THREADS) as other:
        own, _ = greedy_run(other, LONG_PROMPT, steps=0)
    assert max(float(np.abs(a - b).max()) for a, b in zip(own, expected)) > 1e-3
    for split in ([(0, 3), (3, 4)], [(0, 1), (1, 3), (3, 4)]):
        with pytest.raises(ModelLoadError, match="starting at layer 3: it reuses the sparse-attention"):
            InProcessChain(path, split, threads=THREADS)
    for split in ([(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)]):
        with InProcessChain(path, split, threads=THREADS) as stages:
            logits, tokens = greedy_run(stages, LONG_PROMPT, steps=STEPS)
        assert tokens == expected_tokens
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}"
