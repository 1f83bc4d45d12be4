# Block descriptions of the families whose stage boundary is wide (issues 25/26, patch 0012): a
# layer hands on more than the n_embd-wide hidden state, so a boundary row carries a sideband
# beside it. RWKV-7 (Goose) and ARWKV-7 (RWKV-7 time mixing in Qwen2.5 blocks): every layer mixes
# in the first layer's value projection (v_first).
#
# Strategy: like `blocks_rwkv.py`, each function returns one block's tensors in file order, named
# and shaped as llama.cpp's loader creates them (numpy order: the last axis is the input width).
# The low-rank and per-channel tensors llama.cpp's quantizer keeps in F32 (time_mix_w0/w1/w2,
# a0/a1/a2, v0/v1/v2, g1/g2, lerp_fused) are declared unquantized, so a Q8_0 file is what
# `llama-quantize` would make.
from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "arwkv7", "gemma3n_block", "gemma3n_inputs", "gemma3n_keys", "gemma3n_shape", "rwkv7", "two_token_shifts",
    "wkv7_head_width",
]


def _f32(layer: int, name: str, *shape: int) -> TensorDecl:
    return TensorDecl(b.blk(layer, name), tuple(shape), "matrix", False)


def _vector(layer: int, name: str, *shape: int) -> TensorDecl:
    """A per-channel parameter (lerp, decay, mix base) drawn like a norm weight: in [0.6, 1.4]."""
    return TensorDecl(b.blk(layer, name), tuple(shape), "norm", False)


