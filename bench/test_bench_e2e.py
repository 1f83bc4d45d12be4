"""End-to-end ratios as benchmark groups: split vs unsplit decode, the boundary, 512-token prefill.

Run: ``.venv/bin/python -m pytest bench/test_bench_e2e.py --benchmark-only --benchmark-group-by=group``
(the gate: ``make bench-save`` / ``make bench-compare``; CI runs it once with ``--benchmark-disable``).

Strategy: one generated llama (default 8 x 512 F16, 32000-token vocab; ``SKIPPY_BENCH_E2E_MODEL``
names a preset instead, e.g. ``llama-16x1024``), every process at one compute thread, and three
ways to run it, each started once per module (under ``--benchmark-disable``, CI's single pass,
the tiny llama stands in):

* *unsplit*: the whole model in this process (``StageContext``, no wire);
* *1-stage*: one stage process holding every layer, driven over loopback (the driver lane only);
* *2-stage*: two stage processes, half the layers each.

Group ``e2e-decode``: seconds per round of ``DECODE_STEPS`` greedy tokens for each, and for the
2-stage chain once more with direct return (the API's default there: the first stage relays the
decode outside Python, :mod:`skippy.stage.decode_relay`).  The ratios
are in each 2-stage / 1-stage entry's ``extra_info``: ``percent_of_unsplit`` (decode tokens/s
against the unsplit run) and, on the 2-stage entry, ``boundary_us_per_token`` (2-stage minus
1-stage, per token: the cost of one stage boundary).  A regression of either shows as the
2-stage median moving while the unsplit one stays, which the gate's per-benchmark median
comparison catches.

Group ``e2e-prefill-512``: seconds to the first token of a 512-token prompt: unsplit (one
batch), and the 2-stage chain with one 512-token chunk, fixed 128-token chunks and the driver's
adaptive chunking (:mod:`skippy.driver.prefill_chunking`, through :class:`Generator`, seeded by the
warm-up); ``extra_info["speedup_vs_unsplit"]`` is unsplit time / this time (target for adaptive:
>= 1.5 at one thread per process, 2 cores).  The prefix cache is off on the stages and in the
requests, so every round computes the whole prompt.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_chain import FINALS, chain  # noqa: E402

from skippy.driver import StageClient  # noqa: E402
from skippy.driver.generator import Generator, GenerationRequest  # noqa: E402
from skippy.models.cache import ensure_model  # noqa: E402
from skippy.models.spec import ModelSpec, preset, tiny  # noqa: E402
from skippy.net.address import Address  # noqa: E402

DECODE_STEPS = 32
DECODE_PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599]
PREFILL_TOKENS = 512
#: Medians of this run, by benchmark name, for the ratios in later entries' extra_info.
MEDIANS: dict[str, float] = {}


def bench_spec() -> ModelSpec:
    name = os.environ.get("SKIPPY_BENCH_E2E_MODEL")
    if name:
        return preset(name)
    return dataclasses.replace(preset("llama-16x1024"), n_layer=8, n_embd=512, n_ff=2048, n_head=8, n_head_kv=2,
                               name="skippy-llama-8x512")


@pytest.fixture(scope="module")
def spec(benchmarks_disabled: bool) -> ModelSpec:
    if benchmarks_disabled and not os.environ.get("SKIPPY_BENCH_E2E_MODEL"):
        return tiny("llama")  # CI's single pass checks the paths, not the speed
    return bench_spec()


@pytest.fixture(scope="module")
def model(spec: ModelSpec) -> Path:
    return ensure_model(spec)


def splits(n_layer: int, stages: int) -> list[str]:
    bounds = [n_layer * index // stages for index in range(stages + 1)]
    return [f"{start}:{end}" for start, end in zip(bounds, bounds[1:])]


FLAGS = ["--ctx-size", "1024", "--batch-size", "512", "--prefix-cache", "off"]


@pytest.fixture(scope="module")
def chains(model: Path, spec: ModelSpec) -> Iterator[dict[int, Address]]:
    n_layer = spec.n_layer
    with chain(str(model), splits(n_layer, 1), FLAGS) as one, chain(str(model), splits(n_layer, 2), FLAGS) as two:
        yield {1: one, 2: two}


class Unsplit:
    """The whole model in this process, one thread (the reference every ratio divides by)."""

    def __init__(self, path: Path) -> None:
        from skippy.runtime import Model, StageContext

        self.model = Model(path)
        self.context = StageContext(self.model, n_ctx=1024, max_sessions=1, n_batch=512, threads=1)

    def close(self) -> None:
        self.context.close()
        self.model.close()

    def generate(self, prompt: Sequence[int], steps: int) -> int:
        """Prefill ``prompt`` in one batch, decode ``steps`` greedy tokens; the last token."""
        ctx = self.context
        seq = ctx.open_session()
        try:
            ctx.decode(tokens=list(prompt), positions=list(range(len(prompt))), seq_ids=[seq] * len(prompt))
            token = int(np.argmax(ctx.logits(int(ctx.output_rows[-1]))))
            for position in range(len(prompt), len(prompt) + steps):
                ctx.decode(tokens=[token], positions=[position], seq_ids=[seq])
                token = int(np.argmax(ctx.logits(int(ctx.output_rows[-1]))))
            return token
        finally:
            ctx.close_session(seq)


@pytest.fixture(scope="module")
def unsplit(model: Path) -> Iterator[Unsplit]:
    runner = Unsplit(model)
    yield runner
    runner.close()


async def chain_decode(address: Address, prompt: Sequence[int], steps: int, direct: bool = False) -> float:
    """Seconds for ``steps`` decode steps through a chain, after its prefill (not timed); with
    ``direct``, the predictions come straight from the final stage (docs/protocol.md §8) and the
    stages before it relay the decode outside Python (skippy.stage.decode_relay)."""
    async with await StageClient.connect(address) as client:
        await client.configure(1)
        if direct:
            assert await client.open_direct_return(FINALS[address], 1)
        token = (await client.prefill(1, prompt, chunk_size=64)).token
        started = time.perf_counter()
        for position in range(len(prompt), len(prompt) + steps):
            token = (await client.decode(1, token, position)).predicted
        elapsed = time.perf_counter() - started
        await client.stop(1)
        return elapsed


def record(benchmark: Any, name: str) -> float | None:
    """Keep this entry's median for the ratios of later entries (None: benchmarks disabled)."""
    stats = getattr(benchmark, "stats", None)
    if stats is None:
        return None
    median = float(stats.stats.median)
    MEDIANS[name] = median
    return median


