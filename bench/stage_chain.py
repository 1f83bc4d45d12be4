"""End-to-end stage-chain benchmarks: per-boundary overhead, split vs unsplit decode, batching.

Run: ``PYTHONPATH=. .venv/bin/python bench/stage_chain.py [--quick] [--null-only] [--repeat N]``.
Prints one line per figure.

* **Boundary overhead** (null runtime, no compute): decode latency per token of a 1-stage and a
  3-stage chain of null stages on loopback at width 4096 (f32 frames); the overhead of one stage
  boundary is ``(t3 - t1) / 2`` per token (target <= 150 us).
* **Boundary overhead, one process**: the same chains as stage servers inside this process's trio
  run (still real loopback TCP between client and stages): one thread does every hop's work, so
  the difference is the software cost of a boundary without the operating system's part of
  running four processes on this host's cores (wake-ups on another core, caches that each
  process finds cold after the others ran).  Both figures are printed.
* **Split vs unsplit** (a benchmark-shaped generated llama, 16 x 1024, F16): decode tokens/s of the
  whole model in this process, against 2- and 4-stage chains of real processes (targets >= 95%
  and >= 90%), measured alternately ``--repeat`` times (medians, and each round's ratio).  Every
  process uses one compute thread, so the comparison is per-token work plus the chain's overhead,
  not parallelism.
  Each chain line also gives the CPU time per token of the client and all stage processes (from
  ``/proc``), against the unsplit run's: on a shared machine that ratio is the stable one.
* **Aggregate decode** with 8 concurrent sessions against 1 on a 2-stage chain (cross-session
  batching).
* ``--shortcuts``: only the lane shortcuts' figures (``skippy/stage/connection.py``), each
  switch on and off in the same run, rounds interleaved: per-token decode latency and CPU of a
  3-stage null chain (and its per-boundary cost against a 1-stage chain of the same switches), a
  2-stage chain of the tiny llama-4x64 (real runtime thread, negligible compute: the hand-backs
  dominate) and of llama-16x1024 F16; then the null and llama-4x64 chains as stage servers in
  this process (CPU of one process: the steadiest figure on a shared host).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy.driver import StageClient  # noqa: E402
from skippy.net.address import Address  # noqa: E402

_READY = re.compile(r"ready on (\S+):(\d+)")

#: The stage processes of each running chain, by first-stage address (for CPU accounting).
PROCESSES: dict[Address, list["subprocess.Popen[bytes]"]] = {}
#: The final stage's address of each running chain, by first-stage address (for direct return).
FINALS: dict[Address, Address] = {}


def cpu_seconds(pids: Sequence[int] = ()) -> float:
    """CPU time of this process plus ``pids`` (every thread), from the scheduler's ns counters.

    On a shared machine wall time mostly measures the neighbours; CPU time measures the work.
    """
    total = time.process_time()
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0]) / 1e9
    return total


@contextmanager
def chain(model: str, splits: Sequence[str], extra: Sequence[str] = (),
          per_stage: Sequence[Sequence[str]] = ()) -> Iterator[Address]:
    """Start stage processes final-first (each with ``extra``, and stage i with ``per_stage[i]``);
    yield the first stage's address; kill them after."""
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as directory:
        try:
            downstream: Address | None = None
            final: Address | None = None
            for index in reversed(range(len(splits))):
                log = Path(directory) / f"stage{index}.log"
                command = [sys.executable, "-m", "skippy.stage", "--model", model, "--layers", splits[index],
                           "--threads", "1", *extra, *(per_stage[index] if per_stage else ())]
                if downstream is not None:
                    command += ["--downstream", str(downstream)]
                with log.open("wb") as handle:
                    process = subprocess.Popen(command, stdout=handle, stderr=handle, cwd=ROOT,
                                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
                processes.append(process)
                deadline = time.monotonic() + 120
                while True:
                    match = _READY.search(log.read_text(errors="replace"))
                    if match:
                        downstream = Address(match.group(1), int(match.group(2)))
                        final = final or downstream
                        break
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"stage {splits[index]} did not start:\n{log.read_text()}")
                    time.sleep(0.05)
            assert downstream is not None
            PROCESSES[downstream] = processes
            FINALS[downstream] = final  # type: ignore[assignment]
            yield downstream
        finally:
            PROCESSES.pop(downstream, None)  # type: ignore[arg-type]
            FINALS.pop(downstream, None)  # type: ignore[arg-type]
            for process in processes:
                process.kill()
                process.wait()


