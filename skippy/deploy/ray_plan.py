"""The hosts of a Ray cluster for ``skippy plan --ray``, and decode time measured on each node.

Strategy
--------
* **Hosts** (:func:`cluster_hosts`): every alive node with a CPU (a stage's bundle reserves one;
  a head started with ``--num-cpus 0`` is left out), in the order of their IP address, then node
  id.  A host is named by its IP and carries its node id, which the plan file writes as
  ``ray_node`` and ``skippy up --ray --plan`` pins the stage's bundle to.  Its memory budget is the
  node's Ray ``memory`` resource (what Ray lets actors reserve there).  A node that declares
  ``GPU`` gets GPU memory from its custom resource ``gpu_memory`` (bytes; ``ray start
  --num-gpus 1 --resources '{"gpu_memory": 25769803776}'``) or, without one, from ``nvidia-smi``
  run on the node (the smallest GPU's ``memory.total``); a GPU node where neither tells is refused
  with that advice rather than planned as if it had none.
* **Measurement** (:func:`measure_on_nodes`): :func:`skippy.deploy.plan.measure_times` (each
  segment of layers and the output head timed with the runtime in batches of the stages' rows
  under load and of one row) runs as a Ray
  task pinned to each node (``NodeAffinitySchedulingStrategy(soft=False)``, one CPU), all nodes at
  once; each task reports the node it ran on, and the figure is that host's own
  (:class:`skippy.deploy.plan.LayerTimes`, ``measured on Ray node ...``).  The model must be at the same
  path on every node, as for ``skippy up --ray``.
* **Named hosts with a cluster** (:func:`match_nodes`): with ``--hosts`` and ``--ray`` together, a
  host whose NAME is a node id, or the IP of exactly one node, is measured on that node; the
  others keep this machine's figure and the plan says so on their line.

Ray is the optional extra ``skippy-llm[ray]``: this module imports it at import time and is imported
only by ``skippy plan --ray``.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from skippy.deploy.plan import HostSpec, LayerTimes, ModelShape, PlanError

__all__ = ["cluster_hosts", "connect", "match_nodes", "measure_on_nodes"]


@contextlib.contextmanager
def connect(address: str | None) -> Iterator[None]:
    """Joined to the cluster at ``address`` (None: RAY_ADDRESS or a local one) for the block."""
    joined = False
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
        joined = True
    try:
        yield
    finally:
        if joined:
            ray.shutdown()


def _nvidia_smi_gpu_memory() -> int:
    """The smallest GPU's total memory on this node (bytes), 0 when nvidia-smi cannot tell."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        output = subprocess.run([tool, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
        sizes = [int(float(line)) << 20 for line in output.split() if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):  # no driver, a hung tool, odd output: unknown
        return 0
    return min(sizes, default=0)


@ray.remote(num_cpus=0)
def _probe_gpu_memory() -> int:
    return _nvidia_smi_gpu_memory()


@ray.remote(num_cpus=1)
def _measure(path: str, steps: int, rows: int) -> tuple[str, LayerTimes]:
    from skippy.deploy.plan import measure_times

    node = ray.get_runtime_context().get_node_id()
    return node, measure_times(ModelShape.from_gguf(Path(path)), rows=rows, steps=steps,
                               source=f"measured on Ray node {node[:12]}")


def _pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def cluster_hosts(*, port: int = 7000, timeout: float = 60.0) -> list[HostSpec]:
    """The hosts of the connected cluster (see the module notes), in chain order.

    Raises:
        PlanError: no node with a CPU, or a GPU node whose GPU memory nothing tells.
    """
    nodes = sorted((node for node in ray.nodes() if node.get("Alive") and node["Resources"].get("CPU", 0) >= 1),
                   key=lambda node: (node["NodeManagerAddress"], node["NodeID"]))
    if not nodes:
        raise PlanError("the Ray cluster has no alive node with a CPU to run a stage on")
    probes = {node["NodeID"]: _probe_gpu_memory.options(scheduling_strategy=_pinned(node["NodeID"])).remote()
              for node in nodes
              if node["Resources"].get("GPU", 0) >= 1 and not node["Resources"].get("gpu_memory")}
    found = dict(zip(probes, ray.get(list(probes.values()), timeout=timeout))) if probes else {}
    hosts = []
    for node in nodes:
        resources: Mapping[str, float] = node["Resources"]
        node_id = node["NodeID"]
        gpu_memory = 0
        if resources.get("GPU", 0) >= 1:
            gpu_memory = int(resources.get("gpu_memory") or found.get(node_id, 0))
            if not gpu_memory:
                raise PlanError(f"Ray node {node_id} ({node['NodeManagerAddress']}) declares {resources['GPU']:g} "
                                "GPU(s) but neither a gpu_memory resource nor nvidia-smi there tells their memory; "
                                "start it with --resources '{\"gpu_memory\": BYTES}'")
        hosts.append(HostSpec(node["NodeManagerAddress"], int(resources.get("memory", 0)), gpu_memory=gpu_memory,
                              port=port, node_id=node_id))
    return hosts


def match_nodes(hosts: Sequence[HostSpec]) -> list[str]:
    """The Ray node id of each named host ("" where none matches): a host named by a node id, or
    by the IP of exactly one alive node."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    by_id = {node["NodeID"] for node in nodes}
    by_ip: dict[str, list[str]] = {}
    for node in nodes:
        by_ip.setdefault(node["NodeManagerAddress"], []).append(node["NodeID"])
    matched = []
    for host in hosts:
        if host.node_id:
            matched.append(host.node_id)
        elif host.name in by_id:
            matched.append(host.name)
        elif len(by_ip.get(host.name, ())) == 1:
            matched.append(by_ip[host.name][0])
        else:
            matched.append("")
    return matched


def measure_on_nodes(shape: ModelShape, node_ids: Sequence[str], *, steps: int = 6, rows: int = 4,
                     timeout: float = 600.0) -> dict[str, LayerTimes]:
    """Each node's own per-layer decode time in batches of ``rows`` rows and of one row (a pinned
    Ray task per node, all at once).

    Raises:
        PlanError: a node could not measure (the model is not at this path there, the node left),
            naming it; or a task ran on another node than the one it was pinned to.
    """
    unique = list(dict.fromkeys(node_ids))
    refs: dict[str, Any] = {node: _measure.options(scheduling_strategy=_pinned(node)).remote(str(shape.path), steps, rows)
                            for node in unique}
    times = {}
    for node, ref in refs.items():
        try:
            ran_on, measured = ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:  # task failed there, node gone
            raise PlanError(f"cannot measure {shape.path.name} on Ray node {node}: {exc}") from exc
        if ran_on != node:
            raise PlanError(f"the measurement pinned to Ray node {node} ran on {ran_on}")
        times[node] = measured
    return times
