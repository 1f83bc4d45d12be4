"""Many users: aggregate tokens/s of N concurrent greedy completions, skippy against stock llama.cpp.

Run: ``.venv/bin/python bench/concurrency.py [--models gemma,llama] [--concurrency 1,4,8,16]
[--seconds 20] [--rounds 3] [--max-tokens 64] [--variants ...]`` (the full sweep of issue 31;
``--quick`` is a smoke: N = 1, 4, 4 s each, one round; ``--row-costs 8`` times the runtime's
decode batches of 1..8 rows per stage range instead).

Strategy: every variant of a model is started once and stays up for all its rounds (its startup
is not timed); the rounds are interleaved: each round runs every (N, variant) once, the variants in
an order rotated by one each round, so this shared host's load drifts hit them alike.  A
measurement is N client threads, each sending ``/v1/completions`` requests back to back (greedy,
``max_tokens`` new tokens, ``ignore_eos`` so every request makes all of them unless
``--no-ignore-eos``; client i has a
prompt of its own, the same in every variant) for ``--seconds``; the figure is the completion
tokens of the requests that finished, over the time from the start to the last one's end.  The
median over rounds is printed per variant and N, and the ratios of each skippy variant to each
stock one.

* **stock-2t / stock-1t**: ``llama-server -t T -tb T -np P -c P*CTX -ngl 0`` (P = the largest N:
  one slot per client, continuous batching) of the unpatched pinned tree (``bench/peer_build.py
  --server``; ``GGML_NATIVE=OFF`` like skippy's libraries).
* **rpc-2x1t**: two ``ggml-rpc-server -t 1`` and ``llama-server -t 1 --rpc A,B -ngl 99 -ts ...``,
  the layers split as skippy's 2-stage chain (``peer_compare.tensor_split``: the last server
  also holds the head).
* **skippy-1x2t / skippy-2x1t**: ``skippy up --stages S --threads T --max-sessions P`` (the cut
  balanced by cost, speculation at its default; ``skippy-2x1t-nospec`` sends ``speculation:
  false``; ``skippy-2x1t-even`` cuts the layers in halves, as ``--stages 2`` did before; any
  ``skippy-SxTt[-nospec][-even][-greedy][-passive|-spinN][-hop][-nohead][-fa]`` is understood; ``-nohead``:
  ``--head-split off``, the whole output head on the final stage as before the head split).  A skippy variant with ``-greedy`` runs its stages with ``decode_policy = "greedy"`` (every
  ready decode row at once, the scheduler before issue 31's decode groups; through a plan file).
  ``-fa`` passes ``--flash-attn on`` (llama-server's default ``auto`` turns flash attention on
  for the CPU; ``stock-2t-nofa`` / ``stock-1t-nofa`` run it with ``-fa off``, as skippy's default).
  ``-hop`` passes ``--direct-return off`` (predictions back through
  every stage; a request that does not speculate then decodes as a run the first stage drives,
  docs/protocol.md §11).  ``-passive`` / ``-spinN`` start it with ``OMP_WAIT_POLICY=PASSIVE`` / ``GOMP_SPINCOUNT=N`` in
  its environment (how the compute threads wait, over ``--thread-wait auto``: skippy.stage.threads).
  For these, from each stage's metrics port, per N (each point's rounds added up, never N's
  mixed: at N = 1 a chain's decode relay carries the rows outside the scheduler's batches, so one
  figure over N = 1 and 8 reads as fewer rows per batch, less busy and more CPU outside the
  runtime than either): the runtime's busy time (``skippy_stage_runtime_busy_seconds_total``:
  wall time in batches, each batch once; and its thread's CPU time in them), rows per decode
  batch.  Per N for every variant: the CPU time per generated token of each process
  (``/proc/PID/stat`` utime + stime): the stages (for RPC, the two servers), the API process
  (skippy's driver too; stock: llama-server) and this process (the client threads); and of each
  server process its threads' (``/proc/PID/task``, those above 0.05 ms per token, busiest first):
  a stage of T compute threads shows T busy ones (its one OpenMP pool, docs/throughput.md).  On a shared
  host the busy wall time includes time the thread waited for a CPU, and tokens/s move with the
  other load: the CPU per token is the figure to compare there.

The models: ``gemma``, the real Gemma 3 270M (``skippy[real-model]``), and ``llama``, the
generated ``llama-16x1024`` F16 (random weights, a 32000-token vocabulary).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

PROMPTS = [
    "The history of the printing press", "Write a short story about a lighthouse keeper",
    "Explain how a bicycle stays upright", "List the planets of the solar system and",
    "A recipe for bread needs", "The best way to learn a language is", "Once upon a time in a small village",
    "The causes of the first world war were", "In computer science, a hash table", "Dear diary, today I",
    "The rules of chess say that", "Photosynthesis is the process by which", "My favourite season is autumn because",
    "The stock market fell sharply when", "To build a wooden table you need", "The ocean covers most of the Earth and",
]
VARIANTS = ("stock-2t", "stock-1t", "rpc-2x1t", "skippy-1x2t", "skippy-2x1t", "skippy-2x1t-nospec", "skippy-2x1t-even")
#: Any skippy variant: stages x threads, then the modifiers in this order.
SKIPPY_VARIANT = re.compile(r"skippy-(\d+)x(\d+)t(-nospec)?(-even)?(-greedy)?(-passive|-spin\d+)?(-hop)?(-nohead)?(-fa)?")
#: A stock variant: ``-nofa`` runs llama-server with ``-fa off`` (its default is ``auto``: flash
#: attention on the CPU; skippy's stages default to off).
STOCK_VARIANT = re.compile(r"stock-([12])t(-nofa)?")
#: Context cells per slot / session (prompt + max_tokens fit with room).
SLOT_CTX = 256
#: Send ``ignore_eos`` (every request makes max_tokens tokens); --no-ignore-eos clears it.
IGNORE_EOS = True


@dataclasses.dataclass
class Running:
    """A started variant: its base URL, processes, and the stage processes to read CPU time of."""

    name: str
    url: str
    processes: list[subprocess.Popen[bytes]]
    stage_pids: list[int] = dataclasses.field(default_factory=list)
    request_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    split: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: each stage's Prometheus endpoint (skippy), in stage order
    metrics: list[str] = dataclasses.field(default_factory=list)
    #: the process that serves the API (skippy: the driver too; stock: llama-server), for its CPU time
    api_pid: int = 0


def stop(running: Running) -> None:
    """Stop a variant's processes (SIGTERM, then SIGKILL after 20 s)."""
    for process in running.processes:
        process.terminate()
    for process in running.processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


