"""A stage's Prometheus metrics: ``--metrics-listen HOST:PORT`` serves ``GET /metrics``.

Strategy: nothing on the serving path knows about Prometheus.  The lanes and the scheduler keep
plain counters and fixed-bucket latency histograms in :class:`~skippy.stage.stats.StageStats`
(an integer add or a ``bisect`` per event, on the trio thread), and each lane's
:class:`~skippy.net.socket_io.SocketIO` counts its bytes.  At scrape time a
:class:`StageCollector` (registered in a private ``CollectorRegistry``, so nothing global is
touched) turns those into metric families; the gauges that live in the runtime (sessions and KV
cells in use, the prefix cache's counters) are refreshed first through the scheduler, in order
with the compute jobs.  The HTTP side is a deliberately small trio server on the stage's own
nursery (one request per connection, a request head of at most 8 KiB read within 5 s): it runs on
the trio thread, so it reads the counters without locks, and a stage needs no web framework.

Metric names start ``skippy_stage_``; every family carries the stage's ``layers`` label.  The
standard ``process_*`` families (resident memory, CPU seconds, open files; Linux only) come from
prometheus_client's own process collector, registered in the same private registry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from skippy.net.address import Address
from skippy.stage.stats import LATENCY_BOUNDS_US, LatencyHistogram

if TYPE_CHECKING:
    from skippy.stage.server import StageServer

__all__ = ["StageCollector", "metrics_registry", "serve_metrics"]

log = logging.getLogger("skippy.stage.metrics")

_MAX_HEAD = 8192
_READ_TIMEOUT = 5.0
_BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Prefix-cache counters exported (CacheStats field -> metric suffix); gauges apart.
_CACHE_COUNTERS = {"probes": "probes", "probe_hits": "probe_hits", "hits": "hits", "misses": "misses",
                   "errors": "errors", "restored_tokens": "restored_tokens", "records": "records",
                   "evictions": "evictions", "spills": "spills", "spilled_bytes": "spilled_bytes",
                   "spill_restores": "spill_restores", "resident_restores": "resident_restores"}
_CACHE_GAUGES = ("resident_entries", "resident_tokens", "resident_bytes", "spill_entries", "spill_bytes")


def _latency(name: str, documentation: str, labels: dict[str, str], histogram: LatencyHistogram) -> Metric:
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    cumulative, buckets = 0, []
    for bound, count in zip((*LATENCY_BOUNDS_US, None), histogram.counts):
        cumulative += count
        buckets.append(("+Inf" if bound is None else repr(bound / 1e6), cumulative))
    family.add_metric(list(labels.values()), buckets, histogram.sum_us / 1e6)
    return family


class StageCollector(Collector):
    """Exports one :class:`StageServer`'s counters (see the module notes)."""

    def __init__(self, server: "StageServer") -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        server, stats = self.server, self.server.stats
        labels = {"layers": server.config.layers}
        names, values = list(labels), list(labels.values())

        def counter(name: str, documentation: str, value: float) -> Metric:
            family = CounterMetricFamily(f"skippy_stage_{name}", documentation, labels=names)
            family.add_metric(values, value)
            return family

        def gauge(name: str, documentation: str, value: float) -> Metric:
            family = GaugeMetricFamily(f"skippy_stage_{name}", documentation, labels=names)
            family.add_metric(values, value)
            return family

        yield _latency("skippy_stage_compute_seconds", "runtime time per job (a batch's share)", labels,
                       stats.compute_histogram)
        yield _latency("skippy_stage_queue_wait_seconds", "time a job waited for the runtime", labels,
                       stats.queue_histogram)
        yield _latency("skippy_stage_downstream_wait_seconds", "from a frame's write downstream to its reply",
                       labels, stats.downstream_wait_histogram)
        batch = HistogramMetricFamily("skippy_stage_decode_batch_size", "decode rows per native batch",
                                      labels=names)
        cumulative, buckets = 0, []
        sizes = dict(stats.decode_batch_sizes)
        for bound in _BATCH_BOUNDS:
            cumulative = sum(count for size, count in sizes.items() if size <= bound)
            buckets.append((str(bound), cumulative))
        buckets.append(("+Inf", sum(sizes.values())))
        batch.add_metric(values, buckets, float(sum(size * count for size, count in sizes.items())))
        yield batch
        yield counter("messages", "messages received from upstream", stats.messages)
        yield counter("prefill_chunks", "prefill chunks computed", stats.prefill_chunks)
        yield counter("decode_tokens", "decode rows computed", stats.decode_items)
        yield counter("verify_windows", "speculative verify windows computed", stats.verify_windows)
        yield counter("native_batches", "llama.cpp batches run", stats.native_batches)
        yield counter("runtime_busy_seconds", "wall time the runtime ran the scheduler's batches (each once) and "
                      "computed the decode relay's steps", stats.runtime_busy_us / 1e6)
        yield counter("runtime_cpu_seconds", "CPU time of the thread running those batches and the relay's loop, "
                      "during them", stats.runtime_cpu_us / 1e6)
        yield counter("decode_relay_tokens", "decode rows the decode relay carried outside Python (also in "
                      "decode_tokens)", stats.decode_relay_steps)
        yield counter("decode_relay_windows", "verify windows the decode relay carried outside Python (also in "
                      "verify_windows)", stats.decode_relay_windows)
        yield counter("decode_relay_runs", "runs of the decode relay (each ends at a frame it hands back)",
                      stats.decode_relay_runs)
        yield counter("connections", "upstream lanes accepted", stats.connections_total)
        yield gauge("connections_open", "upstream lanes open now", stats.connections_open)
        yield gauge("sessions_in_use", "sessions holding a sequence id", stats.sessions_in_use)
        yield gauge("kv_cells_used", "KV cells in use (sessions and resident cached prefixes)", stats.kv_cells_used)
        yield gauge("kv_cells_capacity", "KV cells of the stage", server.config.ctx_size)
        errors = CounterMetricFamily("skippy_stage_errors", "lanes closed with an error, by error code",
                                     labels=[*names, "code"])
        for code, count in sorted(stats.errors_by_code.items()):
            errors.add_metric([*values, code], count)
        yield errors
        cache = stats.prefix_cache
        for field, suffix in _CACHE_COUNTERS.items():
            yield counter(f"prefix_cache_{suffix}", f"prefix cache {field.replace('_', ' ')}", cache.get(field, 0))
        for field in _CACHE_GAUGES:
            yield gauge(f"prefix_cache_{field}", f"prefix cache {field.replace('_', ' ')} now", cache.get(field, 0))
        resume = stats.resume  # docs/protocol.md §14
        yield gauge("resume_log_bytes", "activation log memory now (rows sent downstream, kept for a resume)",
                    resume.get("log_bytes", 0))
        yield gauge("resume_log_budget_bytes", "activation log budget (--resume-log-mib)", resume.get("log_budget_bytes", 0))
        yield gauge("resume_parked_sessions", "sessions parked for a resume after a lost stage", resume.get("parked_now", 0))
        yield counter("resume_log_evicted_sessions", "sessions evicted from the activation log",
                      resume.get("evicted_sessions", 0))
        yield counter("resume_replayed_tokens", "replayed positions answered from the log or KV (nothing computed)",
                      resume.get("replayed_tokens", 0))
        yield counter("resume_recomputed_tokens", "replayed positions computed again (the log did not cover them)",
                      resume.get("replay_recomputed_tokens", 0))
        yield counter("resume_adopted_sessions", "parked sessions a resume adopted", resume.get("adopted", 0))
        yield from self._bytes(names, values)

    def _bytes(self, names: list[str], values: list[str]) -> Iterator[Metric]:
        stats = self.server.stats
        totals = {("upstream", "in"): stats.upstream_bytes_in, ("upstream", "out"): stats.upstream_bytes_out,
                  ("downstream", "in"): stats.downstream_bytes_in, ("downstream", "out"): stats.downstream_bytes_out}
        for connection in list(self.server.connections):
            for lane, io in (("upstream", connection.upstream_io), ("downstream", connection.downstream_io)):
                if io is not None:
                    totals[(lane, "in")] += io.bytes_in
                    totals[(lane, "out")] += io.bytes_out
        family = CounterMetricFamily("skippy_stage_lane_bytes", "bytes moved on this stage's lanes",
                                     labels=[*names, "lane", "direction"])
        for (lane, direction), count in totals.items():
            family.add_metric([*values, lane, direction], count)
        yield family


