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
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Final, Literal, get_args

__all__ = [
    "Architecture",
    "ModelSpec",
    "PRESETS",
    "VocabName",
    "WeightDtype",
    "demo",
    "preset",
    "tiny",
]

Architecture = Literal["llama", "qwen2", "qwen3"]
VocabName = Literal["llama-spm", "llama-bpe", "qwen2"]
WeightDtype = Literal["F32", "F16", "Q8_0"]

ARCHITECTURES: Final = frozenset(get_args(Architecture))
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
                "give head_dim explicitly (qwen3/llama only)"
            )
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim!r}")
        if self.n_embd_head % 2 != 0:
            raise ValueError(f"head_dim must be even for rope, got {self.n_embd_head}")
        if self.arch == "qwen2" and self.n_head * self.n_embd_head != self.n_embd:
            # llama.cpp's qwen2 loader shapes attn_q/attn_output as n_embd x n_embd.
            raise ValueError(
                f"qwen2 needs n_head * head_dim == n_embd, got {self.n_head} * "
                f"{self.n_embd_head} != {self.n_embd}"
            )
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError("rope_theta and rms_eps must be positive")
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

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dict (stable order), for hashing and display."""
        return dataclasses.asdict(self)

    def short_name(self) -> str:
        """A readable file-name stem, e.g. ``qwen3-28x1024-F16-tied``."""
        head = "tied" if self.tied else "untied"
        return f"{self.arch}-{self.n_layer}x{self.n_embd}-{self.vocab}-{self.dtype}-{head}"


def tiny(
    arch: Architecture = "llama",
    *,
    dtype: WeightDtype = "F32",
    tied: bool = False,
    vocab: VocabName = "llama-spm",
    n_layer: int = 4,
    n_embd: int = 64,
    seed: int = 0,
) -> ModelSpec:
    """A test-sized model: 4 layers, n_embd 64, n_ff 128, 4 query / 2 KV heads.

    qwen3 gets ``head_dim = 32`` (so ``n_head * head_dim = 128 != n_embd``), exercising the
    decoupled head width that real Qwen3 checkpoints use. The default vocab is the 32000-token
    SPM one, which keeps the embedding at 8 MB in F32.

    Args:
        arch: the llama.cpp architecture.
        dtype: weight storage type.
        tied: share the output head with the token embedding.
        vocab: tokenizer source.
        n_layer: number of blocks.
        n_embd: residual width (a multiple of 32 keeps Q8_0 valid).
        seed: random seed.

    Returns:
        The validated spec.
    """
    return ModelSpec(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=2 * n_embd,
        n_head=4,
        n_head_kv=2,
        head_dim=(n_embd // 2) if arch == "qwen3" else None,
        vocab=vocab,
        dtype=dtype,
        tied=tied,
        context_length=2048,
        rope_theta=10000.0,
        rms_eps=1e-6 if arch != "llama" else 1e-5,
        seed=seed,
        name=f"skippy-tiny-{arch}",
    )


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


#: Named presets; each is a zero-argument factory.
PRESETS: Final[dict[str, Callable[[], ModelSpec]]] = {
    "tiny-llama": lambda: tiny("llama"),
    "tiny-qwen2": lambda: tiny("qwen2"),
    "tiny-qwen3": lambda: tiny("qwen3"),
    "demo": demo,
    "qwen3-0.6b": qwen3_0_6b,
    "llama-3.2-1b": llama_3_2_1b,
    "llama-16x1024": llama_16x1024,
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