#: The stage metrics read before and after the measurements (name in the report: Prometheus sample).
STAGE_METRICS = {"compute": "skippy_stage_compute_seconds_sum", "busy": "skippy_stage_runtime_busy_seconds_total",
                 "cpu": "skippy_stage_runtime_cpu_seconds_total",
                 "rows": "skippy_stage_decode_batch_size_sum", "batches": "skippy_stage_decode_batch_size_count"}


def stage_metrics(running: Running) -> list[dict[str, float]]:
    """Each stage's :data:`STAGE_METRICS` now: ``compute`` (runtime time of all its jobs, a batch
    counted once per session in it), ``busy`` (the runtime's wall time in batches, each once),
    ``rows`` / ``batches`` (decode rows and native decode batches)."""
    values = []
    for url in running.metrics:
        text = httpx.get(url, timeout=10).text
        found = {}
        for key, name in STAGE_METRICS.items():
            match = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
            found[key] = float(match.group(1)) if match else 0.0
        values.append(found)
    return values


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """utime + stime of each live thread of a process, in seconds (a thread that ended is gone)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            found[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def start_stock(binary: Path, model: Path, threads: int, slots: int, log: Path, *,
                rpc: Sequence[str] = (), tensor_split: str = "", extra: Sequence[str] = ()) -> Running:
    port = free_port()
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", str(slots), "-c", str(slots * SLOT_CTX), "--no-warmup"]
    command += ["-ngl", "99", "--rpc", ",".join(rpc), "-ts", tensor_split] if rpc else ["-ngl", "0"]
    command += extra
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process)
    return Running("", url, [process], api_pid=process.pid)


def start_rpc_servers(binary: Path, count: int, log_dir: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    processes, addresses = [], []
    for index in range(count):
        port = 20000 + (os.getpid() * 7 + index * 13) % 12000  # below the ephemeral range (peer_compare)
        with (log_dir / f"rpc{index}.log").open("wb") as output:
            process = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                       stdout=output, stderr=subprocess.STDOUT)
        processes.append(process)
        addresses.append(f"127.0.0.1:{port}")
    time.sleep(1.0)
    return processes, addresses


def start_skippy(model: Path, stages: int, threads: int, slots: int, log_dir: Path, *, layers: str = "",
                 chain: dict[str, str] | None = None, environment: dict[str, str] | None = None,
                 extra: Sequence[str] = ()) -> Running:
    """``skippy up``; ``chain``: stage settings for every stage (through a plan file; ``layers``
    must then be given)."""
    where = ["--layers", layers] if layers else ["--stages", str(stages)]
    if chain:
        plan = log_dir / "plan.toml"
        plan.write_text("[chain]\n" + f"model = {json.dumps(str(model))}\n"
                        + "".join(f"{key} = {json.dumps(value)}\n" for key, value in chain.items())
                        + "".join(f'[[stage]]\nlayers = "{r}"\n' for r in layers.split(",")))
        where = ["--plan", str(plan)]
    command = [sys.executable, "-m", "skippy", "up", "--model", str(model), *where,
               "--threads", str(threads), "--max-sessions", str(slots), "--ctx-size", str(slots * SLOT_CTX),
               "--port", "0", "--log-dir", str(log_dir), *extra]
    with (log_dir / "up.log").open("wb") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors,
                                   env={**os.environ, **(environment or {}), "PYTHONPATH": str(ROOT)})
    assert process.stdout is not None
    url = ""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not url:
        line = process.stdout.readline().decode()
        if not line and process.poll() is not None:
            raise RuntimeError(f"skippy up exited: {(log_dir / 'up.log').read_text()[-2000:]}")
        if match := re.search(r"skippy API on (\S+)", line):
            url = match.group(1)
    threading.Thread(target=process.stdout.read, daemon=True).start()  # keep draining
    text = (log_dir / "up.log").read_text()
    stages = sorted((int(index), int(a), int(b), int(pid)) for index, a, b, pid
                    in re.findall(r"stage (\d+) \(layers (\d+):(\d+)\) pid (\d+)", text))
    metrics = []
    for index, start, end, _ in stages:
        log = (log_dir / f"stage-{index}-{start}-{end}.log").read_text()
        found = re.search(r"metrics on (http://\S+/metrics)", log)
        metrics.append(found.group(1) if found else "")
    return Running("", url, [process], stage_pids=[pid for *_, pid in stages], api_pid=process.pid,
                   split=[(start, end) for _, start, end, _ in stages], metrics=[m for m in metrics if m])


def measure(running: Running, model_id: str, clients: int, seconds: float, max_tokens: int,
            stage_compute: dict[int, float], counted: list[int] | None = None) -> float:
    """Aggregate completion tokens/s of ``clients`` threads for ``seconds`` (see the module notes);
    ``counted[0]`` gains the completion tokens made, ``counted[1]`` / ``[2]`` (when there) the
    verify windows and drafts the requests sent (``usage.skippy_speculation``)."""
    started = time.perf_counter()
    deadline = started + seconds
    tokens = [0] * clients
    windows = [0] * clients
    drafts = [0] * clients
    ends = [started] * clients

    def client(index: int) -> None:
        with httpx.Client(timeout=300) as http:
            while time.perf_counter() < deadline:
                body = {"model": model_id, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": max_tokens,
                        "temperature": 0, **running.request_extra}
                if IGNORE_EOS:
                    body["ignore_eos"] = True
                reply = http.post(f"{running.url}/v1/completions", json=body)
                reply.raise_for_status()
                usage = reply.json()["usage"]
                tokens[index] += int(usage["completion_tokens"])
                spec = usage.get("skippy_speculation") or {}
                windows[index] += int(spec.get("windows", 0))
                drafts[index] += int(spec.get("proposed", 0))
                ends[index] = time.perf_counter()
                for stage in usage.get("skippy_timing", {}).get("stages", []):
                    stage_compute[stage["stage"]] = stage_compute.get(stage["stage"], 0.0) + stage["compute_ms"]

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client, index) for index in range(clients)]:
            future.result()
    if counted is not None:
        counted[0] += sum(tokens)
        if len(counted) >= 3:
            counted[1] += sum(windows)
            counted[2] += sum(drafts)
    return sum(tokens) / max(max(ends) - started, 1e-9)


@contextlib.contextmanager
def variants(names: Sequence[str], model: Path, slots: int, log_dir: Path) -> Iterator[dict[str, Running]]:
    from peer_compare import tensor_split

    from skippy.deploy.plan import ModelShape, balanced_stages

    shape = ModelShape.from_gguf(model)
    started: dict[str, Running] = {}
    try:
        peer = None
        if any(not name.startswith("skippy") for name in names):
            from peer_build import build_peer

            peer = build_peer(server=True)
        for name in names:
            directory = log_dir / name
            directory.mkdir(parents=True, exist_ok=True)
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            if stock := STOCK_VARIANT.fullmatch(name):
                assert peer is not None and peer.llama_server is not None
                running = start_stock(peer.llama_server, model, int(stock.group(1)), slots, directory / "server.log",
                                      extra=["-fa", "off"] if stock.group(2) else [])
            elif name == "rpc-2x1t":
                assert peer is not None and peer.llama_server is not None
                servers, addresses = start_rpc_servers(peer.rpc_server, 2, directory)
                split = balanced_stages(shape, 2)[0]
                try:
                    running = start_stock(peer.llama_server, model, 1, slots, directory / "server.log", rpc=addresses,
                                          tensor_split=tensor_split([f"{a}:{b}" for a, b in split], shape.n_layer))
                except BaseException:
                    for server in servers:
                        server.kill()
                    raise
                running.processes += servers
                running.stage_pids = [server.pid for server in servers]
            else:
                shape_match = SKIPPY_VARIANT.fullmatch(name)
                assert shape_match is not None
                stages, threads = int(shape_match.group(1)), int(shape_match.group(2))
                half = shape.n_layer // 2  # -even: the cut before issue 31 (half the layers each)
                layers = f"0:{half},{half}:{shape.n_layer}" if "-even" in name else ""
                chain = None
                if "-greedy" in name:  # the stages' decode policy before issue 31
                    chain = {"decode_policy": "greedy"}
                    layers = layers or ",".join(f"{a}:{b}" for a, b in balanced_stages(shape, stages)[0])
                wait = shape_match.group(6) or ""
                environment = ({"OMP_WAIT_POLICY": "PASSIVE"} if wait == "-passive"
                               else {"GOMP_SPINCOUNT": wait.removeprefix("-spin")} if wait else {})
                running = start_skippy(model, stages, threads, slots, directory, layers=layers, chain=chain,
                                       environment=environment,
                                       extra=[*(["--direct-return", "off"] if shape_match.group(7) else []),
                                              *(["--head-split", "off"] if shape_match.group(8) else []),
                                              *(["--flash-attn", "on"] if shape_match.group(9) else [])])
                if "-nospec" in name:
                    running.request_extra = {"speculation": False}
            running.name = name
            started[name] = running
        yield started
    finally:
        for running in started.values():
            stop(running)


def model_path(name: str) -> tuple[Path, str]:
    if name == "gemma":
        from skippy.models.real import ensure_real_model

        path = ensure_real_model()
    elif name == "llama":
        from skippy.models.cache import ensure_model
        from skippy.models.spec import preset

        path = ensure_model(preset("llama-16x1024"))
    else:
        path = Path(name)
    return path, path.name.removesuffix(".gguf")


def run_model(name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    path, model_id = model_path(name)
    slots = max(args.concurrency)
    results: dict[str, dict[int, list[float]]] = {v: {n: [] for n in args.concurrency} for v in args.variants}
    compute: dict[str, dict[int, float]] = {v: {} for v in args.variants}
    #: per variant and N, over that point's rounds: wall s, tokens made, CPU s of each stage process,
    #: of the API process and of this process (the clients), and each stage's metrics' growth
    tally: dict[str, dict[int, Tally]] = {v: {n: Tally() for n in args.concurrency} for v in args.variants}
    with variants(args.variants, path, slots, log_dir / name) as running:
        for variant in running.values():  # one warm-up request each (loads pages, fills caches)
            measure(variant, model_id, 1, 0.01, 4, {})
        order = list(args.variants)
        for round_index in range(args.rounds):
            for clients in args.concurrency:
                for variant in order:
                    point, run = tally[variant][clients], running[variant]
                    began = time.perf_counter()
                    cpu_was = [cpu_seconds(pid) for pid in (os.getpid(), run.api_pid, *run.stage_pids) if pid]
                    processes = {"api": run.api_pid, **{f"stage {i}": pid for i, pid in enumerate(run.stage_pids)}}
                    threads_were = {label: thread_cpu_seconds(pid) for label, pid in processes.items() if pid}
                    metrics_were = stage_metrics(run)
                    counted = [0, 0, 0]
                    rate = measure(run, model_id, clients, args.seconds, args.max_tokens, compute[variant], counted)
                    point.add(time.perf_counter() - began, counted[0],
                              [cpu_seconds(pid) - was for pid, was
                               in zip([p for p in (os.getpid(), run.api_pid, *run.stage_pids) if p], cpu_was)],
                              bool(run.api_pid),
                              [{key: now[key] - was[key] for key in now}
                               for now, was in zip(stage_metrics(run), metrics_were)])
                    point.spec_windows += counted[1]
                    point.spec_drafts += counted[2]
                    for label, were in threads_were.items():
                        point.add_threads(label, were, thread_cpu_seconds(processes[label]))
                    results[variant][clients].append(rate)
                    print(f"  {name} round {round_index + 1} N={clients:<2} {variant:<20} {rate:7.1f} tok/s",
                          file=sys.stderr, flush=True)
            order = order[1:] + order[:1]
        splits = {v: r.split for v, r in running.items()}
    return {"model": str(path), "results": results, "compute_ms": compute, "splits": splits,
            "points": {v: {n: dataclasses.asdict(t) for n, t in by_n.items()} for v, by_n in tally.items()}}


@dataclasses.dataclass
class Tally:
    """One (variant, N) point's measurements added up over the rounds."""

    wall_s: float = 0.0
    tokens: int = 0
    client_cpu_s: float = 0.0
    api_cpu_s: float = 0.0
    #: the stage processes' (RPC servers') CPU s, in chain order
    stage_cpu_s: list[float] = dataclasses.field(default_factory=list)
    #: each stage's :data:`STAGE_METRICS` growth
    stage_metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: per process ("api", "stage 0", ...), each thread's CPU s (a stage of T compute threads
    #: should show T busy threads: one OpenMP pool, docs/throughput.md)
    thread_cpu_s: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    #: verify windows and drafts the requests sent (usage.skippy_speculation)
    spec_windows: int = 0
    spec_drafts: int = 0

    def add_threads(self, label: str, were: dict[int, float], now: dict[int, float]) -> None:
        threads = self.thread_cpu_s.setdefault(label, {})
        for tid, seconds in now.items():
            threads[tid] = threads.get(tid, 0.0) + seconds - were.get(tid, 0.0)

    def add(self, wall: float, tokens: int, cpu: list[float], api: bool, metrics: list[dict[str, float]]) -> None:
        self.wall_s += wall
        self.tokens += tokens
        self.client_cpu_s += cpu[0]
        self.api_cpu_s += cpu[1] if api else 0.0
        stages = cpu[2:] if api else cpu[1:]
        self.stage_cpu_s = [a + b for a, b in zip(self.stage_cpu_s, stages)] if self.stage_cpu_s else stages
        self.stage_metrics = ([{k: a[k] + b[k] for k in a} for a, b in zip(self.stage_metrics, metrics)]
                              if self.stage_metrics else metrics)


