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
from skippy.models import blocks_adapters as ba
from skippy.models import blocks_perlayer as bp
from skippy.models import blocks_moe as bm
from skippy.models import blocks_dense as dense
from skippy.models import blocks_rules as br
from skippy.models import blocks_ssm as ssm
from skippy.models import blocks_rwkv as rwkv
from skippy.models import blocks_wide as wide
from skippy.models import blocks_hc as hc
from skippy.models import blocks_linear as bl
from skippy.models import blocks_tokens as bt
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
    "ssm_d_conv": OptionalKey("ssm.conv_kernel", GGUFValueType.UINT32),
    "ssm_d_inner": OptionalKey("ssm.inner_size", GGUFValueType.UINT32),
    "ssm_d_state": OptionalKey("ssm.state_size", GGUFValueType.UINT32),
    "ssm_dt_rank": OptionalKey("ssm.time_step_rank", GGUFValueType.UINT32),
    "ssm_n_group": OptionalKey("ssm.group_count", GGUFValueType.UINT32),
    #
    # --- issue 25: linear attention (keep this group's entries below this line) ---
    "linear_conv_kernel": OptionalKey("ssm.conv_kernel", GGUFValueType.UINT32),
    "linear_key_head_dim": OptionalKey("ssm.state_size", GGUFValueType.UINT32),
    "linear_num_key_heads": OptionalKey("ssm.group_count", GGUFValueType.UINT32),
    "linear_num_value_heads": OptionalKey("ssm.time_step_rank", GGUFValueType.UINT32),
    "full_attention_interval": OptionalKey("full_attention_interval", GGUFValueType.UINT32),
    "kda_head_dim": OptionalKey("kda.head_dim", GGUFValueType.UINT32),
    "n_nextn": OptionalKey("nextn_predict_layers", GGUFValueType.UINT32),
    #
    # --- issue 25: RWKV / short conv (keep this group's entries below this line) ---
    "wkv_head_size": OptionalKey("wkv.head_size", GGUFValueType.UINT32),
    "time_mix_extra_dim": OptionalKey("time_mix_extra_dim", GGUFValueType.UINT32),
    "time_decay_extra_dim": OptionalKey("time_decay_extra_dim", GGUFValueType.UINT32),
    "rescale_every_n_layers": OptionalKey("rescale_every_n_layers", GGUFValueType.UINT32),
    "token_shift_count": OptionalKey("token_shift_count", GGUFValueType.UINT32),
    "shortconv_l_cache": OptionalKey("shortconv.l_cache", GGUFValueType.UINT32),
    #
    # --- issue 26: dense (keep this group's entries below this line) ---
    "max_alibi_bias": OptionalKey("attention.max_alibi_bias", GGUFValueType.FLOAT32),
    "rope_sections": OptionalKey("rope.dimension_sections", GGUFValueType.ARRAY),
    # per-layer head counts and feed-forward widths; each replaces the base key of its name
    "layer_n_head": OptionalKey("attention.head_count", GGUFValueType.ARRAY),
    "layer_n_head_kv": OptionalKey("attention.head_count_kv", GGUFValueType.ARRAY),
    "layer_n_ff": OptionalKey("feed_forward_length", GGUFValueType.ARRAY),
    "rope_dim_swa": OptionalKey("rope.dimension_count_swa", GGUFValueType.UINT32),
    #
    # --- issue 26: MoE / sparse attention (keep this group's entries below this line) ---
    "expert_group_scale": OptionalKey("expert_group_scale", GGUFValueType.FLOAT32),
    "n_group_experts": OptionalKey("experts_per_group", GGUFValueType.UINT32),
    "n_ff_chexp": OptionalKey("expert_chunk_feed_forward_length", GGUFValueType.UINT32),
    "indexer_n_head": OptionalKey("attention.indexer.head_count", GGUFValueType.UINT32),
    "indexer_head_size": OptionalKey("attention.indexer.key_length", GGUFValueType.UINT32),
    "indexer_top_k": OptionalKey("attention.indexer.top_k", GGUFValueType.UINT32),
    "kv_lora_rank_swa": OptionalKey("attention.kv_lora_rank_swa", GGUFValueType.UINT32),
    "indexer_block_size": OptionalKey("attention.indexer.block_size", GGUFValueType.UINT32),
    "indexer_local_blocks": OptionalKey("attention.indexer.local_blocks", GGUFValueType.UINT32),
    #
    # --- issue 26: grown rules (keep this group's entries below this line) ---
    "max_alibi_bias": OptionalKey("attention.max_alibi_bias", GGUFValueType.FLOAT32),
    #
    # --- issue 26: per-layer embeddings / KV sharing (keep this group's entries below this line) ---
    "n_embd_per_layer": OptionalKey("embedding_length_per_layer_input", GGUFValueType.UINT32),
    "n_kv_shared_layers": OptionalKey("attention.shared_kv_layers", GGUFValueType.UINT32),
    "head_dim_swa": OptionalKey("attention.key_length_swa", GGUFValueType.UINT32),
    #
    # --- issue 26: token inputs / reused layers (keep this group's entries below this line) ---
    "num_loops": OptionalKey("num_loops", GGUFValueType.UINT32),
    #
    # --- issues 25/26: wide stage boundaries (keep this group's entries below this line) ---
    "decay_lora_rank": OptionalKey("attention.decay_lora_rank", GGUFValueType.UINT32),
    "iclr_lora_rank": OptionalKey("attention.iclr_lora_rank", GGUFValueType.UINT32),
    "value_residual_mix_lora_rank": OptionalKey("attention.value_residual_mix_lora_rank", GGUFValueType.UINT32),
    "gate_lora_rank": OptionalKey("attention.gate_lora_rank", GGUFValueType.UINT32),
    #
    # --- issue 26: adapter switching (keep this group's entries below this line) ---
    "adapter_count": OptionalKey("adapters.count", GGUFValueType.UINT32),
    "adapter_lora_rank": OptionalKey("adapters.lora_rank", GGUFValueType.UINT32),
    "adapter_router_gain": OptionalKey("adapters.router_gain", GGUFValueType.FLOAT32),
    #
    # --- issues 25/26: hyper-connections (keep this group's entries below this line) ---
    "hc_mult": OptionalKey("hyper_connection.count", GGUFValueType.UINT32),
    "hash_layer_count": OptionalKey("hash_layer_count", GGUFValueType.UINT32),
    "compress_ratios": OptionalKey("attention.compress_ratios", GGUFValueType.ARRAY),
    "o_group_count": OptionalKey("attention.output_group_count", GGUFValueType.UINT32),
    "o_lora_rank": OptionalKey("attention.output_lora_rank", GGUFValueType.UINT32),
    "indexer_types": OptionalKey("attention.indexer.types", GGUFValueType.ARRAY),
    "indexer_kpool": OptionalKey("attention.indexer.kpool", GGUFValueType.UINT32),
    "attn_res_block_size": OptionalKey("attn_res.block_size", GGUFValueType.UINT32),
    "n_expert_latent": OptionalKey("expert_latent_length", GGUFValueType.UINT32),
    "hc_low_rank": OptionalKey("hyper_connection.low_rank", GGUFValueType.UINT32),
    "ple_layers": OptionalKey("ple.layers", GGUFValueType.ARRAY),
}

