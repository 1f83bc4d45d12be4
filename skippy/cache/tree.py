"""A radix tree over chained page hashes: the longest cached page-aligned prefix of a prompt.

Strategy
--------
One :class:`PrefixTree` per :class:`~skippy.cache.identity.CacheIdentity` (so tenants and stage
configurations never share a node). A node is one page of ``page_size`` tokens; its key in the
parent is the page's *chained* hash (:mod:`skippy.cache.radix`), and it also keeps the page's tokens,
which a lookup compares, so a 64-bit collision can never hand out another prompt's KV.

A cached prefix (:class:`CacheEntry`) of ``k`` pages hangs on the node at depth ``k``; at most one
entry per node. Its KV covers every shorter prefix too (KV of positions ``0..n`` does not depend
on what comes after), so **any** entry at or below a node can serve that node's prefix. The tree
keeps the invariant that every node has at least one entry in its subtree (empty branches are
pruned when an entry leaves), and each node counts the entries and the resident entries below it.
Hence:

* the longest cached prefix of a prompt is simply how deep the walk along its pages gets
  (``O(pages)`` dict probes and page compares; no probe grid as in the reference);
* the entry to serve it is found by descending through counted children, preferring a resident
  entry (a cell-sharing copy) over a spilled one (a state load), and the shortest spilled one.

Partial hits come for free: a shared system prompt followed by a new user turn walks the shared
pages and is served by whichever sibling entry still holds them. LRU order, pins and tiers are the
store's business (:mod:`skippy.cache.store`); the tree only reflects tier changes in its counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, final

from skippy.cache import radix
from skippy.cache._radix_py import HashArray, TokenArray

if TYPE_CHECKING:
    from skippy.cache.identity import CacheIdentity


class CacheEntry:
    """A cached prefix of whole pages held in one tier of the store.

    Attributes:
        tree: the tree the entry hangs in.
        node: its node (depth = pages).
        tokens: positions covered (``pages * page_size``).
        seq: cache sequence id while resident, else None.
        blob: saved sequence state while spilled, else None.
        digest: BLAKE2b of ``blob`` taken when it was spilled (corruption check).
        pins: holders that forbid eviction and demotion (a probe awaiting its restore).
        uses: times the entry served a restore.
    """

    __slots__ = ("tree", "node", "tokens", "seq", "blob", "digest", "pins", "uses")

    def __init__(self, tree: "PrefixTree", tokens: int, seq: int) -> None:
        self.tree = tree
        self.node: PageNode | None = None
        self.tokens = tokens
        self.seq: int | None = seq
        self.blob: bytes | None = None
        self.digest = b""
        self.pins = 0
        self.uses = 0

    @property
    def resident(self) -> bool:
        return self.seq is not None

    @property
    def attached(self) -> bool:
        return self.node is not None

    def __repr__(self) -> str:
        where = f"seq {self.seq}" if self.seq is not None else f"spilled {len(self.blob or b'')} B"
        return f"<CacheEntry {self.tokens} tokens, {where}, pins {self.pins}>"


@final
class PageNode:
    """One page of a cached prefix."""

    __slots__ = ("parent", "key", "page", "depth", "children", "entry", "entries_below", "resident_below")

    def __init__(self, parent: "PageNode | None", key: int, page: bytes, depth: int) -> None:
        self.parent = parent
        self.key = key
        self.page = page
        self.depth = depth
        self.children: dict[int, PageNode] = {}
        self.entry: CacheEntry | None = None
        self.entries_below = 0
        self.resident_below = 0

    def path(self) -> Iterator["PageNode"]:
        """This node and its ancestors up to (excluding) the root, deepest first."""
        node: PageNode | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent


@final
class PrefixTree:
    """Cached prefixes of one cache identity.

    Args:
        identity: what the KV depends on; gives the page size and the hash seed.
    """

    def __init__(self, identity: "CacheIdentity") -> None:
        self.identity = identity
        self.page_size = identity.page_size
        self.seed = identity.seed
        self.root = PageNode(None, 0, b"", 0)

    # -- hashing and walking -------------------------------------------------------------------
    def hashes(self, tokens: TokenArray) -> HashArray:
        """Chained page hashes of ``tokens`` under this tree's identity."""
        return radix.page_hashes(tokens, self.seed, self.page_size)

    def _page(self, tokens: TokenArray, index: int) -> bytes:
        size = self.page_size
        return tokens[index * size:(index + 1) * size].tobytes()

    def match(self, tokens: TokenArray, hashes: HashArray, max_pages: int | None = None) -> PageNode:
        """The deepest node on ``tokens``' path (the root when nothing is cached).

        Args:
            tokens: the prompt (int32).
            hashes: :meth:`hashes` of (a prefix of) ``tokens``.
            max_pages: walk at most this many pages.
        """
        node = self.root
        pages = len(hashes) if max_pages is None else min(len(hashes), max_pages)
        for index, key in enumerate(hashes[:pages].tolist()):
            child = node.children.get(key)
            if child is None or child.page != self._page(tokens, index):
                break
            node = child
        return node

    @staticmethod
    def best_entry(node: PageNode) -> CacheEntry | None:
        """The entry that serves ``node``'s prefix best: resident first, else the shortest spilled.

        Returns None only for an empty tree's root.
        """
        if node.resident_below:
            current = node
            while True:
                if current.entry is not None and current.entry.resident:
                    return current.entry
                current = next(c for c in current.children.values() if c.resident_below)
        if node.entries_below:
            current = node
            while current.entry is None:
                current = next(c for c in current.children.values() if c.entries_below)
            return current.entry
        return None

    # -- changes ---------------------------------------------------------------------------------
    def insert(self, tokens: TokenArray, hashes: HashArray, entry: CacheEntry) -> PageNode:
        """Hang ``entry`` on the node of its ``entry.tokens // page_size`` pages, creating the path.

        Raises:
            ValueError: the node already holds an entry, or the entry is not whole pages.
        """
        pages, rest = divmod(entry.tokens, self.page_size)
        if rest or pages == 0 or pages > len(hashes):
            raise ValueError(f"an entry covers whole pages: {entry.tokens} tokens, page {self.page_size}")
        node = self.root
        for index, key in enumerate(hashes[:pages].tolist()):
            page = self._page(tokens, index)
            child = node.children.get(key)
            if child is not None and child.page != page:
                # a 64-bit collision with a different page: the cache cannot hold both
                raise ValueError(f"page hash collision at page {index}")
            if child is None:
                child = PageNode(node, key, page, index + 1)
                node.children[key] = child
            node = child
        if node.entry is not None:
            raise ValueError(f"a {entry.tokens}-token prefix is already cached here")
        node.entry = entry
        entry.node = node
        self._count(node, 1, 1 if entry.resident else 0)
        return node

    def detach(self, entry: CacheEntry) -> None:
        """Take ``entry`` off the tree and prune the branches left without entries."""
        node = entry.node
        if node is None:
            return
        self._count(node, -1, -1 if entry.resident else 0)
        node.entry = None
        entry.node = None
        while node.parent is not None and node.entries_below == 0:
            del node.parent.children[node.key]
            node = node.parent

    def set_resident(self, entry: CacheEntry, resident: bool) -> None:
        """Reflect a tier change of an attached entry (call after changing ``entry.seq``)."""
        if entry.node is not None:
            self._count(entry.node, 0, 1 if resident else -1)

    def _count(self, node: PageNode, entries: int, resident: int) -> None:
        current: PageNode | None = node
        while current is not None:
            current.entries_below += entries
            current.resident_below += resident
            current = current.parent

    # -- inspection -------------------------------------------------------------------------------
    def entries(self) -> Iterator[CacheEntry]:
        """Every entry, depth first."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                yield node.entry
            stack.extend(node.children.values())

    def node_count(self) -> int:
        """Nodes in the tree, root excluded."""
        count = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    @property
    def empty(self) -> bool:
        return self.root.entries_below == 0


def as_tokens(tokens: object) -> TokenArray:
    """int32 tokens from any accepted input (see :func:`skippy.cache.radix.as_tokens`)."""
    array: TokenArray = radix.as_tokens(tokens)  # type: ignore[arg-type]
    return array


__all__ = ["CacheEntry", "PageNode", "PrefixTree", "as_tokens"]
