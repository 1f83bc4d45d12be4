"""Issue 26: per-token adapter switching (Granite Switch) splits with the router on every stage.

The bitwise splits are in test_arch_exactness.py (``graniteswitch``).  Here: the tiny model's router
does switch adapters where the tests' prompt holds an adapter token (control); every stage keeps the
router's KV cells beside its layers' (patch 0014), as the runtime and the planner count them (the
saved state of a session grows by exactly that per token); a later stage refuses a batch without the
token ids it runs the router on, in Python and in the patched library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from chain_helpers import ChainModels, InProcessChain, greedy_run
from skippy.deploy.plan import ModelShape
from skippy.models import ensure_model, tiny
from skippy.runtime import InvalidBatch, LayerRange, Model, StageContext, read_gguf_info
from test_arch_exactness import LONG_PROMPT

#: Bytes llama.cpp's saved sequence state holds per KV cell beside the K and V values.
CELL_METADATA = 12


def test_the_router_switches_adapters_at_the_prompts_adapter_token() -> None:
    """Control: the same weights with adapter tokens the prompt lacks give bitwise the same logits
    before the first adapter token (row 3) and different ones from it on, so the exactness suite's
    splits run rows on the base slot and on adapters (the router's answer changes along the prompt)."""
    spec = tiny("graniteswitch")
    first = LONG_PROMPT.index(spec.adapter_tokens[0])
    assert first == 3 and spec.adapter_tokens[1] in LONG_PROMPT[first + 1:]
    unused = dataclasses.replace(spec, adapter_tokens=(2, 3))
    assert not set(unused.adapter_tokens) & set(LONG_PROMPT)
    rows = {}
    for label, s in (("switched", spec), ("base", unused)):
        with InProcessChain(ensure_model(s), [(0, 4)], threads=1) as whole:
            rows[label], _ = greedy_run(whole, LONG_PROMPT, steps=1)
    for row in range(first):
        assert np.array_equal(rows["switched"][row], rows["base"][row]), row
    for row in range(first, len(LONG_PROMPT)):
        assert not np.array_equal(rows["switched"][row], rows["base"][row]), row


@pytest.fixture(scope="module")
def models() -> Iterator[ChainModels]:
    """The 3-stage split's ranges, loaded once: each chain below gets fresh contexts on them."""
    shared = ChainModels()
    yield shared
    shared.close()


@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (3, 4)])
def test_every_stage_keeps_the_routers_kv_cells(models: ChainModels, layers: tuple[int, int]) -> None:
    """A session's saved state on each stage of the 3-stage split grows per token by the KV of the
    stage's layers plus the router's (one head of the head width, K and V, f16), which the runtime
    and the planner count."""
    path = ensure_model(tiny("graniteswitch"))
    info, shape = read_gguf_info(path), ModelShape.from_gguf(path)
    start, end = layers
    router = 2 * info.head_dim_k * 2
    assert info.kv_stage_bytes == shape.kv_stage_bytes == router > 0
    assert info.kv_bytes_per_cell(start, end) == shape.kv_bytes_per_cell(start, end)
    assert info.kv_bytes_per_cell(start, end) == (end - start) * info.kv_layer_bytes[0] + router
    sizes = []
    for n in (4, len(LONG_PROMPT)):
        with models.chain(path, [(0, 1), (1, 3), (3, 4)], threads=1) as chain:
            chain.decode(LONG_PROMPT[:n], list(range(n)), [0] * n)
            stage = next(c for c in chain.contexts if (c.model.layers.start, c.model.layers.end) == layers)
            sizes.append(len(stage.save_state(0)))
    tokens = len(LONG_PROMPT) - 4
    assert sizes[1] - sizes[0] == tokens * (CELL_METADATA + info.kv_bytes_per_cell(start, end))


def test_a_later_stage_needs_the_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_model(tiny("graniteswitch"))
    with Model(path, LayerRange(2, 4)) as model, StageContext(model, n_ctx=64, max_sessions=1, n_batch=8, threads=1) as ctx:
        assert model.reads_tokens
        hidden = np.zeros((2, model.n_embd), dtype=np.float32)
        with pytest.raises(InvalidBatch, match="needs the token ids beside the activations"):
            ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden)
        monkeypatch.setattr(ctx, "_reads_tokens", False)  # the context reads it once, at creation
        with pytest.raises(InvalidBatch, match="of this architecture needs the token ids"):
            ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden)
        monkeypatch.undo()
        ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden, tokens=[1, 29892])


def test_the_spec_refuses_a_malformed_adapter_table() -> None:
    spec = tiny("graniteswitch")
    with pytest.raises(ValueError, match="one activating token and one substitute per adapter"):
        dataclasses.replace(spec, adapter_tokens=(29892,))
    with pytest.raises(ValueError, match="adapter tokens must differ"):
        dataclasses.replace(spec, adapter_tokens=(263, 263))


@pytest.mark.slow
def test_graniteswitch_split_in_three_through_up_gives_the_unsplit_text(tmp_path: Path) -> None:
    """Three stage processes (frames carry the token ids the later stages run the router on) give
    the unsplit greedy text through the API, prefill and decode."""
    from test_perlayer import up_completion

    path = ensure_model(tiny("graniteswitch"))
    whole = up_completion(tmp_path, path, "0:4")
    assert whole.strip()
    assert up_completion(tmp_path, path, "0:1,1:3,3:4") == whole
