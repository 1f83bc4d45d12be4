"""A plan made from a Ray cluster, run on it with GPU bundles, surviving a lost first stage.

One test on one local ``ray.cluster_utils.Cluster`` (a head without CPUs and three one-CPU
workers; two of them declare ``num_gpus=1`` and a ``gpu_memory`` resource, which Ray accepts
without hardware), real processes throughout:

* ``skippy plan --ray ADDRESS --measure`` makes one stage per worker, named by node, with each
  node's memory resource as its budget, GPU memory on the GPU nodes, and a decode time measured
  by a task on that very node;
* ``skippy up --ray ADDRESS --plan`` pins each stage's bundle to its planned node and asks for
  ``GPU: 1`` where the plan has one (read from Ray's placement-group table); the GPU stages'
  processes run with the ``CUDA_VISIBLE_DEVICES`` of the GPU id Ray assigned their actor and
  ``--n-gpu-layers all`` (read from /proc; this build has no CUDA, so ``all`` runs on the CPU:
  the CUDA path itself is not exercised here); the API's greedy tokens equal the unsplit model's;
* the first stage's process killed mid-stream: the stream ends within 2 s with an error naming
  stage 0, ``/health`` answers 503 naming stage 0 while it is gone and 200 once the launcher has
  restarted it, and the next request's tokens equal the unsplit model's again;
* the node of a pinned (CPU) stage removed: that stage restarts in a one-bundle group of its own
  on a spare node added for it, and the tokens equal the unsplit model's again;
* SIGTERM leaves no actor and no stage process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'skippy-llm[ray]')")

from skippy.deploy.plan import GIB, load_plan  # noqa: E402

from api_helpers import ROOT, UpProcess, pid_alive  # noqa: E402
from conftest import PROMPT  # noqa: E402
from stage_helpers import reference_greedy  # noqa: E402

_STARTED = re.compile(r"stage (\d+) \(layers \S+\) pid (\d+) (?:ready|restarted) on")
WORKER_MEMORY = [1 * GIB, 2 * GIB, 3 * GIB // 2]
GPU_MEMORY = GIB


def _started_pids(text: str) -> dict[int, int]:
    """Each stage's latest pid, from ``skippy up``'s ready / restarted lines."""
    pids: dict[int, int] = {}
    for index, pid in _STARTED.findall(text):
        pids[int(index)] = int(pid)
    return pids


def _proc_environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode("utf-8", "replace").partition("=")[::2] for item in raw if item)


def _completion(url: str, model: str, max_tokens: int) -> tuple[str, int]:
    reply = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                      "temperature": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def _detokenize(url: str, tokens: list[int]) -> str:
    reply = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=30)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["content"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_plan_gpu_bundles_and_a_restarted_first_stage(tiny_llama: Path, tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        workers = [cluster.add_node(num_cpus=1, memory=memory, num_gpus=1 if index < 2 else 0,
                                    resources={"gpu_memory": float(GPU_MEMORY)} if index < 2 else {})
                   for index, memory in enumerate(WORKER_MEMORY)]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    except Exception as exc:  # any failure to bring a local cluster up here: skip, saying why
        pytest.skip(f"Ray cannot start a local cluster here: {type(exc).__name__}: {exc}")
    model_id = tiny_llama.name.removesuffix(".gguf")
    up: UpProcess | None = None
    pids: list[int] = []
    try:
        # -- skippy plan --ray --measure: one stage per worker, each measured on its own node ----------
        plan_file = tmp_path / "plan.toml"
        planned = subprocess.run(
            [sys.executable, "-m", "skippy", "plan", "--model", str(tiny_llama), "--ray", cluster.address,
             "--measure", "--ctx-size", "256", "--max-sessions", "2", "--batch-size", "64",
             "--cache-spill-mib", "16", "-o", str(plan_file)],
            capture_output=True, text=True, timeout=240, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert planned.returncode == 0, planned.stdout + planned.stderr
        by_id = {worker.node_id: index for index, worker in enumerate(workers)}
        order = sorted(by_id)  # every worker has the same IP here: chain order is by node id
        _, stages = load_plan(plan_file)
        assert [stage["ray_node"] for stage in stages] == order
        for stage in stages:
            worker = by_id[stage["ray_node"]]
            expected = stage["expected"]
            assert expected["host_memory_bytes"] == WORKER_MEMORY[worker]
            assert stage.get("gpus", 0) == (1 if worker < 2 else 0)
            assert expected["host_gpu_memory_bytes"] == (GPU_MEMORY if worker < 2 else 0)
            assert expected["decode_source"] == f"measured on Ray node {stage['ray_node'][:12]}"
            assert expected["decode_ms"] > 0
            assert f"(Ray node {stage['ray_node'][:12]})" in planned.stdout
        gpu_stages = {index for index, stage in enumerate(stages) if stage.get("gpus")}

        # -- skippy up --ray --plan: pinned bundles, GPU: 1 where planned --------------------------
        # no resume here (tests/test_ray_resume.py): a stream whose first stage is killed ends with the error
        up = UpProcess(["up", "--plan", str(plan_file), "--ray", cluster.address, "--port", "0", "--threads", "1",
                        "--resume-attempts", "0"], tmp_path)
        up.start(timeout=240)
        started = _started_pids(up.stderr())
        assert sorted(started) == [0, 1, 2], up.stderr()
        pids += started.values()
        groups = [table for table in ray.util.placement_group_table().values()
                  if table["state"] == "CREATED" and len(table["bundles"]) == 3]
        assert len(groups) == 1, groups
        table = groups[0]
        assert [table["bundles_to_node_id"][index] for index in range(3)] == order
        for index in range(3):
            assert table["bundles"][index].get("GPU", 0) == (1.0 if index in gpu_stages else 0), table["bundles"]
            command = Path(f"/proc/{started[index]}/cmdline").read_bytes().split(b"\0")
            environment = _proc_environment(started[index])
            if index in gpu_stages:  # Ray's GPU id for the actor (one GPU per node here: id 0)
                assert environment.get("CUDA_VISIBLE_DEVICES") == "0", environment.get("CUDA_VISIBLE_DEVICES")
                assert b"--n-gpu-layers" in command and command[command.index(b"--n-gpu-layers") + 1] == b"all"
                assert "GPU 0" in next(line for line in up.stderr().splitlines() if f"stage {index} (layers" in line)
            else:
                assert b"--n-gpu-layers" not in command

        reference = reference_greedy(tiny_llama, PROMPT, 8, chunk_size=len(PROMPT))
        text, count = _completion(up.url, model_id, 8)
        assert count >= 1 and text == _detokenize(up.url, reference[:count])

        # -- the first stage killed mid-stream; /health in between ----------------------------------
        samples: list[tuple[float, int, dict[str, Any]]] = []
        watching = threading.Event()
        done = threading.Event()

        def poll_health() -> None:
            with httpx.Client(timeout=10) as client:
                watching.set()
                while not done.is_set():
                    response = client.get(f"{up.url}/health")
                    samples.append((time.monotonic(), response.status_code, response.json()))
                    if response.status_code == 200 and any(status == 503 for _, status, _ in samples):
                        return  # down, then healthy again
                    time.sleep(0.05)

        victim = started[0]
        error_text, elapsed = "", -1.0
        poller = threading.Thread(target=poll_health, daemon=True)
        body = {"model": model_id, "prompt": PROMPT, "max_tokens": 256 - len(PROMPT) - 4, "temperature": 0,
                "stream": True, "logit_bias": {"2": -100}}  # no end-of-sequence: the stream is still running
        with httpx.stream("POST", f"{up.url}/v1/completions", json=body, timeout=30) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            poller.start()
            watching.wait(10)
            for line in lines:
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                assert payload != "[DONE]", "the stream finished although its first stage was killed"
                event = json.loads(payload)
                if "error" in event:
                    error_text, elapsed = event["error"]["message"], time.monotonic() - killed
                    break
        assert error_text, "the stream ended without an error"
        assert elapsed < 2.0, elapsed
        assert "stage 0 (layers" in error_text, error_text

        poller.join(240)
        done.set()
        down = [body for _, status, body in samples if status == 503]
        assert down, f"/health never reported the chain down: {samples[:5]}"
        assert all("stage 0 (layers" in body["error"] for body in down), down
        assert samples[-1][1] == 200, samples[-3:]
        restarted = _started_pids(up.stderr())
        assert restarted[0] != victim and restarted[1] == started[1] and restarted[2] == started[2], up.stderr()
        assert "stage 0 (layers" in up.stderr() and "restarted on" in up.stderr()
        pids.append(restarted[0])
        assert f"pid {restarted[0]} restarted on" in up.stderr()
        if 0 in gpu_stages:  # the new actor holds its bundle's GPU too
            assert _proc_environment(restarted[0]).get("CUDA_VISIBLE_DEVICES") == "0"

        text, count = _completion(up.url, model_id, 8)
        assert count >= 1 and text == _detokenize(up.url, reference[:count])

        # -- a pinned stage's node leaves: the stage restarts in a group of its own, on the spare node --
        spare = cluster.add_node(num_cpus=1, memory=2 * GIB)
        cluster.wait_for_nodes()
        lost = next(index for index in range(3) if index not in gpu_stages)
        before = _started_pids(up.stderr())
        cluster.remove_node(workers[by_id[order[lost]]], allow_graceful=False)
        deadline = time.monotonic() + 120
        while _started_pids(up.stderr())[lost] == before[lost] and time.monotonic() < deadline:
            time.sleep(0.2)
        after = _started_pids(up.stderr())
        assert after[lost] != before[lost], up.stderr()
        pids.append(after[lost])
        assert f"its Ray node {order[lost]} left" in up.stderr()
        alone = [table for table in ray.util.placement_group_table().values()
                 if table["state"] == "CREATED" and len(table["bundles"]) == 1]
        assert [table["bundles_to_node_id"][0] for table in alone] == [spare.node_id], alone
        deadline = time.monotonic() + 30
        while httpx.get(f"{up.url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        text, count = _completion(up.url, model_id, 8)
        assert count >= 1 and text == _detokenize(up.url, reference[:count])
        assert up.signal(signal.SIGTERM, timeout=60) == 0, up.stderr()
    finally:
        if up is not None:
            up.stop()
        left = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                if entry["name"].startswith("skippy-")]
        ray.shutdown()
        cluster.shutdown()
    assert not left
    deadline = time.monotonic() + 15
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if pid_alive(pid)]
