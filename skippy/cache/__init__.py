"""Prefix KV cache of a stage: identity, radix tree over chained page hashes, two budgeted tiers.

``StageCache`` is what a stage server calls (lookup / restore / record); ``CacheIdentity`` names
what the KV depends on; ``CacheBudget`` sets the tiers' limits. See ``docs/prefix-cache.md``.
"""

from skippy.cache.identity import TOKENS_INPUT, CacheIdentity
from skippy.cache.stage_cache import (
    MAX_SEQUENCE_IDS, StageCache, claim_cache_ids, context_sessions, prefix_cache_refusal,
)
from skippy.cache.store import CacheBudget, CacheStats, KvBackend, PrefixStore
from skippy.cache.tree import CacheEntry, PageNode, PrefixTree

__all__ = [
    "CacheBudget", "CacheEntry", "CacheIdentity", "CacheStats", "KvBackend", "MAX_SEQUENCE_IDS",
    "PageNode", "PrefixStore", "PrefixTree", "StageCache", "TOKENS_INPUT", "claim_cache_ids",
    "context_sessions", "prefix_cache_refusal",
]