def metrics_registry(server: "StageServer") -> CollectorRegistry:
    """A private registry holding ``server``'s collector and this process's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StageCollector(server))
    ProcessCollector(registry=registry)
    return registry


async def serve_metrics(server: "StageServer", address: Address, *,
                        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``GET /metrics`` on ``address`` until cancelled; reports the bound address."""
    registry = metrics_registry(server)
    listeners = await trio.open_tcp_listeners(address.port, host=address.host)
    name = listeners[0].socket.getsockname()
    bound = Address(name[0], name[1])
    log.info("stage layers %s metrics on http://%s/metrics", server.config.layers, bound)
    task_status.started(bound)

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _answer(server, registry, stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError):
                pass  # the scraper left or stalled: nothing to answer

    await trio.serve_listeners(handle, listeners)


async def _answer(server: "StageServer", registry: CollectorRegistry, stream: trio.SocketStream) -> None:
    head = b""
    with trio.fail_after(_READ_TIMEOUT):
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            chunk = await stream.receive_some(_MAX_HEAD)
            if not chunk:
                return
            head += chunk
            if len(head) > _MAX_HEAD:
                await stream.send_all(_response(431, b"request head too large\n"))
                return
    request_line = head.split(b"\n", 1)[0].decode("latin-1").strip().split()
    if len(request_line) < 2 or request_line[0] not in ("GET", "HEAD"):
        await stream.send_all(_response(405, b"only GET /metrics is served\n"))
        return
    if request_line[1].split("?", 1)[0] != "/metrics":
        await stream.send_all(_response(404, b"only /metrics is served\n"))
        return
    await server.refresh_runtime_stats()
    body = generate_latest(registry)
    await stream.send_all(_response(200, b"" if request_line[0] == "HEAD" else body,
                                    "text/plain; version=0.0.4; charset=utf-8", len(body)))


def _response(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              length: int | None = None) -> bytes:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}[status]
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body
