"""GPU runs of a CUDA build (``pytest -m gpu``): exactness, a stage chain, device memory, decode speed.

Every test needs a GPU device in ggml's registry (a CUDA build on a host with a GPU and its driver);
without one each is skipped with the devices this build and host do have.  On the GPU:

- split = unsplit: every layer on the GPU in both, f32 activations between stages, bitwise equal
  logits over a multi-row prefill and single-row decodes (a generated model of each of two
  architectures, and the real Gemma 3 when the real-model extra is installed);
- a two-stage chain of stage processes (``--n-gpu-layers`` default: all on the GPU) generates the
  unsplit model's greedy tokens;
- memory per stage: a stage holding half the layers takes device memory for its half and not the
  whole model;
- a decode benchmark: tokens/s of the unsplit model and of two in-process stages (prints the
  figures; ``SKIPPY_GPU_REPORT=path`` also writes them as JSON).

``scripts/check_cuda_wheel.sh`` runs these on a GPU host from the CUDA wheel.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from skippy.runtime.offload import Device, OffloadSettings, devices

pytestmark = pytest.mark.gpu


def _gpus() -> list[Device]:
    return [device for device in devices() if device.is_gpu]


@pytest.fixture(scope="module", autouse=True)
def gpu() -> Device:
    found = _gpus()
    if not found:
        have = ", ".join(device.describe() for device in devices())
        pytest.skip(f"no GPU device in this build and host (devices: {have}); run on a GPU host with the CUDA "
                    "wheel (scripts/check_cuda_wheel.sh)")
    return found[0]


ON_GPU = OffloadSettings()  # every layer of every stage on the GPU (the default with a GPU present)
PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354, 1701, 29916, 432, 17204]


MODELS = ("tiny-llama", "tiny-qwen3", "real-gemma3")


def _model(name: str) -> Path:
    """A generated model (head size 32: quantized caches and the GPU kernels' tiles fit), or the real Gemma 3."""
    from skippy.models.cache import ensure_model
    from skippy.models.spec import tiny

    if name == "tiny-llama":
        return ensure_model(tiny("llama", n_embd=128))
    if name == "tiny-qwen3":
        return ensure_model(tiny("qwen3"))
    try:
        from skippy.models.real import ensure_real_model

        return ensure_real_model()
    except Exception as exc:  # noqa: BLE001 - the real-model extra is optional
        pytest.skip(f"the real Gemma 3 model is not available: {exc}")


def _largest() -> Path:
    try:
        return _model("real-gemma3")
    except pytest.skip.Exception:
        return _model("tiny-llama")


def _run(path: Path, split: Sequence[tuple[int, int]], steps: int = 8) -> tuple[np.ndarray, list[int]]:
    from skippy.runtime.local import LocalChain

    with LocalChain(path, split, n_ctx=256, max_sessions=1, n_batch=32, offload=ON_GPU) as chain:
        chain.decode(PROMPT, list(range(len(PROMPT))), [0] * len(PROMPT), [True] * len(PROMPT))
        rows = list(chain.logits())
        tokens = []
        for step in range(steps):
            token = int(np.argmax(rows[-1]))
            tokens.append(token)
            chain.decode([token], [len(PROMPT) + step], [0], [True])
            rows += chain.logits()
        return np.stack(rows), tokens


@pytest.mark.parametrize("name", MODELS)
def test_split_equals_unsplit_on_the_gpu(name: str) -> None:
    from skippy.runtime import read_gguf_info

    path = _model(name)
    n_layer = read_gguf_info(path).n_layer
    unsplit, _ = _run(path, [(0, n_layer)])
    split, _ = _run(path, [(0, n_layer // 2), (n_layer // 2, n_layer)])
    assert np.array_equal(split, unsplit)


async def test_a_two_stage_chain_generates_the_unsplit_tokens(tmp_path: Path) -> None:
    from skippy.driver import StageClient
    from skippy.models.cache import ensure_model
    from skippy.models.spec import tiny

    from stage_helpers import stage_chain

    path = ensure_model(tiny("llama", n_embd=128))
    _, expected = _run(path, [(0, 4)], steps=24)
    async with stage_chain(str(path), ["0:2", "2:4"], tmp_path, ["--batch-size", "32", "--ctx-size", "256"]) as chain:
        logs = [stage.log_path.read_text() for stage in chain]
        assert all(re.search(r"compute: [1-9][0-9]* layers on GPU", log) for log in logs), logs
        async with await StageClient.connect(chain[0].address) as client:  # type: ignore[arg-type]
            tokens = await client.generate_greedy(1, PROMPT, 24, chunk_size=len(PROMPT), credit=2)
    assert tokens == expected


def test_a_stage_holds_its_layers_on_the_device(gpu: Device) -> None:
    from skippy.runtime import LayerRange, Model, read_gguf_info

    path = _largest()
    n_layer = read_gguf_info(path).n_layer
    used = {}
    for layers in ((0, n_layer), (0, n_layer // 2)):
        before = next(d for d in devices() if d.name == gpu.name).memory_free
        resolved = ON_GPU.resolve(devices(), layers[0], layers[1], n_layer)
        with Model(path, LayerRange(*layers), offload=resolved):
            after = next(d for d in devices() if d.name == gpu.name).memory_free
        used[layers] = before - after
    whole, half = used[(0, n_layer)], used[(0, n_layer // 2)]
    print(f"device memory: whole model {whole / 2**20:.1f} MiB, first half {half / 2**20:.1f} MiB")
    assert 0 < half < whole


def test_decode_benchmark() -> None:
    from skippy.runtime.local import LocalChain
    from skippy.runtime import read_gguf_info

    path = _largest()
    n_layer = read_gguf_info(path).n_layer
    figures = {}
    for name, split in (("unsplit", [(0, n_layer)]), ("2 stages", [(0, n_layer // 2), (n_layer // 2, n_layer)])):
        with LocalChain(path, split, n_ctx=512, max_sessions=1, n_batch=128, offload=ON_GPU) as chain:
            prompt = (PROMPT * 8)[:128]
            started = time.perf_counter()
            chain.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * 127 + [True])
            prefill = time.perf_counter() - started
            token, steps = int(np.argmax(chain.logits()[-1])), 64
            started = time.perf_counter()
            for step in range(steps):
                chain.decode([token], [len(prompt) + step], [0], [True])
                token = int(np.argmax(chain.logits()[-1]))
            decode = time.perf_counter() - started
        figures[name] = {"prefill_tok_s": round(len(prompt) / prefill, 1), "decode_tok_s": round(steps / decode, 1)}
    print(f"{path.name} on {_gpus()[0].describe()}: {json.dumps(figures)}")
    report = os.environ.get("SKIPPY_GPU_REPORT")
    if report:
        Path(report).write_text(json.dumps({"model": path.name, "device": _gpus()[0].describe(), **figures}, indent=2))
    assert all(value["decode_tok_s"] > 0 for value in figures.values())
