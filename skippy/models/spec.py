# Model specifications and named presets for synthetic GGUF models.
#
# Strategy: a `ModelSpec` is a frozen, hashable value that says everything needed to reproduce a
# model file byte for byte (architecture, shape, tokenizer source, weight dtype, head tying, rope
# and norm constants, seed). Validation happens once, in `__post_init__`, so an invalid shape is
# refused before any weight is generated or any cache key is computed. Presets are plain
# functions returning specs; `preset(name, **overrides)` applies `dataclasses.replace` on top, so
# "the benchmark shape, but Q8_0" is one call and still a validated spec.
#
# The shapes of the benchmark presets follow the published configs of Qwen3-0.6B and
# Llama-3.2-1B; llama-3 rope scaling is left out on purpose (it needs a `rope_freqs` tensor and
# changes nothing that the split runtime cares about).
#
# Architectures beyond llama/qwen2/qwen3 are described in `families.py` (which hparams and
# tensors each one has); the spec carries their extra hparams as optional fields whose zero /
# false / empty value means "not in the file". `canonical_dict` leaves such unset fields out, so
# the canonical JSON (and so the file bytes and cache key) of every spec that existed before
# those fields is unchanged.
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Final, Literal, get_args

from skippy.models.blocks_linear import tiny_delta_net
from skippy.models.families import OPTIONAL_KEYS, family, quantized_rows

__all__ = [
    "Architecture",
    "ModelSpec",
    "PRESETS",
    "VocabName",
    "WeightDtype",
    "demo",
    "gemma3_270m",
    "gpt_oss_20b_4l",
    "preset",
    "qwen3moe_30b_a3b_8e",
    "tiny",
]

_AttentionArchitecture = Literal[
    "llama",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "mistral3",
    "olmo2",
    "granite",
    "glm4",
    "qwen2moe",
    "qwen3moe",
    "gpt-oss",
    "glm4moe",
    "deepseek2",
    "gemma",
    "olmoe",
    "smollm3",
    "exaone4",
    "ernie4_5",
    "starcoder2",
    "cohere2",
    "seed_oss",
    "llama4",
    "minimax-m2",
    "dots1",
    "ernie4_5-moe",
    "command-r",
    "internlm2",
    "phi2",
    "stablelm",
    "arcee",
    "olmo",
    "hunyuan-moe",
    "bailingmoe2",
    "exaone",
    "nemotron",
]
# Each group below is one body of work (issues 25 and 26); keep a group's names in its own block.
#
#: Issue 25, SSM state (Mamba layers; pure and hybrid).
_SsmArchitecture = Literal[
    "nemotron_h", "mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "nemotron_h_moe",
    "plamo2",
]
#
#: Issue 25, linear attention (gated delta-net, KDA, lightning attention) and hybrids of it.
_LinearAttentionArchitecture = Literal["qwen35", "qwen35moe", "qwen3next", "minimax-01", "kimi-linear", "bailingmoe3"]
#
#: Issue 25, RWKV and short-convolution families.
_RwkvConvArchitecture = Literal["lfm2", "rwkv6", "rwkv6qwen2", "lfm2moe"]
#
#: Issue 26, dense families the layer-loop rules already covered.
_DenseArchitecture = Literal[
    "baichuan", "xverse", "orion", "refact", "qwen", "codeshell", "plamo", "falcon", "maincoder",
    "pangu-embedded", "chatglm", "jais", "hunyuan_vl", "chameleon", "plamo3", "mellum", "apertus",
    "spark2_5", "maple", "qwen2vl", "paddleocr", "plm", "openelm", "deci", "laguna",
]
#
#: Issue 26, MoE and sparse-attention families the layer-loop rules already covered.
_MoeArchitecture = Literal[
    "deepseek", "dbrx", "grok", "arctic", "cohere2moe", "exaone-moe", "bailingmoe", "grovemoe",
    "hy_v3", "deepseek32", "glm-dsa", "step35", "dots3note", "minimax-m3",
]
#
#: Issue 26, families the grown rules cover (input transforms, loops written differently).
_RuleArchitecture = Literal[
    "gpt2", "starcoder", "bloom", "mpt", "gptneox", "jais2", "granitemoe", "minicpm", "phimoe",
    "hunyuan-dense", "mistral4", "smallthinker", "muse-glimmer", "deepseek2-ocr",
    "afmoe", "granite_swa", "mimo2", "minicpm3", "bitnet",
]
#
#: Issue 26, per-layer token embeddings and cross-layer KV sharing.
_PerLayerArchitecture = Literal["gemma4"]
#
#: Issue 26, token inputs on every stage and layers reused in depth (M-RoPE text towers first).
_TokenArchitecture = Literal["qwen3vl", "qwen3vlmoe", "qwen3tts", "talkie", "cogvlm", "nanbeige"]
#
#: Issues 25/26, wide stage boundaries: a sideband beside the hidden state (patch 0012).
_WideBoundaryArchitecture = Literal["rwkv7", "arwkv7", "gemma3n"]
#
#: Issue 26, per-token adapter switching (a router picks each token's LoRA adapter).
_AdapterArchitecture = Literal["graniteswitch"]
#
#: Issues 25/26, hyper-connections: hc_mult residual streams across the boundary (patch 0013).
_HyperArchitecture = Literal["deepseek4", "hy_v4", "glm5-next", "kimi-k3", "qwen4exp"]
#
Architecture = Literal[
    _AttentionArchitecture, _SsmArchitecture, _LinearAttentionArchitecture, _RwkvConvArchitecture,
    _DenseArchitecture, _MoeArchitecture, _RuleArchitecture, _PerLayerArchitecture,
    _TokenArchitecture,
    _WideBoundaryArchitecture,
    _AdapterArchitecture,
    _HyperArchitecture,
]
#: "harmony": llama-bpe's tokenizer with gpt-oss's Harmony special tokens in its reserved slots
#: (skippy/models/vocab_files.py), for the gpt-oss chat format's special-token path.
VocabName = Literal["llama-spm", "llama-bpe", "qwen2", "harmony"]
WeightDtype = Literal["F32", "F16", "Q8_0"]

ARCHITECTURES: Final = frozenset(get_args(Architecture))
#: The architectures issue 11 adds to llama/qwen2/qwen3.
NEW_ARCHITECTURES: Final[tuple[Architecture, ...]] = (
    "gemma2", "gemma3", "phi3", "mistral3", "olmo2", "granite", "glm4",
    "qwen2moe", "qwen3moe", "gpt-oss", "glm4moe", "deepseek2",
)
#: Further families with writers, beyond issue 11's list.
EXTRA_ARCHITECTURES: Final[tuple[Architecture, ...]] = (
    "gemma", "olmoe", "smollm3", "exaone4", "ernie4_5", "starcoder2", "cohere2", "seed_oss",
    "llama4", "minimax-m2", "dots1", "ernie4_5-moe", "command-r", "internlm2", "phi2",
    "stablelm", "arcee", "olmo", "hunyuan-moe", "bailingmoe2", "exaone", "nemotron",
)
# Issues 25 and 26: one tuple per group, each in its own block.
#: Issue 25, SSM state (Mamba layers; pure and hybrid).
SSM_ARCHITECTURES: Final[tuple[Architecture, ...]] = (
    "nemotron_h", "mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "nemotron_h_moe",
    "plamo2",
)
#
#: Issue 25, linear attention (gated delta-net, KDA, lightning attention) and hybrids of it.
LINEAR_ATTENTION_ARCHITECTURES: Final[tuple[Architecture, ...]] = (
    "qwen35", "qwen35moe", "qwen3next", "minimax-01", "kimi-linear", "bailingmoe3",
)
#
#: Issue 25, RWKV and short-convolution families.
RWKV_CONV_ARCHITECTURES: Final[tuple[Architecture, ...]] = ("lfm2", "rwkv6", "rwkv6qwen2", "lfm2moe")
#
#: Issue 26, dense families the layer-loop rules already covered.
DENSE_ARCHITECTURES: Final[tuple[Architecture, ...]] = get_args(_DenseArchitecture)
#
#: Issue 26, MoE and sparse-attention families the layer-loop rules already covered.
MOE_ARCHITECTURES: Final[tuple[Architecture, ...]] = (
    "deepseek", "dbrx", "grok", "arctic", "cohere2moe", "exaone-moe", "bailingmoe", "grovemoe",
    "hy_v3", "deepseek32", "glm-dsa", "step35", "dots3note", "minimax-m3",
)
#
#: Issue 26, families the grown rules cover (input transforms, loops written differently).
RULE_ARCHITECTURES: Final[tuple[Architecture, ...]] = (
    "gpt2", "starcoder", "bloom", "mpt", "gptneox", "jais2", "granitemoe", "minicpm", "phimoe",
    "hunyuan-dense", "mistral4", "smallthinker", "muse-glimmer", "deepseek2-ocr",
    "afmoe", "granite_swa", "mimo2", "minicpm3", "bitnet",
)
#
#: Issue 26, per-layer token embeddings and cross-layer KV sharing.
PER_LAYER_ARCHITECTURES: Final[tuple[Architecture, ...]] = ("gemma4",)
#
#: Issue 26, token inputs on every stage and layers reused in depth (M-RoPE text towers first).
TOKEN_ARCHITECTURES: Final[tuple[Architecture, ...]] = get_args(_TokenArchitecture)
#
#: Issues 25/26, wide stage boundaries: a sideband beside the hidden state (patch 0012).
WIDE_BOUNDARY_ARCHITECTURES: Final[tuple[Architecture, ...]] = ("rwkv7", "arwkv7", "gemma3n")
#
#: Issue 26, per-token adapter switching.
ADAPTER_ARCHITECTURES: Final[tuple[Architecture, ...]] = get_args(_AdapterArchitecture)
#
#: Issues 25/26, hyper-connections: hc_mult residual streams across the boundary (patch 0013).
HYPER_ARCHITECTURES: Final[tuple[Architecture, ...]] = get_args(_HyperArchitecture)
#
#: Every family added by issues 25 and 26 (the exactness suite's later cases).
LATER_ARCHITECTURES: Final[tuple[Architecture, ...]] = (
    *SSM_ARCHITECTURES, *LINEAR_ATTENTION_ARCHITECTURES, *RWKV_CONV_ARCHITECTURES,
    *DENSE_ARCHITECTURES, *MOE_ARCHITECTURES, *RULE_ARCHITECTURES, *PER_LAYER_ARCHITECTURES,
    *TOKEN_ARCHITECTURES,
    *WIDE_BOUNDARY_ARCHITECTURES,
    *ADAPTER_ARCHITECTURES,
    *HYPER_ARCHITECTURES,
)
assert ARCHITECTURES == {
    "llama", "qwen2", "qwen3", *NEW_ARCHITECTURES, *EXTRA_ARCHITECTURES, *LATER_ARCHITECTURES,
}
VOCABS: Final = frozenset(get_args(VocabName))
WEIGHT_DTYPES: Final = frozenset(get_args(WeightDtype))