async def decode_seconds_per_token(address: Address, prompt: Sequence[int], steps: int, *,
                                   sessions: int = 1) -> float:
    """Wall time per decode step (all sessions together) after prefill."""
    return (await decode_cost_per_token(address, prompt, steps, sessions=sessions))[0]


async def decode_cost_per_token(address: Address, prompt: Sequence[int], steps: int, *,
                                sessions: int = 1) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the client and every stage process) per decode step."""
    pids = [process.pid for process in PROCESSES.get(address, [])]
    clients = [await StageClient.connect(address) for _ in range(sessions)]
    try:
        firsts = []
        for index, client in enumerate(clients):
            await client.configure(index + 1)
            firsts.append((await client.prefill(index + 1, prompt, chunk_size=64)).token)

        async def run(index: int) -> None:
            token, position = firsts[index], len(prompt)
            for _ in range(steps):
                token = (await clients[index].decode(index + 1, token, position)).predicted
                position += 1

        started, cpu_started = time.perf_counter(), cpu_seconds(pids)
        async with trio.open_nursery() as nursery:
            for index in range(sessions):
                nursery.start_soon(run, index)
        elapsed, cpu = time.perf_counter() - started, cpu_seconds(pids) - cpu_started
        for index, client in enumerate(clients):
            await client.stop(index + 1)
        return elapsed / steps, cpu / steps
    finally:
        for client in clients:
            await client.aclose()


def boundary_overhead_us(steps: int = 400, width: int = 4096, repeat: int = 1) -> tuple[float, float, float]:
    """(1-stage us/token, 3-stage us/token, overhead per boundary us) with the null runtime.

    Both chains stay up; with ``repeat > 1`` the two are measured alternately ``repeat`` times
    and the medians are reported (the machine is shared: interleaving cancels slow drifts).
    """
    model = f"null:n_embd={width},n_layer=3,n_vocab=32000"
    prompt = list(range(1, 9))
    ones: list[float] = []
    threes: list[float] = []
    with chain(model, ["0:3"]) as first, chain(model, ["0:1", "1:2", "2:3"]) as second:
        for _ in range(repeat):
            ones.append(trio.run(decode_seconds_per_token, first, prompt, steps))
            threes.append(trio.run(decode_seconds_per_token, second, prompt, steps))
    one, three = statistics.median(ones), statistics.median(threes)
    return one * 1e6, three * 1e6, (three - one) / 2 * 1e6


def boundary_overhead_in_process_us(steps: int = 400, width: int = 4096,
                                    repeat: int = 1) -> tuple[float, float, float]:
    """As :func:`boundary_overhead_us`, with the stage servers in this process's trio run."""
    from skippy.stage.config import config_from_mapping
    from skippy.stage.server import StageServer, load_runtime

    model = f"null:n_embd={width},n_layer=3,n_vocab=32000"
    prompt = list(range(1, 9))

    async def measure(splits: Sequence[str]) -> float:
        async with trio.open_nursery() as nursery:
            servers: list[StageServer] = []
            downstream: Address | None = None
            for layers in reversed(splits):
                config = config_from_mapping({"model": model, "layers": layers, "downstream": downstream,
                                              "batch_size": 64, "connect_timeout": 2})
                server = StageServer(config, load_runtime(config))
                downstream = await nursery.start(server.serve)
                servers.append(server)
            assert downstream is not None
            seconds = await decode_seconds_per_token(downstream, prompt, steps)
            for server in servers:
                server.shutdown()
            return seconds

    ones: list[float] = []
    threes: list[float] = []
    for _ in range(repeat):
        ones.append(trio.run(measure, ["0:3"]))
        threes.append(trio.run(measure, ["0:1", "1:2", "2:3"]))
    one, three = statistics.median(ones), statistics.median(threes)
    return one * 1e6, three * 1e6, (three - one) / 2 * 1e6


#: The lane-shortcut combinations ``--shortcuts`` compares (stage flags per label).
SHORTCUTS: dict[str, list[str]] = {
    "both on": [],
    "write-through off": ["--write-through", "off"],
    "inline hand-offs off": ["--inline-hand-offs", "off"],
    "both off": ["--write-through", "off", "--inline-hand-offs", "off"],
}


