"""Two tiers of cached prefix KV over a stage's KV backend, with budgets that bind.

Strategy
--------
*Resident* entries are cache sequence ids in the stage's own KV cell pool: recording copies the
session's positions ``[0, n)`` into a free cache id (``copy`` shares cells, so nothing is
computed or duplicated while the session still holds them), and a hit copies them back into the
new session's id. *Spilled* entries are ``save_state`` blobs in host memory: when the resident
tier is full its least recently used entry is saved, its cells are released, and a later hit
loads the blob into the session (``load_state``) and trims it to the requested length. A spilled
blob carries a BLAKE2b-128 digest taken when it was saved; a blob that fails it, or that the
backend refuses (``StateMismatch``), is dropped and the restore is a miss, never a wrong answer.

Budgets (:class:`CacheBudget`) bind on record and on demotion:

* resident: entries (and the cache ids the stage reserved), tokens (cells), bytes (tokens x the
  backend's ``kv_bytes_per_cell``; cells shared by two entries are counted twice, so the real
  use is at most what is accounted);
* spill: entries and bytes, bytes being the exact length of the saved states.

Eviction is LRU within a tier (one ``OrderedDict`` per tier, touched on every hit or re-record);
a resident victim is demoted to the spill tier when it fits there, else dropped; a spill victim
is dropped. Pinned entries (a probe holding its hit for the coming restore) are never evicted,
demoted or dropped. The store never touches a session's sequence except the one a restore writes.
It is not thread-safe: its owner (the stage's compute task) calls it between decodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from typing import Iterable, Protocol, final

from skippy.cache._radix_py import HashArray, TokenArray
from skippy.cache.tree import CacheEntry, PrefixTree
from skippy.runtime.errors import SessionError, StateMismatch


class KvBackend(Protocol):
    """The KV operations the cache needs; :class:`skippy.runtime.StageContext` provides them."""

    def copy(self, source: int, destination: int, start: int = -1, end: int = -1) -> None: ...

    def remove(self, seq: int, start: int = -1, end: int = -1) -> bool: ...

    def length(self, seq: int) -> int: ...

    def save_state(self, seq: int) -> bytes: ...

    def load_state(self, seq: int, blob: bytes) -> int: ...

    @property
    def kv_bytes_per_cell(self) -> int: ...


@final
@dataclasses.dataclass(frozen=True, slots=True)
class CacheBudget:
    """Limits of the two tiers. ``None`` means unlimited (other limits still bind).

    Attributes:
        resident_entries: resident prefixes (also capped by the cache ids the stage reserved).
        resident_tokens: KV cells the resident prefixes may hold.
        resident_bytes: KV bytes the resident prefixes may hold.
        spill_entries: spilled prefixes; 0 disables the spill tier.
        spill_bytes: bytes of saved states kept in host memory; 0 disables the spill tier.
        min_tokens: shortest prefix worth recording (rounded up to whole pages).
    """

    resident_entries: int | None = 16
    resident_tokens: int | None = None
    resident_bytes: int | None = None
    spill_entries: int | None = 64
    spill_bytes: int | None = 256 << 20
    min_tokens: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value < 0:
                raise ValueError(f"budget {field.name} must be >= 0, got {value}")

    @property
    def spill_enabled(self) -> bool:
        return self.spill_entries != 0 and self.spill_bytes != 0


@dataclasses.dataclass(slots=True)
class CacheStats:
    """Counters of one stage's prefix cache (monotonic except the ``*_entries/tokens/bytes`` gauges).

    Attributes:
        probes / probe_hits: lookups, and those that found at least one page.
        hits / misses / errors: restores that restored the requested length / found nothing or
            less / found a corrupt or refused spilled state (also counted as misses).
        restored_tokens: positions restored into sessions.
        resident_restores / spill_restores: hits served by a copy / by a state load.
        records / recorded_tokens: new entries and their positions.
        touched: records that found the prefix already resident (LRU refresh only).
        superseded: shorter entries dropped because a longer one on their path was recorded.
        uncacheable: records refused (over a budget alone, no unpinned victim, short session).
        evictions: entries dropped for room (resident without a spill slot, or spilled).
        spills: resident entries demoted to host memory.
        spilled_bytes: bytes of states ever spilled.
        resident_entries, resident_tokens, resident_bytes, spill_entries, spill_bytes: gauges.
    """

    probes: int = 0
    probe_hits: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    restored_tokens: int = 0
    resident_restores: int = 0
    spill_restores: int = 0
    records: int = 0
    recorded_tokens: int = 0
    touched: int = 0
    superseded: int = 0
    uncacheable: int = 0
    evictions: int = 0
    spills: int = 0
    spilled_bytes: int = 0
    resident_entries: int = 0
    resident_tokens: int = 0
    resident_bytes: int = 0
    spill_entries: int = 0
    spill_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _digest(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=16).digest()


@final
class PrefixStore:
    """Entries of every tree of one stage, in two budgeted LRU tiers.

    Args:
        backend: the stage's KV operations.
        cache_seqs: sequence ids reserved for resident entries (never a session's).
        budget: tier limits.
    """

    def __init__(self, backend: KvBackend, cache_seqs: Iterable[int], budget: CacheBudget) -> None:
        self.backend = backend
        self.cache_seqs: tuple[int, ...] = tuple(cache_seqs)
        if len(set(self.cache_seqs)) != len(self.cache_seqs) or any(s < 0 for s in self.cache_seqs):
            raise ValueError(f"cache sequence ids must be distinct and >= 0: {self.cache_seqs}")
        self.budget = budget
        self.bytes_per_cell = int(backend.kv_bytes_per_cell)
        self._free = sorted(self.cache_seqs, reverse=True)
        self._resident: OrderedDict[int, CacheEntry] = OrderedDict()  # id(entry) -> entry, LRU first
        self._spilled: OrderedDict[int, CacheEntry] = OrderedDict()
        self.stats = CacheStats()
        self._resident_tokens = 0
        self._spill_bytes = 0

    # -- figures ---------------------------------------------------------------------------------
    @property
    def resident_limit(self) -> int:
        """Most resident entries: the budget, capped by the reserved ids."""
        limit = len(self.cache_seqs)
        if self.budget.resident_entries is not None:
            limit = min(limit, self.budget.resident_entries)
        return limit

    def resident_entries(self) -> list[CacheEntry]:
        """Resident entries, least recently used first."""
        return list(self._resident.values())

    def spilled_entries(self) -> list[CacheEntry]:
        """Spilled entries, least recently used first."""
        return list(self._spilled.values())

    def snapshot(self) -> CacheStats:
        """A copy of the counters with the gauges filled in."""
        stats = dataclasses.replace(self.stats)
        stats.resident_entries = len(self._resident)
        stats.resident_tokens = self._resident_tokens
        stats.resident_bytes = self._resident_tokens * self.bytes_per_cell
        stats.spill_entries = len(self._spilled)
        stats.spill_bytes = self._spill_bytes
        return stats

    def _fits_resident(self, extra_entries: int, extra_tokens: int) -> bool:
        budget = self.budget
        if len(self._resident) + extra_entries > self.resident_limit:
            return False
        tokens = self._resident_tokens + extra_tokens
        if budget.resident_tokens is not None and tokens > budget.resident_tokens:
            return False
        return budget.resident_bytes is None or tokens * self.bytes_per_cell <= budget.resident_bytes

    def _fits_spill(self, extra_entries: int, extra_bytes: int) -> bool:
        budget = self.budget
        if budget.spill_entries is not None and len(self._spilled) + extra_entries > budget.spill_entries:
            return False
        return budget.spill_bytes is None or self._spill_bytes + extra_bytes <= budget.spill_bytes

    # -- LRU ------------------------------------------------------------------------------------
    def touch(self, entry: CacheEntry) -> None:
        """Mark ``entry`` most recently used."""
        tier = self._resident if entry.resident else self._spilled
        if id(entry) in tier:
            tier.move_to_end(id(entry))

    @staticmethod
    def _lru_unpinned(tier: "OrderedDict[int, CacheEntry]", exclude: CacheEntry | None = None) -> CacheEntry | None:
        for entry in tier.values():
            if entry.pins == 0 and entry is not exclude:
                return entry
        return None

    # -- record ----------------------------------------------------------------------------------
    def add_resident(self, tree: PrefixTree, tokens: TokenArray, hashes: HashArray, pages: int,
                     session_seq: int) -> CacheEntry | None:
        """Copy the session's first ``pages`` pages into a new resident entry.

        Makes room first (demoting or evicting unpinned LRU entries). Returns None, counted as
        uncacheable, when the entry alone exceeds a resident budget or every candidate victim is
        pinned.
        """
        count = pages * tree.page_size
        if not self._fits_alone(count) or not self._make_resident_room(count):
            self.stats.uncacheable += 1
            return None
        seq = self._free.pop()
        backend = self.backend
        backend.remove(seq)
        try:
            backend.copy(session_seq, seq, 0, count)
        except Exception:  # e.g. a recurrent session that cannot go back to the page boundary
            backend.remove(seq)
            self._free.append(seq)
            self._free.sort(reverse=True)
            raise
        entry = CacheEntry(tree, count, seq)
        self._resident[id(entry)] = entry
        self._resident_tokens += count
        node = tree.match(tokens, hashes, pages)
        if node.depth == pages and node.entry is not None:
            # the same prefix is cached already (spilled, or resident and pinned): keep the fresh
            # resident copy when the old one can go, else give up the new one
            if node.entry.pins:
                self._drop(entry, counted=False)
                self.stats.uncacheable += 1
                return None
            self._drop(node.entry, counted=False)
            self.stats.superseded += 1
        try:
            tree.insert(tokens, hashes, entry)
        except ValueError:  # 64-bit page hash collision with a different page: do not cache
            self._drop(entry, counted=False)
            self.stats.uncacheable += 1
            return None
        self.stats.records += 1
        self.stats.recorded_tokens += count
        return entry

    def _fits_alone(self, count: int) -> bool:
        budget = self.budget
        if self.resident_limit == 0:
            return False
        if budget.resident_tokens is not None and count > budget.resident_tokens:
            return False
        return budget.resident_bytes is None or count * self.bytes_per_cell <= budget.resident_bytes

    def _make_resident_room(self, count: int) -> bool:
        while not self._free or not self._fits_resident(1, count):
            victim = self._lru_unpinned(self._resident)
            if victim is None:
                return False
            self._demote(victim)
        return True

    def _demote(self, entry: CacheEntry) -> None:
        """Move a resident entry to the spill tier when it fits there, else drop it."""
        assert entry.seq is not None
        if self.budget.spill_enabled:
            blob = self.backend.save_state(entry.seq)
            size = len(blob)
            if self._fits_spill_alone(size) and self._make_spill_room(size):
                self._release_seq(entry)
                entry.blob = blob
                entry.digest = _digest(blob)
                self._spilled[id(entry)] = entry
                self._spill_bytes += size
                entry.tree.set_resident(entry, False)
                self.stats.spills += 1
                self.stats.spilled_bytes += size
                return
        self._drop(entry)

    def _fits_spill_alone(self, size: int) -> bool:
        budget = self.budget
        return budget.spill_entries != 0 and (budget.spill_bytes is None or size <= budget.spill_bytes)

    def _make_spill_room(self, size: int) -> bool:
        while not self._fits_spill(1, size):
            victim = self._lru_unpinned(self._spilled)
            if victim is None:
                return False
            self._drop(victim)
        return True

    # -- removal ---------------------------------------------------------------------------------
    def _release_seq(self, entry: CacheEntry) -> None:
        seq = entry.seq
        if seq is None:
            return
        self.backend.remove(seq)
        del self._resident[id(entry)]
        self._resident_tokens -= entry.tokens
        entry.seq = None
        self._free.append(seq)
        self._free.sort(reverse=True)

    def _drop(self, entry: CacheEntry, *, counted: bool = True) -> None:
        """Forget an entry: free its cells or its blob and take it off its tree."""
        entry.tree.detach(entry)
        if entry.seq is not None:
            self._release_seq(entry)
        if id(entry) in self._spilled:
            del self._spilled[id(entry)]
            self._spill_bytes -= len(entry.blob or b"")
            entry.blob = None
        if counted:
            self.stats.evictions += 1

    def drop(self, entry: CacheEntry, *, counted: bool = True) -> bool:
        """Drop an unpinned entry (False if pinned)."""
        if entry.pins:
            return False
        self._drop(entry, counted=counted)
        return True

    def reclaim(self, cells: int) -> int:
        """Demote unpinned LRU resident entries until ``cells`` of their tokens are released.

        For a stage that ran out of KV cells. Shared cells are only freed when no other sequence
        holds them, so the cells actually freed may be fewer. Returns the tokens released.
        """
        released = 0
        while released < cells:
            victim = self._lru_unpinned(self._resident)
            if victim is None:
                break
            released += victim.tokens
            self._demote(victim)
        return released

    def clear(self) -> None:
        """Drop every entry, pinned or not (shutdown); pins are forgotten."""
        for entry in list(self._resident.values()) + list(self._spilled.values()):
            entry.pins = 0
            self._drop(entry, counted=False)

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, entry: CacheEntry, session_seq: int, count: int) -> bool:
        """Make the session hold exactly the entry's first ``count`` positions.

        Returns False (the session is left empty) when a spilled state is corrupt or refused, or
        holds fewer positions; such an entry is dropped and counted as an error.
        """
        backend = self.backend
        if count > entry.tokens:
            raise ValueError(f"cannot restore {count} tokens from a {entry.tokens}-token entry")
        backend.remove(session_seq)
        if entry.seq is not None:
            try:
                backend.copy(entry.seq, session_seq, 0, count)
            except SessionError:  # a recurrent entry serves its own length only: a miss
                backend.remove(session_seq)
                return False
            self.stats.resident_restores += 1
        else:
            blob = entry.blob
            if blob is None or _digest(blob) != entry.digest:
                return self._bad_spill(entry, session_seq)
            try:
                positions = backend.load_state(session_seq, blob)
            except StateMismatch:  # the backend refused the state: treat as corrupt
                return self._bad_spill(entry, session_seq)
            if positions < count:
                return self._bad_spill(entry, session_seq)
            if positions > count and not backend.remove(session_seq, count, -1):
                backend.remove(session_seq)  # a recurrent state cannot be cut: a miss
                return False
            self.stats.spill_restores += 1
        if backend.length(session_seq) != count:
            backend.remove(session_seq)
            self.stats.errors += 1
            return False
        entry.uses += 1
        self.touch(entry)
        return True

    def _bad_spill(self, entry: CacheEntry, session_seq: int) -> bool:
        self.backend.remove(session_seq)
        entry.pins = 0
        self._drop(entry, counted=False)
        self.stats.errors += 1
        return False

