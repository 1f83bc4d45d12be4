"""The chain as the page at ``/`` draws it: each stage's state, and the API's recent history.

Strategy: nothing new is measured here; what the chain already reports is gathered and shaped.

* **Per stage** (:class:`ChainView`): a lane opened to the stage (READY within the probe timeout)
  says it is up; its Identity frame (docs/protocol.md §9, asked once per address and forgotten when
  the stage goes down) names its model file, header digest and layer range; when its Prometheus
  endpoint is known (``skippy up`` starts stages with ``--metrics-listen``), one scrape gives its
  resident memory, KV cells and sessions in use and its prefix-cache counters (shown only while the
  stage answers on its serving port).  The whole chain's
  health is the pool's own check (a Stop through every stage, as ``/health`` does).  Every stage is
  asked at once, each within ``probe_timeout``, and the result is kept ``refresh_s`` so that any
  number of pages polling cost the chain one probe round per ``refresh_s``.
* **Recent history** (:class:`History`): every finished generation's timing (from the replies'
  Timings frames, the same figures as ``usage.skippy_timing``) is kept for ``window_s``.  From it
  come the throughput (completion tokens spread over each generation's decode time, per bucket),
  the TTFT of each request, and each stage's share of a token's time: compute, queue wait, and the
  wire, which is what the stage's ``downstream_wait`` holds beyond the time its downstream stage
  itself accounts for (queue + compute + its own write and wait), plus its own write downstream.
  All are means per reply, over the replies that carried the stage's record.

Without the stages' addresses (``skippy serve`` knows the first stage only) the first stage alone
is shown and ``stages_known`` is false.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Callable, Final, final

import trio
from prometheus_client.parser import text_string_to_metric_families

from skippy.api.lanes import LanePool, StageInfo
from skippy.codec.protocol_ext import IdentityFrame
from skippy.driver.client import StageClient, StageLost
from skippy.driver.generator import Timing
from skippy.identity import query_identity
from skippy.net.address import Address

__all__ = ["ChainView", "History", "fetch_stage_metrics", "stage_figures"]

#: Seconds of history kept and drawn, and the width of one throughput bucket.
WINDOW_S: Final = 300.0
BUCKET_S: Final = 5.0
#: TTFT points kept (the most recent ones).
MAX_TTFT_POINTS: Final = 600
#: Largest stage metrics body read (a stage's is a few KiB).
MAX_METRICS_BYTES: Final = 1 << 20

#: Stage metrics samples shown, by the name the snapshot gives them.
_FIGURES: Final = {
    "resident_bytes": "process_resident_memory_bytes",
    "kv_cells_used": "skippy_stage_kv_cells_used",
    "kv_cells_capacity": "skippy_stage_kv_cells_capacity",
    "sessions_in_use": "skippy_stage_sessions_in_use",
    "lanes_open": "skippy_stage_connections_open",
    "decode_tokens": "skippy_stage_decode_tokens_total",
    "prefix_cache_hits": "skippy_stage_prefix_cache_hits_total",
    "prefix_cache_misses": "skippy_stage_prefix_cache_misses_total",
}


@dataclasses.dataclass(frozen=True, slots=True)
class _StageSums:
    replies: int
    compute_us: int
    forward_write_us: int
    downstream_wait_us: int
    queue_wait_us: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Finished:
    """One finished generation, as much of it as the history needs."""

    at: float
    ttft_s: float
    decode_s: float
    tokens: int
    stages: dict[int, _StageSums]


@final
class History:
    """Generations finished in the last ``window_s`` seconds (module notes).

    Args:
        window_s: seconds kept.
        bucket_s: width of one throughput bucket.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, *, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (window_s > 0 and 0 < bucket_s <= window_s):
            raise ValueError(f"bad history window {window_s} / bucket {bucket_s}")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.clock = clock
        self._finished: collections.deque[_Finished] = collections.deque()
        #: Totals since the API started.
        self.requests = 0
        self.completion_tokens = 0

    def generation_done(self, timing: Timing, completion_tokens: int) -> None:
        """Record a finished generation (its timing as the usage extension reports it)."""
        stages = {index: _StageSums(stage.replies, stage.compute_us, stage.forward_write_us,
                                    stage.downstream_wait_us, stage.queue_wait_us)
                  for index, stage in timing.stages.items()}
        self._finished.append(_Finished(self.clock(), timing.time_to_first_token, timing.decode_seconds,
                                        completion_tokens, stages))
        self.requests += 1
        self.completion_tokens += completion_tokens
        self._prune(self.clock())

    def _prune(self, now: float) -> None:
        while self._finished and self._finished[0].at < now - self.window_s:
            self._finished.popleft()

    def throughput(self, now: float) -> list[list[float]]:
        """``[seconds ago at the bucket's end, tokens per second]``, oldest first, one per bucket."""
        count = math.ceil(self.window_s / self.bucket_s)
        tokens = [0.0] * count
        start = now - count * self.bucket_s
        for item in self._finished:
            begin = item.at - item.decode_s
            if item.decode_s <= 0:  # one token (or no decode): all of it at the end
                index = min(count - 1, int((item.at - start) // self.bucket_s))
                if index >= 0:
                    tokens[index] += item.tokens
                continue
            rate = item.tokens / item.decode_s
            first = max(0, int((begin - start) // self.bucket_s))
            last = min(count - 1, int((item.at - start) // self.bucket_s))
            for index in range(first, last + 1):
                low = max(begin, start + index * self.bucket_s)
                high = min(item.at, start + (index + 1) * self.bucket_s)
                if high > low:
                    tokens[index] += rate * (high - low)
        return [[round((count - 1 - index) * self.bucket_s, 3), round(value / self.bucket_s, 3)]
                for index, value in enumerate(tokens)]

    def stage_shares(self) -> dict[int, dict[str, float]]:
        """Per stage index: mean compute / queue / wire milliseconds per reply (module notes)."""
        sums: dict[int, list[int]] = {}
        for item in self._finished:
            for index, stage in item.stages.items():
                total = sums.setdefault(index, [0, 0, 0, 0, 0])
                total[0] += stage.replies
                total[1] += stage.compute_us
                total[2] += stage.forward_write_us
                total[3] += stage.downstream_wait_us
                total[4] += stage.queue_wait_us
        means = {index: [value / total[0] / 1000 for value in total[1:]] for index, total in sums.items() if total[0]}
        shares: dict[int, dict[str, float]] = {}
        for index, (compute, write, downstream, queue) in means.items():
            after = means.get(index + 1)
            beyond = 0.0 if after is None else sum(after)  # the next stage's own time inside our wait
            wire = write + max(0.0, downstream - beyond)
            shares[index] = {"compute_ms": round(compute, 3), "wire_ms": round(wire, 3), "queue_ms": round(queue, 3)}
        return shares

    def as_dict(self) -> dict[str, Any]:
        """The history part of the snapshot (times are seconds before now)."""
        now = self.clock()
        self._prune(now)
        ttft = [[round(now - item.at, 3), round(item.ttft_s * 1000, 3)]
                for item in list(self._finished)[-MAX_TTFT_POINTS:]]
        return {"window_s": self.window_s, "bucket_s": self.bucket_s, "throughput": self.throughput(now),
                "ttft_ms": ttft, "requests": self.requests, "completion_tokens": self.completion_tokens}


async def fetch_stage_metrics(address: Address, *, timeout: float) -> str:
    """``GET /metrics`` of a stage's metrics server (one request per connection, plain HTTP).

    Raises:
        OSError: no connection, a reset, or not a 200 answer.
        trio.TooSlowError: no complete answer within ``timeout``.
        ValueError: an answer over :data:`MAX_METRICS_BYTES` or not UTF-8.
    """
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            try:
                await stream.send_all(f"GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
                                      .encode("latin-1"))
                data = bytearray()
                while chunk := await stream.receive_some(65536):
                    data += chunk
                    if len(data) > MAX_METRICS_BYTES:
                        raise ValueError(f"metrics of {address} exceed {MAX_METRICS_BYTES} bytes")
            except trio.BrokenResourceError as exc:  # reset by the stage: as unreachable
                raise OSError(f"metrics of {address}: connection reset") from exc
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or status[1] != b"200":
        raise OSError(f"metrics of {address} answered {head[:80]!r}")
    return body.decode("utf-8")


def stage_figures(text: str) -> dict[str, float]:
    """The figures of :data:`_FIGURES` found in a stage's metrics text (labels summed).

    Raises:
        ValueError: not Prometheus text.
    """
    wanted = {sample: name for name, sample in _FIGURES.items()}
    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = wanted.get(sample.name)
            if name is not None:
                figures[name] = figures.get(name, 0.0) + float(sample.value)
    return figures


def _identity(frame: IdentityFrame) -> dict[str, Any]:
    return {"model": frame.model_name, "digest": frame.digest.hex(),
            "layers": f"{frame.layer_start}:{frame.layer_end}", "layer_count": frame.layer_count,
            "ctx_size": frame.ctx_size, "batch_size": frame.batch_size}


@final
class ChainView:
    """What each stage of ``pool``'s chain says about itself (module notes).

    Args:
        pool: the API's lane pool (its stages, first stage, TLS context, health check).
        probe_timeout: seconds each probe (lane, identity, scrape, chain check) may take.
        refresh_s: seconds one probe round is reused.
    """

    def __init__(self, pool: LanePool, *, probe_timeout: float = 1.0, refresh_s: float = 0.5) -> None:
        self.pool = pool
        self.probe_timeout = probe_timeout
        self.refresh_s = refresh_s
        self._identities: dict[str, IdentityFrame | None] = {}
        self._lock = trio.Lock()
        self._taken_at = -math.inf
        self._last: dict[str, Any] = {}

    def stages(self) -> tuple[StageInfo, ...]:
        """The stages drawn: the pool's, else its first stage alone."""
        return self.pool.stages or (StageInfo(0, "", self.pool.address),)

    async def snapshot(self) -> dict[str, Any]:
        """``{"status", "error", "stages_known", "stages": [...]}``, at most ``refresh_s`` old."""
        async with self._lock:  # callers during a round wait for it and share its result
            if trio.current_time() - self._taken_at >= self.refresh_s:
                self._last = await self._probe_all()
                self._taken_at = trio.current_time()
            return self._last

    async def _probe_all(self) -> dict[str, Any]:
        stages = self.stages()
        entries: list[dict[str, Any]] = [{} for _ in stages]
        problem: list[str | None] = [None]

        async def check_chain() -> None:
            problem[0] = await self.pool.check(self.probe_timeout)

        async def probe(position: int, stage: StageInfo) -> None:
            entries[position] = await self._probe(stage)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(check_chain)
            for position, stage in enumerate(stages):
                nursery.start_soon(probe, position, stage)
        digests = {entry["identity"]["digest"] for entry in entries if entry.get("identity")}
        return {"status": "ok" if problem[0] is None else "unavailable", "error": problem[0],
                "stages_known": bool(self.pool.stages), "one_model": len(digests) <= 1, "stages": entries}

    async def _probe(self, stage: StageInfo) -> dict[str, Any]:
        key = str(stage.address)
        entry: dict[str, Any] = {"index": stage.index, "layers": stage.layers, "address": key, "status": "down",
                                 "error": None, "identity": None, "metrics": None, "metrics_error": None}
        figures: list[dict[str, float] | str] = []
        async with trio.open_nursery() as nursery:
            if stage.metrics is not None:
                nursery.start_soon(self._scrape, stage.metrics, figures)
            try:
                client = await StageClient.connect(stage.address, connect_timeout=self.probe_timeout,
                                                   reply_timeout=self.probe_timeout, tls=self.pool.tls)
            except StageLost as exc:  # no connection or no READY in time: that is what "down" means here
                self._identities.pop(key, None)  # whatever answers there next may serve something else
                entry["error"] = f"not answering on {key}: {exc.__cause__ or exc}"
            else:
                await client.aclose()
                entry["status"] = "up"
                if key not in self._identities:
                    try:
                        self._identities[key] = await query_identity(stage.address, timeout=self.probe_timeout,
                                                                     tls=self.pool.tls)
                    except OSError:  # gone between the two dials: the next round tells
                        pass
                frame = self._identities.get(key)
                if frame is not None:
                    entry["identity"] = _identity(frame)
                    entry["layers"] = entry["identity"]["layers"]
        if entry["status"] == "down":  # a draining stage may still serve metrics: not drawn as working
            return entry
        if figures and isinstance(figures[0], dict):
            entry["metrics"] = figures[0]
        elif figures:
            entry["metrics_error"] = figures[0]
        return entry

    async def _scrape(self, address: Address, out: list[dict[str, float] | str]) -> None:
        try:
            out.append(stage_figures(await fetch_stage_metrics(address, timeout=self.probe_timeout)))
        except (OSError, trio.TooSlowError, ValueError) as exc:  # a stage that is down, hung or not a stage
            out.append(f"metrics of {address}: {exc or type(exc).__name__}")
