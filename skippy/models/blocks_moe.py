# Blocks of the MoE and sparse-attention families of issue 26 (deepseek, dbrx, grok, arctic,
# cohere2moe, exaone-moe, bailingmoe, grovemoe, hy_v3, ...), as their llama.cpp loaders
# (src/models/<arch>.cpp) name and shape them.
#
# Strategy: the same pieces as `blocks.py` (attention, dense FFN, mixture of experts) with the
# few tensors these loaders add written here: DBRX / Grok's attention-output norm, Grok's
# layer-output norm, Arctic's residual dense FFN beside the experts with their own norm,
# GroveMoE's chunk experts, HY V3's suffix-less selection bias. Each function returns one
# block's tensors in file order (numpy shapes: the last axis is the input width).
from __future__ import annotations

from typing import TYPE_CHECKING, Final

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "DSA",
    "arctic",
    "chunk_experts",
    "indexer",
    "deepseek32",
    "dots3note",
    "dots3note_is_swa",
    "dots3note_keys",
    "dsa_indexer",
    "mla_attention",
    "bailingmoe",
    "cohere2moe",
    "dbrx",
    "deepseek",
    "exaone_moe",
    "glm_dsa",
    "glm_dsa_indexer_is_full",
    "grok",
    "grovemoe",
    "hy_v3",
    "minimax_m3",
    "msa_indexer",
    "step35",
    "step35_is_swa",
    "step35_keys",
]

#: The optional spec fields of DeepSeek sparse attention's lightning indexer.
DSA: Final = frozenset({"indexer_n_head", "indexer_head_size", "indexer_top_k"})


def chunk_experts(spec: "ModelSpec") -> str | None:
    # GroveMoE: one chunk expert per group of n_group_experts experts.
    if not spec.n_group_experts or spec.n_expert % spec.n_group_experts:
        return f"{spec.arch} needs n_expert to be a multiple of n_group_experts"
    return None


def indexer(spec: "ModelSpec") -> str | None:
    # llama.cpp rotates the indexer's keys and queries with a Hadamard matrix of a power-of-two
    # size of at least 64 dividing the head width; the head is laid out [rope | nope].
    if spec.indexer_head_size % 64:
        return f"{spec.arch} needs indexer_head_size to be a multiple of 64"
    if spec.n_rot > spec.indexer_head_size:
        return f"{spec.arch} needs rope_dim <= indexer_head_size"
    return None


def _experts(spec: "ModelSpec", layer: int, name: str, count: int, width: int) -> list[TensorDecl]:
    """Stacked gate/up/down experts under the names ``ffn_{gate,up,down}_<name>``."""
    e = spec.n_embd
    return [
        TensorDecl(b.blk(layer, f"ffn_gate_{name}"), (count, width, e), "matrix", True),
        TensorDecl(b.blk(layer, f"ffn_up_{name}"), (count, width, e), "matrix", True),
        TensorDecl(b.blk(layer, f"ffn_down_{name}"), (count, e, width), "matrix", True),
    ]


def deepseek(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # DeepSeek-MoE (V1): llama attention, leading dense blocks, then softmax top-k experts plus
    # n_expert_shared shared experts.
    attention = b.attention(spec, layer)
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, shared="plain")


