"""Issue 29 figures: the decode cost of heartbeats, and the time to a ready replacement of a lost stage.

``python bench/replacement.py cost --model M`` starts two 3-stage ``skippy up`` chains of the same
model, one with heartbeats off (``--heartbeat-timeout 0``) and one with them on (the default), and
times streamed greedy decodes on each in interleaved rounds (per-token time = the gap between the
first and the last streamed token over the tokens in between), then reads each stage's CPU time
over ``--idle`` seconds with no request (what the heartbeats cost, undrowned by the decode noise).
``python bench/replacement.py replace --model M`` starts one chain with ``--restarts``, SIGKILLs
stage 1 and times, from the kill, the launcher's "ready again" and ``/health`` answering 200
again; then the same with ``--standby`` once the standby has loaded.  Results: ``bench/RESULTS-replacement.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
_URL = re.compile(r"skippy API on (http://\S+)")
_STAGE = re.compile(r"stage (\d) \(layers \S+\) pid (\d+) ready on (\S+)")
_AGAIN = re.compile(r"stage (\d) \(layers \S+\) pid (\d+) (restarted|standby) in ([\d.]+) s, ready again")


class Chain:
    """One ``skippy up`` process."""

    def __init__(self, model: Path, layers: str, *extra: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="skippy-bench-replace-"))
        self.err = self.dir / "err"
        self.out = self.dir / "out"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "skippy", "up", "--model", str(model), "--layers", layers, "--port", "0",
                 "--ctx-size", "512", "--threads", "1", "--log-dir", str(self.dir / "logs"), *extra],
                stdout=out, stderr=err, env=env, cwd=ROOT)
        self.url = ""
        deadline = time.monotonic() + 600
        while not self.url:
            found = _URL.search(self.out.read_text())
            if found:
                self.url = found.group(1)
            elif self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"skippy up did not start:\n{self.err.read_text()}")
            time.sleep(0.05)
        self.model_id = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def pids(self) -> dict[int, int]:
        text = self.err.read_text()
        found = {int(m.group(1)): int(m.group(2)) for m in _STAGE.finditer(text)}
        found.update({int(m.group(1)): int(m.group(2)) for m in _AGAIN.finditer(text)})
        return found

    def decode_ms(self, tokens: int) -> float:
        """Per-token time of one streamed greedy decode of ``tokens`` tokens."""
        stamps: list[float] = []
        body = {"model": self.model_id, "prompt": "The history of the city", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    if json.loads(line[6:])["choices"][0].get("text"):
                        stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000

    def cpu_seconds(self) -> list[float]:
        """CPU seconds (user + system) used so far by each stage process, stages in order."""
        ticks = os.sysconf("SC_CLK_TCK")
        used = []
        for _, pid in sorted(self.pids().items()):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            used.append((int(fields[11]) + int(fields[12])) / ticks)
        return used

    def stop(self) -> None:
        pids = list(self.pids().values())
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def cost(args: argparse.Namespace) -> None:
    off = Chain(args.model, args.layers, "--heartbeat-timeout", "0")
    on = Chain(args.model, args.layers)
    try:
        results: dict[str, list[float]] = {"off": [], "on": []}
        for chain in (off, on):
            chain.decode_ms(8)  # warm-up
        for round_ in range(args.rounds):
            order = [("off", off), ("on", on)] if round_ % 2 == 0 else [("on", on), ("off", off)]
            for name, chain in order:
                results[name].append(chain.decode_ms(args.tokens))
        median = {name: statistics.median(values) for name, values in results.items()}
        print(f"model {args.model.name}, layers {args.layers}, "
              f"{args.rounds} interleaved rounds of {args.tokens} tokens")
        for name, values in results.items():
            print(f"heartbeats {name:3}: median {median[name]:.3f} ms/token  "
                  f"(min {min(values):.3f}, max {max(values):.3f})")
        print(f"on / off = {median['on'] / median['off']:.4f}")
        idle = {name: chain.cpu_seconds() for name, chain in (("off", off), ("on", on))}
        time.sleep(args.idle)
        for name, chain in (("off", off), ("on", on)):
            used = [(after - before) / args.idle * 1000 for before, after in zip(idle[name], chain.cpu_seconds())]
            print(f"heartbeats {name:3}: idle stage CPU {', '.join(f'{ms:.2f}' for ms in used)} ms per second "
                  f"(stages 0, 1, 2 over {args.idle:g} s)")
    finally:
        off.stop()
        on.stop()


def replace(args: argparse.Namespace) -> None:
    for mode in ("restart", "standby"):
        chain = Chain(args.model, args.layers, "--restarts", "3", *(["--standby"] if mode == "standby" else []))
        try:
            if mode == "standby":
                deadline = time.monotonic() + 600
                while not any("waiting for activation" in p.read_text()
                              for p in (chain.dir / "logs").glob("stage-1-*standby*.log")):
                    assert time.monotonic() < deadline, "the standby never loaded"
                    time.sleep(0.05)
            before = chain.decode_ms(8)
            victim = chain.pids()[1]
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            ready = None
            while ready is None:
                found = _AGAIN.search(chain.err.read_text())
                if found:
                    ready = time.monotonic() - killed
                    reported = float(found.group(4))
                time.sleep(0.005)
            while httpx.get(chain.url + "/health", timeout=10).status_code != 200:
                time.sleep(0.005)
            healthy = time.monotonic() - killed
            after = chain.decode_ms(8)
            print(f"{args.model.name} {mode:7}: ready again {ready:.2f} s after the kill (launcher: replacement "
                  f"{reported:.2f} s after detection), /health 200 after {healthy:.2f} s; decode "
                  f"{before:.2f} ms/token before, {after:.2f} after")
        finally:
            chain.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["cost", "replace"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--layers", help="ranges of the 3 stages, e.g. 0:6,6:12,12:18", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--idle", type=float, default=10.0, help="cost: seconds of idle CPU measured")
    args = parser.parse_args()
    (cost if args.what == "cost" else replace)(args)


if __name__ == "__main__":
    main()
