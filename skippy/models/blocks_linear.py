# Blocks of the linear-attention families (issue 25): gated delta-net (Qwen3-Next, Qwen3.5),
# their hybrids with full attention, and the shape rules they share.
#
# Strategy: as in `blocks.py`, each function returns one layer's tensors in file order, named
# and shaped as llama.cpp's loader for the family creates them (numpy order: the last axis is
# the input width). A hybrid's block picks the layer kind the way the loader does (every
# ``full_attention_interval``-th layer is full attention), so the file and the loader agree on
# which layers are recurrent.
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "DELTA_NET",
    "delta_net",
    "every_layer_quantizes",
    "mrope_sections",
    "is_recurrent",
    "delta_net_keys",
    "qwen35",
    "qwen35_keys",
    "qwen35moe",
    "qwen3next",
    "tiny_delta_net",
]

#: The spec fields every gated delta-net family needs.
DELTA_NET: Final = frozenset(
    {"linear_conv_kernel", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads"}
)
#: llama.cpp's default when ``full_attention_interval`` is absent from the file.
DEFAULT_FULL_ATTENTION_INTERVAL: Final = 4


def is_recurrent(spec: "ModelSpec", layer: int) -> bool:
    """Whether ``layer`` is a delta-net layer (llama.cpp: ``(il + 1) % interval != 0``)."""
    interval = spec.full_attention_interval or DEFAULT_FULL_ATTENTION_INTERVAL
    return (layer + 1) % interval != 0


def _delta_net_widths(spec: "ModelSpec") -> tuple[int, int]:
    """(key width, value width) of one delta-net layer: heads times the shared head width."""
    head = spec.linear_key_head_dim
    return head * spec.linear_num_key_heads, head * spec.linear_num_value_heads


def gated_delta_net(spec: "ModelSpec", layer: int, *, fused_ba: bool = False) -> list[TensorDecl]:
    """The delta-net mixer of Qwen3-Next / Qwen3.5 (without its input norm): fused q/k/v
    ``attn_qkv``, the output gate ``attn_gate`` (z), the causal conv over q/k/v (F32), the
    per-head dt bias and decay ``ssm_a``, the beta and alpha (decay input) projections (Qwen3-Next
    fuses them in ``ssm_ba``), the gated output norm (one head wide) and ``ssm_out``."""
    key, value = _delta_net_widths(spec)
    heads_v = spec.linear_num_value_heads
    conv = 2 * key + value
    out = [
        b.matrix(layer, "attn_qkv", conv, spec.n_embd),
        b.matrix(layer, "attn_gate", value, spec.n_embd),
        TensorDecl(b.blk(layer, "ssm_conv1d"), (conv, spec.linear_conv_kernel), "matrix", False),
        b.bias(layer, "ssm_dt", heads_v),
        TensorDecl(f"blk.{layer}.ssm_a", (heads_v,), "decay", False),
    ]
    if fused_ba:
        out.append(b.matrix(layer, "ssm_ba", 2 * heads_v, spec.n_embd))
    else:
        out += [b.matrix(layer, "ssm_beta", heads_v, spec.n_embd), b.matrix(layer, "ssm_alpha", heads_v, spec.n_embd)]
    return out + [
        b.norm(layer, "ssm_norm", spec.linear_key_head_dim),
        b.matrix(layer, "ssm_out", spec.n_embd, value),
    ]


def gated_attention(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    """The full-attention mixer of the Qwen3-Next family (without its input norm): q projects
    to query and sigmoid gate (twice the query width), k, v, per-head q/k norms, output."""
    return [
        b.matrix(layer, "attn_q", 2 * spec.n_q, spec.n_embd),
        b.matrix(layer, "attn_k", spec.n_kv, spec.n_embd),
        b.matrix(layer, "attn_v", spec.n_kv, spec.n_embd),
        b.matrix(layer, "attn_output", spec.n_embd, spec.n_q),
        b.norm(layer, "attn_q_norm", spec.n_embd_head),
        b.norm(layer, "attn_k_norm", spec.n_embd_head),
    ]


def _hybrid(spec: "ModelSpec", layer: int, *, fused_ba: bool = False) -> list[TensorDecl]:
    # The Qwen3-Next family's block head: attn_norm, post_attention_norm (the FFN's input
    # norm), then the layer's mixer (delta-net or gated attention).
    out = [b.norm(layer, "attn_norm", spec.n_embd), b.norm(layer, "post_attention_norm", spec.n_embd)]
    if is_recurrent(spec, layer):
        return out + gated_delta_net(spec, layer, fused_ba=fused_ba)
    return out + gated_attention(spec, layer)


def qwen35(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Qwen3.5 (dense): the hybrid mixer, SwiGLU.
    return _hybrid(spec, layer) + b.dense_ffn(spec, layer, pre_norm=False)


def qwen35moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Qwen3.5-MoE: the hybrid mixer, softmax top-k experts plus a sigmoid-gated shared expert.
    return _hybrid(spec, layer) + b.moe_ffn(spec, layer, pre_norm=False, shared="gated")


def qwen3next(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Qwen3-Next: Qwen3.5-MoE's block with beta and alpha fused in ssm_ba.
    return _hybrid(spec, layer, fused_ba=True) + b.moe_ffn(spec, layer, pre_norm=False, shared="gated")


def delta_net_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    # ssm.inner_size is the value width (value heads times the shared head width).
    _, value = _delta_net_widths(spec)
    return [("ssm.inner_size", value, GGUFValueType.UINT32)]


def qwen35_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    # Qwen3.5 adds rope.dimension_sections: the rotated half-width over (time, height, width),
    # as its mrope_section [11, 11, 10] does for 32 pairs.
    pairs = spec.n_rot // 2
    first = -(-pairs // 3)
    sections = [first, first, pairs - 2 * first, 0]
    return delta_net_keys(spec) + [("rope.dimension_sections", sections, GGUFValueType.ARRAY)]


def tiny_delta_net(n_embd: int) -> dict[str, Any]:
    """The tiny shape's delta-net fields (`skippy.models.spec.tiny`): a head width of n_embd / 2
    (decoupled), a quarter of it rotated, 2 key heads of n_embd / 4 repeated over 4 value heads,
    full attention every 3rd layer (R R A R: the test splits cut inside a delta-net run, between
    delta-net and attention, and after attention)."""
    return {
        "head_dim": n_embd // 2, "rope_dim": n_embd // 8, "linear_conv_kernel": 4,
        "linear_key_head_dim": n_embd // 4, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "full_attention_interval": 3,
    }


# --- rules ---------------------------------------------------------------------------------


def delta_net(spec: "ModelSpec") -> str | None:
    if spec.linear_num_value_heads % spec.linear_num_key_heads:
        return (
            f"{spec.arch} repeats key heads over value heads: linear_num_value_heads "
            f"({spec.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
            f"({spec.linear_num_key_heads})"
        )
    if spec.linear_conv_kernel < 2:
        return f"{spec.arch} needs linear_conv_kernel >= 2, got {spec.linear_conv_kernel}"
    if spec.full_attention_interval == 1:
        return "full_attention_interval 1 leaves no delta-net layer"
    return None


def every_layer_quantizes(spec: "ModelSpec") -> str | None:
    # The spec checks Q8_0 rows of block 0 only (and the first block after a dense lead); a
    # hybrid's attention and recurrent layers have different rows, so check every block.
    from skippy.models.families import family, quantized_rows  # families imports this module

    if spec.dtype != "Q8_0":
        return None
    for layer in range(spec.n_layer):
        for label, width in quantized_rows(family(spec.arch).block(spec, layer)):
            if width % 32:
                return f"Q8_0 rows must be a multiple of 32 values; {label} rows are {width}"
    return None


def mrope_sections(spec: "ModelSpec") -> str | None:
    pairs = spec.n_rot // 2
    if pairs < 3:
        return f"{spec.arch} splits the rotated pairs over 3 M-RoPE sections: rope_dim must be >= 6"
    return None
