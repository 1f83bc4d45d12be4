"""Place a chain on a Ray cluster: one placement-group bundle per stage, one actor per stage process.

Strategy
--------
* **Placement.** One placement group with a bundle per stage (``{"CPU": cpus}``, plus ``memory``:
  the stage's expected peak when the chain comes from a ``skippy plan`` file, and ``GPU: 1`` for a
  stage the plan gives GPU memory), strategy ``STRICT_SPREAD`` when the cluster has a node per
  stage (else ``SPREAD``): Ray picks the nodes, and reschedules a lost node's bundle onto a node
  with room.  A plan made from the cluster (``skippy plan --ray``) names each stage's node: its
  bundle is pinned there (``bundle_label_selector`` on ``ray.io/node-id``); a pinned bundle whose
  node is gone cannot move, so that stage restarts in a one-bundle group of its own, unpinned,
  wherever Ray finds room.
* **GPUs.** A stage with a GPU bundle gets its actor with ``num_gpus=1``; the actor starts the
  stage with ``CUDA_VISIBLE_DEVICES`` set to the ids Ray assigned it (``ray.get_gpu_ids()``) and
  ``--n-gpu-layers all`` unless the options set it.  (On a CPU-only build ``all`` means none, so a
  node that merely declares a GPU still runs the stage, on its CPU.)
* **Stages.** Each stage process (``python -m skippy.stage``) is owned by a :class:`StageActor`
  scheduled into its bundle.  The actor starts it listening on its node's IP (port 0), reads its
  log until ``ready on HOST:PORT`` and reports that address and its node id; the stage runs with
  ``--exit-on-stdin-eof on`` on a pipe the actor holds, so it goes when its actor (or node) does.
  Stages start final first, each READY before the next, and each gets ``--downstream`` from the
  address the next one reported, plus a ``--downstream-file`` the actor can rewrite.
* **Threads.** Each stage gets ``--host-threads``: its ``--threads`` times the stages whose
  bundles are on its node (``bundle_nodes``), so ``--thread-wait auto`` spins only where they fit
  the node's cores (:mod:`skippy.stage.threads`).  A stage restarted onto another node counts the
  stages there; the ones already running keep the wait they loaded with.  Without ``--threads``
  in the options (all cores), each stage decides alone.
* **Links.** With a certificate directory (``skippy certs``), each actor writes its stage's
  certificate, key and the chain CA on its node and starts the stage with ``--tls on``: every link
  between nodes is mutual TLS, and the launcher's driver uses the ``driver-0`` certificate.
* **Head split** (issue 31; ``head``): the final stage gets ``--head-split ROWS`` and its actor
  reports the head shard port it logs (on its node's IP); the stage serving the rows ``0:ROWS``
  gets ``--serve-head-rows ROWS`` and that port in a ``--head-shard-dial-file`` its actor holds.
  The head shard link runs on the same mutual TLS as the stage links.  A restarted final stage
  listens on a new port (perhaps on another node): the serving stage's file is rewritten and its
  next dial reaches it; a restarted serving stage is started with the final stage's current port.
* **A lost stage** (:meth:`RayChain.watch`): every ``poll_interval`` the launcher asks each actor
  whether its process lives.  A dead process or an unreachable actor (its node left) restarts that
  stage: a new actor in the same bundle (Ray has moved the bundle if the node is gone), the same
  range, the same downstream; then its upstream neighbour's downstream file is rewritten, so its
  next lane dials the new address.  The other stages keep running.  Requests in flight on the lost
  stage fail at once through the chain's own path (its upstream sends ``DOWNSTREAM_LOST`` naming
  it, or the driver's lane to a lost first stage closes); ``on_restart`` tells the API about a new
  first stage.
* **Shutdown** stops every stage process, kills the actors and removes the placement group, so
  nothing is left on the cluster.

Ray is an optional extra (``pip install 'skippy-llm[ray]'``); this module imports it at import time
and is imported only by ``skippy up --ray``.  Every node needs skippy and the model file at the
same path.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from skippy.deploy.cost import HeadSplit
from skippy.net.address import Address

__all__ = ["RayChain", "RayStage", "StageActor"]

log = logging.getLogger("skippy.ray")

_READY = re.compile(r"ready on (\S+):(\d+)")
_METRICS = re.compile(r"metrics on (http://\S+/metrics)")
_HEAD_PORT = re.compile(r"head shard port on (\S+):(\d+)")


@ray.remote(num_cpus=0)
class StageActor:
    """Owns one stage process on its node (the bundle reserves the resources)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.command: list[str] = []
        self.environment: dict[str, str] = {}  #: what the stage's environment adds to the actor's
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.directory = Path(tempfile.mkdtemp(prefix="skippy-ray-stage-"))
        self.downstream_file = self.directory / "downstream"
        self.head_shard_file = self.directory / "head_shard"

    def start(self, arguments: Sequence[str], downstream: str | None, ready_timeout: float = 300.0,
              metrics: bool = False, tls: dict[str, bytes] | None = None, gpus: int = 0,
              head_shard: str | None = None) -> dict[str, Any]:
        """Start the stage; once it is READY: ``host``, ``port``, ``node`` (id), ``pid``,
        ``metrics`` (URL or ""), ``command``, ``environment`` (what it adds), ``gpu_ids`` and
        ``head_shard`` (the final stage of a split head: its head shard port, ``HOST:PORT``; else "").

        ``tls``: the stage's certificate, key and the chain CA (PEM bytes), written to this node
        for ``--tls on``.  ``gpus``: the actor holds that many of the bundle's GPUs; the stage
        sees only those (``CUDA_VISIBLE_DEVICES``) and offloads every layer.  ``head_shard``: the
        final stage's head shard port, for a stage serving head rows (``--serve-head-rows`` in
        ``arguments``): dialled through a file this actor rewrites (:meth:`set_head_shard`).

        Raises:
            RuntimeError: the stage exited or was not READY in time (with its last log lines).
        """
        host = ray.util.get_node_ip_address()
        command = [sys.executable, "-m", "skippy.stage", *arguments, "--listen", f"{host}:0",
                   "--exit-on-stdin-eof", "on", "--downstream-file", str(self.downstream_file)]
        if downstream is not None:
            self.set_downstream(downstream)
            command += ["--downstream", downstream]
        if metrics:
            command += ["--metrics-listen", f"{host}:0"]
        if head_shard is not None:
            self.set_head_shard(head_shard)
            command += ["--head-shard-dial", head_shard, "--head-shard-dial-file", str(self.head_shard_file)]
        if tls is not None:
            paths = {}
            for part in ("cert", "key", "ca"):
                path = paths[part] = self.directory / f"{part}.pem"
                path.write_bytes(tls[part])
                path.chmod(0o600)
            command += ["--tls", "on", "--tls-cert", str(paths["cert"]), "--tls-key", str(paths["key"]),
                        "--tls-ca", str(paths["ca"])]
        gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()] if gpus else []
        if gpus:
            self.environment["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
            if "--n-gpu-layers" not in arguments:
                command += ["--n-gpu-layers", "all"]
        self.command = command
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, env={**os.environ, **self.environment})
        ready: list[tuple[str, int]] = []
        metrics_url: list[str] = []
        head_port: list[str] = []
        got = threading.Event()

        def read_log() -> None:
            assert self.process is not None and self.process.stderr is not None
            for raw in self.process.stderr:
                line = raw.decode("utf-8", "replace").rstrip()
                self.tail.append(line)
                found = _METRICS.search(line)
                if found:
                    metrics_url.append(found.group(1))
                port = _HEAD_PORT.search(line)
                if port:
                    head_port.append(f"{port.group(1)}:{port.group(2)}")
                match = _READY.search(line)
                if match and not got.is_set():
                    ready.append((match.group(1), int(match.group(2))))
                    got.set()
            got.set()

        threading.Thread(target=read_log, daemon=True).start()
        got.wait(ready_timeout)
        if not ready:
            self.stop()
            raise RuntimeError("stage did not get ready; its last log lines:\n" + "\n".join(self.tail))
        return {"host": ready[0][0], "port": ready[0][1], "node": ray.get_runtime_context().get_node_id(),
                "pid": self.process.pid, "metrics": metrics_url[0] if metrics_url else "", "command": command,
                "environment": dict(self.environment), "gpu_ids": gpu_ids,
                "head_shard": head_port[-1] if head_port else ""}

    def set_downstream(self, address: str) -> None:
        """Point the stage's next downstream dial at ``address`` (atomic rewrite of its file)."""
        temporary = self.downstream_file.with_suffix(".tmp")
        temporary.write_text(address)
        os.replace(temporary, self.downstream_file)

    def set_head_shard(self, address: str) -> None:
        """Point the serving stage's next head shard dial at ``address`` (atomic rewrite of its file)."""
        temporary = self.head_shard_file.with_suffix(".tmp")
        temporary.write_text(address)
        os.replace(temporary, self.head_shard_file)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def last_lines(self) -> list[str]:
        return list(self.tail)

    def stop(self, grace: float = 5.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@dataclasses.dataclass
class RayStage:
    """One placed stage: its range, actor, address and node."""

    index: int
    layers: str
    actor: Any = None
    address: Address | None = None
    node_id: str = ""
    pid: int = 0
    restarts: int = 0
    metrics_url: str = ""
    gpus: int = 0  #: GPUs its bundle reserves
    pinned_node: str = ""  #: the node its bundle is pinned to ("" none)
    command: list[str] = dataclasses.field(default_factory=list)  #: the stage process's command line
    environment: dict[str, str] = dataclasses.field(default_factory=dict)  #: what its environment adds
    gpu_ids: list[str] = dataclasses.field(default_factory=list)  #: the GPU ids Ray assigned its actor
    #: The final stage of a split head: its head shard port (where the serving stage dials).
    head_shard: Address | None = None

    @property
    def name(self) -> str:
        return f"stage {self.index} (layers {self.layers})"


class RayChain:
    """A chain placed on a Ray cluster (see the module notes).

    Args:
        model: the GGUF file (the same path on every node).
        split: the layer ranges, in chain order.
        stage_options: flags every stage gets (ctx size, sessions, ...).
        address: the Ray cluster (None: ``ray.init()``'s default: RAY_ADDRESS or a local one).
        cpus_per_stage: the CPU reservation of each bundle.
        metrics: each stage serves Prometheus metrics on its node (``metrics_url``).
        certificates: a directory of ``skippy certs`` files (``stage-I`` for each stage and the
            chain CA) to run every link on mutual TLS; each stage's files travel to its node with
            its actor (None: plain TCP, which stages on non-loopback addresses refuse by default).
        memory_per_stage: each bundle's ``memory`` (a plan's expected peak).
        gpus_per_stage: each bundle's ``GPU`` (0: none).
        nodes: the Ray node id each stage's bundle is pinned to ("" or None: Ray chooses).
        head: the output head split by vocabulary rows (issue 31; None: the whole head on the
            final stage): rows ``0:head.rows`` on stage ``head.host``.
    """

    def __init__(self, model: Path, split: Sequence[tuple[int, int]], *, stage_options: Sequence[str] = (),
                 address: str | None = None, cpus_per_stage: float = 1.0, metrics: bool = True,
                 certificates: Path | None = None, memory_per_stage: Sequence[int] | None = None,
                 gpus_per_stage: Sequence[int] | None = None, nodes: Sequence[str | None] | None = None,
                 head: HeadSplit | None = None) -> None:
        self.metrics = metrics
        if head is not None and not 0 <= head.host < len(split) - 1:
            raise ValueError(f"head rows on stage {head.host}: not a stage before the final one of {len(split)}")
        self.head = head
        for name, values in (("memory figures", memory_per_stage), ("GPU counts", gpus_per_stage), ("nodes", nodes)):
            if values is not None and len(values) != len(split):
                raise ValueError(f"{len(values)} {name} for {len(split)} stages")
        self.memory = list(memory_per_stage) if memory_per_stage is not None else None
        self.certificates = certificates
        self.model = model
        self.stages = [RayStage(index, f"{a}:{b}", gpus=int(gpus_per_stage[index]) if gpus_per_stage else 0,
                                pinned_node=(nodes[index] or "") if nodes else "")
                       for index, (a, b) in enumerate(split)]
        self.options = list(stage_options)
        self.address = address
        self.cpus = cpus_per_stage
        self.group: PlacementGroup | None = None
        #: one-bundle groups of stages restarted off their lost pinned node (stage index -> group)
        self.replacements: dict[int, PlacementGroup] = {}
        self._initialized = False
        #: Names the actors (``skippy-<id>-stage<i>-<attempt>``), so Ray's listing shows whose they are.
        self.chain_id = f"{os.getpid()}-{id(self) & 0xFFFFFF:x}"
        self._attempts = itertools.count()

    # -- placement ---------------------------------------------------------------------------
    def start(self, announce: Callable[[RayStage], None] | None = None, timeout: float = 300.0) -> None:
        """Connect, reserve the bundles and start every stage, final first (blocking).

        Raises:
            RuntimeError: no placement within ``timeout`` or a stage that failed to start.
        """
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False)
            self._initialized = True
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        strategy = "STRICT_SPREAD" if len(nodes) >= len(self.stages) else "SPREAD"
        bundles = [self._bundle(stage) for stage in self.stages]
        alive = {node["NodeID"] for node in nodes}
        for stage in self.stages:
            if stage.pinned_node and stage.pinned_node not in alive:
                log.warning("%s: the plan's Ray node %s is not alive; Ray places it", stage.name, stage.pinned_node)
                stage.pinned_node = ""
        selectors = [{"ray.io/node-id": stage.pinned_node} if stage.pinned_node else {} for stage in self.stages]
        self.group = placement_group(bundles, strategy=strategy,
                                     bundle_label_selector=selectors if any(selectors) else None)
        try:
            ray.get(self.group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise RuntimeError(f"Ray could not place {len(self.stages)} bundles ({bundles}, {strategy}) "
                               f"within {timeout:g} s") from exc
        self._start_all(announce, timeout)

    def _start_all(self, announce: Callable[[RayStage], None] | None, timeout: float) -> None:
        """Start every stage in its bundle, final first (each gets the next one's address)."""
        downstream: Address | None = None
        for stage in reversed(self.stages):
            self._start_stage(stage, downstream, timeout)
            if announce is not None:
                announce(stage)
            downstream = stage.address

    def _bundle(self, stage: RayStage) -> dict[str, float]:
        bundle = {"CPU": self.cpus}
        if self.memory is not None:  # a plan's expected peak per stage: Ray places where it fits
            bundle["memory"] = float(self.memory[stage.index])
        if stage.gpus:
            bundle["GPU"] = float(stage.gpus)
        return bundle

    def placement(self, stage: RayStage) -> tuple[PlacementGroup, int]:
        """The group and bundle index ``stage`` runs in."""
        if stage.index in self.replacements:
            return self.replacements[stage.index], 0
        assert self.group is not None
        return self.group, stage.index

    def _start_stage(self, stage: RayStage, downstream: Address | None, timeout: float) -> None:
        group, bundle = self.placement(stage)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        stage.actor = StageActor.options(  # type: ignore[attr-defined]
            scheduling_strategy=strategy, max_restarts=0, num_cpus=0, num_gpus=stage.gpus,
            name=f"skippy-{self.chain_id}-stage{stage.index}-{next(self._attempts)}", namespace="skippy").remote()
        arguments = ["--model", str(self.model), "--layers", stage.layers, *self.options, *self._host_threads(stage)]
        head_shard = None
        if self.head is not None and stage.index == len(self.stages) - 1:
            arguments += ["--head-split", str(self.head.rows)]
        elif self.head is not None and stage.index == self.head.host:
            final = self.stages[-1]
            if final.head_shard is None:
                raise RuntimeError(f"{stage.name} serves head rows but {final.name} named no head shard port")
            arguments += ["--serve-head-rows", str(self.head.rows)]
            head_shard = str(final.head_shard)
        tls = None
        if self.certificates is not None:
            name = f"stage-{stage.index}"
            tls = {"cert": (self.certificates / f"{name}.pem").read_bytes(),
                   "key": (self.certificates / f"{name}.key").read_bytes(),
                   "ca": (self.certificates / "ca.pem").read_bytes()}
        try:
            started = ray.get(stage.actor.start.remote(
                arguments, None if downstream is None else str(downstream), timeout, self.metrics, tls, stage.gpus,
                head_shard), timeout=timeout + 60)
        except (ray.exceptions.RayError, RuntimeError) as exc:  # RayTaskError wraps the actor's RuntimeError
            try:
                ray.kill(stage.actor, no_restart=True)
            except (ray.exceptions.RayError, ValueError):  # already gone
                pass
            raise RuntimeError(f"{stage.name} failed to start on Ray: {exc}") from exc
        stage.address = Address(started["host"], started["port"])
        stage.node_id, stage.pid = started["node"], started["pid"]
        stage.metrics_url, stage.command = started["metrics"], started["command"]
        stage.environment, stage.gpu_ids = started["environment"], started["gpu_ids"]
        if self.head is not None and stage.index == len(self.stages) - 1:
            if not started.get("head_shard"):
                raise RuntimeError(f"{stage.name} did not name its head shard port")
            stage.head_shard = Address.parse(started["head_shard"])

    def _host_threads(self, stage: RayStage) -> list[str]:
        """``--host-threads``: the compute threads of the chain's stages on ``stage``'s node."""
        given = [value for flag, value in zip(self.options, self.options[1:]) if flag == "--threads"]
        threads = int(given[-1]) if given and given[-1].isdigit() else 0
        if threads <= 0:  # all of a node's cores: the stage decides alone
            return []
        try:
            nodes = self.bundle_nodes()
        except (KeyError, IndexError, ray.exceptions.RayError) as exc:  # no placement table: decide alone
            log.warning("%s: no node of its bundle (%s); it chooses its thread wait alone", stage.name, exc)
            return []
        return ["--host-threads", str(threads * nodes.count(nodes[stage.index]))]

    # -- a lost stage ------------------------------------------------------------------------
    def bundle_nodes(self) -> list[str]:
        """The node id of each bundle, from Ray's placement-group table."""
        nodes = []
        for stage in self.stages:
            group, bundle = self.placement(stage)
            nodes.append(ray.util.placement_group_table(group)["bundles_to_node_id"][bundle])
        return nodes

    def lost(self, timeout: float = 1.0) -> list[RayStage]:
        """The stages whose process or actor is gone (asks every actor; blocking)."""
        gone = []
        refs = [(stage, stage.actor.alive.remote()) for stage in self.stages]
        for stage, ref in refs:
            try:
                if not ray.get(ref, timeout=timeout):
                    gone.append(stage)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):  # actor or node gone
                gone.append(stage)
        return gone

    def restart(self, stage: RayStage, timeout: float = 300.0) -> None:
        """Start ``stage`` again in its bundle (same range, same downstream) and re-wire its upstream."""
        try:
            ray.kill(stage.actor, no_restart=True)
        except (ray.exceptions.RayError, ValueError):  # already dead with its node
            pass
        following = self.stages[stage.index + 1] if stage.index + 1 < len(self.stages) else None
        deadline = time.monotonic() + timeout
        stage.restarts += 1
        while True:
            # Until Ray notices a node has left (missed heartbeats), the bundle still maps to it
            # and an actor placed there dies unstarted: try again until the bundle has moved.
            # A bundle pinned to a node that left never moves: the stage gets a group of its own.
            if stage.pinned_node and stage.index not in self.replacements and not self._alive(stage.pinned_node):
                log.warning("%s: its Ray node %s left; placing it anywhere with room", stage.name, stage.pinned_node)
                self.replacements[stage.index] = placement_group([self._bundle(stage)])
            # A pinned bundle waits briefly: its node may be found gone meanwhile (a group with a
            # bundle on a dead node is never ready again), and the next pass replaces it.
            pinned = bool(stage.pinned_node) and stage.index not in self.replacements
            try:
                ray.get(self.placement(stage)[0].ready(), timeout=5.0 if pinned else timeout)
                self._start_stage(stage, None if following is None else following.address, timeout)
                break
            except (RuntimeError, ray.exceptions.GetTimeoutError) as exc:  # not placed or not started yet
                if time.monotonic() > deadline:
                    raise
                log.info("%s not restarted yet (%s); retrying", stage.name, str(exc).splitlines()[0])
                time.sleep(1.0)
        if stage.index > 0:
            upstream = self.stages[stage.index - 1]
            ray.get(upstream.actor.set_downstream.remote(str(stage.address)), timeout=30)
        if self.head is not None and stage.index == len(self.stages) - 1:  # its new head shard port
            serving = self.stages[self.head.host]
            try:
                ray.get(serving.actor.set_head_shard.remote(str(stage.head_shard)), timeout=30)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):  # lost too: it restarts with the port
                log.warning("%s: cannot re-point its head shard dial now; it gets %s when it restarts",
                            serving.name, stage.head_shard)

    @staticmethod
    def _alive(node_id: str) -> bool:
        return any(node["NodeID"] == node_id and node.get("Alive") for node in ray.nodes())

    def watch_once(self) -> list[RayStage]:
        """One pass of the watcher: restart every lost stage; returns the restarted ones."""
        gone = self.lost()
        for stage in sorted(gone, key=lambda s: -s.index):  # downstream first: upstreams get its new address
            log.warning("%s at %s is lost; restarting it", stage.name, stage.address)
            self.restart(stage)
        return gone

    # -- teardown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every stage process and actor, remove the placement group (and disconnect)."""
        for stage in self.stages:
            if stage.actor is None:
                continue
            try:
                ray.get(stage.actor.stop.remote(), timeout=15)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):  # its node is gone
                pass
            try:
                ray.kill(stage.actor, no_restart=True)
            except (ray.exceptions.RayError, ValueError):  # already gone
                pass
        for group in [*self.replacements.values(), *([self.group] if self.group is not None else [])]:
            remove_placement_group(group)
        self.group, self.replacements = None, {}
        if self._initialized:
            ray.shutdown()
            self._initialized = False


