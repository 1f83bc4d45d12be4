"""Where a model may be cut into stages: the layers that must share one stage.

Strategy: a cut between layers ``c - 1`` and ``c`` is legal unless it falls inside a group of
layers that must run on one stage because later layers read the KV cells of earlier ones (a stage
holds the KV of its own layers only).  The groups are computed here, once, from the GGUF's
hparams, exactly as llama.cpp's ``create_memory`` wires the reuse (and as native patch 0006's
load-time check refuses a range that cuts a group): in Gemma 3n and Gemma 4 the layers from
``n_layer_kv_from_start`` on compute no K/V and read those of layer ``n_layer_kv_from_start - 2``
(sliding-window layers) or ``- 1`` (global ones), so the group runs from the first layer read to
the last layer.  HY V4's "shared" indexer layers reuse the top-k of the last "full" layer before
them (``attention.indexer.types``; GLM-5.2, glm-dsa at a 1M context, the same by default), so each
full layer and the shared ones after it form a group too (the same holds for what a cut must not
separate, though it is not KV).  Every place that checks or
chooses a split asks this module: the layer range of
one stage (``validate_range``: ``--layers``), ``skippy plan`` and ``skippy up --stages N``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Final

__all__ = ["KvGroup", "kv_groups", "legal_cuts", "cut_refusal", "snap_cuts"]

#: Gemma 3n's n_layer_kv_from_start (llama.cpp hard-codes it in src/models/gemma3n.cpp).
_GEMMA3N_KV_LAYERS = 20
#: Gemma 3n's default sliding-window period when the file has no pattern.
_GEMMA3N_SWA_PERIOD = 5


@dataclasses.dataclass(frozen=True, slots=True)
class KvGroup:
    """Layers ``[start, end)`` that must be on one stage: layers ``[first_reader, end)`` read the
    KV cells of layers from ``start`` on."""

    start: int
    end: int
    first_reader: int
    #: What the readers reuse (the KV cells; HY V4's shared indexer layers: the top-k).
    reused: str = "the KV"

    def cuts_inside(self, cut: int) -> bool:
        return self.start < cut < self.end

    def describe(self) -> str:
        return (f"layers {self.first_reader}..{self.end - 1} reuse {self.reused} of layers "
                f"{self.start}..{self.first_reader - 1}, so layers {self.start}..{self.end - 1} share one stage")


def _swa_pattern(architecture: str, n_layer: int, metadata: Mapping[str, object]) -> list[bool] | None:
    key = f"{architecture}.attention.sliding_window_pattern"
    value = metadata.get(key)
    if isinstance(value, tuple) and len(value) >= n_layer:
        return [bool(v) for v in value[:n_layer]]
    if architecture == "gemma3n":
        period = value if isinstance(value, int) and not isinstance(value, bool) else _GEMMA3N_SWA_PERIOD
        return [period == 0 or il % period < period - 1 for il in range(n_layer)]
    return None


#: GLM-5.2's indexer types (src/models/glm-dsa.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES): layers 0 and
#: 1 full, then one full layer in every 4.  llama.cpp takes them for a glm-dsa file without
#: ``attention.indexer.types`` whose training context is 1M or more (GLM-5 and 5.1: all full).
_GLM_5_2_CONTEXT: Final = 1048576


def _glm_dsa_default(n_layer: int, metadata: Mapping[str, object]) -> tuple[bool, ...]:
    context = metadata.get("glm-dsa.context_length", 0)
    if not isinstance(context, int) or isinstance(context, bool) or context < _GLM_5_2_CONTEXT:
        return (True,) * n_layer
    return tuple(il < 2 or (il - 2) % 4 == 0 for il in range(n_layer))


#: Models whose "shared" indexer layers reuse the last "full" layer's top-k, with what llama.cpp
#: assumes of a layer when the file has no ``attention.indexer.types`` (HY V4: shared; GLM-5 Next:
#: full; glm-dsa: by its training context).  Only attention layers have an indexer (GLM-5 Next's
#: KDA layers, KV heads 0, do not).
_SHARED_INDEXER_DEFAULT: Final[dict[str, Callable[[int, Mapping[str, object]], tuple[bool, ...]]]] = {
    "hy_v4": lambda n_layer, _: (False,) * n_layer,
    "glm5-next": lambda n_layer, _: (True,) * n_layer,
    "glm-dsa": _glm_dsa_default,
}


def _shared_indexer_groups(architecture: str, n_layer: int, metadata: Mapping[str, object]) -> tuple[KvGroup, ...]:
    """Each "full" indexer layer with the "shared" layers after it up to the next full one, which
    reuse its top-k (none without an indexer: ``attention.indexer.top_k`` 0 or absent)."""
    top_k = metadata.get(f"{architecture}.attention.indexer.top_k", 0)
    if not top_k:
        return ()
    types = metadata.get(f"{architecture}.attention.indexer.types",
                         _SHARED_INDEXER_DEFAULT[architecture](n_layer, metadata))
    if isinstance(types, (bool, int)):
        full = [bool(types)] * n_layer
    elif isinstance(types, tuple) and len(types) >= n_layer:
        full = [bool(v) for v in types[:n_layer]]
    else:
        raise ValueError(f"{architecture}.attention.indexer.types is not one value per layer: {types!r}")
    kv_heads = metadata.get(f"{architecture}.attention.head_count_kv")
    attention = [il for il in range(n_layer)
                 if not (isinstance(kv_heads, tuple) and len(kv_heads) > il and kv_heads[il] == 0)]
    if attention and not full[attention[0]]:
        raise ValueError(f"{architecture}: the first attention layer's indexer must be full (nothing precedes it)")
    groups: list[KvGroup] = []
    for at, il in enumerate(attention):
        if full[il] and at + 1 < len(attention) and not full[attention[at + 1]]:
            last = attention[at + 1]
            for j in attention[at + 1:]:
                if full[j]:
                    break
                last = j
            groups.append(KvGroup(il, last + 1, attention[at + 1], "the indexer top-k"))
    return tuple(groups)


def kv_groups(architecture: str, n_layer: int, metadata: Mapping[str, object]) -> tuple[KvGroup, ...]:
    """The KV-sharing groups of a model (empty when no layer reads another layer's KV).

    Raises:
        ValueError: the file declares KV sharing the hparams cannot describe (no sliding-window
            pattern, too few KV layers): llama.cpp would not load it either.
    """
    if architecture in _SHARED_INDEXER_DEFAULT:
        return _shared_indexer_groups(architecture, n_layer, metadata)
    if architecture == "gemma4":
        shared = metadata.get(f"{architecture}.attention.shared_kv_layers", 0)
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(f"{architecture}.attention.shared_kv_layers is not a count: {shared!r}")
        kv_layers = n_layer - shared
    elif architecture == "gemma3n":
        kv_layers = _GEMMA3N_KV_LAYERS
    else:
        return ()
    if kv_layers >= n_layer:
        return ()
    if kv_layers < 2:
        raise ValueError(f"{architecture} with {kv_layers} KV layers of {n_layer}: at least 2 are needed")
    pattern = _swa_pattern(architecture, n_layer, metadata)
    if pattern is None:
        raise ValueError(f"{architecture} file without its per-layer sliding-window pattern")
    first_read = min(kv_layers - (2 if pattern[il] else 1) for il in range(kv_layers, n_layer))
    return (KvGroup(first_read, n_layer, kv_layers),)


def legal_cuts(n_layer: int, groups: Sequence[KvGroup]) -> list[int]:
    """Every layer ``c`` in ``1 .. n_layer - 1`` a stage boundary may fall on."""
    return [cut for cut in range(1, n_layer) if not any(g.cuts_inside(cut) for g in groups)]


def cut_refusal(n_layer: int, groups: Sequence[KvGroup], cut: int) -> str | None:
    """Why a stage boundary at layer ``cut`` is illegal, naming the nearest legal cuts (None: legal)."""
    group = next((g for g in groups if g.cuts_inside(cut)), None)
    if group is None:
        return None
    legal = legal_cuts(n_layer, groups)
    below = [c for c in legal if c < cut]
    above = [c for c in legal if c > cut]
    nearest = [str(c) for c in (below[-1:] + above[:1])]
    offer = f"the nearest legal cuts are {' and '.join(nearest)}" if nearest else "no cut is legal: run it on one stage"
    return f"a cut at layer {cut} separates layers that share {group.reused.removeprefix('the ')} ({group.describe()}); {offer}"


def snap_cuts(n_layer: int, groups: Sequence[KvGroup], cuts: Sequence[int]) -> list[int]:
    """Move each wanted cut to the nearest legal one (ties: the lower), keeping them increasing
    and distinct and leaving enough legal cuts for the ones after it; a split with more cuts than
    the model has legal ones raises ValueError."""
    legal = legal_cuts(n_layer, groups)
    if len(cuts) > len(legal):
        raise ValueError(f"{len(cuts) + 1} stages need {len(cuts)} legal cuts; the model allows only {legal}")
    out: list[int] = []
    for index, cut in enumerate(cuts):
        later = len(cuts) - 1 - index
        options = [c for i, c in enumerate(legal) if (not out or c > out[-1]) and len(legal) - 1 - i >= later]
        out.append(min(options, key=lambda c: (abs(c - cut), c)))
    return out