def shortcuts_ab(repeat: int, quick: bool) -> None:
    """Print the ``--shortcuts`` figures (see the module header)."""
    from contextlib import ExitStack

    from skippy.models.cache import ensure_model
    from skippy.models.spec import preset

    null_model = "null:n_embd=4096,n_layer=3,n_vocab=32000"
    tiny = str(ensure_model(preset("tiny-llama")))
    big = str(ensure_model(preset("llama-16x1024")))
    flags = ["--batch-size", "64", "--ctx-size", "1024"]
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599]
    cases = [  # (name, model, splits, extra flags, decode steps)
        ("null 1 stage", null_model, ["0:3"], [], 100 if quick else 400),
        ("null 3 stages", null_model, ["0:1", "1:2", "2:3"], [], 100 if quick else 400),
        ("llama-4x64 2 stages", tiny, ["0:2", "2:4"], flags, 50 if quick else 200),
        ("llama-16x1024 2 stages", big, ["0:8", "8:16"], flags, 16 if quick else 48),
    ]
    in_process = [  # the same chains as stage servers in this trio run: CPU is this process's
        ("null 1 stage, one process", null_model, ["0:3"], 100 if quick else 400),
        ("null 3 stages, one process", null_model, ["0:1", "1:2", "2:3"], 100 if quick else 400),
        ("llama-4x64 2 st., one process", tiny, ["0:2", "2:4"], 50 if quick else 200),
    ]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with ExitStack() as stack:
        addresses = {(case[0], label): stack.enter_context(chain(case[1], case[2], [*case[3], *switches]))
                     for case in cases for label, switches in SHORTCUTS.items()}
        labels = list(SHORTCUTS)
        for round_ in range(repeat):  # interleaved rounds: machine noise hits every combination alike
            # each round starts with the next combination: none always runs first (after the
            # 16x1024 chains have flushed the caches) or last
            order = labels[round_ % len(labels):] + labels[:round_ % len(labels)]
            for name, _model, _splits, _flags, steps in cases:
                for label in order:
                    cost = trio.run(decode_cost_per_token, addresses[name, label], prompt, steps)
                    results.setdefault((name, label), []).append(cost)
            for name, model, splits, steps in in_process:
                for label in order:
                    switches = SHORTCUTS[label]
                    settings = {"write_through": "--write-through" not in switches,
                                "inline_hand_offs": "--inline-hand-offs" not in switches}
                    cost = trio.run(_in_process_cost, model, splits, settings, prompt, steps)
                    results.setdefault((name, label), []).append(cost)
    cases = [*cases, *((name, model, splits, [], steps) for name, model, splits, steps in in_process)]
    medians = {key: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
               for key, runs in results.items()}
    for name, *_ in cases:
        base_wall, base_cpu = medians[name, "both on"]
        for label in SHORTCUTS:
            wall, cpu = medians[name, label]
            print(f"{name:24s} {label:21s}: {wall * 1e6:8.0f} us/token ({(wall - base_wall) * 1e6:+6.0f}), "
                  f"CPU {cpu * 1e6:8.0f} us/token ({(cpu - base_cpu) * 1e6:+6.0f})")
    for where in ("", ", one process"):
        for label in SHORTCUTS:
            one, three = medians[f"null 1 stage{where}", label], medians[f"null 3 stages{where}", label]
            print(f"null boundary{where}, {label:21s}: {(three[0] - one[0]) / 2 * 1e6:.0f} us wall, "
                  f"{(three[1] - one[1]) / 2 * 1e6:.0f} us CPU per boundary")


