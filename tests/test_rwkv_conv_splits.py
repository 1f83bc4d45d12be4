"""RWKV and short-convolution families (issue 25): what the shared exactness suite leaves out.

`test_arch_exactness.py` covers the three standard splits of each family. Here: a stage that
holds only an attention layer of a hybrid (LFM2's layer 2: its recurrent-state input is built but
unused, patch 0005) and two sequences decoded side by side (each stage keeps one recurrent-state
slot per sequence for its own layers).  RWKV-7's value residual crosses a wide boundary
(tests/test_wide_boundary.py).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from chain_helpers import InProcessChain
from test_arch_exactness import LONG_PROMPT, THREADS

from skippy.models import ensure_model, tiny
from skippy.models.spec import ModelSpec

#: Two prompts of different lengths (the second is the first 12 tokens of the first, shifted).
PROMPTS = (LONG_PROMPT, [t + 7 for t in LONG_PROMPT[:12]])


@functools.lru_cache(maxsize=None)
def _spec(arch: str) -> ModelSpec:
    return tiny(arch)  # type: ignore[arg-type]


def _two_sequences(arch: str, split: list[tuple[int, int]], steps: int = 8) -> list[np.ndarray]:
    """Prefill both prompts in one batch, then decode both sequences together, greedily."""
    with InProcessChain(ensure_model(_spec(arch)), split, threads=THREADS) as chain:
        tokens = [*PROMPTS[0], *PROMPTS[1]]
        positions = [*range(len(PROMPTS[0])), *range(len(PROMPTS[1]))]
        seqs = [0] * len(PROMPTS[0]) + [1] * len(PROMPTS[1])
        logits = chain.decode(tokens, positions, seqs, [True] * len(tokens))
        ends = [len(PROMPTS[0]) - 1, len(tokens) - 1]
        position = [len(p) for p in PROMPTS]
        last = [logits[ends[0]], logits[ends[1]]]
        for _ in range(steps):
            step = [int(np.argmax(row)) for row in last]
            last = chain.decode(step, position, [0, 1], [True, True])
            logits += last
            position = [p + 1 for p in position]
    return logits


@pytest.mark.parametrize("arch", ["lfm2", "lfm2moe"])
def test_hybrid_stage_of_attention_only_is_bitwise_equal(arch: str) -> None:
    spec = _spec(arch)
    assert 2 not in spec.recurrent_layers and {1, 3} <= set(spec.recurrent_layers)
    expected = _two_sequences(arch, [(0, spec.n_layer)])
    got = _two_sequences(arch, [(0, 2), (2, 3), (3, 4)])
    assert len(got) == len(expected)
    for row, (a, b) in enumerate(zip(got, expected)):
        assert np.array_equal(a, b), f"row {row}: max diff {np.abs(a - b).max()}"


@pytest.mark.parametrize("arch", ["rwkv6", "rwkv6qwen2"])
def test_two_sequences_keep_their_own_state_in_every_stage(arch: str) -> None:
    expected = _two_sequences(arch, [(0, 4)])
    got = _two_sequences(arch, [(0, 1), (1, 3), (3, 4)])
    for row, (a, b) in enumerate(zip(got, expected)):
        assert np.array_equal(a, b), f"row {row}: max diff {np.abs(a - b).max()}"
    # the sequences differ, so a stage mixing their states up would show
    assert not np.array_equal(expected[len(PROMPTS[0]) - 1], expected[-1])
