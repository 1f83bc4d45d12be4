# Building blocks of the per-architecture block descriptions in `families.py`: the tensor
# declaration type, the shared sub-blocks (attention, dense feed-forward, mixture of experts)
# with their per-family switches, and the shape rules several families share.
#
# Strategy: each piece returns the tensors of one sub-block of one layer in file order, as
# llama.cpp's loaders name and shape them (numpy order: the last axis is the input width). A
# family's block is a concatenation of pieces; what differs between families is which switches
# it turns on (biases, fused q/k/v, q/k norms, post-norms, sinks, shared experts, ...). Rules
# take a spec and return an error message or None.
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, final

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "TensorDecl",
    "TensorKind",
    "attention",
    "bias",
    "blk",
    "coupled_heads",
    "dense_ffn",
    "dense_lead_below_n_layer",
    "experts",
    "full_rope",
    "matrix",
    "mha",
    "mla",
    "moe_ffn",
    "norm",
    "temperature",
    "window",
    "yarn",
]
#: What a tensor is; decides its initialisation (see synthetic.py) and, with `quantized`, its type.
#: embedding: token table; matrix: a projection (2-D, or 3-D stacked experts); norm: RMSNorm
#: weight; bias: additive bias (any rank); router: expert-gating projection (kept F32, as
#: llama.cpp's converter and quantizer keep ``ffn_gate_inp``); vector: a 1-D weight used as a
#: dot product (qwen2moe's shared-expert gate); sink: gpt-oss per-head attention sink logits;
#: decay: a recurrent layer's negative decay, A = -exp(A_log) (Mamba's per channel, delta-net's and
#: Mamba-2's per head ``ssm_a``), so the recurrent state decays; expert_ids: an I32 table of expert
#: ids per token (DeepSeek V4's hash routing: each row distinct experts of n_expert).
TensorKind = Literal["embedding", "matrix", "norm", "bias", "router", "vector", "sink", "decay", "expert_ids"]


@final
@dataclass(frozen=True, slots=True)
class TensorDecl:
    """One tensor of a model as its family declares it.

    Attributes:
        name: GGUF tensor name.
        shape: numpy shape (last axis = input width).
        kind: see `TensorKind`.
        quantized: stored in the spec's weight dtype (else always F32).
    """

    name: str
    shape: tuple[int, ...]
    kind: TensorKind
    quantized: bool


# --- shared pieces ---------------------------------------------------------------------------


def blk(layer: int, name: str, suffix: str = "weight") -> str:
    return f"blk.{layer}.{name}.{suffix}"


def matrix(layer: int, name: str, out_width: int, in_width: int) -> TensorDecl:
    return TensorDecl(blk(layer, name), (out_width, in_width), "matrix", True)


def norm(layer: int, name: str, width: int) -> TensorDecl:
    return TensorDecl(blk(layer, name), (width,), "norm", False)


def bias(layer: int, name: str, *shape: int) -> TensorDecl:
    return TensorDecl(blk(layer, name, "bias"), tuple(shape), "bias", False)


def attention(
    spec: "ModelSpec",
    layer: int,
    *,
    pre_norm: bool = True,
    norm_bias: bool = False,
    qkv_bias: bool = False,
    fused_qkv: bool = False,
    qk_norm: Literal["none", "head", "full"] = "none",
    out_bias: bool = False,
    sinks: bool = False,
    post_norm: bool = False,
) -> list[TensorDecl]:
    """The attention sub-block: [attn_norm], q/k/v (or fused qkv) [+biases], [q/k norms],
    attn_output [+bias], [attn_sinks], [post_attention_norm]."""
    out: list[TensorDecl] = []
    if pre_norm:
        out.append(norm(layer, "attn_norm", spec.n_embd))
        if norm_bias:
            out.append(bias(layer, "attn_norm", spec.n_embd))
    if fused_qkv:
        out.append(matrix(layer, "attn_qkv", spec.n_q + 2 * spec.n_kv, spec.n_embd))
        if qkv_bias:
            out.append(bias(layer, "attn_qkv", spec.n_q + 2 * spec.n_kv))
    else:
        for name, width in (("attn_q", spec.n_q), ("attn_k", spec.n_kv), ("attn_v", spec.n_kv)):
            out.append(matrix(layer, name, width, spec.n_embd))
            if qkv_bias:
                out.append(bias(layer, name, width))
    if qk_norm == "head":
        out.append(norm(layer, "attn_q_norm", spec.n_embd_head))
        out.append(norm(layer, "attn_k_norm", spec.n_embd_head))
    elif qk_norm == "full":  # OLMo 2 / OLMoE normalise the whole q and k projections
        out.append(norm(layer, "attn_q_norm", spec.n_q))
        out.append(norm(layer, "attn_k_norm", spec.n_kv))
    out.append(matrix(layer, "attn_output", spec.n_embd, spec.n_q))
    if out_bias:
        out.append(bias(layer, "attn_output", spec.n_embd))
    if sinks:
        out.append(TensorDecl(blk(layer, "attn_sinks"), (spec.n_head,), "sink", False))
    if post_norm:
        out.append(norm(layer, "post_attention_norm", spec.n_embd))
    return out


