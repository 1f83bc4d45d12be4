"""Test helpers over :class:`skippy.runtime.local.LocalChain`: collect the logits of greedy runs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from skippy.runtime import LayerRange, Model, StageContext
from skippy.runtime.local import LocalChain, Split, StageTimes


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


class ChainModels:
    """Stage ranges of model files loaded once (for a module-scoped fixture) and chains of fresh
    contexts over them: a load is most of a tiny chain's cost, and the weights are read-only.

    ``chain(path, splits)`` is an :class:`InProcessChain` whose ``close`` (and ``with`` exit)
    closes its contexts only; :meth:`close` frees the models."""

    def __init__(self) -> None:
        self._models: dict[tuple[Path, int, int], Model] = {}

    def model(self, path: Path, start: int, end: int) -> Model:
        key = (Path(path), start, end)
        if key not in self._models:
            self._models[key] = Model(path, LayerRange(start, end))
        return self._models[key]

    def chain(self, path: Path, splits: Split, *, n_ctx: int = 512, max_sessions: int = 4, n_batch: int = 64,
              threads: int = 1, **settings: object) -> InProcessChain:
        """A chain of fresh contexts (``settings``: further StageContext arguments) on the shared models."""
        return _SharedModelChain([self.model(path, start, end) for start, end in splits], n_ctx=n_ctx,
                                 max_sessions=max_sessions, n_batch=n_batch, threads=threads, **settings)

    def close(self) -> None:
        for model in self._models.values():
            model.close()
        self._models.clear()


class _SharedModelChain(InProcessChain):
    """An InProcessChain over given models (LocalChain's loading skipped): closing it closes its
    contexts and leaves the models loaded."""

    def __init__(self, models: list[Model], *, n_ctx: int, max_sessions: int, n_batch: int, threads: int,
                 **settings: object) -> None:
        self.models = models
        self.contexts = []
        try:
            for model in models:
                self.contexts.append(StageContext(model, n_ctx=n_ctx, max_sessions=max_sessions, n_batch=n_batch,
                                                  threads=threads, **settings))  # type: ignore[arg-type]
        except BaseException:
            self.close()
            raise
        self.times = StageTimes([0.0] * len(self.contexts))
        self.n_batch = n_batch
        self.prefill_seconds = 0.0

    def close(self) -> None:
        for context in self.contexts:
            context.close()


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
