"""An in-flight request survives a lost stage through ``skippy up --ray`` (issue 29, 3 Ray nodes).

One local Ray cluster (``ray.cluster_utils.Cluster``: a head without CPUs and three one-CPU
nodes, so the three stages land on three nodes) serves the tiny llama through ``skippy up --ray
ADDRESS``; the uninterrupted streamed greedy completion is taken once.  Each case SIGKILLs one
stage's process (middle, first, final) after the 20th chunk: the Ray launcher restarts it in its
bundle (a new port: stages listen on port 0), re-wires its upstream (or re-points the API's
lanes at a new first stage), and the driver resumes the session there (docs/protocol.md §14).
The stream completes with 200 and the uninterrupted text, and ``usage.skippy_resume`` names the
lost stage, within a few seconds: a dial of a moved downstream follows the launcher's re-wiring
(before, a lane opened while the stage was being restarted kept retrying the lost address and
the survivors' parked session expired: a full re-prefill after 30 s).  The cases share the
cluster and the chain (each start costs most of a minute).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'skippy-llm[ray]')")

from api_helpers import UpProcess, pid_alive  # noqa: E402

pytestmark = pytest.mark.slow

_STAGE = re.compile(r"stage (\d) \(layers \S+\) pid (\d+) (?:ready|restarted) on (\S+) \(Ray node")


class RayUp:
    """The cluster, ``skippy up --ray`` on it, and the uninterrupted stream's text."""

    def __init__(self, up: UpProcess) -> None:
        self.up = up
        self.whole = ""

    def stages(self) -> dict[int, tuple[int, str]]:
        """index -> (pid, address) as last announced (restarts included)."""
        found: dict[int, tuple[int, str]] = {}
        for match in _STAGE.finditer(self.up.stderr()):
            found[int(match.group(1))] = (int(match.group(2)), match.group(3))
        return found

    def every_pid(self) -> list[int]:
        return [int(match.group(2)) for match in _STAGE.finditer(self.up.stderr())]


@pytest.fixture(scope="module")
def ray_up(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayUp]:
    from ray.cluster_utils import Cluster

    tmp_path = tmp_path_factory.mktemp("ray-up")
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(3):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    except Exception as exc:  # any failure to bring a local cluster up here: skip, saying why
        pytest.skip(f"Ray cannot start a local cluster here: {type(exc).__name__}: {exc}")
    up = UpProcess(["up", "--model", str(tiny_llama), "--layers", "0:1,1:3,3:4", "--ray", cluster.address,
                    "--port", "0", "--ctx-size", "256", "--threads", "1", "--log-dir", str(tmp_path / "logs")],
                   tmp_path)
    chain = RayUp(up)
    try:
        up.start(timeout=240)
        assert up.stderr().count("Ray node") == 3
        text, error, _, usage = stream_completion(up)
        assert not error and text and not usage.get("skippy_resume"), (error, usage)
        chain.whole = text
        yield chain
    finally:
        pids = chain.every_pid()
        try:
            if up.process is not None and up.process.poll() is None:
                assert up.signal(signal.SIGTERM, timeout=60) == 0, up.stderr()
        finally:
            up.stop()
            cluster.shutdown()
            deadline = time.monotonic() + 15
            while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid in pids:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
    assert not [pid for pid in pids if pid_alive(pid)]


def stream_completion(up: UpProcess, kill: int = 0, at: int = 20) -> tuple[str, str, float, dict]:
    """Stream a long greedy completion; with ``kill`` (a pid), SIGKILL it after the ``at``-th chunk.
    Returns the text, the error line (or ""), the seconds from the kill to the next chunk and the
    usage chunk's usage."""
    model = httpx.get(up.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "x", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, text, error, took, usage, killed = 0, [], "", 0.0, {}, 0.0
    with httpx.stream("POST", up.url + "/v1/completions", json=body, timeout=180) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if '"error"' in line:
                error = line
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                text.append(choice.get("text") or "")
            sent += 1
            if kill and sent == at:
                os.kill(kill, signal.SIGKILL)
                killed = time.monotonic()
            elif kill and sent == at + 1:
                took = time.monotonic() - killed
    return "".join(text), error, took, usage


@pytest.mark.timeout(900)
@pytest.mark.parametrize("index", [1, 0, 2], ids=["middle", "first", "final"])
def test_a_request_survives_a_killed_stage_on_ray(ray_up: RayUp, index: int) -> None:
    before = ray_up.stages()
    pid, address = before[index]
    text, error, took, usage = stream_completion(ray_up.up, pid)
    assert not error, error
    assert text == ray_up.whole
    resumes = usage.get("skippy_resume") or []
    assert [entry["lost_stage"] for entry in resumes] == [index], usage
    # well inside the survivors' hold of the parked session (30 s): they resume, not re-prefill
    assert took < 10.0, (took, resumes)
    after = ray_up.stages()
    assert after[index][0] != pid, ray_up.up.stderr()  # restarted by the Ray launcher
    moved = "on the same address" if after[index][1] == address else f"moved {address} -> {after[index][1]}"
    print(f"stage {index} SIGKILLed on Ray: next token {took * 1000:.0f} ms after the kill ({moved}); {resumes}")
