"""What one token costs each part of a model (layers, input embedding, output head), from the
GGUF header, and the split of the layers into stages that balances it.

Strategy
--------
* **Units**: multiply-adds (MACs) per token row, plus the bytes a row reads.  A weight matrix
  costs one MAC per element; the input embedding copies one row (``n_embd``); the output head is
  a ``n_vocab x n_embd`` matrix (``output.weight``, or ``token_embd`` when tied: Gemma 3 270M's
  262,144-row head costs as much as 30 of its layers).  MoE expert tensors (3-D, one slice per
  expert) count ``expert_used_count / expert_count`` of their elements: only the routed experts
  run.  An attention layer adds its scores and weighted sum over the context a row attends to
  (``n_head x (key_length + value_length) x min(sliding_window, ATTENDED_TOKENS)``); a recurrent
  layer (:mod:`skippy.runtime.layer_kinds`) adds a read and a write of its state instead
  (``2 x n_embd_r + n_embd_s``); every layer adds :data:`LAYER_FIXED_MACS` for its small ops
  (norms, rope, activations and the threads' barriers between them), which dominate only in tiny
  models.
* **Time** (:meth:`PartCosts.time_ms`): a part takes the longer of reading its weights at the
  assumed bandwidth and computing its MACs at the assumed rate (a roofline): decode on a CPU is
  compute bound for the quantized matrices of small models (the head of Gemma 3 270M: about
  8 GMAC/s on one core of the development host whether a batch has 1 row or 8) and memory bound
  for large F16 ones.  ``--measure`` replaces the estimate by timings (:func:`skippy.deploy.plan.measure_layer_times`).
* **Split** (:func:`balanced_split`): the contiguous ranges, cut only where
  :func:`skippy.runtime.cuts.legal_cuts` allows, that minimise the slowest stage's time (the
  output head charged to the last stage, the embedding to the first), by a dynamic programme over
  (stage, end layer); among the splits as fast as that, the one with the least sum of squared stage
  times (stages closest to equal).  :func:`shares` gives
  each stage's expected share of a token's time, which ``skippy up`` and ``skippy plan`` print.
* **Head split** (:func:`head_split`, issue 31): when the final stage is still above its fair share
  (the head alone can be more than half a token, as Gemma 3 270M's is), the head's first
  vocabulary rows move to the least loaded other stage, as many as make the two equal.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Final

from skippy.runtime.cuts import KvGroup, legal_cuts
from skippy.runtime.gguf_header import TensorEntry
from skippy.runtime.layer_kinds import recurrent_layers, state_values_per_layer

__all__ = ["ATTENDED_TOKENS", "HEAD_ROW_ALIGN", "LAYER_FIXED_MACS", "HeadSplit", "PartCosts", "balanced_split",
           "balanced_split_head", "head_split", "part_costs", "shares", "split_head_times", "split_times"]

#: Context a decode row is assumed to attend to (tokens) when estimating attention's cost.
ATTENDED_TOKENS: Final = 512
#: Cost of a layer's small ops and thread barriers, in MACs: about 0.1 ms on the development host
#: (a one-layer stage of Gemma 3 270M measures 0.7-0.9 ms per row against 0.7 ms for its matrices).
LAYER_FIXED_MACS: Final = 1_000_000
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_HEAD = ("output.weight",)
_TIED_HEAD = "token_embd.weight"


@dataclasses.dataclass(frozen=True, slots=True)
class PartCosts:
    """Per-token-row MACs and bytes read of each layer, the input embedding and the output head."""

    layer_macs: tuple[float, ...]
    layer_read_bytes: tuple[float, ...]
    embed_macs: float
    head_macs: float
    head_read_bytes: float

    def time_ms(self, macs: float, read_bytes: float, *, gmacs: float, bandwidth_gbs: float) -> float:
        """The roofline time of one part (ms): the longer of computing and reading it."""
        return max(macs / (gmacs * 1e6), read_bytes / (bandwidth_gbs * 1e6))

    def layer_ms(self, *, gmacs: float, bandwidth_gbs: float) -> tuple[float, ...]:
        return tuple(self.time_ms(m, b, gmacs=gmacs, bandwidth_gbs=bandwidth_gbs)
                     for m, b in zip(self.layer_macs, self.layer_read_bytes))

    def head_ms(self, *, gmacs: float, bandwidth_gbs: float) -> float:
        return self.time_ms(self.head_macs, self.head_read_bytes, gmacs=gmacs, bandwidth_gbs=bandwidth_gbs)

    def embed_ms(self, *, gmacs: float, bandwidth_gbs: float) -> float:
        return self.time_ms(self.embed_macs, self.embed_macs * 4, gmacs=gmacs, bandwidth_gbs=bandwidth_gbs)


def _int(metadata: Mapping[str, object], key: str, default: int = 0) -> int:
    value = metadata.get(key, default)
    if isinstance(value, tuple):  # a per-layer array: the widest layer
        value = max((v for v in value if isinstance(v, int)), default=default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def part_costs(arch: str, n_layer: int, metadata: Mapping[str, object], tensors: Sequence[TensorEntry],
               tensor_bytes: Mapping[str, int], *, layer_period: int = 0) -> PartCosts:
    """The cost of each part of a model (see the module notes).

    Args:
        n_layer: the layers that run (a looped model's slots: layer ``il`` runs block
            ``il % layer_period``).
        tensor_bytes: each tensor's size in the file.
    """
    blocks = layer_period or n_layer
    n_expert, n_used = _int(metadata, f"{arch}.expert_count"), _int(metadata, f"{arch}.expert_used_count")
    macs = [0.0] * blocks
    read = [0.0] * blocks
    head_macs = head_read = 0.0
    names = {t.name for t in tensors}
    n_embd = _int(metadata, f"{arch}.embedding_length")
    for tensor in tensors:
        elements = math.prod(tensor.dims) if tensor.dims else 1
        size = tensor_bytes.get(tensor.name, 0)
        block = _BLOCK.match(tensor.name)
        if block:
            index = int(block.group(1))
            if not 0 <= index < blocks or len(tensor.dims) < 2:
                continue  # vectors (norms, biases, scales): part of the fixed cost
            fraction = 1.0
            if len(tensor.dims) >= 3 and n_expert > 1 and tensor.dims[-1] == n_expert:
                fraction = min(1.0, max(1, n_used) / n_expert)  # only the routed experts run
            macs[index] += elements * fraction
            read[index] += size * fraction
        elif tensor.name in _HEAD or (tensor.name == _TIED_HEAD and "output.weight" not in names):
            head_macs += elements
            head_read += size
    macs = [macs[il % blocks] for il in range(n_layer)]
    read = [read[il % blocks] for il in range(n_layer)]
    recurrent = recurrent_layers(arch, n_layer, metadata) or frozenset()
    n_head = _int(metadata, f"{arch}.attention.head_count", 1)
    head_k = _int(metadata, f"{arch}.attention.key_length", n_embd // max(1, n_head))
    head_v = _int(metadata, f"{arch}.attention.value_length", n_embd // max(1, n_head))
    window = _int(metadata, f"{arch}.attention.sliding_window") or ATTENDED_TOKENS
    attention = n_head * (head_k + head_v) * min(window, ATTENDED_TOKENS)
    state = state_values_per_layer(arch, metadata) if recurrent else 0
    for il in range(n_layer):
        both = arch == "falcon-h1"  # every layer runs attention and an SSM
        extra = (2 * state if il in recurrent else 0) + (attention if il not in recurrent or both else 0)
        macs[il] += extra + LAYER_FIXED_MACS
    return PartCosts(tuple(macs), tuple(read), float(n_embd), head_macs, head_read)


def split_times(layer_ms: Sequence[float], head_ms: float, bounds: Sequence[int], *,
                embed_ms: float = 0.0) -> list[float]:
    """Each stage's time for the stage boundaries ``bounds`` (``[0, c1, ..., n_layer]``)."""
    times = [sum(layer_ms[a:b]) for a, b in zip(bounds, bounds[1:])]
    times[0] += embed_ms
    times[-1] += head_ms
    return times


