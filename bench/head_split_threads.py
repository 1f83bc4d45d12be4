"""Where a head split's CPU goes: each stage process's threads' CPU per generated token (issue 31).

Run: ``PYTHONPATH=. .venv/bin/python bench/head_split_threads.py [--clients 8] [--seconds 10]
[--rounds 2] [--base TREE] VARIANT...`` with VARIANT ``split`` (``skippy up --stages 2 --threads 1``
on the real Gemma 3 270M: the head split by default), ``nohead`` (``--head-split off``) or
``base`` (``split`` run from another checkout ``--base``, e.g. ``git archive`` of an older commit
with this tree's built libraries copied in).  The variants run at once and are measured in turns,
rotated each round (a shared host's load drifts hit them alike); ``--heartbeat-timeout 0``, so
an overloaded host does not get its stages replaced.  Each client sends greedy 48-token requests
without speculation back to back.  Printed per variant: tokens/s, each stage's CPU ms per token
(``/proc/PID/task/*/stat`` utime + stime of every thread over the measurements) with its rows per
decode batch (its metrics), and each thread's share, named by ``py-spy dump`` where ``py-spy`` is
on the PATH (else by the kernel's thread name).  On a shared host compare the CPU, not the tokens/s.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import tempfile
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The history of the printing press", "Write a short story about a lighthouse keeper",
           "Explain how a bicycle stays upright", "List the planets of the solar system and",
           "A recipe for bread needs", "The best way to learn a language is", "Once upon a time in a small village",
           "The causes of the first world war were"]
TCK = os.sysconf("SC_CLK_TCK")
MODEL_ID = ""


def threads(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / TCK)
    return out


def names(pid: int) -> dict[int, str]:
    try:
        pyspy = shutil.which("py-spy")
        if pyspy is None:
            return {}
        text = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return {}
    found = {}
    for match in re.finditer(r"Thread (0x[0-9A-Fa-f]+|\d+) \((\w+)\): \"([^\"]*)\"", text):
        tid = match.group(1)
        found[int(tid, 16) if tid.startswith("0x") else int(tid)] = match.group(3)
    return found


def start(name: str, log_dir: Path, model: Path, base: Path | None, clients: int) -> tuple[subprocess.Popen, str, list[int]]:
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--head-split", "off"] if name == "nohead" else []
    tree = base if name == "base" and base is not None else ROOT
    command = [sys.executable, "-m", "skippy", "up", "--model", str(model), "--stages", "2", "--threads", "1",
               "--max-sessions", str(clients), "--ctx-size", str(clients * 512), "--port", "0", "--heartbeat-timeout", "0", "--log-dir", str(log_dir), *extra]
    errors = (log_dir / "up.log").open("wb")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors,
                               env={**os.environ, "PYTHONPATH": str(tree)})
    url = ""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not url:
        line = process.stdout.readline().decode()
        if not line and process.poll() is not None:
            raise RuntimeError((log_dir / "up.log").read_text()[-3000:])
        if match := re.search(r"skippy API on (\S+)", line):
            url = match.group(1)
    threading.Thread(target=process.stdout.read, daemon=True).start()
    text = (log_dir / "up.log").read_text()
    stages = sorted((int(i), int(pid)) for i, _, _, pid in re.findall(r"stage (\d+) \(layers (\d+):(\d+)\) pid (\d+)", text))
    metrics = []
    for index, _ in stages:
        log = next(log_dir.glob(f"stage-{index}-*.log")).read_text()
        found = re.search(r"metrics on (http://\S+/metrics)", log)
        metrics.append(found.group(1) if found else "")
    METRICS[name] = metrics
    return process, url, [pid for _, pid in stages]


METRICS: dict[str, list[str]] = {}


def batch_counts(name: str) -> list[tuple[float, float]]:
    out = []
    for url in METRICS[name]:
        if not url:
            out.append((0.0, 0.0))
            continue
        text = httpx.get(url, timeout=10).text
        vals = []
        for metric in ("skippy_stage_decode_batch_size_sum", "skippy_stage_decode_batch_size_count"):
            m = re.search(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
            vals.append(float(m.group(1)) if m else 0.0)
        out.append((vals[0], vals[1]))
    return out


def measure(url: str, clients: int, seconds: float) -> int:
    deadline = time.perf_counter() + seconds
    tokens = [0] * clients

    def client(index: int) -> None:
        with httpx.Client(timeout=300) as http:
            while time.perf_counter() < deadline:
                body = {"model": MODEL_ID, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 48, "temperature": 0,
                        "ignore_eos": True, "speculation": False}
                reply = http.post(f"{url}/v1/completions", json=body)
                reply.raise_for_status()
                tokens[index] += int(reply.json()["usage"]["completion_tokens"])

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client, i) for i in range(clients)]:
            future.result()
    return sum(tokens)


def main() -> None:
    global MODEL_ID
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", choices=["split", "nohead", "base"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--base", type=Path, help="the checkout the 'base' variant runs from")
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    from skippy.models.real import ensure_real_model

    model = ensure_real_model()
    MODEL_ID = model.name.removesuffix(".gguf")
    NAMES, SECONDS, ROUNDS, N = args.variants, args.seconds, args.rounds, args.clients
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="skippy-head-threads-"))
    print(f"logs in {log_root}", file=sys.stderr)
    running = {}
    try:
        for name in NAMES:
            running[name] = start(name, log_root / name, model, args.base, N)
            measure(running[name][1], 2, 1.0)
        tally = {name: {"tokens": 0, "wall": 0.0, "threads": {}} for name in NAMES}
        order = list(NAMES)
        for _ in range(ROUNDS):
            for name in order:
                _, url, pids = running[name]
                before = [threads(pid) for pid in pids]
                counts_before = batch_counts(name)
                began = time.perf_counter()
                t = tally[name]
                made = measure(url, N, SECONDS)
                wall = time.perf_counter() - began
                after = [threads(pid) for pid in pids]
                counts_after = batch_counts(name)
                t.setdefault("rows", [[0.0, 0.0] for _ in pids])
                for index, ((r0, b0), (r1, b1)) in enumerate(zip(counts_before, counts_after)):
                    t["rows"][index][0] += r1 - r0
                    t["rows"][index][1] += b1 - b0
                t = tally[name]
                t["tokens"] += made
                t["wall"] += wall
                for index, (b, a) in enumerate(zip(before, after)):
                    for tid, (comm, cpu) in a.items():
                        key = (index, tid)
                        prev = b.get(tid, (comm, 0.0))[1]
                        t["threads"][key] = t["threads"].get(key, 0.0) + cpu - prev
                print(f"{name}: {made / wall:.1f} tok/s", flush=True)
            order = order[1:] + order[:1]
        for name in NAMES:
            _, _, pids = running[name]
            labels = [names(pid) for pid in pids]
            t = tally[name]
            made = t["tokens"]
            print(f"== {name}: {made / t['wall']:.1f} tok/s over {t['wall']:.0f} s, {made} tokens")
            for index, pid in enumerate(pids):
                rows = sorted(((cpu, tid) for (i, tid), cpu in t["threads"].items() if i == index), reverse=True)
                total = sum(cpu for cpu, _ in rows)
                nrows, batches = t["rows"][index]
                print(f"  stage {index}: {1000 * total / made:.2f} ms/token, {nrows / max(batches, 1):.2f} rows per decode batch")
                for cpu, tid in rows:
                    if cpu > 0.005 * total:
                        print(f"    {labels[index].get(tid, '?'):24s} tid {tid}: {1000 * cpu / made:.2f} ms/token")
    finally:
        for process, _, _ in running.values():
            process.terminate()
        for process, _, _ in running.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
