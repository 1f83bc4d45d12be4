"""Run a prompt through a chain of in-process stages (or the whole model) and collect logits.

Used by the exactness tests and benchmarks: every stage gets the same rows, positions and
micro-batch partition, activations are handed on as float32, and the final stage's logits for
every flagged row are copied out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from skippy.runtime import LayerRange, Model, StageContext

Split = Sequence[tuple[int, int]]


class InProcessChain:
    """Stages ``splits`` of one model, called back to back."""

    def __init__(self, path: Path, splits: Split, *, n_ctx: int = 512, max_sessions: int = 4,
                 n_batch: int = 64, threads: int = 2) -> None:
        self.models = [Model(path, LayerRange(a, b)) for a, b in splits]
        self.contexts = [
            StageContext(m, n_ctx=n_ctx, max_sessions=max_sessions, n_batch=n_batch, threads=threads)
            for m in self.models
        ]

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool] | None = None) -> list[np.ndarray]:
        """Run one batch through every stage; returns copies of the logits of the output rows."""
        hidden = None
        for index, context in enumerate(self.contexts):
            flags = outputs if context.model.is_last else None
            if index == 0:
                context.decode(tokens=tokens, positions=positions, seq_ids=seq_ids, outputs=flags)
            else:
                context.decode(activations=hidden, positions=positions, seq_ids=seq_ids, outputs=flags)
            if not context.model.is_last:
                hidden = context.activations().copy()
        last = self.contexts[-1]
        return [last.logits(int(row)).copy() for row in last.output_rows]

    def each(self, method: str, *args: object) -> list[object]:
        """Mirror one KV operation on every stage."""
        return [getattr(context, method)(*args) for context in self.contexts]

    def close(self) -> None:
        for context in self.contexts:
            context.close()
        for model in self.models:
            model.close()

    def __enter__(self) -> "InProcessChain":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def greedy_run(chain: InProcessChain, prompt: Sequence[int], steps: int, seq: int = 0,
               start: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """Prefill ``prompt`` (all rows output) then ``steps`` greedy single-token decodes."""
    positions = list(range(start, start + len(prompt)))
    logits = chain.decode(prompt, positions, [seq] * len(prompt), [True] * len(prompt))
    tokens: list[int] = []
    position = start + len(prompt)
    for _ in range(steps):
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
        logits += chain.decode([token], [position], [seq])
        position += 1
    return logits, tokens
