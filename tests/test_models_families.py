# Tests of the synthetic writers for the architecture families beyond llama/qwen2/qwen3.
#
# Strategy: the expected tensors of each family's block are written out here independently of
# skippy/models/families.py (names, ggml shapes, which are F32), as read from llama.cpp's
# loaders (src/models/<arch>.cpp), and every tiny file is checked against them, together with
# its hparam keys, by the small GGUF parser of tests/gguf_helpers.py (gguf's GGUFReader takes
# seconds per file on a 32000-token vocab, too slow for 33 files). The key and tensor names themselves are checked
# against the pinned llama.cpp tree's src/llama-arch.cpp. Whether llama.cpp accepts each file
# (it refuses a missing required tensor and any tensor it did not ask for) and computes finite,
# non-constant logits with it is checked unsplit in a subprocess through llama-cpp-python on
# the library in skippy/lib (a native crash must not take pytest down); llama.cpp's own
# parameter count must equal the plan's. The spec rules (heads a loader lacks, keys of another
# family, Q8_0 row widths of experts) and the real-shape presets are tested directly.
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf_helpers import parse_gguf, tensor_f32
from skippy.models import ModelSpec, ensure_model, family, plan_tensors, preset, tiny
from skippy.models.families import FAMILIES, OPTIONAL_KEYS
from skippy.models.spec import EXTRA_ARCHITECTURES, NEW_ARCHITECTURES
from skippy.models.synthetic import family_keys, spec_json

REPO_ROOT = Path(__file__).resolve().parents[1]
LIB_DIR = REPO_ROOT / "skippy" / "lib"
LLAMA_ARCH_CPP = (
    REPO_ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "src" / "llama-arch.cpp"
)
DTYPES = ("F32", "F16", "Q8_0")
#: Issue 11's families and the further ones with writers.
ALL_NEW = NEW_ARCHITECTURES + EXTRA_ARCHITECTURES
N_VOCAB = 32000

Shapes = dict[str, tuple[int, ...]]


# --- the blocks as llama.cpp's loaders declare them (ggml ne order: input width first) -------


def _attn(s: ModelSpec, *, norm: bool = True, bias: bool = False) -> Shapes:
    e, q, kv = s.n_embd, s.n_q, s.n_kv
    out: Shapes = {"attn_norm.weight": (e,)} if norm else {}
    out |= {"attn_q.weight": (e, q), "attn_k.weight": (e, kv), "attn_v.weight": (e, kv)}
    if bias:
        out |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    out["attn_output.weight"] = (q, e)
    return out


def _ffn(s: ModelSpec, *, norm: bool = True) -> Shapes:
    e, f = s.n_embd, s.n_ff
    out: Shapes = {"ffn_norm.weight": (e,)} if norm else {}
    return out | {"ffn_gate.weight": (e, f), "ffn_up.weight": (e, f), "ffn_down.weight": (f, e)}


def _experts(s: ModelSpec) -> Shapes:
    e, x, n = s.n_embd, s.n_ff_exp, s.n_expert
    return {
        "ffn_gate_inp.weight": (e, n),
        "ffn_gate_exps.weight": (e, x, n),
        "ffn_up_exps.weight": (e, x, n),
        "ffn_down_exps.weight": (x, e, n),
    }


def _qk_norm(s: ModelSpec) -> Shapes:
    return {"attn_q_norm.weight": (s.n_embd_head,), "attn_k_norm.weight": (s.n_embd_head,)}


def _post(s: ModelSpec) -> Shapes:
    return {"post_attention_norm.weight": (s.n_embd,), "post_ffw_norm.weight": (s.n_embd,)}


def _gpt_oss(s: ModelSpec) -> Shapes:
    e, x, n = s.n_embd, s.n_ff_exp, s.n_expert
    return _attn(s, bias=True) | _experts(s) | {
        "attn_output.bias": (e,),
        "attn_sinks.weight": (s.n_head,),
        "post_attention_norm.weight": (e,),
        "ffn_gate_inp.bias": (n,),
        "ffn_gate_exps.bias": (x, n),
        "ffn_up_exps.bias": (x, n),
        "ffn_down_exps.bias": (e, n),
    }


