"""skippy 1/2/4 stages against stock llama.cpp unsplit and its RPC backend (2/4 servers), one run.

Run: ``.venv/bin/python bench/peer_compare.py [--rounds 5] [--steps 64] [--prompt 512] [--pipelined] [--quick]
[--cpus 1] [--sched]``;
issue 27's peer benchmark (decode only: hop by hop, direct return and greedy speculation at 1, 2
and 4 stages against stock and RPC 2 / 4, one interleaved run): ``... --issue27 [--rounds 5]``;
speculation alone: ``... --speculation --no-prefill [--spec-loop] [--spec-ab] [--spec-trace]``.

Strategy: every variant stays up for the whole run (three skippy chains of stage processes, six
``ggml-rpc-server`` processes; with ``--fresh-chains``, part of ``--issue27``, skippy's chains
start again before every round, so that each round meets a new page placement of the stage
processes as each llama-bench run does, instead of one placement biasing a chain's every round)
and the rounds are interleaved: each round measures every variant
once, decode then prefill, in an order rotated by one each round, so slow drifts of this shared
host's load hit them alike.  Medians over rounds and the per-round ratios to stock are printed.

* **stock**: ``llama-bench -t 1 -fa 0 -ngl 0 -r 1 -p 0 -n 64`` (decode) and ``-p 512 -n 0``
  (prefill, default ``-ub 512``) of the unpatched pinned tree (``bench/peer_build.py``); the rate
  is llama-bench's own sample from ``-o json``.
* **RPC k** (k = 2, 4): k ``ggml-rpc-server -H 127.0.0.1 -p PORT -t 1`` processes (ports below
  32768: inside the ephemeral range the server sometimes cannot bind and llama-bench then aborts)
  and the same llama-bench commands with ``-ngl 99 --rpc 127.0.0.1:P1,... -ts 8/9`` (``4/4/4/5``).
  How ``-ts`` maps layers (``src/llama-model.cpp`` ``load_tensors``): the split is over the
  model's *devices*, which are the RPC servers only (CPU devices are skipped in the device list:
  the CPU holds what is not offloaded, here just the token-embedding input layer, which llama.cpp
  always keeps on the CPU).  With ``-ngl 99`` the offloaded units are the 16 repeating layers plus
  the output layer (17), and unit ``i`` goes to the first device whose cumulative normalised split
  exceeds ``i / 17``; so ``8/9`` gives 0:8 and 8:16 + output, ``4/4/4/5`` gives 0:4, 4:8, 8:12,
  12:16 + output: exactly skippy's stage ranges (the final stage holds the head).  ``1/1`` would
  give 0:9 and 9:16 + output.  :func:`tensor_split` derives the string from the ranges and
  :func:`check_rpc_layout` reads llama-bench's ``-v`` log ("layer N assigned to device RPCi")
  once per layout at start-up and refuses to run if the ranges differ.
* **skippy k** (k = 1, 2, 4): ``python -m skippy.stage`` processes as ``bench/stage_chain.py``
  starts them (``--threads 1 --ctx-size 1024 --batch-size 512 --prefix-cache off``: every cell
  free between requests, as in llama-bench; f32 wire, the default), driven over loopback by
  ``StageClient``: decode is configure, a 1-token prefill, 64 greedy decodes (timed), stop;
  prefill is a fresh random prompt every round sent as one 512-token chunk (as llama-bench's
  single 512-row ubatch), timed to its PredictedToken.
* **in-process**: skippy's runtime called directly in this process (``Model`` + ``StageContext``
  with the stages' settings, 1 thread), the same 1-token prompt, 64 decodes each followed by the
  greedy ``sample`` the final stage does; prefill one 512-row batch.  It splits the 1-stage gap
  into the runtime's share (in-process vs stock) and the stage process + client's (skippy 1 vs
  in-process; both printed as "boundary" rows with one boundary).
* ``--speculation``: **skippy k spec**, the driver's :class:`~skippy.driver.Generator` with greedy
  speculation (n-gram drafts, verify windows) on a looping continuation: a code prompt whose greedy
  continuation by the generated weights repeats, ``--steps`` tokens, its decode rate as the
  generator measures it (first token to last); the tokens of the 1, 2 and 4-stage chains are
  compared each round.  Its CPU per token: the client's and the chain's over the request, less a
  1-token request's (the prompt's prefill and first token), over the tokens after the first.
  This stream loops for its first ~25 tokens only (then runs of 2-8): drafts are kept about half
  the time.  ``--spec-loop`` adds **skippy k loop**: the same on :data:`LOOP`, a prompt whose
  greedy continuation by the generated llama-16x1024 is one token repeated (every draft after the
  first few kept): speculation's gain where drafts are accepted.  ``--spec-ab`` adds each of them
  with the controller's bets not calibrating it (``ControllerConfig(calibrate=False)``; **...
  raw**), on the same chains, interleaved.  ``--spec-trace`` prints
  each speculating request's windows (e/c: epoch start / continuation, rows, drafts kept /
  judged, s: stale, @ the position in the continuation) and the controller's state at its end.
  ``--spec-plain`` adds **skippy k nospec**: the same generator's requests without speculation
  (a plain request: decode runs), and **skippy k spec off**: speculating requests whose controller
  never sends a window (the speculating path's plain steps: what it costs apart from the
  controller's decisions).  Each variant has its own generator, so its requests share their
  chain's costs and bets as a server's requests do.
* Peers: without ``--no-build`` the stock binaries are built (``bench/peer_build.py``); when the
  build fails, or with ``--no-build`` one is missing, the stock and RPC variants are skipped with
  a message saying so and skippy 1 stage is the reference of the ratios.
* ``--pipelined`` adds the micro-batched prefills: RPC with ``-ub 128`` (llama.cpp pipelines
  micro-batches across servers) and skippy 2/4 stages with 128-token chunks (credit 2).

* ``--cpus LIST`` runs every variant on the same CPUs: this process sets its affinity before it
  starts anything, so llama-bench, the RPC servers, the stage processes and the in-process
  runtime inherit it (each server's and stage's threads are checked).  With one CPU a
  single-stream decode is serial on one core for every variant alike: wall time is CPU time plus
  context switches, with no wake-up of an idle CPU and no placement of the chain's processes on
  the host's (here virtual) CPUs.  Unpinned on this 2-vCPU host, a hop-by-hop token of a 2-stage
  chain crosses CPUs at two more wake-ups than a 1-stage one, and its stages' compute took more
  CPU in some placements: that, not work on the chain's path, is what moved issue 27's 2-stage
  rounds (bench/RESULTS-stage.md, "Where a 2-stage hop-by-hop token goes").  On a shared
  host, use it only while the host is quiet: a pinned process cannot move away from a neighbour
  on its CPU, and a chain with more wake-ups per token loses more to one.
* ``--sched`` reports, per skippy variant, where its decode time went (:class:`Sched`): the
  client's and each stage's thread CPU (the runtime thread's share: the decode relay computes
  there), the time threads were runnable but not running, and the wall time no thread of the
  chain ran (the gap: wake-ups on the critical path, or CPUs taken by others).

CPU per token (the host is shared; CPU time is the steadier figure): in-process: the calling
thread (llama.cpp computes on it with one thread); skippy: this client process
plus the chain's stage processes (``/proc/<pid>/stat``: exited threads included).  llama-bench:
its process's CPU (``RUSAGE_CHILDREN``) plus the RPC servers' schedstat delta, minus that of a
baseline run per variant and round (``-p 0 -n 1``: load, warm-up, one token), so loading (for RPC:
shipping the weights to the servers) cancels; the decode figure is ``(run - baseline) / (n - 1)``
and the prefill one accounts for its warm-up prompt (``(run - baseline + 2 * decode) / (2 * n)``).

Per-boundary cost (ms per token per boundary, median of the per-round values): skippy k against
skippy 1 stage, ``(t_k - t_1) / (k - 1)``; RPC k against stock unsplit, ``(t_rpc_k - t_stock) /
(k - 1)`` (this one also carries the client <-> server hops, which skippy's 1-stage base already
pays); and for both, 2 -> 4, ``(t_4 - t_2) / 2``, which counts the same two extra hops on each side.

llama-bench's decode loop reads no logits; skippy's final stage samples (greedy over 32000 logits)
and its client is Python: both are part of skippy's per-token cost and are timed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peer_build import Peer, PeerBuildError, build_peer, peer_build_dir  # noqa: E402
from stage_chain import FINALS, PROCESSES, chain  # noqa: E402

from skippy.driver import GenerationRequest, Generator, StageClient  # noqa: E402
from skippy.driver import generator as generator_module  # noqa: E402
from skippy.driver.generator import Completion  # noqa: E402
from skippy.driver.speculation import ControllerConfig, SpeculativeDecoder, WindowOutcome  # noqa: E402
from skippy.net.address import Address  # noqa: E402

MODEL_PRESET = "llama-16x1024"
STAGE_COUNTS = (1, 2, 4)
STAGE_FLAGS = ["--ctx-size", "1024", "--batch-size", "512", "--prefix-cache", "off"]
BOS = 1  # the generated llama's SPM vocabulary

Sample = tuple[float, float]  # (tokens/s, CPU seconds per token)
#: The speculation workload's prompt (bench/bench_speculation.py's: the generated weights' greedy
#: continuation of it loops, so n-gram drafts are accepted).
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
#: ``--spec-loop``'s token prompt: its greedy continuation by the generated llama-16x1024 (F16) is
#: token 24576 repeated (96 tokens checked), found by trying prompts of repeated tokens.
LOOP = (BOS, *(1977, 7582) * 32)


# -- layout ---------------------------------------------------------------------------------------
def even_layout(n_layer: int, stages: int) -> list[str]:
    """``stages`` contiguous ranges of ``n_layer`` layers, as equal as possible (16 / 4: 0:4 ... 12:16)."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {stages} stages")
    ends = [round(n_layer * (index + 1) / stages) for index in range(stages)]
    return [f"{begin}:{end}" for begin, end in zip([0, *ends[:-1]], ends)]


