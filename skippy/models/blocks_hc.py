# Block descriptions of the families whose residual stream is wider than the hidden state (issues
# 25/26, patch 0013): hyper-connection families carry hc_mult parallel streams, so a stage boundary
# row holds hc_mult x n_embd values; Kimi-K3 banks layer inputs, so it holds 1 + the rows banked
# before the cut (the protocol's boundary-rows extension announces either).  DeepSeek V4
# (deepseek4): mHC mixing around every attention and MoE sub-block, sliding-window attention
# beside compressed KV (ratio 4 with a lightning indexer, ratio 128 without), grouped low-rank
# output, hash-routed experts in the first layers (experts picked by token id), sqrt-softplus
# routing elsewhere, shared experts, a learned hc head collapsing the streams before the output.
#
# Strategy: like `blocks_wide.py`, each function returns one block's tensors in file order, named
# and shaped as llama.cpp's loader (src/models/deepseek4.cpp) creates them (numpy order: the last
# axis is the input width).  The small mixing tensors (hc_*_fn/base/scale, compressor positions)
# stay F32, as the converter (conversion/deepseek.py) writes them; the hash-routing tables are
# I32 expert ids (kind "expert_ids").
from __future__ import annotations

from typing import TYPE_CHECKING, Final

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models import blocks_linear as bl
from skippy.models import blocks_moe as bm
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "DEEPSEEK4", "GLM5_NEXT", "HY_V4", "KIMI_K3", "deepseek4", "deepseek4_inputs", "deepseek4_keys",
    "deepseek4_shape", "glm5_next", "glm5_next_keys", "glm5_next_shape", "hy_v4", "hy_v4_inputs",
    "hy_v4_keys", "hy_v4_shape", "kimi_k3", "kimi_k3_inputs", "kimi_k3_keys", "kimi_k3_shape",
    "QWEN4EXP", "QWEN4EXP_PLE", "qwen4exp", "qwen4exp_inputs", "qwen4exp_keys", "qwen4exp_shape",
]

#: The optional spec fields of DeepSeek V4's attention and hyper-connections.
DEEPSEEK4: Final = frozenset({"hc_mult", "hash_layer_count", "compress_ratios", "o_group_count", "o_lora_rank"})
#: DeepSeek-V4-Flash's constants (config.json): Sinkhorn iterations and epsilon of the stream
#: mixing, the compressed layers' rope base, the SwiGLU clamp of experts and shared experts.
HC_SINKHORN_ITERS: Final = 20
HC_EPS: Final = 1e-6
COMPRESS_ROPE_BASE: Final = 160000.0
SWIGLU_LIMIT: Final = 10.0
#: llama.cpp's DeepSeek V4 graph asserts four streams; its cache compresses by 4 or 128.
HC_MULT: Final = 4
COMPRESS_RATIOS: Final = (0, 4, 128)


def _f32(name: str, *shape: int, kind: str = "matrix") -> TensorDecl:
    return TensorDecl(name, tuple(shape), kind, False)  # type: ignore[arg-type]


def _hc(spec: "ModelSpec", layer: int, part: str) -> list[TensorDecl]:
    """One sub-block's stream mixing: pre weights, post weights and the Sinkhorn-normalised
    hc x hc combination, read from the RMS-normed flattened streams."""
    hc = spec.hc_mult
    mix = (2 + hc) * hc
    return [
        _f32(b.blk(layer, f"hc_{part}_fn"), mix, hc * spec.n_embd),
        _f32(b.blk(layer, f"hc_{part}_base"), mix, kind="bias"),
        _f32(b.blk(layer, f"hc_{part}_scale"), 3, kind="norm"),
    ]


def _compressor(layer: int, prefix: str, width: int, ratio: int, n_embd: int, norm_width: int) -> list[TensorDecl]:
    return [
        b.matrix(layer, f"{prefix}_kv", width, n_embd),
        b.matrix(layer, f"{prefix}_gate", width, n_embd),
        _f32(b.blk(layer, f"{prefix}_ape"), ratio, width, kind="bias"),
        b.norm(layer, f"{prefix}_norm", norm_width),
    ]