def _glm4moe(s: ModelSpec, layer: int) -> Shapes:
    out = _attn(s, bias=True) | {"post_attention_norm.weight": (s.n_embd,)}
    if layer < s.n_dense_lead:
        return out | _ffn(s, norm=False)
    w = s.n_ff_exp * s.n_expert_shared
    return out | _experts(s) | {
        "exp_probs_b.bias": (s.n_expert,),
        "ffn_gate_shexp.weight": (s.n_embd, w),
        "ffn_up_shexp.weight": (s.n_embd, w),
        "ffn_down_shexp.weight": (w, s.n_embd),
    }


def _deepseek2(s: ModelSpec, layer: int) -> Shapes:
    e, h, rope = s.n_embd, s.n_head, s.n_rot
    nope, v, q, kv = s.n_embd_head - rope, s.v_head_dim, s.q_lora_rank, s.kv_lora_rank
    out: Shapes = {
        "attn_norm.weight": (e,),
        "attn_q_a_norm.weight": (q,),
        "attn_kv_a_norm.weight": (kv,),
        "attn_q_a.weight": (e, q),
        "attn_q_b.weight": (q, h * (nope + rope)),
        "attn_kv_a_mqa.weight": (e, kv + rope),
        "attn_k_b.weight": (nope, kv, h),
        "attn_v_b.weight": (kv, v, h),
        "attn_output.weight": (h * v, e),
    }
    if layer < s.n_dense_lead:
        return out | _ffn(s)
    w = s.n_ff_exp * s.n_expert_shared
    return out | _experts(s) | {
        "ffn_norm.weight": (e,),
        "exp_probs_b.bias": (s.n_expert,),
        "ffn_gate_shexp.weight": (e, w),
        "ffn_up_shexp.weight": (e, w),
        "ffn_down_shexp.weight": (w, e),
    }