async def _in_process_cost(model: str, splits: Sequence[str], settings: dict[str, object], prompt: Sequence[int],
                           steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per decode step of a chain of stage servers in this trio run."""
    from skippy.stage.config import config_from_mapping
    from skippy.stage.server import StageServer, load_runtime

    async with trio.open_nursery() as nursery:
        servers: list[StageServer] = []
        downstream: Address | None = None
        for layers in reversed(splits):
            config = config_from_mapping({"model": model, "layers": layers, "downstream": downstream, "threads": 1,
                                          "batch_size": 64, "ctx_size": 1024, "connect_timeout": 2, **settings})
            server = StageServer(config, load_runtime(config))
            downstream = await nursery.start(server.serve)
            servers.append(server)
        assert downstream is not None
        cost = await decode_cost_per_token(downstream, prompt, steps)
        for server in servers:
            server.shutdown()
    return cost


def unsplit_tokens_per_second(path: Path, prompt: Sequence[int], steps: int) -> float:
    return unsplit_cost_per_token(path, prompt, steps)[0] ** -1


def unsplit_cost_per_token(path: Path, prompt: Sequence[int], steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per decode step of the whole model in this process."""
    from skippy.runtime import Model, StageContext
    import numpy as np

    with Model(path) as model, StageContext(model, n_ctx=1024, max_sessions=8, n_batch=64, threads=1) as ctx:
        seq = ctx.open_session()
        ctx.decode(tokens=list(prompt), positions=list(range(len(prompt))), seq_ids=[seq] * len(prompt))
        token = int(np.argmax(ctx.logits(int(ctx.output_rows[-1]))))
        position = len(prompt)
        started, cpu_started = time.perf_counter(), cpu_seconds()
        for _ in range(steps):
            ctx.decode(tokens=[token], positions=[position], seq_ids=[seq])
            token = int(np.argmax(ctx.logits(int(ctx.output_rows[-1]))))
            position += 1
        return (time.perf_counter() - started) / steps, (cpu_seconds() - cpu_started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--null-only", action="store_true", help="only the null-runtime boundary overhead")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure the layouts of each figure alternately this many times; report medians")
    parser.add_argument("--shortcuts", action="store_true",
                        help="only the lane shortcuts, each switch on and off in the same run")
    args = parser.parse_args()
    if args.shortcuts:
        shortcuts_ab(max(1, args.repeat), args.quick)
        return
    steps = 40 if args.quick else 200
    one, three, overhead = boundary_overhead_us(steps * 2, repeat=max(1, args.repeat))
    print(f"null runtime, width 4096 f32, stage processes: 1 stage {one:.0f} us/token, 3 stages {three:.0f} "
          f"us/token, overhead per boundary {overhead:.0f} us (target <= 150)")
    one, three, overhead = boundary_overhead_in_process_us(steps * 2, repeat=max(1, args.repeat))
    print(f"null runtime, width 4096 f32, stages in one process: 1 stage {one:.0f} us/token, 3 stages "
          f"{three:.0f} us/token, overhead per boundary {overhead:.0f} us (target <= 150)")
    if args.null_only:
        return

    from skippy.models.cache import ensure_model
    from skippy.models.spec import preset

    path = ensure_model(preset("llama-16x1024"))
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599]
    decode_steps = 16 if args.quick else 48
    flags = ["--batch-size", "64", "--ctx-size", "1024"]
    layouts = (["0:8", "8:16"], ["0:4", "4:8", "8:12", "12:16"])
    references: list[tuple[float, float]] = []
    costs: dict[int, list[tuple[float, float]]] = {len(splits): [] for splits in layouts}
    with chain(str(path), layouts[0], flags) as two, chain(str(path), layouts[1], flags) as four:
        for _ in range(max(1, args.repeat)):  # interleaved rounds: machine noise hits all alike
            references.append(unsplit_cost_per_token(path, prompt, decode_steps))
            for count, address in ((2, two), (4, four)):
                costs[count].append(trio.run(decode_cost_per_token, address, prompt, decode_steps))
    reference = 1.0 / statistics.median(wall for wall, _ in references)
    reference_cpu = statistics.median(cpu for _, cpu in references)
    print(f"llama-16x1024 F16 unsplit (in process, 1 thread): {reference:.1f} tok/s, "
          f"{reference_cpu * 1e3:.1f} ms CPU/token")
    for count, measured in costs.items():
        rate = 1.0 / statistics.median(wall for wall, _ in measured)
        cpu = statistics.median(cpu for _, cpu in measured)
        ratios = [100 * u / w for (w, _), (u, _) in zip(measured, references)]
        target = 95 if count == 2 else 90
        print(f"{count}-stage chain: {rate:.1f} tok/s = {100 * rate / reference:.1f}% of unsplit "
              f"(target >= {target}%; per round {', '.join(f'{x:.1f}' for x in ratios)}); "
              f"CPU {cpu * 1e3:.1f} ms/token (all processes) = unsplit's at {100 * reference_cpu / cpu:.1f}%")
    with chain(str(path), ["0:8", "8:16"], flags) as address:
        single = 1.0 / trio.run(decode_seconds_per_token, address, prompt, decode_steps)
        eight = 8.0 / trio.run(functools.partial(decode_seconds_per_token, sessions=8), address, prompt, decode_steps)
    print(f"2-stage aggregate decode: 1 session {single:.1f} tok/s, 8 sessions {eight:.1f} tok/s "
          f"({eight / single:.2f}x)")


if __name__ == "__main__":
    main()
