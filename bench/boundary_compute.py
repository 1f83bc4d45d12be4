"""Where a stage boundary's time goes with real compute: interleaved 1-stage / 2-stage chains.

Run: ``PYTHONPATH=. .venv/bin/python bench/boundary_compute.py [--rounds N] [--steps N]``.

Strategy: the cost of one extra boundary is the difference between a 2-stage chain (0:8, 8:16)
and a 1-stage chain (0:16) of real stage processes over the same generated llama-16x1024 F16,
one compute thread each, measured in interleaved rounds (medians), next to the same model decoded
in this process whole and as two stage contexts called one after the other (the split's own
llama.cpp cost, without processes; per-call means).  Besides wall time per token it reads, per token and per
thread of every stage process, what the scheduler accounts (``/proc/PID/task/TID/schedstat``: CPU
time and time spent runnable but waiting for a core; ``sched``: migrations, context switches),
and, from ``bench/decode_probe.py`` (the stages are started through it), the thread CPU and wall
time of every ``StageContext.decode`` and of every runtime job around it.  So the figure splits
into the native decode, the job's Python around it, the trio threads' messaging, and waiting.
The runtime thread of a stage is the thread with the most CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy.driver import StageClient  # noqa: E402
from skippy.net.address import Address  # noqa: E402

_READY = re.compile(r"ready on (\S+):(\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class ThreadSample:
    cpu_ns: int
    wait_ns: int
    migrations: int
    switches: int


def _thread_samples(pid: int) -> dict[int, ThreadSample]:
    samples: dict[int, ThreadSample] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run, wait, _ = (int(x) for x in (task / "schedstat").read_text().split())
            fields = {}
            for line in (task / "sched").read_text().splitlines()[2:]:
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
            migrations = int(float(fields.get("se.nr_migrations", "0")))
            switches = int(float(fields.get("nr_switches", "0")))
        except (OSError, ValueError):
            continue
        samples[int(task.name)] = ThreadSample(run, wait, migrations, switches)
    return samples


@dataclasses.dataclass(slots=True)
class Stage:
    process: "subprocess.Popen[bytes]"
    probe: Path
    address: Address | None = None


@contextmanager
def chain(model: str, splits: Sequence[str], extra: Sequence[str],
          env: dict[str, str] | None = None) -> Iterator[tuple[Address, list[Stage]]]:
    """Start probed stage processes final-first; yield the first stage's address and the stages
    (first stage first); kill them after."""
    stages: list[Stage] = []
    with tempfile.TemporaryDirectory() as directory:
        try:
            downstream: Address | None = None
            for index in reversed(range(len(splits))):
                log = Path(directory) / f"stage{index}.log"
                probe = Path(directory) / f"stage{index}.probe"
                command = [sys.executable, str(ROOT / "bench" / "decode_probe.py"), str(probe), "--model", model,
                           "--layers", splits[index], "--threads", "1", *extra]
                if downstream is not None:
                    command += ["--downstream", str(downstream)]
                with log.open("wb") as handle:
                    process = subprocess.Popen(command, stdout=handle, stderr=handle, cwd=ROOT,
                                               env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
                stages.insert(0, stage := Stage(process, probe))
                deadline = time.monotonic() + 120
                while True:
                    match = _READY.search(log.read_text(errors="replace"))
                    if match:
                        downstream = stage.address = Address(match.group(1), int(match.group(2)))
                        break
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"stage {splits[index]} did not start:\n{log.read_text()}")
                    time.sleep(0.05)
            assert downstream is not None
            yield downstream, stages
        finally:
            for stage in stages:
                stage.process.kill()
                stage.process.wait()


def _probe_lines(path: Path, offset: int) -> tuple[dict[str, list[tuple[int, int]]], int]:
    records: dict[str, list[tuple[int, int]]] = {}
    data = path.read_bytes() if path.exists() else b""
    for line in data[offset:].splitlines():
        name, cpu, wall = line.split()
        records.setdefault(name.decode(), []).append((int(cpu), int(wall)))
    return records, len(data)


@dataclasses.dataclass(slots=True)
class StageCost:
    """Per-token figures of one stage in one round (microseconds, counts)."""

    decode_cpu: float
    decode_wall: float
    job_cpu: float
    job_wall: float
    thread_job_cpu: float
    thread_job_wall: float
    runtime_thread_cpu: float
    other_threads_cpu: float
    waiting: float
    migrations: float
    switches: float


FIELDS = [field.name for field in dataclasses.fields(StageCost)]


@dataclasses.dataclass(slots=True)
class ChainCost:
    wall_us: float
    client_cpu_us: float
    stages: list[StageCost]


def _median(values: list[tuple[int, int]], index: int) -> float:
    return statistics.median(v[index] for v in values) / 1e3 if values else 0.0


def _mean(values: list[tuple[int, int]], index: int) -> float:
    """Mean per call (us): with the scheduler's per-thread totals, means add up; medians would not."""
    return statistics.fmean(v[index] for v in values) / 1e3 if values else 0.0