def _time_mix_v7(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    """WKV-7 time mixing: decay w, in-context learning rate a, value-residual mix v and (where
    gate_lora_rank is set) the output gate g as low-rank updates over five or six fused lerps
    (layer 0's value is v_first, which the others mix in), r/k/v projections, group norm, output."""
    e, decay, iclr, gate = spec.n_embd, spec.decay_lora_rank, spec.iclr_lora_rank, spec.gate_lora_rank
    value_mix = iclr if layer == 0 else spec.value_residual_mix_lora_rank
    out = [
        _vector(layer, "time_mix_w0", e), _f32(layer, "time_mix_w1", decay, e), _f32(layer, "time_mix_w2", e, decay),
        _vector(layer, "time_mix_a0", e), _f32(layer, "time_mix_a1", iclr, e), _f32(layer, "time_mix_a2", e, iclr),
        _vector(layer, "time_mix_v0", e), _f32(layer, "time_mix_v1", value_mix, e),
        _f32(layer, "time_mix_v2", e, value_mix),
    ]
    if gate:
        out += [_f32(layer, "time_mix_g1", gate, e), _f32(layer, "time_mix_g2", e, gate)]
    return out + [
        _vector(layer, "time_mix_lerp_fused", 6 if gate else 5, 1, 1, e),
        _vector(layer, "time_mix_k_k", e), _vector(layer, "time_mix_k_a", e), _vector(layer, "time_mix_r_k", e),
        b.matrix(layer, "time_mix_key", e, e),
        b.matrix(layer, "time_mix_value", e, e),
        b.matrix(layer, "time_mix_receptance", e, e),
        b.norm(layer, "time_mix_ln", e), b.bias(layer, "time_mix_ln", e),
        b.matrix(layer, "time_mix_output", e, e),
    ]


def rwkv7(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # RWKV-7: LayerNorms with biases, gated WKV-7 time mixing, then squared-ReLU channel mixing.
    e = spec.n_embd
    return [
        b.norm(layer, "attn_norm", e), b.bias(layer, "attn_norm", e),
        b.norm(layer, "attn_norm_2", e), b.bias(layer, "attn_norm_2", e),
        *_time_mix_v7(spec, layer),
        _vector(layer, "channel_mix_lerp_k", 1, 1, e),
        b.matrix(layer, "channel_mix_key", spec.n_ff, e),
        b.matrix(layer, "channel_mix_value", e, spec.n_ff),
    ]


def arwkv7(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # ARWKV-7: RMSNorm, WKV-7 time mixing without the output gate (five lerps, as the distilled
    # models ship), then Qwen2's SwiGLU.
    return [b.norm(layer, "attn_norm", spec.n_embd), *_time_mix_v7(spec, layer), *b.dense_ffn(spec, layer)]


def two_token_shifts(spec: "ModelSpec") -> str | None:
    # RWKV-7 keeps two shifted rows per layer (time and channel mixing; its graph asserts 2).
    if spec.token_shift_count != 2:
        return f"{spec.arch} needs token_shift_count == 2"
    return None


def wkv7_head_width(spec: "ModelSpec") -> str | None:
    # ggml's CPU WKV-7 kernel walks a head in blocks of 32 (AVX2) or 64 (AVX-512) floats: a
    # narrower head reads past its end (the real models' heads are 64 wide).
    if spec.wkv_head_size % 64:
        return f"{spec.arch} needs wkv_head_size a multiple of 64 (ggml's WKV-7 kernel), got {spec.wkv_head_size}"
    return None


# --- Gemma 3n ------------------------------------------------------------------------------
# llama.cpp hard-codes Gemma 3n's AltUp and LAuReL shapes (src/llama-hparams.h): four AltUp
# streams (the active one first), per-layer inputs 256 wide, LAuReL rank 64.
GEMMA3N_ALTUP = 4
GEMMA3N_LAUREL_RANK = 64
GEMMA3N_PER_LAYER = 256


def gemma3n_is_swa(spec: "ModelSpec", layer: int) -> bool:
    """Layer ``layer`` is sliding-window (every ``swa_period``-th layer is global)."""
    return (layer + 1) % spec.swa_period != 0


def gemma3n_block(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Gemma 3n: AltUp prediction over the four streams, the active one through attention (q/k
    # norms, a weightless v norm) and LAuReL, a GeGLU MLP (activation sparsity in the first 10
    # layers), AltUp correction, then the per-layer input gated in.
    e, p, n = spec.n_embd, spec.n_embd_per_layer, GEMMA3N_ALTUP
    head = spec.n_embd_head
    q, kv = spec.n_head * head, spec.n_head_kv * head
    return [
        b.norm(layer, "attn_norm", e),
        b.matrix(layer, "attn_q", q, e), b.matrix(layer, "attn_k", kv, e), b.matrix(layer, "attn_v", kv, e),
        b.matrix(layer, "attn_output", e, q),
        b.norm(layer, "attn_q_norm", head), b.norm(layer, "attn_k_norm", head),
        b.norm(layer, "post_attention_norm", e),
        *b.dense_ffn(spec, layer, post_norm=True),
        b.matrix(layer, "inp_gate", p, e), b.matrix(layer, "proj", e, p), b.norm(layer, "post_norm", e),
        _f32(layer, "altup_correct_coef", n, n),
        _vector(layer, "altup_correct_scale", e),
        _f32(layer, "altup_predict_coef", n * n, n),
        _f32(layer, "altup_router", n, e),
        b.norm(layer, "altup_router_norm", e),
        b.matrix(layer, "laurel_l", GEMMA3N_LAUREL_RANK, e),
        b.matrix(layer, "laurel_r", e, GEMMA3N_LAUREL_RANK),
        b.norm(layer, "laurel_post_norm", e),
    ]


def gemma3n_inputs(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """AltUp's projections into and out of the extra streams, the per-layer token table, the
    projection of the token embeddings into the per-layer inputs and its norm."""
    e, width, extra = spec.n_embd, spec.n_embd_per_layer * spec.n_layer, GEMMA3N_ALTUP - 1
    return [
        TensorDecl("altup_proj.weight", (extra, e, e), "matrix", True),
        TensorDecl("altup_unembd_proj.weight", (extra, e, e), "matrix", True),
        TensorDecl("per_layer_token_embd.weight", (n_vocab, width), "matrix", True),
        TensorDecl("per_layer_model_proj.weight", (width, e), "matrix", True),
        TensorDecl("per_layer_proj_norm.weight", (spec.n_embd_per_layer,), "norm", False),
    ]


def gemma3n_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    return [("attention.sliding_window_pattern", [gemma3n_is_swa(spec, il) for il in range(spec.n_layer)],
             GGUFValueType.ARRAY)]


def gemma3n_shape(spec: "ModelSpec") -> str | None:
    if spec.n_embd_per_layer != GEMMA3N_PER_LAYER:
        return f"gemma3n's per-layer inputs are {GEMMA3N_PER_LAYER} wide (llama.cpp hard-codes it)"
    if spec.swa_period < 2:
        return "gemma3n needs swa_period >= 2 (its sliding-window pattern)"
    return None
