# Per-architecture descriptions of synthetic models: which hparams a family needs and which
# tensors each of its blocks holds, as llama.cpp's loader for that architecture expects them.
#
# Strategy: a `Family` is data, not code paths spread through the writer (the shared pieces its
# blocks are built from live in `blocks.py`). It names
# - the head options its loader accepts (`heads`: tied, untied or both),
# - the optional `ModelSpec` fields it requires / permits (`requires`, `permits`); every such
#   field maps to one GGUF key (`OPTIONAL_KEYS`), written only when the field is set, so a spec
#   of one family can never carry another family's keys by accident,
# - a `block(spec, layer)` function returning that block's tensors in file order, built from a
#   few shared pieces (attention, dense FFN, mixture of experts) with per-family switches
#   (biases, fused q/k/v, q/k norms, post-norms, attention sinks, shared experts, ...),
# - extra shape rules (`rules`), e.g. "n_head * head_dim must equal n_embd" where the loader
#   shapes attention as n_embd x n_embd,
# - and the rare extras: keys computed from several fields (`derived_keys`, deepseek2's MLA key
#   width) and the ends of the model that differ (`output_norm_bias`, `output_norm`,
#   `output_bias`: starcoder2/stablelm/phi2 LayerNorm biases, OLMo 1's weightless norms, phi2's
#   head bias).
# The shapes are numpy (row-major) order: the last axis is the input width (fan_in) and the one
# Q8_0 blocks run along; ggml's `ne` is the reverse. 3-D expert tensors are (n_expert, out, in).
# Names and keys are the strings of llama.cpp's src/llama-arch.cpp (tests check them against the
# pinned tree). The llama/qwen2/qwen3 blocks are exactly what the writer produced before this
# module existed (same tensors, same order), so their files keep their bytes.
#
# Which real checkpoints each description follows is said in its `summary`.
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models import blocks_perlayer as bp
from skippy.models.blocks import TensorDecl, TensorKind

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "FAMILIES",
    "Family",
    "OPTIONAL_KEYS",
    "OptionalKey",
    "TensorDecl",
    "TensorKind",
    "family",
    "quantized_rows",
]


@final
@dataclass(frozen=True, slots=True)
class OptionalKey:
    """A GGUF hparam key written from one optional `ModelSpec` field when that field is set."""

    suffix: str  # the key without the "<arch>." prefix
    type: GGUFValueType


