"""Adaptive prefill chunk size: the reference's ramp, fed by the chain's own timings (sans-IO).

Strategy.  A split chain prefills as a pipeline: while stage ``k`` computes chunk ``i``, stage
``k - 1`` computes chunk ``i + 1``.  One chunk per prompt leaves every stage but one idle (the
2-stage chain runs at ~101% of unsplit with 512-token chunks); many small chunks overlap the
stages but pay the per-chunk costs (a frame per boundary, a llama batch per stage) more often.
So the chunk size for one request is

    chunk = clamp(ceil(N / (pipeline_depth * S)), minimum, size)

for ``N`` prompt tokens to compute and ``S`` stages (``pipeline_depth`` chunks per stage keep
every stage busy after the fill), and ``size``, the ceiling, is what the ramp adapts: after every
request the driver folds that request's measurements into an EWMA (alpha 0.25) and

* grows ``size`` by ``step`` while the boundary is hidden behind compute: wait <= 0.75x compute
  and write <= 0.25x compute;
* shrinks it by ``step`` once the boundary shows: wait > 1.25x compute or write > 0.75x compute;
* holds it in between, and advances (grows) when a request brought no observation (one chunk, or
  one stage: nothing to hide).

The next request starts from the ``size`` the previous one left (the seed).  A 1-stage chain has
no pipeline: it uses ``size`` itself.  Short prompts (at most ``short_prompt`` tokens, 128) are
one chunk: a pipeline fill of a few small chunks saves less than their per-chunk costs.

Where the figures come from (nothing here does I/O; :mod:`skippy.driver.generator` feeds it):

* *compute*: the final chunk's Timings frame (``usage.skippy_timing.stages``, docs/protocol.md
  §4) gives each stage's ``compute_us`` for that chunk; scaled to a full chunk by token count;
* *write* / *wait*: the reply stats' prefill-edge maxima (``prefill_edge_write_us_max``,
  ``prefill_edge_wait_us_max``): the slowest downstream write of a non-final chunk, and the
  longest wait from that write to the downstream stage's early ACK (which it sends on receipt,
  so a long wait means the downstream stage is behind and backpressures).  The ratio uses the
  compute of the stage that sent that edge (``prefill_edge_stage_index``).

Not thread-safe; one controller serves every lane of a :class:`~skippy.driver.generator.Generator`
(trio runs them on one thread, and :meth:`PrefillChunker.plan` / :meth:`observe` never await).
"""

from __future__ import annotations

import dataclasses
import math
from typing import final

from skippy.codec.protocol import ReplyStats
from skippy.codec.protocol_ext import TimingsFrame

__all__ = ["ChunkingConfig", "PrefillChunker", "PrefillObservation", "observation_from"]


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkingConfig:
    """The ramp's bounds and thresholds (the reference's adaptive-ramp defaults start at 128)."""

    start: int = 128
    step: int = 64
    minimum: int = 32
    maximum: int = 512
    #: Grow while wait <= grow_wait x compute and write <= grow_write x compute.
    grow_wait: float = 0.75
    grow_write: float = 0.25
    #: Shrink once wait > shrink_wait x compute or write > shrink_write x compute.
    shrink_wait: float = 1.25
    shrink_write: float = 0.75
    #: Weight of the newest request in the wait / write ratios' EWMA.
    alpha: float = 0.25
    #: Chunks per stage a split chain's prompt is cut into (at least), so the pipeline fills.
    pipeline_depth: int = 2
    #: Prompts of at most this many tokens are one chunk (too short for the pipeline to pay).
    short_prompt: int = 128

    def __post_init__(self) -> None:
        if not 0 < self.minimum <= self.start <= self.maximum:
            raise ValueError(f"need 0 < minimum <= start <= maximum (got {self.minimum}, {self.start}, "
                             f"{self.maximum})")
        if self.step <= 0 or self.pipeline_depth <= 0 or not 0 < self.alpha <= 1:
            raise ValueError("step and pipeline_depth must be > 0 and alpha in (0, 1]")
        if self.grow_wait > self.shrink_wait or self.grow_write > self.shrink_write:
            raise ValueError("grow thresholds must not exceed shrink thresholds")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillObservation:
    """What one request's prefill measured (microseconds; ``edges`` 0: no boundary was seen)."""

    stages: int
    #: One stage's compute for a full chunk of the size the request used.
    compute_us: float
    write_us: float = 0.0
    wait_us: float = 0.0
    #: Prefill-edge observations behind write / wait (non-final chunks x boundaries).
    edges: int = 0


def observation_from(chunk_size: int, final_tokens: int, timings: TimingsFrame | None,
                     stats: ReplyStats) -> PrefillObservation | None:
    """The observation in a prefill's final reply (its ``stats`` and the Timings frame before it).

    ``final_tokens`` is the final chunk's token count.  None when the chain sent no timings
    (a plain v11 chain): the ramp then keeps its size.
    """
    if timings is None or not timings.records or final_tokens <= 0:
        return None
    scale = chunk_size / final_tokens
    by_stage = {record.stage_index: record.compute_us for record in timings.records}
    edges = stats.prefill_edge_observation_count
    compute = by_stage.get(stats.prefill_edge_stage_index) if edges else None
    if compute is None:
        compute = max(by_stage.values())
    return PrefillObservation(stages=len(timings.records), compute_us=compute * scale,
                              write_us=float(stats.prefill_edge_write_us_max),
                              wait_us=float(stats.prefill_edge_wait_us_max), edges=edges)


@final
class PrefillChunker:
    """Chooses each request's prefill chunk size and learns from what the chain measured."""

    def __init__(self, config: ChunkingConfig = ChunkingConfig()) -> None:
        self.config = config
        #: The ramp's current ceiling (the seed of the next request).
        self.size = config.start
        #: Stages of the chain, from the last observation (0: not known yet).
        self.stages = 0
        #: EWMA of wait / compute and write / compute (None: nothing observed yet).
        self.wait_ratio: float | None = None
        self.write_ratio: float | None = None

    def plan(self, tokens: int) -> int:
        """The chunk size for a prefill of ``tokens`` tokens."""
        config = self.config
        if tokens <= max(config.minimum, config.short_prompt):
            return max(1, tokens)
        if self.stages <= 1:  # one stage (or not known yet): no pipeline to fill
            return self.size
        spread = math.ceil(tokens / (config.pipeline_depth * self.stages))
        return max(config.minimum, min(self.size, spread))

    def observe(self, observation: PrefillObservation | None) -> int:
        """Fold one request's figures in and move the ramp; returns the new ``size``."""
        if observation is None:
            return self.size
        config = self.config
        self.stages = observation.stages
        if observation.edges <= 0 or observation.compute_us <= 0:
            return self._grow()  # nothing to hide: advance, as the reference's ramp does
        wait = observation.wait_us / observation.compute_us
        write = observation.write_us / observation.compute_us
        self.wait_ratio = wait if self.wait_ratio is None else self.wait_ratio + config.alpha * (wait - self.wait_ratio)
        self.write_ratio = (write if self.write_ratio is None
                            else self.write_ratio + config.alpha * (write - self.write_ratio))
        if self.wait_ratio > config.shrink_wait or self.write_ratio > config.shrink_write:
            self.size = max(config.minimum, self.size - config.step)
        elif self.wait_ratio <= config.grow_wait and self.write_ratio <= config.grow_write:
            self._grow()
        return self.size

    def _grow(self) -> int:
        self.size = min(self.config.maximum, self.size + self.config.step)
        return self.size
