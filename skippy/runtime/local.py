"""Stages of one model called back to back in one process: the split without the network.

Strategy: one ``Model`` + ``StageContext`` per layer range; a batch runs through every stage in
order, the first taking tokens and each next one the float32 activations of the previous; KV
operations are mirrored on every stage.  This is the reference shape of a chain (what the TCP
stages do, minus transport) and serves the ``generate`` command, tests and benchmarks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from skippy.runtime import LayerRange, Model, Sampler, SamplingParams, StageContext, read_gguf_info
from skippy.runtime.cuts import KvGroup, cut_refusal, snap_cuts
from skippy.runtime.offload import OffloadSettings, devices

Split = Sequence[tuple[int, int]]


def parse_split(text: str) -> list[tuple[int, int]]:
    """``"0:2,2:4"`` -> ``[(0, 2), (2, 4)]``; the ranges must be contiguous from 0."""
    ranges = [LayerRange.parse(part.strip()) for part in text.split(",") if part.strip()]
    if not ranges:
        raise ValueError(f"no layer ranges in {text!r}")
    if ranges[0].start != 0:
        raise ValueError(f"the first range must start at layer 0 (got {ranges[0]})")
    for before, after in zip(ranges, ranges[1:]):
        if after.start != before.end:
            raise ValueError(f"ranges {before} and {after} are not contiguous")
    return [(r.start, r.end) for r in ranges]


def even_split(n_layer: int, n_stages: int, groups: Sequence[KvGroup] = ()) -> list[tuple[int, int]]:
    """Split ``n_layer`` layers into ``n_stages`` contiguous ranges of nearly equal size; with
    KV-sharing ``groups`` (``GGUFInfo.kv_groups``) each cut moves to the nearest legal one."""
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_stages} stages")
    bounds = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    if groups:
        bounds = [0, *snap_cuts(n_layer, groups, bounds[1:-1]), n_layer]
    return list(zip(bounds, bounds[1:]))


def check_split(split: Split, n_layer: int, groups: Sequence[KvGroup]) -> None:
    """Raise ValueError when a cut of ``split`` separates layers that share KV (naming the
    nearest legal cuts)."""
    for _, cut in split[:-1]:
        refusal = cut_refusal(n_layer, groups, cut)
        if refusal is not None:
            raise ValueError(refusal)


@dataclass
class StageTimes:
    """Seconds spent in each stage's decode calls."""

    compute: list[float] = field(default_factory=list)


class LocalChain:
    """Stages ``split`` of the model at ``path``, in this process."""

    def __init__(self, path: str | Path, split: Split, *, n_ctx: int = 1024, max_sessions: int = 4,
                 n_batch: int = 64, threads: int | None = None, offload: OffloadSettings | None = None) -> None:
        self.models: list[Model] = []
        self.contexts: list[StageContext] = []
        try:
            for start, end in split:
                resolved = None
                if offload is not None:
                    resolved = offload.resolve(devices(), start, end, read_gguf_info(path).n_layer)
                model = Model(path, LayerRange(start, end), offload=resolved)
                self.models.append(model)
                self.contexts.append(StageContext(model, n_ctx=n_ctx, max_sessions=max_sessions,
                                                  n_batch=n_batch, threads=threads, offload=resolved))
        except BaseException:
            self.close()
            raise
        self.times = StageTimes([0.0] * len(self.contexts))
        self.n_batch = n_batch
        self.prefill_seconds = 0.0

    @property
    def last(self) -> StageContext:
        return self.contexts[-1]

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool] | None = None) -> None:
        """Run one batch through every stage; logits are then on :attr:`last`."""
        hidden = None
        for index, context in enumerate(self.contexts):
            started = time.perf_counter()
            flags = outputs if context.model.is_last else None
            if index == 0:
                context.decode(tokens=tokens, positions=positions, seq_ids=seq_ids, outputs=flags)
            else:
                context.decode(activations=hidden, positions=positions, seq_ids=seq_ids, outputs=flags,
                               tokens=tokens if context.model.reads_tokens else None)
            if not context.model.is_last:
                hidden = context.activations()
            self.times.compute[index] += time.perf_counter() - started

    def logits(self) -> list[np.ndarray]:
        """Copies of the logits of the last decode's output rows."""
        return [self.last.logits(int(row)).copy() for row in self.last.output_rows]

    def prefill(self, tokens: Sequence[int], seq: int = 0, start: int = 0) -> None:
        """Prefill in chunks of the batch size (the same partition on every stage)."""
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset: offset + self.n_batch]
            positions = range(start + offset, start + offset + len(chunk))
            self.decode(chunk, list(positions), [seq] * len(chunk))

    def generate(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams, *,
                 seq: int = 0, stop_at_eog: bool = True) -> list[int]:
        """Prefill ``prompt`` then sample up to ``max_tokens`` tokens."""
        out: list[int] = []
        with Sampler(params, self.models[-1].n_vocab) as sampler:
            started = time.perf_counter()
            self.prefill(prompt, seq)
            self.prefill_seconds = time.perf_counter() - started
            position = len(prompt)
            for _ in range(max_tokens):
                row = int(self.last.output_rows[-1])
                token = int(self.last.sample([sampler], [row])[0])
                out.append(token)
                if stop_at_eog and self.models[-1].is_end_of_generation(token):
                    break
                self.decode([token], [position], [seq])
                position += 1
        return out

    def each(self, method: str, *args: object) -> list[object]:
        """Mirror one KV operation on every stage."""
        return [getattr(context, method)(*args) for context in self.contexts]

    def close(self) -> None:
        for context in self.contexts:
            context.close()
        for model in self.models:
            model.close()

    def __enter__(self) -> "LocalChain":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
