"""A split model gives bitwise the same logits as the unsplit model (f32 activations).

Every arch x weight dtype x head tying, at three splits of a 4-layer model: a 12-token prefill
(all rows' logits) and 16 greedy decode steps, same micro-batch partition on every stage.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from chain_helpers import InProcessChain, greedy_run
from conftest import PROMPT, model_path

SPLITS = [
    [(0, 1), (1, 4)],
    [(0, 2), (2, 4)],
    [(0, 1), (1, 3), (3, 4)],
]
ARCHS = ["llama", "qwen2", "qwen3"]
DTYPES = ["F32", "F16", "Q8_0"]


@functools.lru_cache(maxsize=None)
def unsplit(arch: str, dtype: str, tied: bool) -> tuple[tuple[np.ndarray, ...], tuple[int, ...]]:
    with InProcessChain(model_path(arch, dtype, tied), [(0, 4)]) as chain:
        logits, tokens = greedy_run(chain, PROMPT, steps=16)
    return tuple(logits), tuple(tokens)


#: The fast suite's share of the matrix (``-m "not slow"``: every arch, dtype, tying and split
#: once); the other cases are marked slow and run in ``make test``.
FAST_CASES = {("llama", "F32", False, 2), ("qwen2", "F16", True, 0), ("qwen3", "Q8_0", False, 1)}
CASES = [
    pytest.param(arch, dtype, tied, split,
                 id=f"{'+'.join(f'{a}:{b}' for a, b in split)}-{arch}-{dtype}-{'tied' if tied else 'untied'}",
                 marks=() if (arch, dtype, tied, index) in FAST_CASES else pytest.mark.slow)
    for index, split in enumerate(SPLITS) for arch in ARCHS for dtype in DTYPES for tied in (False, True)
]


@pytest.mark.parametrize("arch, dtype, tied, split", CASES)
def test_split_logits_are_bitwise_equal(arch: str, dtype: str, tied: bool, split: list[tuple[int, int]]) -> None:
    expected_logits, expected_tokens = unsplit(arch, dtype, tied)
    with InProcessChain(model_path(arch, dtype, tied), split) as chain:
        logits, tokens = greedy_run(chain, PROMPT, steps=16)
    assert tokens == list(expected_tokens)
    assert len(logits) == len(expected_logits) == len(PROMPT) + 16
    for got, want in zip(logits, expected_logits):
        assert np.array_equal(got, want), f"max diff {np.abs(got - want).max()}"
    # the logits are informative, not a constant: a wrong chain would be caught
    assert float(np.std(expected_logits[-1])) > 0.1


def test_skipping_a_layer_is_detected() -> None:
    """Sanity control: a chain that drops layer 2 differs from the unsplit model."""
    expected_logits, _ = unsplit("llama", "F32", False)
    path = model_path("llama", "F32", False)
    with InProcessChain(path, [(0, 2)]) as first, InProcessChain(path, [(3, 4)]) as last:
        n = len(PROMPT)
        first.contexts[0].decode(tokens=PROMPT, positions=list(range(n)), seq_ids=[0] * n)
        hidden = first.contexts[0].activations().copy()
        last.contexts[0].decode(activations=hidden, positions=list(range(n)), seq_ids=[0] * n, outputs=[True] * n)
        got = last.contexts[0].logits(n - 1)
    assert not np.array_equal(got, expected_logits[n - 1])


@pytest.mark.slow
def test_f16_wire_rounding_stays_close() -> None:
    """Rounding hidden states to f16 between stages changes logits only slightly (reported, not exact)."""
    expected_logits, _ = unsplit("llama", "F32", False)
    path = model_path("llama", "F32", False)
    with InProcessChain(path, [(0, 2)]) as first, InProcessChain(path, [(2, 4)]) as last:
        n = len(PROMPT)
        first.contexts[0].decode(tokens=PROMPT, positions=list(range(n)), seq_ids=[0] * n)
        hidden = first.contexts[0].activations().astype(np.float16).astype(np.float32)
        last.contexts[0].decode(activations=hidden, positions=list(range(n)), seq_ids=[0] * n, outputs=[True] * n)
        got = last.contexts[0].logits(n - 1)
    diff = float(np.abs(got - expected_logits[n - 1]).max())
    assert 0.0 < diff < 0.05