def _ranges(splits: Sequence[str]) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (split.split(":") for split in splits)]


def tensor_split(splits: Sequence[str], n_layer: int) -> str:
    """The ``-ts`` string that gives RPC server i exactly ``splits[i]`` (the last one also the head).

    llama.cpp splits the ``n_layer + 1`` offloaded units (layers, then the output layer) over the
    devices in proportion to ``-ts``; integer weights equal to each device's unit count make the
    cumulative boundaries fall exactly on the ranges' ends.
    """
    ranges = _ranges(splits)
    if ranges[0][0] != 0 or ranges[-1][1] != n_layer or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"{splits} do not cover 0:{n_layer} contiguously")
    counts = [end - begin for begin, end in ranges]
    counts[-1] += 1  # the output layer
    return "/".join(str(count) for count in counts)


_ASSIGNED = re.compile(r"layer\s+(\d+) assigned to device (\S+),")


def layers_by_device(log: str) -> dict[str, list[int]]:
    """Units per device from llama-bench ``-v``'s "layer N assigned to device D" lines (first load)."""
    seen: dict[int, str] = {}
    for match in _ASSIGNED.finditer(log):
        seen.setdefault(int(match.group(1)), match.group(2))
    devices: dict[str, list[int]] = {}
    for layer in sorted(seen):
        devices.setdefault(seen[layer], []).append(layer)
    return devices


# -- RPC servers ----------------------------------------------------------------------------------
def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, start: int = 23000, stop: int = 32000) -> list[int]:
    """``count`` bindable loopback ports below 32768 (outside the ephemeral range)."""
    ports: list[int] = []
    base = start + (os.getpid() * 7) % (stop - start - 100)
    for offset in range(stop - start):
        port = start + (base - start + offset) % (stop - start)
        if _port_free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports in {start}..{stop}")


