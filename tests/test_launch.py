"""``skippy up`` with real processes: nothing is left behind after Ctrl-C, SIGTERM or a child crash.

Each test starts ``python -m skippy up`` on the tiny 4-layer llama (no chat template: the fallback
one is used) and reads the stage pids it announces.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from skippy.commands.up import ProgressBar
from skippy.deploy.launch import stage_command
from skippy.net.address import Address

from api_helpers import UpProcess, pid_alive

pytestmark = pytest.mark.slow


@pytest.fixture()
def up(tiny_llama: Path, tmp_path: Path) -> Iterator[UpProcess]:
    process = UpProcess(["up", "--model", str(tiny_llama), "--layers", "0:1,1:3,3:4", "--port", "0",
                         "--ctx-size", "256", "--threads", "1", "--log-dir", str(tmp_path / "logs")], tmp_path)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if pid_alive(pid)]


def serves(up: UpProcess) -> None:
    model = httpx.get(up.url + "/v1/models").json()["data"][0]["id"]
    response = httpx.post(up.url + "/v1/chat/completions", timeout=30,
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_every_process(up: UpProcess, number: int) -> None:
    assert len(up.stage_pids) == 3 and all(pid_alive(pid) for pid in up.stage_pids)
    serves(up)
    assert up.signal(number) == 0
    assert wait_gone(up.stage_pids) == []
    assert "stopped every stage" in up.stderr()


def test_stages_outlive_trios_idle_worker_threads(up: UpProcess) -> None:
    # trio spawns children from worker threads that exit after ~10 s idle; a parent-death signal
    # tied to that thread once killed healthy stages at that point.
    time.sleep(12)
    assert all(pid_alive(pid) for pid in up.stage_pids)
    serves(up)


def test_a_killed_launcher_leaves_no_stage_behind(up: UpProcess) -> None:
    # SIGKILL runs no handler: the stages notice the launcher's end of their stdin pipe closing.
    assert up.process is not None and all(pid_alive(pid) for pid in up.stage_pids)
    up.process.kill()
    up.process.wait(10)
    assert wait_gone(up.stage_pids, timeout=10) == []


def test_a_stage_exits_cleanly_when_its_stdin_closes(tmp_path: Path) -> None:
    log = tmp_path / "stage.log"
    with log.open("wb") as stream:
        process = subprocess.Popen(
            [sys.executable, "-m", "skippy.stage", "--model", "null:n_embd=8,n_layer=2", "--layers", "0:2",
             "--exit-on-stdin-eof", "on"], stdin=subprocess.PIPE, stderr=stream, stdout=stream)
    try:
        deadline = time.monotonic() + 30
        while "ready on" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(0.3)
        assert process.poll() is None, "the stage must keep serving while its stdin is open"
        assert process.stdin is not None
        process.stdin.close()
        assert process.wait(10) == 0
        text = log.read_text()
        assert "standard input closed (the launcher is gone): draining" in text and "stopped" in text
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_crashing_stage_stops_the_rest_with_its_error(tiny_llama: Path, tmp_path: Path) -> None:
    up = UpProcess(["up", "--model", str(tiny_llama), "--layers", "0:1,1:3,3:4", "--port", "0", "--ctx-size", "256",
                    "--threads", "1", "--restarts", "0", "--log-dir", str(tmp_path / "logs")], tmp_path).start()
    try:  # --restarts 0: a lost stage is not replaced (tests/test_replacement.py: it is by default)
        victim = up.stage_pids[1]  # announced final-first: this is stage 1 (layers 1:3)
        os.kill(victim, signal.SIGKILL)
        assert up.process is not None
        assert up.process.wait(30) == 1
        assert wait_gone(up.stage_pids) == []
        err = up.stderr()
        assert "error: stage 1 (layers 1:3) exited with status -9" in err
        assert "its last log lines" in err
    finally:
        up.stop()


def test_a_model_that_is_not_gguf_is_reported(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    process = UpProcess(["up", "--model", str(broken), "--port", "0"], tmp_path)
    with pytest.raises(RuntimeError, match="exited with 2"):
        process.start()
    assert "error:" in process.stderr() and "Traceback" not in process.stderr()


def test_a_stage_that_cannot_start_is_reported(tiny_llama: Path, tmp_path: Path) -> None:
    process = UpProcess(["up", "--model", str(tiny_llama), "--port", "0", "--ctx-size", "0",
                         "--log-dir", str(tmp_path / "logs")], tmp_path)
    with pytest.raises(RuntimeError, match="exited with 1"):
        process.start()
    err = process.stderr()
    # both stages refuse the setting: whichever exits first is the one reported
    assert re.search(r"error: stage \d \(layers \d+:\d+\) exited with status 2", err), err
    assert "ctx_size must be > 0" in err


def test_stage_command_and_progress_bar(tmp_path: Path) -> None:
    command = stage_command(Path("m.gguf"), "2:4", downstream=Address("127.0.0.1", 9), host="127.0.0.1",
                            options=["--threads", "1"])
    assert command[-2:] == ["--downstream", "127.0.0.1:9"] and "--layers" in command
    assert command[command.index("--exit-on-stdin-eof") + 1] == "on"  # see test_a_killed_launcher...
    with (tmp_path / "bar").open("w") as stream:
        bar = ProgressBar(stream, 2)
        bar.update(0, 2, 0.5)
        bar.line("stage 0 ready")
    assert (tmp_path / "bar").read_text() == "stage 0 ready\n"
