"""The per-stage prefix cache policy a stage server calls: lookup, restore, record.

Strategy
--------
One :class:`StageCache` per stage process wraps a :class:`~skippy.cache.store.PrefixStore` (two
budgeted tiers over the stage's KV) and one :class:`~skippy.cache.tree.PrefixTree` per cache
identity (the stage's identity with each request's namespace). All lengths are in tokens; cached
lengths are whole pages.

Calls, in the order a stage sees them (see ``docs/prefix-cache.md`` for the chain protocol):

1. ``lookup(tokens, hold=session)`` (ProbePrefill): the longest cached prefix, read-only except
   that ``hold`` pins the serving entry until the session's restore or :meth:`release`, so a
   chain-wide probe followed by a restore of the chain-wide minimum cannot lose its entry to an
   eviction in between.
2. ``restore(session, tokens, length)`` (RestorePrefill / TryRestorePrefill): all or nothing; the
   session ends up holding exactly ``length`` positions, or none (a miss). Never more than what is
   cached: a request beyond the cached prefix is a miss, and so is a corrupt spilled state.
3. ``record(session, tokens)`` after a completed prefill: caches the page-aligned prefix of the
   session's prompt as a resident entry (unless it is already resident), dropping the shorter
   entries on its path that it supersedes.
4. :meth:`release` when a session ends; :meth:`release_all` on reset; :meth:`close` at shutdown.

Sequence ids: sessions use ``0 .. sessions-1`` and the cache the ids above, so the stage must
create its :class:`~skippy.runtime.StageContext` with ``max_sessions = sessions + cache_slots``
(at most 256 in all; :func:`context_sessions`). Because ``StageContext.open_session`` hands out
any free id, :meth:`StageCache.for_context` *claims* the cache ids through it, so a session can
never be given one; ``sessions_in_use`` therefore counts them while the cache is open.

A stage with no cache (or a v11 peer) answers every probe and restore as a miss, which the chain
protocol treats as "restore nothing anywhere". This object is not thread-safe; the stage's compute
task owns it, as it owns the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Iterable, final

from skippy.cache.identity import CacheIdentity
from skippy.cache.store import CacheBudget, CacheStats, KvBackend, PrefixStore
from skippy.cache.tree import CacheEntry, PrefixTree, as_tokens

if TYPE_CHECKING:
    from skippy.runtime import StageContext

#: StageContext's limit on sequence ids (sessions plus cache slots).
MAX_SEQUENCE_IDS: Final = 256
#: Empty namespace trees are pruned once there are more trees than this.
_TREE_PRUNE_THRESHOLD: Final = 64


#: Why a model's prefix cache is off: a hit would not give the uncached run's tokens.  The
#: lightning indexer (deepseek32's, shared by GLM-5, dots3note, HY V4 and DeepSeek V4) sums ReLU
#: scores, so keys often tie at 0, and llama.cpp's top-k (an unstable partial sort over the KV
#: cells) keeps tied keys by where their cells lie; a restored prefix keeps the cached entry's
#: cells, an uncached run gets fresh ones, and the two select other positions (one stage too:
#: tests/test_prefix_cache_exact.py).
_SPARSE_SELECTION: Final = ("its lightning indexer's top-k keeps keys tied at score 0 by their KV cell "
                            "order, which differs between a restored prefix and an uncached run")
PREFIX_CACHE_REFUSALS: Final = {
    "deepseek32": _SPARSE_SELECTION, "glm-dsa": _SPARSE_SELECTION, "dots3note": _SPARSE_SELECTION,
    "hy_v4": _SPARSE_SELECTION, "qwen4exp": _SPARSE_SELECTION,
    "deepseek4": _SPARSE_SELECTION + "; and a session copied (seq_cp) then rolled back to a checkpoint "
                 "with no rows to decode again does not yet match a fresh run (one loaded from a saved state does)",
}


def prefix_cache_refusal(architecture: str) -> str | None:
    """Why a stage of ``architecture`` runs without its prefix cache (None: it may have one)."""
    reason = PREFIX_CACHE_REFUSALS.get(architecture)
    return None if reason is None else f"{architecture}: {reason}, so a hit could give other tokens"


def context_sessions(sessions: int, cache_slots: int) -> int:
    """``max_sessions`` to give a StageContext that serves ``sessions`` and caches ``cache_slots``.

    Raises:
        ValueError: the total exceeds StageContext's 256 sequence ids, or a count is negative.
    """
    if sessions < 1 or cache_slots < 0:
        raise ValueError(f"need >= 1 session and >= 0 cache slots (got {sessions}, {cache_slots})")
    total = sessions + cache_slots
    if total > MAX_SEQUENCE_IDS:
        raise ValueError(f"{sessions} sessions + {cache_slots} cache slots exceed {MAX_SEQUENCE_IDS} sequence ids")
    return total


def claim_cache_ids(context: "StageContext", sessions: int) -> range:
    """Reserve ids ``sessions .. max_sessions-1`` of a context for the cache.

    Opens every free session id and closes again those below ``sessions``; call it before any
    session is opened.

    Raises:
        ValueError: some id is already taken, or no id is left for the cache.
    """
    ids = range(sessions, context.max_sessions)
    if not ids:
        raise ValueError(f"context has {context.max_sessions} ids: none left for a cache above {sessions} sessions")
    if context.sessions_in_use:
        raise ValueError("claim cache ids before opening sessions")
    opened = [context.open_session() for _ in range(context.max_sessions)]
    for seq in opened:
        if seq < sessions:
            context.close_session(seq)
    return ids


@final
class StageCache:
    """Prefix KV cache of one stage.

    Args:
        backend: the stage's KV operations (a StageContext).
        identity: the stage's cache identity (its ``namespace`` is the default namespace).
        cache_seqs: sequence ids reserved for resident entries.
        budget: tier limits.
    """

    def __init__(self, backend: KvBackend, identity: CacheIdentity, cache_seqs: Iterable[int],
                 budget: CacheBudget | None = None) -> None:
        self.identity = identity
        self.page_size = identity.page_size
        self.budget = budget or CacheBudget()
        self.store = PrefixStore(backend, cache_seqs, self.budget)
        self._cache_seq_set = frozenset(self.store.cache_seqs)
        self._trees: dict[CacheIdentity, PrefixTree] = {}
        self._holds: dict[int, CacheEntry] = {}
        self._claimed: tuple[int, ...] = ()
        self._context: StageContext | None = None

    @classmethod
    def for_context(cls, context: "StageContext", *, sessions: int, wire_dtype: str | None = None,
                    page_size: int = 64, budget: CacheBudget | None = None, claim: bool = True) -> "StageCache":
        """A cache over a context created with ``max_sessions = context_sessions(sessions, slots)``.

        Args:
            context: the stage's context.
            sessions: ids ``0 .. sessions-1`` stay for sessions; the rest are the cache's.
            wire_dtype: the stage's input dtype (see :class:`CacheIdentity`).
            page_size: tokens per page.
            budget: tier limits.
            claim: reserve the cache ids in the context (:func:`claim_cache_ids`).
        """
        identity = CacheIdentity.for_context(context, wire_dtype=wire_dtype, page_size=page_size)
        ids = claim_cache_ids(context, sessions) if claim else range(sessions, context.max_sessions)
        cache = cls(context, identity, ids, budget)
        if claim:
            cache._claimed = tuple(ids)
            cache._context = context
        return cache

    # -- helpers ---------------------------------------------------------------------------------
    def tree(self, namespace: str | None = None, *, create: bool = False) -> PrefixTree | None:
        """The tree of a namespace (None: the stage's default namespace)."""
        identity = self.identity if namespace is None else self.identity.with_namespace(namespace)
        tree = self._trees.get(identity)
        if tree is None and create:
            if len(self._trees) >= _TREE_PRUNE_THRESHOLD:
                self._prune_trees()
            tree = self._trees[identity] = PrefixTree(identity)
        return tree

    def _prune_trees(self) -> None:
        for identity, tree in list(self._trees.items()):
            if tree.empty:
                del self._trees[identity]

    def _check_session(self, session_seq: int) -> None:
        if session_seq in self._cache_seq_set or session_seq < 0:
            raise ValueError(f"sequence id {session_seq} is not a session id (cache ids: {self.store.cache_seqs})")

    def _serving_entry(self, tokens: object, namespace: str | None,
                       limit: int | None) -> tuple[int, CacheEntry | None]:
        tree = self.tree(namespace)
        if tree is None:
            return 0, None
        array = as_tokens(tokens)
        if limit is not None:
            array = array[:max(0, limit)]
        hashes = tree.hashes(array)
        node = tree.match(array, hashes)
        if node.depth == 0:
            return 0, None
        if getattr(self.store.backend, "recurrent", False):
            # a recurrent state exists at its entry's own length only (it cannot be cut at an
            # earlier page): the deepest entry on the path serves, exactly its length
            for at in node.path():
                if at.entry is not None:
                    return at.depth * self.page_size, at.entry
            return 0, None
        return node.depth * self.page_size, tree.best_entry(node)

    # -- the stage's calls -----------------------------------------------------------------------
    def lookup(self, tokens: object, *, namespace: str | None = None, limit: int | None = None,
               hold: int | None = None) -> int:
        """Longest cached page-aligned prefix of ``tokens``, in tokens (0: miss).

        Args:
            tokens: the prompt (int32 array, buffer or ints). Pass it without its last token, or
                set ``limit = len(prompt) - 1``, so at least one token is left to compute logits.
            namespace: tenant key.
            limit: consider only the first ``limit`` tokens.
            hold: a session id: pin the serving entry until that session's :meth:`restore` or
                :meth:`release` (replaces the session's previous hold).

        Raises:
            ValueError: bad tokens, or ``hold`` is a cache id.
        """
        if hold is not None:
            self._check_session(hold)
            self.release(hold)
        length, entry = self._serving_entry(tokens, namespace, limit)
        stats = self.store.stats
        stats.probes += 1
        if entry is None:
            return 0
        stats.probe_hits += 1
        if hold is not None:
            entry.pins += 1
            self._holds[hold] = entry
        return length

    def restore(self, session_seq: int, tokens: object, length: int, *, namespace: str | None = None) -> int:
        """Make the session hold the KV of ``tokens[:length]``: all of it, or nothing.

        Any previous content of the session is removed. Releases the session's hold.

        Returns:
            ``length`` on a hit; 0 on a miss (nothing or less cached, a corrupt or refused spilled
            state), the session then being empty.

        Raises:
            ValueError: ``length`` is negative or longer than ``tokens``; the id is a cache id.
        """
        self._check_session(session_seq)
        array = as_tokens(tokens)
        if not 0 <= length <= array.shape[0]:
            raise ValueError(f"cannot restore {length} tokens of a {array.shape[0]}-token prompt")
        stats = self.store.stats
        try:
            if length == 0:
                return 0
            pages = -(-length // self.page_size)
            cached, entry = self._serving_entry(array[:pages * self.page_size], namespace, None)
            if entry is None or cached < length:
                self.store.backend.remove(session_seq)
                stats.misses += 1
                return 0
            if not self.store.restore(entry, session_seq, length):
                stats.misses += 1
                return 0
            stats.hits += 1
            stats.restored_tokens += length
            return length
        finally:
            self.release(session_seq)

    def record(self, session_seq: int, tokens: object, *, namespace: str | None = None) -> int:
        """Cache the page-aligned prefix of a session's completed prefill.

        Args:
            session_seq: the session; its positions ``0 .. len(tokens)-1`` hold ``tokens``' KV.
            tokens: the tokens the session's KV was computed from (the prompt).
            namespace: tenant key.

        Returns:
            Tokens newly cached (0 when already resident, too short, or refused by the budget).
        """
        self._check_session(session_seq)
        array = as_tokens(tokens)
        pages = array.shape[0] // self.page_size
        count = pages * self.page_size
        minimum = -(-self.budget.min_tokens // self.page_size) * self.page_size
        if pages == 0 or count < minimum:
            return 0
        store = self.store
        if store.backend.length(session_seq) < count:
            store.stats.uncacheable += 1
            return 0
        tree = self.tree(namespace, create=True)
        assert tree is not None
        array = array[:count]
        hashes = tree.hashes(array)
        node = tree.match(array, hashes)
        if node.depth == pages and node.resident_below:
            covering = tree.best_entry(node)
            assert covering is not None
            store.touch(covering)
            store.stats.touched += 1
            return 0
        entry = store.add_resident(tree, array, hashes, pages, session_seq)
        if entry is None or entry.node is None:
            return 0
        for ancestor in list(entry.node.path())[1:]:
            if ancestor.entry is not None and store.drop(ancestor.entry, counted=False):
                store.stats.superseded += 1
        return count

    def release(self, session_seq: int) -> None:
        """Drop the session's hold, if any (call when a session ends)."""
        entry = self._holds.pop(session_seq, None)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def reclaim(self, cells: int) -> int:
        """Demote LRU resident prefixes to free about ``cells`` KV cells (the stage ran short)."""
        return self.store.reclaim(cells)

    def release_all(self) -> None:
        """Drop every cached prefix and hold; the cache ids stay reserved."""
        self._holds.clear()
        self.store.clear()
        self._trees.clear()

    def close(self) -> None:
        """:meth:`release_all` and give claimed ids back to the context; idempotent."""
        self.release_all()
        context, self._context = self._context, None
        if context is not None:
            for seq in self._claimed:
                context.close_session(seq)
        self._claimed = ()

    # -- figures ---------------------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """Counters and gauges (a snapshot)."""
        return self.store.snapshot()

    @property
    def cache_seqs(self) -> tuple[int, ...]:
        return self.store.cache_seqs

    @property
    def holds(self) -> int:
        return len(self._holds)

    def entries(self) -> list[CacheEntry]:
        """Every entry of every namespace."""
        return [entry for tree in self._trees.values() for entry in tree.entries()]

    def __enter__(self) -> "StageCache":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
