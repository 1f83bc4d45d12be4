"""Many users as a benchmark group: seconds for N concurrent greedy completions through the API.

Run: ``.venv/bin/python -m pytest bench/test_bench_concurrency.py --benchmark-only
--benchmark-group-by=group`` (the gate: ``make bench-save`` / ``make bench-compare``; CI runs it
once with ``--benchmark-disable``, on the tiny llama).

Strategy: ``skippy up`` as ``bench/concurrency.py`` starts it (the layers cut by cost), one
thread per stage, 2 stages, and a round of ``CLIENTS`` clients each sending one ``/v1/completions``
request of ``TOKENS`` new tokens (greedy, ``ignore_eos``) at once; the benchmark's time is the
round's wall time, ``extra_info["tokens_per_second"]`` the aggregate rate.  Group
``concurrency-4``: the 2-stage chain with speculation at its default and off (the load-aware
controller should keep the two close) and, where ``bench/peer_build.py --server`` has built it,
stock ``llama-server -t 1`` on the same model (``extra_info["ratio_to_stock_1t"]`` on the skippy
entries once it ran).  The model: the generated 8 x 512 F16 llama of ``test_bench_e2e.py``.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import concurrency  # noqa: E402
from peer_build import SERVER_TARGET, peer_build_dir  # noqa: E402

from skippy.models.cache import ensure_model  # noqa: E402
from skippy.models.spec import preset, tiny  # noqa: E402

CLIENTS = 4
TOKENS = 32
#: Medians of this run, by benchmark name (for the ratio in later entries' extra_info).
MEDIANS: dict[str, float] = {}


@pytest.fixture(scope="module")
def model(benchmarks_disabled: bool) -> Path:
    if benchmarks_disabled:
        return ensure_model(tiny("llama"))
    return ensure_model(dataclasses.replace(preset("llama-16x1024"), n_layer=8, n_embd=512, n_ff=2048, n_head=8,
                                            n_head_kv=2, name="skippy-llama-8x512"))


@pytest.fixture(scope="module")
def chain(model: Path) -> Iterator[concurrency.Running]:
    running = concurrency.start_skippy(model, 2, 1, CLIENTS, Path(tempfile.mkdtemp(prefix="skippy-bench-conc-")))
    try:
        yield running
    finally:
        concurrency.stop(running)


def one_round(url: str, model_id: str, extra: dict[str, Any]) -> int:
    """``CLIENTS`` requests at once; the completion tokens they made."""
    def request(index: int) -> int:
        body = {"model": model_id, "prompt": concurrency.PROMPTS[index], "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True, **extra}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(CLIENTS) as pool:
        return sum(pool.map(request, range(CLIENTS)))


def run(benchmark: Any, name: str, url: str, model_id: str, extra: dict[str, Any]) -> None:
    one_round(url, model_id, extra)  # warm-up
    made: list[int] = []
    started: list[float] = []

    def timed() -> None:
        started.append(time.perf_counter())
        made.append(one_round(url, model_id, extra))

    benchmark.pedantic(timed, rounds=3, iterations=1)
    assert made and all(count == CLIENTS * TOKENS for count in made)
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median
        MEDIANS[name] = median
        benchmark.extra_info["tokens_per_second"] = CLIENTS * TOKENS / median
        if "stock-1t" in MEDIANS and name != "stock-1t":
            benchmark.extra_info["ratio_to_stock_1t"] = MEDIANS["stock-1t"] / median


@pytest.mark.benchmark(group=f"concurrency-{CLIENTS}")
def test_stock_llama_server_1t(benchmark: Any, model: Path) -> None:
    binary = peer_build_dir() / "bin" / SERVER_TARGET
    if not binary.exists():
        pytest.skip(f"{binary} not built (bench/peer_build.py --server)")
    directory = Path(tempfile.mkdtemp(prefix="skippy-bench-stock-"))
    running = concurrency.start_stock(binary, model, 1, CLIENTS, directory / "server.log")
    try:
        run(benchmark, "stock-1t", running.url, model.name.removesuffix(".gguf"), {})
    finally:
        concurrency.stop(running)


@pytest.mark.benchmark(group=f"concurrency-{CLIENTS}")
@pytest.mark.parametrize("speculation", ["default", "off"])
def test_skippy_two_stages(benchmark: Any, chain: concurrency.Running, model: Path, speculation: str) -> None:
    extra = {} if speculation == "default" else {"speculation": False}
    run(benchmark, f"skippy-2x1t-{speculation}", chain.url, model.name.removesuffix(".gguf"), extra)
