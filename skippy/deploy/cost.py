"""What one token costs each part of a model (layers, input embedding, output head), from the
GGUF header, priced in decode batches of a given size, and the cut of the layers (and the head)
into stages that balances it.

Strategy
--------
* **Units**: multiply-adds (MACs) per token row, plus the bytes a batch reads.  A weight matrix
  costs one MAC per element; the input embedding copies one row (``n_embd``); the output head is
  a ``n_vocab x n_embd`` matrix (``output.weight``, or ``token_embd`` when tied: Gemma 3 270M's
  262,144-row head costs about as much as its 18 layers at one row).  MoE expert tensors (3-D, one
  slice per expert) count ``expert_used_count / expert_count`` of their elements: only the routed
  experts run.  An attention layer adds its scores and weighted sum over the context a row
  attends to (``n_head x (key_length + value_length) x min(sliding_window, ATTENDED_TOKENS)``); a
  recurrent layer (:mod:`skippy.runtime.layer_kinds`) adds a read and a write of its state instead
  (``2 x n_embd_r + n_embd_s``); every layer adds its small ops (norms, rope, activations and the
  threads' barriers): :data:`LAYER_FIXED_MACS` once a batch and :data:`LAYER_ROW_MACS` a row;
  the head adds :data:`HEAD_LOGIT_NS` for each logit a row writes.
* **Time of a row in a batch of n rows** (:meth:`PartCosts.time_ms`): the longer of computing it
  and reading the part's weights (once per batch: ``1 / n`` of them a row) at the assumed
  bandwidth, plus the small ops.  Matrices are priced by weight type and ``n``
  (:data:`ROW_NS_PER_MAC`, measured on the development host by ``bench/type_costs.py``): patch
  0018 makes F32 / F16 / Q8_0 products 1.5-2.4x cheaper a row in batches of 2..8 than alone, the
  K-quants gain little.  Attention is priced as an F16 product of the batch's rows, the rest at
  ``compute_gmacs``, which also scales the table.  ``--measure`` replaces the estimate by timings
  at the same batch sizes (:func:`skippy.deploy.plan.measure_times`).
* **Regimes** (:class:`Regime`): under the expected load of S sessions through P pipelined stages
  each stage runs batches of ``ceil(S / P)`` rows (:func:`load_rows`); a single stream runs
  batches of one row.  A cut is priced in both.
* **Split** (:func:`balanced_split`, per regime): the contiguous ranges, cut only where
  :func:`skippy.runtime.cuts.legal_cuts` allows, that minimise the slowest stage's time (the
  output head charged to the last stage, the embedding to the first), by a dynamic programme over
  (stage, end layer); among the splits as fast as that, the one with the least sum of squared stage
  times (stages closest to equal).  :func:`shares` gives each stage's expected share of a token's
  time, which ``skippy up`` and ``skippy plan`` print (under the load).
* **Choice across regimes** (:func:`choose_cut`): the load decides (it caps a served chain's
  throughput; a single stream runs the stages one after the other, so the cut changes its time
  little): among the candidates (each regime's balanced cut, and with a head split those below),
  the ones within :data:`LOAD_TOLERANCE` of the fastest under load; of those, the fastest at one
  row; then the fewest head rows moved and the most even under load.
* **Head split** (:func:`head_split`, :func:`choose_cut`; issue 31): the head's first vocabulary
  rows move to the least loaded other stage (or to stage 0 with the layers cut again around them)
  only where that makes the slowest stage under load more than :data:`HEAD_SPLIT_MIN_GAIN`
  faster than the best cut without one: the split adds a link, the moved rows' logits on it and a
  wait the model does not count.
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

__all__ = [
    "ATTENDED_TOKENS", "BATCH_ROWS", "HEAD_LOGIT_NS", "HEAD_ROW_ALIGN", "HEAD_SPLIT_MIN_GAIN", "LAYER_FIXED_MACS", "LAYER_ROW_MACS",
    "LOAD_TOLERANCE", "REFERENCE_GMACS", "ROW_NS_PER_MAC", "HeadSplit", "PartCosts", "Regime", "balanced_split",
    "balanced_split_head", "choose_cut", "head_split", "load_rows", "part_costs", "row_ns_per_mac", "shares",
    "split_head_times", "split_times",
]

#: Context a decode row is assumed to attend to (tokens) when estimating attention's cost.
ATTENDED_TOKENS: Final = 512
#: Cost of a layer's small ops and thread barriers, in MACs at ``compute_gmacs``: this much once
#: per decode batch and ``LAYER_ROW_MACS`` per row (fitted to ``bench/concurrency.py --row-costs 8``
#: on the development host: Gemma 3 270M's 0:17 and 17:18 and llama-16x1024's ranges at 1..8 rows
#: come out within about 15% of the measured batch times, the stages' shares within 2 points).
LAYER_FIXED_MACS: Final = 1_000_000
LAYER_ROW_MACS: Final = 500_000
#: CPU ns per logit of a row beside the head's matrix (writing the row's logits out, the ops on
#: them), at ``REFERENCE_GMACS``: Gemma 3 270M's head-only contexts on the development host take
#: 0.5-0.55 ms a row more than their Q8_0 product at 2, 4 and 8 rows (262,144 logits).
HEAD_LOGIT_NS: Final = 2.0
#: The compute rate (GMAC/s) ``ROW_NS_PER_MAC`` stands for: ``compute_gmacs`` above it scales
#: the table down (a faster host), below it up.
REFERENCE_GMACS: Final = 8.0
#: Rows in a batch that ``ROW_NS_PER_MAC`` gives a figure for (others: the nearest below; above
#: the last, the last).
BATCH_ROWS: Final = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
#: CPU ns per multiply-add of one token row, by weight type and rows in the batch (``BATCH_ROWS``),
#: measured on the development host (shared, 2 cores, AVX2 build with patch 0018; 1 thread, CPU
#: time, median of 7 interleaved rounds, 1024 x 4096 weights placed as llama.cpp's loader places
#: them: Q4_0 / Q4_K repacked) by ``PYTHONPATH=. python bench/type_costs.py --rounds 7 --m 4096``
#: on 2026-12-06.  F32, F16 and Q8_0 take patch 0018's kernel at 2..8 rows (2-4x cheaper a row
#: than one row alone); Q4_0 / Q4_K the repacked kernels (4 columns at a time); Q5_0 stock
#: tinyBLAS (odd counts in two passes); Q5_K / Q6_K ggml's vec_dot (no gain from a batch).
ROW_NS_PER_MAC: Final[Mapping[str, tuple[float, ...]]] = {
    "f32": (0.0677, 0.0506, 0.0374, 0.0391, 0.0340, 0.0311, 0.0321, 0.0289, 0.0319, 0.0297),
    "f16": (0.0428, 0.0274, 0.0231, 0.0267, 0.0239, 0.0230, 0.0237, 0.0226, 0.0205, 0.0233),
    "q8_0": (0.0401, 0.0257, 0.0259, 0.0250, 0.0253, 0.0244, 0.0251, 0.0242, 0.0251, 0.0255),
    "q4_0": (0.0300, 0.0300, 0.0298, 0.0260, 0.0265, 0.0269, 0.0272, 0.0255, 0.0257, 0.0222),
    "q5_0": (0.0592, 0.0403, 0.0457, 0.0391, 0.0415, 0.0381, 0.0426, 0.0409, 0.0403, 0.0398),
    "q4_K": (0.0274, 0.0269, 0.0268, 0.0236, 0.0245, 0.0246, 0.0250, 0.0236, 0.0236, 0.0186),
    "q5_K": (0.0475, 0.0456, 0.0481, 0.0454, 0.0467, 0.0488, 0.0480, 0.0424, 0.0286, 0.0255),
    "q6_K": (0.0362, 0.0374, 0.0378, 0.0371, 0.0368, 0.0359, 0.0356, 0.0572, 0.0424, 0.0353),
}
#: ggml type ids (ggml.h) priced as a measured type: the same kernel on x86 AVX2 (BF16 and any
#: type not named: ggml's vec_dot, as Q5_K).
_TYPE_CLASS: Final[Mapping[int, str]] = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q5_0", 6: "q5_0", 7: "q5_0", 8: "q8_0", 10: "q4_K", 11: "q5_K", 12: "q4_K",
    13: "q5_K", 14: "q6_K", 20: "q4_0", 39: "q4_0",
}
#: A head split must make the cut's slowest stage this much faster than the best cut without one:
#: it costs what the model does not count, the link and the moved rows' logits on it, a wait, and
#: the final stage's decode relay (a split-head final stage runs every row through the lane path:
#: about 0.7 ms more CPU a token, 7% of Gemma 3 270M's final stage at one row; docs/throughput.md).
HEAD_SPLIT_MIN_GAIN: Final = 0.10
#: Cuts whose slowest stage under load is within this of the fastest are equals there; among
#: them the one best at one row a batch is taken (see :func:`choose_cut`).
LOAD_TOLERANCE: Final = 0.02
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_HEAD = ("output.weight",)
_TIED_HEAD = "token_embd.weight"


def row_ns_per_mac(ggml_type: int, rows: int) -> float:
    """CPU ns per multiply-add of one row of a ``ggml_type`` weight in a batch of ``rows`` rows
    (:data:`ROW_NS_PER_MAC`, the development host at :data:`REFERENCE_GMACS`)."""
    table = ROW_NS_PER_MAC[_TYPE_CLASS.get(ggml_type, "q5_K")]
    if ggml_type == 30:  # BF16: no small-batch kernel, as F16 alone
        return ROW_NS_PER_MAC["f16"][0]
    index = max(i for i, n in enumerate(BATCH_ROWS) if n <= max(1, rows))
    return table[index]


def load_rows(sessions: int, n_stages: int) -> int:
    """Rows a stage's decode batch holds with ``sessions`` sessions decoding through ``n_stages``
    pipelined stages: each stage works on its own group of about ``sessions / n_stages``."""
    return max(1, -(-max(1, sessions) // max(1, n_stages)))


@dataclasses.dataclass(frozen=True, slots=True)
class PartCosts:
    """Per-token-row MACs and bytes read of each layer, the input embedding and the output head;
    the matrices by weight type, to price a row in a batch of any size (:meth:`layer_ms`)."""

    layer_macs: tuple[float, ...]
    layer_read_bytes: tuple[float, ...]
    embed_macs: float
    head_macs: float
    head_read_bytes: float
    #: each layer's matrices as (ggml type, MACs per row); empty: ``layer_macs`` at the reference rate
    layer_matrices: tuple[tuple[tuple[int, float], ...], ...] = ()
    #: the head's matrices as (ggml type, MACs per row)
    head_matrices: tuple[tuple[int, float], ...] = ()
    #: each layer's attention MACs per row (part of ``layer_macs``): F16 products over the KV cells
    layer_attention: tuple[float, ...] = ()
    #: logits a row of the head writes (its vocabulary rows): :data:`HEAD_LOGIT_NS` each
    head_logits: float = 0.0

    def time_ms(self, macs: float, read_bytes: float, *, gmacs: float, bandwidth_gbs: float,
                rows: int = 1, matrices: Sequence[tuple[int, float]] = (), attention: float = 0.0,
                fixed: bool = False) -> float:
        """The time of one row of a part in a batch of ``rows`` rows (ms): the longer of computing it
        and reading its weights (once per batch, so ``1 / rows`` of them a row); a layer
        (``fixed``) adds its small ops (:data:`LAYER_FIXED_MACS` once per batch,
        :data:`LAYER_ROW_MACS` a row).  ``matrices`` are priced by type and rows
        (:func:`row_ns_per_mac`), ``attention`` as F16 products of the batch's rows (the K and V
        cache are F16; llama.cpp multiplies every row of the batch by the cells in use at once),
        the rest of ``macs`` at ``gmacs``."""
        rows = max(1, rows)
        scale = REFERENCE_GMACS / gmacs / 1e6
        typed = sum(m for _, m in matrices)
        compute = (sum(m * row_ns_per_mac(t, rows) for t, m in matrices) * scale
                   + attention * row_ns_per_mac(1, rows) * scale
                   + max(0.0, macs - typed - attention) / (gmacs * 1e6))
        small = (LAYER_FIXED_MACS / rows + LAYER_ROW_MACS) / (gmacs * 1e6) if fixed else 0.0
        return max(compute, read_bytes / rows / (bandwidth_gbs * 1e6)) + small

    def layer_ms(self, *, gmacs: float, bandwidth_gbs: float, rows: int = 1) -> tuple[float, ...]:
        """Each layer's time per row in a batch of ``rows`` rows (see :meth:`time_ms`)."""
        count = len(self.layer_macs)
        matrices = self.layer_matrices or ((),) * count
        attention = self.layer_attention or (0.0,) * count
        return tuple(self.time_ms(m, b, gmacs=gmacs, bandwidth_gbs=bandwidth_gbs, rows=rows, matrices=typed,
                                  attention=a, fixed=True)
                     for m, b, typed, a in zip(self.layer_macs, self.layer_read_bytes, matrices, attention))

    def head_ms(self, *, gmacs: float, bandwidth_gbs: float, rows: int = 1) -> float:
        """The output head's time per row in a batch of ``rows`` rows (its logits included)."""
        return (self.time_ms(self.head_macs, self.head_read_bytes, gmacs=gmacs, bandwidth_gbs=bandwidth_gbs,
                             rows=rows, matrices=self.head_matrices)
                + self.head_logits * HEAD_LOGIT_NS * REFERENCE_GMACS / gmacs / 1e6)

    def embed_ms(self, *, gmacs: float, bandwidth_gbs: float) -> float:
        """The input embedding's time per row (one row copied, in any batch)."""
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
    typed: list[dict[int, float]] = [{} for _ in range(blocks)]
    head_typed: dict[int, float] = {}
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
            typed[index][tensor.ggml_type] = typed[index].get(tensor.ggml_type, 0.0) + elements * fraction
        elif tensor.name in _HEAD or (tensor.name == _TIED_HEAD and "output.weight" not in names):
            head_macs += elements
            head_read += size
            head_typed[tensor.ggml_type] = head_typed.get(tensor.ggml_type, 0.0) + elements
    macs = [macs[il % blocks] for il in range(n_layer)]
    read = [read[il % blocks] for il in range(n_layer)]
    matrices = tuple(tuple(sorted(typed[il % blocks].items())) for il in range(n_layer))
    recurrent = recurrent_layers(arch, n_layer, metadata) or frozenset()
    n_head = _int(metadata, f"{arch}.attention.head_count", 1)
    head_k = _int(metadata, f"{arch}.attention.key_length", n_embd // max(1, n_head))
    head_v = _int(metadata, f"{arch}.attention.value_length", n_embd // max(1, n_head))
    window = _int(metadata, f"{arch}.attention.sliding_window") or ATTENDED_TOKENS
    attention = n_head * (head_k + head_v) * min(window, ATTENDED_TOKENS)
    state = state_values_per_layer(arch, metadata) if recurrent else 0
    attends = []
    for il in range(n_layer):
        both = arch == "falcon-h1"  # every layer runs attention and an SSM
        attends.append(float(attention if il not in recurrent or both else 0))
        macs[il] += (2 * state if il in recurrent else 0) + attends[-1]
    logits = head_macs / n_embd if n_embd else 0.0  # the head is n_vocab x n_embd
    return PartCosts(tuple(macs), tuple(read), float(n_embd), head_macs, head_read, matrices,
                     tuple(sorted(head_typed.items())), tuple(attends), logits)


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
    stage equal go to that stage, where that makes the slowest stage more than
    :data:`HEAD_SPLIT_MIN_GAIN` faster (``rows``: that many, chosen by hand).  None: no split (one
    stage, a final stage at or under its share, a gain under that, or fewer rows than one block
    to move)."""
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
        if rows <= 0 or max(split_head_times(times, head_ms, n_vocab, HeadSplit(host, rows))) * (
                1 + HEAD_SPLIT_MIN_GAIN) > max(times):
            return None
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


@dataclasses.dataclass(frozen=True, slots=True)
class Regime:
    """Every part's time per token row (ms) when each stage's decode batch holds ``rows`` rows."""

    rows: int
    layer_ms: tuple[float, ...]
    head_ms: float
    embed_ms: float = 0.0

    def stage_times(self, split: Sequence[tuple[int, int]], head: HeadSplit | None, n_vocab: int) -> list[float]:
        """Each stage's time per row for the ranges ``split`` and the head split ``head``."""
        bounds = [start for start, _ in split] + [len(self.layer_ms)]
        times = split_times(self.layer_ms, self.head_ms, bounds, embed_ms=self.embed_ms)
        return split_head_times(times, self.head_ms, n_vocab, head)


Candidate = tuple[list[tuple[int, int]], HeadSplit | None]


def _head_candidates(regime: Regime, n_stages: int, n_vocab: int, groups: Sequence[KvGroup],
                     base: list[tuple[int, int]]) -> list[Candidate]:
    """Cuts with a head split for one regime: ``base`` with the rows :func:`head_split` moves
    (without its gain threshold), and the rows ``0:R`` on stage 0 with the layers cut again for
    each ``R`` tried (the head in 16ths, then 128ths around the best)."""
    layer_ms, head_ms, embed_ms = regime.layer_ms, regime.head_ms, regime.embed_ms

    def recut(rows: int) -> Candidate:
        moved = head_ms * rows / n_vocab
        split = balanced_split(layer_ms, head_ms - moved, n_stages, groups, embed_ms=embed_ms,
                               stage_extra_ms=[moved])
        return split, HeadSplit(0, rows)

    def aligned(fraction: float) -> int:
        return min(n_vocab - HEAD_ROW_ALIGN, int(round(fraction * n_vocab / HEAD_ROW_ALIGN)) * HEAD_ROW_ALIGN)

    candidates: list[Candidate] = []
    times = regime.stage_times(base, None, n_vocab)
    host = min(range(n_stages - 1), key=lambda s: times[s])
    rows = aligned(min(head_ms, max(0.0, times[-1] - times[host]) / 2) / head_ms)
    if rows > 0:
        candidates.append((base, HeadSplit(host, rows)))
    grid = [recut(rows) for rows in sorted({aligned(step / 16) for step in range(1, 16)}) if rows > 0]
    if grid:
        best = min(grid, key=lambda c: max(regime.stage_times(*c, n_vocab)))[1]
        assert best is not None
        fraction = best.rows / n_vocab
        grid += [recut(rows) for rows in sorted({aligned(fraction + step / 128) for step in range(-8, 9)})
                 if rows > 0]
    return candidates + grid


def _best_within(load: Regime, other: Regime, n_stages: int, groups: Sequence[KvGroup],
                 limit: float) -> list[tuple[int, int]] | None:
    """The ranges whose slowest stage in ``other`` is fastest among those whose every stage takes
    at most ``limit`` in ``load`` (the head whole on the last stage); None: none."""
    n_layer = len(load.layer_ms)
    cuts = [0, *legal_cuts(n_layer, groups), n_layer]

    def stage_time(regime: Regime, start: int, end: int) -> float:
        return (sum(regime.layer_ms[start:end]) + (regime.embed_ms if start == 0 else 0.0)
                + (regime.head_ms if end == n_layer else 0.0))

    best = [{end: math.inf for end in cuts} for _ in range(n_stages)]
    choice: list[dict[int, int]] = [{} for _ in range(n_stages)]
    for s in range(n_stages):
        for end in cuts[1:]:
            for start in [0] if s == 0 else cuts[1:]:
                if start >= end or (s > 0 and best[s - 1][start] == math.inf):
                    continue
                if stage_time(load, start, end) > limit:
                    continue
                value = max(0.0 if s == 0 else best[s - 1][start], stage_time(other, start, end))
                if value < best[s][end]:
                    best[s][end], choice[s][end] = value, start
    if best[n_stages - 1][n_layer] == math.inf:
        return None
    bounds, end = [n_layer], n_layer
    for s in range(n_stages - 1, -1, -1):
        end = choice[s][end]
        bounds.append(end)
    bounds.reverse()
    return list(zip(bounds, bounds[1:]))


def choose_cut(regimes: Sequence[Regime], n_stages: int, n_vocab: int, groups: Sequence[KvGroup] = (), *,
               head: bool = True) -> Candidate:
    """The layer ranges and head split for a chain priced in several regimes (see the module
    notes): ``regimes[0]`` (each stage's batch under the expected load) decides, the others
    (one row a batch) choose among the cuts within :data:`LOAD_TOLERANCE` of the fastest there.
    A head split (``head``) is a candidate only where one makes the slowest stage of
    ``regimes[0]`` more than :data:`HEAD_SPLIT_MIN_GAIN` faster than the best cut without one.

    Raises:
        ValueError: as :func:`balanced_split`.
    """
    if not regimes:
        raise ValueError("no regime to price the cut in")
    load = regimes[0]
    plain: list[Candidate] = []
    for regime in regimes:
        split = balanced_split(regime.layer_ms, regime.head_ms, n_stages, groups, embed_ms=regime.embed_ms)
        if (split, None) not in plain:
            plain.append((split, None))

    def slowest(regime: Regime, candidate: Candidate) -> float:
        return max(regime.stage_times(*candidate, n_vocab))

    fastest_plain = min(slowest(load, c) for c in plain)
    for regime in regimes[1:]:  # the cut best in this regime among those near the fastest under load
        within = _best_within(load, regime, n_stages, groups, fastest_plain * (1 + LOAD_TOLERANCE))
        if within is not None and (within, None) not in plain:
            plain.append((within, None))
    candidates = list(plain)
    if head and n_stages >= 2 and load.head_ms > 0 and n_vocab > 2 * HEAD_ROW_ALIGN:
        split_heads = [c for regime in regimes
                       for c in _head_candidates(regime, n_stages, n_vocab, groups, plain[0][0])]
        without = min(slowest(load, c) for c in plain)
        if split_heads and min(slowest(load, c) for c in split_heads) * (1 + HEAD_SPLIT_MIN_GAIN) < without:
            candidates = split_heads  # a split pays: the cuts without one are slower by more than the gain
    fastest = min(slowest(load, c) for c in candidates)
    near = [c for c in candidates if slowest(load, c) <= fastest * (1 + LOAD_TOLERANCE)]
    for regime in regimes[1:]:
        best = min(slowest(regime, c) for c in near)
        near = [c for c in near if slowest(regime, c) <= best * (1 + LOAD_TOLERANCE)]

    def evenness(candidate: Candidate) -> tuple[float, int, float]:
        rows = candidate[1].rows if candidate[1] is not None else 0
        return (rows, slowest(load, candidate), sum(t * t for t in load.stage_times(*candidate, n_vocab)))
    split, chosen = min(near, key=evenness)
    return list(split), chosen


def balanced_split_head(layer_ms: Sequence[float], head_ms: float, n_stages: int, n_vocab: int,
                        groups: Sequence[KvGroup] = (), *,
                        embed_ms: float = 0.0) -> tuple[list[tuple[int, int]], HeadSplit | None]:
    """The layers and the head's rows cut together in one regime (:func:`choose_cut`): among the
    cuts within :data:`LOAD_TOLERANCE` of the fastest, the one moving the fewest rows (each row's
    logits cross the network every token); no split when none beats the whole head on the last
    stage by more than :data:`HEAD_SPLIT_MIN_GAIN`.

    Raises:
        ValueError: as :func:`balanced_split`.
    """
    return choose_cut([Regime(1, tuple(layer_ms), head_ms, embed_ms)], n_stages, n_vocab, groups)