@contextlib.contextmanager
def rpc_servers(peer: Peer, count: int, directory: Path) -> Iterator[tuple[str, list[int]]]:
    """Start ``count`` one-thread RPC servers; yield (the ``--rpc`` list, their pids)."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        ports = free_ports(count)
        for port in ports:
            log = directory / f"rpc-{port}.log"
            with log.open("wb") as handle:
                processes.append(subprocess.Popen(
                    [str(peer.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                    stdout=handle, stderr=subprocess.STDOUT))
        for port, process in zip(ports, processes):
            deadline = time.monotonic() + 30
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    text = (directory / f"rpc-{port}.log").read_text(errors="replace")
                    raise RuntimeError(f"ggml-rpc-server on port {port} did not start:\n{text}")
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.05)
        yield ",".join(f"127.0.0.1:{port}" for port in ports), [process.pid for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int] = ()) -> float:
    """CPU time of this process plus the stage processes ``pids``, whole processes: utime + stime
    of ``/proc/<pid>/stat``, which keeps the time of threads that have exited (summing the live
    threads' schedstat, as ``stage_chain.cpu_seconds`` does, loses a thread that exits during a
    measurement, e.g. trio's idle worker threads after 10 s: the speculation rows came out at -46
    and +96 ms a token).  Clock-tick resolution (10 ms) is ~1% of a 64-token run's CPU."""
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
    return total


def _pids_cpu(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0]) / 1e9
    return total


# -- llama-bench variants -------------------------------------------------------------------------
@dataclasses.dataclass
class BenchVariant:
    """One llama-bench configuration (stock unsplit or RPC) with CPU accounting of its servers."""

    bench: Path
    model: Path
    args: list[str]
    server_pids: list[int]
    _baseline: float | None = None
    _decode_cpu: float | None = None

    def run(self, extra: Sequence[str], *, verbose: bool = False) -> tuple[dict, float, str]:
        """(llama-bench's first test as JSON, CPU seconds of it and the servers, stderr)."""
        command = [str(self.bench), "-m", str(self.model), "-t", "1", "-fa", "0", "-r", "1", *self.args,
                   *extra, "-o", "json", *(["-v"] if verbose else [])]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        servers_before = _pids_cpu(self.server_pids)
        result = subprocess.run(command, capture_output=True, text=True)
        servers = _pids_cpu(self.server_pids) - servers_before
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if result.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({result.returncode}): {' '.join(command)}\n"
                               f"{result.stderr[-3000:]}")
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) + servers
        return json.loads(result.stdout)[0], cpu, result.stderr

    def baseline(self) -> None:
        """CPU of a run that loads, warms up and decodes one token (subtracted from the next two)."""
        self._baseline = self.run(["-p", "0", "-n", "1"])[1]

    def decode(self, steps: int) -> Sample:
        assert self._baseline is not None
        test, cpu, _ = self.run(["-p", "0", "-n", str(steps)])
        self._decode_cpu = (cpu - self._baseline) / (steps - 1)
        return float(test["samples_ts"][0]), self._decode_cpu

    def prefill(self, n_prompt: int, ubatch: int) -> Sample:
        """The warm-up is a whole prompt; the baseline decoded 2 tokens (warm-up + 1) that this does not."""
        assert self._baseline is not None and self._decode_cpu is not None
        test, cpu, _ = self.run(["-p", str(n_prompt), "-n", "0", "-ub", str(ubatch)])
        return float(test["samples_ts"][0]), (cpu - self._baseline + 2 * self._decode_cpu) / (2 * n_prompt)


def check_rpc_layout(variant: BenchVariant, splits: Sequence[str], n_layer: int) -> str:
    """Load once with ``-v``; raise unless RPC server i holds exactly ``splits[i]`` (+ head on the last)."""
    _, _, log = variant.run(["-p", "0", "-n", "1"], verbose=True)
    devices = layers_by_device(log)
    got = [(units[0], units[-1] + 1) for units in devices.values()]
    want = [(begin, end) for begin, end in _ranges(splits)]
    want[-1] = (want[-1][0], want[-1][1] + 1)  # the output layer is unit n_layer
    if got != want or not all(name.startswith("RPC") for name in devices):
        raise RuntimeError(f"-ts did not give the servers skippy's ranges {splits}: {devices}")
    return ", ".join(f"{name} {units[0]}:{min(units[-1] + 1, n_layer)}{' + output' if units[-1] == n_layer else ''}"
                     for name, units in devices.items())


def cpu_list(text: str) -> set[int]:
    """``--cpus``: "1", "0,1" or "0-3" (as taskset -c reads them) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or int(last or first) < int(first):
            raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 1, 0,1 or 0-3)")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def check_affinity(pids: Sequence[int], cpus: set[int]) -> None:
    """Raise unless every thread of ``pids`` may run on exactly ``cpus`` (``--cpus``: a process
    that set its own affinity would make the variants unlike)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                got = os.sched_getaffinity(int(task.name))
                if got != cpus:
                    raise RuntimeError(f"--cpus: thread {task.name} of process {pid} runs on {sorted(got)}, "
                                       f"not {sorted(cpus)}")


@dataclasses.dataclass(frozen=True)
class Sched:
    """``--sched``: where a skippy decode's wall time went, ms per token: thread CPU (``run``) of
    this client and of each stage (``stages``, stage 0 first; the stage's threads other than its
    main trio thread in ``compute``: the runtime thread, where the decode relay computes), time
    threads were runnable but waited for a CPU (``wait``), and the wall time no thread of the
    chain ran (``gap``: wall - run; wake-ups and transfers on the critical path, or CPUs taken by
    others)."""

    wall: float
    client: float
    stages: tuple[float, ...]
    compute: tuple[float, ...]
    wait: float

    @property
    def run(self) -> float:
        return self.client + sum(self.stages)

    @property
    def gap(self) -> float:
        return self.wall - self.run