def pin(stages: list[Stage], compute_cpu: int, io_cpu: int) -> None:
    """Pin every stage's runtime thread (the one with the most CPU so far) to ``compute_cpu`` and
    its other threads, and this process, to ``io_cpu``."""
    for stage in stages:
        samples = _thread_samples(stage.process.pid)
        runtime = max(samples, key=lambda tid: samples[tid].cpu_ns)
        for tid in samples:
            try:
                os.sched_setaffinity(tid, {compute_cpu} if tid == runtime else {io_cpu})
            except OSError:  # a thread that has just ended
                pass
    os.sched_setaffinity(0, {io_cpu})


async def _measure(address: Address, stages: list[Stage], prompt: Sequence[int], steps: int,
                   pinned: bool = False, direct: bool = False) -> ChainCost:
    client = await StageClient.connect(address)
    try:
        await client.configure(1)
        if direct:  # docs/protocol.md §8: predictions come straight from the final stage
            assert stages[-1].address is not None and await client.open_direct_return(stages[-1].address, 1)
        token = (await client.prefill(1, prompt, chunk_size=64)).token
        position = len(prompt)
        for _ in range(2):  # warm: the first decode after prefill rebuilds the graph
            token = (await client.decode(1, token, position)).predicted
            position += 1
        if pinned:
            pin(stages, 0, 1)
        offsets = [_probe_lines(stage.probe, 0)[1] for stage in stages]
        before = [_thread_samples(stage.process.pid) for stage in stages]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            token = (await client.decode(1, token, position)).predicted
            position += 1
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        after = [_thread_samples(stage.process.pid) for stage in stages]
        probes = [_probe_lines(stage.probe, offset)[0] for stage, offset in zip(stages, offsets)]
        await client.stop(1)
    finally:
        await client.aclose()
    costs = []
    for start, end, probe in zip(before, after, probes):
        deltas = {tid: (end[tid].cpu_ns - start[tid].cpu_ns, end[tid].wait_ns - start[tid].wait_ns,
                        end[tid].migrations - start[tid].migrations, end[tid].switches - start[tid].switches)
                  for tid in end if tid in start}
        runtime = max(deltas, key=lambda tid: deltas[tid][0])
        other = sum(d[0] for tid, d in deltas.items() if tid != runtime)
        decodes, jobs = probe.get("decode", []), probe.get("job", []) + probe.get("item", [])
        threads = probe.get("thread", [])
        costs.append(StageCost(
            _mean(decodes, 0), _mean(decodes, 1), _mean(jobs, 0), _mean(jobs, 1), _mean(threads, 0), _mean(threads, 1),
            deltas[runtime][0] / steps / 1e3, other / steps / 1e3, sum(d[1] for d in deltas.values()) / steps / 1e3,
            sum(d[2] for d in deltas.values()) / steps, sum(d[3] for d in deltas.values()) / steps))
    return ChainCost(wall / steps * 1e6, cpu / steps * 1e6, costs)


