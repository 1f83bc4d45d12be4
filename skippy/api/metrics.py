"""Prometheus metrics of the API server, in a registry of their own.

Strategy: one :class:`Metrics` object per app (its own ``CollectorRegistry``, so several apps in
one process — tests — never collide), updated by the request handlers at a few points: a request
ends (status, tokens), the first token arrives (TTFT), each later token (inter-token gap), and the
stage timings carried by the replies (mean compute of one stage per reply, and the chain's total),
the speculative-decoding counters of the requests that speculated, and admission (requests
waiting for a lane, retries after an overloaded stage, lanes kept or closed after a client left).
"""

from __future__ import annotations

from typing import final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from skippy.driver.generator import GenerationRequest, Timing
from skippy.driver.speculation.window import SpeculationUsage

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@final
class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("skippy_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.in_flight = Gauge("skippy_requests_in_flight", "generation requests running", registry=r)
        self.prompt_tokens = Counter("skippy_prompt_tokens", "prompt tokens processed", registry=r)
        self.completion_tokens = Counter("skippy_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("skippy_time_to_first_token_seconds", "time to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("skippy_inter_token_seconds", "time between consecutive tokens",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.stage_compute = Histogram("skippy_stage_compute_seconds",
                                       "compute of one stage for one reply (chain mean)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.chain_compute = Counter("skippy_chain_compute_seconds", "compute summed over all stages", registry=r)
        self.chain_stages = Gauge("skippy_chain_stages", "stages that reported timings", registry=r)
        self.lanes_open = Gauge("skippy_lanes_open", "lanes open to the first stage", registry=r)
        self.spec_requests = Counter("skippy_speculation_requests", "requests that decoded speculatively",
                                     registry=r)
        self.spec_proposed = Counter("skippy_speculation_proposed_tokens", "draft tokens sent in verify windows",
                                     registry=r)
        self.spec_accepted = Counter("skippy_speculation_accepted_tokens", "draft tokens the target kept",
                                     registry=r)
        self.spec_windows = Counter("skippy_speculation_windows", "verify windows sent", registry=r)
        self.spec_rollbacks = Counter("skippy_speculation_rollbacks",
                                      "divergences that rolled stage KV back (authoritative position)", registry=r)
        self.spec_stale = Counter("skippy_speculation_stale_windows", "pipelined windows drained unused",
                                  registry=r)
        self.prefix_lookups = Counter("skippy_prefix_cache_lookups", "requests that looked up the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("skippy_prefix_cache_hits", "requests that restored a cached prefix",
                                   registry=r)
        self.prefix_cached_tokens = Counter("skippy_prefix_cache_cached_tokens",
                                            "prompt tokens restored from the prefix cache", registry=r)
        self.queue_waiting = Gauge("skippy_queue_waiting", "requests waiting for a lane", registry=r)
        self.overload_retries = Counter("skippy_overload_retries",
                                        "first exchanges retried after a stage had no free session", registry=r)
        self.lanes_kept_after_abort = Counter("skippy_lanes_kept_after_abort",
                                              "lanes kept after a client left mid-stream (session stopped)",
                                              registry=r)
        self.lanes_closed_after_abort = Counter("skippy_lanes_closed_after_abort",
                                                "lanes closed after a client left mid-exchange", registry=r)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def first_token(self, timing: Timing) -> None:
        self.ttft.observe(timing.time_to_first_token)

    def generation_done(self, timing: Timing, completion_tokens: int) -> None:
        self.prompt_tokens.inc(timing.prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        for gap in timing.inter_token:
            self.inter_token.observe(gap)
        if timing.replies and timing.stage_count:
            per_stage = timing.compute_us / timing.replies / timing.stage_count / 1e6
            for _ in range(timing.replies):
                self.stage_compute.observe(per_stage)
            self.chain_compute.inc(timing.compute_us / 1e6)
            self.chain_stages.set(timing.stage_count)

    def speculation_done(self, usage: SpeculationUsage) -> None:
        self.spec_requests.inc()
        self.spec_proposed.inc(usage.proposed)
        self.spec_accepted.inc(usage.accepted)
        self.spec_windows.inc(usage.windows)
        self.spec_rollbacks.inc(usage.rollbacks)
        self.spec_stale.inc(usage.stale_windows)

    def prefix_cache_done(self, request: GenerationRequest, cached_tokens: int) -> None:
        if request.prefix_cache is not False:
            self.prefix_lookups.inc()
        if cached_tokens:
            self.prefix_hits.inc()
            self.prefix_cached_tokens.inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
