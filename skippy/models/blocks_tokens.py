# Blocks of the families whose later stages read the token ids beside the hidden state (issue 26,
# patch 0010): Talkie's layers add the normalised input embedding (an embedding skip), CogVLM's pick
# text or vision-expert weights by whether the batch holds tokens.
#
# Strategy: the shared pieces of `blocks.py` with the families' own extras, named and shaped as
# src/models/talkie.cpp and cogvlm.cpp load them (numpy order: the last axis is the input width).
from __future__ import annotations

from typing import TYPE_CHECKING

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = ["cogvlm", "cogvlm_shape", "talkie"]


def talkie(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Weightless RMS norms everywhere; a per-head query gain (no key gain) after rope; each
    # layer's output adds the normalised input embedding times its own scalar scale.
    return (
        b.attention(spec, layer, pre_norm=False)
        + [TensorDecl(b.blk(layer, "attn_q_norm"), (spec.n_head, 1), "norm", False)]
        + b.dense_ffn(spec, layer, pre_norm=False)
        + [TensorDecl(b.blk(layer, "layer_output_scale"), (1,), "norm", False)]
    )


def cogvlm(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Text weights (fused q/k/v) and the vision expert's copy of the attention and the MLP; a text
    # batch uses the former on every layer.
    n = spec.n_embd
    return b.attention(spec, layer, fused_qkv=True) + b.dense_ffn(spec, layer) + [
        b.matrix(layer, "vis_attn_qkv", 3 * n, n),
        b.matrix(layer, "vis_attn_output", n, n),
        b.matrix(layer, "vis_gate", spec.n_ff, n),
        b.matrix(layer, "vis_down", n, spec.n_ff),
        b.matrix(layer, "vis_up", spec.n_ff, n),
    ]


def cogvlm_shape(spec: "ModelSpec") -> str | None:
    # The graph views q, k and v out of the fused projection at offsets n_embd and 2 n_embd.
    if spec.n_head_kv != spec.n_head or spec.n_q != spec.n_embd:
        return "cogvlm needs n_head_kv == n_head and n_head * head_dim == n_embd (MHA over n_embd)"
    return None
