"""The head split on Ray (issue 31): the launcher wires the head shard link, on the chain's mutual TLS.

Without a cluster (Ray's calls replaced by fakes that record them): the final stage gets
``--head-split``, the serving stage ``--serve-head-rows`` and the final stage's reported head shard
port through its actor's dial file, both with their TLS files; a restarted final stage's new port
is written to the serving stage's actor, a restarted serving stage starts with the current port.
Slow, on a local ``ray.cluster_utils.Cluster`` (two one-CPU workers, real processes): a two-node
chain with the head split answers the unsplit model's greedy tokens, both ends of the head shard
link log TLS, and after the final stage is killed and restarted the tokens are the same again;
then ``skippy up --ray --plan`` runs a cross-host plan that carries the split.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'skippy-llm[ray]')")

from skippy.deploy import ray_launch  # noqa: E402
from skippy.deploy.certs import make_chain_certificates  # noqa: E402
from skippy.deploy.cost import HeadSplit  # noqa: E402
from skippy.deploy.ray_launch import RayChain  # noqa: E402

from conftest import PROMPT  # noqa: E402
from api_helpers import UpProcess  # noqa: E402
from stage_helpers import reference_greedy  # noqa: E402


class _Call:
    def __init__(self, actor: "_FakeActor", name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> Any:
        self.actor.calls.append((self.name, args))
        if self.name == "start":
            return self.actor.started(*args)
        return None


class _FakeActor:
    """A StageActor stand-in: records its calls; ``start`` answers as a READY stage would."""

    made: list["_FakeActor"] = []
    ports = iter(range(9100, 9200))

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        _FakeActor.made.append(self)

    @classmethod
    def options(cls, **_: Any) -> Any:
        return type("Made", (), {"remote": staticmethod(cls)})

    def __getattr__(self, name: str) -> _Call:
        return _Call(self, name)

    def started(self, arguments: list[str], downstream: str | None, timeout: float, metrics: bool,
                tls: dict[str, bytes] | None, gpus: int, head_shard: str | None) -> dict[str, Any]:
        final = "--head-split" in arguments
        return {"host": "10.0.0.9", "port": next(self.ports), "node": "n", "pid": 1, "metrics": "", "command": [],
                "environment": {}, "gpu_ids": [], "head_shard": f"10.0.0.9:{next(self.ports)}" if final else ""}


class _Group:
    def ready(self) -> None:
        return None


def test_the_ray_launcher_wires_the_head_shard_link(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    make_chain_certificates(tmp_path, ["stage-0", "stage-1", "stage-2"])
    monkeypatch.setattr(ray_launch, "StageActor", _FakeActor)
    monkeypatch.setattr(ray_launch.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(ray_launch.ray, "kill", lambda actor, no_restart=True: None)
    monkeypatch.setattr(ray_launch, "PlacementGroupSchedulingStrategy", lambda *a, **k: None)
    with pytest.raises(ValueError, match="not a stage before the final one"):
        RayChain(Path("m.gguf"), [(0, 2), (2, 4)], head=HeadSplit(1, 4096))
    chain = RayChain(Path("m.gguf"), [(0, 1), (1, 3), (3, 4)], certificates=tmp_path, head=HeadSplit(1, 4096))
    chain.group = _Group()  # type: ignore[assignment]
    chain._start_all(None, 5.0)
    final, serving, first = (chain.stages[2].actor, chain.stages[1].actor, chain.stages[0].actor)

    def start_of(actor: _FakeActor) -> tuple[Any, ...]:
        return [args for name, args in actor.calls if name == "start"][-1]

    arguments, _, _, _, tls, _, head_shard = start_of(final)
    assert arguments[arguments.index("--head-split") + 1] == "4096" and head_shard is None
    assert tls is not None and tls["cert"] == (tmp_path / "stage-2.pem").read_bytes()  # the link's TLS: its own
    port = chain.stages[2].head_shard
    assert port is not None and port.host == "10.0.0.9"
    arguments, _, _, _, tls, _, head_shard = start_of(serving)
    assert arguments[arguments.index("--serve-head-rows") + 1] == "4096" and head_shard == str(port)
    assert tls is not None and tls["cert"] == (tmp_path / "stage-1.pem").read_bytes()
    arguments = start_of(first)[0]
    assert "--serve-head-rows" not in arguments and "--head-split" not in arguments and start_of(first)[6] is None

    chain.restart(chain.stages[2], timeout=5.0)  # a new final stage: a new port, written to the serving actor
    moved = chain.stages[2].head_shard
    assert moved is not None and moved != port
    assert ("set_head_shard", (str(moved),)) in serving.calls
    chain.restart(chain.stages[1], timeout=5.0)  # a new serving stage: started with the current port
    assert start_of(chain.stages[1].actor)[6] == str(moved)
    assert not any(name == "set_head_shard" for name, _ in first.calls)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_head_split_chain_on_ray_runs_on_tls_and_survives_a_lost_final_stage(tiny_llama: Path,
                                                                               tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    from skippy.deploy.plan import GIB, HostSpec, ModelShape, PlanSettings, plan_chain
    from skippy.driver.client import StageClient
    from skippy.net.tls import TlsFiles, client_context

    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    except Exception as exc:  # any failure to bring a local cluster up here: skip, saying why
        pytest.skip(f"Ray cannot start a local cluster here: {type(exc).__name__}: {exc}")
    certs = tmp_path / "certs"
    make_chain_certificates(certs, ["stage-0", "stage-1", "driver-0"])
    tls = client_context(TlsFiles.in_directory(certs, "driver-0"))
    flags = ["--batch-size", "64", "--ctx-size", "256", "--max-sessions", "2", "--threads", "1",
             "--connect-timeout", "10", "--drain-timeout", "0"]
    chain = RayChain(tiny_llama, [(0, 2), (2, 4)], stage_options=flags, certificates=certs, head=HeadSplit(0, 4096))
    reference = reference_greedy(tiny_llama, PROMPT, 8, chunk_size=8)

    async def greedy(session: int) -> list[int]:
        async with await StageClient.connect(chain.stages[0].address, tls=tls) as client:  # type: ignore[arg-type]
            return await client.generate_greedy(session, PROMPT, 8, chunk_size=8)

    try:
        chain.start(timeout=240)
        assert chain.stages[0].node_id != chain.stages[1].node_id  # the head shard link leaves the node
        assert trio.run(greedy, 1) == reference
        final_log = "\n".join(ray.get(chain.stages[1].actor.last_lines.remote(), timeout=30))
        serving_log = "\n".join(ray.get(chain.stages[0].actor.last_lines.remote(), timeout=30))
        port = chain.stages[1].head_shard
        assert port is not None and f"head shard port on {port} (TLS)" in final_log, final_log
        assert re.search(rf"serving head rows 0:4096 to {re.escape(str(port))} \(TLS\)", serving_log), serving_log

        os.kill(chain.stages[1].pid, signal.SIGKILL)  # the final stage: restarted with a new head shard port
        deadline = time.monotonic() + 120
        while not chain.stages[1].restarts and time.monotonic() < deadline:
            chain.watch_once()
            time.sleep(0.2)
        assert chain.stages[1].restarts == 1 and chain.stages[1].head_shard not in (None, port)
        assert trio.run(greedy, 2) == reference
        chain.shutdown()

        # a cross-host plan carries the split; skippy up --ray --plan runs it, its links on TLS
        shape = ModelShape.from_gguf(tiny_llama)
        plan = plan_chain(shape, [HostSpec(f"h{i}", GIB) for i in range(2)],
                          PlanSettings(ctx_size=256, max_sessions=2, batch_size=64, cache_spill_mib=16))
        plan_file = tmp_path / "plan.toml"
        plan_file.write_text(plan.with_head_split(HeadSplit(0, 4096), 1.0, shape.n_vocab).to_toml())
        up = UpProcess(["up", "--plan", str(plan_file), "--ray", cluster.address, "--port", "0", "--threads", "1"],
                       tmp_path)
        try:
            up.start(timeout=240)
            assert "head split as planned: rows 0:4096 on stage 0" in up.stderr()
            model = tiny_llama.name.removesuffix(".gguf")
            reply = httpx.post(f"{up.url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                                 "temperature": 0}, timeout=60)
            assert reply.status_code == 200, reply.text
            text = httpx.post(f"{up.url}/detokenize", json={"tokens": reference}, timeout=30).json()["content"]
            assert reply.json()["choices"][0]["text"] == text
        finally:
            assert up.signal(signal.SIGTERM, timeout=60) == 0, up.stderr()
    finally:
        chain.shutdown()
        ray.shutdown()
        cluster.shutdown()