#: Q8_0 packs 32 values per block along a row; every quantized row length must be a multiple.
Q8_0_BLOCK: Final = 32


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything that determines a synthetic model file.

    Attributes:
        arch: llama.cpp architecture name written to ``general.architecture``.
        n_layer: number of transformer blocks.
        n_embd: width of the residual stream.
        n_ff: hidden width of the SwiGLU feed-forward block.
        n_head: query heads.
        n_head_kv: key/value heads (grouped-query attention when smaller than ``n_head``).
        head_dim: per-head width; ``None`` means ``n_embd // n_head``. Only qwen3 and llama may
            use a value whose product with ``n_head`` differs from ``n_embd``.
        vocab: which vocab-only GGUF of the llama.cpp tree provides the tokenizer.
        dtype: storage type of the 2-D weight matrices; norms and biases are always F32.
        tied: when true the file has no ``output.weight`` and the head reuses ``token_embd``.
        context_length: ``<arch>.context_length`` (the training context).
        rope_theta: ``<arch>.rope.freq_base``.
        rms_eps: ``<arch>.attention.layer_norm_rms_epsilon``.
        seed: root of every random draw in the file.
        name: ``general.name``; informational only, but part of the cache key.

    The remaining fields are family-specific hparams (see `families.py` for which family
    requires or permits which); 0 / False / "" means absent from the file.

        rope_dim: ``rope.dimension_count`` when rope covers only part of a head (glm4: half);
            0 means the whole head.
        n_expert, n_expert_used: experts per MoE block and how many each token uses.
        n_ff_exp: hidden width of one expert.
        n_ff_shexp: hidden width of qwen2moe's shared expert.
        n_expert_shared: shared experts of glm4moe (each ``n_ff_exp`` wide).
        n_dense_lead: leading blocks with a dense FFN instead of experts (glm4moe).
        expert_weights_scale, expert_weights_norm, expert_gating: routing constants
            (gating 1 = softmax, 2 = sigmoid).
        sliding_window: the local-attention window of SWA layers.
        swa_pattern: every ``swa_pattern``-th layer is global, the others are sliding-window
            (llama.cpp: layer ``il`` is SWA when ``il % swa_pattern < swa_pattern - 1``).
        rope_theta_swa: rope base of the sliding-window layers.
        rope_scaling, rope_scaling_factor, rope_orig_ctx: ``"yarn"`` rope scaling.
        attn_temp_scale: position-dependent attention temperature (mistral3).
        attn_softcap, final_softcap: attention / final logit soft-capping (gemma2).
        embedding_scale, residual_scale, attention_scale, logit_scale: granite's multipliers.
        q_lora_rank, kv_lora_rank, v_head_dim: deepseek2's multi-head latent attention (low-rank
            q, the latent KV width, the per-head value width); ``head_dim`` is then the key
            width qk_nope + qk_rope and ``rope_dim`` qk_rope.
        ln_eps: LayerNorm epsilon of the families that use LayerNorm (starcoder2, cohere2).
        n_moe_layer_step: every n-th block is MoE, the others dense (llama4).
        clamp_kqv: clip q, k and v to +-clamp_kqv (OLMo 1).
        expert_group_scale, n_group_experts, n_ff_chexp: GroveMoE's chunk ("adjugate") experts:
            the weight of their output, experts per group (one chunk expert per group) and
            their width.
        indexer_n_head, indexer_head_size, indexer_top_k: the lightning indexer of DeepSeek
            sparse attention (query heads, the width of its heads, how many keys each query
            keeps).
        kv_lora_rank_swa: the latent KV width of dots3note's sliding-window MLA layers.
        indexer_block_size, indexer_local_blocks: MiniMax sparse attention's blocks of positions
            (its indexer_top_k counts blocks) and how many recent blocks it always keeps.
    """

    arch: Architecture
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int | None = None
    vocab: VocabName = "llama-spm"
    dtype: WeightDtype = "F32"
    tied: bool = False
    context_length: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    name: str = "skippy-synthetic"
    rope_dim: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    n_expert_shared: int = 0
    n_dense_lead: int = 0
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating: int = 0
    sliding_window: int = 0
    swa_pattern: int = 0
    rope_theta_swa: float = 0.0
    rope_scaling: str = ""
    rope_scaling_factor: float = 0.0
    rope_orig_ctx: int = 0
    attn_temp_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attention_scale: float = 0.0
    logit_scale: float = 0.0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    v_head_dim: int = 0
    ln_eps: float = 0.0
    n_moe_layer_step: int = 0
    clamp_kqv: float = 0.0
    # --- issue 25: SSM (keep this group's entries below this line) ---
    # Mamba mixers: conv kernel width, inner width, state size per channel, dt rank (Mamba-2:
    # the number of heads), groups of B/C (Mamba-2). layer_pattern lays out a hybrid, one
    # character per layer: "M" Mamba, "*" attention, "-" dense MLP, "E" experts (see
    # blocks_ssm.py); n_head / n_head_kv / n_ff describe its non-Mamba layers.
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_dt_rank: int = 0
    ssm_n_group: int = 0
    layer_pattern: str = ""
    #
    # --- issue 25: linear attention (keep this group's entries below this line) ---
    # Gated delta-net layers (names of the Hugging Face configs of Qwen3-Next / Qwen3.5):
    # linear_conv_kernel: the causal conv's width (``ssm.conv_kernel``); linear_key_head_dim:
    # the key (and value) head width (``ssm.state_size``); linear_num_key_heads /
    # linear_num_value_heads: ``ssm.group_count`` / ``ssm.time_step_rank`` (``ssm.inner_size``
    # is derived); full_attention_interval: every n-th layer is full attention, the others
    # delta-net.
    linear_conv_kernel: int = 0
    linear_key_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    full_attention_interval: int = 0
    # kda_head_dim: Kimi Delta Attention's head width (``kda.head_dim``); its layers are the
    # full_attention_interval pattern's recurrent ones (KV heads 0 per layer in the file).
    kda_head_dim: int = 0
    # n_nextn: multi-token-prediction (NextN) blocks after the n_layer trunk blocks
    # (``nextn_predict_layers``; ``block_count`` then counts both).
    n_nextn: int = 0
    #
    # --- issue 25: RWKV / short conv (keep this group's entries below this line) ---
    # wkv_head_size: RWKV head width (n_head * wkv_head_size == n_embd); time_mix_extra_dim,
    # time_decay_extra_dim: RWKV-6's low-rank token-shift and decay widths;
    # rescale_every_n_layers: RWKV-6 halves the hidden state after every n-th layer;
    # token_shift_count: shifted rows kept per layer (QRWKV: 1); shortconv_l_cache: LFM2's conv
    # taps; recurrent_layers: the layers of a hybrid without attention (head_count_kv 0 there).
    wkv_head_size: int = 0
    time_mix_extra_dim: int = 0
    time_decay_extra_dim: int = 0
    rescale_every_n_layers: int = 0
    token_shift_count: int = 0
    shortconv_l_cache: int = 0
    recurrent_layers: tuple[int, ...] = ()
    #
    # --- issue 26: dense (keep this group's entries below this line) ---
    max_alibi_bias: float = 0.0  # ALiBi's largest head slope exponent (Jais)
    rope_sections: tuple[int, ...] = ()  # M-RoPE / XD-RoPE: four sections of the rotated half-head
    # per-layer query heads, KV heads and MLP widths (OpenELM, DeciLM, Laguna); layer 0's equal
    # n_head, n_head_kv and n_ff, and each replaces the model-wide key in the file
    layer_n_head: tuple[int, ...] = ()
    layer_n_head_kv: tuple[int, ...] = ()
    layer_n_ff: tuple[int, ...] = ()
    rope_dim_swa: int = 0  # rotary width of the sliding-window layers (Laguna); 0: rope_dim
    #
    # --- issue 26: MoE / sparse attention (keep this group's entries below this line) ---
    expert_group_scale: float = 0.0
    n_group_experts: int = 0
    n_ff_chexp: int = 0
    indexer_n_head: int = 0
    indexer_head_size: int = 0
    indexer_top_k: int = 0
    kv_lora_rank_swa: int = 0
    indexer_block_size: int = 0
    indexer_local_blocks: int = 0
    #
    # --- issue 26: grown rules (keep this group's entries below this line) ---
    #: ALiBi's largest head slope exponent (MPT; BLOOM's loader fixes it at 8).
    max_alibi_bias: float = 0.0
    #
    # --- issue 26: per-layer embeddings / KV sharing (keep this group's entries below this line) ---
    #: Gemma 4: the width of each layer's slice of the per-layer token embeddings, the trailing
    #: layers that reuse the KV of earlier ones, the head width of the sliding-window layers and
    #: the period of the sliding-window pattern (written as the per-layer bool array Gemma 4
    #: reads: layer il is global when (il + 1) % swa_period == 0).
    n_embd_per_layer: int = 0
    n_kv_shared_layers: int = 0
    head_dim_swa: int = 0
    swa_period: int = 0
    #
    # --- issue 26: token inputs / reused layers (keep this group's entries below this line) ---
    #: Nanbeige's loops: the n_layer blocks run num_loops times, one layer slot (and KV) per run,
    #: so the model has n_layer * num_loops layers (``num_loops``).
    num_loops: int = 0
    #
    # --- issues 25/26: wide stage boundaries (keep this group's entries below this line) ---
    #: RWKV-7's low-rank widths: the decay, the in-context learning rate (also layer 0's value
    #: mix), the value-residual mix of the other layers and the output gate.
    decay_lora_rank: int = 0
    iclr_lora_rank: int = 0
    value_residual_mix_lora_rank: int = 0
    gate_lora_rank: int = 0
    #
    # --- issue 26: adapter switching (keep this group's entries below this line) ---
    #: Granite Switch: the LoRA adapters (each with slot 0, the base, stacked per projection), their
    #: rank, the router's gain, the token that activates each adapter and the id it is embedded as.
    adapter_count: int = 0
    adapter_lora_rank: int = 0
    adapter_router_gain: float = 0.0
    adapter_tokens: tuple[int, ...] = ()
    adapter_substitutes: tuple[int, ...] = ()
    #
    # --- issues 25/26: hyper-connections (keep this group's entries below this line) ---
    #: DeepSeek V4: parallel residual streams, hash-routed first layers (experts by token id), the
    #: per-layer KV compression ratio (0: sliding window only; 4: with the lightning indexer; 128)
    #: and the grouped low-rank attention output.
    hc_mult: int = 0
    hash_layer_count: int = 0
    compress_ratios: tuple[int, ...] = ()
    o_group_count: int = 0
    o_lora_rank: int = 0
    #: HY V4: per layer, whether the lightning indexer is the layer's own (1) or the last full
    #: layer's top-k is reused (0, "shared").
    indexer_types: tuple[int, ...] = ()
    #: GLM-5 Next: the lightning indexer scores keys pooled kpool at a time.
    indexer_kpool: int = 0
    #: Kimi-K3: every attn_res_block_size-th layer banks its input for the cross-layer residual
    #: attention; the routed experts run at n_expert_latent wide.
    attn_res_block_size: int = 0
    n_expert_latent: int = 0
    #: Qwen4-exp: the rank of the low-rank stream mixing, and the layers with per-layer n-gram
    #: embeddings (PLE; llama.cpp supports one, a delta-net layer).
    hc_low_rank: int = 0
    ple_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {self.arch!r}")
        if self.vocab not in VOCABS:
            raise ValueError(f"vocab must be one of {sorted(VOCABS)}, got {self.vocab!r}")
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {self.dtype!r}")
        for field in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "context_length"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.n_head % self.n_head_kv != 0:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})"
            )
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head}); "
                "give head_dim explicitly (families with a decoupled head width only)"
            )
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim!r}")
        if self.n_embd_head % 2 != 0:
            raise ValueError(f"head_dim must be even for rope, got {self.n_embd_head}")
        for name in OPTIONAL_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) != (name == "expert_weights_norm"):
                raise ValueError(f"{name} has the wrong type: {value!r}")
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"{name} must not be negative, got {value!r}")
        if self.rope_dim < 0 or self.rope_dim % 2 or self.rope_dim > self.n_embd_head:
            raise ValueError(f"rope_dim must be even and at most head_dim, got {self.rope_dim}")
        if self.arch == "llama" and self.rope_dim not in (0, self.n_embd_head):
            raise ValueError("llama needs rope_dim == head_dim (llama.cpp checks it)")
        errors = family(self.arch).check(self)
        if errors:
            raise ValueError("; ".join(errors))
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError("rope_theta and rms_eps must be positive")
        if any(marker in self.name.lower() for marker in ("phi3", "phi-3")):
            # llama.cpp's vocab loader then sets attributes on "<|endoftext|>", which the
            # shipped vocabularies lack, and fails with unordered_map::at.
            raise ValueError(f"name must not contain 'phi3' / 'phi-3' (got {self.name!r})")
        if self.dtype == "Q8_0":
            for label, width in (
                ("n_embd", self.n_embd),
                ("n_ff", self.n_ff),
                ("n_head * head_dim", self.n_q),
            ):
                if width % Q8_0_BLOCK != 0:
                    raise ValueError(
                        f"Q8_0 rows must be a multiple of {Q8_0_BLOCK} values; {label} is {width}"
                    )
            block = family(self.arch).block
            # every layer: a hybrid's layers differ by kind, not only past the dense lead
            for layer in range(self.n_layer):
                for label, width in quantized_rows(block(self, layer)):
                    if width % Q8_0_BLOCK != 0:
                        raise ValueError(
                            f"Q8_0 rows must be a multiple of {Q8_0_BLOCK} values; "
                            f"{label} rows are {width}"
                        )

    @property
    def n_embd_head(self) -> int:
        """The effective per-head width (``head_dim`` or ``n_embd // n_head``)."""
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def n_q(self) -> int:
        """Width of the query projection output (``n_head * head_dim``)."""
        return self.n_head * self.n_embd_head

    @property
    def n_kv(self) -> int:
        """Width of the key and value projection outputs (``n_head_kv * head_dim``)."""
        return self.n_head_kv * self.n_embd_head

    @property
    def key_length(self) -> int:
        """``attention.key_length``: the head width, or for MLA the cached latent + rope key."""
        return self.kv_lora_rank + self.n_rot if self.kv_lora_rank else self.n_embd_head

    @property
    def value_length(self) -> int:
        """``attention.value_length``: the head width, or for MLA the cached latent."""
        return self.kv_lora_rank or self.n_embd_head

    @property
    def n_rot(self) -> int:
        """Rotary width per head (``rope_dim`` or the whole head)."""
        return self.rope_dim or self.n_embd_head

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dict (stable order), for hashing and display."""
        return dataclasses.asdict(self)

    def canonical_dict(self) -> dict[str, Any]:
        """The fields that identify the file: every base field, plus each family field that is
        set (so specs written before the family fields existed keep their canonical form)."""
        return {
            key: value
            for key, value in self.as_dict().items()
            if key in _BASE_FIELDS or value != _FIELD_DEFAULTS[key]
        }

    def short_name(self) -> str:
        """A readable file-name stem, e.g. ``qwen3-28x1024-F16-tied``."""
        head = "tied" if self.tied else "untied"
        experts = f"-{self.n_expert}e{self.n_expert_used}" if self.n_expert else ""
        return f"{self.arch}-{self.n_layer}x{self.n_embd}{experts}-{self.vocab}-{self.dtype}-{head}"


#: The fields ModelSpec had before family-specific hparams existed; always canonical.
_BASE_FIELDS: Final = frozenset(
    {
        "arch", "n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "vocab",
        "dtype", "tied", "context_length", "rope_theta", "rms_eps", "seed", "name",
    }
)
_FIELD_DEFAULTS: Final[dict[str, Any]] = {
    f.name: f.default for f in dataclasses.fields(ModelSpec)
}


def tiny(
    arch: Architecture = "llama",
    *,
    dtype: WeightDtype = "F32",
    tied: bool | None = None,
    vocab: VocabName = "llama-spm",
    n_layer: int = 4,
    n_embd: int = 64,
    seed: int = 0,
) -> ModelSpec:
    """A test-sized model: 4 layers, n_embd 64, n_ff 128, 4 query / 2 KV heads.

    qwen3 gets ``head_dim = 32`` (so ``n_head * head_dim = 128 != n_embd``), exercising the
    decoupled head width that real Qwen3 checkpoints use; so do the other families whose real
    checkpoints decouple it (gemma3, mistral3, qwen3moe, gpt-oss, glm4moe, ernie4_5, seed_oss;
    deepseek2's MLA key width is 48 = 32 + 16 rope). The default vocab is the 32000-token SPM
    one, which keeps the embedding at 8 MB in F32.

    Family constants (see `_TINY_EXTRAS`): sliding-window families get a window of 8 with every
    other layer global (cohere2: every 4th), so a 12-token prompt crosses the window and a
    4-layer model has both layer kinds; MoE families get 8 experts of which 2 are used (so
    routing picks different experts per token); granite gets non-trivial multipliers (12, 0.22,
    1/128, 8); glm4 and glm4moe rotate half of each head, as the real models do.

    Args:
        arch: the llama.cpp architecture.
        dtype: weight storage type.
        tied: share the output head with the token embedding; ``None`` is the family's first
            option (untied, except where the loader only has a tied head: gemma, gemma2,
            cohere2).
        vocab: tokenizer source.
        n_layer: number of blocks.
        n_embd: residual width (a multiple of 32 keeps Q8_0 valid).
        seed: random seed.

    Returns:
        The validated spec.
    """
    if tied is None:
        tied = False not in family(arch).heads
    decoupled = arch in _DECOUPLED_HEADS
    fields: dict[str, Any] = {
        "arch": arch,
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_ff": 2 * n_embd,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim": (n_embd // 2) if decoupled else None,
        "vocab": vocab,
        "dtype": dtype,
        "tied": tied,
        "context_length": 2048,
        "rope_theta": 10000.0,
        "rms_eps": 1e-6 if arch != "llama" else 1e-5,
        "seed": seed,
        "name": f"skippy-tiny-{arch}".replace("phi3", "phi"),
    }
    fields.update(_TINY_EXTRAS.get(arch, _no_extras)(n_embd))
    return ModelSpec(**fields)


def _tiny_deepseek2(n_embd: int) -> dict[str, Any]:
    # DeepSeek-V3's ratios at width 64: q_lora 32, kv_lora 64, qk_nope 32 + qk_rope 16 keys,
    # values of 32, one leading dense block, sigmoid routing with a selection bias.
    return {
        **_tiny_moe(n_embd), "n_head_kv": 1, "head_dim": n_embd // 2 + n_embd // 4,
        "rope_dim": n_embd // 4, "q_lora_rank": n_embd // 2, "kv_lora_rank": n_embd,
        "v_head_dim": n_embd // 2, "n_dense_lead": 1, "n_expert_shared": 1, "expert_gating": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5,
    }


def _tiny_dsa(n_embd: int) -> dict[str, Any]:
    # The lightning indexer: 2 heads of 64 (llama.cpp rotates its keys with a Hadamard matrix,
    # whose size is a multiple of 64), each query keeping its 8 best keys, so over the tests'
    # 20-token prompt most queries attend to a subset of the positions they could see.
    del n_embd
    return {"indexer_n_head": 2, "indexer_head_size": 64, "indexer_top_k": 8}


#: Families whose tiny shape has head_dim = n_embd / 2 (n_head * head_dim != n_embd).
_DECOUPLED_HEADS: Final = frozenset(
    {
        "qwen3", "gemma3", "mistral3", "qwen3moe", "gpt-oss", "glm4moe", "ernie4_5", "seed_oss",
        "minimax-m2", "ernie4_5-moe",
    }
)

#: The tiny sliding window: shorter than the tests' 12-token prompt.
TINY_SLIDING_WINDOW: Final = 8


def _no_extras(n_embd: int) -> dict[str, Any]:
    del n_embd
    return {}


def _tiny_moe(n_embd: int) -> dict[str, Any]:
    return {"n_expert": 8, "n_expert_used": 2, "n_ff_exp": n_embd // 2}


def _tiny_mamba2(n_embd: int) -> dict[str, Any]:
    return {
        "ssm_d_conv": 4, "ssm_d_inner": 2 * n_embd, "ssm_d_state": 16, "ssm_dt_rank": 8,
        "ssm_n_group": 2,
    }


_TINY_EXTRAS: Final[dict[str, Callable[[int], dict[str, Any]]]] = {
    "gemma2": lambda n: {
        "sliding_window": TINY_SLIDING_WINDOW, "swa_pattern": 2,
        "attn_softcap": 50.0, "final_softcap": 30.0,
    },
    "gemma3": lambda n: {
        "sliding_window": TINY_SLIDING_WINDOW, "swa_pattern": 2, "rope_theta_swa": 10000.0,
    },
    # yarn over a 16-token original context and the attention temperature floor at 16
    # positions: a 12-token prompt plus 16 decode steps crosses it.
    "mistral3": lambda n: {
        "rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_orig_ctx": 16,
        "attn_temp_scale": 0.1,
    },
    "granite": lambda n: {
        "embedding_scale": 12.0, "residual_scale": 0.22, "attention_scale": 0.0078125,
        "logit_scale": 8.0,
    },
    "glm4": lambda n: {"rope_dim": n // 8},  # half of the n_embd / 4 head
    "qwen2moe": lambda n: {**_tiny_moe(n), "n_ff_shexp": n},
    "qwen3moe": _tiny_moe,
    "gpt-oss": lambda n: {
        **_tiny_moe(n), "n_ff_exp": n, "sliding_window": TINY_SLIDING_WINDOW, "swa_pattern": 2,
        "rope_scaling": "yarn", "rope_scaling_factor": 32.0, "rope_orig_ctx": 4096,
    },
    "glm4moe": lambda n: {
        **_tiny_moe(n), "rope_dim": n // 4, "n_dense_lead": 1, "n_expert_shared": 1,
        "expert_gating": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5,
    },
    "deepseek2": _tiny_deepseek2,
    # OLMoE: MHA, experts as wide as n_ff (half the tiny n_ff).
    "olmoe": lambda n: {"n_head_kv": 4, "n_ff": n // 2, "n_expert": 8, "n_expert_used": 2},
    "starcoder2": lambda n: {"ln_eps": 1e-5},
    "cohere2": lambda n: {
        "ln_eps": 1e-5, "logit_scale": 0.25, "sliding_window": TINY_SLIDING_WINDOW,
        "swa_pattern": 4,
    },
    # Llama 4: every 2nd block MoE (Maverick's interleave), top-1 of 8 experts plus the shared
    # one; layer 3 has no rope (every 4th).
    "llama4": lambda n: {**_tiny_moe(n), "n_expert_used": 1, "n_moe_layer_step": 2},
    "minimax-m2": lambda n: {
        **_tiny_moe(n), "n_ff": n // 2, "rope_dim": n // 4, "expert_gating": 2,
    },
    "dots1": lambda n: {
        **_tiny_moe(n), "n_head_kv": 4, "n_dense_lead": 1, "n_expert_shared": 1,
        "expert_gating": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5,
    },
    "ernie4_5-moe": lambda n: {
        **_tiny_moe(n), "n_moe_layer_step": 1, "n_dense_lead": 1, "n_ff_shexp": n,
    },
    "command-r": lambda n: {"ln_eps": 1e-5, "logit_scale": 0.0625},
    # Phi-2 / StableLM 2 rotate 40% / 25% of each head: here half / a quarter of 16.
    "phi2": lambda n: {"ln_eps": 1e-5, "rope_dim": n // 8},
    "stablelm": lambda n: {"ln_eps": 1e-5, "rope_dim": n // 16},
    # OLMo-7B-0424 clips q/k/v at 8; at this width 1.5 clips some of the tiny model's values.
    "olmo": lambda n: {"ln_eps": 1e-5, "clamp_kqv": 1.5},
    "hunyuan-moe": lambda n: {**_tiny_moe(n), "n_ff": n // 2, "n_ff_shexp": n},
    "bailingmoe2": lambda n: {
        **_tiny_moe(n), "rope_dim": n // 8, "n_dense_lead": 1, "n_expert_shared": 1,
        "expert_gating": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5,
    },
    "nemotron": lambda n: {"ln_eps": 1e-5, "rope_dim": n // 8},
    # --- issue 25: SSM (keep this group's entries below this line) ---
    # Hybrids lay out 4 layers so that the test splits cut inside a run of Mamba layers (1:),
    # between a Mamba and an attention layer (2:) and after attention (3:). Mamba-2 mixers:
    # d_inner 2 n_embd in 8 heads of 16, 2 groups, d_state 16, conv width 4.
    "nemotron_h": lambda n: {**_tiny_mamba2(n), "layer_pattern": "MM*-", "ln_eps": 1e-5},
    "nemotron_h_moe": lambda n: {
        **_tiny_mamba2(n), **_tiny_moe(n), "layer_pattern": "MM*E", "ln_eps": 1e-5,
        "n_ff_shexp": n, "expert_weights_norm": True, "expert_weights_scale": 2.5,
    },
    "mamba2": _tiny_mamba2,
    "falcon-h1": _tiny_mamba2,
    # Mamba-1 mixers: dt rank 32 (a Q8_0 row), d_state 16, conv width 4.
    "mamba": lambda n: {
        "ssm_d_conv": 4, "ssm_d_inner": 2 * n, "ssm_d_state": 16, "ssm_dt_rank": n // 2,
    },
    "jamba": lambda n: {
        "ssm_d_conv": 4, "ssm_d_inner": 2 * n, "ssm_d_state": 16, "ssm_dt_rank": n // 2,
        "layer_pattern": "MM*M", "n_expert": 8, "n_expert_used": 2,
    },
    # Granite 4.0-H-Tiny's kind: experts of width n_ff (here n_embd / 2) plus a shared expert.
    "granitehybrid": lambda n: {
        **_tiny_mamba2(n), "layer_pattern": "MM*M", "n_ff": n // 2, "n_expert": 8,
        "n_expert_used": 2, "n_ff_shexp": n, "embedding_scale": 12.0, "residual_scale": 0.22,
        "attention_scale": 0.0078125, "logit_scale": 8.0,
    },
    # PLaMo 2's mixer: 8 heads over d_inner 2 n_embd, no groups (the loader wants group_count 0).
    "plamo2": lambda n: {
        "ssm_d_conv": 4, "ssm_d_inner": 2 * n, "ssm_d_state": 16, "ssm_dt_rank": 8,
        "layer_pattern": "MM*M",
    },
    #
    # --- issue 25: linear attention (keep this group's entries below this line) ---
    # Qwen3.5: delta-net layers with full attention every 3rd (see tiny_delta_net).
    "qwen35": tiny_delta_net,
    # Qwen3.5-MoE / Qwen3-Next: the same layers; 8 experts of which 2 are used, a gated shared
    # expert as wide as n_embd.
    "qwen35moe": lambda n: {**tiny_delta_net(n), **_tiny_moe(n), "n_ff_shexp": n},
    "qwen3next": lambda n: {**tiny_delta_net(n), **_tiny_moe(n), "n_ff_shexp": n},
    # MiniMax-Text-01: lightning attention with softmax attention every 3rd layer (R R A R, as
    # above), half of each head rotated, experts as wide as n_ff, residual scale 2.
    "minimax-01": lambda n: {
        **_tiny_moe(n), "n_ff": n // 2, "n_ff_exp": n // 2, "rope_dim": n // 8,
        "full_attention_interval": 3, "residual_scale": 2.0,
    },
    # Kimi-Linear: KDA (heads of 32) with MLA every 3rd layer (R R A R; MLA widths as the tiny
    # deepseek2's, one latent KV head), a leading dense block, sigmoid experts plus a shared one.
    "kimi-linear": lambda n: {
        **_tiny_deepseek2(n), "q_lora_rank": 0, "expert_weights_norm": False,
        "kda_head_dim": n // 2, "linear_conv_kernel": 4, "full_attention_interval": 3,
    },
    # Ling 2.5 (bailingmoe3): the same layer pattern, low-rank q as the tiny deepseek2's.
    "bailingmoe3": lambda n: {
        **_tiny_deepseek2(n), "kda_head_dim": n // 2, "linear_conv_kernel": 4,
        "full_attention_interval": 3,
    },
    #
    # --- issue 25: RWKV / short conv (keep this group's entries below this line) ---
    # LFM2: conv, conv, attention, conv, so the tests' cuts fall inside the run of conv layers
    # (at 1), between a conv and an attention layer (at 2) and after the attention one (at 3).
    "lfm2": lambda n: {"shortconv_l_cache": 3, "recurrent_layers": (0, 1, 3)},
    # LFM2-MoE: the same layer kinds; block 0 dense, then top-2 of 8 sigmoid-routed experts.
    "lfm2moe": lambda n: {
        **_tiny_moe(n), "shortconv_l_cache": 3, "recurrent_layers": (0, 1, 3), "n_dense_lead": 1,
        "expert_gating": 2,
    },
    # RWKV-6: heads of 16, low-rank widths of a quarter / an eighth of n_embd, the hidden state
    # halved after every 2nd layer (the real models: every 6th).
    "rwkv6": lambda n: {
        "n_head_kv": 4, "wkv_head_size": 16, "time_mix_extra_dim": n // 4,
        "time_decay_extra_dim": n // 8, "rescale_every_n_layers": 2, "ln_eps": 1e-5,
    },
    # QRWKV-6: GQA k/v (2 of the 4 WKV heads), one token-shift row per layer.
    "rwkv6qwen2": lambda n: {
        "wkv_head_size": 16, "time_mix_extra_dim": n // 4, "time_decay_extra_dim": n // 8,
        "token_shift_count": 1,
    },
    #
    # --- issue 26: dense (keep this group's entries below this line) ---
    # LayerNorm families; Jais's ALiBi at its real maximum bias; half-width rope for chatglm;
    # the decoupled head width where the loader allows it; sliding-window layers (window 8,
    # every other layer global) with their own rope base for plamo3 and mellum.
    "orion": lambda n: {"ln_eps": 1e-5},
    "qwen": lambda n: {"n_head_kv": 4},
    "codeshell": lambda n: {"ln_eps": 1e-5},
    "falcon": lambda n: {"ln_eps": 1e-5, "n_head_kv": 1},
    "jais": lambda n: {"ln_eps": 1e-5, "max_alibi_bias": 8.0},
    "chatglm": lambda n: {"rope_dim": n // 8},
    "refact": lambda n: {"head_dim": n // 2},
    "maincoder": lambda n: {"head_dim": n // 2},
    "pangu-embedded": lambda n: {"head_dim": n // 2},
    # M-RoPE sections covering the rotated half-head: Qwen2-VL's and PaddleOCR-VL's 16:24:24:0
    # ratio (the fourth section empty), HunyuanOCR's four equal XD-RoPE sections.
    "hunyuan_vl": lambda n: {"head_dim": n // 2, "rope_sections": (n // 16,) * 4},
    "qwen2vl": lambda n: {"rope_sections": (n // 32, 3 * n // 64, 3 * n // 64, 0)},
    "paddleocr": lambda n: {
        "head_dim": n // 2, "rope_sections": (n // 16, 3 * n // 32, 3 * n // 32, 0),
    },
    "plamo3": lambda n: {
        "head_dim": n // 2, "sliding_window": TINY_SLIDING_WINDOW, "swa_pattern": 2,
        "rope_theta_swa": 1000.0,
    },
    "mellum": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "sliding_window": TINY_SLIDING_WINDOW,
        "swa_pattern": 2, "rope_theta_swa": 1000.0,
    },
    "apertus": lambda n: {"head_dim": n // 2},
    # OpenELM's layer-wise scaling (heads and MLP width grow with depth, 4 queries per KV head
    # at the top); Nemotron-51B's kinds of layers: attention, attention-free, "linear".
    "openelm": lambda n: {
        "head_dim": 16, "n_head": 2, "n_head_kv": 1, "n_ff": n, "layer_n_head": (2, 4, 4, 8),
        "layer_n_head_kv": (1, 1, 2, 2), "layer_n_ff": (n, 2 * n, 3 * n, 4 * n),
    },
    "deci": lambda n: {
        "layer_n_head": (4, 0, 4, 4), "layer_n_head_kv": (2, 0, 0, 2),
        "layer_n_ff": (2 * n, n, 3 * n, 2 * n),
    },
    # Laguna XS.2's layout at width 64: global layers (0, 2) with 4 heads, yarn over half of
    # each 32-wide head, sliding-window layers (1, 3) with 8 heads and plain rope over the whole
    # head; block 0 dense, then 8 sigmoid experts (2 used) plus a shared one.
    "laguna": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "rope_dim": n // 4, "rope_dim_swa": n // 2,
        "layer_n_head": (4, 8, 4, 8), "n_ff_shexp": n, "n_dense_lead": 1, "expert_gating": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5,
        "sliding_window": TINY_SLIDING_WINDOW, "swa_pattern": 2, "rope_theta": 500000.0,
        "rope_theta_swa": 10000.0, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
        "rope_orig_ctx": 16,
    },
    # PLM-1.8B's ratios at width 64: keys of 32 nope + 16 rope, values of 32, a latent of 32.
    "plm": lambda n: {
        "n_head_kv": 4, "head_dim": n // 2 + n // 4, "rope_dim": n // 4, "kv_lora_rank": n // 2,
        "v_head_dim": n // 2,
    },
    "spark2_5": lambda n: {"sliding_window": TINY_SLIDING_WINDOW, "rope_theta_swa": 1000.0},
    "maple": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "sliding_window": TINY_SLIDING_WINDOW,
        "rope_theta_swa": 1000.0,
    },
    #
    # --- issue 26: MoE / sparse attention (keep this group's entries below this line) ---
    # DeepSeek-MoE 16B: one leading dense block, shared experts, softmax routing.
    "deepseek": lambda n: {**_tiny_moe(n), "n_dense_lead": 1, "n_expert_shared": 1},
    # DBRX clips q/k/v at 8; at this width 1.5 clips some values. Experts n_ff wide.
    "dbrx": lambda n: {
        "ln_eps": 1e-5, "clamp_kqv": 1.5, "n_ff": n // 2, "n_expert": 8, "n_expert_used": 2,
    },
    # Grok: the loader's defaults (embedding x78.4, attention softcap 30 and output scale,
    # router softcap 30, logit scale 0.577) stay in effect; Grok 2's dense FFN beside experts.
    "grok": _tiny_moe,
    "arctic": lambda n: {"n_ff": n // 2, "n_expert": 8, "n_expert_used": 2},
    # Cohere2 MoE: window 8 on odd layers (dense_first pattern 2), the leading dense block and
    # the even layers global (the latter without rope), a shared expert, sigmoid routing.
    "cohere2moe": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "sliding_window": TINY_SLIDING_WINDOW,
        "swa_pattern": 2, "logit_scale": 0.25, "n_dense_lead": 1, "n_expert_shared": 1,
        "expert_gating": 2, "expert_weights_norm": True,
    },
    "exaone-moe": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "sliding_window": TINY_SLIDING_WINDOW,
        "swa_pattern": 2, "n_dense_lead": 1, "n_expert_shared": 1, "n_ff_shexp": n // 2,
        "expert_gating": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5,
    },
    "bailingmoe": lambda n: {
        **_tiny_moe(n), "n_expert_shared": 1, "expert_weights_norm": True,
    },
    # GroveMoE: 4 chunk experts (one per 2 experts) of width 32, weighted 0.5.
    "grovemoe": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "expert_group_scale": 0.5, "n_group_experts": 2,
        "n_ff_chexp": n // 2,
    },
    "hy_v3": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "n_dense_lead": 1, "n_ff_shexp": n // 2,
        "expert_gating": 2, "expert_weights_norm": True, "expert_weights_scale": 2.5,
    },
    "deepseek32": lambda n: {**_tiny_deepseek2(n), **_tiny_dsa(n)},
    # GLM-5's layout (every layer has its own indexer: a 2048-token training context); the
    # tests give GLM-5.2's shared-indexer layers a context of GLM_5_2_CONTEXT.
    "glm-dsa": lambda n: {**_tiny_deepseek2(n), **_tiny_dsa(n)},
    # dots3note: layers 0-2 a window of 8 with a latent of 32, layer 3 sparse full attention.
    "dots3note": lambda n: {
        **_tiny_deepseek2(n), **_tiny_dsa(n), "kv_lora_rank_swa": n // 2,
        "sliding_window": TINY_SLIDING_WINDOW, "rope_theta_swa": 10000.0,
    },
    # MiniMax-M3: blocks of 4 positions, each query keeping its 2 best blocks (the latest one
    # always among them), so over the 20-token prompt (5 blocks) later queries drop positions.
    "minimax-m3": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "rope_dim": n // 4, "n_dense_lead": 1,
        "n_expert_shared": 1, "expert_gating": 2, "expert_weights_norm": True,
        "expert_weights_scale": 2.5, "indexer_n_head": 2, "indexer_head_size": n // 2,
        "indexer_top_k": 2, "indexer_block_size": 4, "indexer_local_blocks": 1,
    },
    # Step 3.5: layer 0 full attention (and the dense block), layers 1-3 a window of 8.
    "step35": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "sliding_window": TINY_SLIDING_WINDOW,
        "n_dense_lead": 1, "n_ff_shexp": n // 2, "expert_gating": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5,
    },
    #
    # --- issue 26: grown rules (keep this group's entries below this line) ---
    # GPT-2 and BLOOM are MHA, StarCoder multi-query; MPT clamps q/k/v (as DBRX and some MPT
    # fine-tunes do) at a value the tiny model's activations cross.
    "gpt2": lambda n: {"ln_eps": 1e-5, "n_head_kv": 4},
    "starcoder": lambda n: {"ln_eps": 1e-5, "n_head_kv": 1},
    "bloom": lambda n: {"ln_eps": 1e-5, "n_head_kv": 4},
    "mpt": lambda n: {"ln_eps": 1e-5, "n_head_kv": 4, "max_alibi_bias": 8.0, "clamp_kqv": 1.5},
    # Pythia rotates a quarter of each head (rotary_pct 0.25).
    "gptneox": lambda n: {"ln_eps": 1e-5, "n_head_kv": 4, "rope_dim": n // 16},
    "jais2": lambda n: {"ln_eps": 1e-5},
    "granitemoe": lambda n: {
        "n_expert": 8, "n_expert_used": 2, "n_ff": n // 2, "n_ff_shexp": n,
        "embedding_scale": 12.0, "residual_scale": 0.22, "attention_scale": 0.0078125,
        "logit_scale": 8.0,
    },
    # MiniCPM's own defaults at 4 layers of 64: scale_emb 12, 1.4 / sqrt(4), 256 / 64.
    "minicpm": lambda n: {"embedding_scale": 12.0, "residual_scale": 0.7, "logit_scale": 4.0},
    "phimoe": lambda n: {"n_expert": 8, "n_expert_used": 2, "n_ff": n // 2},
    "mistral4": lambda n: _tiny_deepseek2(n),
    "smallthinker": lambda n: {**_tiny_moe(n), "expert_gating": 1},
    "mimo2": lambda n: {**_tiny_moe(n), "n_dense_lead": 1, "sliding_window": TINY_SLIDING_WINDOW},
    # MiniCPM3-4B's ratios: q_lora 768 / kv_lora 256 of 2560, rope 32 of 96-wide keys.
    "minicpm3": lambda n: {"n_head_kv": 4, "q_lora_rank": n // 2, "rope_dim": n // 8},
    "granite_swa": lambda n: {
        "sliding_window": TINY_SLIDING_WINDOW, "embedding_scale": 12.0, "residual_scale": 0.22,
        "attention_scale": 0.0078125, "logit_scale": 8.0,
    },
    "afmoe": lambda n: {
        **_tiny_moe(n), "n_dense_lead": 1, "n_expert_shared": 1, "expert_gating": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5,
        "sliding_window": TINY_SLIDING_WINDOW, "swa_pattern": 2, "rope_theta_swa": 10000.0,
    },
    # DeepSeek-OCR's decoder: MHA, one leading dense block, 2 of 8 experts plus a shared one.
    "deepseek2-ocr": lambda n: {
        **_tiny_moe(n), "n_head_kv": 4, "n_dense_lead": 1, "n_expert_shared": 1,
        "expert_weights_scale": 1.0,
    },
    "muse-glimmer": lambda n: {
        "sliding_window": TINY_SLIDING_WINDOW, "swa_pattern": 2, "rope_theta_swa": 10000.0,
        "logit_scale": 0.5, "final_softcap": 30.0,
    },
    #
    # --- issue 26: per-layer embeddings / KV sharing (keep this group's entries below this line) ---
    # Gemma 4 E2B's layout at width 64: per-layer inputs of 32, global heads of 32 and local ones
    # of 16, layers 1 and 3 global (both kinds on every multi-layer stage), final soft-capping.
    # No KV sharing: the exactness suite's cuts 1, 2 and 3 must all be legal (the sharing has
    # its own test, with its own shape).
    "gemma4": lambda n: {
        "head_dim": n // 2, "head_dim_swa": n // 4, "n_embd_per_layer": n // 2,
        "sliding_window": TINY_SLIDING_WINDOW, "swa_period": 2, "rope_theta_swa": 10000.0,
        "final_softcap": 30.0,
    },
    #
    # --- issue 26: token inputs / reused layers (keep this group's entries below this line) ---
    # Qwen3-VL's interleaved M-RoPE sections 24:20:20 of a 128-wide head, at a 32-wide one
    # (6:5:5); no deepstack layers (a text-only file has none). Qwen3-TTS's talker is the same
    # tower with a 3072-row codec head.
    "qwen3vl": lambda n: {"head_dim": n // 2, "rope_sections": (6 * n // 64, 5 * n // 64, 5 * n // 64, 0)},
    "qwen3vlmoe": lambda n: {
        **_tiny_moe(n), "head_dim": n // 2, "rope_sections": (6 * n // 64, 5 * n // 64, 5 * n // 64, 0),
    },
    "qwen3tts": lambda n: {"head_dim": n // 2, "rope_sections": (6 * n // 64, 5 * n // 64, 5 * n // 64, 0)},
    # Talkie's logit scale; CogVLM is MHA (its graph views q/k/v out of a 3 n_embd projection).
    "talkie": lambda n: {"logit_scale": 2.0},
    "cogvlm": lambda n: {"n_head_kv": 4},
    # Nanbeige looped twice over 2 blocks: 4 layer slots, the output norm between the loops; every
    # test split has a stage whose slots run a block that another stage runs too.
    "nanbeige": lambda n: {"n_layer": 2, "num_loops": 2},
    #
    # --- issues 25/26: wide stage boundaries (keep this group's entries below this line) ---
    # RWKV-7: one head of 64 (the real models' head width; ggml's CPU WKV-7 kernel reads whole
    # 32- or 64-float blocks of a head), low-rank widths of a quarter / an eighth of n_embd (the
    # value mix narrower than layer 0's iclr width, as in the real models).
    "rwkv7": lambda n: {
        "n_head": n // 64, "n_head_kv": n // 64, "wkv_head_size": 64, "decay_lora_rank": n // 4, "iclr_lora_rank": n // 4,
        "value_residual_mix_lora_rank": n // 8, "gate_lora_rank": n // 2, "token_shift_count": 2,
        "ln_eps": 1e-5,
    },
    # ARWKV-7: the same time mixing without the gate, one token-shift row per layer.
    "arwkv7": lambda n: {
        "n_head": n // 64, "n_head_kv": n // 64, "wkv_head_size": 64, "decay_lora_rank": n // 4,
        "iclr_lora_rank": n // 4, "value_residual_mix_lora_rank": n // 8, "token_shift_count": 1,
    },
    # Gemma 3n (E2B layout at width 64): per-layer inputs of 256 (llama.cpp's fixed width), layers
    # 1 and 3 global, the others sliding-window (window 8), final soft-capping.
    "gemma3n": lambda n: {
        "n_embd_per_layer": 256, "sliding_window": TINY_SLIDING_WINDOW, "swa_period": 2,
        "rope_theta_swa": 10000.0, "final_softcap": 30.0,
    },
    #
    # --- issue 26: adapter switching (keep this group's entries below this line) ---
    # Granite Switch: granite's multipliers, two adapters of rank 32 (Q8_0 rows) activated by
    # tokens 3 and 14 of the tests' 20-token prompt (",", "a"), so the prompt's rows run the base
    # slot, then adapter 1, then the router's answer with both adapter tokens in sight.
    "graniteswitch": lambda n: {
        "embedding_scale": 12.0, "residual_scale": 0.22, "attention_scale": 0.0078125, "logit_scale": 8.0,
        "adapter_count": 2, "adapter_lora_rank": 32, "adapter_router_gain": 15.0,
        "adapter_tokens": (29892, 263), "adapter_substitutes": (1919, 278),
    },
    #
    # --- issues 25/26: hyper-connections (keep this group's entries below this line) ---
    # DeepSeek V4 (Flash's layout at width 64): four streams, one 64-wide KV head beside 4 query
    # heads (rope over 16), a sliding window of 8; layers 0 and 1 hash-routed (a cut at 1 leaves
    # one on the later stage), compression ratios 4 (with a 2-head indexer keeping its 2 best
    # compressed blocks, so a 20-token prompt attends to a subset), 0, 128 and 4; sqrt-softplus
    # routing over 8 experts (2 used) plus a shared one; the output grouped in 2 of rank 16.
    "deepseek4": lambda n: {
        **_tiny_moe(n), "n_head_kv": 1, "head_dim": 64, "rope_dim": 16, "q_lora_rank": n // 2,
        "sliding_window": TINY_SLIDING_WINDOW, "n_expert_shared": 1, "expert_gating": 4,
        "expert_weights_norm": True, "expert_weights_scale": 1.5,
        "indexer_n_head": 2, "indexer_head_size": 64, "indexer_top_k": 2,
        "hc_mult": 4, "hash_layer_count": 2, "compress_ratios": (4, 0, 128, 4),
        "o_group_count": 2, "o_lora_rank": n // 4,
    },
    # HY V4 (Hunyuan V4's layout at width 64): four independent streams, deepseek2's tiny MLA
    # (q_lora 32, kv_lora 64, keys 32 + 16 rope, values 32) with its output gate and sinks, a
    # 2-head indexer keeping 8 of the 20-token prompt's keys on every layer (the shared-indexer
    # layout has its own test: a cut may not fall before a shared layer), one leading dense block,
    # sigmoid experts with a shared one.
    "hy_v4": lambda n: {
        **_tiny_deepseek2(n), "hc_mult": 4, "indexer_n_head": 2, "indexer_head_size": 64, "indexer_top_k": 8,
        "indexer_types": (1, 1, 1, 1),
    },
    # GLM-5 Next at width 64: Kimi-Linear's tiny layer pattern (KDA, KDA, MLA + DSA, KDA: a cut
    # inside the KDA run, one on each side of the attention layer), deepseek2's tiny MLA with 64-wide
    # nope keys (no rope: Q8_0 rows of 32), a 2-head
    # indexer keeping 8 keys pooled 4 at a time, four mHC streams, one dense block, sigmoid experts.
    "glm5-next": lambda n: {
        **_tiny_deepseek2(n), "head_dim": n, "hc_mult": 4, "kda_head_dim": n // 2, "linear_conv_kernel": 4,
        "full_attention_interval": 3, "indexer_n_head": 2, "indexer_head_size": 64, "indexer_top_k": 8,
        "indexer_kpool": 4,
    },
    # Kimi-K3 at width 64: Kimi-Linear's tiny pattern (KDA, KDA, MLA, KDA), a bank every 2 layers (so
    # the test cuts hand on 1, 1 and 2 banked rows: widths 2, 2 and 3 x n_embd, a middle stage taking
    # 2 and giving 3), routed experts at 32 wide.
    "kimi-k3": lambda n: {
        **_tiny_deepseek2(n), "kda_head_dim": n // 2, "linear_conv_kernel": 4, "full_attention_interval": 3,
        "attn_res_block_size": 2, "n_expert_latent": n // 2,
    },
    # Qwen4-exp at width 64: the delta-net pattern R R A R (a cut inside the delta-net run, one on
    # each side of the attention layer, and a last stage [3, 4) without attention layers), four
    # streams mixed at rank 32, the attention's indexer keeping 8 cells (blocks of 4) of the
    # 20-token prompt, PLE on layer 3 (on a later stage in every test split: it hashes the token
    # ids it receives with the predecessors its own cells recorded), softmax experts plus a shared one.
    "qwen4exp": lambda n: {
        **tiny_delta_net(n), **_tiny_moe(n), "n_ff_shexp": n, "hc_mult": 4, "hc_low_rank": 32,
        "indexer_n_head": 2, "indexer_head_size": n // 2, "indexer_top_k": 8, "compress_ratios": (4, 4, 4, 4),
        "ple_layers": (3,), "n_embd_per_layer": n // 2,
    },
}


def demo(*, dtype: WeightDtype = "F16", seed: int = 0) -> ModelSpec:
    """The demo model: qwen2 with the real Qwen2 tokenizer and chat template, 8 x 256.

    Args:
        dtype: weight storage type.
        seed: random seed.

    Returns:
        The validated spec.
    """
    return ModelSpec(
        arch="qwen2",
        n_layer=8,
        n_embd=256,
        n_ff=768,
        n_head=4,
        n_head_kv=2,
        vocab="qwen2",
        dtype=dtype,
        tied=True,
        context_length=32768,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        seed=seed,
        name="skippy-demo",
    )


def qwen3_0_6b(*, dtype: WeightDtype = "F16", seed: int = 0) -> ModelSpec:
    """The shape of Qwen3-0.6B: 28 x 1024, n_ff 3072, 16/8 heads of 128, tied, qwen2 vocab."""
    return ModelSpec(
        arch="qwen3",
        n_layer=28,
        n_embd=1024,
        n_ff=3072,
        n_head=16,
        n_head_kv=8,
        head_dim=128,
        vocab="qwen2",
        dtype=dtype,
        tied=True,
        context_length=40960,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        seed=seed,
        name="skippy-qwen3-0.6b-shape",
    )


def llama_3_2_1b(*, dtype: WeightDtype = "F16", seed: int = 0) -> ModelSpec:
    """The shape of Llama-3.2-1B: 16 x 2048, n_ff 8192, 32/8 heads of 64, tied, llama-bpe vocab."""
    return ModelSpec(
        arch="llama",
        n_layer=16,
        n_embd=2048,
        n_ff=8192,
        n_head=32,
        n_head_kv=8,
        vocab="llama-bpe",
        dtype=dtype,
        tied=True,
        context_length=131072,
        rope_theta=500_000.0,
        rms_eps=1e-5,
        seed=seed,
        name="skippy-llama-3.2-1b-shape",
    )


def llama_16x1024(
    *, dtype: WeightDtype = "F16", tied: bool = False, seed: int = 0
) -> ModelSpec:
    """The memory-test shape: llama, 16 x 1024, n_ff 4096, 16/4 heads, 32000-token SPM vocab.

    The layers dominate the file (about 30 MiB per layer in F16 against 62 MiB for the
    embedding), so a stage's resident share is easy to tell apart from the whole file.
    """
    return ModelSpec(
        arch="llama",
        n_layer=16,
        n_embd=1024,
        n_ff=4096,
        n_head=16,
        n_head_kv=4,
        vocab="llama-spm",
        dtype=dtype,
        tied=tied,
        context_length=4096,
        rope_theta=10000.0,
        rms_eps=1e-5,
        seed=seed,
        name="skippy-llama-16x1024",
    )


def gemma3_270m(*, dtype: WeightDtype = "F16", seed: int = 0) -> ModelSpec:
    """The shape of Gemma 3 270M: 18 x 640, n_ff 2048, 4 query / 1 KV heads of 256, tied.

    Sliding window 512 with every 6th layer global, rope base 1e6 (global) / 1e4 (local). The
    real model's 262144-token vocab is replaced by the 32000-token SPM one, so the layers are a
    larger share of the file than in the real one (which is mostly embedding).
    """
    return ModelSpec(
        arch="gemma3",
        n_layer=18,
        n_embd=640,
        n_ff=2048,
        n_head=4,
        n_head_kv=1,
        head_dim=256,
        vocab="llama-spm",
        dtype=dtype,
        tied=True,
        context_length=32768,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        seed=seed,
        name="skippy-gemma3-270m-shape",
        sliding_window=512,
        swa_pattern=6,
        rope_theta_swa=10_000.0,
    )


def qwen3moe_30b_a3b_8e(*, dtype: WeightDtype = "Q8_0", seed: int = 0) -> ModelSpec:
    """Qwen3-30B-A3B's block shape with 8 experts (2 used) and 12 of its 48 layers.

    Each block is Qwen3-30B-A3B's (n_embd 2048, 32 query / 4 KV heads of 128, experts of width
    768), but with 8 experts instead of 128 and a 32000-token SPM vocab, so the file is about
    0.86 GB in Q8_0 and the expert tensors are its larger part (56%; 90% in the real model).
    """
    return ModelSpec(
        arch="qwen3moe",
        n_layer=12,
        n_embd=2048,
        n_ff=6144,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        vocab="llama-spm",
        dtype=dtype,
        tied=False,
        context_length=40960,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        seed=seed,
        name="skippy-qwen3moe-30b-a3b-8e-shape",
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=768,
    )


def gpt_oss_20b_4l(*, dtype: WeightDtype = "Q8_0", seed: int = 0) -> ModelSpec:
    """gpt-oss-20b's block shape with 4 of its 24 layers and 4 of its 32 experts (2 used).

    Each block is gpt-oss-20b's (n_embd 2880, 64 query / 8 KV heads of 64, attention sinks,
    experts of width 2880, sliding window 128 on every other layer, yarn 32 over 4096, rope
    base 150000); with the 32000-token SPM vocab the file is about 0.73 GB in Q8_0.
    """
    return ModelSpec(
        arch="gpt-oss",
        n_layer=4,
        n_embd=2880,
        n_ff=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        vocab="llama-spm",
        dtype=dtype,
        tied=False,
        context_length=131072,
        rope_theta=150_000.0,
        rms_eps=1e-5,
        seed=seed,
        name="skippy-gpt-oss-20b-4l-shape",
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=2880,
        sliding_window=128,
        swa_pattern=2,
        rope_scaling="yarn",
        rope_scaling_factor=32.0,
        rope_orig_ctx=4096,
    )


#: Nemotron-H-8B's 52 blocks (NVIDIA's hybrid_override_pattern): 24 Mamba-2, 4 attention, 24 MLP.
NEMOTRON_H_8B_PATTERN: Final = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def nemotron_h_8b_8l(*, dtype: WeightDtype = "Q8_0", seed: int = 0) -> ModelSpec:
    """Nemotron-H-8B's block shapes with its first 8 of 52 layers (``M-M-M-M*``).

    Each block is Nemotron-H-8B's (n_embd 4096; Mamba-2 with 128 heads of 64 = d_inner 8192,
    8 groups, d_state 128, conv 4; attention 32 query / 8 KV heads of 128 without rope; squared-ReLU
    MLP of 21504); with the 32000-token SPM vocab the file is about 1.3 GB in Q8_0. Each Mamba
    layer keeps (3 * 10240 + 128 * 8192) * 4 bytes = 4.1 MiB of state per sequence. The whole
    model is ``preset("nemotron-h-8b-8l", n_layer=52, layer_pattern=NEMOTRON_H_8B_PATTERN)``.
    """
    return ModelSpec(
        arch="nemotron_h",
        n_layer=8,
        n_embd=4096,
        n_ff=21504,
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        vocab="llama-spm",
        dtype=dtype,
        tied=False,
        context_length=8192,
        rms_eps=1e-5,
        seed=seed,
        name="skippy-nemotron-h-8b-8l-shape",
        ln_eps=1e-5,
        ssm_d_conv=4,
        ssm_d_inner=8192,
        ssm_d_state=128,
        ssm_dt_rank=128,
        ssm_n_group=8,
        layer_pattern=NEMOTRON_H_8B_PATTERN[:8],
    )


def qwen35moe_35b_a3b_8l(*, dtype: WeightDtype = "Q8_0", seed: int = 0) -> ModelSpec:
    """Qwen3.5-35B-A3B's block shape with 8 of its 40 layers (two of its ten groups of three
    Gated DeltaNet layers and one gated-attention layer); issue 25's real hybrid shape.

    Each block is Qwen3.5-35B-A3B's (n_embd 2048; delta-net with 16 key / 32 value heads of
    128 and a 4-wide conv; attention with 16 query / 2 KV heads of 256, a quarter of each
    rotated (M-RoPE sections 11/11/10), base 1e7; 256 experts of width 512, 8 used, plus a
    gated shared expert of 512). The 248320-token vocab is replaced by the 32000-token SPM one
    and the multi-token-prediction block is left out (llama.cpp does not load it), so the file
    is about 7.3 GB in Q8_0, the experts 94% of it; it is written one tensor at a time (under
    1 GB of memory).
    """
    return ModelSpec(
        arch="qwen35moe",
        n_layer=8,
        n_embd=2048,
        n_ff=512,
        n_head=16,
        n_head_kv=2,
        head_dim=256,
        vocab="llama-spm",
        dtype=dtype,
        tied=False,
        context_length=262144,
        rope_theta=10_000_000.0,
        rms_eps=1e-6,
        seed=seed,
        name="skippy-qwen35moe-35b-a3b-8l-shape",
        rope_dim=64,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=512,
        n_ff_shexp=512,
        linear_conv_kernel=4,
        linear_key_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        full_attention_interval=4,
    )


def gemma4_e2b(*, dtype: WeightDtype = "Q8_0", seed: int = 0) -> ModelSpec:
    """Gemma 4 E2B's shape: 35 x 1536, 8 query heads and 1 KV head of 512 (global) / 256
    (sliding-window, window 512, every 5th layer global), per-layer token embeddings of 256 per
    layer, the last 20 layers reusing the KV of layers 13 (local) and 14 (global), tied head, final
    soft-capping; issue 26's real Gemma 4 shape.

    Two departures: every MLP is 6144 wide (E2B doubles it on its KV-sharing layers), and the
    262144-token vocabulary is replaced by the 32000-token SPM one, so the token table and the
    per-layer table (n_vocab x 35 x 256) are an eighth of the real ones; the file is about 1.7 GB
    in Q8_0, its layers 1.4 GB of it.
    """
    return ModelSpec(
        arch="gemma4",
        n_layer=35,
        n_embd=1536,
        n_ff=6144,
        n_head=8,
        n_head_kv=1,
        head_dim=512,
        vocab="llama-spm",
        dtype=dtype,
        tied=True,
        context_length=131072,
        rope_theta=1_000_000.0,
        rms_eps=1e-6,
        seed=seed,
        name="skippy-gemma4-e2b-shape",
        sliding_window=512,
        rope_theta_swa=10_000.0,
        final_softcap=30.0,
        n_embd_per_layer=256,
        n_kv_shared_layers=20,
        head_dim_swa=256,
        swa_period=5,
    )


#: Named presets; each is a zero-argument factory.
PRESETS: Final[dict[str, Callable[[], ModelSpec]]] = {
    "tiny-llama": lambda: tiny("llama"),
    "tiny-qwen2": lambda: tiny("qwen2"),
    "tiny-qwen3": lambda: tiny("qwen3"),
    **{
        f"tiny-{arch}": functools.partial(tiny, arch)
        for arch in NEW_ARCHITECTURES + EXTRA_ARCHITECTURES
    },
    "demo": demo,
    "qwen3-0.6b": qwen3_0_6b,
    "llama-3.2-1b": llama_3_2_1b,
    "llama-16x1024": llama_16x1024,
    "gemma3-270m": gemma3_270m,
    "qwen3moe-30b-a3b-8e": qwen3moe_30b_a3b_8e,
    "gpt-oss-20b-4l": gpt_oss_20b_4l,
    "nemotron-h-8b-8l": nemotron_h_8b_8l,
    **{f"tiny-{arch}": functools.partial(tiny, arch) for arch in LATER_ARCHITECTURES},
    "qwen35moe-35b-a3b-8l": qwen35moe_35b_a3b_8l,
    "gemma4-e2b": gemma4_e2b,
}


def preset(name: str, **overrides: Any) -> ModelSpec:
    """Return a named preset, optionally with some fields replaced.

    Args:
        name: a key of `PRESETS`.
        **overrides: `ModelSpec` fields to replace (e.g. ``dtype="Q8_0"``, ``tied=False``).

    Returns:
        The validated spec.

    Raises:
        KeyError: unknown preset name.
        ValueError, TypeError: an override makes the spec invalid or names no field.
    """
    try:
        factory = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
    return dataclasses.replace(factory(), **overrides)