def shares(times: Sequence[float]) -> list[float]:
    """Each stage's share of a token's time (fractions summing to 1)."""
    total = sum(times)
    return [t / total if total > 0 else 1.0 / len(times) for t in times]


def balanced_split(layer_ms: Sequence[float], head_ms: float, n_stages: int,
                   groups: Sequence[KvGroup] = (), *, embed_ms: float = 0.0,
                   stage_extra_ms: Sequence[float] = ()) -> list[tuple[int, int]]:
    """The ``n_stages`` contiguous ranges that minimise the slowest stage (see the module notes;
    ``stage_extra_ms``: time each stage index spends beyond its layers, e.g. a head shard's rows).

    Raises:
        ValueError: more stages than layers, or than the legal cuts allow.
    """
    n_layer = len(layer_ms)
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_stages} stages")
    legal = legal_cuts(n_layer, groups)
    if n_stages - 1 > len(legal):
        raise ValueError(f"{n_stages} stages need {n_stages - 1} legal cuts; the model allows only {legal}")
    prefix = [0.0]
    for value in layer_ms:
        prefix.append(prefix[-1] + value)

    def stage_time(start: int, end: int) -> float:
        return (prefix[end] - prefix[start] + (embed_ms if start == 0 else 0.0)
                + (head_ms if end == n_layer else 0.0))

    cuts = [0, *legal, n_layer]

    def solve(limit: float) -> tuple[list[dict[int, float]], list[dict[int, int]]]:
        # best[s][end]: with stages 0..s covering layers 0..end-1: the slowest stage (limit = inf),
        # else the least sum of squared stage times among splits whose stages all take <= limit
        best = [{end: math.inf for end in cuts} for _ in range(n_stages)]
        choice: list[dict[int, int]] = [{} for _ in range(n_stages)]
        for s in range(n_stages):
            for end in cuts[1:]:
                for start in [0] if s == 0 else cuts[1:]:
                    if start >= end or (s > 0 and best[s - 1][start] == math.inf):
                        continue
                    t = stage_time(start, end) + (stage_extra_ms[s] if s < len(stage_extra_ms) else 0.0)
                    if t > limit:
                        continue
                    before = 0.0 if s == 0 else best[s - 1][start]
                    value = max(before, t) if limit == math.inf else before + t * t
                    if value < best[s][end]:
                        best[s][end], choice[s][end] = value, start
        return best, choice

    slowest = solve(math.inf)[0][n_stages - 1][n_layer]
    if slowest == math.inf:
        raise ValueError(f"no split of {n_layer} layers into {n_stages} stages at the legal cuts {legal}")
    # among the splits as fast as the best, the one with stages closest to equal
    best, choice = solve(slowest * (1 + 1e-9))
    bounds, end = [n_layer], n_layer
    for s in range(n_stages - 1, -1, -1):
        end = choice[s][end]
        bounds.append(end)
    bounds.reverse()
    return list(zip(bounds, bounds[1:]))