def dbrx(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # DBRX: bias-free LayerNorms, fused q/k/v (clamped), an attention-output norm that feeds the
    # experts (no ffn_norm), experts as wide as feed_forward_length.
    e = spec.n_embd
    return [
        b.norm(layer, "attn_norm", e),
        b.matrix(layer, "attn_qkv", spec.n_q + 2 * spec.n_kv, e),
        b.matrix(layer, "attn_output", e, spec.n_q),
        b.norm(layer, "attn_output_norm", e),
    ] + b.moe_ffn(spec, layer, pre_norm=False, expert_width=spec.n_ff)


def grok(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Grok (1 and 2): attention output normed before the residual, a dense GELU FFN beside the
    # experts (Grok 2; their sum scaled by 1/sqrt(2)), the sum normed by layer_output_norm.
    e = spec.n_embd
    attention = b.attention(spec, layer) + [b.norm(layer, "attn_output_norm", e)]
    return attention + b.dense_ffn(spec, layer) + b.moe_ffn(spec, layer, pre_norm=False) + [
        b.norm(layer, "layer_output_norm", e)
    ]


def arctic(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Snowflake Arctic: a residual dense SwiGLU as wide as n_embd, and beside it experts
    # (sized by feed_forward_length) with their own input norm over the block's input.
    e = spec.n_embd
    dense = [
        b.norm(layer, "ffn_norm", e),
        b.matrix(layer, "ffn_gate", e, e),
        b.matrix(layer, "ffn_up", e, e),
        b.matrix(layer, "ffn_down", e, e),
    ]
    experts = [b.norm(layer, "ffn_norm_exps", e)] + b.moe_ffn(
        spec, layer, pre_norm=False, expert_width=spec.n_ff
    )
    return b.attention(spec, layer) + dense + experts


def cohere2moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Cohere2 MoE: one norm feeds attention and FFN in parallel (no ffn_norm); leading dense
    # blocks, then routed experts with optional shared experts.
    attention = b.attention(spec, layer)
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer, pre_norm=False)
    if not spec.n_expert_shared:
        return attention + b.moe_ffn(spec, layer, pre_norm=False)
    shared = "own" if spec.n_ff_shexp else "plain"  # the loader's width: n_ff_shexp, else
    return attention + b.moe_ffn(spec, layer, pre_norm=False, shared=shared)  # shared x n_ff_exp


def exaone_moe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # EXAONE MoE: per-head q/k norms, leading dense blocks, then routed experts with a
    # selection bias and a shared expert (n_ff_shexp wide).
    attention = b.attention(spec, layer, qk_norm="head")
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, selection_bias=True, shared="own")


def bailingmoe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Ling (bailingmoe, 1.0): llama attention, softmax experts in every block plus shared
    # experts.
    return b.attention(spec, layer) + b.moe_ffn(spec, layer, shared="plain")


def grovemoe(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # GroveMoE: qwen3 attention; the router's probabilities drive both the experts and the
    # "adjugate" chunk experts (one per group of experts_per_group experts, n_ff_chexp wide).
    out = b.attention(spec, layer, qk_norm="head") + b.moe_ffn(spec, layer)
    n_chunk = spec.n_expert // spec.n_group_experts
    return out + _experts(spec, layer, "chexps", n_chunk, spec.n_ff_chexp)


def hy_v3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # HY V3: qwen3 attention; dense blocks where the file has no router, else sigmoid experts
    # with a selection bias and a shared expert. Its loader asks for the selection bias as
    # "blk.N.exp_probs_b" (no ".bias" suffix).
    attention = b.attention(spec, layer, qk_norm="head")
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    moe = b.moe_ffn(spec, layer, shared="own")
    bias = TensorDecl(f"blk.{layer}.exp_probs_b", (spec.n_expert,), "bias", False)
    return attention + moe[:2] + [bias] + moe[2:]


def mla_attention(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    """DeepSeek-V3's multi-head latent attention, as families._deepseek2 writes it: low-rank q
    (q_a, its norm, q_b), the latent kv_a_mqa and its norm, per-head k_b / v_b, attn_output."""
    e, heads, q_rank, kv_rank = spec.n_embd, spec.n_head, spec.q_lora_rank, spec.kv_lora_rank
    nope = spec.n_embd_head - spec.n_rot
    return [
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


def dsa_indexer(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    """The lightning indexer of DeepSeek sparse attention: one key head (LayerNorm with bias),
    indexer_n_head query heads from the low-rank q, per-head weights from the block input."""
    e, width, heads = spec.n_embd, spec.indexer_head_size, spec.indexer_n_head
    return [
        b.norm(layer, "indexer.k_norm", width),
        b.bias(layer, "indexer.k_norm", width),
        b.matrix(layer, "indexer.proj", heads, e),
        b.matrix(layer, "indexer.attn_k", width, e),
        b.matrix(layer, "indexer.attn_q_b", heads * width, spec.q_lora_rank),
    ]


def deepseek32(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # DeepSeek-V3.2 (deepseek32): deepseek2's MLA plus a lightning indexer in every block,
    # whose top-k keys are the only ones each query attends to; leading dense blocks, then
    # sigmoid experts with a selection bias and shared experts.
    out = mla_attention(spec, layer) + dsa_indexer(spec, layer)
    if layer < spec.n_dense_lead:
        return out + b.dense_ffn(spec, layer)
    return out + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


#: GLM-5.2's training context; llama.cpp gives a model with at least this context GLM-5.2's
#: indexer layout (full indexers on layers 0, 1, 2, 6, 10, ...; "shared" ones elsewhere) when
#: the file has no attention.indexer.types, and GLM-5 / 5.1's (every layer full) below it.
GLM_5_2_CONTEXT: Final = 1048576


def glm_dsa_indexer_is_full(spec: "ModelSpec", layer: int) -> bool:
    """Whether a glm-dsa block computes its own top-k (else it reuses the previous full one's)."""
    if spec.context_length < GLM_5_2_CONTEXT:
        return True
    return layer < 2 or (layer - 2) % 4 == 0


def glm_dsa(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # GLM-5 / 5.1 / 5.2 (glm-dsa): deepseek32's block with the indexer rotating its heads the
    # "normal" way; GLM-5.2's shared-indexer layers have no indexer of their own.
    out = mla_attention(spec, layer)
    if glm_dsa_indexer_is_full(spec, layer):
        out += dsa_indexer(spec, layer)
    if layer < spec.n_dense_lead:
        return out + b.dense_ffn(spec, layer)
    return out + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


def step35_is_swa(layer: int) -> bool:
    """Step 3.5's layout here: full attention on every 4th layer from 0, sliding window
    elsewhere (the file states it per layer, as attention.sliding_window_pattern)."""
    return layer % 4 != 0


def step35_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    # The loader reads the pattern only as an array (one flag per layer).
    pattern = [int(step35_is_swa(layer)) for layer in range(spec.n_layer)]
    return [("attention.sliding_window_pattern", pattern, GGUFValueType.ARRAY)]


def step35(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Step 3.5 (Flash): per-head q/k norms, a head-wise sigmoid output gate, sliding-window
    # layers rotating the whole rope width and full ones half of it; dense blocks where no
    # router is stored, else sigmoid experts with a selection bias plus a shared expert.
    attention = b.attention(spec, layer, qk_norm="head")
    attention.insert(-1, b.matrix(layer, "attn_gate", spec.n_head, spec.n_embd))
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    return attention + b.moe_ffn(spec, layer, selection_bias=True, shared="own")


def dots3note_is_swa(layer: int) -> bool:
    """dots3note's layout here: a full-attention (sparse, indexed) layer closing every group of
    4, sliding-window layers before it (the file states both per layer, as arrays)."""
    return layer % 4 != 3


def dots3note_keys(spec: "ModelSpec") -> list[tuple[str, object, GGUFValueType]]:
    # The MLA widths of both layer kinds (the sliding-window ones have their own latent rank),
    # the KV cache's per-kind key/value widths, and the per-layer pattern and indexer arrays.
    swa = [dots3note_is_swa(layer) for layer in range(spec.n_layer)]
    u32 = GGUFValueType.UINT32
    return [
        ("attention.key_length_mla", spec.n_embd_head, u32),
        ("attention.key_length_mla_swa", spec.n_embd_head, u32),
        ("attention.value_length_mla_swa", spec.v_head_dim, u32),
        ("attention.key_length_swa", spec.kv_lora_rank_swa + spec.n_rot, u32),
        ("attention.value_length_swa", spec.kv_lora_rank_swa, u32),
        ("attention.sliding_window_pattern", [int(s) for s in swa], GGUFValueType.ARRAY),
        ("attention.indexer.types", [int(not s) for s in swa], GGUFValueType.ARRAY),
    ]


def dots3note(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # dots3note: MLA on every layer (the sliding-window ones with a smaller latent), a norm on
    # the shared rope key, a head-wise sigmoid output gate, the DSA lightning indexer on the
    # full-attention layers; leading dense blocks, then sigmoid experts with a selection bias
    # and shared experts.
    swa = dots3note_is_swa(layer)
    kv_rank = spec.kv_lora_rank_swa if swa else spec.kv_lora_rank
    e, heads, nope = spec.n_embd, spec.n_head, spec.n_embd_head - spec.n_rot
    out = [
        b.norm(layer, "attn_norm", e),
        b.norm(layer, "attn_q_a_norm", spec.q_lora_rank),
        b.norm(layer, "attn_kv_a_norm", kv_rank),
        b.norm(layer, "attn_k_norm", spec.n_rot),
        b.matrix(layer, "attn_q_a", spec.q_lora_rank, e),
        b.matrix(layer, "attn_q_b", heads * spec.n_embd_head, spec.q_lora_rank),
        b.matrix(layer, "attn_kv_a_mqa", kv_rank + spec.n_rot, e),
        TensorDecl(b.blk(layer, "attn_k_b"), (heads, kv_rank, nope), "matrix", True),
        TensorDecl(b.blk(layer, "attn_v_b"), (heads, spec.v_head_dim, kv_rank), "matrix", True),
        b.matrix(layer, "attn_output", e, heads * spec.v_head_dim),
        b.matrix(layer, "attn_gate", heads, e),
    ]
    if not swa:
        out += dsa_indexer(spec, layer)
    if layer < spec.n_dense_lead:
        return out + b.dense_ffn(spec, layer)
    return out + b.moe_ffn(spec, layer, selection_bias=True, shared="plain")


def msa_indexer(spec: "ModelSpec") -> str | None:
    # MiniMax sparse attention scores blocks of positions with one indexer head per KV head,
    # rotating its first rope_dim values.
    if spec.indexer_n_head != spec.n_head_kv:
        return f"{spec.arch} needs indexer_n_head == n_head_kv (one indexer head per KV head)"
    if spec.n_rot > spec.indexer_head_size:
        return f"{spec.arch} needs rope_dim <= indexer_head_size"
    return None


def minimax_m3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # MiniMax-M3: MiniMax-M2's attention (per-head q/k norms, partial rope); leading dense
    # blocks, then sigmoid experts with a selection bias plus shared experts and the MSA indexer
    # (its own q/k projections and norms) in every sparse block.
    attention = b.attention(spec, layer, qk_norm="head")
    if layer < spec.n_dense_lead:
        return attention + b.dense_ffn(spec, layer)
    width, heads = spec.indexer_head_size, spec.indexer_n_head
    indexer = [
        b.matrix(layer, "indexer.q_proj", heads * width, spec.n_embd),
        b.matrix(layer, "indexer.k_proj", width, spec.n_embd),
        b.norm(layer, "indexer.q_norm", width),
        b.norm(layer, "indexer.k_norm", width),
    ]
    return attention + b.moe_ffn(spec, layer, selection_bias=True, shared="plain") + indexer