EXPECTED_BLOCK: dict[str, Callable[[ModelSpec, int], Shapes]] = {
    "gemma2": lambda s, i: _attn(s) | _ffn(s) | _post(s),
    "gemma3": lambda s, i: _attn(s) | _ffn(s) | _post(s) | _qk_norm(s),
    "phi3": lambda s, i: {
        "attn_norm.weight": (s.n_embd,),
        "attn_qkv.weight": (s.n_embd, s.n_embd + 2 * s.n_kv),
        "attn_output.weight": (s.n_embd, s.n_embd),
        "ffn_norm.weight": (s.n_embd,),
        "ffn_up.weight": (s.n_embd, 2 * s.n_ff),
        "ffn_down.weight": (s.n_ff, s.n_embd),
    },
    "mistral3": lambda s, i: _attn(s) | _ffn(s),
    "olmo2": lambda s, i: _attn(s, norm=False) | _ffn(s, norm=False) | _post(s) | {
        "attn_q_norm.weight": (s.n_embd,),
        "attn_k_norm.weight": (s.n_kv,),
    },
    "granite": lambda s, i: _attn(s) | _ffn(s),
    "glm4": lambda s, i: _attn(s, bias=True) | _post(s) | {
        "ffn_norm.weight": (s.n_embd,),
        "ffn_up.weight": (s.n_embd, 2 * s.n_ff),
        "ffn_down.weight": (s.n_ff, s.n_embd),
    },
    "qwen2moe": lambda s, i: _attn(s, bias=True) | _experts(s) | {
        "ffn_norm.weight": (s.n_embd,),
        "ffn_gate_inp_shexp.weight": (s.n_embd,),
        "ffn_gate_shexp.weight": (s.n_embd, s.n_ff_shexp),
        "ffn_up_shexp.weight": (s.n_embd, s.n_ff_shexp),
        "ffn_down_shexp.weight": (s.n_ff_shexp, s.n_embd),
    },
    "qwen3moe": lambda s, i: _attn(s) | _qk_norm(s) | _experts(s) | {"ffn_norm.weight": (s.n_embd,)},
    "gpt-oss": lambda s, i: _gpt_oss(s),
    "glm4moe": _glm4moe,
    "deepseek2": _deepseek2,
    "gemma": lambda s, i: _attn(s) | _ffn(s),
    "olmoe": lambda s, i: _attn(s) | {
        "attn_q_norm.weight": (s.n_embd,),
        "attn_k_norm.weight": (s.n_embd,),
        "ffn_norm.weight": (s.n_embd,),
        "ffn_gate_inp.weight": (s.n_embd, s.n_expert),
        "ffn_gate_exps.weight": (s.n_embd, s.n_ff, s.n_expert),
        "ffn_up_exps.weight": (s.n_embd, s.n_ff, s.n_expert),
        "ffn_down_exps.weight": (s.n_ff, s.n_embd, s.n_expert),
    },
    "smollm3": lambda s, i: _attn(s) | _ffn(s),
    "exaone4": lambda s, i: _attn(s, norm=False) | _ffn(s, norm=False) | _post(s) | _qk_norm(s),
    "ernie4_5": lambda s, i: _attn(s) | _ffn(s),
    "starcoder2": lambda s, i: _attn(s, bias=True) | {
        "attn_norm.bias": (s.n_embd,),
        "attn_output.bias": (s.n_embd,),
        "ffn_norm.weight": (s.n_embd,),
        "ffn_norm.bias": (s.n_embd,),
        "ffn_up.weight": (s.n_embd, s.n_ff),
        "ffn_up.bias": (s.n_ff,),
        "ffn_down.weight": (s.n_ff, s.n_embd),
        "ffn_down.bias": (s.n_embd,),
    },
    "cohere2": lambda s, i: _attn(s) | _ffn(s, norm=False),
    "seed_oss": lambda s, i: _attn(s, bias=True) | _ffn(s, norm=False) | {
        "post_attention_norm.weight": (s.n_embd,),
    },
    "llama4": lambda s, i: _attn(s) | (
        _ffn(s) if (i + 1) % s.n_moe_layer_step else _experts(s) | {
            "ffn_norm.weight": (s.n_embd,),
            "ffn_gate_shexp.weight": (s.n_embd, s.n_ff_exp),
            "ffn_up_shexp.weight": (s.n_embd, s.n_ff_exp),
            "ffn_down_shexp.weight": (s.n_ff_exp, s.n_embd),
        }
    ),
    "minimax-m2": lambda s, i: _attn(s) | _experts(s) | {
        "attn_q_norm.weight": (s.n_q,),
        "attn_k_norm.weight": (s.n_kv,),
        "ffn_norm.weight": (s.n_embd,),
        "exp_probs_b.bias": (s.n_expert,),
    },
    "ernie4_5-moe": lambda s, i: _attn(s) | (
        _ffn(s) if i < s.n_dense_lead else _experts(s) | {
            "ffn_norm.weight": (s.n_embd,),
            "exp_probs_b.bias": (s.n_expert,),
            "ffn_gate_shexp.weight": (s.n_embd, s.n_ff_shexp),
            "ffn_up_shexp.weight": (s.n_embd, s.n_ff_shexp),
            "ffn_down_shexp.weight": (s.n_ff_shexp, s.n_embd),
        }
    ),
    "command-r": lambda s, i: _attn(s) | _ffn(s, norm=False),
    "internlm2": lambda s, i: _attn(s) | _ffn(s),
    "phi2": lambda s, i: {
        "attn_norm.weight": (s.n_embd,),
        "attn_norm.bias": (s.n_embd,),
        "attn_qkv.weight": (s.n_embd, s.n_embd + 2 * s.n_kv),
        "attn_qkv.bias": (s.n_embd + 2 * s.n_kv,),
        "attn_output.weight": (s.n_embd, s.n_embd),
        "attn_output.bias": (s.n_embd,),
        "ffn_up.weight": (s.n_embd, s.n_ff),
        "ffn_up.bias": (s.n_ff,),
        "ffn_down.weight": (s.n_ff, s.n_embd),
        "ffn_down.bias": (s.n_embd,),
    },
    "stablelm": lambda s, i: _attn(s, bias=True) | _ffn(s) | {
        "attn_norm.bias": (s.n_embd,),
        "ffn_norm.bias": (s.n_embd,),
    },
    "arcee": lambda s, i: _attn(s) | {
        "ffn_norm.weight": (s.n_embd,),
        "ffn_up.weight": (s.n_embd, s.n_ff),
        "ffn_down.weight": (s.n_ff, s.n_embd),
    },
    "olmo": lambda s, i: _attn(s, norm=False) | _ffn(s, norm=False),
    "hunyuan-moe": lambda s, i: _attn(s) | _qk_norm(s) | {
        "ffn_norm.weight": (s.n_embd,),
        "ffn_gate_inp.weight": (s.n_embd, s.n_expert),
        "ffn_gate_exps.weight": (s.n_embd, s.n_ff, s.n_expert),
        "ffn_up_exps.weight": (s.n_embd, s.n_ff, s.n_expert),
        "ffn_down_exps.weight": (s.n_ff, s.n_embd, s.n_expert),
        "ffn_gate_shexp.weight": (s.n_embd, s.n_ff_shexp),
        "ffn_up_shexp.weight": (s.n_embd, s.n_ff_shexp),
        "ffn_down_shexp.weight": (s.n_ff_shexp, s.n_embd),
    },
    "bailingmoe2": lambda s, i: _qk_norm(s) | {
        "attn_norm.weight": (s.n_embd,),
        "attn_qkv.weight": (s.n_embd, s.n_embd + 2 * s.n_kv),
        "attn_output.weight": (s.n_q, s.n_embd),
    } | (
        _ffn(s) if i < s.n_dense_lead else _experts(s) | {
            "ffn_norm.weight": (s.n_embd,),
            "exp_probs_b.bias": (s.n_expert,),
            "ffn_gate_shexp.weight": (s.n_embd, s.n_ff_exp),
            "ffn_up_shexp.weight": (s.n_embd, s.n_ff_exp),
            "ffn_down_shexp.weight": (s.n_ff_exp, s.n_embd),
        }
    ),
    "exaone": lambda s, i: _attn(s) | _ffn(s),
    "nemotron": lambda s, i: _attn(s) | {
        "attn_norm.bias": (s.n_embd,),
        "ffn_norm.weight": (s.n_embd,),
        "ffn_norm.bias": (s.n_embd,),
        "ffn_up.weight": (s.n_embd, s.n_ff),
        "ffn_down.weight": (s.n_ff, s.n_embd),
    },
    "dots1": lambda s, i: _attn(s) | _qk_norm(s) | (
        _ffn(s) if i < s.n_dense_lead else _experts(s) | {
            "ffn_norm.weight": (s.n_embd,),
            "exp_probs_b.bias": (s.n_expert,),
            "ffn_gate_shexp.weight": (s.n_embd, s.n_ff_exp),
            "ffn_up_shexp.weight": (s.n_embd, s.n_ff_exp),
            "ffn_down_shexp.weight": (s.n_ff_exp, s.n_embd),
        }
    ),
}

