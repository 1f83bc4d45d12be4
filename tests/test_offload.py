"""Stage GPU settings (skippy/runtime/offload.py): checks, resolution against a host's devices, the stage
command line, and what each setting does to exactness on the CPU.

Resolution is tested against device lists (a CPU-only host as this one is, and one with two GPUs);
the real runs use this host's CPU backend: KV cache types and flash attention change the logits
(not bitwise equal to the defaults), while a split still equals the unsplit model with the same
settings on every stage.  GPU runs are in tests/test_gpu.py (``pytest -m gpu``).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from skippy.runtime.offload import CPU_ONLY, Device, OffloadSettings, devices
from skippy.stage.__main__ import main as stage_main
from skippy.stage.config import parse_config

CPU = Device(0, "CPU", "AMD EPYC", "cpu", 0, 0)
GPUS = [CPU, Device(1, "CUDA0", "NVIDIA H100", "gpu", 70 << 30, 80 << 30),
        Device(2, "CUDA1", "NVIDIA H100", "gpu", 70 << 30, 80 << 30)]


@pytest.mark.parametrize("settings, message", [
    (OffloadSettings(cache_type_k="q3"), "cache_type_k must be one of f32, f16, q8_0, q4_0 (got 'q3')"),
    (OffloadSettings(flash_attn="maybe"), "flash_attn must be one of off, on, auto"),
    (OffloadSettings(split_mode="tensor"), "split_mode must be one of none, layer, row"),
    (OffloadSettings(n_gpu_layers=-2), "n_gpu_layers must be >= 0"),
    (OffloadSettings(main_gpu=-1), "main_gpu must be >= 0"),
    (OffloadSettings(cache_type_v="q4_0"), "cache_type_v q4_0 needs flash attention"),
])
def test_bad_values_name_the_setting(settings: OffloadSettings, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings.check()


def test_a_cpu_host_runs_everything_on_the_cpu_by_default() -> None:
    resolved = OffloadSettings(flash_attn="on", cache_type_k="q8_0", cache_type_v="q8_0").resolve([CPU], 0, 4, 8)
    assert (resolved.n_gpu_layers, resolved.gpu_layers, resolved.device_indices) == (0, 0, ())
    assert (resolved.flash_attn, resolved.cache_type_k, resolved.cache_type_v) == ("on", "q8_0", "q8_0")
    assert OffloadSettings(n_gpu_layers=0).resolve([CPU], 0, 4, 8) == CPU_ONLY


@pytest.mark.parametrize("settings, message", [
    (OffloadSettings(devices=("CUDA0",)), "device 'CUDA0' does not exist; this build and host have: CPU (AMD EPYC)"),
    (OffloadSettings(n_gpu_layers=4), "--n-gpu-layers 4 needs a GPU, but this build and host have no GPU device"),
    (OffloadSettings(main_gpu=1), "--main-gpu 1 needs a GPU"),
    (OffloadSettings(split_mode="row"), "--split-mode row needs a GPU"),
    (OffloadSettings(devices=("CPU",), n_gpu_layers=2), "--n-gpu-layers 2 needs a GPU, but --device none was given"),
])
def test_gpu_only_settings_are_refused_on_a_cpu_host(settings: OffloadSettings, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings.resolve([CPU], 0, 4, 8)


@pytest.mark.parametrize("given, layers, expected, on_gpu", [
    (None, (0, 4), -1, 4),     # default: every layer of the stage (and the head, on a final stage)
    (4, (4, 8), -1, 4),
    (9, (0, 4), -1, 4),        # more than the stage has: all of them
    (0, (0, 4), 0, 0),
    (1, (0, 4), 6, 1),         # layer 3 only: 8 + 1 - 6 = 3
    (2, (4, 8), 3, 2),         # layers 6, 7 (the head, index 8, stays on the CPU)
])
def test_gpu_layers_are_the_stages_last(given: int | None, layers: tuple[int, int], expected: int,
                                         on_gpu: int) -> None:
    resolved = OffloadSettings(n_gpu_layers=given).resolve(GPUS, *layers, 8)
    assert (resolved.n_gpu_layers, resolved.gpu_layers) == (expected, on_gpu)
    # llama.cpp's rule: layer i (the head is i = n_layer) is offloaded when i >= n_layer + 1 - n_gpu_layers
    if expected > 0:
        assert [i for i in range(*layers) if i >= 8 + 1 - expected] == list(range(layers[1] - on_gpu, layers[1]))


def test_named_devices_and_main_gpu() -> None:
    resolved = OffloadSettings(devices=("cuda1",), split_mode="none").resolve(GPUS, 0, 4, 8)
    assert (resolved.device_indices, resolved.main_gpu, resolved.split_mode) == ((2,), 0, "none")
    assert OffloadSettings().resolve(GPUS, 0, 4, 8).device_indices == ()  # llama.cpp's default: every GPU
    assert OffloadSettings(devices=("none",)).resolve(GPUS, 0, 4, 8).n_gpu_layers == 0
    with pytest.raises(ValueError, match=r"--main-gpu 1 is out of range: the stage uses 1 GPU\(s\) \(CUDA1\)"):
        OffloadSettings(devices=("CUDA1",), main_gpu=1).resolve(GPUS, 0, 4, 8)
    with pytest.raises(ValueError, match="device 'CPU' is not a GPU"):
        OffloadSettings(devices=("CUDA0", "CPU")).resolve(GPUS, 0, 4, 8)
    with pytest.raises(ValueError, match="device 'CUDA7' does not exist; this build and host have: CPU"):
        OffloadSettings(devices=("CUDA7",)).resolve(GPUS, 0, 4, 8)


def test_this_hosts_devices() -> None:
    found = devices()
    assert found[0].kind == "cpu" and found[0].name == "CPU"


def test_stage_flags() -> None:
    config = parse_config(["--model", "m.gguf", "--layers", "0:4", "--n-gpu-layers", "3", "--device", "CUDA0,CUDA1",
                           "--main-gpu", "1", "--split-mode", "row", "--flash-attn", "ON", "--cache-type-k", "q8_0",
                           "--cache-type-v", "q4_0"])
    assert config.offload == OffloadSettings(3, ("CUDA0", "CUDA1"), 1, "row", "on", "q8_0", "q4_0")
    assert parse_config(["--model", "m.gguf", "--layers", "0:4", "--n-gpu-layers", "all"]).offload == OffloadSettings()


@pytest.mark.parametrize("argv, message", [
    (["--cache-type-k", "q3"], "cache_type_k 'q3' is not one of f32, f16, q8_0, q4_0"),
    (["--flash-attn", "yes"], "flash_attn 'yes' is not one of off, on, auto"),
    (["--cache-type-v", "q8_0"], "cache_type_v q8_0 needs flash attention"),
    (["--n-gpu-layers", "-1"], "n_gpu_layers must be >= 0"),
])
def test_bad_stage_flags_are_clear_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m skippy.stage``'s main in this process (the flags end it before anything loads;
    test_a_stage_on_this_host_refuses_a_device_it_lacks runs the process)."""
    with pytest.raises(SystemExit) as ended:
        stage_main(["--model", "m.gguf", "--layers", "0:4", *argv])
    stderr = capsys.readouterr().err
    assert ended.value.code == 2 and message in stderr, stderr