#: A head split moves whole blocks of this many vocabulary rows (a repacked weight's row groups
#: stay whole on both sides: patch 0017's rows are bitwise those of the whole head).
HEAD_ROW_ALIGN: Final = 256


@dataclasses.dataclass(frozen=True, slots=True)
class HeadSplit:
    """The output head's vocabulary rows ``0:rows`` computed on stage ``host`` (beside its layers),
    the rest on the final stage (issue 31)."""

    host: int
    rows: int


def head_split(times: Sequence[float], head_ms: float, n_vocab: int, *,
               rows: int | None = None) -> HeadSplit | None:
    """Where the head's rows go when the final stage of ``times`` (each stage's time, the whole
    head on the last) is above its fair share: the rows that make it and the least loaded other
    stage equal go to that stage (``rows``: that many, chosen by hand).  None: no split (one
    stage, a final stage at or under its share, or fewer rows than one block to move)."""
    count = len(times)
    if count < 2 or head_ms <= 0 or n_vocab <= HEAD_ROW_ALIGN:
        return None
    host = min(range(count - 1), key=lambda s: times[s])
    if rows is None:
        if times[-1] <= sum(times) / count:
            return None
        moved_ms = min(head_ms, (times[-1] - times[host]) / 2)
        rows = int(round(moved_ms / head_ms * n_vocab / HEAD_ROW_ALIGN)) * HEAD_ROW_ALIGN
    rows = min(rows, n_vocab - HEAD_ROW_ALIGN)
    return HeadSplit(host, rows) if rows > 0 else None