#: Keys (without the arch prefix) each tiny file must carry, with their values.
EXPECTED_KEYS: dict[str, dict[str, object]] = {
    "gemma2": {
        "attention.sliding_window": 8, "attention.sliding_window_pattern": 2,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    },
    "gemma3": {
        "attention.sliding_window": 8, "attention.sliding_window_pattern": 2,
        "rope.freq_base_swa": 10000.0,
    },
    "phi3": {},
    "mistral3": {
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 16, "attention.temperature_scale": 0.1,
    },
    "olmo2": {},
    "granite": {
        "embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.0078125,
        "logit_scale": 8.0,
    },
    "glm4": {"rope.dimension_count": 8},
    "qwen2moe": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_shared_feed_forward_length": 64,
    },
    "qwen3moe": {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32},
    "gpt-oss": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64,
        "attention.sliding_window": 8, "attention.sliding_window_pattern": 2,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096,
    },
    "glm4moe": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_shared_count": 1, "leading_dense_block_count": 1, "expert_gating_func": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5, "rope.dimension_count": 16,
    },
    "deepseek2": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_shared_count": 1, "leading_dense_block_count": 1, "expert_gating_func": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5, "attention.q_lora_rank": 32,
        "attention.kv_lora_rank": 64, "attention.value_length_mla": 32,
        "attention.key_length_mla": 48, "attention.key_length": 80,
        "attention.value_length": 64, "attention.head_count_kv": 1, "rope.dimension_count": 16,
    },
    "gemma": {},
    "olmoe": {"expert_count": 8, "expert_used_count": 2, "attention.head_count_kv": 4},
    "smollm3": {},
    "exaone4": {},
    "ernie4_5": {},
    "starcoder2": {"attention.layer_norm_epsilon": 1e-5},
    "cohere2": {
        "attention.layer_norm_epsilon": 1e-5, "logit_scale": 0.25,
        "attention.sliding_window": 8, "attention.sliding_window_pattern": 4,
    },
    "seed_oss": {},
    "llama4": {
        "expert_count": 8, "expert_used_count": 1, "expert_feed_forward_length": 32,
        "interleave_moe_layer_step": 2,
    },
    "minimax-m2": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_gating_func": 2, "rope.dimension_count": 16,
    },
    "ernie4_5-moe": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "interleave_moe_layer_step": 1, "leading_dense_block_count": 1,
        "expert_shared_feed_forward_length": 64,
    },
    "command-r": {"attention.layer_norm_epsilon": 1e-5, "logit_scale": 0.0625},
    "internlm2": {},
    "phi2": {"attention.layer_norm_epsilon": 1e-5, "rope.dimension_count": 8},
    "stablelm": {"attention.layer_norm_epsilon": 1e-5, "rope.dimension_count": 4},
    "arcee": {},
    "olmo": {"attention.layer_norm_epsilon": 1e-5, "attention.clamp_kqv": 1.5},
    "hunyuan-moe": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_shared_feed_forward_length": 64,
    },
    "bailingmoe2": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_shared_count": 1, "leading_dense_block_count": 1, "expert_gating_func": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5, "rope.dimension_count": 8,
    },
    "exaone": {},
    "nemotron": {"attention.layer_norm_epsilon": 1e-5, "rope.dimension_count": 8},
    "dots1": {
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_shared_count": 1, "leading_dense_block_count": 1, "expert_gating_func": 2,
        "expert_weights_norm": True, "expert_weights_scale": 2.5, "attention.head_count_kv": 4,
    },
}