def test_help_lists_the_gpu_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        stage_main(["--help"])
    assert ended.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--n-gpu-layers", "--device", "--main-gpu", "--split-mode", "--flash-attn", "--cache-type-k",
                 "--cache-type-v"):
        assert flag in text


def test_a_stage_on_this_host_refuses_a_device_it_lacks(tiny_llama: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "skippy.stage", "--model", str(tiny_llama), "--layers", "0:2",
                             "--downstream", "127.0.0.1:1", "--device", "CUDA0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "device 'CUDA0' does not exist; this build and host have: CPU" in result.stderr


PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 29973, 306, 626]


def _logits(path: Path, split: list[tuple[int, int]], settings: OffloadSettings | None) -> np.ndarray:
    from skippy.runtime.local import LocalChain

    # one thread: ggml's workers spin-wait for each other, and on a busy 2-core host a 2-thread run of
    # this tiny model (flash attention most) costs many times the CPU (every run here has the same count)
    with LocalChain(path, split, n_ctx=64, max_sessions=1, n_batch=16, threads=1, offload=settings) as chain:
        chain.decode(PROMPT[:8], list(range(8)), [0] * 8, [True] * 8)  # a multi-row batch,
        chain.decode(PROMPT[8:], list(range(8, len(PROMPT))), [0] * 3, [True] * 3)  # then more on the cache
        return np.stack(chain.logits())


@functools.cache
def _default_logits(path: Path) -> np.ndarray:
    """The unsplit logits with the default settings (every setting below is compared with them)."""
    return _logits(path, [(0, 4)], None)


@pytest.mark.parametrize("settings", [
    OffloadSettings(cache_type_k="q8_0"),
    OffloadSettings(cache_type_k="q4_0"),
    OffloadSettings(flash_attn="on"),
    OffloadSettings(flash_attn="on", cache_type_k="q8_0", cache_type_v="q8_0"),
], ids=["k-q8_0", "k-q4_0", "flash-attn", "flash-attn-kv-q8_0"])
def test_split_equals_unsplit_with_the_same_settings(settings: OffloadSettings) -> None:
    from skippy.models.cache import ensure_model
    from skippy.models.spec import tiny

    path = ensure_model(tiny("llama", n_embd=128))  # head size 32: quantized caches need a multiple of 32
    default = _default_logits(path)
    unsplit = _logits(path, [(0, 4)], settings)
    split = _logits(path, [(0, 2), (2, 4)], settings)
    assert np.array_equal(split, unsplit)
    assert not np.array_equal(unsplit, default), "the setting did not change the computation"
    # random weights amplify any rounding, so only the direction is checked against the defaults
    assert np.corrcoef(unsplit.ravel(), default.ravel())[0, 1] > 0.5


def test_skippy_up_checks_the_gpu_settings_before_starting_stages(tiny_llama: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "skippy", "up", "--model", str(tiny_llama), "--port", "0",
                             "--cache-type-k", "q3"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "cache_type_k 'q3' is not one of f32, f16, q8_0, q4_0" in result.stderr
    assert "stage" not in result.stderr.split("error:")[0]  # nothing was started


def test_skippy_up_passes_the_gpu_settings_to_every_stage() -> None:
    import argparse

    from skippy.commands.up import add_chain_arguments, gpu_options

    parser = argparse.ArgumentParser()
    add_chain_arguments(parser)
    args = parser.parse_args(["--flash-attn", "on", "--cache-type-v", "q8_0", "--device", "CUDA0"])
    assert gpu_options(args) == ["--device", "CUDA0", "--flash-attn", "on", "--cache-type-v", "q8_0"]