def report(name: str, data: dict[str, Any], args: argparse.Namespace) -> str:
    results = data["results"]
    lines = [f"## {name} ({Path(data['model']).name}), {args.max_tokens} new tokens, {args.seconds:g} s x "
             f"{args.rounds} round(s) per point; aggregate tokens/s, median over rounds", "",
             "| variant | " + " | ".join(f"N={n}" for n in args.concurrency) + " |",
             "|---|" + "---|" * len(args.concurrency)]
    medians = {v: {n: statistics.median(r[n]) for n in args.concurrency} for v, r in results.items()}
    for variant in args.variants:
        lines.append(f"| {variant} | " + " | ".join(f"{medians[variant][n]:.1f}" for n in args.concurrency) + " |")
    stock = [v for v in args.variants if not v.startswith("skippy")]
    for variant in [v for v in args.variants if v.startswith("skippy")]:
        for base in stock:
            ratios = " ".join(f"N={n}: {medians[variant][n] / medians[base][n]:.2f}x" for n in args.concurrency
                              if medians[base][n] > 0)
            lines.append(f"- {variant} / {base}: {ratios}")
    for variant in args.variants:
        split = data["splits"].get(variant)
        compute = data["compute_ms"][variant]
        if split:
            lines.append(f"- {variant} split {split}")
        if len(compute) > 1:
            total = sum(compute.values())
            shares = ", ".join(f"stage {s}: {compute[s] / total:.0%}" for s in sorted(compute))
            lines.append(f"- {variant}: compute in usage.skippy_timing (speculative windows and hop-by-hop steps "
                         f"only; decode runs report the last stage alone) {shares}")
        for clients, point in data["points"][variant].items():
            made, wall = point["tokens"], point["wall_s"]
            if not made or wall <= 0:
                continue
            # CPU per generated token: meaningful on a shared host, where tokens/s are not
            cpu = point["stage_cpu_s"]
            per = [f"stage {i} {1000 * c / made:.2f}" for i, c in enumerate(cpu)]
            per += [f"api {1000 * point['api_cpu_s'] / made:.2f}", f"clients {1000 * point['client_cpu_s'] / made:.2f}"]
            # each process's threads above 0.05 ms per token, busiest first (the compute pool shows)
            per += [f"{label} by thread " + " / ".join(f"{1000 * s / made:.2f}" for s in sorted(threads.values(), reverse=True)
                                                         if 1000 * s / made >= 0.05)
                    for label, threads in point.get("thread_cpu_s", {}).items()]
            text = (f"- {variant} N={clients}, {made} tokens over {wall:.0f} s: CPU ms per token "
                    + ", ".join(per))
            if point.get("spec_windows"):
                text += f"; speculation: {point['spec_windows']} verify windows, {point.get('spec_drafts', 0)} drafts"
            stages = point["stage_metrics"]
            if stages:
                text += "; " + "; ".join(
                    f"stage {i} runtime busy {m['busy'] / wall:.0%} (its thread's CPU {1000 * m['cpu'] / made:.2f} ms "
                    f"per token), {m['rows'] / max(m['batches'], 1):.2f} rows per decode batch ({m['batches']:.0f})"
                    for i, m in enumerate(stages))
            lines.append(text)
    return "\n".join(lines)


