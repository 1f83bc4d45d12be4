"""Deterministic per-token cost of a stage boundary: instruction counts of the stage processes.

Run: ``PYTHONPATH=. .venv/bin/python bench/boundary_callgrind.py [--steps N] [--cache-sim]``
(needs valgrind; minutes: every stage runs under callgrind).

Strategy: on a shared 2-core host, times swing by more than the figure being measured, while
instruction counts do not.  The script starts a 1-stage chain (0:16) and a 2-stage chain
(0:8, 8:16) of llama-16x1024 F16 with every stage process under ``valgrind --tool=callgrind
--separate-threads=yes``, warms each chain (prefill and two decodes), zeroes the counters
(``callgrind_control --zero``), runs ``--steps`` decodes, and dumps (``callgrind_control
--dump``).  For every thread it prints instructions per token, split into what ran inside
``llama_decode`` (inclusive) and the rest (Python, trio, the wire codec, syscalls' user side);
with ``--cache-sim`` also simulated last-level misses, which model what the other stages'
weight streaming leaves cold.  The per-boundary figure is the 2-stage total minus the 1-stage
total.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy.driver import StageClient  # noqa: E402
from skippy.stage.config import Address  # noqa: E402

_READY = re.compile(r"ready on (\S+):(\d+)")


def _start(model: str, splits: Sequence[str], directory: Path, cache_sim: bool,
           ) -> tuple[Address, list["subprocess.Popen[bytes]"], list[Path]]:
    processes: list[subprocess.Popen[bytes]] = []
    outputs: list[Path] = []
    downstream: Address | None = None
    for index in reversed(range(len(splits))):
        log = directory / f"stage{index}.log"
        out = directory / f"stage{index}.cg"
        command = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
                   f"--cache-sim={'yes' if cache_sim else 'no'}", "--LL=33554432,16,64",
                   sys.executable, "-m", "skippy.stage", "--model", model, "--layers", splits[index],
                   "--threads", "1", "--batch-size", "64", "--ctx-size", "1024", "--connect-timeout", "600"]
        if downstream is not None:
            command += ["--downstream", str(downstream)]
        with log.open("wb") as handle:
            process = subprocess.Popen(command, stdout=handle, stderr=handle, cwd=ROOT,
                                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
        processes.insert(0, process)
        outputs.insert(0, out)
        deadline = time.monotonic() + 1800
        while True:
            match = _READY.search(log.read_text(errors="replace"))
            if match:
                downstream = Address(match.group(1), int(match.group(2)))
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stage {splits[index]} did not start:\n{log.read_text()}")
            time.sleep(0.5)
    assert downstream is not None
    return downstream, processes, outputs


def _control(flag: str, processes: Sequence["subprocess.Popen[bytes]"]) -> None:
    for process in processes:
        # valgrind runs as the Popen'd process itself (it execs the tool in place)
        subprocess.run(["callgrind_control", flag, str(process.pid)], check=True, capture_output=True)


async def _drive(address: Address, processes: Sequence["subprocess.Popen[bytes]"], steps: int) -> float:
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599]
    client = await StageClient.connect(address)
    try:
        await client.configure(1)
        token = (await client.prefill(1, prompt, chunk_size=64)).token
        position = len(prompt)
        for _ in range(2):
            token = (await client.decode(1, token, position)).predicted
            position += 1
        _control("--zero", processes)
        started = time.process_time()
        for _ in range(steps):
            token = (await client.decode(1, token, position)).predicted
            position += 1
        client_cpu = time.process_time() - started
        _control("--dump", processes)
        await client.stop(1)
    finally:
        await client.aclose()
    return client_cpu / steps


_TOTALS = re.compile(r"^summary:\s+(.*)$", re.M)
_EVENTS = re.compile(r"^events:\s+(.*)$", re.M)


def _thread_costs(path: Path) -> list[tuple[str, dict[str, int], dict[str, int]]]:
    """(file, event totals, event totals inside llama_decode) of every dump of ``path``'s threads."""
    results = []
    for dump in sorted(path.parent.glob(path.name + "*")):
        if not re.search(r"\.\d+-\d+$", dump.name):  # PREFIX.PART-THREAD: only the explicit dumps
            continue
        text = dump.read_text(errors="replace")
        events = _EVENTS.search(text)
        totals = _TOTALS.search(text)
        if not events or not totals:
            continue
        names = events.group(1).split()
        total = dict(zip(names, (int(x) for x in totals.group(1).split())))
        inside = _inclusive(dump, "llama_decode", names)
        results.append((dump.name, total, inside))
    return results


def _inclusive(dump: Path, function: str, names: list[str]) -> dict[str, int]:
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        if re.search(rf"[?:]{function} \[", line) or line.rstrip().endswith(f":{function}"):
            numbers = re.findall(r"([\d,]+) \(", line)
            return dict(zip(names, (int(n.replace(",", "")) for n in numbers)))
    return {name: 0 for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cache-sim", action="store_true")
    parser.add_argument("--layouts", default="0:16;0:8,8:16")
    args = parser.parse_args()
    from skippy.models.cache import ensure_model
    from skippy.models.spec import preset

    model = str(ensure_model(preset("llama-16x1024")))
    grand: dict[str, dict[str, float]] = {}
    for layout in args.layouts.split(";"):
        splits = layout.split(",")
        with tempfile.TemporaryDirectory() as name:
            directory = Path(name)
            address, processes, outputs = _start(model, splits, directory, args.cache_sim)
            try:
                client = trio.run(_drive, address, processes, args.steps)
            finally:
                for process in processes:
                    process.terminate()
                for process in processes:
                    process.wait()
            summary: dict[str, float] = {}
            print(f"layout {layout}: client CPU {client * 1e6:.0f} us/token")
            for stage, out in zip(splits, outputs):
                for dump, total, inside in _thread_costs(out):
                    if total.get("Ir", 0) == 0:
                        continue
                    line = [f"  stage {stage} {dump.split('.')[-1]}:"]
                    for event in total:
                        per_token = total[event] / args.steps
                        native = inside.get(event, 0) / args.steps
                        line.append(f"{event} {per_token / 1e3:.1f}k (in llama_decode {native / 1e3:.1f}k, "
                                    f"other {(per_token - native) / 1e3:.1f}k)")
                        summary[event + " total"] = summary.get(event + " total", 0.0) + per_token
                        summary[event + " outside llama_decode"] = (
                            summary.get(event + " outside llama_decode", 0.0) + per_token - native)
                    print(" ".join(line), flush=True)
            grand[layout] = summary
    layouts = list(grand)
    if len(layouts) == 2:
        one, two = grand[layouts[0]], grand[layouts[1]]
        for key in one:
            print(f"per boundary, {key}: {one[key] / 1e3:.1f}k -> {two.get(key, 0) / 1e3:.1f}k per token "
                  f"({(two.get(key, 0) - one[key]) / 1e3:+.1f}k)")


if __name__ == "__main__":
    main()