#: Keys of EXPECTED_KEYS that every file has (not one of the optional family keys).
COMMON_KEYS = {
    "rope.dimension_count", "attention.key_length", "attention.value_length",
    "attention.head_count_kv", "attention.key_length_mla",
}

#: Keys every file has, which an optional per-layer field (OpenELM, DeciLM, Laguna) replaces.
BASE_KEYS = {"attention.head_count", "attention.head_count_kv", "feed_forward_length"}

#: Tensors stored F32 whatever the file's dtype: 1-D ones, biases and routers.
def _always_f32(name: str, ne: tuple[int, ...]) -> bool:
    return len(ne) == 1 or name.endswith(".bias") or ".ffn_gate_inp" in name


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "token_embd.weight": ((spec.n_embd, N_VOCAB), spec.dtype),
    }
    if spec.arch != "olmo":  # OLMo 1's LayerNorms have no weights
        out["output_norm.weight"] = ((spec.n_embd,), "F32")
    if not spec.tied:
        out["output.weight"] = ((spec.n_embd, N_VOCAB), spec.dtype)
    if spec.arch in ("starcoder2", "phi2", "stablelm", "nemotron"):
        out["output_norm.bias"] = ((spec.n_embd,), "F32")
    if spec.arch == "phi2":
        out["output.bias"] = ((N_VOCAB,), "F32")
    for i in range(spec.n_layer):
        for name, ne in EXPECTED_BLOCK[spec.arch](spec, i).items():
            full = f"blk.{i}.{name}"
            out[full] = (ne, "F32" if _always_f32(full, ne) else spec.dtype)
    return out


def all_configs() -> list[tuple[str, str, bool]]:
    return [
        (arch, dtype, tied)
        for arch in ALL_NEW
        for dtype in DTYPES
        for tied in sorted(family(arch).heads)
    ]


def structure_cases() -> list[object]:
    """Every config; the fast suite keeps F32 and Q8_0 (row-width rules) of each family's first
    head option (the F32 files are the fast exactness tests' too)."""
    out: list[object] = []
    for config in all_configs():
        arch, dtype, tied = config
        fast = dtype != "F16" and tied == min(family(arch).heads)
        out.append(pytest.param(config, id=config_id(config), marks=() if fast else (pytest.mark.slow,)))
    return out


def config_id(config: tuple[str, str, bool]) -> str:
    arch, dtype, tied = config
    return f"{arch}-{dtype}-{'tied' if tied else 'untied'}"


# --- file structure --------------------------------------------------------------------------

@pytest.mark.parametrize("config", structure_cases())
def test_family_file_has_the_loaders_tensors_and_keys(config: tuple[str, str, bool]) -> None:
    arch, dtype, tied = config
    spec = tiny(arch, dtype=dtype, tied=tied)  # type: ignore[arg-type]
    parsed = parse_gguf(ensure_model(spec))
    fields = parsed.fields
    assert fields["general.architecture"] == arch
    for suffix, value in EXPECTED_KEYS[arch].items():
        got = fields.get(f"{arch}.{suffix}")
        assert got == (pytest.approx(value) if isinstance(value, float) else value), suffix
    # No key of another family's optional fields sneaks in (the per-layer head counts and widths
    # replace keys every file has).
    optional = {f"{arch}.{k.suffix}" for k in OPTIONAL_KEYS.values() if k.suffix not in BASE_KEYS}
    written = {k for k in fields if k in optional}
    assert written == {f"{arch}.{s}" for s in EXPECTED_KEYS[arch] if s not in COMMON_KEYS}
    actual = {name: (ne, kind) for name, (ne, kind, _) in parsed.tensors.items()}
    assert actual == expected_tensors(spec)
    names = list(parsed.tensors)
    block_of = [int(n.split(".")[1]) for n in names if n.startswith("blk.")]
    assert block_of == sorted(block_of), "blocks must be stored in layer order"
    for name, (_, kind, _) in parsed.tensors.items():
        if kind == "F32":
            values = tensor_f32(parsed, name)
            assert np.isfinite(values).all() and values.std() > 0, name