def split_head_times(times: Sequence[float], head_ms: float, n_vocab: int, split: HeadSplit | None) -> list[float]:
    """Each stage's time with the head's rows ``0:split.rows`` moved to ``split.host``."""
    result = list(times)
    if split is not None:
        moved = head_ms * split.rows / n_vocab
        result[split.host] += moved
        result[-1] -= moved
    return result


def balanced_split_head(layer_ms: Sequence[float], head_ms: float, n_stages: int, n_vocab: int,
                        groups: Sequence[KvGroup] = (), *,
                        embed_ms: float = 0.0) -> tuple[list[tuple[int, int]], HeadSplit | None]:
    """The layers and the head's rows cut together.  Candidates: the balanced cut with the rows
    :func:`head_split` moves, and the rows ``0:R`` on stage 0 with the layers cut again for each
    ``R`` tried (the head in 16ths, then 128ths around the best); among those within 1% of the
    fastest, the one moving the fewest rows (each row's logits cross the network every token).  No
    split when none beats the whole head on the last stage by more than that.

    Raises:
        ValueError: as :func:`balanced_split`.
    """
    n_layer = len(layer_ms)

    def times_of(split: Sequence[tuple[int, int]], chosen: HeadSplit | None) -> list[float]:
        bounds = [start for start, _ in split] + [n_layer]
        return split_head_times(split_times(layer_ms, head_ms, bounds, embed_ms=embed_ms), head_ms, n_vocab, chosen)

    def recut(rows: int) -> tuple[list[tuple[int, int]], HeadSplit]:
        moved = head_ms * rows / n_vocab
        split = balanced_split(layer_ms, head_ms - moved, n_stages, groups, embed_ms=embed_ms,
                               stage_extra_ms=[moved])
        return split, HeadSplit(0, rows)

    def aligned(fraction: float) -> int:
        return min(n_vocab - HEAD_ROW_ALIGN, int(round(fraction * n_vocab / HEAD_ROW_ALIGN)) * HEAD_ROW_ALIGN)

    base = balanced_split(layer_ms, head_ms, n_stages, groups, embed_ms=embed_ms)
    whole = max(times_of(base, None))
    if n_stages < 2 or head_ms <= 0 or n_vocab <= 2 * HEAD_ROW_ALIGN:
        return base, None
    candidates: list[tuple[list[tuple[int, int]], HeadSplit]] = []
    simple = head_split(times_of(base, None), head_ms, n_vocab)
    if simple is not None:
        candidates.append((base, simple))
    grid = [recut(rows) for rows in sorted({aligned(step / 16) for step in range(1, 16)})]
    best = min(grid, key=lambda c: max(times_of(*c)))[1].rows / n_vocab
    grid += [recut(rows) for rows in sorted({aligned(best + step / 128) for step in range(-8, 9)}) if rows > 0]
    candidates += grid
    fastest = min(max(times_of(*c)) for c in candidates)
    if fastest >= whole / 1.01:
        return base, None
    split, chosen = min((c for c in candidates if max(times_of(*c)) <= fastest * 1.01),
                        key=lambda c: (c[1].rows, sum(t * t for t in times_of(*c))))
    return list(split), chosen
