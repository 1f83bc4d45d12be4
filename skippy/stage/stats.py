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
import time
from bisect import bisect_left
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable, Final

import trio


#: Upper bounds (microseconds) of the latency histograms' buckets; the last bucket is +Inf.
LATENCY_BOUNDS_US: Final = (50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000,
                            250_000, 500_000, 1_000_000, 2_500_000, 10_000_000)


class LatencyHistogram:
    """Counts of durations (microseconds) per bucket of :data:`LATENCY_BOUNDS_US`, with their sum.

    One ``bisect`` and two additions per observation, on the trio thread; exported to Prometheus
    at scrape time (:mod:`skippy.stage.metrics`) and to the stats file as plain lists.
    """

    __slots__ = ("counts", "sum_us")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS_US) + 1)
        self.sum_us = 0

    def observe(self, value_us: int) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS_US, value_us)] += 1
        self.sum_us += value_us

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict[str, Any]:
        return {"bounds_us": list(LATENCY_BOUNDS_US), "counts": list(self.counts), "sum_us": self.sum_us}


@dataclasses.dataclass(slots=True)
class StageStats:
    """Live counters (see the field names); ``decode_batch_sizes`` is a histogram."""

    messages: int = 0
    prefill_chunks: int = 0
    #: Positions the prefill chunks computed (a restored or forked prefix is not counted).
    prefill_tokens: int = 0
    #: Sessions forked from another session of their lane (``n`` > 1 choices) and the positions copied.
    forked_sessions: int = 0
    forked_tokens: int = 0
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
    #: Wall time the runtime was claimed by the scheduler's batches (each batch once, however many
    #: sessions share it) and spent computing the decode relay's steps (its waits for the upstream
    #: not included): the stage's busy time.
    runtime_busy_us: int = 0
    #: CPU time of the thread that ran those batches and the relay's loop, during them (one compute
    #: thread's share: with --threads > 1 the other compute threads are not in it); below
    #: ``runtime_busy_us`` when the host takes the CPU away.
    runtime_cpu_us: int = 0
    forward_write_us: int = 0
    #: Frames (downstream activations, final-stage predictions) the runtime thread wrote itself.
    write_throughs: int = 0
    #: docs/protocol.md §8: return lanes opened on this stage, predictions written into them.
    return_lanes: int = 0
    direct_replies: int = 0
    #: Of ``connections_open``, the return lanes: they only carry predictions written into them,
    #: so they never bring work to the runtime (the scheduler's LaneRegistry leaves them out).
    return_lanes_open: int = 0
    #: docs/protocol.md §11: decode runs started on this (first) stage, and the steps it started
    #: itself (each run's flagged message not counted).
    decode_runs: int = 0
    decode_run_steps: int = 0
    #: The decode relay (:mod:`skippy.stage.decode_relay`): its runs, and the tokens it carried
    #: outside the lane's Python path (also counted as messages and decode items), and the
    #: verify windows (also counted as messages and verify windows).
    decode_relay_runs: int = 0
    decode_relay_steps: int = 0
    decode_relay_windows: int = 0
    downstream_wait_us: int = 0
    sessions_in_use: int = 0
    kv_cells_used: int = 0
    #: The stage's memory per KV cell (its attention layers only) and per sequence id of
    #: recurrent state (its recurrent layers; 0 for attention-only models), as the planner counts.
    kv_bytes_per_cell: int = 0
    state_bytes_per_sequence: int = 0
    #: The prefix cache's counters and gauges (``StageCache.stats``; empty when it is off).
    prefix_cache: dict[str, int] = dataclasses.field(default_factory=dict)
    #: A recurrent or hybrid model's rollbacks (``StageContext.rollback_stats``; empty otherwise).
    recurrent_rollback: dict[str, int] = dataclasses.field(default_factory=dict)
    #: docs/protocol.md §14: the activation log and resumes (``Executor.resume_stats``).
    resume: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Per-job runtime time, scheduler queue wait, and per-frame downstream wait (write to reply).
    compute_histogram: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    queue_histogram: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    downstream_wait_histogram: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    #: Lanes closed with an error, by the ErrorCode name of the frame they sent (or would have).
    errors_by_code: Counter[str] = dataclasses.field(default_factory=Counter)
    #: Bytes moved by lanes that have closed (open lanes are counted live by their SocketIO).
    upstream_bytes_in: int = 0
    upstream_bytes_out: int = 0
    downstream_bytes_in: int = 0
    downstream_bytes_out: int = 0
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
        for name in ("compute_histogram", "queue_histogram", "downstream_wait_histogram"):
            data[name] = getattr(self, name).as_dict()
        data["errors_by_code"] = dict(self.errors_by_code)
        return data


def write_stats_file(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` with ``data`` as JSON."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, sort_keys=True))
    os.replace(temporary, path)


async def write_stats_periodically(path: Path, stats: StageStats,
                                   refresh: Callable[[], Awaitable[bool | None]], *, interval: float = 0.1,
                                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Keep ``path`` current: refresh the runtime figures and rewrite it every ``interval``.

    The runtime figures are refreshed even when no counter moved: work queued before the last
    counter change (a KV trim after a rejected draft, say) lands in the runtime afterwards.  Each
    write carries ``refreshed_at`` (``time.time()`` taken before the last refresh that read the
    runtime: ``refresh`` returns False when it left the figures as they were, e.g. while a decode
    relay carries tokens), so a reader that needs figures no older than some moment waits for a
    file refreshed after it.
    """
    refreshed = time.time()
    await refresh()
    write_stats_file(path, {**stats.as_dict(), "refreshed_at": refreshed})
    task_status.started()
    while True:
        await trio.sleep(interval)
        moment = time.time()
        if await refresh() is not False:  # the runtime's figures were read: they are as of ``moment``
            refreshed = moment
        await trio.to_thread.run_sync(write_stats_file, path, {**stats.as_dict(), "refreshed_at": refreshed})
