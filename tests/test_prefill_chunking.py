"""The adaptive prefill chunk controller (sans-IO): plan, ramp, seed, the observation parser; and
its hook in ``Generator`` over a chain."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy.codec.protocol import ReplyStats
from skippy.codec.protocol_ext import TimingRecord, TimingsFrame
from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.driver.prefill_chunking import ChunkingConfig, PrefillChunker, PrefillObservation, observation_from

from stage_helpers import inprocess_chain, reference_greedy


def hidden(stages: int = 2) -> PrefillObservation:
    return PrefillObservation(stages=stages, compute_us=10_000, write_us=1_000, wait_us=5_000, edges=3)


def exposed_wait(stages: int = 2) -> PrefillObservation:
    return PrefillObservation(stages=stages, compute_us=10_000, write_us=1_000, wait_us=20_000, edges=3)


def exposed_write(stages: int = 2) -> PrefillObservation:
    return PrefillObservation(stages=stages, compute_us=10_000, write_us=9_000, wait_us=1_000, edges=3)


def test_defaults_start_at_128_and_validate() -> None:
    chunker = PrefillChunker()
    assert chunker.size == 128 and chunker.stages == 0
    with pytest.raises(ValueError):
        ChunkingConfig(minimum=64, start=32)
    with pytest.raises(ValueError):
        ChunkingConfig(step=0)
    with pytest.raises(ValueError):
        ChunkingConfig(grow_wait=2.0)


def test_unknown_chain_and_one_stage_use_the_ramp_size() -> None:
    chunker = PrefillChunker()
    assert chunker.plan(1000) == 128  # stage count not known yet
    chunker.observe(PrefillObservation(stages=1, compute_us=10_000))
    assert chunker.stages == 1 and chunker.plan(1000) == chunker.size == 192


def test_split_chain_cuts_the_prompt_for_the_pipeline() -> None:
    chunker = PrefillChunker(ChunkingConfig(start=384, maximum=512))
    chunker.stages = 2
    assert chunker.plan(512) == 128  # 2 chunks per stage
    assert chunker.plan(500) == 125  # balanced chunks, not 128 + a short tail
    assert chunker.plan(4096) == 384  # capped by the ramp
    assert chunker.plan(200) == 50
    assert chunker.plan(100) == 100  # a short prompt: one chunk
    chunker = PrefillChunker(ChunkingConfig(short_prompt=0))
    chunker.stages = 2
    assert chunker.plan(100) == 32  # not below the minimum
    chunker.stages = 4
    assert chunker.plan(512) == 64


def test_short_prompts_are_one_chunk() -> None:
    chunker = PrefillChunker()
    chunker.stages = 2
    assert chunker.plan(128) == 128
    assert chunker.plan(32) == 32
    assert chunker.plan(5) == 5
    assert chunker.plan(1) == 1


def test_grows_while_the_boundary_is_hidden_up_to_the_maximum() -> None:
    chunker = PrefillChunker(ChunkingConfig(start=128, step=128, maximum=384))
    assert chunker.observe(hidden()) == 256
    assert chunker.observe(hidden()) == 384
    assert chunker.observe(hidden()) == 384


def test_shrinks_when_wait_or_write_is_exposed_down_to_the_minimum() -> None:
    chunker = PrefillChunker(ChunkingConfig(start=128, step=64, minimum=32))
    assert chunker.observe(exposed_wait()) == 64
    chunker = PrefillChunker(ChunkingConfig(start=128, step=64, minimum=32))
    assert chunker.observe(exposed_write()) == 64
    assert chunker.observe(exposed_write()) == 32
    assert chunker.observe(exposed_write()) == 32


def test_holds_between_the_thresholds() -> None:
    chunker = PrefillChunker()
    # wait 1.0x compute: above the grow bound (0.75), not past the shrink bound (1.25)
    middle = PrefillObservation(stages=2, compute_us=10_000, write_us=1_000, wait_us=10_000, edges=2)
    assert chunker.observe(middle) == 128
    # write 0.5x compute: likewise
    middle = PrefillObservation(stages=2, compute_us=10_000, write_us=5_000, wait_us=0, edges=2)
    assert PrefillChunker().observe(middle) == 128


def test_thresholds_are_inclusive_on_the_grow_side() -> None:
    edge = PrefillObservation(stages=2, compute_us=10_000, write_us=2_500, wait_us=7_500, edges=1)
    assert PrefillChunker().observe(edge) == 192
    past = PrefillObservation(stages=2, compute_us=10_000, write_us=0, wait_us=12_501, edges=1)
    assert PrefillChunker().observe(past) == 64


def test_ewma_smooths_one_outlier() -> None:
    chunker = PrefillChunker(ChunkingConfig(start=256, step=64))
    for _ in range(4):
        chunker.observe(hidden())
    size = chunker.size
    chunker.observe(exposed_wait())  # one bad request: 0.5 -> 0.5 + 0.25 * (2.0 - 0.5) = 0.875 (hold)
    assert chunker.size == size
    assert chunker.wait_ratio == pytest.approx(0.875)
    for _ in range(3):
        chunker.observe(exposed_wait())
    assert chunker.size < size


def test_no_observation_advances_and_none_keeps() -> None:
    chunker = PrefillChunker()
    assert chunker.observe(None) == 128  # a plain v11 chain: nothing known
    assert chunker.observe(PrefillObservation(stages=2, compute_us=5_000, edges=0)) == 192  # one chunk
    assert chunker.stages == 2


def test_seed_carries_over_requests() -> None:
    chunker = PrefillChunker(ChunkingConfig(start=64, step=64, maximum=512))
    chunker.observe(hidden(stages=2))
    chunker.observe(hidden(stages=2))
    assert chunker.size == 192
    assert chunker.plan(4096) == 192  # the next request starts where the last one left the ramp


def test_observation_from_a_final_reply() -> None:
    timings = TimingsFrame((
        TimingRecord(1, 8, 16, compute_us=4_000),
        TimingRecord(0, 0, 8, compute_us=3_000, forward_write_us=100, downstream_wait_us=4_500),
    ))
    stats = ReplyStats().observe_prefill_edge_transport(0, 300, 900, 1 << 20).observe_prefill_edge_transport(
        0, 200, 1_200, 1 << 20)
    observation = observation_from(128, 64, timings, stats)
    assert observation == PrefillObservation(stages=2, compute_us=6_000, write_us=300, wait_us=1_200, edges=2)


def test_observation_without_edges_uses_the_slowest_stage() -> None:
    timings = TimingsFrame((TimingRecord(1, 8, 16, compute_us=4_000), TimingRecord(0, 0, 8, compute_us=3_000)))
    observation = observation_from(32, 32, timings, ReplyStats())
    assert observation == PrefillObservation(stages=2, compute_us=4_000)


def test_observation_needs_timings() -> None:
    assert observation_from(128, 10, None, ReplyStats()) is None
    assert observation_from(128, 10, TimingsFrame(()), ReplyStats()) is None


async def test_the_generator_plans_and_learns_over_a_chain(tiny_llama: Path) -> None:
    """Through a 2-stage chain (in-process servers, tiny llama): the first request uses the
    ramp's size, learns the stage count and boundary figures, and the next request is cut for
    the pipeline; both give the unsplit model's tokens with the same chunking."""
    prompt = tuple(range(100, 260))  # 160 tokens
    generator = Generator.from_model(tiny_llama, n_ctx=512)
    assert generator.chunking is not None and generator.chunk_size is None
    chunker = generator.chunking = PrefillChunker(ChunkingConfig(start=32, step=16, minimum=8, maximum=64,
                                                                 short_prompt=16))
    try:
        async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama)) as servers:
            async with await StageClient.connect(servers[0].address) as client:
                request = GenerationRequest(prompt, 4, speculation=False, prefix_cache=False)
                first = await generator.generate(client, request, 1)
                assert chunker.stages == 2 and chunker.wait_ratio is not None and chunker.write_ratio is not None
                assert chunker.size in (16, 32, 48)  # moved (or held) by what the chain measured
                planned = chunker.plan(len(prompt))
                assert planned == min(chunker.size, 40)  # ceil(160 / (2 chunks x 2 stages))
                second = await generator.generate(client, request, 2)
    finally:
        generator.close()
    assert first.tokens == reference_greedy(tiny_llama, list(prompt), 4, chunk_size=32)[: len(first.tokens)]
    assert second.tokens == reference_greedy(tiny_llama, list(prompt), 4, chunk_size=planned)[: len(second.tokens)]
