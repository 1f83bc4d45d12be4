# Blocks of the dense families of issue 26 (and the few MoE ones in its list): the families
# whose graphs the layer-loop rules already covered, written as `families.py` writes the others.
#
# Strategy: each function returns one block's tensors in file order, as the family's loader in
# llama.cpp's src/models/<file>.cpp names and shapes them (numpy order: last axis = input
# width), built from the shared pieces of `blocks.py` wherever the layout is one of theirs. The
# few tensors no shared piece has (Falcon's second norm, chameleon's per-head q/k LayerNorms,
# PLM's kv_b, spark2_5's per-head attention gate, plamo3's suffix-less post-norms) are declared
# here directly, and so are the blocks whose shapes change per layer (OpenELM, DeciLM, Laguna:
# `heads`). The module also holds these families' rules and computed keys (M-RoPE sections,
# per-layer sliding-window arrays, Maple's SwiGLU clamp, Apertus's xIELU constants). Which real
# checkpoints each block follows is said in its family's summary.
from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFValueType

from skippy.models import blocks as b
from skippy.models.blocks import TensorDecl

if TYPE_CHECKING:
    from skippy.models.spec import ModelSpec

__all__ = [
    "alternating_swa", "apertus", "baichuan", "chameleon", "chatglm", "codeshell", "deci",
    "falcon", "heads", "hunyuan_vl", "jais", "laguna", "low_rank_kv", "maincoder", "maple",
    "maple_keys", "mellum", "mrope_sections", "openelm", "orion", "paddleocr", "pangu_embedded",
    "per_layer_shapes", "plamo", "plamo3", "plm", "plm_head_widths", "qwen", "qwen2vl", "refact",
    "spark2_5", "xielu", "xverse"
]


