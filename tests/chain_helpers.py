"""Test helpers over :class:`skippy.runtime.local.LocalChain`: collect the logits of greedy runs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from skippy.runtime.local import LocalChain, Split


class InProcessChain(LocalChain):
    """A LocalChain with test-sized defaults whose ``decode`` returns the output rows' logits.

    One compute thread by default: ggml's worker threads spin-wait for each other, and on a busy
    2-core host a 2-thread run of a tiny model costs many times the CPU of a 1-thread one."""

    def __init__(self, path: Path, splits: Split, *, n_ctx: int = 512, max_sessions: int = 4,
                 n_batch: int = 64, threads: int = 1) -> None:
        super().__init__(path, splits, n_ctx=n_ctx, max_sessions=max_sessions, n_batch=n_batch, threads=threads)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],  # type: ignore[override]
               outputs: Sequence[bool] | None = None) -> list[np.ndarray]:
        super().decode(tokens, positions, seq_ids, outputs)
        return self.logits()


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
