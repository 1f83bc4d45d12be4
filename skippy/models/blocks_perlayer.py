# Blocks of the families with per-layer token embeddings and cross-layer KV sharing (issue 26):
# Gemma 4 (E2B / E4B layout: dense GeGLU, per-layer inputs, sliding-window and global layers of
# different head widths, trailing layers that reuse the KV of earlier ones; the 31B without
# per-layer inputs; the 26B-A4B with experts beside the dense MLP).
#
# Strategy: as `blocks.py`, pieces returning one layer's tensors in file order, named and shaped
# as llama.cpp's loader (src/models/gemma4.cpp) creates them; the model-wide per-layer tensors
# (the token table, its projection and norm, the global layers' rope frequencies) are the
# family's `inputs`, written after ``token_embd``. Families are assembled in `families.py`.
from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = ["gemma4_block", "gemma4_inputs", "gemma4_keys", "gemma4_shape", "gemma4_is_swa"]


def gemma4_is_swa(spec: "ModelSpec", layer: int) -> bool:
    """Layer ``layer`` is sliding-window (every ``swa_period``-th layer is global)."""
    return (layer + 1) % spec.swa_period != 0


def gemma4_has_kv(spec: "ModelSpec", layer: int) -> bool:
    """The layer computes its own K/V (the last ``n_kv_shared_layers`` reuse earlier ones')."""
    return layer < spec.n_layer - spec.n_kv_shared_layers


def gemma4_block(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    head = spec.head_dim_swa if gemma4_is_swa(spec, layer) else spec.n_embd_head
    q, kv, e, p = spec.n_head * head, spec.n_head_kv * head, spec.n_embd, spec.n_embd_per_layer
    out = [b.norm(layer, "attn_norm", e), b.matrix(layer, "attn_q", q, e)]
    if gemma4_has_kv(spec, layer):
        out += [b.matrix(layer, "attn_k", kv, e), b.matrix(layer, "attn_v", kv, e)]
    out += [b.matrix(layer, "attn_output", e, q), b.norm(layer, "attn_q_norm", head)]
    if gemma4_has_kv(spec, layer):
        out.append(b.norm(layer, "attn_k_norm", head))
    out += [
        b.norm(layer, "post_attention_norm", e),
        b.norm(layer, "layer_output_scale", 1),
        *b.dense_ffn(spec, layer, post_norm=True),
    ]
    if spec.n_expert:  # 26B-A4B: experts beside the dense MLP (its shared expert), own norms
        out += [
            TensorDecl(b.blk(layer, "ffn_gate_inp"), (spec.n_expert, e), "router", False),
            TensorDecl(b.blk(layer, "ffn_gate_inp", "scale"), (e,), "norm", False),
            b.norm(layer, "pre_ffw_norm_2", e),
            b.norm(layer, "post_ffw_norm_1", e),
            b.norm(layer, "post_ffw_norm_2", e),
            *b.moe_ffn(spec, layer, pre_norm=False)[1:],  # the experts (the router is above)
        ]
    if p:  # per-layer token embeddings (E2B / E4B; the 31B has none)
        out += [b.matrix(layer, "inp_gate", p, e), b.matrix(layer, "proj", e, p), b.norm(layer, "post_norm", e)]
    return out


def gemma4_inputs(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """The per-layer token table (n_vocab x n_layer slices), the projection of the token
    embeddings into the per-layer inputs and its norm, and the global layers' rope frequencies."""
    width = spec.n_embd_per_layer * spec.n_layer
    rope = [TensorDecl("rope_freqs.weight", (spec.n_embd_head // 2,), "norm", False)]
    if not width:
        return rope
    return [
        TensorDecl("per_layer_token_embd.weight", (n_vocab, width), "matrix", True),
        TensorDecl("per_layer_model_proj.weight", (width, spec.n_embd), "matrix", True),
        TensorDecl("per_layer_proj_norm.weight", (spec.n_embd_per_layer,), "norm", False),
        *rope,
    ]


def gemma4_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    # the loader reads embedding_length_per_layer_input unconditionally: 0 when there are none
    none = [] if spec.n_embd_per_layer else [("embedding_length_per_layer_input", 0, GGUFValueType.UINT32)]
    return none + [
        ("attention.sliding_window_pattern", [gemma4_is_swa(spec, il) for il in range(spec.n_layer)],
         GGUFValueType.ARRAY),
        ("attention.value_length_swa", spec.head_dim_swa, GGUFValueType.UINT32),
        ("rope.dimension_count_swa", spec.head_dim_swa, GGUFValueType.UINT32),
    ]


def gemma4_shape(spec: "ModelSpec") -> str | None:
    if spec.swa_period < 2:
        return "gemma4 needs swa_period >= 2 (its sliding-window pattern)"
    if spec.head_dim_swa % 2 or spec.n_embd_head % 4:
        return "gemma4 needs even head widths (rope) and a global head width divisible by 4"
    if spec.n_kv_shared_layers:
        kv_layers = spec.n_layer - spec.n_kv_shared_layers
        if kv_layers < 2 or not (gemma4_is_swa(spec, kv_layers - 2) and not gemma4_is_swa(spec, kv_layers - 1)):
            return ("gemma4's KV sharing needs the last two KV layers to be a sliding-window one "
                    "then a global one (the layers the shared ones read)")
    return None