#: Optional spec field -> the key it is written to (only when non-zero / true / non-empty).
OPTIONAL_KEYS: Final[dict[str, OptionalKey]] = {
    "n_expert": OptionalKey("expert_count", GGUFValueType.UINT32),
    "n_expert_used": OptionalKey("expert_used_count", GGUFValueType.UINT32),
    "n_ff_exp": OptionalKey("expert_feed_forward_length", GGUFValueType.UINT32),
    "n_ff_shexp": OptionalKey("expert_shared_feed_forward_length", GGUFValueType.UINT32),
    "n_expert_shared": OptionalKey("expert_shared_count", GGUFValueType.UINT32),
    "n_dense_lead": OptionalKey("leading_dense_block_count", GGUFValueType.UINT32),
    "expert_weights_scale": OptionalKey("expert_weights_scale", GGUFValueType.FLOAT32),
    "expert_weights_norm": OptionalKey("expert_weights_norm", GGUFValueType.BOOL),
    "expert_gating": OptionalKey("expert_gating_func", GGUFValueType.UINT32),
    "sliding_window": OptionalKey("attention.sliding_window", GGUFValueType.UINT32),
    "swa_pattern": OptionalKey("attention.sliding_window_pattern", GGUFValueType.UINT32),
    "rope_theta_swa": OptionalKey("rope.freq_base_swa", GGUFValueType.FLOAT32),
    "rope_scaling": OptionalKey("rope.scaling.type", GGUFValueType.STRING),
    "rope_scaling_factor": OptionalKey("rope.scaling.factor", GGUFValueType.FLOAT32),
    "rope_orig_ctx": OptionalKey("rope.scaling.original_context_length", GGUFValueType.UINT32),
    "attn_temp_scale": OptionalKey("attention.temperature_scale", GGUFValueType.FLOAT32),
    "attn_softcap": OptionalKey("attn_logit_softcapping", GGUFValueType.FLOAT32),
    "final_softcap": OptionalKey("final_logit_softcapping", GGUFValueType.FLOAT32),
    "embedding_scale": OptionalKey("embedding_scale", GGUFValueType.FLOAT32),
    "residual_scale": OptionalKey("residual_scale", GGUFValueType.FLOAT32),
    "attention_scale": OptionalKey("attention.scale", GGUFValueType.FLOAT32),
    "logit_scale": OptionalKey("logit_scale", GGUFValueType.FLOAT32),
    "q_lora_rank": OptionalKey("attention.q_lora_rank", GGUFValueType.UINT32),
    "kv_lora_rank": OptionalKey("attention.kv_lora_rank", GGUFValueType.UINT32),
    "v_head_dim": OptionalKey("attention.value_length_mla", GGUFValueType.UINT32),
    "ln_eps": OptionalKey("attention.layer_norm_epsilon", GGUFValueType.FLOAT32),
    "n_moe_layer_step": OptionalKey("interleave_moe_layer_step", GGUFValueType.UINT32),
    "clamp_kqv": OptionalKey("attention.clamp_kqv", GGUFValueType.FLOAT32),
    # --- issue 25: SSM (keep this group's entries below this line) ---
    #
    # --- issue 25: linear attention (keep this group's entries below this line) ---
    #
    # --- issue 25: RWKV / short conv (keep this group's entries below this line) ---
    #
    # --- issue 26: dense (keep this group's entries below this line) ---
    #
    # --- issue 26: MoE / sparse attention (keep this group's entries below this line) ---
    #
    # --- issue 26: grown rules (keep this group's entries below this line) ---
    #
    # --- issue 26: per-layer embeddings / KV sharing (keep this group's entries below this line) ---
    "n_embd_per_layer": OptionalKey("embedding_length_per_layer_input", GGUFValueType.UINT32),
    "n_kv_shared_layers": OptionalKey("attention.shared_kv_layers", GGUFValueType.UINT32),
    "head_dim_swa": OptionalKey("attention.key_length_swa", GGUFValueType.UINT32),
}

#: A key computed from the spec rather than copied from one field: (suffix, value, type).
DerivedKey = tuple[str, object, GGUFValueType]

_MOE: Final = frozenset({"n_expert", "n_expert_used", "n_ff_exp"})
_SWA: Final = frozenset({"sliding_window", "swa_pattern"})
_YARN: Final = frozenset({"rope_scaling", "rope_scaling_factor", "rope_orig_ctx"})

#: A rule returns an error message, or None when the spec satisfies it.
Rule = Callable[["ModelSpec"], "str | None"]


@final
@dataclass(frozen=True, slots=True)
class Family:
    """How one llama.cpp architecture's files look.

    Attributes:
        arch: the ``general.architecture`` string.
        heads: the accepted values of ``ModelSpec.tied`` (what the loader can load).
        block: the tensors of block ``layer`` in file order.
        requires: optional spec fields that must be set.
        permits: optional spec fields that may be set (``requires`` is implied).
        rules: further shape checks.
        summary: which real checkpoints the description follows.
        derived_keys: keys computed from several fields (deepseek2's MLA key width).
        output_norm_bias: the final norm is a LayerNorm with a bias (starcoder2).
        output_norm: the final norm has a weight at all (OLMo 1's norms have none).
        output_bias: the head has a bias over the vocabulary (phi2).
        inputs: tensors outside the blocks written right after ``token_embd`` (given the spec and
            the vocabulary size): Gemma 4's per-layer token embeddings and rope frequencies.
    """

    arch: str
    heads: frozenset[bool]
    block: Callable[["ModelSpec", int], list[TensorDecl]]
    requires: frozenset[str] = frozenset()
    permits: frozenset[str] = frozenset()
    rules: tuple[Rule, ...] = ()
    summary: str = ""
    derived_keys: Callable[["ModelSpec"], list[DerivedKey]] | None = None
    output_norm_bias: bool = False
    output_norm: bool = True
    output_bias: bool = False
    inputs: Callable[["ModelSpec", int], list[TensorDecl]] | None = None

    @property
    def allowed(self) -> frozenset[str]:
        """Every optional field a spec of this family may set."""
        return self.requires | self.permits

    def check(self, spec: "ModelSpec") -> list[str]:
        """Return the reasons ``spec`` is not a valid model of this family (empty when valid)."""
        errors: list[str] = []
        if spec.tied not in self.heads:
            kind = "tied" if spec.tied else "untied"
            errors.append(f"{self.arch} has no {kind} head (llama.cpp's loader would not load it)")
        for name in sorted(self.requires):
            if not _is_set(getattr(spec, name)):
                errors.append(f"{self.arch} needs {name}")
        for name in sorted(set(OPTIONAL_KEYS) - self.allowed):
            if _is_set(getattr(spec, name)):
                errors.append(f"{name} does not apply to {self.arch}")
        for rule in self.rules:
            message = rule(spec)
            if message is not None:
                errors.append(message)
        return errors


