"""What a cached prefix's KV depends on, and the 64-bit seed of its page hashes.

Strategy
--------
KV for a token prefix on one stage is a function of: the model file (its content identity, not
its path or display name), the stage's layer range, the context/KV settings that change the
cells' bytes (context size, K/V cache types, flash attention), the wire dtype of the activations
the stage was fed (a lossy wire changes every downstream KV), and the page size the cache cuts
prompts into. A :class:`CacheIdentity` names all of them plus an optional tenant ``namespace``
(an OpenAI ``prompt_cache_key`` or user). Sessions and processes are deliberately *not* part of
it: reuse across sessions is the point.

Isolation is structural, not probabilistic: the prefix tree keeps one root per identity (the
frozen dataclass is the dict key), so two namespaces never share a node even if their 64-bit
seeds collided. The seed exists so that page hashes of different identities differ too (useful
for logs, stats and any hash-keyed structure in phase 2); it is the first 8 bytes of a BLAKE2b
digest of a canonical, length-prefixed encoding of the fields, with a distinct marker for "no
namespace" so that ``None`` never equals ``""``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import TYPE_CHECKING, Final, final

from skippy.cache import radix
from skippy.cache._radix_py import check_page_size

if TYPE_CHECKING:
    from skippy.runtime import StageContext

#: Version of the identity encoding; bump it when the KV layout or the hash changes.
IDENTITY_VERSION: Final = 1
_DOMAIN: Final = b"skippy-prefix-cache-identity\0"
#: Wire dtype name of a stage fed token ids (the first stage): lossless by definition.
TOKENS_INPUT: Final = "tokens"


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


@final
@dataclasses.dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything that changes a stage's KV for a given token prefix.

    Attributes:
        model_identity: content identity of the GGUF file (``Model.identity``).
        layer_start: first layer of the stage.
        layer_end: one past the stage's last layer.
        n_ctx: KV cells of the stage's context.
        wire_dtype: dtype of the activations this stage receives (``"f32"``, ``"f16"``, ``"q8"``),
            or :data:`TOKENS_INPUT` for the first stage. When the edges of a chain use different
            dtypes, name them all, upstream first (``"f16>q8"``): every upstream edge shapes the
            activations this stage sees.
        kv_type_k: K cache type (``"f16"`` is llama.cpp's default).
        kv_type_v: V cache type.
        flash_attention: whether the context computes attention with flash attention.
        page_size: tokens per page of the prefix tree.
        namespace: tenant key; ``None`` is the shared default namespace.
    """

    model_identity: str
    layer_start: int
    layer_end: int
    n_ctx: int
    wire_dtype: str = TOKENS_INPUT
    kv_type_k: str = "f16"
    kv_type_v: str = "f16"
    flash_attention: bool = False
    page_size: int = radix.DEFAULT_PAGE_SIZE
    namespace: str | None = None

    def __post_init__(self) -> None:
        if not self.model_identity:
            raise ValueError("a cache identity needs the model file's identity")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"bad layer range {self.layer_start}:{self.layer_end}")
        if self.n_ctx <= 0:
            raise ValueError(f"n_ctx must be positive, got {self.n_ctx}")
        check_page_size(self.page_size)

    @classmethod
    def for_context(cls, context: "StageContext", *, wire_dtype: str | None = None,
                    page_size: int = radix.DEFAULT_PAGE_SIZE, namespace: str | None = None) -> "CacheIdentity":
        """The identity of a stage context's KV.

        Args:
            context: the stage's context (model identity, layer range, context size).
            wire_dtype: the stage's input dtype; default :data:`TOKENS_INPUT` on the first stage
                and required on the others.
            page_size: tokens per page.
            namespace: tenant key.

        Raises:
            ValueError: a non-first stage without ``wire_dtype``.
        """
        model = context.model
        if wire_dtype is None:
            if not model.is_first:
                raise ValueError(f"stage {model.layers} takes activations: give its input wire dtype")
            wire_dtype = TOKENS_INPUT
        return cls(
            model_identity=model.identity, layer_start=model.layers.start, layer_end=model.layers.end,
            n_ctx=context.n_ctx, wire_dtype=wire_dtype, page_size=page_size, namespace=namespace,
        )

    def with_namespace(self, namespace: str | None) -> "CacheIdentity":
        """The same stage identity for another tenant."""
        if namespace == self.namespace:
            return self
        return dataclasses.replace(self, namespace=namespace)

    def encode(self) -> bytes:
        """The canonical byte encoding the seed is derived from."""
        parts = [
            _DOMAIN,
            struct.pack("<I", IDENTITY_VERSION),
            _field(self.model_identity.encode()),
            struct.pack("<QQQ", self.layer_start, self.layer_end, self.n_ctx),
            _field(self.wire_dtype.encode()),
            _field(self.kv_type_k.encode()),
            _field(self.kv_type_v.encode()),
            struct.pack("<BQ", int(self.flash_attention), self.page_size),
        ]
        if self.namespace is None:
            parts.append(b"\0")
        else:
            parts.append(b"\1" + _field(self.namespace.encode()))
        return b"".join(parts)

    @property
    def seed(self) -> int:
        """64-bit seed of this identity's page hashes."""
        return int.from_bytes(hashlib.blake2b(self.encode(), digest_size=8).digest(), "little")

    def describe(self) -> str:
        """A short human-readable form for logs."""
        tenant = "" if self.namespace is None else f" ns={self.namespace!r}"
        return (f"{self.model_identity[:12]} layers {self.layer_start}:{self.layer_end} ctx {self.n_ctx} "
                f"in {self.wire_dtype} page {self.page_size}{tenant}")