def row_costs(name: str, most: int, threads: int = 1) -> str:
    """``--row-costs``: the CPU time of one native decode batch of 1..``most`` rows (one per
    session) of each range of skippy's 2-stage cut and of the whole model, ``threads`` threads, in
    this process (the runtime alone: no wire, no Python around it).  What a decode group's size
    costs: a chain's stages run groups of ceil(N / stages) rows where the unsplit model runs N."""
    import numpy as np

    from skippy.deploy.plan import ModelShape, balanced_stages
    from skippy.runtime import Model, StageContext
    from skippy.runtime.model import LayerRange

    path, _ = model_path(name)
    shape = ModelShape.from_gguf(path)
    ranges = [*balanced_stages(shape, 2)[0], (0, shape.n_layer)]
    counts = list(range(1, most + 1))
    lines = [f"## {name}: CPU ms of one decode batch of n rows ({threads} thread(s), median of 3 x 5 batches; "
             "ms per row in brackets)", "", "| layers | " + " | ".join(f"n={n}" for n in counts) + " |",
             "|---|" + "---|" * len(counts)]
    noise = np.random.default_rng(0)
    for start, end in ranges:
        with Model(path, LayerRange(start, end)) as model, StageContext(
                model, n_ctx=most * 256, max_sessions=most, n_batch=most, threads=threads) as context:
            positions = [0] * most
            times: dict[int, list[float]] = {n: [] for n in counts}
            for _ in range(3):
                for n in counts:
                    activations = (noise.standard_normal((n, context.input_width)).astype(np.float32)
                                   if not model.is_first else None)
                    tokens = [1 + row for row in range(n)] if model.is_first or model.reads_tokens else None
                    for step in range(6):
                        began = time.thread_time()
                        context.decode(positions=positions[:n], seq_ids=list(range(n)), tokens=tokens,
                                       activations=activations, outputs=[True] * n if model.is_last else None)
                        if step:  # the first warms up
                            times[n].append((time.thread_time() - began) * 1e3)
                        for row in range(n):
                            positions[row] += 1
        cells = [f"{statistics.median(times[n]):.1f} ({statistics.median(times[n]) / n:.2f})" for n in counts]
        lines.append(f"| {start}:{end} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma,llama")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="smoke: N = 1, 4, 4 s, one round")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="let requests end at an end-of-generation token (ignore_eos is a logit bias, which "
                             "costs a final stage's sampler a pass over the vocabulary per row)")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--row-costs", type=int, metavar="ROWS",
                        help="only time native decode batches of 1..ROWS rows of each stage range (1 thread) and exit")
    args = parser.parse_args()
    if args.row_costs:
        for name in args.models.split(","):
            print(row_costs(name, args.row_costs), flush=True)
        return 0
    global IGNORE_EOS
    IGNORE_EOS = not args.no_ignore_eos
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = {v for v in args.variants
               if v not in VARIANTS and not SKIPPY_VARIANT.fullmatch(v) and not STOCK_VARIANT.fullmatch(v)}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)} (known: {', '.join(VARIANTS)})")
    if args.quick:
        args.concurrency, args.seconds, args.rounds = [1, 4], 4.0, 1
    log_dir = Path(tempfile.mkdtemp(prefix="skippy-concurrency-"))
    print(f"logs in {log_dir}", file=sys.stderr)
    out: dict[str, Any] = {}
    for name in args.models.split(","):
        out[name] = run_model(name, args, log_dir)
        print(report(name, out[name], args), flush=True)
        print(flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