def _is_set(value: object) -> bool:
    return bool(value)


# --- the families --------------------------------------------------------------------------

_BOTH: Final = frozenset({False, True})
_TIED: Final = frozenset({True})
_UNTIED: Final = frozenset({False})


def _llama(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer) + b.dense_ffn(spec, layer)


def _qwen2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, qkv_bias=True) + b.dense_ffn(spec, layer)


def _qwen3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, qk_norm="head") + b.dense_ffn(spec, layer)


def _gemma2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, post_norm=True) + b.dense_ffn(spec, layer, post_norm=True)


def _gemma3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, qk_norm="head", post_norm=True) + b.dense_ffn(
        spec, layer, post_norm=True
    )


def _phi3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, fused_qkv=True) + b.dense_ffn(spec, layer, fused_up=True)


def _olmo2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # OLMo 2 has no pre-norms: q/k norms over the whole projections, then post-norms.
    return b.attention(spec, layer, pre_norm=False, qk_norm="full", post_norm=True) + b.dense_ffn(
        spec, layer, pre_norm=False, post_norm=True
    )


def _glm4(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, qkv_bias=True, post_norm=True) + b.dense_ffn(
        spec, layer, fused_up=True, post_norm=True
    )


def _qwen2moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, qkv_bias=True) + b.moe_ffn(spec, layer, shared="gated")


def _qwen3moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, qk_norm="head") + b.moe_ffn(spec, layer)


def _gpt_oss(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # gpt-oss: biases everywhere, per-head sinks; its "post_attention_norm" is the FFN's
    # input norm (there is no ffn_norm).
    return b.attention(
        spec, layer, qkv_bias=True, out_bias=True, sinks=True, post_norm=True
    ) + b.moe_ffn(spec, layer, pre_norm=False, router_bias=True, expert_bias=True)


def _glm4moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # GLM-4.5(-Air): q/k/v biases, "post_attention_norm" feeds the FFN (no ffn_norm), the first
    # n_dense_lead blocks are dense, the rest sigmoid-routed experts with a selection bias and
    # one shared expert.
    attention = b.attention(spec, layer, qkv_bias=True, post_norm=True)
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer, pre_norm=False)
    return attention + b.moe_ffn(spec, layer, pre_norm=False, selection_bias=True, shared="plain")


def _deepseek2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # DeepSeek-V3-style block: low-rank q (q_a, its norm, q_b), the latent kv_a_mqa (latent plus
    # the shared rope key) and its norm, per-head k_b / v_b (3-D: n_head stacked matrices, as
    # llama.cpp's MLA path wants them), attn_output; leading dense blocks, then sigmoid-routed
    # experts with a selection bias and shared experts.
    e, heads, q_rank, kv_rank = spec.n_embd, spec.n_head, spec.q_lora_rank, spec.kv_lora_rank
    nope = spec.n_embd_head - spec.n_rot
    out = [
        b.norm(layer, "attn_norm", e),
        b.matrix(layer, "attn_q_a", q_rank, e),
        b.norm(layer, "attn_q_a_norm", q_rank),
        b.matrix(layer, "attn_q_b", heads * spec.n_embd_head, q_rank),
        b.matrix(layer, "attn_kv_a_mqa", kv_rank + spec.n_rot, e),
        b.norm(layer, "attn_kv_a_norm", kv_rank),
        TensorDecl(b.blk(layer, "attn_k_b"), (heads, kv_rank, nope), "matrix", True),
        TensorDecl(b.blk(layer, "attn_v_b"), (heads, spec.v_head_dim, kv_rank), "matrix", True),
        b.matrix(layer, "attn_output", e, heads * spec.v_head_dim),
    ]
    if layer < spec.n_dense_lead:
        return out + b.dense_ffn(spec, layer)
    return out + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


