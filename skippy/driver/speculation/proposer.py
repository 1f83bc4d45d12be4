# Draft proposer from the request's own context: prompt lookup by suffix n-gram matching.
#
# Strategy: the committed history (prompt + accepted tokens) is indexed incrementally.  For every
# n in [n_min, n_max] a dict maps an n-gram to the position right after its latest occurrence (the
# "continuation start").  Indexing lags one token behind the history, so the current suffix is
# never found as its own match: when token t is appended, the n-grams that END at t-1 are
# indexed, pointing at t.  Appending a token costs (n_max - n_min + 1) dict writes of short tuples,
# independent of the history length.
#
# A proposal looks the suffix of (history + optimistic tail) up from the longest n down to the
# shortest; the first hit wins (longest match, most recent occurrence).  The continuation is copied
# LZ77-style, so a copy may run into the suffix itself: a period-p loop yields a draft of any
# length.  The optimistic tail (drafts still in flight) is searched with but never indexed: drafts
# are not history until the target accepts them.
#
# Memory is bounded: when the history exceeds twice `max_history` the oldest half is dropped and
# the index is rebuilt from what remains (amortised O(n_max) per token).  The confidence hint is the
# real length of the match (extended backwards past n, up to `MATCH_LENGTH_CAP`), which the
# controller buckets to learn per-bucket acceptance.
from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Iterable, Sequence, final

__all__ = ["MATCH_LENGTH_CAP", "Draft", "NgramProposer", "NO_DRAFT"]

#: How far back a match is extended to measure the confidence hint.
MATCH_LENGTH_CAP: Final = 64


@dataclass(frozen=True, slots=True)
class Draft:
    """A proposed continuation.

    Attributes:
        tokens: the drafted tokens, in order (empty when nothing matched).
        match_length: how many tokens before the continuation source equal the current suffix
            (at least the matched n, capped at ``MATCH_LENGTH_CAP``); 0 when nothing matched.
        source: absolute history position the continuation was copied from (-1 when none).
    """

    tokens: tuple[int, ...]
    match_length: int
    source: int = -1

    @property
    def confidence(self) -> float:
        """A hint in [0, 1): longer matches are likelier to continue (1 - 1/(1 + length/4))."""
        return 1.0 - 1.0 / (1.0 + self.match_length / 4.0)

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT: Final = Draft((), 0)


@final
class NgramProposer:
    """Incremental suffix n-gram index over one request's committed tokens."""

    def __init__(self, tokens: Iterable[int] = (), *, n_min: int = 2, n_max: int = 12,
                 max_history: int = 16384) -> None:
        """Args:
            tokens: initial history (usually the prompt).
            n_min: shortest suffix that may match (>= 1).
            n_max: longest suffix looked up (>= n_min).
            max_history: tokens kept searchable; memory is O(max_history * (n_max - n_min + 1)).

        Raises:
            ValueError: inconsistent bounds.
        """
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max (got {n_min}, {n_max})")
        if max_history < n_max + 1:
            raise ValueError(f"max_history must exceed n_max (got {max_history})")
        self.n_min = n_min
        self.n_max = n_max
        self.max_history = max_history
        self._history: list[int] = []
        self._offset = 0  # absolute position of _history[0]
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        """Absolute length of the history (dropped tokens included)."""
        return self._offset + len(self._history)

    def append(self, token: int) -> None:
        """Add one committed token and index the n-grams ending just before it."""
        history = self._history
        history.append(int(token))
        end = len(history) - 1  # n-grams ending at end-1 continue at `end`
        if end >= self.n_min:
            absolute = self._offset + end
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._index[n][tuple(history[end - n:end])] = absolute
        if len(history) > 2 * self.max_history:
            self._compact()

    def extend(self, tokens: Iterable[int]) -> None:
        """Add committed tokens in order."""
        for token in tokens:
            self.append(token)

    def _compact(self) -> None:
        drop = len(self._history) - self.max_history
        kept = self._history[drop:]
        self._offset += drop
        self._history = []
        for table in self._index.values():
            table.clear()
        offset = self._offset
        for token in kept:
            self._history.append(token)
            end = len(self._history) - 1
            if end >= self.n_min:
                for n in range(self.n_min, min(self.n_max, end) + 1):
                    self._index[n][tuple(self._history[end - n:end])] = offset + end

    def propose(self, max_tokens: int, *, tail: Sequence[int] = ()) -> Draft:
        """Draft up to ``max_tokens`` tokens continuing history + ``tail``.

        Args:
            max_tokens: most tokens to return (0 returns ``NO_DRAFT``).
            tail: optimistic tokens after the history (drafts in flight); searched, not indexed.

        Returns:
            The continuation of the longest, most recent suffix match, or ``NO_DRAFT``.
        """
        if max_tokens <= 0:
            return NO_DRAFT
        history = self._history
        tail = list(tail)
        sequence_length = len(history) + len(tail)
        suffix_source = history[-self.n_max:] + tail if len(tail) < self.n_max else tail
        suffix = suffix_source[-self.n_max:]
        for n in range(min(self.n_max, len(suffix)), self.n_min - 1, -1):
            start = self._index[n].get(tuple(suffix[-n:]))
            if start is None:
                continue
            relative = start - self._offset
            if relative < n:  # stale entry from before a compaction (rebuilt tables make this rare)
                continue
            tokens = self._copy(relative, max_tokens, tail, sequence_length)
            length = self._match_length(relative, n, tail)
            return Draft(tuple(tokens), length, start)
        return NO_DRAFT

    def _at(self, index: int, tail: list[int]) -> int:
        history = self._history
        return history[index] if index < len(history) else tail[index - len(history)]

    def _copy(self, relative: int, count: int, tail: list[int], sequence_length: int) -> list[int]:
        out: list[int] = []
        index = relative
        while len(out) < count:
            out.append(self._at(index, tail) if index < sequence_length else out[index - sequence_length])
            index += 1
        return out

    def _match_length(self, relative: int, n: int, tail: list[int]) -> int:
        """How many tokens before ``relative`` equal the suffix (>= n, capped)."""
        length = n
        sequence_length = len(self._history) + len(tail)
        while length < MATCH_LENGTH_CAP:
            source = relative - length - 1
            target = sequence_length - length - 1
            if source < 0 or self._at(source, tail) != self._at(target, tail):
                break
            length += 1
        return length
