"""The compute-cost model (skippy/deploy/cost.py) and the splits chosen from it: ``skippy up --stages N``,
``skippy plan`` and the Ray launcher cut where the slowest stage is fastest, the output head and
routed experts counted, the legal cuts kept."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from skippy.deploy.cost import (
    ATTENDED_TOKENS,
    HEAD_SPLIT_MIN_GAIN,
    LAYER_FIXED_MACS,
    LAYER_ROW_MACS,
    ROW_NS_PER_MAC,
    PartCosts,
    Regime,
    balanced_split,
    choose_cut,
    load_rows,
    row_ns_per_mac,
    shares,
    split_times,
)
from skippy.deploy.plan import (
    GIB,
    HostSpec,
    LayerTimes,
    ModelShape,
    PlanSettings,
    balanced_stages,
    estimated_times,
    plan_chain,
)
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
    assert shape.costs.layer_macs[0] == matrices + attention
    assert shape.costs.layer_attention[0] == attention
    types = {t.ggml_type for t in read_layout(path).tensors if t.name.startswith("blk.0.") and len(t.dims) >= 2}
    assert {t for t, _ in shape.costs.layer_matrices[0]} == types
    assert sum(m for _, m in shape.costs.layer_matrices[0]) == matrices
    # the head is the n_vocab x n_embd output matrix; the embedding copies one row
    assert shape.costs.head_macs == shape.n_vocab * shape.n_embd
    assert shape.costs.embed_macs == shape.n_embd
    # the small ops: LAYER_FIXED_MACS once a batch, LAYER_ROW_MACS a row
    rates = {"gmacs": 8.0, "bandwidth_gbs": 1e9}
    no_ops = dataclasses.replace(shape.costs, layer_macs=(0.0,) * shape.n_layer, layer_matrices=((),) * shape.n_layer,
                                 layer_attention=(0.0,) * shape.n_layer)
    assert no_ops.layer_ms(**rates, rows=1)[0] == pytest.approx((LAYER_FIXED_MACS + LAYER_ROW_MACS) / 8e6)
    assert no_ops.layer_ms(**rates, rows=4)[0] == pytest.approx((LAYER_FIXED_MACS / 4 + LAYER_ROW_MACS) / 8e6)


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
    attention = shape.costs.layer_macs[0] - dense - experts * n_used / n_expert
    assert experts > 0 and attention == pytest.approx(
        meta["qwen3moe.attention.head_count"] * (
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
    layer_ms = shape.costs.layer_ms(gmacs=settings.compute_gmacs, bandwidth_gbs=settings.bandwidth_gbs)
    # a head that takes as long as two layers (untyped MACs are priced at compute_gmacs)
    heavy = dataclasses.replace(shape, costs=dataclasses.replace(
        shape.costs, head_macs=layer_ms[0] * 2 * settings.compute_gmacs * 1e6, head_read_bytes=0, head_matrices=(),
        head_logits=0))
    light = dataclasses.replace(shape, costs=dataclasses.replace(shape.costs, head_macs=0, head_read_bytes=0,
                                                                 head_matrices=(), head_logits=0))
    assert [s.layers for s in plan_chain(light, hosts, settings).stages] == ["0:2", "2:4"]
    plan = plan_chain(heavy, hosts, settings)
    assert [s.layers for s in plan.stages] == ["0:3", "3:4"]
    assert [s.share for s in plan.stages] == pytest.approx([0.5, 0.5])
    assert "50% of a token's time" in plan.describe() and "decode_share = 0.5000" in plan.to_toml()
    assert "in a stage's batch of 1 row under that load" in plan.describe()  # max_sessions 1 over 2 stages


def test_up_cuts_by_cost_unless_layers_are_given() -> None:
    from skippy.commands.up import _split

    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    args = argparse.Namespace(layers=None, stages=2, measure=False)
    split, how = _split(args, path, shape.n_layer)
    assert split == balanced_stages(shape, 2)[0]
    assert "cut by compute cost (estimated from the shapes, 4 rows a stage's batch at 8 sessions)" in how
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


def test_measured_times_at_the_load_and_at_one_row() -> None:
    """``--measure`` times every segment in the stages' batch under load and at one row (one load
    each); the cut takes both regimes as from the estimate."""
    from skippy.deploy.plan import measure_times

    shape = ModelShape.from_gguf(model_path("llama"))
    times = measure_times(shape, rows=4, steps=4, threads=1)
    assert times.rows == 4 and times.one_row is not None and times.source == "measured on this machine"
    layer_ms, head_ms = times.one_row
    assert len(layer_ms) == len(times.layer_ms) == shape.n_layer and all(t > 0 for t in layer_ms)
    assert head_ms > 0 and times.head_ms > 0
    assert [regime.rows for regime in times.regimes()] == [4, 1]
    split, fractions = balanced_stages(shape, 2, times)
    assert split[0][0] == 0 and split[-1][1] == shape.n_layer and sum(fractions) == pytest.approx(1.0)
    single = measure_times(shape, rows=1, steps=2, threads=1)
    assert single.one_row is None and [regime.rows for regime in single.regimes()] == [1]


def test_real_gemma_is_cut_for_the_load(real_model: Path) -> None:
    """Gemma 3 270M: its tied 262,144-row Q8_0 head costs about as much as its 18 K-quant / Q5_0
    layers at one row, and patch 0018 makes it 2.2x cheaper a row in the batches each stage runs
    under load while the layers gain less.  Two stages: 0:17 | 17:18 at 1 and 8 sessions, the head
    whole (a split would not gain 10%), neither stage over 60% in either regime.  Three stages at
    8 sessions (3 rows a stage's batch): more head rows on stage 0 and a different cut than at one
    session, which a batch-blind model (the one-row figures at every load) would keep."""
    from skippy.deploy.plan import balanced_stages_head

    shape = ModelShape.from_gguf(real_model)
    settings = PlanSettings()
    for sessions in (1, 8):
        split, head, fractions = balanced_stages_head(shape, 2, sessions=sessions)
        assert (split, head) == ([(0, 17), (17, 18)], None) and max(fractions) < 0.6
        one = estimated_times(shape, settings, rows=1).regimes()[0]
        assert max(shares(one.stage_times(split, None, shape.n_vocab))) < 0.6
    light = balanced_stages_head(shape, 3, sessions=1)
    loaded = balanced_stages_head(shape, 3, sessions=8)
    assert light[1] is not None and loaded[1] is not None and loaded[1].rows > light[1].rows
    assert loaded[0] != light[0] and max(loaded[2]) < 0.36
    one = estimated_times(shape, settings, rows=1).regimes()[0]
    blind = LayerTimes(one.layer_ms, one.head_ms, "estimated", 3)  # one row's figures at 8 sessions
    assert balanced_stages_head(shape, 3, blind)[:2] == light[:2]
    # skippy plan on two hosts: the same cut and shares under its --max-sessions
    hosts = [HostSpec("127.0.0.1", 8 * GIB, port=7000 + index) for index in range(2)]
    for sessions in (1, 8):
        plan = plan_chain(shape, hosts, PlanSettings(max_sessions=sessions))
        assert [stage.layers for stage in plan.stages] == ["0:17", "17:18"]
        assert [stage.share for stage in plan.stages] == pytest.approx(balanced_stages(shape, 2, sessions=sessions)[1])


def _typed_costs(head_type: int, head_macs: float, *, layer_type: int = 12, n_layer: int = 8,
                 layer_macs: float = 20e6) -> PartCosts:
    """A model of ``n_layer`` equal layers of one weight type and a head of another (no attention,
    no reads: compute only)."""
    return PartCosts((layer_macs,) * n_layer, (0.0,) * n_layer, 0.0, head_macs, 0.0,
                     (((layer_type, layer_macs),),) * n_layer, ((head_type, head_macs),), (0.0,) * n_layer)


def _regimes(costs: PartCosts, rows: int) -> list[Regime]:
    rates = {"gmacs": 8.0, "bandwidth_gbs": 1e9}
    found = [Regime(rows, costs.layer_ms(**rates, rows=rows), costs.head_ms(**rates, rows=rows))]
    if rows > 1:
        found.append(Regime(1, costs.layer_ms(**rates), costs.head_ms(**rates)))
    return found


def test_the_table_has_the_small_batch_kernels_gain() -> None:
    """Patch 0018's types cost far less a row in a batch of 2..8 than alone; the repacked and
    vec_dot K-quants about the same (the calibration table, bench/type_costs.py)."""
    for name in ("f32", "f16", "q8_0"):
        assert all(cost < 0.75 * ROW_NS_PER_MAC[name][0] for cost in ROW_NS_PER_MAC[name][1:8])
    for name in ("q4_K", "q5_K", "q6_K"):
        assert all(cost > 0.85 * ROW_NS_PER_MAC[name][0] for cost in ROW_NS_PER_MAC[name][1:7])
    assert row_ns_per_mac(8, 4) == ROW_NS_PER_MAC["q8_0"][3] and row_ns_per_mac(8, 10) == ROW_NS_PER_MAC["q8_0"][7]
    assert row_ns_per_mac(8, 100) == ROW_NS_PER_MAC["q8_0"][-1] and row_ns_per_mac(99, 1) == ROW_NS_PER_MAC["q5_K"][0]
    assert [load_rows(n, 2) for n in (1, 2, 3, 8, 9)] == [1, 1, 2, 4, 5]


def test_a_q8_0_head_and_a_q4_k_head_of_the_same_one_row_time_cut_differently_under_load() -> None:
    """Two models of 4 Q4_K layers whose heads take the same time at one row (as long as four
    layers' matrices): at one session both need a head split (3 layers | 1 layer + the head).  At 8
    sessions (4 rows a stage's batch) the Q8_0 head costs 0.62 of that a row, the Q4_K head 0.86
    and the layers about 0.8: the Q8_0 model's cut is even enough without a split, the Q4_K
    model's is not.  A batch-blind model would split both heads at every load."""
    one_row = 4 * 20e6 * row_ns_per_mac(12, 1)
    q8 = _typed_costs(8, one_row / row_ns_per_mac(8, 1), n_layer=4)
    q4k = _typed_costs(12, one_row / row_ns_per_mac(12, 1), n_layer=4)
    assert q8.head_ms(gmacs=8.0, bandwidth_gbs=1e9) == pytest.approx(q4k.head_ms(gmacs=8.0, bandwidth_gbs=1e9))
    for costs in (q8, q4k):
        split, head = choose_cut(_regimes(costs, 1), 2, 65536)
        assert split == [(0, 3), (3, 4)] and head is not None and head.host == 0
    assert choose_cut(_regimes(q8, 4), 2, 65536) == ([(0, 3), (3, 4)], None)
    split, head = choose_cut(_regimes(q4k, 4), 2, 65536)
    assert head is not None and head.host == 0
    load = _regimes(q4k, 4)[0]
    assert max(load.stage_times(split, head, 65536)) * (1 + HEAD_SPLIT_MIN_GAIN) < max(
        load.stage_times([(0, 3), (3, 4)], None, 65536))


def test_the_load_decides_and_one_row_chooses_among_equals() -> None:
    """``regimes[0]`` (the load) decides; among cuts within LOAD_TOLERANCE of its fastest, the
    one fastest at one row; a head split only where it beats the best cut without one by
    HEAD_SPLIT_MIN_GAIN."""
    load = Regime(4, (1.0,) * 6, 1.0)  # 0:3 | 3:6 and 0:4 | 4:6 both 4 at their slowest
    assert choose_cut([load, Regime(1, (1.0,) * 6, 2.0)], 2, 65536, head=False) == ([(0, 4), (4, 6)], None)
    assert choose_cut([load, Regime(1, (1.0,) * 6, 0.0)], 2, 65536, head=False) == ([(0, 3), (3, 6)], None)
    # one row would gain from moving head rows (5 vs 4 at best), the load cannot (0:4 | 4:6 is 4 vs 4)
    assert choose_cut([Regime(4, (1.0,) * 6, 2.0), Regime(1, (1.0,) * 6, 3.0)], 2, 65536) == ([(0, 4), (4, 6)], None)
    assert choose_cut([Regime(1, (1.0,) * 6, 3.0)], 2, 65536)[1] is not None  # one session: it pays
    # the head split pays under load: 0:5 | 5:6 is 5 vs 7, moving rows makes it 6 vs 6 (17% faster)
    split, head = choose_cut([Regime(4, (1.0,) * 6, 6.0)], 2, 65536)
    assert head is not None and max(Regime(4, (1.0,) * 6, 6.0).stage_times(split, head, 65536)) <= 6.0 * 1.02


def test_llama_16x1024_two_stages_under_60_percent_at_one_and_eight_sessions() -> None:
    """The generated llama-16x1024 (F16 throughout: every part gains alike in a batch) cuts 0:9 | 9:16
    at 1 and 8 sessions, neither stage over 60%, no head split."""
    from skippy.models.cache import ensure_model
    from skippy.models.spec import preset

    from skippy.deploy.plan import balanced_stages_head

    shape = ModelShape.from_gguf(ensure_model(preset("llama-16x1024")))
    for sessions in (1, 8):
        split, head, fractions = balanced_stages_head(shape, 2, sessions=sessions)
        assert (split, head) == ([(0, 9), (9, 16)], None) and max(fractions) < 0.6