async def run_ray_chain(model: Path, split: Sequence[tuple[int, int]], *, stage_options: Sequence[str] = (),
                        address: str | None = None, certificates: Path | None = None,
                        memory_per_stage: Sequence[int] | None = None,
                        gpus_per_stage: Sequence[int] | None = None, nodes: Sequence[str | None] | None = None,
                        head: HeadSplit | None = None, announce: Callable[[RayStage], None] | None = None,
                        on_restart: Callable[[RayStage], Any] | None = None, poll_interval: float = 0.5,
                        task_status: Any = None) -> None:
    """``skippy up --ray``: place and run the chain until cancelled (trio; Ray calls in a thread).

    Reports the placed :class:`RayStage` list through ``task_status``; then watches, restarting
    lost stages and calling ``on_restart`` (in the trio thread) for each; on the way out it shuts
    everything down.
    """
    import trio

    chain = RayChain(model, split, stage_options=stage_options, address=address, certificates=certificates,
                     memory_per_stage=memory_per_stage, gpus_per_stage=gpus_per_stage, nodes=nodes, head=head)
    try:
        await trio.to_thread.run_sync(lambda: chain.start(announce), abandon_on_cancel=False)
        if task_status is not None:
            task_status.started(chain.stages)
        while True:
            await trio.sleep(poll_interval)
            for stage in await trio.to_thread.run_sync(chain.watch_once):
                if on_restart is not None:
                    await on_restart(stage)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(chain.shutdown)