# ------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------


def test_decode_unsplit(benchmark: Any, unsplit: Unsplit) -> None:
    benchmark.group = "e2e-decode"
    unsplit.generate(DECODE_PROMPT, 2)  # warm-up: first-call allocations are not the figure
    benchmark.pedantic(unsplit.generate, (DECODE_PROMPT, DECODE_STEPS), rounds=5, iterations=1)
    median = record(benchmark, "decode-unsplit")
    if median is not None:
        benchmark.extra_info["us_per_token"] = median / DECODE_STEPS * 1e6


@pytest.mark.parametrize(("stages", "direct"), [(1, False), (2, False), (2, True)],
                         ids=["1-stage", "2-stage", "2-stage-direct"])
def test_decode_chain(benchmark: Any, chains: dict[int, Address], stages: int, direct: bool) -> None:
    benchmark.group = "e2e-decode"
    address = chains[stages]
    trio.run(chain_decode, address, DECODE_PROMPT, 2, direct)  # warm-up
    seconds = benchmark.pedantic(lambda: trio.run(chain_decode, address, DECODE_PROMPT, DECODE_STEPS, direct),
                                 rounds=5, iterations=1)
    assert seconds > 0
    median = record(benchmark, f"decode-{stages}-stage{'-direct' if direct else ''}")
    if median is None:
        return
    benchmark.extra_info["us_per_token"] = median / DECODE_STEPS * 1e6
    reference = MEDIANS.get("decode-unsplit")
    if reference:
        benchmark.extra_info["percent_of_unsplit"] = 100 * reference / median
    one = MEDIANS.get("decode-1-stage")
    if stages == 2 and one:
        benchmark.extra_info["boundary_us_per_token"] = (median - one) / DECODE_STEPS * 1e6


# ------------------------------------------------------------------------------------------
# Prefill
# ------------------------------------------------------------------------------------------


PREFILL_PROMPT = tuple(int(token) for token in np.random.default_rng(5).integers(100, 30000, PREFILL_TOKENS))


