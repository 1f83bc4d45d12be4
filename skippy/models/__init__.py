# Synthetic GGUF models: seeded random weights, real llama.cpp tokenizers, cached by spec.
#
# Strategy: tests, the demo and the benchmarks cannot download weights, so they generate them.
# `spec.py` says what a model is (and names the presets), `families.py` what each architecture's
# hparams and blocks look like (built from the pieces in `blocks.py`), `vocab_files.py` finds
# and reads the tokenizer of a vocab-only GGUF, `synthetic.py` writes the file, `cache.py` keeps
# one file per spec, and `__main__.py` is the command line (`python -m skippy.models`). The
# `vocab/` folder (gitignored, no Python in it) is where the native build copies the vocab-only
# GGUFs.
from __future__ import annotations

from skippy.models.cache import cache_dir, cached_path, ensure_model, spec_key
from skippy.models.spec import (
    PRESETS,
    Architecture,
    ModelSpec,
    VocabName,
    WeightDtype,
    demo,
    gemma3_270m,
    gpt_oss_20b_4l,
    llama_3_2_1b,
    llama_16x1024,
    preset,
    qwen3_0_6b,
    qwen3moe_30b_a3b_8e,
    tiny,
)
from skippy.models.families import FAMILIES, Family, family
from skippy.models.synthetic import TensorPlan, plan_tensors, write_model
from skippy.models.vocab_files import VocabNotFoundError, read_tokenizer, vocab_path

__all__ = [
    "PRESETS",
    "Architecture",
    "ModelSpec",
    "TensorPlan",
    "VocabName",
    "VocabNotFoundError",
    "WeightDtype",
    "cache_dir",
    "cached_path",
    "demo",
    "ensure_model",
    "FAMILIES",
    "Family",
    "family",
    "gemma3_270m",
    "gpt_oss_20b_4l",
    "llama_16x1024",
    "llama_3_2_1b",
    "plan_tensors",
    "preset",
    "qwen3_0_6b",
    "qwen3moe_30b_a3b_8e",
    "read_tokenizer",
    "spec_key",
    "tiny",
    "vocab_path",
    "write_model",
]