def deepseek4(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    e, head = spec.n_embd, spec.n_embd_head
    q_width, groups, rank = spec.n_head * head, spec.o_group_count, spec.o_lora_rank
    ratio = spec.compress_ratios[layer]
    out = [
        b.norm(layer, "attn_norm", e),
        TensorDecl(b.blk(layer, "attn_sinks"), (spec.n_head,), "sink", False),
        b.matrix(layer, "attn_q_a", spec.q_lora_rank, e),
        b.norm(layer, "attn_q_a_norm", spec.q_lora_rank),
        b.matrix(layer, "attn_q_b", q_width, spec.q_lora_rank),
        b.matrix(layer, "attn_kv", head, e),
        b.norm(layer, "attn_kv_a_norm", head),
        # the file's (n_head * head / groups, rank * groups), which the loader views per group
        b.matrix(layer, "attn_output_a", rank * groups, q_width // groups),
        b.matrix(layer, "attn_output_b", e, groups * rank),
        *_hc(spec, layer, "attn"),
        *_hc(spec, layer, "ffn"),
    ]
    if ratio:
        out += _compressor(layer, "attn_compressor", (2 if ratio == 4 else 1) * head, ratio, e, head)
    if ratio == 4:
        idx = spec.indexer_head_size
        out += [
            b.matrix(layer, "indexer.proj", spec.indexer_n_head, e),
            b.matrix(layer, "indexer.attn_q_b", spec.indexer_n_head * idx, spec.q_lora_rank),
            *_compressor(layer, "indexer_compressor", 2 * idx, ratio, e, idx),
        ]
    out.append(TensorDecl(b.blk(layer, "ffn_gate_inp"), (spec.n_expert, e), "router", False))
    if layer >= spec.hash_layer_count:  # hash-routed layers' tables are inputs (they need n_vocab)
        out.append(b.bias(layer, "exp_probs_b", spec.n_expert))
    out.append(b.norm(layer, "ffn_norm", e))
    for name, rows, cols in (("ffn_gate_exps", spec.n_ff_exp, e), ("ffn_down_exps", e, spec.n_ff_exp),
                             ("ffn_up_exps", spec.n_ff_exp, e)):
        out.append(TensorDecl(b.blk(layer, name), (spec.n_expert, rows, cols), "matrix", True))
    shared = spec.n_ff_exp * spec.n_expert_shared
    out += [b.matrix(layer, "ffn_gate_shexp", shared, e), b.matrix(layer, "ffn_down_shexp", e, shared),
            b.matrix(layer, "ffn_up_shexp", shared, e)]
    return out


def deepseek4_inputs(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """The hc head (collapsing the streams before the output norm; the last stage loads it) and
    the hash-routing tables of the first hash_layer_count layers (each token's experts)."""
    hc = spec.hc_mult
    return [
        _f32("output_hc_fn.weight", hc, hc * spec.n_embd),
        _f32("output_hc_base.weight", hc, kind="bias"),
        _f32("output_hc_scale.weight", 1, kind="norm"),
        *(TensorDecl(b.blk(layer, "ffn_gate_tid2eid"), (n_vocab, spec.n_expert_used), "expert_ids", False)
          for layer in range(spec.hash_layer_count)),
    ]


def deepseek4_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    return [
        ("hyper_connection.sinkhorn_iterations", HC_SINKHORN_ITERS, GGUFValueType.UINT32),
        ("hyper_connection.epsilon", HC_EPS, GGUFValueType.FLOAT32),
        ("attention.compress_rope_freq_base", COMPRESS_ROPE_BASE, GGUFValueType.FLOAT32),
        ("swiglu_clamp_exp", SWIGLU_LIMIT, GGUFValueType.FLOAT32),
        ("swiglu_clamp_shexp", SWIGLU_LIMIT, GGUFValueType.FLOAT32),
        ("embedding_length_out", spec.hc_mult * spec.n_embd, GGUFValueType.UINT32),
    ]


#: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the only routing its loader accepts.
SQRT_SOFTPLUS: Final = 4


def deepseek4_shape(spec: "ModelSpec") -> str | None:
    if spec.expert_gating != SQRT_SOFTPLUS or not 0 < spec.n_expert_used <= spec.n_expert:
        return f"deepseek4 routes n_expert_used of n_expert experts by sqrt-softplus (expert_gating {SQRT_SOFTPLUS})"
    if spec.hc_mult != HC_MULT:
        return f"deepseek4 needs hc_mult == {HC_MULT} (llama.cpp's graph asserts it)"
    if len(spec.compress_ratios) != spec.n_layer or set(spec.compress_ratios) - set(COMPRESS_RATIOS):
        return f"deepseek4 needs one compress ratio per layer, each of {COMPRESS_RATIOS}"
    if spec.n_head_kv != 1 or spec.n_head % spec.o_group_count:
        return "deepseek4 has one KV head and n_head a multiple of o_group_count"
    if not 0 <= spec.hash_layer_count <= spec.n_layer:
        return "deepseek4 needs hash_layer_count <= n_layer"
    if spec.n_embd_head & (spec.n_embd_head - 1) or spec.indexer_head_size & (spec.indexer_head_size - 1):
        return "deepseek4 rotates heads with a Hadamard matrix: head widths must be powers of two"
    return None


# --- HY V4 -----------------------------------------------------------------------------------
# Hunyuan V4: independent hyper-connections (pre/post gates only, 2*hc mixes, no Sinkhorn
# combination; the post gate scaled by hc_magnitude), DeepSeek-V3 MLA with a sigmoid output gate
# and attention sinks, the lightning indexer on its "full" layers (a "shared" layer reuses the top-k
# of the last full one before it: a cut may not fall before a shared layer, skippy/runtime/cuts.py),
# leading dense blocks, then sigmoid experts with a shared one.

#: The optional spec fields of HY V4's hyper-connections and indexer layout.
HY_V4: Final = frozenset({"hc_mult", "indexer_types"})
#: Hunyuan V4's post-gate magnitude (config.json hc_magnitude).
HC_MAGNITUDE: Final = 2.0


def hy_v4(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    e, hc, heads = spec.n_embd, spec.hc_mult, spec.n_head
    out = [
        *bm.mla_attention(spec, layer)[:-1],  # attn_output last, after its gate
        TensorDecl(b.blk(layer, "attn_sinks"), (heads,), "sink", False),
        b.matrix(layer, "attn_output", e, heads * spec.v_head_dim),
        b.matrix(layer, "attn_gate", heads * spec.v_head_dim, e),
    ]
    if spec.indexer_top_k and spec.indexer_types[layer]:
        out += bm.dsa_indexer(spec, layer)
    for part in ("attn", "ffn"):
        out += [
            _f32(b.blk(layer, f"hc_{part}_fn"), 2 * hc, hc * e),
            _f32(b.blk(layer, f"hc_{part}_base"), 2 * hc, kind="bias"),
            _f32(b.blk(layer, f"hc_{part}_scale"), 2, kind="norm"),
        ]
    if layer < spec.n_dense_lead:
        return out + b.dense_ffn(spec, layer)
    return out + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


def hy_v4_inputs(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """The hc head collapsing the streams before the output norm (the last stage loads it)."""
    del n_vocab
    hc = spec.hc_mult
    return [
        _f32("output_hc_fn.weight", hc, hc * spec.n_embd),
        _f32("output_hc_base.weight", hc, kind="bias"),
        _f32("output_hc_scale.weight", 1, kind="norm"),
    ]


def hy_v4_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    return [
        ("attention.key_length_mla", spec.n_embd_head, GGUFValueType.UINT32),
        ("hyper_connection.epsilon", HC_EPS, GGUFValueType.FLOAT32),
        ("hyper_connection.magnitude", HC_MAGNITUDE, GGUFValueType.FLOAT32),
    ]


def hy_v4_shape(spec: "ModelSpec") -> str | None:
    if spec.hc_mult < 2:
        return "hy_v4 needs hc_mult >= 2 parallel streams"
    if spec.indexer_top_k and (len(spec.indexer_types) != spec.n_layer or not spec.indexer_types[0]):
        return "hy_v4 needs one indexer type per layer (1 full, 0 shared), layer 0 full"
    return None


# --- GLM-5 Next --------------------------------------------------------------------------------
# GLM-5.3-Flash (glm5-next): DeepSeek V4's mHC streams (Sinkhorn combination) around KDA layers
# (Kimi Delta Attention, recurrent) and MLA layers with DeepSeek sparse attention, whose lightning
# indexer scores k-pooled keys (kpool keys gated into one); a "shared" indexer layer reuses the top-k
# of the last full one (skippy/runtime/cuts.py); leading dense blocks, then sigmoid experts with a
# shared one; the streams' mean before the output norm.

#: The optional spec fields of GLM-5 Next's streams, KDA layers and k-pooled indexer.
GLM5_NEXT: Final = frozenset({"hc_mult", "kda_head_dim", "linear_conv_kernel", "indexer_kpool"})


def glm5_next(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    e = spec.n_embd
    out = [b.norm(layer, "attn_norm", e), *_hc(spec, layer, "attn"), *_hc(spec, layer, "ffn")]
    if bl.is_recurrent(spec, layer):  # Kimi-Linear's KDA, its per-head decay 1-D (not padded)
        out += [TensorDecl(d.name, (spec.n_head,), d.kind, d.quantized) if d.name.endswith(".ssm_a") else d
                for d in bl.kda(spec, layer)]
    else:  # nope-only MLA (llama.cpp asserts no rope: rope.dimension_count 0, glm5_next_keys)
        heads, kv_rank, q_rank, head = spec.n_head, spec.kv_lora_rank, spec.q_lora_rank, spec.n_embd_head
        out += [
            b.matrix(layer, "attn_q_a", q_rank, e),
            b.norm(layer, "attn_q_a_norm", q_rank),
            b.matrix(layer, "attn_q_b", heads * head, q_rank),
            b.matrix(layer, "attn_kv_a_mqa", kv_rank, e),
            b.norm(layer, "attn_kv_a_norm", kv_rank),
            TensorDecl(b.blk(layer, "attn_k_b"), (heads, kv_rank, head), "matrix", True),
            TensorDecl(b.blk(layer, "attn_v_b"), (heads, spec.v_head_dim, kv_rank), "matrix", True),
            b.matrix(layer, "attn_output", e, heads * spec.v_head_dim),
        ]
        if not spec.indexer_types or spec.indexer_types[layer]:
            idx = spec.indexer_head_size
            out += [
                *bm.dsa_indexer(spec, layer),
                b.matrix(layer, "indexer_compressor_gate", idx, e),
                _f32(b.blk(layer, "indexer_compressor_ape"), spec.indexer_kpool, idx, kind="bias"),
            ]
    if layer < spec.n_dense_lead:
        return out + b.dense_ffn(spec, layer)
    return out + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


def glm5_next_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    return bl.kimi_linear_keys(spec) + [
        ("rope.dimension_count", 0, GGUFValueType.UINT32),
        ("attention.key_length", spec.kv_lora_rank, GGUFValueType.UINT32),  # the cached latent, no rope key
        ("hyper_connection.sinkhorn_iterations", HC_SINKHORN_ITERS, GGUFValueType.UINT32),
        ("hyper_connection.epsilon", HC_EPS, GGUFValueType.FLOAT32),
    ]


def glm5_next_shape(spec: "ModelSpec") -> str | None:
    if spec.hc_mult != HC_MULT:
        return f"glm5-next needs hc_mult == {HC_MULT} (llama.cpp asserts it)"
    if spec.indexer_kpool < 2 or spec.indexer_top_k % spec.indexer_kpool:
        return "glm5-next needs indexer_kpool > 1 dividing indexer_top_k (llama.cpp asserts it)"
    return None


# --- Kimi K3 -----------------------------------------------------------------------------------
# Kimi-K3: Kimi-Linear's KDA / MLA hybrid (a full-rank KDA output gate, 1-D decay; nope MLA with a
# sigmoid output gate) plus cross-layer residual attention: every attn_res_block_size-th layer banks
# its input, and every sub-block reads a softmax mix of the banked rows and the running residual
# (scored against its own res_score vector); a cut at layer L hands on ceil(L / block) banked rows
# beside the hidden state.  Latent MoE (routed experts at expert_latent_length, projected down and
# up), situ activations, leading dense blocks, shared experts at full width.

#: The optional spec fields of Kimi-K3's banked residual and latent experts.
KIMI_K3: Final = frozenset({"kda_head_dim", "linear_conv_kernel", "attn_res_block_size", "n_expert_latent"})
#: Kimi-K3's situ activation constants (config.json).
SITU_BETA: Final = 4.0
SITU_LINEAR_BETA: Final = 8.0


def kimi_k3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    e, heads, latent = spec.n_embd, spec.n_head, spec.n_expert_latent
    out = [b.norm(layer, "attn_norm", e), b.norm(layer, "ffn_norm", e),
           _f32(b.blk(layer, "attn_res_score"), e, kind="vector"), _f32(b.blk(layer, "ffn_res_score"), e, kind="vector")]
    if bl.is_recurrent(spec, layer):  # KDA with one full-rank output gate and a 1-D decay
        inner = spec.kda_head_dim * heads
        for d in bl.kda(spec, layer):
            if d.name.endswith(".ssm_a"):
                out.append(TensorDecl(d.name, (heads,), d.kind, d.quantized))
            elif d.name.endswith(".ssm_g_a.weight"):
                out.append(b.matrix(layer, "ssm_g", inner, e))
            elif not d.name.endswith(".ssm_g_b.weight"):
                out.append(d)
    else:  # nope MLA, its sigmoid gate before the output projection
        *mla, output = bl.mla(spec, layer)
        out += [*mla, b.matrix(layer, "attn_gate", heads * spec.v_head_dim, e), output]
    if layer < spec.n_dense_lead:
        return out + b.dense_ffn(spec, layer, pre_norm=False)
    n_exp, width = spec.n_expert, spec.n_ff_exp
    shared = width * spec.n_expert_shared
    return out + [
        TensorDecl(b.blk(layer, "ffn_gate_inp"), (n_exp, e), "router", False),
        b.bias(layer, "exp_probs_b", n_exp),
        TensorDecl(b.blk(layer, "ffn_gate_exps"), (n_exp, width, latent), "matrix", True),
        TensorDecl(b.blk(layer, "ffn_down_exps"), (n_exp, latent, width), "matrix", True),
        TensorDecl(b.blk(layer, "ffn_up_exps"), (n_exp, width, latent), "matrix", True),
        b.matrix(layer, "ffn_routed_down", latent, e),
        b.matrix(layer, "ffn_routed_up", e, latent),
        b.norm(layer, "ffn_routed_norm", latent),
        b.matrix(layer, "ffn_gate_shexp", shared, e),
        b.matrix(layer, "ffn_down_shexp", e, shared),
        b.matrix(layer, "ffn_up_shexp", shared, e),
    ]


def kimi_k3_inputs(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """The final mix's score vector (the last stage loads it)."""
    del n_vocab
    return [_f32("output_res_score.weight", spec.n_embd, kind="vector")]


def kimi_k3_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    return bl.kimi_linear_keys(spec) + [
        ("activation.situ_beta", SITU_BETA, GGUFValueType.FLOAT32),
        ("activation.situ_linear_beta", SITU_LINEAR_BETA, GGUFValueType.FLOAT32),
    ]


def kimi_k3_shape(spec: "ModelSpec") -> str | None:
    if spec.attn_res_block_size < 1 or spec.n_expert_latent < 1:
        return "kimi-k3 needs attn_res_block_size >= 1 and n_expert_latent >= 1"
    return None


# --- Qwen4-exp ---------------------------------------------------------------------------------
# Qwen4-exp (qwen4exp): low-rank hyper-connections (a grouped-norm mix down to hc_low_rank and up,
# sigmoid-gated, averaged over the streams; an inject projection scatters the block output back),
# Qwen3-Next's gated delta-net layers with gated full attention every n-th, whose keys a
# block-pooled indexer (QSA) narrows to the top-k cells; softmax experts plus a sigmoid-gated shared
# expert; per-layer n-gram embeddings (PLE) on one delta-net layer: rows of a shared table hashed
# from each token and its predecessors (the attention cells' token record), gated into the streams
# beside a depthwise causal conv whose history is a recurrent row; the final mix is the output norm.

#: The optional spec fields of Qwen4-exp's streams and PLE layer.
QWEN4EXP: Final = frozenset({"hc_mult", "hc_low_rank"})
#: ... and the optional PLE layer (a file without the ple.* keys has none).
QWEN4EXP_PLE: Final = frozenset({"ple_layers", "n_embd_per_layer"})
#: The tiny PLE hash: 3-grams (each token and its 2 predecessors), one head per n-gram order (the
#: bigram and the trigram), a causal conv of 3 taps dilated by the n-gram size (a history of 6
#: tokens), odd 64-bit multipliers, prime head vocabularies laid out back to back in the table.
PLE_NGRAM: Final = 3
PLE_HEADS_PER_NGRAM: Final = 1
PLE_CONV_KERNEL: Final = 3
PLE_MULTIPLIERS: Final = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)
PLE_HEAD_VOCABS: Final = (61, 67)
#: The llama-spm vocabulary's </s>: an EOS in a token's window resets the hash.
PLE_EOS: Final = 2


def _ple_heads() -> int:
    return (PLE_NGRAM - 1) * PLE_HEADS_PER_NGRAM


def _hc_low_rank(spec: "ModelSpec", layer: int, part: str) -> list[TensorDecl]:
    hc, e = spec.hc_mult, spec.n_embd
    return [
        _f32(b.blk(layer, f"hc_{part}_norm"), hc, e, kind="norm"),
        b.matrix(layer, f"hc_{part}_down", spec.hc_low_rank, hc * e),
        b.matrix(layer, f"hc_{part}_up", hc * e, spec.hc_low_rank),
        b.matrix(layer, f"hc_{part}_inject", hc, hc * e),
    ]


def qwen4exp(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    e, hc = spec.n_embd, spec.hc_mult
    out = [*_hc_low_rank(spec, layer, "attn"), *_hc_low_rank(spec, layer, "ffn")]
    if bl.is_recurrent(spec, layer):
        out += bl.gated_delta_net(spec, layer)
    else:
        idx = spec.indexer_head_size
        out += bl.gated_attention(spec, layer) + [
            b.matrix(layer, "indexer.q_proj", spec.indexer_n_head * idx, e),
            b.matrix(layer, "indexer.k_proj", idx, e),
            b.norm(layer, "indexer.q_norm", idx),
            b.norm(layer, "indexer.k_norm", idx),
        ]
    if layer in spec.ple_layers:
        out += [
            b.matrix(layer, "ple_key", hc * e, e),
            b.matrix(layer, "ple_value", e, e),
            _f32(b.blk(layer, "ple_norm_key"), hc, e, kind="norm"),
            _f32(b.blk(layer, "ple_norm_query"), hc, e, kind="norm"),
            _f32(b.blk(layer, "ple_norm_conv"), hc, e, kind="norm"),
            _f32(b.blk(layer, "ple_conv1d"), hc * e, PLE_CONV_KERNEL),
        ]
    return out + b.moe_ffn(spec, layer, pre_norm=False, shared="gated")


def qwen4exp_inputs(spec: "ModelSpec", n_vocab: int) -> list[TensorDecl]:
    """The final stream mix (the output norm; the last stage loads it) and the PLE table (every
    stage loads it: patch 0006 keeps the per-layer token embeddings of such a model)."""
    del n_vocab
    hc, e = spec.hc_mult, spec.n_embd
    out = [
        _f32("output_hc_norm.weight", hc, e, kind="norm"),
        TensorDecl("output_hc_down.weight", (spec.hc_low_rank, hc * e), "matrix", True),
        TensorDecl("output_hc_up.weight", (hc * e, spec.hc_low_rank), "matrix", True),
    ]
    if spec.ple_layers:
        out.append(TensorDecl("per_layer_token_embd.weight", (sum(PLE_HEAD_VOCABS), spec.n_embd_per_layer),
                              "embedding", True))
    return out


def qwen4exp_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    keys = bl.qwen35_keys(spec)
    if spec.ple_layers:
        offsets = [sum(PLE_HEAD_VOCABS[:h]) for h in range(len(PLE_HEAD_VOCABS))]
        keys += [
            ("ple.ngram_size", PLE_NGRAM, GGUFValueType.UINT32),
            ("ple.heads_per_ngram", PLE_HEADS_PER_NGRAM, GGUFValueType.UINT32),
            ("ple.conv_kernel", PLE_CONV_KERNEL, GGUFValueType.UINT32),
            ("ple.eos_token_id", PLE_EOS, GGUFValueType.UINT32),
            # arrays of uint64 (the loader reads the hash constants as 64-bit)
            ("ple.layer_multipliers", list(PLE_MULTIPLIERS), GGUFValueType.UINT64),
            ("ple.head_offsets", offsets, GGUFValueType.UINT64),
            ("ple.head_vocab_sizes", list(PLE_HEAD_VOCABS), GGUFValueType.UINT64),
        ]
    return keys


def qwen4exp_shape(spec: "ModelSpec") -> str | None:
    if spec.hc_mult < 2 or spec.hc_low_rank < 1:
        return "qwen4exp needs hc_mult >= 2 streams and hc_low_rank >= 1"
    if len(spec.ple_layers) > 1 or not all(bl.is_recurrent(spec, il) for il in spec.ple_layers):
        return "qwen4exp has at most one PLE layer, a delta-net one (llama.cpp's loader requires it)"
    if any(not 0 <= il < spec.n_layer for il in spec.ple_layers):
        return "qwen4exp's PLE layer must be one of its layers"
    if bool(spec.ple_layers) != bool(spec.n_embd_per_layer):
        return "qwen4exp sets ple_layers and n_embd_per_layer together (the PLE layer and its head width)"
    if spec.ple_layers and spec.n_embd_per_layer * _ple_heads() != spec.n_embd:
        return f"qwen4exp's PLE heads ({_ple_heads()}) times n_embd_per_layer must be n_embd"
    if len(spec.compress_ratios) != spec.n_layer or any(
            r < 1 for il, r in enumerate(spec.compress_ratios) if not bl.is_recurrent(spec, il)):
        return "qwen4exp needs one compress ratio per layer, >= 1 on the full-attention layers"
    return None