def dense_ffn(
    spec: "ModelSpec",
    layer: int,
    *,
    pre_norm: bool = True,
    fused_up: bool = False,
    post_norm: bool = False,
    gated: bool = True,
    biases: bool = False,
) -> list[TensorDecl]:
    """The feed-forward: [ffn_norm], gate, up, down (SwiGLU / GeGLU; or up = [gate; up] fused,
    as phi3 and glm4 store it; or no gate, as starcoder2's GELU MLP), [post_ffw_norm].
    ``biases`` adds the norm's bias and the projections' (starcoder2)."""
    out: list[TensorDecl] = []
    if pre_norm:
        out.append(norm(layer, "ffn_norm", spec.n_embd))
        if biases:
            out.append(bias(layer, "ffn_norm", spec.n_embd))
    if fused_up:
        out.append(matrix(layer, "ffn_up", 2 * spec.n_ff, spec.n_embd))
    else:
        if gated:
            out.append(matrix(layer, "ffn_gate", spec.n_ff, spec.n_embd))
        out.append(matrix(layer, "ffn_up", spec.n_ff, spec.n_embd))
        if biases:
            out.append(bias(layer, "ffn_up", spec.n_ff))
    out.append(matrix(layer, "ffn_down", spec.n_embd, spec.n_ff))
    if biases:
        out.append(bias(layer, "ffn_down", spec.n_embd))
    if post_norm:
        out.append(norm(layer, "post_ffw_norm", spec.n_embd))
    return out


def moe_ffn(
    spec: "ModelSpec",
    layer: int,
    *,
    pre_norm: bool = True,
    router_bias: bool = False,
    expert_bias: bool = False,
    selection_bias: bool = False,
    shared: Literal["none", "gated", "plain", "own"] = "none",
    expert_width: int = 0,
) -> list[TensorDecl]:
    """The mixture-of-experts feed-forward: [ffn_norm], router ffn_gate_inp (F32) [+bias],
    [exp_probs_b selection bias], merged 3-D gate/up/down experts [+2-D biases], then the
    shared expert: "gated" (qwen2moe: a sigmoid gate vector plus its own width n_ff_shexp),
    "plain" (glm4moe/deepseek2: n_expert_shared * n_ff_exp wide) or "own" (ernie4_5-moe: its
    own width n_ff_shexp, no gate). ``expert_width`` replaces
    n_ff_exp where the loader sizes experts by feed_forward_length (olmoe)."""
    n_exp, n_ff_exp, n_embd = spec.n_expert, expert_width or spec.n_ff_exp, spec.n_embd
    out: list[TensorDecl] = []
    if pre_norm:
        out.append(norm(layer, "ffn_norm", n_embd))
    out.append(TensorDecl(blk(layer, "ffn_gate_inp"), (n_exp, n_embd), "router", False))
    if router_bias:
        out.append(bias(layer, "ffn_gate_inp", n_exp))
    if selection_bias:
        out.append(bias(layer, "exp_probs_b", n_exp))
    for name, rows, cols, bias_width in (
        ("ffn_gate_exps", n_ff_exp, n_embd, n_ff_exp),
        ("ffn_up_exps", n_ff_exp, n_embd, n_ff_exp),
        ("ffn_down_exps", n_embd, n_ff_exp, n_embd),
    ):
        out.append(TensorDecl(blk(layer, name), (n_exp, rows, cols), "matrix", True))
        if expert_bias:
            out.append(bias(layer, name, n_exp, bias_width))
    if shared == "gated":
        width = spec.n_ff_shexp
        out.append(TensorDecl(blk(layer, "ffn_gate_inp_shexp"), (n_embd,), "vector", False))
    elif shared == "plain":
        width = spec.n_expert_shared * n_ff_exp
    elif shared == "own" and spec.n_ff_shexp:
        width = spec.n_ff_shexp
    else:
        return out
    out.append(matrix(layer, "ffn_gate_shexp", width, n_embd))
    out.append(matrix(layer, "ffn_up_shexp", width, n_embd))
    out.append(matrix(layer, "ffn_down_shexp", n_embd, width))
    return out


