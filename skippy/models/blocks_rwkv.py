# Block descriptions of the RWKV and short-convolution families (issue 25): RWKV-6 (Finch),
# RWKV-6-Qwen2 (QRWKV: Qwen2 blocks whose attention is replaced by RWKV-6 time mixing) and LFM2
# (gated short convolutions interleaved with GQA attention layers).
#
# Strategy: like `blocks.py`, each function returns one block's tensors in file order, named and
# shaped as llama.cpp's loader for that architecture creates them (numpy order: the last axis is
# the input width). The small RWKV tensors llama.cpp's quantizer keeps in F32 (time_mix_w1/w2,
# decay_w1/w2, lerp_fused, time_mix_first) and LFM2's conv kernel are declared unquantized, so
# a Q8_0 file is what `llama-quantize` would make. Each layer's recurrent state (token shift and
# WKV state, the conv window) is its own: none of it crosses layers, so a layer range owns it.
from __future__ import annotations

from typing import TYPE_CHECKING

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = ["hybrid_layers", "lfm2", "lfm2moe", "rwkv6", "rwkv6qwen2", "wkv_heads"]


def _f32(layer: int, name: str, *shape: int) -> TensorDecl:
    """A matrix-initialised tensor that stays F32 whatever the spec's dtype."""
    return TensorDecl(b.blk(layer, name), tuple(shape), "matrix", False)


def _vector(layer: int, name: str, *shape: int) -> TensorDecl:
    """A per-channel parameter (lerp, decay, bonus) drawn like a norm weight: in [0.6, 1.4]."""
    return TensorDecl(b.blk(layer, name), tuple(shape), "norm", False)


def _time_mix_v6(spec: "ModelSpec", layer: int, kv_width: int, *, bonus: bool) -> list[TensorDecl]:
    """RWKV-6 time mixing: data-dependent token shift (w1/w2 low-rank over 5 lerps), decay with
    its own low-rank update, r/k/v/g projections and the output; ``bonus`` adds time_mix_first
    (RWKV-6 proper; QRWKV has none and runs gated linear attention instead)."""
    e, extra, decay = spec.n_embd, spec.time_mix_extra_dim, spec.time_decay_extra_dim
    out = [
        _f32(layer, "time_mix_w1", 5 * extra, e),
        _f32(layer, "time_mix_w2", 5, e, extra),
        _vector(layer, "time_mix_lerp_x", 1, 1, e),
        _vector(layer, "time_mix_lerp_fused", 5, 1, 1, e),
    ]
    if bonus:
        out.append(TensorDecl(b.blk(layer, "time_mix_first"), (e // spec.wkv_head_size, spec.wkv_head_size), "bias", False))
    out += [
        _vector(layer, "time_mix_decay", e),
        _f32(layer, "time_mix_decay_w1", decay, e),
        _f32(layer, "time_mix_decay_w2", e, decay),
        b.matrix(layer, "time_mix_key", kv_width, e),
        b.matrix(layer, "time_mix_value", kv_width, e),
        b.matrix(layer, "time_mix_receptance", e, e),
        b.matrix(layer, "time_mix_gate", e, e),
    ]
    return out


def rwkv6(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # RWKV-6 (Finch): LayerNorms with biases before time and channel mixing, the WKV-6 kernel
    # with a per-head bonus, group norm on its output, squared-ReLU channel mixing gated by r.
    e = spec.n_embd
    return [
        b.norm(layer, "attn_norm", e), b.bias(layer, "attn_norm", e),
        b.norm(layer, "attn_norm_2", e), b.bias(layer, "attn_norm_2", e),
        *_time_mix_v6(spec, layer, e, bonus=True),
        b.norm(layer, "time_mix_ln", e), b.bias(layer, "time_mix_ln", e),
        b.matrix(layer, "time_mix_output", e, e),
        _vector(layer, "channel_mix_lerp_k", 1, 1, e),
        _vector(layer, "channel_mix_lerp_r", 1, 1, e),
        b.matrix(layer, "channel_mix_key", spec.n_ff, e),
        b.matrix(layer, "channel_mix_value", e, spec.n_ff),
        b.matrix(layer, "channel_mix_receptance", e, e),
    ]


def rwkv6qwen2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # QRWKV-6: RMSNorm, RWKV-6 time mixing without the bonus (gated linear attention) whose
    # k/v are GQA-narrow (n_head_kv heads of wkv_head_size) with Qwen2's q/k/v biases, then
    # Qwen2's SwiGLU.
    e, kv = spec.n_embd, spec.n_head_kv * spec.wkv_head_size
    return [
        b.norm(layer, "attn_norm", e),
        *_time_mix_v6(spec, layer, kv, bonus=False),
        b.bias(layer, "time_mix_key", kv),
        b.bias(layer, "time_mix_value", kv),
        b.bias(layer, "time_mix_receptance", e),
        b.matrix(layer, "time_mix_output", e, e),
        *b.dense_ffn(spec, layer),
    ]


def _lfm2_mixer(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # An "operator norm", then either a gated short convolution (in_proj to b, c, x; a depthwise
    # causal conv of l_cache taps over b*x; c times that; out_proj) or GQA attention with
    # per-head q/k norms.
    e = spec.n_embd
    if layer not in spec.recurrent_layers:
        return b.attention(spec, layer, qk_norm="head")
    return [
        b.norm(layer, "attn_norm", e),
        _f32(layer, "shortconv.conv", e, spec.shortconv_l_cache),
        b.matrix(layer, "shortconv.in_proj", 3 * e, e),
        b.matrix(layer, "shortconv.out_proj", e, e),
    ]


def lfm2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # LFM2: the mixer, then a SwiGLU FFN.
    return _lfm2_mixer(spec, layer) + b.dense_ffn(spec, layer)


def lfm2moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # LFM2-MoE (8B-A1B): the mixer, then a dense FFN for the leading n_dense_lead blocks and
    # sigmoid-routed experts with a selection bias (renormalised top-k) for the others.
    if layer < spec.n_dense_lead:
        return _lfm2_mixer(spec, layer) + b.dense_ffn(spec, layer)
    return _lfm2_mixer(spec, layer) + b.moe_ffn(spec, layer, selection_bias=True)


# --- rules ---------------------------------------------------------------------------------


def wkv_heads(spec: "ModelSpec") -> str | None:
    # The WKV heads are n_embd / head_size wide; the loaders read n_head only for GQA k/v.
    size = spec.wkv_head_size
    if spec.n_embd % size or spec.n_head * size != spec.n_embd:
        return f"{spec.arch} needs n_head * wkv_head_size == n_embd, got {spec.n_head} * {size}"
    if spec.arch == "rwkv6" and spec.n_head_kv != spec.n_head:
        return "rwkv6 has no GQA: needs n_head_kv == n_head"
    return None


def hybrid_layers(spec: "ModelSpec") -> str | None:
    # Layers listed in recurrent_layers get head_count_kv 0 (llama.cpp: a recurrent layer).
    layers = spec.recurrent_layers
    if not isinstance(layers, tuple) or not all(type(il) is int for il in layers):
        return f"recurrent_layers must be a tuple of ints, got {layers!r}"
    if list(layers) != sorted(set(layers)) or not all(0 <= il < spec.n_layer for il in layers):
        return f"recurrent_layers must be distinct layer indices in increasing order, got {layers}"
    return None