def test_names_and_keys_are_llama_cpps() -> None:
    if not LLAMA_ARCH_CPP.is_file():
        pytest.skip(f"no pinned llama.cpp tree at {LLAMA_ARCH_CPP}")
    source = LLAMA_ARCH_CPP.read_text()
    keys = set(re.findall(r'"%s\.([a-z_.]+)"', source))
    for field_name, key in OPTIONAL_KEYS.items():
        assert key.suffix in keys, f"{field_name} -> {key.suffix} is not a llama.cpp key"
    for arch, expected in EXPECTED_KEYS.items():
        for suffix in expected:
            assert suffix in keys, f"{arch}: {suffix} is not a llama.cpp key"
    tensor_names = set(re.findall(r'"blk\.%d\.([a-z_0-9]+)"', source))
    arch_names = set(re.findall(r'\{ LLM_ARCH_[A-Z0-9_]+, *"([a-z0-9_-]+)" *\}', source))
    for arch in ALL_NEW:
        assert arch in arch_names, arch
        spec = tiny(arch)
        for decl in FAMILIES[arch].block(spec, spec.n_layer - 1):
            base = decl.name.split(".")[2]
            assert base in tensor_names, decl.name


def test_existing_specs_keep_their_bytes(tmp_path: Path) -> None:
    """The family fields did not change the file of any spec that existed before them."""
    spec = tiny("llama")
    assert set(json.loads(spec_json(spec))) == {
        "generator_version", "arch", "n_layer", "n_embd", "n_ff", "n_head", "n_head_kv",
        "head_dim", "vocab", "dtype", "tied", "context_length", "rope_theta", "rms_eps", "seed",
        "name",
    }
    assert family_keys(spec) == []
    from skippy.models import write_model

    digest = hashlib.sha256(write_model(spec, tmp_path / "llama.gguf").read_bytes()).hexdigest()
    assert digest == "ca3f479c4151cfffb2e718b8169bdc4dd853d91291cd2f31265e58392980a30f"


