# Blocks and input-end tensors of the families issue 26's grown generator rules split (input
# transforms before the layer loop, loops written differently), for `families.py`.
#
# Strategy: as in `blocks.py`, each function returns tensors in file order with llama.cpp's
# names and shapes (numpy order: the last axis is the input width), built from the shared
# pieces; the input-end functions give the tensors a family's first stage alone loads (see
# `Family.inputs`).
from __future__ import annotations

from typing import TYPE_CHECKING

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = ["gpt2", "input_layer_norm", "mpt", "position_embedding"]


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