def _thread_times(pids: Sequence[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (ns on a CPU, ns runnable waiting for one) from every thread's schedstat."""
    times: dict[tuple[int, int], tuple[int, int]] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                run, wait, _ = (task / "schedstat").read_text().split()
                times[pid, int(task.name)] = int(run), int(wait)
    return times


def _sched(before: dict[tuple[int, int], tuple[int, int]], after: dict[tuple[int, int], tuple[int, int]],
           pids: Sequence[int], wall: float, steps: int) -> Sched:
    """The :class:`Sched` of one measurement (``pids``: this process, then the stages, stage 0
    first); a thread that exited between the snapshots is lost (the stages' threads live on)."""
    run: dict[int, float] = {pid: 0.0 for pid in pids}
    compute: dict[int, float] = {pid: 0.0 for pid in pids}
    wait = 0.0
    for (pid, tid), (ran, waited) in after.items():
        ran0, waited0 = before.get((pid, tid), (0, 0))
        run[pid] += (ran - ran0) / 1e6 / steps
        if tid != pid:
            compute[pid] += (ran - ran0) / 1e6 / steps
        wait += (waited - waited0) / 1e6 / steps
    return Sched(wall * 1e3 / steps, run[pids[0]], tuple(run[pid] for pid in pids[1:]),
                 tuple(compute[pid] for pid in pids[1:]), wait)


def sched_lines(scheds: dict[str, list[Sched]]) -> list[str]:
    """``--sched``'s report: per skippy variant, medians and per-round values (ms per token)."""
    lines = ["  where skippy's decode time went (ms per token, median (rounds)): wall = run + gap; run = client + "
             "stages (each stage's runtime-thread share in brackets); wait = runnable, not running"]
    for name, samples in scheds.items():
        if not samples:
            continue
        def rounds(values: Sequence[float]) -> str:
            return f"{_median(values):6.2f} ({', '.join(f'{v:.2f}' for v in values)})"
        stages = " + ".join(f"{_median([s.stages[i] for s in samples]):.2f} "
                            f"[{_median([s.compute[i] for s in samples]):.2f}]"
                            for i in range(len(samples[0].stages)))
        lines.append(f"    {name:<20} wall {rounds([s.wall for s in samples])}; run {rounds([s.run for s in samples])} "
                     f"= client {_median([s.client for s in samples]):.2f} + {stages}; "
                     f"gap {rounds([s.gap for s in samples])}; wait {rounds([s.wait for s in samples])}")
    return lines


# -- skippy chains --------------------------------------------------------------------------------
async def stage_decode(address: Address, steps: int, run: bool = False, direct: bool = False,
                       sched: list[Sched] | None = None) -> Sample:
    """(tokens/s, CPU s/token of this client + the chain's processes) of ``steps`` decodes after BOS.

    ``run``: the ``steps`` tokens as one decode run (docs/protocol.md §11: the first stage feeds
    each prediction to the next step itself) instead of one DecodeEmbd per token.  ``direct``:
    the final stage sends the predictions over a return lane (docs/protocol.md §8).  ``sched``:
    the same measurement's :class:`Sched` is appended to it.
    """
    pids = [process.pid for process in PROCESSES.get(address, [])]
    ordered = [os.getpid(), *reversed(pids)]  # (chain() starts the final stage first)
    client = await StageClient.connect(address)
    try:
        await client.configure(1)
        if direct and not await client.open_direct_return(FINALS[address], 1):
            raise AssertionError(f"the final stage {FINALS[address]} refused the return lane")
        token = (await client.prefill(1, [BOS], chunk_size=512)).token
        threads = _thread_times(ordered) if sched is not None else {}
        started, cpu_started = time.perf_counter(), cpu_seconds(pids)
        if run:
            token = (await client.start_run(1, token, 1, max_tokens=steps)).predicted
            done = 1
            while client.running:
                token = (await client.next_run_token(1)).predicted
                done += 1
            if done != steps:
                raise AssertionError(f"the decode run made {done} predictions, not {steps}")
        else:
            for position in range(1, steps + 1):
                token = (await client.decode(1, token, position)).predicted
        wall = time.perf_counter() - started
        rate, cpu = steps / wall, (cpu_seconds(pids) - cpu_started) / steps
        if sched is not None:
            sched.append(_sched(threads, _thread_times(ordered), ordered, wall, steps))
        await client.stop(1)
        return rate, cpu
    finally:
        await client.aclose()


async def stage_prefill(address: Address, prompt: Sequence[int], chunk: int) -> Sample:
    pids = [process.pid for process in PROCESSES.get(address, [])]
    client = await StageClient.connect(address)
    try:
        await client.configure(1, prompt_token_count=len(prompt))
        started, cpu_started = time.perf_counter(), cpu_seconds(pids)
        await client.prefill(1, prompt, chunk_size=chunk, credit=2)
        rate = len(prompt) / (time.perf_counter() - started)
        cpu = (cpu_seconds(pids) - cpu_started) / len(prompt)
        await client.stop(1)
        return rate, cpu
    finally:
        await client.aclose()


class _TracedDecoder(SpeculativeDecoder):
    """A decoder that keeps its windows' outcomes (``--spec-trace``): e (epoch start) or c
    (continuation), rows, drafts kept / judged, s when stale."""

    last: "_TracedDecoder | None" = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.trace: list[str] = []
        self._prompt_length = len(self.proposer) - 1  # the prompt, then the first token
        _TracedDecoder.last = self

    def on_reply(self, window_id: int, predicted: Sequence[int], **kwargs: object) -> WindowOutcome:
        outcome = super().on_reply(window_id, predicted, **kwargs)  # type: ignore[arg-type]
        window = outcome.window
        if window.drafts:
            self.trace.append(f"{'c' if window.continuation else 'e'}{len(window.inputs)}:"
                              f"{outcome.accepted}/{outcome.proposed}{'s' if outcome.stale else ''}"
                              f"@{window.base_position - self._prompt_length}")
        return outcome


def _controller_state(decoder: SpeculativeDecoder) -> str:
    """The controller's view at a request's end: R, c_1, C(2), C(9) and the pipelined correction
    (ms), the bets' q by band (a1 0.5 / 0.6 / 0.8 / 0.9) and the chain's plain steps since a window."""
    control = decoder.controller
    cost = control.cost
    bands = "/".join(f"{control.calibration(rate):.2f}" for rate in (0.5, 0.6, 0.8, 0.9))
    return (f"[R {cost.round_trip * 1e3:.1f} c1 {cost.single_row * 1e3:.1f} C2 {cost.compute(2) * 1e3:.1f} "
            f"C9 {cost.compute(9) * 1e3:.1f} corr {cost.correction(2):.2f} q {bands} "
            f"plain {control.plain_steps_since_window}]")


class Speculation:
    """Greedy speculation through a chain by the driver's generator (a fresh session each time).

    ``prompt``: the token prompt (default: :data:`CODE`'s); ``controller``: the generator's
    speculation settings (``stages`` is filled in per chain); ``trace``: keep each request's windows
    (:attr:`windows`); ``speculate``: False decodes the same requests without speculation."""

    def __init__(self, model: Path, steps: int, *, prompt: Sequence[int] | None = None,
                 controller: ControllerConfig = ControllerConfig(), trace: bool = False,
                 speculate: bool = True) -> None:
        self.generator = Generator.from_model(model, n_ctx=1024, chunk_size=128, controller=controller)
        self.prompt = tuple(self.generator.encode(CODE)) if prompt is None else tuple(prompt)
        self.steps = steps
        self.session = 100
        self.trace = trace
        self.speculate = speculate
        #: The last run's tokens and acceptance rate (compared across chains by the caller).
        self.tokens: list[int] = []
        self.acceptance = 0.0
        self.usage: dict[str, int] = {}
        #: The last run's windows (``trace``): see :class:`_TracedDecoder`.
        self.windows: list[str] = []

    async def _generate(self, address: Address, tokens: int,
                        sched: list[Sched] | None = None) -> tuple[Completion, float]:
        pids = [process.pid for process in PROCESSES.get(address, [])]
        ordered = [os.getpid(), *reversed(pids)]  # (chain() starts the final stage first)
        self.session += 1
        request = GenerationRequest(self.prompt, tokens, speculation=self.speculate)
        async with await StageClient.connect(address) as client:
            threads = _thread_times(ordered) if sched is not None else {}
            started, cpu_started = time.perf_counter(), cpu_seconds(pids)
            if self.trace:
                generator_module.SpeculativeDecoder = _TracedDecoder  # type: ignore[misc]
            try:
                done = await self.generator.generate(client, request, self.session)
            finally:
                generator_module.SpeculativeDecoder = SpeculativeDecoder  # type: ignore[misc]
            if sched is not None:  # (the whole request: its prefill and first token are a small share)
                sched.append(_sched(threads, _thread_times(ordered), ordered, time.perf_counter() - started,
                                    max(1, len(done.tokens))))
            traced = _TracedDecoder.last
            self.windows = [*traced.trace, _controller_state(traced)] if self.trace and traced else []
            _TracedDecoder.last = None
            return done, cpu_seconds(pids) - cpu_started

    async def decode(self, address: Address, sched: list[Sched] | None = None) -> Sample:
        """(decode tokens/s, CPU s/token): the CPU of a 1-token request (the prompt's prefill and
        first token) is taken off and the rest spread over the tokens after the first.
        ``sched``: the request's :class:`Sched` is appended to it."""
        _, baseline = await self._generate(address, 1)
        done, cpu = await self._generate(address, self.steps, sched)
        self.tokens = done.tokens
        self.acceptance = done.speculation.acceptance_rate if done.speculation else 0.0
        self.usage = done.speculation.as_dict() if done.speculation else {}
        return (done.timing.decode_tokens_per_second(done.completion_tokens),
                (cpu - baseline) / max(1, done.completion_tokens - 1))

    def close(self) -> None:
        self.generator.close()


class InProcess:
    """skippy's runtime called directly: the stages' context settings, 1 thread, greedy sample per token.

    Separates the runtime's share of the 1-stage gap from the stage process and client's.
    """

    def __init__(self, path: Path) -> None:
        from skippy.runtime import Model, Sampler, StageContext
        from skippy.runtime.sampling import GREEDY

        self.model = Model(path)
        self.ctx = StageContext(self.model, n_ctx=1024, max_sessions=8, n_batch=512, threads=1)
        self.sampler = Sampler(GREEDY, self.model.n_vocab)

    def decode(self, steps: int) -> Sample:
        ctx, samplers = self.ctx, [self.sampler]
        seq = ctx.open_session()
        try:
            ctx.decode(tokens=[BOS], positions=[0], seq_ids=[seq])
            token = int(ctx.sample(samplers, [0])[0])
            started, cpu_started = time.perf_counter(), time.thread_time()
            for position in range(1, steps + 1):
                ctx.decode(tokens=[token], positions=[position], seq_ids=[seq])
                token = int(ctx.sample(samplers, [0])[0])
            return steps / (time.perf_counter() - started), (time.thread_time() - cpu_started) / steps
        finally:
            ctx.close_session(seq)

    def prefill(self, prompt: Sequence[int]) -> Sample:
        ctx, n = self.ctx, len(prompt)
        seq = ctx.open_session()
        try:
            started, cpu_started = time.perf_counter(), time.thread_time()
            ctx.decode(tokens=np.asarray(prompt, dtype=np.int32), positions=np.arange(n, dtype=np.int32),
                       seq_ids=np.full(n, seq, dtype=np.int32))
            ctx.sample([self.sampler], [n - 1])
            return n / (time.perf_counter() - started), (time.thread_time() - cpu_started) / n
        finally:
            ctx.close_session(seq)

    def close(self) -> None:
        self.sampler.close()
        self.ctx.close()
        self.model.close()


# -- report ---------------------------------------------------------------------------------------
def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summary(title: str, runs: dict[str, list[Sample]], reference: str) -> list[str]:
    """One line per variant: tok/s, % of ``reference`` (median, per round), ms and CPU ms per token."""
    lines = [title]
    ref = runs[reference]
    ref_rate, ref_cpu = _median([r for r, _ in ref]), _median([c for _, c in ref])
    for name, samples in runs.items():
        if not samples:
            continue
        rate, cpu = _median([r for r, _ in samples]), _median([c for _, c in samples])
        per_round = [100 * r / s for (r, _), (s, _) in zip(samples, ref)]
        lines.append(
            f"  {name:<22} {rate:7.2f} tok/s {100 * rate / ref_rate:6.1f}% of {reference} "
            f"(rounds {', '.join(f'{x:.0f}' for x in per_round)}); {1e3 / rate:7.3f} ms/token, "
            f"CPU {cpu * 1e3:7.3f} ms/token = {reference}'s speed at {100 * ref_cpu / cpu:5.1f}%")
    return lines


def boundary_lines(runs: dict[str, list[Sample]], pairs: Sequence[tuple[str, str, int]]) -> list[str]:
    """Extra ms per token per boundary, wall and CPU: median over rounds of (t_a - t_b) / boundaries."""
    lines = ["  per-boundary cost (ms per token per boundary, median of per-round values):"]
    for label, (a, b, boundaries) in zip((f"{a} vs {b}" for a, b, _ in pairs), pairs):
        if not runs.get(a) or not runs.get(b):
            continue
        wall = [(1 / ra - 1 / rb) / boundaries * 1e3 for (ra, _), (rb, _) in zip(runs[a], runs[b])]
        cpu = [(ca - cb) / boundaries * 1e3 for (_, ca), (_, cb) in zip(runs[a], runs[b])]
        lines.append(f"    {label:<34} wall {_median(wall):+7.3f} ({', '.join(f'{x:+.2f}' for x in wall)}); "
                     f"CPU {_median(cpu):+7.3f} ({', '.join(f'{x:+.2f}' for x in cpu)})")
    return lines


BOUNDARY_PAIRS = [
    ("in-process", "stock", 1), ("skippy 1", "in-process", 1),
    ("skippy 2", "skippy 1", 1), ("skippy 4", "skippy 1", 3), ("skippy 4", "skippy 2", 2),
    ("RPC 2", "stock", 1), ("RPC 4", "stock", 3), ("RPC 4", "RPC 2", 2),
    ("skippy 2 direct", "skippy 1", 1), ("skippy 4 direct", "skippy 1", 3),
    ("skippy 2 direct relay-off", "skippy 1", 1), ("skippy 4 direct relay-off", "skippy 1", 3),
    ("skippy 1 run", "in-process", 1), ("skippy 2 run", "skippy 1 run", 1), ("skippy 4 run", "skippy 1 run", 3),
    ("skippy 2 spec", "skippy 1 spec", 1), ("skippy 4 spec", "skippy 1 spec", 3),
    ("skippy 2 spec raw", "skippy 1 spec raw", 1), ("skippy 4 spec raw", "skippy 1 spec raw", 3),
    # speculation against plain decode on the same chain (one "boundary": the difference per token)
    ("skippy 1 spec", "skippy 1", 1), ("skippy 2 spec", "skippy 2", 1), ("skippy 4 spec", "skippy 4", 1),
    ("skippy 1 spec raw", "skippy 1", 1), ("skippy 2 spec raw", "skippy 2", 1), ("skippy 4 spec raw", "skippy 4", 1),
    ("skippy 4 loop", "skippy 4", 1), ("skippy 4 loop raw", "skippy 4", 1),
    ("skippy 2 nospec", "skippy 1 nospec", 1), ("skippy 4 nospec", "skippy 1 nospec", 3),
    ("skippy 2 spec off", "skippy 1 spec off", 1), ("skippy 4 spec off", "skippy 1 spec off", 3),
    ("skippy 1 spec off", "skippy 1", 1), ("skippy 2 spec off", "skippy 2", 1), ("skippy 4 spec off", "skippy 4", 1),
    ("skippy 1 spec", "skippy 1 nospec", 1), ("skippy 2 spec", "skippy 2 nospec", 1),
    ("skippy 4 spec", "skippy 4 nospec", 1),
]


def existing_peer() -> Peer | None:
    """The already-built stock binaries (``--no-build``); None (said why) if either is missing."""
    out = peer_build_dir()
    peer = Peer(out / "bin" / "llama-bench", out / "bin" / "ggml-rpc-server", out)
    for binary in (peer.llama_bench, peer.rpc_server):
        if not binary.exists():
            print(f"SKIPPING stock and RPC: {binary} is missing (build it with "
                  f".venv/bin/python bench/peer_build.py)", flush=True)
            return None
    return peer


def built_peer() -> Peer | None:
    """The stock binaries, built now when needed; None (said why) when the build fails."""
    try:
        return build_peer()
    except PeerBuildError as exc:
        print(f"SKIPPING stock and RPC: the peer build failed: {exc}", flush=True)
        return None


# -- the run --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64, help="decode tokens per measurement")
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    parser.add_argument("--pipelined", action="store_true",
                        help="also RPC with -ub 128 and skippy 2/4 stages with 128-token chunks")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--direct-return", action="store_true",
                        help="also decode the 2- and 4-stage chains with direct return (docs/protocol.md §8)")
    parser.add_argument("--relay-off", action="store_true",
                        help="with --direct-return: also 2- and 4-stage chains started with --decode-relay off "
                             "(the decode relay's A/B in the same run)")
    parser.add_argument("--speculation", action="store_true",
                        help="also 1, 2 and 4 stages with greedy speculation on a looping continuation")
    parser.add_argument("--spec-loop", action="store_true",
                        help="with --speculation: also on a continuation that is one token repeated (LOOP)")
    parser.add_argument("--spec-ab", action="store_true",
                        help="with --speculation: also each with the bets not calibrating the controller (raw)")
    parser.add_argument("--spec-trace", action="store_true", help="print each speculating request's windows")
    parser.add_argument("--spec-only", action="store_true",
                        help="with --speculation: measure only the speculating rows (no stock, RPC, in-process "
                             "or plain skippy rows; the chains are still started)")
    parser.add_argument("--spec-plain", action="store_true",
                        help="with --speculation: also the generator's requests without speculation (nospec)")
    parser.add_argument("--issue27", action="store_true",
                        help="issue 27's peer run: --direct-return --speculation --spec-loop --no-prefill --fresh-chains")
    parser.add_argument("--decode-runs", action="store_true",
                        help="also decode each skippy chain as one decode run (docs/protocol.md §11)")
    parser.add_argument("--preset", default=MODEL_PRESET,
                        help="generated model (skippy.models preset; a llama-spm vocabulary)")
    parser.add_argument("--quick", action="store_true", help="1 round, 8 decode tokens, a 64-token prompt")
    parser.add_argument("--fresh-chains", action="store_true",
                        help="start skippy's chains again before every round (each round a new page placement "
                             "of the stage processes, as llama-bench's process is; otherwise one placement "
                             "per run biases every round of a chain alike)")
    parser.add_argument("--no-build", action="store_true",
                        help="use the peer binaries already in build/peer-*; never configure or build")
    parser.add_argument("--sched", action="store_true",
                        help="also report where each skippy decode's wall time went: each process's thread CPU, "
                             "the time threads waited for a CPU, and the gap no thread of the chain ran")
    parser.add_argument("--cpus", type=cpu_list, default=None,
                        help="run every variant's processes on these CPUs only (e.g. 1 or 0,1): this process and "
                             "so every process it starts (llama-bench, ggml-rpc-server, the stage processes, "
                             "the in-process runtime) inherit the affinity; default: wherever the kernel "
                             "places them")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.prompt = 1, 8, 64
    if args.issue27:
        args.direct_return = args.speculation = args.spec_loop = args.no_prefill = args.fresh_chains = True
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    if args.cpus is None:
        return _run(args, parser)
    previous = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, args.cpus)  # inherited by every process started from here on
    except OSError as exc:
        parser.error(f"--cpus {','.join(map(str, sorted(args.cpus)))}: {exc}")
    try:
        return _run(args, parser)
    finally:
        os.sched_setaffinity(0, previous)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from skippy.models.cache import ensure_model
    from skippy.models.spec import preset

    if args.spec_only and not args.speculation:
        parser.error("--spec-only needs --speculation (or --issue27)")
    peer = None if args.spec_only else existing_peer() if args.no_build else built_peer()
    spec = preset(args.preset)
    model = ensure_model(spec)
    n_layer = spec.n_layer
    layouts = {count: even_layout(n_layer, count) for count in STAGE_COUNTS}
    started = time.monotonic()
    load = os.getloadavg()
    print(f"peer {peer.build_dir if peer else 'none (skipped)'} ({peer_build_dir().name}); model {model.name}; 1 compute thread per process; "
          f"{args.steps} decode tokens, {args.prompt}-token prefill; {args.rounds} interleaved rounds; "
          f"CPUs {','.join(map(str, sorted(os.sched_getaffinity(0))))}{' (--cpus)' if args.cpus else ''}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    rng = np.random.default_rng(1234)
    micro = min(128, max(1, args.prompt // 4))
    with tempfile.TemporaryDirectory(prefix="skippy-peer-") as tmp, contextlib.ExitStack() as stack:
        benches: dict[str, BenchVariant] = {}
        if peer is not None:
            benches["stock"] = BenchVariant(peer.llama_bench, model, ["-ngl", "0"], [])
        for count in (2, 4) if peer is not None else ():
            endpoints, pids = stack.enter_context(rpc_servers(peer, count, Path(tmp)))
            if args.cpus:
                check_affinity(pids, args.cpus)
            split = tensor_split(layouts[count], n_layer)
            variant = BenchVariant(peer.llama_bench, model, ["-ngl", "99", "--rpc", endpoints, "-ts", split], pids)
            print(f"RPC {count}: -ts {split} -> {check_rpc_layout(variant, layouts[count], n_layer)}", flush=True)
            benches[f"RPC {count}"] = variant
        def start_chains(chain_stack: contextlib.ExitStack) -> dict[str, Any]:
            started = {f"skippy {count}": chain_stack.enter_context(chain(str(model), layouts[count], STAGE_FLAGS))
                       for count in STAGE_COUNTS}
            if args.direct_return and args.relay_off:  # the same splits without the decode relay
                for count in (2, 4):
                    started[f"skippy {count} relay-off"] = chain_stack.enter_context(
                        chain(str(model), layouts[count], [*STAGE_FLAGS, "--decode-relay", "off"]))
            for address in started.values():  # the stages' first-request paths
                trio.run(stage_decode, address, 2)
                if args.cpus:
                    check_affinity([process.pid for process in PROCESSES[address]], args.cpus)
            return started

        chain_stack = stack.enter_context(contextlib.ExitStack())
        chains = start_chains(chain_stack)

        inproc = InProcess(model)
        stack.callback(inproc.close)
        measured = [name for name in chains if not name.endswith("relay-off")]  # hop by hop, and prefill
        decode_runs: dict[str, list[Sample]] = {name: [] for name in (*benches, "in-process", *measured)}
        prefill_runs: dict[str, list[Sample]] = {name: [] for name in decode_runs}
        if args.decode_runs:  # the same chains decoding as one decode run (decode only)
            for name in measured:
                decode_runs[f"{name} run"] = []
        if args.direct_return:  # the same chains with the predictions sent straight back (decode only)
            for name in measured:
                if name != "skippy 1":
                    decode_runs[f"{name} direct"] = []
            for name in chains:
                if name.endswith("relay-off"):
                    decode_runs[f"{name[:-len(' relay-off')]} direct relay-off"] = []
        speculations: dict[str, tuple[Speculation, str]] = {}  # variant -> (its generator, its chain)
        if args.speculation:  # the same chains, greedy speculation by the generator (decode only)
            kinds = [("spec", None, ""), *([("spec", None, " raw")] if args.spec_ab else []),
                     *([("nospec", None, ""), ("spec", None, " off")] if args.spec_plain else []),
                     *([("loop", LOOP, "")] if args.spec_loop else []),
                     *([("loop", LOOP, " raw")] if args.spec_loop and args.spec_ab else [])]
            for suffix, prompt, raw in kinds:
                controller = ControllerConfig(calibrate=raw != " raw")
                if raw == " off":  # the speculating path's plain steps only: no window, no probe
                    controller = dataclasses.replace(controller, min_gain=1e9, probe_interval=1 << 30,
                                                     refresh_interval=1 << 30)
                speculation = Speculation(model, args.steps, prompt=prompt, trace=args.spec_trace,
                                          controller=controller, speculate=suffix != "nospec")
                stack.callback(speculation.close)
                for name in measured:
                    trio.run(speculation.decode, chains[name])  # its first request
                    variant = f"{name} {suffix}{raw}"
                    speculations[variant] = (speculation, name)
                    decode_runs[variant] = []
        spec_tokens: dict[str, dict[str, list[int]]] = {}  # by prompt
        if args.pipelined:
            for name in ("RPC 2", "RPC 4", "skippy 2", "skippy 4") if peer is not None else ("skippy 2", "skippy 4"):
                prefill_runs[f"{name} /{micro}"] = []
        if args.spec_only:  # the speculating rows alone (their chains are up all the same)
            for name in [name for name in decode_runs if name not in speculations]:
                del decode_runs[name]
                prefill_runs.pop(name, None)
        names = list(decode_runs)
        #: ``--sched``: per skippy variant decoded by stage_decode, where its time went.
        scheds: dict[str, list[Sched]] = {name: [] for name in names if args.sched and name.startswith("skippy")}
        for round_index in range(args.rounds):
            if args.fresh_chains and round_index > 0:  # new stage processes: a new page placement
                chain_stack.close()
                chains.clear()
                chains.update(start_chains(chain_stack))
                for speculation, chain_name in speculations.values():
                    trio.run(speculation.decode, chains[chain_name])  # the new stages' first request
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            prompt = [BOS] + [int(t) for t in rng.integers(1000, 31000, args.prompt - 1)]
            for name in order:
                if name in benches:
                    bench = benches[name]
                    bench.baseline()
                    decode_runs[name].append(bench.decode(args.steps))
                    if not args.no_prefill:
                        prefill_runs[name].append(bench.prefill(args.prompt, args.prompt))
                        if f"{name} /{micro}" in prefill_runs:
                            prefill_runs[f"{name} /{micro}"].append(bench.prefill(args.prompt, micro))
                elif name == "in-process":
                    decode_runs[name].append(inproc.decode(args.steps))
                    if not args.no_prefill:
                        prefill_runs[name].append(inproc.prefill(prompt))
                elif name in speculations:
                    speculation, chain_name = speculations[name]
                    decode_runs[name].append(trio.run(speculation.decode, chains[chain_name], scheds.get(name)))
                    spec_tokens.setdefault(str(speculation.prompt[:4]), {})[name] = speculation.tokens
                    print(f"  {name}: acceptance {speculation.acceptance:.2f}, "
                          + ", ".join(f"{key} {value}" for key, value in speculation.usage.items())
                          + (f"; windows {' '.join(speculation.windows) or '-'}" if args.spec_trace else ""),
                          flush=True)
                elif name.endswith(" run"):
                    decode_runs[name].append(trio.run(stage_decode, chains[name[:-4]], args.steps, True, False,
                                                      scheds.get(name)))
                elif name.endswith(" direct"):
                    decode_runs[name].append(trio.run(stage_decode, chains[name[:-7]], args.steps, False, True,
                                                      scheds.get(name)))
                elif name.endswith(" direct relay-off"):
                    chain_name = name[:-len(" direct relay-off")] + " relay-off"
                    decode_runs[name].append(trio.run(stage_decode, chains[chain_name], args.steps, False, True,
                                                      scheds.get(name)))
                else:
                    address = chains[name]
                    decode_runs[name].append(trio.run(stage_decode, address, args.steps, False, False,
                                                      scheds.get(name)))
                    if not args.no_prefill:
                        prefill_runs[name].append(trio.run(stage_prefill, address, prompt, args.prompt))
                        if f"{name} /{micro}" in prefill_runs:
                            prefill_runs[f"{name} /{micro}"].append(trio.run(stage_prefill, address, prompt, micro))
            if any(len({tuple(tokens) for tokens in runs.values()}) > 1 for runs in spec_tokens.values()):
                print("  MISMATCH: the speculating chains' greedy tokens differ", flush=True)
            print(f"round {round_index + 1}: " + "; ".join(
                f"{name} {runs[-1][0]:.1f} tok/s {runs[-1][1] * 1e3:.2f} ms CPU"
                for name, runs in decode_runs.items()) + " | prefill " + "; ".join(
                f"{name} {runs[-1][0]:.1f}" for name, runs in prefill_runs.items() if runs), flush=True)

    reference = "stock" if peer is not None else "skippy 1" if "skippy 1" in decode_runs else "skippy 1 spec"
    lines = summary(f"decode (tg{args.steps}), medians of {args.rounds} rounds:", decode_runs, reference)
    lines += boundary_lines(decode_runs, BOUNDARY_PAIRS)
    if args.sched:
        lines += sched_lines(scheds)
    if not args.no_prefill:
        lines += summary(f"prefill (pp{args.prompt}, one {args.prompt}-token batch/chunk unless /N), medians:",
                         prefill_runs, reference)
        lines += boundary_lines(prefill_runs, BOUNDARY_PAIRS)
    load = os.getloadavg()
    lines.append(f"took {time.monotonic() - started:.0f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
