"""Test doubles and drivers for the prefix cache: a fake KV backend and a cached in-process chain."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from chain_helpers import InProcessChain
from skippy.cache import CacheBudget, CacheIdentity, StageCache, context_sessions
from skippy.runtime import StateMismatch

_MAGIC = b"FAKEKV01"


def content_of(tokens: Sequence[int]) -> list[int]:
    """What the fake backend stores at each position: a digest of the prefix up to it."""
    out = []
    digest = hashlib.blake2b(digest_size=8)
    for token in tokens:
        digest.update(struct.pack("<i", int(token)))
        out.append(int.from_bytes(digest.copy().digest(), "little"))
    return out


class FakeKv:
    """A unified KV cell pool with llama.cpp's sequence semantics (copy shares cells)."""

    kv_bytes_per_cell = 100

    def __init__(self, max_seqs: int = 16) -> None:
        self.max_seqs = max_seqs
        self.seqs: dict[int, list[int]] = {}        # seq -> cell id per position
        self.cells: dict[int, int] = {}             # cell id -> content
        self._tokens: dict[int, list[int]] = {}    # seq -> tokens its positions hold
        self._next_cell = 0
        self.calls: list[str] = []

    def _new_cell(self, content: int) -> int:
        self._next_cell += 1
        self.cells[self._next_cell] = content
        return self._next_cell

    def _check(self, seq: int) -> None:
        assert 0 <= seq < self.max_seqs, f"seq {seq} out of range"

    def prefill(self, seq: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to a session (each cell's content depends on the whole prefix)."""
        self._check(seq)
        cells = self.seqs.setdefault(seq, [])
        full = self._tokens.get(seq, []) + [int(t) for t in tokens]
        self._tokens[seq] = full
        for value in content_of(full)[len(cells):]:
            cells.append(self._new_cell(value))

    def content(self, seq: int) -> list[int]:
        return [self.cells[c] for c in self.seqs.get(seq, [])]

    # -- the KvBackend protocol ------------------------------------------------------------------
    def copy(self, source: int, destination: int, start: int = -1, end: int = -1) -> None:
        self._check(source)
        self._check(destination)
        self.calls.append("copy")
        cells = self.seqs.get(source, [])
        start = 0 if start < 0 else start
        end = len(cells) if end < 0 else min(end, len(cells))
        target = self.seqs.setdefault(destination, [])
        assert len(target) == start, "fake copy only appends to a sequence"
        target.extend(cells[start:end])
        self._tokens[destination] = self._tokens.get(source, [])[:end]
        self._collect()

    def remove(self, seq: int, start: int = -1, end: int = -1) -> bool:
        self._check(seq)
        cells = self.seqs.get(seq, [])
        start = 0 if start < 0 else start
        assert end < 0 or end >= len(cells), "fake remove only cuts tails"
        del cells[start:]
        self._tokens[seq] = self._tokens.get(seq, [])[:start]
        self._collect()
        return True

    def length(self, seq: int) -> int:
        return len(self.seqs.get(seq, []))

    def save_state(self, seq: int) -> bytes:
        self.calls.append("save")
        values = self.content(seq)
        tokens = self._tokens.get(seq, [])
        return _MAGIC + struct.pack("<I", len(values)) + struct.pack(f"<{len(values)}Q", *values) + struct.pack(
            f"<{len(tokens)}i", *tokens)

    def load_state(self, seq: int, blob: bytes) -> int:
        self.calls.append("load")
        if blob[:8] != _MAGIC or len(blob) < 12:
            raise StateMismatch("not a fake state")
        (count,) = struct.unpack_from("<I", blob, 8)
        if len(blob) != 12 + 12 * count:
            raise StateMismatch("fake state has the wrong size")
        values = struct.unpack_from(f"<{count}Q", blob, 12)
        tokens = list(struct.unpack_from(f"<{count}i", blob, 12 + 8 * count))
        self.remove(seq)
        self.seqs[seq] = [self._new_cell(v) for v in values]
        self._tokens[seq] = tokens
        return count

    # -- figures ---------------------------------------------------------------------------------
    def _collect(self) -> None:
        live = {c for cells in self.seqs.values() for c in cells}
        for cell in [c for c in self.cells if c not in live]:
            del self.cells[cell]

    def kv_cells_used(self) -> int:
        return len(self.cells)


def prefill_logits(chain: InProcessChain, tokens: Sequence[int], seq: int, start: int = 0) -> list[np.ndarray]:
    """Decode ``tokens`` at ``start..`` in batch-size chunks, every row an output."""
    out: list[np.ndarray] = []
    step = chain.n_batch
    for offset in range(0, len(tokens), step):
        chunk = list(tokens[offset:offset + step])
        positions = list(range(start + offset, start + offset + len(chunk)))
        out += chain.decode(chunk, positions, [seq] * len(chunk), [True] * len(chunk))
    return out


class CachedChain:
    """An in-process split with one StageCache per stage, driven like the phase-2 chain protocol.

    Probe every stage (holding the hit), restore the chain-wide minimum everywhere (all or
    nothing), prefill the suffix, record, close the session.
    """

    def __init__(self, path: Path, split: Sequence[tuple[int, int]], *, sessions: int = 2, cache_slots: int = 3,
                 page_size: int = 16, budget: CacheBudget | None = None, n_ctx: int = 512, n_batch: int = 16) -> None:
        self.chain = InProcessChain(path, split, n_ctx=n_ctx, n_batch=n_batch,
                                    max_sessions=context_sessions(sessions, cache_slots))
        self.caches = [
            StageCache.for_context(context, sessions=sessions, page_size=page_size, budget=budget,
                                   wire_dtype=None if index == 0 else "f32")
            for index, context in enumerate(self.chain.contexts)
        ]
        self.sessions = sessions

    def serve(self, prompt: Sequence[int], seq: int = 0, namespace: str | None = None) -> tuple[int, list[np.ndarray]]:
        """Returns (restored tokens, logits of the computed suffix rows)."""
        limit = len(prompt) - 1
        lengths = [cache.lookup(prompt, namespace=namespace, limit=limit, hold=seq) for cache in self.caches]
        restored = min(lengths)
        if restored:
            got = [cache.restore(seq, prompt, restored, namespace=namespace) for cache in self.caches]
            if min(got) != restored:  # some stage missed: restore nothing anywhere
                for context in self.chain.contexts:
                    context.remove(seq)
                restored = 0
        else:
            for cache in self.caches:
                cache.release(seq)
        logits = prefill_logits(self.chain, prompt[restored:], seq, restored)
        for cache in self.caches:
            cache.record(seq, prompt, namespace=namespace)
        for context in self.chain.contexts:
            context.remove(seq)
        return restored, logits

    def fresh(self, prompt: Sequence[int], seq: int = 1) -> list[np.ndarray]:
        """Logits of a plain prefill, in a scratch session, removed afterwards."""
        logits = prefill_logits(self.chain, prompt, seq)
        for context in self.chain.contexts:
            context.remove(seq)
        return logits

    def close(self) -> None:
        for cache in self.caches:
            cache.close()
        self.chain.close()

    def __enter__(self) -> "CachedChain":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def identity(namespace: str | None = None, page_size: int = 4) -> CacheIdentity:
    return CacheIdentity(model_identity="fake-model", layer_start=0, layer_end=2, n_ctx=256,
                         page_size=page_size, namespace=namespace)
