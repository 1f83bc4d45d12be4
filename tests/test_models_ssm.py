# The state-space families' writers (skippy/models/blocks_ssm.py) and the planner's recurrent state.
#
# Strategy: what the exactness suite (test_arch_exactness.py) cannot show by itself is checked
# here: the tiny hybrids' layouts put the test splits' cuts where the issue asks (inside a run of
# Mamba layers, between a Mamba and an attention layer); the files carry the per-layer arrays and
# leave out the keys a pure-SSM model has not; the spec rules refuse what the loaders would; and
# the planner's per-layer KV and recurrent-state figures match the tiny Nemotron-H's shapes and
# the state llama.cpp actually keeps for a stage's layers (its saved sequence state).
from __future__ import annotations

import dataclasses

import pytest
from chain_helpers import InProcessChain
from gguf_helpers import parse_gguf
from skippy.deploy.plan import CACHE_SLOTS, ModelShape, PlanSettings, sequence_ids, stage_memory
from skippy.models import ensure_model, preset, tiny
from skippy.models.spec import SSM_ARCHITECTURES
from skippy.models.synthetic import family_keys
from skippy.stage.config import StageConfig

HYBRIDS = [a for a in SSM_ARCHITECTURES if tiny(a).layer_pattern]  # type: ignore[arg-type]
#: Bytes llama.cpp's saved sequence state holds per KV cell beside the K and V values.
CELL_METADATA = 12
#: 12 tokens of the llama-spm vocabulary.
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_tiny_hybrids_put_the_cuts_where_the_splits_need_them(arch: str) -> None:
    """Splits [0:1)+[1:4) and [0:2)+[2:4): one cut inside a run of Mamba layers, one between a
    Mamba and an attention layer; the 3-stage split's middle stage holds both kinds."""
    layout = tiny(arch).layer_pattern  # type: ignore[arg-type]
    assert layout[:3] == "MM*", layout
    assert len(layout) == 4


def test_hybrid_file_has_per_layer_head_counts() -> None:
    spec = tiny("nemotron_h")
    keys = {key: value for key, value, _ in family_keys(spec)}
    assert keys["nemotron_h.attention.head_count_kv"] == [0, 0, spec.n_head_kv, 0]
    assert keys["nemotron_h.feed_forward_length"] == [0, 0, 0, spec.n_ff]
    fields = parse_gguf(ensure_model(spec)).fields
    assert fields["nemotron_h.attention.head_count_kv"] == 4  # an array of 4 (the parser counts)
    assert fields["nemotron_h.feed_forward_length"] == 4
    assert fields["nemotron_h.ssm.group_count"] == 2


def test_pure_ssm_file_has_no_attention_keys() -> None:
    fields = parse_gguf(ensure_model(tiny("mamba"))).fields
    assert fields["mamba.attention.head_count"] == 0 and fields["mamba.feed_forward_length"] == 0
    for absent in ("attention.head_count_kv", "attention.key_length", "rope.dimension_count", "rope.freq_base"):
        assert f"mamba.{absent}" not in fields
    assert parse_gguf(ensure_model(tiny("plamo2"))).fields["plamo2.ssm.group_count"] == 0


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        ("llama", {"layer_pattern": "****"}, "layer_pattern does not apply to llama"),
        ("nemotron_h", {"layer_pattern": "MM*"}, "one of 'M\\*-' per layer"),
        ("nemotron_h", {"layer_pattern": "MM*E"}, "one of 'M\\*-' per layer"),
        ("nemotron_h", {"ssm_n_group": 0}, "needs ssm_n_group"),
        ("mamba", {"ssm_d_inner": 96}, "expansion factor of 2"),
        ("mamba2", {"ssm_dt_rank": 7}, "divisible by ssm_dt_rank"),
        # Q8_0 rows of every layer, not only the first: ssm_out's rows are d_inner wide
        ("nemotron_h", {"dtype": "Q8_0", "ssm_d_inner": 80}, "ssm_out"),
    ],
)
def test_rules_refuse_what_the_loader_would(arch: str, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tiny(arch), **overrides)  # type: ignore[arg-type]


def test_real_shape_preset() -> None:
    spec = preset("nemotron-h-8b-8l")
    assert spec.layer_pattern == "M-M-M-M*" and spec.ssm_d_inner == 128 * 64


def test_plan_counts_recurrent_state_and_kv_per_layer() -> None:
    spec = tiny("nemotron_h")
    shape = ModelShape.from_gguf(ensure_model(spec))
    conv = (spec.ssm_d_conv - 1) * (spec.ssm_d_inner + 2 * spec.ssm_n_group * spec.ssm_d_state)
    state = (conv + spec.ssm_d_state * spec.ssm_d_inner) * 4  # f32
    assert shape.state_layer_bytes == (state, state, 0, 0)
    assert shape.kv_layer_bytes == (0, 0, 2 * spec.n_kv * 2, 0)  # K and V, f16, attention only
    settings = PlanSettings(ctx_size=256, max_sessions=3, prefix_cache=False)
    first, second = stage_memory(shape, 0, 2, settings), stage_memory(shape, 2, 4, settings)
    assert (first.state, first.kv) == (3 * 2 * state, 0)
    assert (second.state, second.kv) == (0, 256 * 2 * spec.n_kv * 2)
    assert first.resident - stage_memory(shape, 0, 2, dataclasses.replace(settings, max_sessions=1)).resident > 0
    # one state slot per sequence id: the sessions and, with the prefix cache, its slots
    assert sequence_ids(PlanSettings(max_sessions=3)) == 3 + CACHE_SLOTS
    assert StageConfig.__dataclass_fields__["cache_slots"].default == CACHE_SLOTS


def test_planned_state_is_what_llama_cpp_keeps_for_the_stage() -> None:
    """The saved state of a session on stage [0:2) (two Mamba layers, no KV) is the planned
    per-sequence state plus llama.cpp's small framing, whatever the prompt length; on [2:4) it
    has no recurrent part."""
    spec = tiny("nemotron_h")
    path = ensure_model(spec)
    shape = ModelShape.from_gguf(path)
    sizes = []
    for n in (4, len(PROMPT)):
        with InProcessChain(path, [(0, 2), (2, 4)], threads=1) as chain:
            chain.decode(PROMPT[:n], list(range(n)), [0] * n)
            sizes.append([len(context.save_state(0)) for context in chain.contexts])
    planned = shape.state_bytes_per_sequence(0, 2)
    assert planned <= sizes[0][0] <= planned + 1024, (planned, sizes)
    # per token only the cells' metadata (position, sequence ids: 3 int32) on the Mamba stage,
    # that plus its KV on the attention stage, which holds no recurrent state
    tokens = len(PROMPT) - 4
    assert sizes[1][0] - sizes[0][0] == tokens * CELL_METADATA
    assert sizes[1][1] - sizes[0][1] == tokens * (CELL_METADATA + shape.kv_bytes_per_cell(2, 4))
    assert sizes[0][1] < planned