def _olmoe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, qk_norm="full") + b.moe_ffn(spec, layer, expert_width=spec.n_ff)


def _exaone4(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, pre_norm=False, qk_norm="head", post_norm=True) + b.dense_ffn(
        spec, layer, pre_norm=False, post_norm=True
    )


def _starcoder2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer, norm_bias=True, qkv_bias=True, out_bias=True) + b.dense_ffn(
        spec, layer, gated=False, biases=True
    )


def _cohere2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Command R7B: one LayerNorm feeds attention and FFN in parallel (no ffn_norm).
    return b.attention(spec, layer) + b.dense_ffn(spec, layer, pre_norm=False)


def _seed_oss(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Seed-OSS: q/k/v biases; "post_attention_norm" is the FFN's input norm.
    return b.attention(spec, layer, qkv_bias=True, post_norm=True) + b.dense_ffn(
        spec, layer, pre_norm=False
    )


def _llama4(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Llama 4: every n_moe_layer_step-th block is MoE (sigmoid top-k plus one shared expert as
    # wide as an expert), the others dense.
    attention = b.attention(spec, layer)
    if (layer + 1) % spec.n_moe_layer_step != 0:
        return attention + b.dense_ffn(spec, layer)
    shared = [
        b.matrix(layer, "ffn_gate_shexp", spec.n_ff_exp, spec.n_embd),
        b.matrix(layer, "ffn_up_shexp", spec.n_ff_exp, spec.n_embd),
        b.matrix(layer, "ffn_down_shexp", spec.n_embd, spec.n_ff_exp),
    ]
    return attention + b.moe_ffn(spec, layer) + shared


def _minimax_m2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # MiniMax-M2: full-width q/k norms, sigmoid-routed experts (sized by feed_forward_length)
    # with a selection bias.
    return b.attention(spec, layer, qk_norm="full") + b.moe_ffn(
        spec, layer, selection_bias=True, expert_width=spec.n_ff
    )


def _dots1(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    attention = b.attention(spec, layer, qk_norm="head")
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


def _phi2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Phi-2: one LayerNorm (with bias) feeds attention and the GELU MLP in parallel; fused
    # q/k/v with bias, biases on every projection.
    return b.attention(
        spec, layer, norm_bias=True, fused_qkv=True, qkv_bias=True, out_bias=True
    ) + b.dense_ffn(spec, layer, pre_norm=False, gated=False, biases=True)


def _stablelm(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # StableLM 2: LayerNorms with biases, q/k/v biases, SwiGLU.
    out = b.attention(spec, layer, norm_bias=True, qkv_bias=True)
    out += [b.norm(layer, "ffn_norm", spec.n_embd), b.bias(layer, "ffn_norm", spec.n_embd)]
    return out + b.dense_ffn(spec, layer, pre_norm=False)


def _arcee(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # AFM (arcee): llama attention, ReLU^2 MLP without a gate.
    return b.attention(spec, layer) + b.dense_ffn(spec, layer, gated=False)


def _olmo(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # OLMo 1: non-parametric LayerNorms (no norm tensors at all), SwiGLU.
    return b.attention(spec, layer, pre_norm=False) + b.dense_ffn(spec, layer, pre_norm=False)


def _hunyuan_moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Hunyuan-A13B: per-head q/k norms; softmax experts sized by feed_forward_length plus a
    # shared expert of its own width.
    return b.attention(spec, layer, qk_norm="head") + b.moe_ffn(
        spec, layer, shared="own", expert_width=spec.n_ff
    )


def _bailingmoe2(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Ling 2.0 (bailingmoe2): fused q/k/v, per-head q/k norms, a leading dense block, sigmoid
    # experts with a selection bias and shared experts.
    attention = b.attention(spec, layer, fused_qkv=True, qk_norm="head")
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


def _nemotron(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Nemotron(-4/Mini): LayerNorms with biases, squared-ReLU MLP without a gate.
    out = b.attention(spec, layer, norm_bias=True)
    out += [b.norm(layer, "ffn_norm", spec.n_embd), b.bias(layer, "ffn_norm", spec.n_embd)]
    return out + b.dense_ffn(spec, layer, pre_norm=False, gated=False)


def _ernie4_5_moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # ERNIE-4.5-MoE (21B-A3B): llama attention; after n_dense_lead dense blocks, softmax experts
    # with a selection bias and (optionally) a shared expert of width n_ff_shexp.
    attention = b.attention(spec, layer)
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, selection_bias=True, shared="own")


def _every_block_after_the_lead_is_moe(spec: "ModelSpec") -> str | None:
    # The loader creates experts for every block from n_dense_lead on, the graph only for every
    # n_moe_layer_step-th: they agree (and real checkpoints are) at step 1.
    if spec.n_moe_layer_step != 1:
        return f"{spec.arch} needs n_moe_layer_step == 1"
    return None


def _expert_width_is_n_ff(spec: "ModelSpec") -> str | None:
    if spec.n_ff_exp != spec.n_ff:
        return f"{spec.arch} sizes its experts by n_ff: needs n_ff_exp == n_ff"
    return None


def _deepseek2_keys(spec: "ModelSpec") -> list[DerivedKey]:
    return [("attention.key_length_mla", spec.n_embd_head, GGUFValueType.UINT32)]


#: Every family the writer knows, by ``general.architecture``.
FAMILIES: Final[dict[str, Family]] = {
    f.arch: f
    for f in (
        Family("llama", _BOTH, _llama, summary="Llama 2/3: pre-norm SwiGLU, GQA"),
        Family(
            "qwen2", _BOTH, _qwen2, rules=(b.coupled_heads,),
            summary="Qwen2/2.5: llama plus q/k/v biases",
        ),
        Family("qwen3", _BOTH, _qwen3, summary="Qwen3: llama plus per-head q/k RMSNorm"),
        Family(
            "gemma2", _TIED, _gemma2,
            requires=_SWA | {"attn_softcap", "final_softcap"}, permits=frozenset({"rope_theta_swa"}),
            rules=(b.window,),
            summary="Gemma 2: tied head, post-norms, alternating sliding-window layers, "
            "attention and final logit soft-capping",
        ),
        Family(
            "gemma3", _BOTH, _gemma3,
            permits=_SWA | {"rope_theta_swa", "final_softcap"}, rules=(b.window,),
            summary="Gemma 3: Gemma 2's layout plus per-head q/k norms, 5:1 (configurable) "
            "local/global layers with their own rope base, no soft-capping",
        ),
        Family(
            "phi3", _BOTH, _phi3, rules=(b.coupled_heads,),
            summary="Phi-3/Phi-4-mini: fused attn_qkv, fused gate+up in ffn_up",
        ),
        Family(
            "mistral3", _BOTH, _llama,
            permits=_YARN | {"attn_temp_scale"}, rules=(b.yarn, b.temperature),
            summary="Ministral 3: llama layout with a decoupled head width, yarn rope and a "
            "position-dependent attention temperature",
        ),
        Family(
            "olmo2", _UNTIED, _olmo2,
            summary="OLMo 2: no pre-norms, full-width q/k norms, post-norms, untied head",
        ),
        Family(
            "granite", _BOTH, _llama,
            requires=frozenset({"logit_scale"}),
            permits=frozenset({"embedding_scale", "residual_scale", "attention_scale"}),
            summary="Granite 3: llama layout with embedding, residual, attention and logit "
            "multipliers",
        ),
        Family(
            "glm4", _BOTH, _glm4,
            summary="GLM-4-0414: q/k/v biases, fused gate+up, post-norms, half-width rope",
        ),
        Family(
            "qwen2moe", _UNTIED, _qwen2moe,
            requires=_MOE | {"n_ff_shexp"}, rules=(b.coupled_heads, b.experts),
            summary="Qwen1.5/2-MoE: q/k/v biases, softmax top-k experts plus a sigmoid-gated "
            "shared expert",
        ),
        Family(
            "qwen3moe", _BOTH, _qwen3moe,
            requires=_MOE, rules=(b.experts,),
            summary="Qwen3-MoE (30B-A3B): qwen3 attention, normalised top-k experts, no shared "
            "expert",
        ),
        Family(
            "gpt-oss", _UNTIED, _gpt_oss,
            requires=_MOE | {"sliding_window"},
            permits=frozenset({"swa_pattern", "rope_theta_swa"}) | _YARN,
            rules=(b.experts, b.window, b.full_rope, b.yarn),
            summary="gpt-oss: attention sinks, biases on attention and experts, alternating "
            "sliding-window layers, yarn rope",
        ),
        Family(
            "glm4moe", _BOTH, _glm4moe,
            requires=_MOE | {"n_expert_shared"},
            permits=frozenset(
                {"n_dense_lead", "expert_weights_scale", "expert_weights_norm", "expert_gating"}
            ),
            rules=(b.experts, b.dense_lead_below_n_layer),
            summary="GLM-4.5(-Air): leading dense blocks, sigmoid-routed experts with a "
            "selection bias, one shared expert, half-width rope",
        ),
        Family(
            "deepseek2", _BOTH, _deepseek2,
            requires=_MOE | {"n_expert_shared", "q_lora_rank", "kv_lora_rank", "v_head_dim"},
            permits=frozenset(
                {"n_dense_lead", "expert_weights_scale", "expert_weights_norm", "expert_gating"}
            ),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer),
            derived_keys=_deepseek2_keys,
            summary="DeepSeek-V3 (deepseek2): multi-head latent attention with low-rank q, "
            "leading dense blocks, sigmoid-routed experts with a selection bias, shared experts",
        ),
        # Beyond issue 11's list: common families whose loaders follow the same layer loop.
        Family("gemma", _TIED, _llama, summary="Gemma (1): llama layout, tied head, GeGLU"),
        Family(
            "olmoe", _UNTIED, _olmoe,
            requires=frozenset({"n_expert", "n_expert_used"}),
            rules=(b.coupled_heads, b.mha, b.experts),
            summary="OLMoE: full-width q/k norms, softmax top-k experts of width n_ff, untied",
        ),
        Family(
            "smollm3", _BOTH, _llama,
            summary="SmolLM3: llama layout, every 4th layer without rope (NoPE)",
        ),
        Family(
            "exaone4", _BOTH, _exaone4, rules=(b.coupled_heads,),
            summary="EXAONE 4.0: no pre-norms, per-head q/k norms, post-norms",
        ),
        Family("ernie4_5", _BOTH, _llama, summary="ERNIE 4.5 (dense): llama layout"),
        Family(
            "starcoder2", _BOTH, _starcoder2,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,), output_norm_bias=True,
            summary="StarCoder2: LayerNorm with biases, biases on every projection, GELU MLP",
        ),
        Family(
            "cohere2", _TIED, _cohere2,
            requires=frozenset({"ln_eps", "logit_scale", "sliding_window"}),
            permits=frozenset({"swa_pattern", "rope_theta_swa"}),
            rules=(b.coupled_heads, b.window),
            summary="Command R7B (cohere2): parallel attention and FFN under one LayerNorm, "
            "3 sliding-window layers per global one, logit scale, tied",
        ),
        Family(
            "seed_oss", _BOTH, _seed_oss,
            summary="Seed-OSS: q/k/v biases, post-attention norm feeding the FFN",
        ),
        Family(
            "llama4", _BOTH, _llama4,
            requires=_MOE | {"n_moe_layer_step"}, rules=(b.experts,),
            summary="Llama 4: MoE every n-th block (top-k plus a shared expert), chunked "
            "attention on 3 of 4 layers, no rope on the others",
        ),
        Family(
            "minimax-m2", _UNTIED, _minimax_m2,
            requires=_MOE, permits=frozenset({"expert_gating"}),
            rules=(b.experts, _expert_width_is_n_ff),
            summary="MiniMax-M2: full-width q/k norms, partial rope, sigmoid-routed experts with "
            "a selection bias",
        ),
        Family(
            "dots1", _UNTIED, _dots1,
            requires=_MOE | {"n_expert_shared"},
            permits=frozenset(
                {"n_dense_lead", "expert_weights_scale", "expert_weights_norm", "expert_gating"}
            ),
            rules=(b.mha, b.experts, b.dense_lead_below_n_layer),
            summary="dots.llm1: per-head q/k norms, MHA, leading dense blocks, sigmoid experts "
            "with a selection bias and shared experts",
        ),
        Family(
            "ernie4_5-moe", _BOTH, _ernie4_5_moe,
            requires=_MOE | {"n_moe_layer_step"},
            permits=frozenset({"n_ff_shexp", "n_dense_lead"}),
            rules=(b.experts, b.dense_lead_below_n_layer, _every_block_after_the_lead_is_moe),
            summary="ERNIE-4.5-MoE (21B-A3B): a leading dense block, softmax experts with a "
            "selection bias and a shared expert",
        ),
        Family(
            "command-r", _TIED, _cohere2,
            requires=frozenset({"ln_eps"}), permits=frozenset({"logit_scale"}),
            rules=(b.coupled_heads,),
            summary="Command-R: parallel attention and FFN under one LayerNorm, logit scale, tied",
        ),
        Family(
            "internlm2", _UNTIED, _llama, rules=(b.coupled_heads,),
            summary="InternLM2: llama layout, untied head",
        ),
        Family(
            "phi2", _UNTIED, _phi2,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,),
            output_norm_bias=True, output_bias=True,
            summary="Phi-2: parallel attention and GELU MLP under one LayerNorm, fused q/k/v, "
            "biases everywhere (head too), partial rope",
        ),
        Family(
            "stablelm", _UNTIED, _stablelm,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,), output_norm_bias=True,
            summary="StableLM 2: LayerNorms with biases, q/k/v biases, partial rope",
        ),
        Family(
            "arcee", _BOTH, _arcee,
            summary="AFM (arcee): llama attention, ReLU^2 MLP without a gate",
        ),
        Family(
            "olmo", _BOTH, _olmo,
            requires=frozenset({"ln_eps"}), permits=frozenset({"clamp_kqv"}),
            rules=(b.coupled_heads,), output_norm=False,
            summary="OLMo 1: weightless LayerNorms, q/k/v clamping",
        ),
        Family(
            "hunyuan-moe", _BOTH, _hunyuan_moe,
            requires=_MOE | {"n_ff_shexp"}, rules=(b.experts, _expert_width_is_n_ff),
            summary="Hunyuan-A13B: per-head q/k norms, softmax experts plus a shared expert",
        ),
        Family(
            "bailingmoe2", _UNTIED, _bailingmoe2,
            requires=_MOE | {"n_expert_shared", "expert_gating"},
            permits=frozenset({"n_dense_lead", "expert_weights_scale", "expert_weights_norm"}),
            rules=(b.coupled_heads, b.experts, b.dense_lead_below_n_layer),
            summary="Ling 2.0 (bailingmoe2): fused q/k/v, per-head q/k norms, half-width rope, "
            "leading dense block, sigmoid experts with a selection bias and a shared expert",
        ),
        Family("exaone", _BOTH, _llama, summary="EXAONE 3.x: llama layout"),
        Family(
            "nemotron", _UNTIED, _nemotron,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,), output_norm_bias=True,
            summary="Nemotron: LayerNorms with biases, squared-ReLU MLP, partial rope",
        ),
        # --- issue 25: SSM (keep this group's entries below this line) ---
        #
        # --- issue 25: linear attention (keep this group's entries below this line) ---
        #
        # --- issue 25: RWKV / short conv (keep this group's entries below this line) ---
        #
        # --- issue 26: dense (keep this group's entries below this line) ---
        #
        # --- issue 26: MoE / sparse attention (keep this group's entries below this line) ---
        #
        # --- issue 26: grown rules (keep this group's entries below this line) ---
        #
        # --- issue 26: per-layer embeddings / KV sharing (keep this group's entries below this line) ---
        Family(
            "gemma4", _BOTH, bp.gemma4_block,
            requires=frozenset({"sliding_window", "head_dim_swa"}),
            permits=_MOE | {"rope_theta_swa", "final_softcap", "n_kv_shared_layers", "n_embd_per_layer"},
            rules=(bp.gemma4_shape, b.experts), derived_keys=bp.gemma4_keys, inputs=bp.gemma4_inputs,
            summary="Gemma 4 (E2B/E4B): per-layer token embeddings, sliding-window and global "
            "layers of different head widths, q/k norms and a weightless v norm, GeGLU, per-layer "
            "output scale, trailing layers that reuse the KV of earlier ones, final soft-capping",
        ),
    )
}


def family(arch: str) -> Family:
    """Return the family of an architecture name.

    Raises:
        KeyError: the writer does not know ``arch``.
    """
    try:
        return FAMILIES[arch]
    except KeyError:
        raise KeyError(f"no synthetic-model family for {arch!r}; known: {', '.join(FAMILIES)}") from None


def quantized_rows(decls: Sequence[TensorDecl]) -> list[tuple[str, int]]:
    """(name, row width) of every quantized tensor of ``decls``; Q8_0 needs widths % 32 == 0."""
    return [(d.name, d.shape[-1]) for d in decls if d.quantized]

