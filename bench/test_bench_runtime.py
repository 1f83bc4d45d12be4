"""pytest-benchmark: one decode step through the unsplit model vs 2 and 4 in-process stages.

Run: pytest bench/test_bench_runtime.py --benchmark-only (group "decode-step"; compare the
means).  bench/split_decode.py prints the same comparison as ratios from interleaved rounds.
Under ``--benchmark-disable`` (CI's single pass) the tiny qwen3 stands in for qwen3-0.6b.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from skippy.models.cache import ensure_model
from skippy.models.spec import preset, tiny
from skippy.runtime import read_gguf_info
from skippy.runtime.local import LocalChain, even_split

PROMPT = list(range(100, 164))


@pytest.fixture(scope="module")
def model_path(benchmarks_disabled: bool) -> object:
    if benchmarks_disabled:  # CI's single pass checks the path works: the tiny model is enough
        return ensure_model(tiny("qwen3"))
    return ensure_model(preset("qwen3-0.6b", dtype="F16"))


@pytest.fixture(params=[1, 2, 4], ids=["unsplit", "2-stages", "4-stages"])
def chain(request: pytest.FixtureRequest, model_path: object) -> Iterator[LocalChain]:
    n_layer = read_gguf_info(model_path).n_layer  # type: ignore[arg-type]
    with LocalChain(model_path, even_split(n_layer, request.param), n_ctx=4096, max_sessions=1,  # type: ignore[arg-type]
                    n_batch=64) as chain:
        chain.prefill(PROMPT)
        yield chain


@pytest.mark.benchmark(group="decode-step")
def test_decode_step(benchmark: object, chain: LocalChain) -> None:
    state = {"position": len(PROMPT)}

    def step() -> None:
        chain.decode([42], [state["position"]], [0])
        state["position"] += 1

    benchmark.pedantic(step, rounds=64, warmup_rounds=4, iterations=1)  # type: ignore[attr-defined]
