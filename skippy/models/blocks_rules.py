# Blocks and input-end tensors of the families issue 26's grown generator rules split (input
# transforms before the layer loop, loops written differently), for `families.py`.
#
# Strategy: as in `blocks.py`, each function returns tensors in file order with llama.cpp's
# names and shapes (numpy order: the last axis is the input width), built from the shared
# pieces; the input-end functions give the tensors a family's first stage alone loads (see
# `Family.inputs`).
from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "afmoe", "alternating_window_layers", "bitnet", "deepseek2_ocr", "gpt2", "granite_swa", "granitemoe", "input_layer_norm", "jais2", "mimo2", "minicpm3", "minicpm3_kv_rank", "mpt", "muse_glimmer", "parallel_residual", "partial_rope", "phimoe",
    "position_embedding",
]


def position_embedding(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """GPT-2 / StarCoder's learned absolute positions: one row per trained position."""
    del n_vocab
    return [TensorDecl("position_embd.weight", (spec.context_length, spec.n_embd), "embedding", True)]


def input_layer_norm(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """BLOOM's LayerNorm of the token embeddings (``word_embeddings_layernorm``)."""
    del n_vocab
    return [
        TensorDecl("token_embd_norm.weight", (spec.n_embd,), "norm", False),
        TensorDecl("token_embd_norm.bias", (spec.n_embd,), "bias", False),
    ]


def gpt2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # GPT-2 / StarCoder / BLOOM: LayerNorms with biases, fused q/k/v, biases on every
    # projection, a GELU MLP without a gate.
    return b.attention(
        spec, layer, norm_bias=True, fused_qkv=True, qkv_bias=True, out_bias=True
    ) + b.dense_ffn(spec, layer, gated=False, biases=True)


def mpt(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # MPT (no_bias): bias-free LayerNorms, fused q/k/v, GELU MLP.
    return b.attention(spec, layer, fused_qkv=True) + b.dense_ffn(spec, layer, gated=False)


def jais2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Jais 2: LayerNorms with biases, separate q/k/v with biases, a gate-less MLP with biases.
    return b.attention(spec, layer, norm_bias=True, qkv_bias=True, out_bias=True) + b.dense_ffn(
        spec, layer, gated=False, biases=True
    )


def granitemoe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Granite MoE: llama attention, softmax experts as wide as n_ff, the shared expert of
    # Granite MoE-shared when n_ff_shexp is set.
    return b.attention(spec, layer) + b.moe_ffn(spec, layer, shared="own", expert_width=spec.n_ff)


def phimoe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Phi-3.5-MoE: norms with biases, q/k/v and output biases, softmax experts of width n_ff.
    out = b.attention(spec, layer, norm_bias=True, qkv_bias=True, out_bias=True)
    out += [b.norm(layer, "ffn_norm", spec.n_embd), b.bias(layer, "ffn_norm", spec.n_embd)]
    return out + b.moe_ffn(spec, layer, pre_norm=False, expert_width=spec.n_ff)


def parallel_residual(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    """GPT-NeoX's ``use_parallel_residual`` (required by its loader): true, as in Pythia."""
    del spec
    return [("use_parallel_residual", True, GGUFValueType.BOOL)]


def muse_glimmer(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Muse Glimmer: per-head q/k norms, post-norms, an attention-output gate read from the
    # block's normed input (n_head * head_dim wide).
    return (
        b.attention(spec, layer, qk_norm="head", post_norm=True)
        + [b.matrix(layer, "attn_gate", spec.n_q, spec.n_embd)]
        + b.dense_ffn(spec, layer, post_norm=True)
    )


def deepseek2_ocr(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # DeepSeek-OCR's decoder: llama attention (no MLA), n_dense_lead dense blocks, then softmax
    # experts with n_expert_shared shared experts as wide as an expert each.
    attention = b.attention(spec, layer)
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, shared="plain")


def afmoe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # AFM MoE: Muse Glimmer's gated attention with post-norms; the FFN (dense for the first
    # n_dense_lead blocks, then sigmoid experts with a selection bias and shared experts) sits
    # between ffn_norm and post_ffw_norm.
    attention = b.attention(spec, layer, qk_norm="head", post_norm=True)
    attention.append(b.matrix(layer, "attn_gate", spec.n_q, spec.n_embd))
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer, post_norm=True)
    experts = b.moe_ffn(spec, layer, selection_bias=True, shared="plain")
    return attention + experts + [b.norm(layer, "post_ffw_norm", spec.n_embd)]


def granite_swa(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Granite 4 (iSWA): llama attention with per-head sinks, a dense SwiGLU FFN.
    return b.attention(spec, layer, sinks=True) + b.dense_ffn(spec, layer)


def alternating_window_layers(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    """granite_swa's per-layer ``attention.sliding_window_pattern`` (an array its loader requires):
    even layers sliding-window, odd ones global."""
    return [("attention.sliding_window_pattern", [il % 2 == 0 for il in range(spec.n_layer)], GGUFValueType.ARRAY)]


def mimo2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # MiMo-V2-Flash: attention with sinks; n_dense_lead dense SwiGLU blocks (the loader has no
    # key for it: the graph tells them by a missing router), then sigmoid experts with a
    # selection bias.
    attention = b.attention(spec, layer, sinks=True)
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, selection_bias=True)


def _minicpm3_kv_rank(spec: "ModelSpec") -> int:
    # Kept out of ModelSpec.kv_lora_rank on purpose: that field means deepseek2's absorbed MLA,
    # whose cache is the latent (key_length = kv_lora_rank + rope); MiniCPM3 decompresses kv_b and
    # caches whole heads (key_length = value_length = head_dim).
    return spec.n_embd // 2


def minicpm3_kv_rank(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    """MiniCPM3's ``attention.kv_lora_rank`` (required by its loader): n_embd / 2."""
    return [("attention.kv_lora_rank", _minicpm3_kv_rank(spec), GGUFValueType.UINT32)]


def partial_rope(spec: "ModelSpec") -> str | None:
    # MiniCPM3 splits each key into a rotated part (rope_dim) and an unrotated one.
    if not 0 < spec.n_rot < spec.n_embd_head:
        return f"{spec.arch} needs 0 < rope_dim < head_dim"
    return None


def minicpm3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # MiniCPM3: q = q_b(norm(q_a(x))); [kv latent; shared rope key] = kv_a_mqa(x), per-head
    # [k_nope; v] = kv_b(norm(latent)); values as wide as keys (head_dim).
    e, heads, head, q_rank, kv_rank = spec.n_embd, spec.n_head, spec.n_embd_head, spec.q_lora_rank, _minicpm3_kv_rank(spec)
    nope = head - spec.n_rot
    return [
        b.norm(layer, "attn_norm", e),
        b.norm(layer, "attn_q_a_norm", q_rank),
        b.norm(layer, "attn_kv_a_norm", kv_rank),
        b.matrix(layer, "attn_q_a", q_rank, e),
        b.matrix(layer, "attn_q_b", heads * head, q_rank),
        b.matrix(layer, "attn_kv_a_mqa", kv_rank + spec.n_rot, e),
        b.matrix(layer, "attn_kv_b", heads * (nope + head), kv_rank),
        b.matrix(layer, "attn_output", e, heads * head),
    ] + b.dense_ffn(spec, layer)


def bitnet(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # BitNet b1.58: llama's projections with an RMS sub-norm on the attention output (before
    # attn_output) and on the gated FFN activation (before ffn_down, n_ff wide).
    e = spec.n_embd
    return [
        b.norm(layer, "attn_norm", e),
        b.norm(layer, "attn_sub_norm", e),
        b.matrix(layer, "attn_q", spec.n_q, e),
        b.matrix(layer, "attn_k", spec.n_kv, e),
        b.matrix(layer, "attn_v", spec.n_kv, e),
        b.matrix(layer, "attn_output", e, spec.n_q),
        b.norm(layer, "ffn_norm", e),
        b.norm(layer, "ffn_sub_norm", spec.n_ff),
        b.matrix(layer, "ffn_gate", spec.n_ff, e),
        b.matrix(layer, "ffn_down", e, spec.n_ff),
        b.matrix(layer, "ffn_up", spec.n_ff, e),
    ]
