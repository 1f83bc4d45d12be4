"""A chain placed on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``).

One test (Ray takes most of a minute to start four nodes on two cores): three stages on three
different nodes (asserted from Ray's own view of the actors), greedy tokens equal to the unsplit
model's; the middle stage killed and its node removed mid-generation fails the request within
2 s naming the stage; the stage comes back on the spare node, its upstream re-wired, and the next
request's tokens equal unsplit; shutting down leaves no actor and no stage process; then
``skippy up --ray ADDRESS`` serves the API from the same cluster and stops cleanly.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import trio

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'skippy-llm[ray]')")

from skippy.deploy.certs import make_chain_certificates  # noqa: E402
from skippy.deploy.plan import GIB, HostSpec, ModelShape, PlanSettings, plan_chain  # noqa: E402
from skippy.deploy.ray_launch import RayChain  # noqa: E402
from skippy.driver.client import StageClient, StageLost  # noqa: E402
from skippy.net.tls import TlsFiles, client_context  # noqa: E402

from conftest import PROMPT  # noqa: E402
from api_helpers import UpProcess  # noqa: E402
from stage_helpers import reference_greedy  # noqa: E402

FLAGS = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "4", "--threads", "1",
         "--connect-timeout", "5", "--drain-timeout", "0"]
CHUNK = 8


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone between the two checks
        return False
    return "\nState:\tZ" not in status


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_places_restarts_and_releases(tiny_llama: Path, tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        workers = [cluster.add_node(num_cpus=1) for _ in range(4)]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    except Exception as exc:  # any failure to bring a local cluster up here: skip, saying why
        pytest.skip(f"Ray cannot start a local cluster here: {type(exc).__name__}: {exc}")
    certs = tmp_path / "certs"  # the links between nodes run mutual TLS, each stage's files sent with its actor
    make_chain_certificates(certs, ["stage-0", "stage-1", "stage-2", "driver-0"])
    tls = client_context(TlsFiles.in_directory(certs, "driver-0"))
    chain = RayChain(tiny_llama, [(0, 1), (1, 3), (3, 4)], stage_options=FLAGS, certificates=certs)
    pids: list[int] = []
    try:
        chain.start(timeout=240)
        nodes = {stage.node_id for stage in chain.stages}
        assert len(nodes) == 3, "three stages on three nodes"
        for stage in chain.stages:  # one stage of 1 thread on each node (skippy.stage.threads)
            assert stage.command[stage.command.index("--host-threads") + 1] == "1", stage.command
        assert chain.bundle_nodes() == [stage.node_id for stage in chain.stages]  # Ray's placement table
        named = {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)}
        assert sum(name.startswith(f"skippy-{chain.chain_id}-") for name in named) == 3
        assert all(stage.metrics_url.startswith("http://") for stage in chain.stages)
        pids += [stage.pid for stage in chain.stages]
        reference = reference_greedy(tiny_llama, PROMPT, 8, chunk_size=CHUNK)

        async def greedy(session: int) -> list[int]:
            async with await StageClient.connect(chain.stages[0].address, tls=tls) as client:  # type: ignore[arg-type]
                return await client.generate_greedy(session, PROMPT, 8, chunk_size=CHUNK)

        assert trio.run(greedy, 1) == reference

        victim = chain.stages[1]
        victim_node = next(node for node in workers if node.node_id == victim.node_id)

        async def killed_mid_generation() -> tuple[float, str]:
            async with await StageClient.connect(chain.stages[0].address, tls=tls) as client:  # type: ignore[arg-type]
                await client.configure(2, prompt_token_count=len(PROMPT))
                result = await client.prefill(2, PROMPT, chunk_size=CHUNK)
                token, position = result.token, len(PROMPT)
                for step in range(3):
                    token = (await client.decode(2, token, position, decode_step=step)).predicted
                    position += 1
                os.kill(victim.pid, signal.SIGKILL)  # the stage dies with its node
                cluster.remove_node(victim_node, allow_graceful=False)
                started = time.monotonic()
                with pytest.raises(StageLost) as caught:
                    with trio.fail_after(10):
                        await client.decode(2, token, position, decode_step=3)
                return time.monotonic() - started, str(caught.value)

        elapsed, message = trio.run(killed_mid_generation)
        assert elapsed < 2.0, elapsed
        assert str(victim.address) in message or "stage 1" in message, message

        old_node, old_address = victim.node_id, victim.address
        deadline = time.monotonic() + 240
        while not victim.restarts and time.monotonic() < deadline:
            chain.watch_once()
            time.sleep(0.2)
        assert victim.restarts == 1 and victim.node_id != old_node and victim.address != old_address
        pids.append(victim.pid)
        assert trio.run(greedy, 3) == reference
        chain.shutdown()

        # skippy up --ray ADDRESS --plan: the same placement behind the API, from the command line,
        # each bundle sized by the plan's expected peak memory
        shape = ModelShape.from_gguf(tiny_llama)
        plan = plan_chain(shape, [HostSpec(f"h{i}", GIB) for i in range(3)],
                          PlanSettings(ctx_size=256, max_sessions=2, batch_size=64, cache_spill_mib=16))
        plan_file = tmp_path / "plan.toml"
        plan_file.write_text(plan.to_toml())
        up = UpProcess(["up", "--plan", str(plan_file), "--ray", cluster.address, "--port", "0", "--threads", "1"],
                       tmp_path)
        try:
            up.start(timeout=240)
            assert up.stderr().count("Ray node") == 3
            for stage in plan.stages:
                assert re.search(rf"stage {stage.index} \(layers {stage.layers}\) pid \d+ ready on", up.stderr())
            reply = httpx.post(f"{up.url}/v1/completions", json={
                "model": tiny_llama.name.removesuffix(".gguf"), "prompt": "Hello", "max_tokens": 4}, timeout=60)
            assert reply.status_code == 200, reply.text
            assert httpx.get(f"{up.url}/health", timeout=30).status_code == 200
        finally:
            assert up.signal(signal.SIGTERM, timeout=60) == 0, up.stderr()
    finally:
        chain.shutdown()
        if not ray.is_initialized():  # chain.shutdown() disconnects only a connection it made
            ray.init(address=cluster.address, log_to_driver=False)
        left = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                if entry["name"].startswith("skippy-")]
        ray.shutdown()
        cluster.shutdown()
    assert not left
    deadline = time.monotonic() + 15
    while any(_pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _pid_alive(pid)]