def test_lower_precision_experts_round_the_same_weights() -> None:
    from gguf import GGMLQuantizationType, quants

    files = {d: parse_gguf(ensure_model(tiny("qwen3moe", dtype=d))) for d in DTYPES}  # type: ignore[arg-type]

    def data(dtype: str, name: str) -> np.ndarray:
        parsed = files[dtype]
        ne, kind, offset = parsed.tensors[name]
        n = int(np.prod(ne))
        if kind == "Q8_0":
            return np.frombuffer(parsed.data, dtype=np.uint8, count=n // 32 * 34, offset=offset)
        dtype_np = np.float32 if kind == "F32" else np.float16
        return np.frombuffer(parsed.data, dtype=dtype_np, count=n, offset=offset).reshape(ne[::-1])

    name = "blk.1.ffn_down_exps.weight"
    full = data("F32", name)
    assert full.shape == (8, 64, 32)
    np.testing.assert_array_equal(data("F16", name), full.astype(np.float16))
    q8 = quants.quantize(full.reshape(-1, 32), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(data("Q8_0", name), q8.ravel())
    assert full.std() == pytest.approx(1 / np.sqrt(32), rel=0.05)
    # Experts differ from each other; routers stay F32 in every file.
    assert not np.array_equal(full[0], full[1])
    for dtype in DTYPES:
        router = data(dtype, "blk.1.ffn_gate_inp.weight")
        assert router.dtype == np.float32 and router.shape == (8, 64)


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        ("gemma2", {"tied": False}, "no untied head"),
        ("olmo2", {"tied": True}, "no tied head"),
        ("qwen2moe", {"n_ff_shexp": 0}, "needs n_ff_shexp"),
        ("qwen3moe", {"n_expert_used": 9}, "n_expert_used"),
        ("llama", {"n_expert": 8}, "does not apply to llama"),
        ("gpt-oss", {"sliding_window": 0}, "needs sliding_window"),
        ("gemma3", {"attn_softcap": 50.0}, "attn_softcap does not apply"),
        ("phi3", {"head_dim": 32}, "phi3 needs n_head"),
        ("granite", {"logit_scale": 0.0}, "needs logit_scale"),
        ("glm4moe", {"n_dense_lead": 4}, "n_dense_lead"),
        ("qwen3moe", {"dtype": "Q8_0", "n_ff_exp": 48}, "Q8_0 rows"),
        ("mistral3", {"rope_orig_ctx": 0, "rope_scaling": ""}, "attn_temp_scale needs"),
        ("phi3", {"name": "my-phi3"}, "phi3"),
        ("deepseek2", {"n_head_kv": 2}, "n_head_kv == 1"),
        ("deepseek2", {"kv_lora_rank": 0}, "needs kv_lora_rank"),
        ("olmoe", {"n_head_kv": 2}, "n_head_kv == n_head"),
        ("cohere2", {"ln_eps": 0.0}, "needs ln_eps"),
        ("gemma", {"tied": False}, "no untied head"),
        ("llama4", {"n_moe_layer_step": 0}, "needs n_moe_layer_step"),
        ("minimax-m2", {"n_ff": 64}, "n_ff_exp == n_ff"),
        ("dots1", {"n_head_kv": 2}, "n_head_kv == n_head"),
        ("ernie4_5-moe", {"n_moe_layer_step": 2}, "n_moe_layer_step == 1"),
        # issue 26, dense
        ("qwen2vl", {"rope_sections": ()}, "needs rope_sections"),
        ("qwen2vl", {"rope_sections": (2, 3, 3)}, "four non-negative ints"),
        ("hunyuan_vl", {"rope_sections": (4, 4, 4, 5)}, "add up to rope_dim / 2"),
        ("llama", {"rope_sections": (2, 2, 2, 2)}, "rope_sections does not apply to llama"),
        ("jais", {"max_alibi_bias": 0.0}, "needs max_alibi_bias"),
        ("openelm", {"layer_n_ff": (64, 128)}, "layer_n_ff must be 4"),
        ("openelm", {"layer_n_head": (4, 4, 4, 8)}, "layer 0's per-layer values"),
        ("openelm", {"layer_n_head_kv": (1, 3, 2, 2)}, "not a multiple of 3 KV heads"),
        ("openelm", {"dtype": "Q8_0", "layer_n_ff": (64, 128, 144, 256)}, "Q8_0 rows"),
        ("deci", {"layer_n_head": (4, 0, 4, 4), "layer_n_head_kv": (2, 1, 0, 2)}, "not a multiple"),
        ("llama", {"layer_n_head": (4, 4, 4, 4)}, "layer_n_head does not apply to llama"),
        ("plm", {"rope_dim": 0}, "0 < rope_dim < head_dim"),
        ("plm", {"n_head_kv": 2}, "n_head_kv == n_head"),
        ("qwen", {"n_head_kv": 2}, "n_head_kv == n_head"),
        ("laguna", {"layer_n_head": ()}, "needs layer_n_head"),
    ],
)
def test_family_rules_refuse_what_the_loader_would(
    arch: str, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tiny(arch), **overrides)  # type: ignore[arg-type]


def test_real_shape_presets() -> None:
    gemma = preset("gemma3-270m")
    assert (gemma.arch, gemma.n_layer, gemma.n_embd, gemma.n_ff) == ("gemma3", 18, 640, 2048)
    assert (gemma.n_head, gemma.n_head_kv, gemma.n_embd_head, gemma.tied) == (4, 1, 256, True)
    assert (gemma.sliding_window, gemma.swa_pattern) == (512, 6)
    plans = plan_tensors(gemma, 262144)
    # Gemma 3 270M: 268M parameters with its 262144-token vocab, 170M of them the embedding.
    assert sum(p.n_values for p in plans) == pytest.approx(268.1e6, rel=0.01)
    moe = preset("qwen3moe-30b-a3b-8e")
    assert (moe.n_embd, moe.n_head, moe.n_head_kv, moe.n_embd_head) == (2048, 32, 4, 128)
    assert (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, moe.dtype) == (8, 2, 768, "Q8_0")
    plans = plan_tensors(moe, N_VOCAB)
    total = sum(p.nbytes for p in plans)
    assert 0.5e9 < total < 1.0e9
    experts = sum(p.nbytes for p in plans if "_exps" in p.name)
    assert experts / total > 0.5
    oss = preset("gpt-oss-20b-4l")
    assert (oss.n_embd, oss.n_head, oss.n_head_kv, oss.n_embd_head) == (2880, 64, 8, 64)
    assert (oss.n_expert, oss.n_ff_exp, oss.sliding_window, oss.swa_pattern) == (4, 2880, 128, 2)
    assert 0.5e9 < sum(p.nbytes for p in plan_tensors(oss, N_VOCAB)) < 1.0e9