def in_process(path: Path, prompt: Sequence[int], steps: int) -> tuple[float, float, float, float]:
    """(whole model, two stage contexts one after the other): median thread CPU and wall per token
    of the decode calls (us), in this process."""
    from skippy.runtime import Model, StageContext

    settings = dict(n_ctx=1024, max_sessions=8, n_batch=64, threads=1)

    def token_of(context: StageContext) -> int:
        return int(np.argmax(context.logits(int(context.output_rows[-1]))))

    def timed(call: object) -> tuple[int, int]:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        call()  # type: ignore[operator]
        return time.thread_time_ns() - cpu, time.perf_counter_ns() - wall

    with Model(path) as model, StageContext(model, **settings) as whole:  # type: ignore[arg-type]
        seq = whole.open_session()
        whole.decode(tokens=list(prompt), positions=list(range(len(prompt))), seq_ids=[seq] * len(prompt))
        token, position, whole_costs = token_of(whole), len(prompt), []
        for _ in range(steps):
            whole_costs.append(timed(lambda: whole.decode(tokens=[token], positions=[position], seq_ids=[seq])))
            token, position = token_of(whole), position + 1
    with Model(path, "0:8") as first, Model(path, "8:16") as last, \
            StageContext(first, **settings) as one, StageContext(last, **settings) as two:  # type: ignore[arg-type]
        seq_one, seq_two = one.open_session(), two.open_session()
        positions = list(range(len(prompt)))
        one.decode(tokens=list(prompt), positions=positions, seq_ids=[seq_one] * len(prompt))
        two.decode(activations=np.array(one.activations()), positions=positions, seq_ids=[seq_two] * len(prompt))
        token, position, split_costs = token_of(two), len(prompt), []
        for _ in range(steps):
            a = timed(lambda: one.decode(tokens=[token], positions=[position], seq_ids=[seq_one]))
            hidden = np.array(one.activations())
            b = timed(lambda: two.decode(activations=hidden, positions=[position], seq_ids=[seq_two]))
            split_costs.append((a[0] + b[0], a[1] + b[1]))
            token, position = token_of(two), position + 1
    return (_median(whole_costs, 0), _median(whole_costs, 1), _median(split_costs, 0), _median(split_costs, 1))


def _median_cost(costs: list[ChainCost]) -> ChainCost:
    stages = []
    for index in range(len(costs[0].stages)):
        stages.append(StageCost(*(statistics.median(getattr(c.stages[index], f) for c in costs) for f in FIELDS)))
    return ChainCost(statistics.median(c.wall_us for c in costs), statistics.median(c.client_cpu_us for c in costs),
                     stages)


def _describe(name: str, cost: ChainCost) -> str:
    parts = [f"{name}: {cost.wall_us / 1e3:.2f} ms/token, client CPU {cost.client_cpu_us:.0f} us"]
    for index, s in enumerate(cost.stages):
        parts.append(
            f"  stage {index}: decode CPU {s.decode_cpu:.0f} us (wall {s.decode_wall:.0f}), job CPU {s.job_cpu:.0f} "
            f"(wall {s.job_wall:.0f}), runtime-thread batch CPU {s.thread_job_cpu:.0f} (wall "
            f"{s.thread_job_wall:.0f}), runtime thread CPU {s.runtime_thread_cpu:.0f}, other threads "
            f"{s.other_threads_cpu:.0f}, waiting {s.waiting:.0f} us; {s.migrations:.2f} migrations, "
            f"{s.switches:.1f} switches per token")
    return "\n".join(parts)