# --- rules ---------------------------------------------------------------------------------


def coupled_heads(spec: "ModelSpec") -> str | None:
    # These loaders shape q and attn_output as n_embd x n_embd.
    if spec.n_q != spec.n_embd:
        return (
            f"{spec.arch} needs n_head * head_dim == n_embd, got {spec.n_head} * "
            f"{spec.n_embd_head} != {spec.n_embd}"
        )
    return None


def mha(spec: "ModelSpec") -> str | None:
    # OLMoE's loader shapes k/v and the k norm as n_embd wide.
    if spec.n_head_kv != spec.n_head:
        return f"{spec.arch} needs n_head_kv == n_head"
    return None


def full_rope(spec: "ModelSpec") -> str | None:
    # gpt-oss shapes its projections with n_rot, so the rotary width must be the head width.
    if spec.n_rot != spec.n_embd_head:
        return f"{spec.arch} needs rope_dim == head_dim"
    return None


def mla(spec: "ModelSpec") -> str | None:
    # DeepSeek-V2/V3 multi-head latent attention, as converted today: one shared latent KV head,
    # per-head key width head_dim = qk_nope + qk_rope with rope_dim = qk_rope.
    if spec.n_head_kv != 1:
        return "deepseek2 (MLA) needs n_head_kv == 1 (one shared latent KV head)"
    if not 0 < spec.n_rot < spec.n_embd_head:
        return "deepseek2 needs 0 < rope_dim < head_dim (head_dim = qk_nope + qk_rope)"
    return None


def dense_lead_below_n_layer(spec: "ModelSpec") -> str | None:
    if spec.n_dense_lead >= spec.n_layer:
        return f"n_dense_lead ({spec.n_dense_lead}) must be below n_layer ({spec.n_layer})"
    return None


def experts(spec: "ModelSpec") -> str | None:
    if spec.n_expert and not 0 < spec.n_expert_used <= spec.n_expert:
        return f"n_expert_used must be in 1..n_expert ({spec.n_expert}), got {spec.n_expert_used}"
    if spec.expert_gating not in (0, 1, 2):
        return f"expert_gating must be 1 (softmax) or 2 (sigmoid), got {spec.expert_gating}"
    return None


def window(spec: "ModelSpec") -> str | None:
    if spec.swa_pattern and not spec.sliding_window:
        return "swa_pattern needs sliding_window"
    return None


def yarn(spec: "ModelSpec") -> str | None:
    if spec.rope_scaling not in ("", "yarn"):
        return f"rope_scaling must be '' or 'yarn', got {spec.rope_scaling!r}"
    if spec.rope_scaling and not spec.rope_scaling_factor > 0:
        return "rope_scaling 'yarn' needs rope_scaling_factor > 0"
    return None


def temperature(spec: "ModelSpec") -> str | None:
    if spec.attn_temp_scale and not spec.rope_orig_ctx:
        # llama.cpp floors positions by n_ctx_orig_yarn for the attention temperature.
        return "attn_temp_scale needs rope_orig_ctx"
    return None