#: Optional spec fields that no single key holds: a family's `derived_keys` write what they
#: mean (a hybrid's layer pattern becomes per-layer head_count_kv / feed_forward_length arrays).
#: Like `OPTIONAL_KEYS`, a family must permit one before a spec of it may set it.
DERIVED_FIELDS: Final[frozenset[str]] = frozenset(
    {
        # --- issue 25: SSM (keep this group's entries below this line) ---
        "layer_pattern",
        #
        # --- issue 25: RWKV / short conv ---
        # ``recurrent_layers`` turns ``attention.head_count_kv`` into an array with 0 at those
        # layers (llama.cpp's mark of a recurrent layer in a hybrid model)
        "recurrent_layers",
        #
        # --- issue 26: adapter switching (keep this group's entries below this line) ---
        # the adapter table: Granite Switch's token_ids_activate / token_ids_substitute arrays
        "adapter_tokens",
        "adapter_substitutes",
    }
)

#: A key computed from the spec rather than copied from one field: (suffix, value, type). It
#: replaces a base key of the same suffix (a per-layer array instead of the scalar); a value of
#: None leaves that base key out (a pure-SSM model has no attention keys).
DerivedKey = tuple[str, object, GGUFValueType]

_MOE: Final = frozenset({"n_expert", "n_expert_used", "n_ff_exp"})
_SWA: Final = frozenset({"sliding_window", "swa_pattern"})
_YARN: Final = frozenset({"rope_scaling", "rope_scaling_factor", "rope_orig_ctx"})
_PER_LAYER: Final = frozenset({"layer_n_head", "layer_n_head_kv", "layer_n_ff"})

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
        global_keys: derived keys that llama.cpp reads without the ``<arch>.`` prefix
            (Apertus's per-layer ``xielu.*`` constants).
        head_widths: ``attention.key_length`` and ``value_length`` where they are not the
            spec's `key_length` / `value_length` (PLM caches full per-head keys and values
            beside a low-rank KV projection).
        derived_keys: keys computed from several fields (deepseek2's MLA key width, a hybrid's
            per-layer head counts), replacing or leaving out base keys (see `DerivedKey`).
        output_norm_bias: the final norm is a LayerNorm with a bias (starcoder2).
        output_norm: the final norm has a weight at all (OLMo 1's norms have none).
        output_bias: the head has a bias over the vocabulary (phi2).
        inputs: tensors outside the blocks written right after ``token_embd`` (given the spec and
            the vocabulary size): Gemma 4's per-layer token embeddings and rope frequencies, a
            learned position embedding or an input LayerNorm (GPT-2, BLOOM; loaded by the first
            stage only).
        output_norm_name: the final norm's tensor name (LFM2 stores it as ``token_embd_norm``).
        output_rows: the head's rows where they are not the vocabulary's (Qwen3-TTS's codec head:
            its logits are the last rows of the vocabulary, the rest padded with -inf); 0: n_vocab.
    """

    arch: str
    heads: frozenset[bool]
    block: Callable[["ModelSpec", int], list[TensorDecl]]
    requires: frozenset[str] = frozenset()
    permits: frozenset[str] = frozenset()
    rules: tuple[Rule, ...] = ()
    summary: str = ""
    derived_keys: Callable[["ModelSpec"], list[DerivedKey]] | None = None
    global_keys: Callable[["ModelSpec"], list[DerivedKey]] | None = None
    head_widths: Callable[["ModelSpec"], tuple[int, int]] | None = None
    output_norm_bias: bool = False
    output_norm: bool = True
    output_bias: bool = False
    inputs: Callable[["ModelSpec", int], list[TensorDecl]] | None = None
    output_norm_name: str = "output_norm"
    output_rows: int = 0

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
        for name in sorted((set(OPTIONAL_KEYS) | DERIVED_FIELDS) - self.allowed):
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


def _qwen3moe_without_qk_norm(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    return b.attention(spec, layer) + b.moe_ffn(spec, layer)


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


def _one_token_shift(spec: "ModelSpec") -> str | None:
    # rwkv6qwen2 keeps one shifted row per layer (its graph asserts n_embd_r == n_embd).
    if spec.token_shift_count != 1:
        return f"{spec.arch} needs token_shift_count == 1"
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
        Family(
            "nemotron_h", _BOTH, ssm.nemotron_h,
            requires=ssm.MAMBA2 | {"layer_pattern", "ln_eps"},
            rules=(ssm.mamba2_shape, ssm.pattern("M*-")),
            derived_keys=ssm.nemotron_h_keys,
            summary="Nemotron-H: Mamba-2 (M), attention without rope (*) and squared-ReLU MLP "
            "(-) blocks after one RMSNorm each, as layer_pattern lays them out",
        ),
        Family(
            "mamba", _BOTH, ssm.mamba,
            requires=ssm.MAMBA1, rules=(ssm.expansion_2,), derived_keys=ssm.pure_ssm_keys,
            summary="Mamba (1): RMSNorm and a Mamba-1 mixer per layer, no attention",
        ),
        Family(
            "mamba2", _BOTH, ssm.mamba2,
            requires=ssm.MAMBA2, rules=(ssm.mamba2_shape,), derived_keys=ssm.pure_ssm_keys,
            summary="Mamba-2 (Mamba-Codestral): RMSNorm and a Mamba-2 mixer (heads, groups, "
            "gated grouped RMSNorm) per layer, no attention",
        ),
        Family(
            "jamba", _BOTH, ssm.jamba,
            requires=ssm.MAMBA1 | {"layer_pattern"},
            permits=frozenset({"n_expert", "n_expert_used"}),
            rules=(ssm.expansion_2, b.coupled_heads, b.experts, ssm.pattern("M*")),
            derived_keys=ssm.hybrid_keys,
            summary="Jamba: Mamba-1 (dt/B/C norms) or rope-less attention layers, experts of "
            "width n_ff on every other layer",
        ),
        Family(
            "falcon-h1", _BOTH, ssm.falcon_h1,
            requires=ssm.MAMBA2, rules=(ssm.mamba2_shape,),
            summary="Falcon-H1: attention and a Mamba-2 mixer in parallel in every layer, SwiGLU",
        ),
        Family(
            "granitehybrid", _BOTH, ssm.granitehybrid,
            requires=ssm.MAMBA2 | {"layer_pattern"},
            permits=frozenset(
                {"n_expert", "n_expert_used", "n_ff_shexp", "embedding_scale", "residual_scale",
                 "attention_scale", "logit_scale"}
            ),
            rules=(ssm.expansion_2, ssm.mamba2_shape, b.experts, ssm.pattern("M*")),
            derived_keys=ssm.hybrid_keys,
            summary="Granite 4.0-H: Mamba-2 or attention layers, experts of width n_ff plus a "
            "shared expert, granite's multipliers",
        ),
        Family(
            "nemotron_h_moe", _BOTH, ssm.nemotron_h_moe,
            requires=ssm.MAMBA2 | _MOE | {"layer_pattern", "ln_eps", "n_ff_shexp"},
            permits=frozenset({"expert_weights_norm", "expert_weights_scale"}),
            rules=(ssm.mamba2_shape, b.experts, ssm.pattern("M*E")),
            derived_keys=ssm.nemotron_h_keys,
            summary="Nemotron-H MoE (Nemotron 3 Nano): Nemotron-H's blocks with sigmoid-routed "
            "squared-ReLU experts (E) and a shared expert",
        ),
        Family(
            "plamo2", _BOTH, ssm.plamo2,
            requires=ssm.MAMBA1 | {"layer_pattern"}, rules=(ssm.pattern("M*"),),
            derived_keys=ssm.plamo2_keys,
            summary="PLaMo 2: its own Mamba mixer (per-head dt, dt/B/C norms, no groups) or "
            "fused-qkv attention with q/k norms; post-mixer and post-FFN norms",
        ),
        #
        # --- issue 25: linear attention (keep this group's entries below this line) ---
        Family(
            "qwen35", _BOTH, bl.qwen35,
            requires=bl.DELTA_NET, permits=frozenset({"full_attention_interval", "n_nextn"}),
            rules=(bl.delta_net, bl.mrope_sections, bl.every_layer_quantizes), derived_keys=bl.qwen35_keys,
            summary="Qwen3.5 (dense): gated delta-net layers with full attention every n-th "
            "(sigmoid-gated q, per-head q/k norms, interleaved M-RoPE on part of each head), "
            "post-attention norm feeding a SwiGLU FFN",
        ),
        Family(
            "qwen35moe", _BOTH, bl.qwen35moe,
            requires=bl.DELTA_NET | _MOE | {"n_ff_shexp"}, permits=frozenset({"full_attention_interval"}),
            rules=(bl.delta_net, bl.mrope_sections, bl.every_layer_quantizes, b.experts),
            derived_keys=bl.qwen35_keys,
            summary="Qwen3.5-MoE (35B-A3B): Qwen3.5's hybrid layers, softmax top-k experts plus "
            "a sigmoid-gated shared expert",
        ),
        Family(
            "qwen3next", _BOTH, bl.qwen3next,
            requires=bl.DELTA_NET | _MOE | {"n_ff_shexp"}, permits=frozenset({"full_attention_interval"}),
            rules=(bl.delta_net, bl.every_layer_quantizes, b.experts),
            derived_keys=bl.delta_net_keys,
            summary="Qwen3-Next (80B-A3B): gated delta-net layers (beta and alpha fused) with "
            "gated full attention every n-th, neox rope, experts plus a gated shared expert",
        ),
        Family(
            "minimax-01", _BOTH, bl.minimax_01,
            requires=_MOE | {"full_attention_interval", "residual_scale"},
            rules=(b.experts, _expert_width_is_n_ff, bl.every_layer_quantizes),
            summary="MiniMax-Text-01: lightning (linear) attention layers with softmax attention "
            "every n-th, residuals from the scaled pre-norm output, softmax top-k experts",
        ),
        Family(
            "kimi-linear", _UNTIED, bl.kimi_linear,
            requires=_MOE | {
                "kda_head_dim", "linear_conv_kernel", "full_attention_interval", "kv_lora_rank",
                "v_head_dim", "n_expert_shared", "expert_gating",
            },
            permits=frozenset({"n_dense_lead", "expert_weights_scale"}),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, bl.every_layer_quantizes),
            derived_keys=bl.kimi_linear_keys,
            summary="Kimi-Linear (48B-A3B): Kimi Delta Attention layers with NoPE multi-head "
            "latent attention every n-th, leading dense blocks, sigmoid experts with a selection "
            "bias and shared experts",
        ),
        Family(
            "bailingmoe3", _BOTH, bl.bailingmoe3,
            requires=_MOE | {
                "kda_head_dim", "linear_conv_kernel", "full_attention_interval", "kv_lora_rank",
                "v_head_dim", "n_expert_shared", "expert_gating",
            },
            permits=frozenset(
                {"q_lora_rank", "n_dense_lead", "expert_weights_scale", "expert_weights_norm"}
            ),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, bl.every_layer_quantizes),
            derived_keys=bl.bailingmoe3_keys,
            summary="Ling 2.5 (bailingmoe3): KDA layers with full-rank gates and MLA with a "
            "per-head output gate every n-th, leading dense blocks, sigmoid experts with a "
            "selection bias and shared experts",
        ),
        #
        # --- issue 25: RWKV / short conv (keep this group's entries below this line) ---
        Family(
            "lfm2", _BOTH, rwkv.lfm2,
            requires=frozenset({"shortconv_l_cache", "recurrent_layers"}),
            rules=(b.coupled_heads, rwkv.hybrid_layers), output_norm_name="token_embd_norm",
            summary="LFM2: gated short-convolution blocks (causal conv of l_cache taps) "
            "interleaved with GQA attention blocks with per-head q/k norms, SwiGLU FFNs",
        ),
        Family(
            "lfm2moe", _BOTH, rwkv.lfm2moe,
            requires=_MOE | {"shortconv_l_cache", "recurrent_layers", "expert_gating"},
            permits=frozenset({"n_dense_lead"}),
            rules=(b.coupled_heads, rwkv.hybrid_layers, b.experts, b.dense_lead_below_n_layer),
            output_norm_name="token_embd_norm",
            summary="LFM2-MoE (8B-A1B): LFM2's conv / attention mixers, leading dense blocks, then "
            "sigmoid-routed experts with a selection bias",
        ),
        Family(
            "rwkv6", _UNTIED, rwkv.rwkv6,
            requires=frozenset({"wkv_head_size", "time_mix_extra_dim", "time_decay_extra_dim", "ln_eps"}),
            permits=frozenset({"rescale_every_n_layers"}),
            rules=(rwkv.wkv_heads,), output_norm_bias=True, inputs=br.input_layer_norm,
            summary="RWKV-6 (Finch): LayerNorm of the embeddings, WKV-6 time mixing with "
            "data-dependent token shift and decay, squared-ReLU channel mixing, halving of the "
            "hidden state every n layers",
        ),
        Family(
            "rwkv6qwen2", _UNTIED, rwkv.rwkv6qwen2,
            requires=frozenset({"wkv_head_size", "time_mix_extra_dim", "time_decay_extra_dim",
                                "token_shift_count"}),
            permits=frozenset({"rescale_every_n_layers"}),
            rules=(rwkv.wkv_heads, _one_token_shift),
            summary="QRWKV-6 (rwkv6qwen2): Qwen2 blocks with RWKV-6 time mixing as gated linear "
            "attention over GQA k/v (with biases) instead of softmax attention",
        ),
        #
        # --- issue 26: dense (keep this group's entries below this line) ---
        #
        Family(
            "baichuan", _UNTIED, dense.baichuan, rules=(b.coupled_heads,),
            summary="Baichuan 2: llama layout (7B: rope, 13B: ALiBi; other depths, as the tiny "
            "one, neither)",
        ),
        Family(
            "xverse", _UNTIED, dense.xverse, rules=(b.coupled_heads,),
            summary="XVERSE-7B/13B/65B: llama layout, untied head",
        ),
        Family(
            "openelm", _TIED, dense.openelm,
            requires=_PER_LAYER, rules=(dense.per_layer_shapes,),
            summary="OpenELM: layer-wise scaling (query heads, KV heads and MLP width per layer), "
            "fused q/k/v, per-head q/k norms, tied",
        ),
        Family(
            "deci", _BOTH, dense.deci,
            requires=_PER_LAYER, rules=(dense.per_layer_shapes,),
            summary="Llama-3_1-Nemotron-51B (deci): per-layer heads and MLP widths, with "
            "attention-free layers (no heads) and \"linear attention\" layers (no KV heads: "
            "attn_output only)",
        ),
        Family(
            "laguna", _BOTH, dense.laguna,
            requires=_MOE | {"n_dense_lead", "layer_n_head"},
            permits=_SWA | _YARN | {
                "rope_theta_swa", "rope_dim_swa", "n_ff_shexp", "expert_weights_scale",
                "expert_weights_norm", "expert_gating",
            },
            rules=(b.experts, b.window, b.yarn, b.dense_lead_below_n_layer, dense.per_layer_shapes),
            summary="Laguna XS.2: per-layer query heads, per-head softplus attention gate, "
            "q/k norms, global layers with partial yarn rope and sliding-window ones with whole "
            "plain rope, a leading dense block, sigmoid experts with a selection bias and a "
            "shared expert",
        ),
        Family(
            "plm", _TIED, dense.plm,
            requires=frozenset({"kv_lora_rank", "v_head_dim"}), rules=(b.mha, dense.low_rank_kv),
            head_widths=dense.plm_head_widths,
            summary="PLM-1.8B: low-rank KV (kv_a with a shared rope key, kv_b to per-head keys "
            "and values), partial rope, squared-ReLU MLP, tied",
        ),
        Family(
            "orion", _UNTIED, dense.orion,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,), output_norm_bias=True,
            summary="Orion-14B: llama layout with LayerNorms with biases",
        ),
        Family(
            "refact", _BOTH, dense.refact,
            summary="Refact-1.6B: llama layout, ALiBi (max bias 8) instead of rope",
        ),
        Family(
            "qwen", _UNTIED, dense.qwen, rules=(b.coupled_heads, b.mha),
            summary="Qwen (1): fused q/k/v with bias, MHA, SwiGLU of half the file's "
            "feed_forward_length",
        ),
        Family(
            "codeshell", _UNTIED, dense.codeshell,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,), output_norm_bias=True,
            summary="CodeShell-7B: LayerNorms with biases, fused q/k/v, biases everywhere, GELU "
            "MLP",
        ),
        Family(
            "plamo", _UNTIED, dense.plamo, rules=(b.coupled_heads,),
            summary="PLaMo-13B: parallel attention and SwiGLU MLP under one RMSNorm",
        ),
        Family(
            "falcon", _BOTH, dense.falcon,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,), output_norm_bias=True,
            summary="Falcon-40B: parallel attention (own LayerNorm) and GELU MLP, fused q/k/v, "
            "grouped KV",
        ),
        Family(
            "maincoder", _BOTH, dense.maincoder,
            summary="Maincoder-1B: qwen3 layout, q/k norms after rope",
        ),
        Family(
            "pangu-embedded", _BOTH, dense.pangu_embedded,
            summary="openPangu-Embedded-1B/7B: llama plus q/k/v and attention-output biases",
        ),
        Family(
            "chatglm", _BOTH, dense.chatglm, rules=(b.coupled_heads,),
            summary="ChatGLM3-6B / GLM-4-9B: fused q/k/v with bias, fused gate+up, half-width rope",
        ),
        Family(
            "jais", _UNTIED, dense.jais,
            requires=frozenset({"ln_eps", "max_alibi_bias"}), rules=(b.coupled_heads,),
            output_norm_bias=True,
            summary="Jais-13B: LayerNorms with biases, fused q/k/v, biases everywhere, SwiGLU, "
            "ALiBi, 1/head_dim attention scale",
        ),
        Family(
            "hunyuan_vl", _BOTH, dense.hunyuan_vl,
            permits=frozenset({"rope_sections"}), rules=(dense.mrope_sections,),
            summary="HunyuanOCR's text tower (hunyuan_vl): per-head q/k norms after rope, "
            "XD-RoPE over four position sections",
        ),
        Family(
            "qwen2vl", _BOTH, dense.qwen2vl,
            requires=frozenset({"rope_sections"}), rules=(b.coupled_heads, dense.mrope_sections),
            summary="Qwen2-VL's text tower: qwen2 layout (q/k/v biases) with M-RoPE sections",
        ),
        Family(
            "paddleocr", _BOTH, dense.paddleocr,
            permits=frozenset({"rope_sections"}), rules=(dense.mrope_sections,),
            summary="PaddleOCR-VL's text tower (ERNIE-4.5-0.3B): llama layout with M-RoPE sections",
        ),
        Family(
            "chameleon", _BOTH, dense.chameleon, rules=(b.coupled_heads,),
            summary="Chameleon-7B: per-head q/k LayerNorms with biases, image-token logits "
            "masked",
        ),
        Family(
            "plamo3", _BOTH, dense.plamo3,
            permits=_SWA | {"rope_theta_swa"}, rules=(b.window,),
            summary="PLaMo 3: fused q/k/v, per-head q/k norms, post-norms, fused gate+up, "
            "sliding-window layers with their own rope base",
        ),
        Family(
            "mellum", _UNTIED, dense.mellum,
            requires=_MOE, permits=_SWA | {"rope_theta_swa"}, rules=(b.experts, b.window),
            summary="Mellum: per-head q/k norms, softmax top-k experts, optional sliding-window "
            "layers",
        ),
        Family(
            "apertus", _UNTIED, dense.apertus, global_keys=dense.xielu,
            summary="Apertus-8B: per-head q/k norms, xIELU MLP (per-layer constants), no gate",
        ),
        Family(
            "spark2_5", _BOTH, dense.spark2_5,
            requires=frozenset({"sliding_window"}), permits=frozenset({"rope_theta_swa"}),
            derived_keys=dense.alternating_swa,
            summary="Spark2.5: per-head sigmoid gate on the attention output, GELU-gated MLP, "
            "sliding-window layers (per-layer pattern array) with their own rope base",
        ),
        Family(
            "maple", _UNTIED, dense.maple,
            requires=_MOE | {"sliding_window"}, permits=frozenset({"rope_theta_swa"}),
            rules=(b.experts,), derived_keys=dense.maple_keys,
            summary="Maple: per-head q/k norms, softmax top-k experts with a per-layer SwiGLU "
            "clamp, rope on the sliding-window layers only (the global ones are NoPE)",
        ),
        # --- issue 26: MoE / sparse attention (keep this group's entries below this line) ---
        Family(
            "deepseek", _BOTH, bm.deepseek,
            requires=_MOE | {"n_expert_shared"},
            permits=frozenset({"n_dense_lead", "expert_weights_scale"}),
            rules=(b.coupled_heads, b.experts, b.dense_lead_below_n_layer),
            summary="DeepSeek-MoE 16B (deepseek): llama attention, leading dense blocks, "
            "softmax experts plus shared experts",
        ),
        Family(
            "dbrx", _UNTIED, bm.dbrx,
            requires=frozenset({"n_expert", "n_expert_used", "ln_eps", "clamp_kqv"}),
            rules=(b.coupled_heads, b.experts),
            summary="DBRX: bias-free LayerNorms, fused and clamped q/k/v, an attention-output "
            "norm feeding softmax experts of width n_ff, untied",
        ),
        Family(
            "grok", _BOTH, bm.grok,
            requires=_MOE,
            permits=frozenset({"embedding_scale", "logit_scale", "attn_softcap", "final_softcap"}),
            rules=(b.coupled_heads, b.experts),
            summary="Grok-1/2: attention and layer output norms, attention and router "
            "soft-capping, embedding and logit scales, a dense GELU FFN beside the experts "
            "(Grok 2)",
        ),
        Family(
            "arctic", _BOTH, bm.arctic,
            requires=frozenset({"n_expert", "n_expert_used"}),
            rules=(b.coupled_heads, b.experts),
            summary="Snowflake Arctic: a residual n_embd-wide dense FFN plus softmax experts "
            "(n_ff wide) on the block input with their own norm",
        ),
        Family(
            "cohere2moe", _BOTH, bm.cohere2moe,
            requires=_MOE | {"sliding_window", "logit_scale", "n_dense_lead"},
            permits=frozenset(
                {"swa_pattern", "rope_theta_swa", "n_expert_shared", "n_ff_shexp",
                 "expert_weights_norm", "expert_weights_scale", "expert_gating"}
            ),
            rules=(b.experts, b.window, b.dense_lead_below_n_layer),
            summary="Cohere2 MoE (30B-A3B): parallel attention and FFN under one norm, "
            "sliding-window layers with rope and global ones without, leading dense blocks, "
            "sigmoid experts plus shared experts, logit scale",
        ),
        Family(
            "exaone-moe", _UNTIED, bm.exaone_moe,
            requires=_MOE | {"sliding_window", "expert_gating", "n_ff_shexp"},
            permits=frozenset(
                {"swa_pattern", "rope_theta_swa", "n_expert_shared", "n_dense_lead",
                 "expert_weights_norm", "expert_weights_scale"}
            ),
            rules=(b.experts, b.window, b.dense_lead_below_n_layer),
            summary="EXAONE MoE (K-EXAONE): per-head q/k norms, sliding-window layers with rope "
            "and global ones without, leading dense blocks, experts with a selection bias and "
            "a shared expert, untied",
        ),
        Family(
            "bailingmoe", _UNTIED, bm.bailingmoe,
            requires=_MOE | {"n_expert_shared"},
            permits=frozenset({"expert_weights_norm", "expert_weights_scale"}),
            rules=(b.experts, b.full_rope),
            summary="Ling 1.0 / Ling-lite (bailingmoe): llama attention, softmax experts in "
            "every block plus shared experts, untied",
        ),
        Family(
            "grovemoe", _BOTH, bm.grovemoe,
            requires=_MOE | {"expert_group_scale", "n_group_experts", "n_ff_chexp"},
            rules=(b.experts, bm.chunk_experts),
            summary="GroveMoE (Inclusion AI): qwen3 attention, softmax experts plus one "
            "'adjugate' chunk expert per group sharing the router's probabilities",
        ),
        Family(
            "hy_v3", _BOTH, bm.hy_v3,
            requires=_MOE | {"n_ff_shexp"},
            permits=frozenset(
                {"n_dense_lead", "expert_gating", "expert_weights_norm", "expert_weights_scale"}
            ),
            rules=(b.experts, b.dense_lead_below_n_layer),
            summary="Tencent HY V3 (30B-A3B): per-head q/k norms, dense blocks where no router "
            "is stored (leading_dense_block_count only tells the writer which), sigmoid experts "
            "with a selection bias and a shared expert",
        ),
        Family(
            "deepseek32", _BOTH, bm.deepseek32,
            requires=_MOE | bm.DSA | {
                "n_expert_shared", "q_lora_rank", "kv_lora_rank", "v_head_dim", "expert_gating",
            },
            permits=frozenset({"n_dense_lead", "expert_weights_scale", "expert_weights_norm"}),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, bm.indexer),
            derived_keys=_deepseek2_keys,
            summary="DeepSeek-V3.2 (deepseek32): DeepSeek-V3's MLA and experts plus the "
            "lightning indexer of DeepSeek sparse attention (each query attends to its top-k "
            "keys only)",
        ),
        Family(
            "glm-dsa", _BOTH, bm.glm_dsa,
            requires=_MOE | bm.DSA | {"n_expert_shared", "q_lora_rank", "kv_lora_rank",
                                      "v_head_dim"},
            permits=frozenset(
                {"n_dense_lead", "expert_weights_scale", "expert_weights_norm", "expert_gating"}
            ),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, bm.indexer),
            derived_keys=_deepseek2_keys,
            summary="GLM-5 / 5.1 / 5.2 (glm-dsa): MLA, sigmoid experts and DeepSeek sparse "
            "attention; GLM-5.2's layout (a training context of 1M) has shared-indexer layers "
            "reusing the previous full layer's selection",
        ),
        Family(
            "dots3note", _BOTH, bm.dots3note,
            requires=_MOE | bm.DSA | {
                "n_expert_shared", "q_lora_rank", "kv_lora_rank", "v_head_dim", "expert_gating",
                "n_dense_lead", "kv_lora_rank_swa", "sliding_window", "rope_theta_swa",
            },
            permits=frozenset({"expert_weights_scale", "expert_weights_norm"}),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, bm.indexer),
            derived_keys=bm.dots3note_keys,
            summary="dots3note: MLA with a head-wise output gate on sliding-window layers (own "
            "latent rank) and on full-attention layers with DeepSeek sparse attention, leading "
            "dense blocks, sigmoid experts with a selection bias and shared experts",
        ),
        Family(
            "minimax-m3", _UNTIED, bm.minimax_m3,
            requires=_MOE | bm.DSA | {
                "n_expert_shared", "expert_gating", "indexer_block_size", "indexer_local_blocks",
            },
            permits=frozenset({"n_dense_lead", "expert_weights_scale", "expert_weights_norm"}),
            rules=(b.experts, b.dense_lead_below_n_layer, bm.msa_indexer),
            summary="MiniMax-M3: MiniMax-M2's attention, leading dense blocks, sigmoid experts "
            "with a selection bias and shared experts, MiniMax sparse attention (top-k blocks "
            "of positions; with flash attention on and one sequence per cache stream)",
        ),
        Family(
            "step35", _UNTIED, bm.step35,
            requires=_MOE | {"sliding_window", "n_ff_shexp"},
            permits=frozenset(
                {"n_dense_lead", "rope_theta_swa", "expert_gating", "expert_weights_norm",
                 "expert_weights_scale"}
            ),
            rules=(b.experts, b.dense_lead_below_n_layer),
            derived_keys=bm.step35_keys,
            summary="Step 3.5 Flash (step35): per-head q/k norms, head-wise output gate, "
            "sliding-window layers with full rope and full-attention layers with half, dense "
            "blocks, then sigmoid experts with a selection bias and a shared expert",
        ),
        #
        # --- issue 26: grown rules (keep this group's entries below this line) ---
        Family(
            "gpt2", _BOTH, br.gpt2,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,),
            output_norm_bias=True, inputs=br.position_embedding,
            summary="GPT-2: learned position embeddings, LayerNorms with biases, fused q/k/v, "
            "biases everywhere, GELU MLP",
        ),
        Family(
            "starcoder", _BOTH, br.gpt2,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,),
            output_norm_bias=True, inputs=br.position_embedding,
            summary="StarCoder (1) / SantaCoder: GPT-2's layout with multi-query attention",
        ),
        Family(
            "bloom", _BOTH, br.gpt2,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,),
            output_norm_bias=True, inputs=br.input_layer_norm,
            summary="BLOOM: a LayerNorm on the token embeddings, ALiBi (max bias 8), GPT-2's "
            "block layout",
        ),
        Family(
            "mpt", _BOTH, br.mpt,
            requires=frozenset({"ln_eps", "max_alibi_bias"}), permits=frozenset({"clamp_kqv"}),
            rules=(b.coupled_heads,),
            summary="MPT-7B/30B: ALiBi, bias-free LayerNorms and projections, fused and clamped "
            "q/k/v, GELU MLP",
        ),
        Family(
            "gptneox", _UNTIED, br.gpt2,
            requires=frozenset({"ln_eps"}), rules=(b.coupled_heads,), output_norm_bias=True,
            derived_keys=br.parallel_residual,
            summary="GPT-NeoX / Pythia: GPT-2's block layout with partial NeoX rope and "
            "attention and MLP in parallel on the residual, untied",
        ),
        Family(
            "jais2", _BOTH, br.jais2,
            requires=frozenset({"ln_eps"}), output_norm_bias=True,
            summary="Jais 2: LayerNorms with biases, q/k/v and output biases, a GELU MLP "
            "without a gate",
        ),
        Family(
            "granitemoe", _BOTH, br.granitemoe,
            requires=frozenset({"n_expert", "n_expert_used", "logit_scale"}),
            permits=frozenset({"embedding_scale", "residual_scale", "attention_scale", "n_ff_shexp"}),
            rules=(b.experts,),
            summary="Granite 3 MoE (and MoE-shared): granite's multipliers, softmax experts of "
            "width n_ff, an optional shared expert",
        ),
        Family(
            "minicpm", _BOTH, _llama,
            permits=frozenset({"embedding_scale", "residual_scale", "logit_scale"}),
            summary="MiniCPM (1/2): llama layout with embedding, residual and logit scales "
            "(granite's graph)",
        ),
        Family(
            "phimoe", _UNTIED, br.phimoe,
            requires=frozenset({"n_expert", "n_expert_used"}), rules=(b.coupled_heads, b.experts),
            output_norm_bias=True, output_bias=True,
            summary="Phi-3.5-MoE: RMS norms with biases, q/k/v and output biases, softmax "
            "experts of width n_ff, a head bias (phi3's graph)",
        ),
        Family(
            "hunyuan-dense", _BOTH, _qwen3,
            summary="Hunyuan dense (hunyuan-vl's graph): llama plus per-head q/k norms",
        ),
        Family(
            "mistral4", _BOTH, _deepseek2,
            requires=_MOE | {"n_expert_shared", "q_lora_rank", "kv_lora_rank", "v_head_dim"},
            permits=frozenset(
                {"n_dense_lead", "expert_weights_scale", "expert_weights_norm", "expert_gating"}
            ),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer),
            derived_keys=_deepseek2_keys,
            summary="Mistral 4: deepseek2's loader and graph (multi-head latent attention, "
            "leading dense blocks, routed and shared experts) under its own name",
        ),
        Family(
            "deepseek2-ocr", _BOTH, br.deepseek2_ocr,
            requires=_MOE | {"n_expert_shared"},
            permits=frozenset({"n_dense_lead", "expert_weights_scale", "expert_weights_norm", "expert_gating"}),
            rules=(b.coupled_heads, b.mha, b.experts, b.dense_lead_below_n_layer),
            summary="DeepSeek-OCR's language model (deepseek2's graph without MLA): MHA with full "
            "NeoX rope, leading dense blocks, softmax experts plus shared experts",
        ),
        Family(
            "afmoe", _BOTH, br.afmoe,
            requires=_MOE | {"n_expert_shared"},
            permits=frozenset(
                {"n_dense_lead", "expert_weights_scale", "expert_weights_norm", "expert_gating",
                 "sliding_window", "swa_pattern", "rope_theta_swa"}
            ),
            rules=(b.experts, b.window, b.dense_lead_below_n_layer),
            summary="AFM MoE (Trinity): a sqrt(n_embd) input scale, per-head q/k norms, a sigmoid "
            "attention-output gate, post-norms, 3:1 sliding-window layers, leading dense blocks, "
            "sigmoid experts with a selection bias and shared experts",
        ),
        Family(
            "granite_swa", _BOTH, br.granite_swa,
            requires=frozenset({"sliding_window", "logit_scale"}),
            permits=frozenset({"embedding_scale", "residual_scale", "attention_scale"}),
            derived_keys=br.alternating_window_layers,
            summary="Granite 4 (iSWA, dense): granite's multipliers, attention sinks, a per-layer "
            "sliding-window pattern",
        ),
        Family(
            "mimo2", _UNTIED, br.mimo2,
            requires=_MOE | {"sliding_window"}, permits=frozenset({"n_dense_lead", "rope_theta_swa"}),
            rules=(b.experts, b.dense_lead_below_n_layer),
            derived_keys=br.alternating_window_layers,
            summary="MiMo-V2-Flash (trunk, no MTP block): attention sinks, a per-layer "
            "sliding-window pattern, a leading dense block, sigmoid experts with a selection bias",
        ),
        Family(
            "minicpm3", _BOTH, br.minicpm3,
            requires=frozenset({"q_lora_rank"}), rules=(b.mha, br.partial_rope),
            derived_keys=br.minicpm3_kv_rank,
            summary="MiniCPM3: low-rank q and kv projections (kv_b decompressed, plain KV cache), "
            "an embedding scale of 12, residual scale 1.4 / sqrt(n_layer), head scale 256 / n_embd",
        ),
        Family(
            "bitnet", _TIED, br.bitnet, rules=(b.coupled_heads,),
            summary="BitNet b1.58: llama layout plus sub-norms before attn_output and ffn_down, "
            "the head tied to the token embeddings (weights here are plain, not ternary)",
        ),
        Family(
            "smallthinker", _BOTH, _qwen3moe_without_qk_norm,
            requires=_MOE, permits=frozenset({"expert_gating"}), rules=(b.experts,),
            summary="SmallThinker: llama attention, routed experts (the router reads the block "
            "input), no NoPE layers without a sliding window",
        ),
        Family(
            "muse-glimmer", _UNTIED, br.muse_glimmer,
            requires=frozenset({"sliding_window", "logit_scale"}),
            permits=frozenset({"swa_pattern", "rope_theta_swa", "final_softcap"}),
            rules=(b.window,),
            summary="Muse Glimmer: an RMS norm on the embeddings, per-head q/k norms, a sigmoid "
            "attention-output gate, post-norms, rope on sliding-window layers only (NoPE on "
            "global ones), logit scale and soft-capping",
        ),
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
        #
        # --- issue 26: token inputs / reused layers (keep this group's entries below this line) ---
        Family(
            "qwen3vl", _BOTH, _qwen3,
            requires=frozenset({"rope_sections"}), rules=(dense.mrope_sections,),
            summary="Qwen3-VL's text tower (text-only file, no deepstack layers): qwen3 layout with "
            "interleaved M-RoPE sections",
        ),
        Family(
            "qwen3vlmoe", _BOTH, _qwen3moe,
            requires=_MOE | {"rope_sections"}, rules=(b.experts, dense.mrope_sections),
            summary="Qwen3-VL-MoE's text tower (30B-A3B): qwen3moe layout with interleaved M-RoPE "
            "sections",
        ),
        Family(
            "qwen3tts", _UNTIED, _qwen3,
            requires=frozenset({"rope_sections"}), rules=(dense.mrope_sections,), output_rows=3072,
            summary="Qwen3-TTS's talker: Qwen3-VL's tower generating codec tokens through a "
            "3072-row codec head (the last 3072 ids of the vocabulary)",
        ),
        Family(
            "talkie", _UNTIED, bt.talkie, requires=frozenset({"logit_scale"}), output_norm=False,
            summary="Talkie-13B: weightless RMS norms, a per-head query gain after rope, every "
            "layer adding the normalised input embedding times its own scale, a logit scale",
        ),
        Family(
            "cogvlm", _BOTH, bt.cogvlm, rules=(bt.cogvlm_shape,),
            summary="CogVLM's language model: llama layout with fused q/k/v and a vision expert's "
            "attention and MLP weights beside the text ones (picked by the batch's modality)",
        ),
        Family(
            "nanbeige", _BOTH, _llama, permits=frozenset({"num_loops"}),
            summary="Nanbeige (looped): llama blocks run num_loops times, each run its own layer "
            "slot and KV, the output norm between loops",
        ),
        #
        # --- issues 25/26: wide stage boundaries (keep this group's entries below this line) ---
        Family(
            "rwkv7", _UNTIED, wide.rwkv7,
            requires=frozenset({"wkv_head_size", "decay_lora_rank", "iclr_lora_rank",
                                "value_residual_mix_lora_rank", "gate_lora_rank", "token_shift_count",
                                "ln_eps"}),
            rules=(rwkv.wkv_heads, wide.two_token_shifts, wide.wkv7_head_width), output_norm_bias=True, inputs=br.input_layer_norm,
            summary="RWKV-7 (Goose): LayerNorm of the embeddings, WKV-7 time mixing with low-rank "
            "decay, in-context learning rate and gate, every layer mixing in the first layer's "
            "values (v_first), squared-ReLU channel mixing",
        ),
        Family(
            "arwkv7", _UNTIED, wide.arwkv7,
            requires=frozenset({"wkv_head_size", "decay_lora_rank", "iclr_lora_rank",
                                "value_residual_mix_lora_rank", "token_shift_count"}),
            permits=frozenset({"gate_lora_rank"}),
            rules=(rwkv.wkv_heads, _one_token_shift, wide.wkv7_head_width),
            summary="ARWKV-7: Qwen2.5 blocks whose attention is RWKV-7 time mixing (RMSNorm, WKV-7 with "
            "the first layer's values mixed into every layer, optional output gate), SwiGLU",
        ),
        Family(
            "gemma3n", _BOTH, wide.gemma3n_block,
            requires=frozenset({"sliding_window", "n_embd_per_layer"}),
            permits=frozenset({"rope_theta_swa", "final_softcap"}),
            rules=(wide.gemma3n_shape,), derived_keys=wide.gemma3n_keys, inputs=wide.gemma3n_inputs,
            summary="Gemma 3n (E2B/E4B): four AltUp streams (predict, run the active one, correct), "
            "LAuReL, per-layer token embeddings, sliding-window and global layers, GeGLU with "
            "activation sparsity, final soft-capping",
        ),
        #
        # --- issue 26: adapter switching (keep this group's entries below this line) ---
        Family(
            "graniteswitch", _BOTH, ba.graniteswitch_block,
            requires=frozenset({"logit_scale", "adapter_count", "adapter_lora_rank", "adapter_tokens",
                                "adapter_substitutes"}),
            permits=frozenset({"embedding_scale", "residual_scale", "attention_scale", "adapter_router_gain"}),
            rules=(ba.graniteswitch_shape,), derived_keys=ba.graniteswitch_keys,
            summary="Granite Switch: granite layers with a fused q/k/v projection and per-slot LoRA "
            "deltas on every projection, the slot picked per token by a router (an attention of its "
            "own over the token ids: the last adapter token in sight), adapter tokens embedded as "
            "their substitutes",
        ),
        #
        # --- issues 25/26: hyper-connections (keep this group's entries below this line) ---
        Family(
            "deepseek4", _UNTIED, hc.deepseek4,
            requires=_MOE | bm.DSA | hc.DEEPSEEK4 | {
                "n_expert_shared", "q_lora_rank", "sliding_window", "expert_gating", "expert_weights_scale",
                "expert_weights_norm",
            },
            rules=(bm.indexer, hc.deepseek4_shape), derived_keys=hc.deepseek4_keys,
            inputs=hc.deepseek4_inputs,
            summary="DeepSeek V4 (Flash): four hyper-connection streams mixed around every sub-block, "
            "sliding-window attention with compressed KV (ratio 4 with a lightning indexer, 128), "
            "grouped low-rank output, hash-routed experts in the first layers, sqrt-softplus routing",
        ),
        Family(
            "hy_v4", _UNTIED, hc.hy_v4,
            requires=_MOE | bm.DSA | hc.HY_V4 | {
                "n_expert_shared", "q_lora_rank", "kv_lora_rank", "v_head_dim", "expert_gating", "n_dense_lead",
            },
            permits=frozenset({"expert_weights_scale", "expert_weights_norm"}),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, bm.indexer, hc.hy_v4_shape),
            derived_keys=hc.hy_v4_keys, inputs=hc.hy_v4_inputs,
            summary="HY V4 (Hunyuan V4): independent hyper-connections (pre/post gates), MLA with an "
            "output gate and sinks, the lightning indexer on full layers (shared layers reuse its top-k), "
            "leading dense blocks, sigmoid experts with a shared one",
        ),
        Family(
            "glm5-next", _UNTIED, hc.glm5_next,
            requires=_MOE | bm.DSA | hc.GLM5_NEXT | {
                "n_expert_shared", "q_lora_rank", "kv_lora_rank", "v_head_dim", "expert_gating", "n_dense_lead",
                "full_attention_interval",
            },
            permits=frozenset({"expert_weights_scale", "expert_weights_norm", "indexer_types"}),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, bm.indexer, hc.glm5_next_shape),
            derived_keys=hc.glm5_next_keys,
            summary="GLM-5.3-Flash (glm5-next): mHC streams around KDA layers and MLA layers with DeepSeek "
            "sparse attention (a k-pooled lightning indexer), leading dense blocks, sigmoid experts",
        ),
        Family(
            "kimi-k3", _UNTIED, hc.kimi_k3,
            requires=_MOE | hc.KIMI_K3 | {
                "n_expert_shared", "q_lora_rank", "kv_lora_rank", "v_head_dim", "expert_gating", "n_dense_lead",
                "full_attention_interval",
            },
            permits=frozenset({"expert_weights_scale", "expert_weights_norm"}),
            rules=(b.mla, b.experts, b.dense_lead_below_n_layer, hc.kimi_k3_shape),
            derived_keys=hc.kimi_k3_keys, inputs=hc.kimi_k3_inputs,
            summary="Kimi-K3: Kimi-Linear's KDA / MLA hybrid (full-rank KDA gate, gated nope MLA) with "
            "cross-layer residual attention over banked layer inputs, latent experts, situ activations",
        ),
        Family(
            "qwen4exp", _UNTIED, hc.qwen4exp,
            requires=bl.DELTA_NET | _MOE | bm.DSA | hc.QWEN4EXP | {"n_ff_shexp", "compress_ratios"},
            permits=frozenset({"full_attention_interval"}) | hc.QWEN4EXP_PLE,
            rules=(bl.delta_net, bl.mrope_sections, bl.every_layer_quantizes, b.experts, hc.qwen4exp_shape),
            derived_keys=hc.qwen4exp_keys, inputs=hc.qwen4exp_inputs, output_norm=False,
            summary="Qwen4-exp: low-rank hyper-connection streams around Qwen3-Next's gated delta-net "
            "layers and gated attention narrowed by a block-pooled indexer, softmax experts with a gated "
            "shared one, n-gram embeddings (PLE) hashed from each token's predecessors on one layer",
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