def baichuan(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Baichuan (2): the llama layout (the converter unpacks W_pack into q/k/v).
    return b.attention(spec, layer) + b.dense_ffn(spec, layer)


refact = baichuan  # Refact-1.6B: the llama layout (ALiBi instead of rope, in the graph)
xverse = baichuan  # XVERSE: the llama layout


def orion(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Orion-14B: LayerNorms with biases, SwiGLU.
    out = b.attention(spec, layer, norm_bias=True)
    out += [b.norm(layer, "ffn_norm", spec.n_embd), b.bias(layer, "ffn_norm", spec.n_embd)]
    return out + b.dense_ffn(spec, layer, pre_norm=False)


def qwen(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Qwen (1): fused q/k/v with bias; the file's feed_forward_length is twice the SwiGLU width.
    e, f = spec.n_embd, spec.n_ff // 2
    return b.attention(spec, layer, fused_qkv=True, qkv_bias=True) + [
        b.norm(layer, "ffn_norm", e),
        b.matrix(layer, "ffn_gate", f, e),
        b.matrix(layer, "ffn_up", f, e),
        b.matrix(layer, "ffn_down", e, f),
    ]


def codeshell(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # CodeShell-7B: LayerNorms with biases, fused q/k/v with bias, biases on every projection,
    # GELU MLP.
    return b.attention(
        spec, layer, norm_bias=True, fused_qkv=True, qkv_bias=True, out_bias=True
    ) + b.dense_ffn(spec, layer, gated=False, biases=True)


def plamo(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # PLaMo-13B: one RMSNorm feeds attention and the SwiGLU MLP in parallel.
    return b.attention(spec, layer) + b.dense_ffn(spec, layer, pre_norm=False)


def falcon(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Falcon-40B: attention reads its own LayerNorm (attn_norm_2), the parallel GELU MLP reads
    # attn_norm; fused q/k/v, no biases on the projections.
    e = spec.n_embd
    return [
        b.norm(layer, "attn_norm", e),
        b.bias(layer, "attn_norm", e),
        b.norm(layer, "attn_norm_2", e),
        b.bias(layer, "attn_norm_2", e),
        *b.attention(spec, layer, pre_norm=False, fused_qkv=True),
        *b.dense_ffn(spec, layer, pre_norm=False, gated=False),
    ]


def maincoder(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Maincoder-1B: the qwen3 layout (per-head q/k RMSNorms, applied after rope in the graph).
    return b.attention(spec, layer, qk_norm="head") + b.dense_ffn(spec, layer)


def pangu_embedded(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # openPangu-Embedded: llama plus q/k/v biases and an attention-output bias.
    return b.attention(spec, layer, qkv_bias=True, out_bias=True) + b.dense_ffn(spec, layer)


def chatglm(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # ChatGLM3 / GLM-4-9B (chatglm): fused q/k/v with bias, fused gate+up (SwiGLU), half rope.
    return b.attention(spec, layer, fused_qkv=True, qkv_bias=True) + b.dense_ffn(
        spec, layer, fused_up=True
    )


def jais(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Jais: LayerNorms with biases, fused q/k/v with bias, biases on every projection, SwiGLU
    # with biases, ALiBi.
    e, f = spec.n_embd, spec.n_ff
    return b.attention(
        spec, layer, norm_bias=True, fused_qkv=True, qkv_bias=True, out_bias=True
    ) + [
        b.norm(layer, "ffn_norm", e),
        b.bias(layer, "ffn_norm", e),
        b.matrix(layer, "ffn_down", e, f),
        b.bias(layer, "ffn_down", e),
        b.matrix(layer, "ffn_gate", f, e),
        b.bias(layer, "ffn_gate", f),
        b.matrix(layer, "ffn_up", f, e),
        b.bias(layer, "ffn_up", f),
    ]


def hunyuan_vl(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # HunyuanOCR's text tower (hunyuan_vl): per-head q/k RMSNorms after rope.
    return b.attention(spec, layer, qk_norm="head") + b.dense_ffn(spec, layer)


def qwen2vl(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Qwen2-VL's text tower: the qwen2 layout (q/k/v biases); M-RoPE in the graph.
    return b.attention(spec, layer, qkv_bias=True) + b.dense_ffn(spec, layer)


def paddleocr(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # PaddleOCR-VL's text tower: ERNIE-4.5's llama layout (loaded by the ernie4_5 loader).
    return b.attention(spec, layer) + b.dense_ffn(spec, layer)


def mrope_sections(spec: "ModelSpec") -> str | None:
    # ggml's M-RoPE takes four sections that together cover the rotated half-head.
    if not spec.rope_sections:
        return None
    if len(spec.rope_sections) != 4 or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in spec.rope_sections
    ):
        return f"rope_sections must be four non-negative ints, got {spec.rope_sections!r}"
    if sum(spec.rope_sections) != spec.n_rot // 2:
        return (
            f"rope_sections must add up to rope_dim / 2 ({spec.n_rot // 2}), got "
            f"{sum(spec.rope_sections)}"
        )
    return None


def apertus(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Apertus: per-head q/k RMSNorms, an up/down MLP with the xIELU activation (no gate).
    return b.attention(spec, layer, qk_norm="head") + b.dense_ffn(spec, layer, gated=False)


def chameleon(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Chameleon: per-head q/k LayerNorms with their own weight and bias per head.
    h, kv, d = spec.n_head, spec.n_head_kv, spec.n_embd_head
    out = b.attention(spec, layer)
    at = next(i for i, decl in enumerate(out) if decl.name.endswith("attn_output.weight"))
    norms = [
        TensorDecl(b.blk(layer, "attn_q_norm"), (h, d), "norm", False),
        TensorDecl(b.blk(layer, "attn_k_norm"), (kv, d), "norm", False),
        TensorDecl(b.blk(layer, "attn_q_norm", "bias"), (h, d), "bias", False),
        TensorDecl(b.blk(layer, "attn_k_norm", "bias"), (kv, d), "bias", False),
    ]
    return out[:at] + norms + out[at:] + b.dense_ffn(spec, layer)


def plamo3(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # PLaMo 3: fused q/k/v, per-head q/k RMSNorms, post-norms (the loader names them without a
    # ".weight" suffix), fused gate+up (SwiGLU).
    e = spec.n_embd
    out = b.attention(spec, layer, fused_qkv=True, qk_norm="head")
    out.append(TensorDecl(f"blk.{layer}.post_attention_norm", (e,), "norm", False))
    out += b.dense_ffn(spec, layer, fused_up=True)
    out.append(TensorDecl(f"blk.{layer}.post_ffw_norm", (e,), "norm", False))
    return out


def mellum(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Mellum: per-head q/k RMSNorms, softmax top-k experts (no shared expert).
    return b.attention(spec, layer, qk_norm="head") + b.moe_ffn(spec, layer)


def spark2_5(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Spark2.5: llama attention with a sigmoid gate per head on its output (attn_gate, one
    # row per head), GELU-gated MLP.
    out = b.attention(spec, layer)
    at = next(i for i, decl in enumerate(out) if decl.name.endswith("attn_output.weight"))
    gate = b.matrix(layer, "attn_gate", spec.n_head, spec.n_embd)
    return out[:at] + [gate] + out[at:] + b.dense_ffn(spec, layer)


def maple(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Maple: per-head q/k RMSNorms, softmax top-k experts with a clamped SwiGLU.
    return b.attention(spec, layer, qk_norm="head") + b.moe_ffn(spec, layer)


#: A key computed from the spec: (suffix or full key, value, GGUF type).
Key = tuple[str, object, GGUFValueType]


def alternating_swa(spec: "ModelSpec") -> list[Key]:
    """``attention.sliding_window_pattern`` as the per-layer array these loaders require: even
    layers sliding-window, odd ones global."""
    pattern = [layer % 2 == 0 for layer in range(spec.n_layer)]
    return [("attention.sliding_window_pattern", pattern, GGUFValueType.ARRAY)]


def maple_keys(spec: "ModelSpec") -> list[Key]:
    """Maple's sliding-window array plus its per-layer SwiGLU clamp (``swiglu_clamp_exp``), here
    1.0 - 0.1 * layer so that it clips the tiny model's gate and up values and differs per layer
    (the graph reads it by layer index)."""
    clamp = [round(1.0 - 0.1 * layer, 6) for layer in range(spec.n_layer)]
    return alternating_swa(spec) + [("swiglu_clamp_exp", clamp, GGUFValueType.ARRAY)]


def xielu(spec: "ModelSpec") -> list[Key]:
    """Apertus's per-layer xIELU constants (keys without the arch prefix), near the trained
    model's (alpha_p, alpha_n about 0.8, beta 0.5, eps -1e-6) and different per layer, so that a
    stage reading another layer's constants would change the logits."""
    n = spec.n_layer
    return [
        ("xielu.alpha_p", [round(0.8 + 0.05 * i, 6) for i in range(n)], GGUFValueType.ARRAY),
        ("xielu.alpha_n", [round(0.9 - 0.05 * i, 6) for i in range(n)], GGUFValueType.ARRAY),
        ("xielu.beta", [0.5] * n, GGUFValueType.ARRAY),
        ("xielu.eps", [-1e-6] * n, GGUFValueType.ARRAY),
    ]


def plm(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # PLM: q over full heads (nope + rope), kv_a_mqa = the latent plus one shared rope key, its
    # norm, kv_b expanding the latent to per-head nope keys and values; squared-ReLU MLP.
    e, h, rank, v = spec.n_embd, spec.n_head, spec.kv_lora_rank, spec.v_head_dim
    nope = spec.n_embd_head - spec.n_rot
    return [
        b.norm(layer, "attn_norm", e),
        b.matrix(layer, "attn_q", h * spec.n_embd_head, e),
        b.matrix(layer, "attn_kv_a_mqa", rank + spec.n_rot, e),
        b.norm(layer, "attn_kv_a_norm", rank),
        b.matrix(layer, "attn_kv_b", h * (nope + v), rank),
        b.matrix(layer, "attn_output", e, h * v),
        *b.dense_ffn(spec, layer, gated=False),
    ]


def plm_head_widths(spec: "ModelSpec") -> tuple[int, int]:
    """PLM caches whole keys (nope + rope) and values of v_head_dim per head."""
    return spec.n_embd_head, spec.v_head_dim


def low_rank_kv(spec: "ModelSpec") -> str | None:
    # The rope part of each key is the rotated tail of the head; the rest comes from kv_b.
    if not 0 < spec.n_rot < spec.n_embd_head:
        return f"{spec.arch} needs 0 < rope_dim < head_dim (head_dim = qk_nope + qk_rope)"
    return None


def heads(spec: "ModelSpec", layer: int) -> tuple[int, int, int]:
    """(query heads, KV heads, MLP width) of one layer: the per-layer values where the spec has
    them, else the model-wide ones."""
    return (
        spec.layer_n_head[layer] if spec.layer_n_head else spec.n_head,
        spec.layer_n_head_kv[layer] if spec.layer_n_head_kv else spec.n_head_kv,
        spec.layer_n_ff[layer] if spec.layer_n_ff else spec.n_ff,
    )


def openelm(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # OpenELM: fused q/k/v of this layer's heads, per-head q/k RMSNorms, SwiGLU of this layer's
    # width.
    e, d = spec.n_embd, spec.n_embd_head
    h, kv, f = heads(spec, layer)
    return [
        b.norm(layer, "attn_norm", e),
        b.matrix(layer, "attn_qkv", (h + 2 * kv) * d, e),
        b.norm(layer, "attn_q_norm", d),
        b.norm(layer, "attn_k_norm", d),
        b.matrix(layer, "attn_output", e, h * d),
        b.norm(layer, "ffn_norm", e),
        b.matrix(layer, "ffn_gate", f, e),
        b.matrix(layer, "ffn_up", f, e),
        b.matrix(layer, "ffn_down", e, f),
    ]


def deci(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # DeciLM / Nemotron-51B: per-layer heads and widths; a layer with heads but no KV heads is
    # "linear attention" (attn_output alone), one without heads has no attention tensors.
    e, d = spec.n_embd, spec.n_embd_head
    h, kv, f = heads(spec, layer)
    out: list[TensorDecl] = []
    if h and not kv:
        out += [b.norm(layer, "attn_norm", e), b.matrix(layer, "attn_output", e, e)]
    elif h:
        out.append(b.norm(layer, "attn_norm", e))
        for name, width in (("attn_q", h * d), ("attn_k", kv * d), ("attn_v", kv * d)):
            out.append(b.matrix(layer, name, width, e))
        out.append(b.matrix(layer, "attn_output", e, h * d))
    if f:
        out += [
            b.norm(layer, "ffn_norm", e),
            b.matrix(layer, "ffn_gate", f, e),
            b.matrix(layer, "ffn_down", e, f),
            b.matrix(layer, "ffn_up", f, e),
        ]
    return out


def per_layer_shapes(spec: "ModelSpec") -> str | None:
    # One value per layer; layer 0's are the model-wide fields (llama.cpp's n_head() and n_ff()
    # are layer 0's); KV heads divide the query heads; Q8_0 rows of every layer are whole blocks.
    fields = {"layer_n_head": spec.layer_n_head, "layer_n_head_kv": spec.layer_n_head_kv,
              "layer_n_ff": spec.layer_n_ff}
    for name, values in fields.items():
        if values and len(values) != spec.n_layer or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values
        ):
            return f"{name} must be {spec.n_layer} non-negative ints, got {values!r}"
    if heads(spec, 0) != (spec.n_head, spec.n_head_kv, spec.n_ff):
        return "n_head, n_head_kv and n_ff must be layer 0's per-layer values"
    for layer in range(spec.n_layer):
        h, kv, f = heads(spec, layer)
        if kv and (not h or h % kv):
            return f"layer {layer}: {h} query heads are not a multiple of {kv} KV heads"
        if spec.dtype == "Q8_0":
            for decl in _PER_LAYER_BLOCKS[spec.arch](spec, layer):
                if decl.quantized and decl.shape[-1] % 32:
                    return (
                        f"Q8_0 rows must be a multiple of 32 values; {decl.name} rows are "
                        f"{decl.shape[-1]}"
                    )
    return None


def laguna(spec: "ModelSpec", layer: int) -> list[TensorDecl]:
    # Laguna XS.2: per-layer query heads (sliding-window layers have more), per-head q/k
    # RMSNorms, a per-head softplus gate on the attention output (attn_gate, one row per head);
    # after the leading dense blocks, sigmoid-routed experts with a selection bias plus an
    # always-on shared expert of its own width.
    e, d = spec.n_embd, spec.n_embd_head
    h, kv, f = heads(spec, layer)
    out = [
        b.norm(layer, "attn_norm", e),
        b.matrix(layer, "attn_q", h * d, e),
        b.matrix(layer, "attn_k", kv * d, e),
        b.matrix(layer, "attn_v", kv * d, e),
        b.matrix(layer, "attn_output", e, h * d),
        b.norm(layer, "attn_q_norm", d),
        b.norm(layer, "attn_k_norm", d),
        b.matrix(layer, "attn_gate", h, e),
        b.norm(layer, "ffn_norm", e),
    ]
    if layer < spec.n_dense_lead:
        return out + [
            b.matrix(layer, "ffn_gate", f, e),
            b.matrix(layer, "ffn_up", f, e),
            b.matrix(layer, "ffn_down", e, f),
        ]
    return out + b.moe_ffn(spec, layer, pre_norm=False, selection_bias=True, shared="own")


_PER_LAYER_BLOCKS = {"openelm": openelm, "deci": deci, "laguna": laguna}
