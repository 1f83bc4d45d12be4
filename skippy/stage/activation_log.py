"""What a stage keeps so an in-flight request survives a lost stage (docs/protocol.md §14).

Strategy: two stage-wide tables, used only on the runtime's thread (the executor's), so no lock.

* :class:`ActivationLog`: per session, the activation rows this stage handed downstream, as the
  frames it computed them in (``(start, count, rows)``, contiguous from the session's first
  logged position).  When a stage behind this one is replaced, a replay of the session's
  positions (``REPLAY_FLAG`` prefill frames, sent by the driver with the frames' original
  partition) is answered from the log instead of the runtime: this stage's KV is kept, nothing is
  computed, and the replacement receives bit-identical inputs in the same micro-batches.  Memory
  is bounded by ``budget_bytes``; past it the least recently written sessions are evicted whole
  (their replay falls back to recomputing on this stage, logged).  The decode relay's steps reach
  it too (the loop keeps each computed row; :class:`~skippy.stage.decode_relay.RelayRun` records
  them after every run).  A gap (frames this log did not see) or a frame overwriting logged
  positions cuts the log back.
* :class:`ParkedSessions`: a session whose lane closed because the chain lost a stage is not
  released but parked for ``hold_s`` seconds under its wire session id; a resume (a
  ConfigureGeneration carrying :data:`~skippy.codec.protocol_ext.RESUME_METADATA_KEY`) on a new
  lane adopts it, anything else (or the deadline) releases it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from typing import Final

import numpy as np
import numpy.typing as npt

from skippy.codec.protocol_ext import RESUME_METADATA_KEY

log = logging.getLogger("skippy.stage")

__all__ = ["ActivationLog", "LogStats", "holds_for_resume", "ParkedSessions", "ResumeRequest", "resume_request"]

#: Default log budget (bytes) and how long a parked session waits for its resume (seconds).
DEFAULT_LOG_BYTES: Final = 64 << 20
DEFAULT_HOLD_S: Final = 30.0
#: Largest number of committed tokens a resume may carry (the sampler's history).
MAX_RESUME_TOKENS: Final = 1 << 20

FloatArray = npt.NDArray[np.float32]


@dataclasses.dataclass(slots=True)
class LogStats:
    """Counters of the log and of resumes on this stage (the stats file's ``resume`` section)."""

    log_bytes: int = 0
    log_sessions: int = 0
    log_budget_bytes: int = 0
    evicted_sessions: int = 0
    #: Replay frames answered from the log (positions), and those recomputed (log missing).
    replayed_tokens: int = 0
    replay_recomputed_tokens: int = 0
    #: Sessions parked on a lost lane, adopted by a resume, released at their deadline.
    parked: int = 0
    adopted: int = 0
    park_expired: int = 0
    sampler_restores: int = 0
    #: Positions this stage ran through its runtime (replayed ones are not counted).
    computed_positions: int = 0


@dataclasses.dataclass(slots=True)
class _Entry:
    start: int
    count: int
    rows: FloatArray


class ActivationLog:
    """Per-session log of the activation frames a stage sent downstream (see the module header)."""

    def __init__(self, budget_bytes: int = DEFAULT_LOG_BYTES, stats: LogStats | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the activation log budget must be >= 0 bytes (got {budget_bytes})")
        self.budget_bytes = budget_bytes
        self.stats = stats or LogStats()
        self.stats.log_budget_bytes = budget_bytes
        #: Session key -> its frames, least recently written first.
        self._sessions: collections.OrderedDict[int, list[_Entry]] = collections.OrderedDict()
        #: Sessions evicted since their first frame: a replay for them is a logged fallback.
        self._evicted: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def record(self, key: int, start: int, count: int, rows: FloatArray) -> None:
        """Log ``rows`` (``count`` positions from ``start``) as handed downstream for ``key``."""
        if not self.enabled or count <= 0:
            return
        entries = self._sessions.get(key)
        if entries is None:
            if key in self._evicted:
                return  # a session evicted stays evicted: its log has a hole
            entries = self._sessions[key] = []
        else:
            self._sessions.move_to_end(key)
        end = entries[-1].start + entries[-1].count if entries else start
        if start < end:
            self.trim(key, start)
            entries = self._sessions.setdefault(key, [])
        elif start > end:  # a gap: frames this log did not see (the decode relay carried them)
            self.drop(key)
            entries = self._sessions[key] = []
        # the executor's arrays are its own copies, never written again: kept as they are, but a
        # row of a larger batch array is copied (a view would keep the whole batch alive)
        kept = rows if rows.dtype == np.float32 else rows.astype(np.float32)
        base = kept.base
        if base is not None and getattr(base, "nbytes", 0) > kept.nbytes:
            kept = kept.copy()
        entries.append(_Entry(start, count, kept))
        self.stats.log_bytes += kept.nbytes
        self.stats.log_sessions = len(self._sessions)
        self._evict()

    def _evict(self) -> None:
        while self.stats.log_bytes > self.budget_bytes and self._sessions:
            key, entries = self._sessions.popitem(last=False)
            self.stats.log_bytes -= sum(e.rows.nbytes for e in entries)
            self._evicted.add(key)
            self.stats.evicted_sessions += 1
            log.info("activation log: session %d evicted (%d positions; budget %d bytes): its resume would "
                     "recompute on this stage", key & 0xFFFFFFFF, sum(e.count for e in entries), self.budget_bytes)
        self.stats.log_sessions = len(self._sessions)

    def rows(self, key: int, start: int, count: int) -> FloatArray | None:
        """The logged rows of positions ``[start, start + count)`` (None: not all logged)."""
        entries = self._sessions.get(key)
        if not entries or count <= 0:
            return None
        pieces: list[FloatArray] = []
        position, end = start, start + count
        for entry in entries:
            entry_end = entry.start + entry.count
            if entry_end <= position or entry.start >= end:
                continue
            if entry.start > position:
                return None
            per = entry.rows.shape[0] // entry.count
            lo, hi = position - entry.start, min(end, entry_end) - entry.start
            pieces.append(entry.rows[lo * per:hi * per])
            position = entry.start + hi
            if position >= end:
                break
        if position < end:
            return None
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def length(self, key: int) -> int:
        """The end of the logged positions of ``key`` (0: nothing logged)."""
        entries = self._sessions.get(key)
        return entries[-1].start + entries[-1].count if entries else 0

    def trim(self, key: int, length: int) -> None:
        """Forget the logged positions at and past ``length`` (the session's KV was trimmed)."""
        entries = self._sessions.get(key)
        if not entries:
            return
        kept: list[_Entry] = []
        for entry in entries:
            if entry.start + entry.count <= length:
                kept.append(entry)
                continue
            self.stats.log_bytes -= entry.rows.nbytes
            if entry.start < length:
                count = length - entry.start
                per = entry.rows.shape[0] // entry.count
                rows = entry.rows[:count * per].copy()
                kept.append(_Entry(entry.start, count, rows))
                self.stats.log_bytes += rows.nbytes
        self._sessions[key] = kept

    def drop(self, key: int) -> None:
        """Forget ``key`` (released)."""
        entries = self._sessions.pop(key, None)
        self._evicted.discard(key)
        if entries:
            self.stats.log_bytes -= sum(e.rows.nbytes for e in entries)
        self.stats.log_sessions = len(self._sessions)

    def evicted(self, key: int) -> bool:
        return key in self._evicted

    def rekey(self, old: int, new: int) -> None:
        """Session ``old`` goes on as ``new`` (adopted by a resume on another lane)."""
        entries = self._sessions.pop(old, None)
        if entries is not None:
            self._sessions[new] = entries
        if old in self._evicted:
            self._evicted.discard(old)
            self._evicted.add(new)


class ParkedSessions:
    """Sessions kept after their lane was lost, by wire session id (see the module header)."""

    def __init__(self, hold_s: float = DEFAULT_HOLD_S, stats: LogStats | None = None) -> None:
        self.hold_s = hold_s
        self.stats = stats or LogStats()
        self._parked: dict[int, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, session_id: int, key: int) -> None:
        self._parked[session_id] = (key, time.monotonic() + self.hold_s)
        self.stats.parked += 1

    def take(self, session_id: int) -> int | None:
        """The key of parked ``session_id`` (it is no longer parked), or None."""
        entry = self._parked.pop(session_id, None)
        return None if entry is None else entry[0]

    def expired(self, now: float | None = None) -> list[int]:
        """Take the keys whose deadline passed."""
        moment = time.monotonic() if now is None else now
        gone = [sid for sid, (_, deadline) in self._parked.items() if deadline <= moment]
        keys = [self._parked.pop(sid)[0] for sid in gone]
        self.stats.park_expired += len(keys)
        return keys

    def all(self) -> list[int]:
        keys = [key for key, _ in self._parked.values()]
        self._parked.clear()
        return keys


@dataclasses.dataclass(frozen=True, slots=True)
class ResumeRequest:
    """docs/protocol.md §14: a ConfigureGeneration that resumes a session after a lost stage.

    ``length``: the positions the session's KV keeps (the rest is trimmed); ``tokens``: the tokens
    the final stage sampled so far, in order (its sampler accepts them again and its seeded draw
    advances once per token).
    """

    length: int
    tokens: tuple[int, ...]

    def section(self) -> dict[str, object]:
        return {"length": self.length, "tokens": list(self.tokens)}


def holds_for_resume(metadata: str | None) -> bool:
    """Whether ConfigureGeneration's metadata asks this stage to park the session on a lost stage
    (``{"skippy.resume": {...}}``: any resume section, the first configure's ``{"hold": true}`` too)."""
    if not metadata or RESUME_METADATA_KEY not in metadata:
        return False
    try:
        data = json.loads(metadata)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and isinstance(data.get(RESUME_METADATA_KEY), dict)


def resume_request(metadata: str | None) -> ResumeRequest | None:
    """The resume section of ConfigureGeneration's chat metadata (None: absent).

    Raises:
        ValueError: a malformed section (named).
    """
    if not metadata or RESUME_METADATA_KEY not in metadata:
        return None
    try:
        data = json.loads(metadata)
    except (ValueError, RecursionError):
        return None
    section = data.get(RESUME_METADATA_KEY) if isinstance(data, dict) else None
    if section is None or (isinstance(section, dict) and "length" not in section):
        return None  # absent, or the first configure's {"hold": true}
    if not isinstance(section, dict):
        raise ValueError(f"{RESUME_METADATA_KEY} must be an object")
    length, tokens = section.get("length"), section.get("tokens", [])
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= 1 << 24:
        raise ValueError(f"{RESUME_METADATA_KEY}.length must be an integer in [0, 2^24] (got {length!r})")
    if (not isinstance(tokens, list) or len(tokens) > MAX_RESUME_TOKENS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in tokens)):
        raise ValueError(f"{RESUME_METADATA_KEY}.tokens must be a list of at most {MAX_RESUME_TOKENS} token ids")
    return ResumeRequest(length, tuple(tokens))
