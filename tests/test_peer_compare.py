"""bench/peer_compare.py: the RPC layer split it derives and checks, and a smoke run of the benchmark.

Strategy: the layout helpers are pure (tested always).  The smoke run needs the stock peer
(``bench/peer_build.py``, minutes to build): it is skipped unless both binaries already exist, and
this test never builds them.  It runs ``--quick`` on the tiny generated llama (4 layers), so every
variant (stock, RPC 2/4, skippy 1/2/4) starts, is measured once and is reported.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import peer_compare  # noqa: E402
from peer_build import peer_build_dir  # noqa: E402


def test_even_layout() -> None:
    assert peer_compare.even_layout(16, 1) == ["0:16"]
    assert peer_compare.even_layout(16, 2) == ["0:8", "8:16"]
    assert peer_compare.even_layout(16, 4) == ["0:4", "4:8", "8:12", "12:16"]
    assert peer_compare.even_layout(4, 4) == ["0:1", "1:2", "2:3", "3:4"]
    with pytest.raises(ValueError):
        peer_compare.even_layout(2, 4)


def test_tensor_split_gives_the_last_server_the_output_layer() -> None:
    assert peer_compare.tensor_split(["0:8", "8:16"], 16) == "8/9"
    assert peer_compare.tensor_split(["0:4", "4:8", "8:12", "12:16"], 16) == "4/4/4/5"
    assert peer_compare.tensor_split(["0:16"], 16) == "17"
    with pytest.raises(ValueError):
        peer_compare.tensor_split(["0:8", "9:16"], 16)
    with pytest.raises(ValueError):
        peer_compare.tensor_split(["0:8"], 16)


def test_layers_by_device_reads_the_first_load_only() -> None:
    log = "".join(f"load_tensors: layer {i:3d} assigned to device RPC{0 if i < 2 else 1}, is_swa = 0\n"
                  for i in range(5))
    log += "llama_kv_cache: layer   0: dev = RPC0\n"
    log += "load_tensors: layer   0 assigned to device RPC1, is_swa = 0\n"  # a later load: ignored
    assert peer_compare.layers_by_device(log) == {"RPC0": [0, 1], "RPC1": [2, 3, 4]}


def test_cpu_list_reads_taskset_lists() -> None:
    assert peer_compare.cpu_list("1") == {1}
    assert peer_compare.cpu_list("0,1") == {0, 1}
    assert peer_compare.cpu_list("0-2,5") == {0, 1, 2, 5}
    for bad in ("", "a", "1-", "3-1", "1,,2", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            peer_compare.cpu_list(bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_check_affinity_names_a_thread_on_other_cpus() -> None:
    first, second = sorted(os.sched_getaffinity(0))[:2]
    process = subprocess.Popen(["sleep", "30"])
    try:
        os.sched_setaffinity(process.pid, {first})
        peer_compare.check_affinity([process.pid], {first})
        with pytest.raises(RuntimeError, match=f"process {process.pid} runs on \\[{first}\\]"):
            peer_compare.check_affinity([process.pid], {first, second})
    finally:
        process.kill()
        process.wait()


_PEER = peer_build_dir() / "bin"


@pytest.mark.slow
@pytest.mark.skipif(not ((_PEER / "llama-bench").exists() and (_PEER / "ggml-rpc-server").exists()),
                    reason="stock peer not built (run bench/peer_build.py; tests do not build it)")
def test_quick_run_reports_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    assert peer_compare.main(["--quick", "--no-build", "--preset", "tiny-llama"]) == 0
    out = capsys.readouterr().out
    assert "RPC 2: -ts 2/3 -> RPC0 0:2, RPC1 2:4 + output" in out
    assert "RPC 4: -ts 1/1/1/2 -> RPC0 0:1, RPC1 1:2, RPC2 2:3, RPC3 3:4 + output" in out
    for name in ("stock", "RPC 2", "RPC 4", "in-process", "skippy 1", "skippy 2", "skippy 4"):
        assert f"  {name} " in out
    assert out.count("per-boundary cost") == 2  # decode and prefill
    assert "skippy 4 vs skippy 2" in out and "RPC 4 vs RPC 2" in out


@pytest.mark.slow
@pytest.mark.skipif(not ((_PEER / "llama-bench").exists() and (_PEER / "ggml-rpc-server").exists()),
                    reason="stock peer not built (run bench/peer_build.py; tests do not build it)")
def test_quick_run_on_one_cpu_pins_every_variant_and_gives_the_cpus_back(capsys: pytest.CaptureFixture[str]) -> None:
    before = os.sched_getaffinity(0)
    cpu = min(before)
    assert peer_compare.main(["--quick", "--no-build", "--preset", "tiny-llama", "--no-prefill", "--cpus", str(cpu),
                              "--sched"]) == 0
    assert os.sched_getaffinity(0) == before
    out = capsys.readouterr().out
    assert f"CPUs {cpu} (--cpus)" in out  # (check_affinity raised had a stage or server run elsewhere)
    for name in ("stock", "RPC 2", "RPC 4", "skippy 1", "skippy 2", "skippy 4"):
        assert f"  {name} " in out
    sched = out.split("where skippy's decode time went", 1)[1].splitlines()[1:4]
    for count, line in zip((1, 2, 4), sched):  # the client, then each stage with its runtime-thread share
        assert line.split()[:2] == ["skippy", str(count)] and line.count("[") == count


def test_sched_splits_wall_into_run_and_gap() -> None:
    me = os.getpid()
    before = {(me, me): (1_000_000, 0), (7, 7): (0, 0), (7, 8): (0, 500_000)}
    after = {(me, me): (3_000_000, 0), (7, 7): (1_000_000, 0), (7, 8): (5_000_000, 2_500_000), (7, 9): (1_000_000, 0)}
    sched = peer_compare._sched(before, after, [me, 7], wall=0.010, steps=2)
    assert sched.client == 1.0 and sched.stages == (3.5,) and sched.compute == (3.0,)  # ms per token
    assert sched.wait == 1.0 and sched.run == 4.5 and sched.wall == 5.0 and sched.gap == 0.5