async def chain_prefill(address: Address, generator: Generator) -> float:
    """Seconds to the first token of the 512-token prompt through ``generator`` (one request)."""
    async with await StageClient.connect(address) as client:
        request = GenerationRequest(PREFILL_PROMPT, max_tokens=1, speculation=False, prefix_cache=False)
        completion = await generator.generate(client, request, 1)
        return completion.timing.time_to_first_token


@pytest.fixture(scope="module")
def generators(model: Path) -> Iterator[dict[str, Generator]]:
    made = {"512-chunk": Generator.from_model(model, n_ctx=1024, chunk_size=512),
            "128-chunk": Generator.from_model(model, n_ctx=1024, chunk_size=128),
            "adaptive": Generator.from_model(model, n_ctx=1024)}
    yield made
    for generator in made.values():
        generator.close()


def test_prefill_unsplit(benchmark: Any, unsplit: Unsplit) -> None:
    benchmark.group = f"e2e-prefill-{PREFILL_TOKENS}"
    unsplit.generate(PREFILL_PROMPT, 0)  # warm-up
    benchmark.pedantic(unsplit.generate, (PREFILL_PROMPT, 0), rounds=3, iterations=1)
    record(benchmark, "prefill-unsplit")


@pytest.mark.parametrize("chunking", ["512-chunk", "128-chunk", "adaptive"])
def test_prefill_2_stage(benchmark: Any, chains: dict[int, Address], generators: dict[str, Generator],
                         chunking: str) -> None:
    benchmark.group = f"e2e-prefill-{PREFILL_TOKENS}"
    generator = generators[chunking]
    trio.run(chain_prefill, chains[2], generator)  # warm-up; seeds the adaptive ramp with the chain
    seconds = benchmark.pedantic(lambda: trio.run(chain_prefill, chains[2], generator), rounds=3, iterations=1)
    assert seconds > 0
    if generator.chunking is not None:
        benchmark.extra_info["chunk_size"] = generator.chunking.plan(PREFILL_TOKENS)
        benchmark.extra_info["ramp_size"] = generator.chunking.size
    median = record(benchmark, f"prefill-2-stage-{chunking}")
    reference = MEDIANS.get("prefill-unsplit")
    if median is not None and reference:
        benchmark.extra_info["speedup_vs_unsplit"] = reference / median


def prefill_speedups(rounds: int) -> dict[str, list[float]]:
    """Interleaved rounds (``python bench/test_bench_e2e.py``): each round times the unsplit
    prefill and each 2-stage variant back to back, so machine noise hits them alike."""
    path = ensure_model(bench_spec())
    made = {f"{size}-chunk": Generator.from_model(path, n_ctx=1024, chunk_size=size) for size in (512, 128, 64)}
    made["adaptive"] = Generator.from_model(path, n_ctx=1024)
    speedups: dict[str, list[float]] = {name: [] for name in made}
    runner = Unsplit(path)
    try:
        with chain(str(path), splits(bench_spec().n_layer, 2), FLAGS) as address:
            runner.generate(PREFILL_PROMPT, 0)
            for generator in made.values():
                trio.run(chain_prefill, address, generator)
            for _ in range(rounds):
                started = time.perf_counter()
                runner.generate(PREFILL_PROMPT, 0)
                reference = time.perf_counter() - started
                for name, generator in made.items():
                    speedups[name].append(reference / trio.run(chain_prefill, address, generator))
        adaptive = made["adaptive"].chunking
        assert adaptive is not None
        print(f"adaptive chunk for {PREFILL_TOKENS} tokens: {adaptive.plan(PREFILL_TOKENS)} "
              f"(ramp size {adaptive.size}, wait/compute {adaptive.wait_ratio}, write/compute {adaptive.write_ratio})")
    finally:
        runner.close()
        for generator in made.values():
            generator.close()
    return speedups


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="2-stage 512-token prefill against unsplit, interleaved rounds")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"model {bench_spec().name} ({bench_spec().n_layer} x {bench_spec().n_embd} {bench_spec().dtype}), "
          f"one thread per process, {PREFILL_TOKENS}-token prompt, {args.rounds} interleaved rounds")
    for name, values in prefill_speedups(args.rounds).items():
        print(f"2-stage {name}: {100 * statistics.median(values):.0f}% of unsplit prefill speed "
              f"(per round {', '.join(f'{100 * v:.0f}' for v in values)})")
