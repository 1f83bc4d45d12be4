"""Counters of one stage process, and the JSON stats file they are written to.

Strategy: plain integers mutated only on the trio thread (no locks); the scheduler adds
session/KV figures it reads on its own thread.  ``StatsWriter`` rewrites the file atomically
(write then rename) a few times a second while something changed, so tests and operators can
read the live state of a stage process without a protocol extension.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio


@dataclasses.dataclass(slots=True)
class StageStats:
    """Live counters (see the field names); ``decode_batch_sizes`` is a histogram."""

    messages: int = 0
    prefill_chunks: int = 0
    decode_items: int = 0
    verify_windows: int = 0
    #: TryRestorePrefillDecode (18) messages this stage restored and decoded (local hits).
    restore_decodes: int = 0
    native_batches: int = 0
    decode_batches: int = 0
    max_decode_batch: int = 0
    decode_batch_sizes: Counter[int] = dataclasses.field(default_factory=Counter)
    auto_aligns: int = 0
    trimmed_tokens: int = 0
    early_acks: int = 0
    max_pending_prefill_acks: int = 0
    credit_waits: int = 0
    connections_open: int = 0
    connections_total: int = 0
    connection_errors: int = 0
    sessions_released: int = 0
    orphan_sessions_released: int = 0
    compute_us: int = 0
    forward_write_us: int = 0
    #: Frames (downstream activations, final-stage predictions) the runtime thread wrote itself.
    write_throughs: int = 0
    #: docs/protocol.md §8: return lanes opened on this stage, predictions written into them.
    return_lanes: int = 0
    direct_replies: int = 0
    downstream_wait_us: int = 0
    sessions_in_use: int = 0
    kv_cells_used: int = 0
    #: The prefix cache's counters and gauges (``StageCache.stats``; empty when it is off).
    prefix_cache: dict[str, int] = dataclasses.field(default_factory=dict)
    version: int = 0

    def touch(self) -> None:
        self.version += 1

    def observe_decode_batch(self, size: int) -> None:
        self.decode_batches += 1
        self.decode_batch_sizes[size] += 1
        self.max_decode_batch = max(self.max_decode_batch, size)
        self.touch()

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["decode_batch_sizes"] = {str(k): v for k, v in sorted(self.decode_batch_sizes.items())}
        return data


def write_stats_file(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` with ``data`` as JSON."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, sort_keys=True))
    os.replace(temporary, path)


async def write_stats_periodically(path: Path, stats: StageStats,
                                   refresh: Callable[[], Awaitable[None]], *, interval: float = 0.1,
                                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Keep ``path`` current: refresh the runtime figures and rewrite it whenever stats change."""
    written = -1
    await refresh()
    write_stats_file(path, stats.as_dict())
    task_status.started()
    while True:
        await trio.sleep(interval)
        if stats.version != written:
            written = stats.version
            await refresh()
            await trio.to_thread.run_sync(write_stats_file, path, stats.as_dict())