def _total(cost: ChainCost, field: str) -> float:
    return sum(getattr(s, field) for s in cost.stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--pin", action="store_true",
                        help="also measure each chain with every runtime thread on CPU 0 and all other "
                             "threads (stages' trio threads, the client) on CPU 1")
    parser.add_argument("--ab-arg", action="append", default=[],
                        help="also measure both chains with this extra stage argument (repeatable; A/B in "
                             "the same rounds), e.g. --ab-arg=--inline-decode --ab-arg=off")
    parser.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE",
                        help="also measure both chains with this variable in the stages' environment "
                             "(repeatable; with --ab-arg, the B chains get both)")
    parser.add_argument("--direct-return", action="store_true",
                        help="decode with direct return (docs/protocol.md §8), so the 2-stage chain's first "
                             "stage uses the decode relay (its probe then sees only the first decode: the "
                             "per-stage CPU split is the Python path's; wall and thread CPU stay exact)")
    parser.add_argument("--stage-arg", action="append", default=[],
                        help="extra argument for every stage process (repeatable)")
    args = parser.parse_args()
    direct = args.direct_return

    from skippy.models.cache import ensure_model
    from skippy.models.spec import preset

    path = ensure_model(preset("llama-16x1024"))
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599]
    flags = ["--batch-size", "64", "--ctx-size", "1024", *args.stage_arg]
    locals_: list[tuple[float, float, float, float]] = []
    ones: list[ChainCost] = []
    twos: list[ChainCost] = []
    pinned_ones: list[ChainCost] = []
    pinned_twos: list[ChainCost] = []
    every_cpu = os.sched_getaffinity(0)
    ab_ones: list[ChainCost] = []
    ab_twos: list[ChainCost] = []
    ab_env = dict(item.split("=", 1) for item in args.ab_env)
    ab = " ".join([*args.ab_arg, *args.ab_env])
    with ExitStack() as stack:
        one, one_stages = stack.enter_context(chain(str(path), ["0:16"], flags))
        two, two_stages = stack.enter_context(chain(str(path), ["0:8", "8:16"], flags))
        if ab:
            ab_one, ab_one_stages = stack.enter_context(chain(str(path), ["0:16"], [*flags, *args.ab_arg], ab_env))
            ab_two, ab_two_stages = stack.enter_context(chain(str(path), ["0:8", "8:16"], [*flags, *args.ab_arg],
                                                              ab_env))
        for _ in range(args.rounds):  # interleaved: machine noise hits every layout alike
            locals_.append(in_process(path, prompt, args.steps))
            ones.append(trio.run(_measure, one, one_stages, prompt, args.steps, False, direct))
            twos.append(trio.run(_measure, two, two_stages, prompt, args.steps, False, direct))
            if ab:
                ab_ones.append(trio.run(_measure, ab_one, ab_one_stages, prompt, args.steps, False, direct))
                ab_twos.append(trio.run(_measure, ab_two, ab_two_stages, prompt, args.steps, False, direct))
                print(f"round, with {ab}: 1 stage {ab_ones[-1].wall_us / 1e3:.2f}, 2 stages "
                      f"{ab_twos[-1].wall_us / 1e3:.2f} ms/token", flush=True)
            if args.pin:
                pinned_ones.append(trio.run(_measure, one, one_stages, prompt, args.steps, True))
                pinned_twos.append(trio.run(_measure, two, two_stages, prompt, args.steps, True))
                for stage in one_stages + two_stages:
                    for tid in _thread_samples(stage.process.pid):
                        try:
                            os.sched_setaffinity(tid, every_cpu)
                        except OSError:
                            pass
                os.sched_setaffinity(0, every_cpu)
            print(f"round: in process whole {locals_[-1][1] / 1e3:.2f} / split {locals_[-1][3] / 1e3:.2f} ms decode "
                  f"wall; chains 1 stage {ones[-1].wall_us / 1e3:.2f}, 2 stages {twos[-1].wall_us / 1e3:.2f} "
                  f"ms/token; boundary {(twos[-1].wall_us - ones[-1].wall_us) / 1e3:+.2f} ms", flush=True)
    whole_cpu, whole_wall, split_cpu, split_wall = (statistics.median(x[k] for x in locals_) for k in range(4))
    print(f"in process, decode per token: whole {whole_cpu:.0f} us CPU ({whole_wall:.0f} wall), "
          f"two contexts {split_cpu:.0f} us CPU ({split_wall:.0f} wall): split {split_cpu - whole_cpu:+.0f} us CPU")
    _report("", ones, twos)
    if ab:
        _report(f"with {ab}: ", ab_ones, ab_twos)
    if args.pin:
        _report("pinned (runtime threads on CPU 0, everything else on CPU 1) ", pinned_ones, pinned_twos)


def _report(label: str, ones: list[ChainCost], twos: list[ChainCost]) -> None:
    one_cost, two_cost = _median_cost(ones), _median_cost(twos)
    print(_describe(label + "1-stage chain", one_cost))
    print(_describe(label + "2-stage chain", two_cost))
    boundaries = [t.wall_us - o.wall_us for o, t in zip(ones, twos)]
    print(f"{label}per boundary (2 stages - 1 stage), medians: wall {statistics.median(boundaries):.0f} us "
          f"(rounds {', '.join(f'{b:.0f}' for b in boundaries)})")
    for field in FIELDS[:9]:
        print(f"  {field}: {_total(one_cost, field):.0f} -> {_total(two_cost, field):.0f} us "
              f"({_total(two_cost, field) - _total(one_cost, field):+.0f})")
    one_all = _total(one_cost, "runtime_thread_cpu") + _total(one_cost, "other_threads_cpu")
    two_all = _total(two_cost, "runtime_thread_cpu") + _total(two_cost, "other_threads_cpu")
    one_out, two_out = one_all - _total(one_cost, "job_cpu"), two_all - _total(two_cost, "job_cpu")
    print(f"  stage processes' CPU, all threads: {one_all:.0f} -> {two_all:.0f} us ({two_all - one_all:+.0f}); "
          f"outside the runtime job (trio, hand-offs, write-through): {one_out:.0f} -> {two_out:.0f} us "
          f"({two_out - one_out:+.0f})")
    print(f"  client CPU: {one_cost.client_cpu_us:.0f} -> {two_cost.client_cpu_us:.0f} us "
          f"({two_cost.client_cpu_us - one_cost.client_cpu_us:+.0f})")


if __name__ == "__main__":
    main()
