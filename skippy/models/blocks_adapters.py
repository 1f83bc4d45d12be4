# Blocks of the families whose layers switch LoRA adapters per token (issue 26): Granite Switch
# (granite layers with a fused q/k/v projection, and on every projection a stack of LoRA deltas,
# one per adapter slot, of which a router picks one per token from the token ids).
#
# Strategy: as `blocks.py`, pieces returning one layer's tensors in file order, named and shaped as
# llama.cpp's loader (src/models/granite-switch.cpp) creates them; the adapter table (the token
# that activates each adapter and the id it is embedded as) is written by `graniteswitch_keys`.
from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = ["graniteswitch_block", "graniteswitch_keys", "graniteswitch_shape"]


def _lora(layer: int, name: str, n_out: int, n_in: int, spec: "ModelSpec") -> list[TensorDecl]:
    # slot 0 is the base model's (the router's answer before any adapter token), then one per adapter
    slots, rank = spec.adapter_count + 1, spec.adapter_lora_rank
    return [
        TensorDecl(b.blk(layer, name, "lora_a"), (slots, rank, n_in), "matrix", True),
        TensorDecl(b.blk(layer, name, "lora_b"), (slots, n_out, rank), "matrix", True),
    ]


def graniteswitch_block(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    e, q, kv, ff = spec.n_embd, spec.n_q, spec.n_kv, spec.n_ff
    return (
        b.attention(spec, layer, fused_qkv=True)
        + b.dense_ffn(spec, layer)
        + _lora(layer, "attn_q", q, e, spec) + _lora(layer, "attn_k", kv, e, spec)
        + _lora(layer, "attn_v", kv, e, spec) + _lora(layer, "attn_output", e, q, spec)
        + _lora(layer, "ffn_gate", ff, e, spec) + _lora(layer, "ffn_up", ff, e, spec)
        + _lora(layer, "ffn_down", e, ff, spec)
    )


def graniteswitch_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    return [
        ("adapters.token_ids_activate", list(spec.adapter_tokens), GGUFValueType.ARRAY),
        ("adapters.token_ids_substitute", list(spec.adapter_substitutes), GGUFValueType.ARRAY),
    ]


def graniteswitch_shape(spec: "ModelSpec") -> str | None:
    n = spec.adapter_count
    if len(spec.adapter_tokens) != n or len(spec.adapter_substitutes) != n:
        return (f"graniteswitch needs one activating token and one substitute per adapter "
                f"({n} adapters, {len(spec.adapter_tokens)} tokens, {len(spec.adapter_substitutes)} substitutes)")
    if len(set(spec.adapter_tokens)) != n:
        return "graniteswitch's adapter tokens must differ (each activates one adapter)"
    if spec.n_embd_head != spec.n_rot:
        return "graniteswitch rotates whole heads (its graph asserts head_dim == rope_dim)"
    return None
