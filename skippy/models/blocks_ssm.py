# Blocks of the state-space (Mamba) families, pure and hybrid (issue 25): the Mamba-1 and
# Mamba-2 mixers, the per-family blocks built from them, their shape rules and the per-layer
# keys of the hybrids.
#
# Strategy: as in `blocks.py`, each piece returns one sub-block's tensors in the order and the
# shapes (numpy order: last axis = input width) of llama.cpp's loaders (src/models/<arch>.cpp).
# A hybrid's layout is the spec's `layer_pattern`, one character per layer, in Nemotron-H's
# notation: "M" a Mamba mixer, "*" attention, "-" a dense MLP, "E" a mixture of experts. The
# loaders read the layout from per-layer arrays (a layer is recurrent when its head_count_kv is 0,
# and for Nemotron-H its feed_forward_length too), which `layer_keys` writes in place of the
# scalar keys. Values follow the converters: A = -exp(A_log) is negative (kind "decay"), the
# small conv1d kernels stay F32 (llama.cpp's quantizer never quantizes them), D and the dt bias
# are per channel (Mamba-1) or per head (Mamba-2).
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "MAMBA1",
    "MAMBA2",
    "mamba1_mixer",
    "mamba2_mixer",
    "mamba2_shape",
    "nemotron_h",
    "nemotron_h_keys",
    "pattern",
]

#: The hparams of a Mamba-1 mixer (mamba, jamba, falcon-mamba) and of a Mamba-2 one (groups).
MAMBA1: Final = frozenset({"ssm_d_conv", "ssm_d_inner", "ssm_d_state", "ssm_dt_rank"})
MAMBA2: Final = MAMBA1 | {"ssm_n_group"}

DerivedKey = tuple[str, object, GGUFValueType]
Rule = Callable[["ModelSpec"], "str | None"]


def _vector(layer: int, name: str, *shape: int, kind: str) -> TensorDecl:
    # ssm_a / ssm_d have no ".weight" suffix in llama.cpp's names
    return TensorDecl(f"blk.{layer}.{name}", tuple(shape), kind, False)  # type: ignore[arg-type]


def _conv(layer: int, channels: int, width: int) -> list[TensorDecl]:
    return [
        TensorDecl(b.blk(layer, "ssm_conv1d"), (channels, width), "matrix", False),
        b.bias(layer, "ssm_conv1d", channels),
    ]


def mamba1_mixer(spec: "ModelSpec", layer: int, *, bcdt_norms: bool = False) -> list[TensorDecl]:
    """Mamba-1: ssm_in (x and z), the causal conv over d_inner channels, ssm_x (dt, B, C),
    [dt/B/C RMSNorms: Jamba], ssm_dt (+bias), A (d_inner x d_state), D, ssm_out."""
    e, di, ds, dr = spec.n_embd, spec.ssm_d_inner, spec.ssm_d_state, spec.ssm_dt_rank
    out = [b.matrix(layer, "ssm_in", 2 * di, e), *_conv(layer, di, spec.ssm_d_conv)]
    out.append(b.matrix(layer, "ssm_x", dr + 2 * ds, di))
    if bcdt_norms:
        out.append(b.norm(layer, "ssm_dt_norm", dr))
    out += [b.matrix(layer, "ssm_dt", di, dr), b.bias(layer, "ssm_dt", di)]
    if bcdt_norms:
        out += [b.norm(layer, "ssm_b_norm", ds), b.norm(layer, "ssm_c_norm", ds)]
    out += [_vector(layer, "ssm_a", di, ds, kind="decay"), _vector(layer, "ssm_d", di, kind="norm")]
    return out + [b.matrix(layer, "ssm_out", e, di)]


def mamba2_mixer(spec: "ModelSpec", layer: int, *, norm: bool = True) -> list[TensorDecl]:
    """Mamba-2: ssm_in (z, x, B, C, dt: 2 d_inner + 2 groups x d_state + heads), the conv over
    x, B and C, the dt bias, A and D per head, the grouped RMSNorm, ssm_out."""
    e, di, ds, heads, groups = (
        spec.n_embd, spec.ssm_d_inner, spec.ssm_d_state, spec.ssm_dt_rank, spec.ssm_n_group
    )
    conv = di + 2 * groups * ds
    out = [b.matrix(layer, "ssm_in", di + conv + heads, e), *_conv(layer, conv, spec.ssm_d_conv)]
    out += [
        b.bias(layer, "ssm_dt", heads),
        _vector(layer, "ssm_a", heads, 1, kind="decay"),
        _vector(layer, "ssm_d", heads, 1, kind="norm"),
    ]
    if norm:
        out.append(TensorDecl(b.blk(layer, "ssm_norm"), (groups, di // groups), "norm", False))
    return out + [b.matrix(layer, "ssm_out", e, di)]


# --- families --------------------------------------------------------------------------------


def nemotron_h(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Every block is one RMSNorm and one mixer: Mamba-2, attention (no rope, no biases) or a
    # squared-ReLU MLP without a gate.
    kind = spec.layer_pattern[layer]
    out = [b.norm(layer, "attn_norm", spec.n_embd)]
    if kind == "M":
        return out + mamba2_mixer(spec, layer)
    if kind == "*":
        return out + b.attention(spec, layer, pre_norm=False)
    return out + b.dense_ffn(spec, layer, pre_norm=False, gated=False)


def layer_keys(spec: "ModelSpec", *, ffn: str) -> list[DerivedKey]:
    """head_count_kv per layer (0 on all but "*" layers) and, when ``ffn`` names the pattern
    characters that have a feed-forward, feed_forward_length per layer (0 elsewhere)."""
    kv = [spec.n_head_kv if kind == "*" else 0 for kind in spec.layer_pattern]
    keys: list[DerivedKey] = [("attention.head_count_kv", kv, GGUFValueType.ARRAY)]
    if ffn:
        width = spec.n_ff_exp or spec.n_ff
        ff = [width if kind in ffn else 0 for kind in spec.layer_pattern]
        keys.append(("feed_forward_length", ff, GGUFValueType.ARRAY))
    return keys


def nemotron_h_keys(spec: "ModelSpec") -> list[DerivedKey]:
    # the loader: a layer is recurrent iff its head_count_kv and feed_forward_length are both 0
    return layer_keys(spec, ffn="-E")


# --- rules -----------------------------------------------------------------------------------


def pattern(kinds: str) -> Rule:
    """The layer pattern has one of ``kinds`` per layer."""

    def rule(spec: "ModelSpec") -> str | None:
        layout = spec.layer_pattern
        if not isinstance(layout, str) or len(layout) != spec.n_layer or set(layout) - set(kinds):
            return (
                f"{spec.arch} needs layer_pattern: one of {kinds!r} per layer "
                f"({spec.n_layer}), got {spec.layer_pattern!r}"
            )
        return None

    return rule


def mamba2_shape(spec: "ModelSpec") -> str | None:
    # heads (time_step_rank) and groups both divide d_inner
    if spec.ssm_d_inner % spec.ssm_dt_rank or spec.ssm_d_inner % spec.ssm_n_group:
        return (
            f"{spec.arch} needs ssm_d_inner ({spec.ssm_d_inner}) divisible by ssm_dt_rank "
            f"({spec.ssm_dt_rank}, the heads) and ssm_n_group ({spec.ssm_n_group})"
        )
    return None