def test_cli_lists_every_family(capsys: pytest.CaptureFixture[str]) -> None:
    from skippy.models.__main__ import main

    assert main(["--list"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {f"tiny-{arch}" for arch in ALL_NEW} <= listed
    assert {"gemma3-270m", "qwen3moe-30b-a3b-8e", "gpt-oss-20b-4l"} <= listed


# --- llama.cpp loads and runs them unsplit ---------------------------------------------------

_LLAMA_CHECK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    results = []
    for path in sys.argv[1:]:
        model = Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=False)
        tokens = model.tokenize(b"Hello, world! The quick brown fox jumps over the lazy dog")
        model.eval(tokens)
        logits = np.array(model.scores[: len(tokens)])
        generated = model.generate(tokens, temp=0.0)
        new = [next(generated) for _ in range(4)]
        results.append({
            "n_params": int(llama_cpp.llama_model_n_params(model.model)),
            "finite": bool(np.isfinite(logits).all()),
            "spread": float(logits.std(axis=1).min()),
            "distinct_rows": len({row.tobytes() for row in logits}),
            "rows": len(tokens),
            "new_tokens": len(new),
        })
        del model
    print(json.dumps(results))
    """
)


def _run_unsplit(specs: list[ModelSpec]) -> None:
    if not (LIB_DIR / "libllama.so").is_file():
        pytest.skip(f"no libllama.so in {LIB_DIR}: the native build has not installed it yet")
    paths = [str(ensure_model(spec)) for spec in specs]
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(LIB_DIR)}
    completed = subprocess.run(
        [sys.executable, "-c", _LLAMA_CHECK, *paths],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    for spec, result in zip(specs, results, strict=True):
        label = spec.short_name()
        assert result["n_params"] == sum(p.n_values for p in plan_tensors(spec, N_VOCAB)), label
        assert result["finite"], label
        # granite's logit_scale 8 divides the logits by 8, cohere2's 0.25 / command-r's 0.0625
        # multiply them
        assert result["spread"] > (0.02 if spec.logit_scale else 0.1), f"{label}: nearly constant"
        assert result["distinct_rows"] == result["rows"], label
        assert result["new_tokens"] == 4, label


@pytest.mark.slow  # ~30 s on 2 busy cores; the fast exactness tests load every family unsplit too
def test_llama_cpp_loads_and_runs_every_family() -> None:
    _run_unsplit([tiny(arch) for arch in ALL_NEW])  # type: ignore[arg-type]


@pytest.mark.slow
def test_llama_cpp_loads_and_runs_every_family_dtype_and_head() -> None:
    _run_unsplit([tiny(a, dtype=d, tied=t) for a, d, t in all_configs()])  # type: ignore[arg-type]


@pytest.mark.slow
def test_llama_cpp_loads_the_gemma3_270m_shape() -> None:
    _run_unsplit([preset("gemma3-270m")])


def test_qwen35moe_real_shape_preset() -> None:
    """Issue 25's real hybrid shape: Qwen3.5-35B-A3B's blocks (8 of 40 layers: two groups of
    three delta-net layers and one attention layer), all 256 experts; about 7.3 GB in Q8_0."""
    from skippy.models.blocks_linear import is_recurrent

    spec = preset("qwen35moe-35b-a3b-8l")
    assert (spec.n_embd, spec.n_head, spec.n_head_kv, spec.n_embd_head, spec.n_rot) == (2048, 16, 2, 256, 64)
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp, spec.n_ff_shexp) == (256, 8, 512, 512)
    assert (spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim) == (16, 32, 128)
    assert [is_recurrent(spec, layer) for layer in range(spec.n_layer)] == [True, True, True, False] * 2
    plans = plan_tensors(spec, N_VOCAB)
    total = sum(p.nbytes for p in plans)
    assert 7.0e9 < total < 7.6e9
    assert sum(p.nbytes for p in plans if "_exps" in p.name) / total > 0.9
    # written a tensor at a time: the largest (one layer's stacked experts) is under 300 MB
    assert max(p.nbytes for p in plans) < 300e6
