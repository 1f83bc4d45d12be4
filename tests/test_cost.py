"""The compute-cost model (skippy/deploy/cost.py) and the splits chosen from it: ``skippy up --stages N``,
``skippy plan`` and the Ray launcher cut where the slowest stage is fastest, the output head and
routed experts counted, the legal cuts kept."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from skippy.deploy.cost import ATTENDED_TOKENS, LAYER_FIXED_MACS, balanced_split, shares, split_times
from skippy.deploy.plan import GIB, HostSpec, LayerTimes, ModelShape, PlanSettings, balanced_stages, plan_chain
from skippy.runtime.cuts import KvGroup
from skippy.runtime.gguf_header import read_layout

from conftest import model_path


def _matrices(path: Path, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.name, t.dims) for t in read_layout(path).tensors
            if t.name.startswith(f"blk.{layer}.") and len(t.dims) >= 2]


def test_dense_layer_costs_its_matrices_attention_and_fixed_ops() -> None:
    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    meta = read_layout(path).metadata
    assert shape.costs is not None
    n_head = meta["llama.attention.head_count"]
    head_dim = shape.n_embd // n_head
    matrices = sum(math.prod(dims) for _, dims in _matrices(path, 0))
    attention = n_head * 2 * head_dim * ATTENDED_TOKENS
    assert shape.costs.layer_macs[0] == matrices + attention + LAYER_FIXED_MACS
    # the head is the n_vocab x n_embd output matrix; the embedding copies one row
    assert shape.costs.head_macs == shape.n_vocab * shape.n_embd
    assert shape.costs.embed_macs == shape.n_embd


def test_tied_head_costs_the_token_table() -> None:
    shape = ModelShape.from_gguf(model_path("llama", tied=True))
    assert shape.tied_head and shape.costs is not None
    assert shape.costs.head_macs == shape.n_vocab * shape.n_embd


def test_moe_layers_count_only_the_routed_experts() -> None:
    path = model_path("qwen3moe")
    shape = ModelShape.from_gguf(path)
    meta = read_layout(path).metadata
    assert shape.costs is not None
    n_expert, n_used = meta["qwen3moe.expert_count"], meta["qwen3moe.expert_used_count"]
    assert n_used < n_expert
    dense = sum(math.prod(d) for name, d in _matrices(path, 0) if "_exps" not in name)
    experts = sum(math.prod(d) for name, d in _matrices(path, 0) if "_exps" in name)
    fixed = shape.costs.layer_macs[0] - dense - experts * n_used / n_expert
    assert experts > 0 and fixed == pytest.approx(
        LAYER_FIXED_MACS + meta["qwen3moe.attention.head_count"] * (
            meta["qwen3moe.attention.key_length"] + meta["qwen3moe.attention.value_length"]) * ATTENDED_TOKENS)


def test_hybrid_attention_and_recurrent_layers_cost_their_own_work() -> None:
    """granitehybrid's one attention layer pays for its scores over the context, the Mamba layers
    for their state, so two layers with the same matrices cost differently."""
    path = model_path("granitehybrid")
    shape = ModelShape.from_gguf(path)
    assert shape.costs is not None
    kinds = read_layout(path).metadata["granitehybrid.attention.head_count_kv"]
    attention = [il for il, kv in enumerate(kinds) if kv]
    recurrent = [il for il, kv in enumerate(kinds) if not kv]
    assert attention and recurrent
    costs = shape.costs.layer_macs
    assert len({costs[il] for il in recurrent}) == 1  # same shapes, same cost
    assert costs[attention[0]] != costs[recurrent[0]]


def test_balanced_split_takes_the_head_into_account() -> None:
    layer_ms, head_ms = [1.0] * 18, 19.0  # the head costs as much as 19 layers (Gemma 3 270M-like)
    assert balanced_split(layer_ms, head_ms, 2) == [(0, 17), (17, 18)]
    assert balanced_split(layer_ms, 0.0, 2) == [(0, 9), (9, 18)]
    assert balanced_split(layer_ms, 3.0, 3) == [(0, 7), (7, 14), (14, 18)]
    bounds = [0, 17, 18]
    assert shares(split_times(layer_ms, head_ms, bounds)) == pytest.approx([17 / 37, 20 / 37])
    # the embedding is charged to the first stage
    assert split_times([1.0] * 4, 2.0, [0, 2, 4], embed_ms=0.5) == [2.5, 4.0]


def test_balanced_split_prefers_even_stages_among_equally_fast_splits() -> None:
    """The slowest stage fixes the throughput; among splits where it is as fast, the most even."""
    layer_ms = [10.0, 1.0, 1.0, 1.0, 1.0]
    # every split that leaves layer 0 alone is 10 ms at its slowest; of those, 2 + 2 is the most even
    assert balanced_split(layer_ms, 0.0, 3) == [(0, 1), (1, 3), (3, 5)]


def test_balanced_split_keeps_to_the_legal_cuts() -> None:
    group = KvGroup(2, 6, 4)  # layers 2..5 share one stage
    layer_ms = [1.0] * 6
    assert balanced_split(layer_ms, 0.0, 2, [group]) == [(0, 2), (2, 6)]
    assert balanced_split(layer_ms, 0.0, 3, [group]) == [(0, 1), (1, 2), (2, 6)]
    with pytest.raises(ValueError, match="legal cuts"):
        balanced_split(layer_ms, 0.0, 4, [group])
    with pytest.raises(ValueError, match="cannot split"):
        balanced_split(layer_ms, 0.0, 7)


def test_plan_charges_the_head_and_prints_shares() -> None:
    """``skippy plan`` (estimated): a head as costly as many layers moves the cut towards the end,
    and each stage's share of a token's time is printed and written."""
    shape = ModelShape.from_gguf(model_path("llama"))
    assert shape.costs is not None
    settings = PlanSettings(ctx_size=256, max_sessions=1, batch_size=16, prefix_cache=False)
    hosts = [HostSpec("a", GIB), HostSpec("b", GIB)]
    heavy = dataclasses.replace(shape, costs=dataclasses.replace(
        shape.costs, head_macs=shape.costs.layer_macs[0] * 2, head_read_bytes=0))
    light = dataclasses.replace(shape, costs=dataclasses.replace(shape.costs, head_macs=0, head_read_bytes=0))
    assert [s.layers for s in plan_chain(light, hosts, settings).stages] == ["0:2", "2:4"]
    plan = plan_chain(heavy, hosts, settings)
    assert [s.layers for s in plan.stages] == ["0:3", "3:4"]
    assert [s.share for s in plan.stages] == pytest.approx([0.5, 0.5])
    assert "50% of a token's time" in plan.describe() and "decode_share = 0.5000" in plan.to_toml()


def test_up_cuts_by_cost_unless_layers_are_given() -> None:
    from skippy.commands.up import _split

    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    args = argparse.Namespace(layers=None, stages=2, measure=False)
    split, how = _split(args, path, shape.n_layer)
    assert split == balanced_stages(shape, 2)[0] and "cut by compute cost (estimated from the shapes)" in how
    args = argparse.Namespace(layers="0:1,1:4", stages=None, measure=False)
    assert _split(args, path, shape.n_layer) == ([(0, 1), (1, 4)], "layers as given")


def test_measured_times_isolate_the_head() -> None:
    """``--measure``: each layer timed as a stage of its own, the head by the difference between
    batches with every row's logits and one row's; the tiny model's 32000-row head costs more
    than one of its 64-wide layers."""
    from skippy.deploy.plan import measure_layer_times

    shape = ModelShape.from_gguf(model_path("llama"))
    layer_ms, head_ms = measure_layer_times(shape, rows=4, steps=6, threads=1)
    assert len(layer_ms) == shape.n_layer and all(t > 0 for t in layer_ms)
    assert head_ms > max(layer_ms)
    split, fractions = balanced_stages(shape, 2, LayerTimes(tuple(layer_ms), head_ms, "measured"))
    assert split[0][0] == 0 and split[-1][1] == shape.n_layer and sum(fractions) == pytest.approx(1.0)


def test_real_gemma_two_stages_keep_the_head_stage_light(real_model: Path) -> None:
    """Gemma 3 270M: the tied 262,144-row head is costlier than the 18 layers, so ``--stages 2``
    gives the last stage one layer, and neither stage's expected share passes 60%."""
    shape = ModelShape.from_gguf(real_model)
    split, fractions = balanced_stages(shape, 2)
    assert split == [(0, 17), (17, 18)]
    assert max(fractions) < 0.6
