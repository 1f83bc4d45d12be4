"""Soak: N streaming clients for T minutes against ``skippy up``; errors, latency and per-process RSS.

Run: ``PYTHONPATH=. .venv/bin/python bench/soak_api.py [--clients 32] [--minutes 5] [--lanes 8]
[--stages 2] [--model M.gguf] [--max-tokens 24] [--abandon 0.02] [--api-key KEY] [--url URL]``.

Strategy: one ``skippy up`` (``--max-sessions`` = ``--lanes``: as many API lanes as stage
sessions) is started on a free port, unless ``--url`` names a running API.  ``--clients`` trio
tasks, each with its own HTTP connection, send streaming chat completions back to back (prompts
cycle through a few shapes, greedy and sampled, some sharing a prefix so the prefix cache is
used) and read every event to ``[DONE]``.  A fraction ``--abandon`` of the requests is dropped
by the client after its first content chunk (the connection closes mid-stream), which is how a
lane ends uncleanly.  Every outcome is counted: completed streams, refusals by HTTP status and
error code, error events inside a stream, transport failures.  Latency is measured at the client
(time to the first content chunk, and to ``[DONE]``), and the completed streams' completion
tokens (their usage chunk) give the aggregate tokens/s; RSS of the API process and of every stage
is sampled every ``--sample-s`` seconds from ``/proc``.  RSS is reported at the end of the first
tenth of the run (after warm-up), at the end and at its peak; "drift" is end / warm - 1.

The report is plain lines; ``--json PATH`` also writes the figures.  Exit status 1 when any
request that was not abandoned failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from api_helpers import UpProcess  # noqa: E402

#: Prompts cycled by the clients; the first two share a long prefix (a prefix-cache hit).
SYSTEM = "You are a terse assistant. Answer in one short sentence and never use lists. " * 3
PROMPTS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a prime number above 10."}],
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "user", "content": "1, 2, 3,"}],
]


@dataclasses.dataclass
class Tally:
    """Outcomes and latencies of every client."""

    completed: int = 0
    abandoned: int = 0
    #: Completion tokens of the completed streams (their final usage chunk).
    tokens: int = 0
    refused: Counter[str] = dataclasses.field(default_factory=Counter)
    stream_errors: Counter[str] = dataclasses.field(default_factory=Counter)
    transport: Counter[str] = dataclasses.field(default_factory=Counter)
    ttft: list[float] = dataclasses.field(default_factory=list)
    total: list[float] = dataclasses.field(default_factory=list)
    #: The first message seen for each kind of failure.
    examples: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(self.refused.values()) + sum(self.stream_errors.values()) + sum(self.transport.values())


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


async def client_loop(index: int, url: str, model: str, args: argparse.Namespace, deadline: float,
                      tally: Tally) -> None:
    rng = random.Random(index)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, headers=headers) as http:
        round_ = 0
        while trio.current_time() < deadline:
            round_ += 1
            messages = PROMPTS[(index + round_) % len(PROMPTS)]
            body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": args.max_tokens,
                                    "stream": True, "stream_options": {"include_usage": True},
                                    "temperature": 0 if round_ % 2 else 0.8, "seed": index}
            abandon = rng.random() < args.abandon
            started = time.perf_counter()
            first = 0.0
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        try:
                            code, message = response.json()["error"]["code"], response.json()["error"]["message"]
                        except (ValueError, KeyError, TypeError):
                            code, message = "not-openai-json", response.text[:200]
                        tally.refused[f"{response.status_code} {code}"] += 1
                        tally.examples.setdefault(f"{response.status_code} {code}", message)
                        continue
                    failed = False
                    tokens = 0
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            tally.stream_errors[str(event["error"].get("code"))] += 1
                            tally.examples.setdefault(str(event["error"].get("code")), str(event["error"]))
                            failed = True
                            break
                        if event.get("usage"):
                            tokens = int(event["usage"]["completion_tokens"])
                        choices = event.get("choices") or [{}]
                        if not first and choices[0].get("delta", {}).get("content"):
                            first = time.perf_counter()
                            tally.ttft.append(first - started)
                            if abandon:
                                break
                    if abandon and first:
                        tally.abandoned += 1
                        continue
                    if not failed:
                        tally.completed += 1
                        tally.tokens += tokens
                        tally.total.append(time.perf_counter() - started)
            except httpx.HTTPError as exc:
                tally.transport[type(exc).__name__] += 1
                tally.examples.setdefault(type(exc).__name__, str(exc))


async def sample_rss(pids: dict[str, int], period: float, samples: dict[str, list[tuple[float, int]]],
                     started: float) -> None:
    while True:
        for name, pid in pids.items():
            value = rss_kib(pid)
            if value is not None:
                samples.setdefault(name, []).append((time.monotonic() - started, value))
        await trio.sleep(period)


async def soak(url: str, model: str, pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    samples: dict[str, list[tuple[float, int]]] = {}
    seconds = args.minutes * 60
    started = time.monotonic()
    async with trio.open_nursery() as outer:
        outer.start_soon(sample_rss, pids, args.sample_s, samples, started)
        deadline = trio.current_time() + seconds
        async with trio.open_nursery() as clients:
            for index in range(args.clients):
                clients.start_soon(client_loop, index, url, model, args, deadline, tally)
        outer.cancel_scope.cancel()
    elapsed = time.monotonic() - started
    rss: dict[str, dict[str, float]] = {}
    for name, series in samples.items():
        warm = [kib for at, kib in series if at <= seconds * 0.1] or [series[0][1]]
        rss[name] = {"warm_mib": warm[-1] / 1024, "end_mib": series[-1][1] / 1024,
                     "peak_mib": max(kib for _, kib in series) / 1024,
                     "drift": series[-1][1] / warm[-1] - 1}
    attempted = tally.completed + tally.abandoned + tally.failed
    return {
        "clients": args.clients, "lanes": args.lanes, "seconds": round(elapsed, 1), "requests": attempted,
        "completed": tally.completed, "abandoned": tally.abandoned, "failed": tally.failed,
        "completion_tokens": tally.tokens, "tokens_per_s": round(tally.tokens / elapsed, 1),
        "refused": dict(tally.refused), "stream_errors": dict(tally.stream_errors),
        "transport_errors": dict(tally.transport), "examples": tally.examples,
        "ttft_ms": {"p50": percentile(tally.ttft, 0.5) * 1000, "p99": percentile(tally.ttft, 0.99) * 1000},
        "latency_ms": {"p50": percentile(tally.total, 0.5) * 1000, "p99": percentile(tally.total, 0.99) * 1000,
                       "max": max(tally.total, default=math.nan) * 1000},
        "rss": rss,
    }


def report(result: dict[str, Any]) -> None:
    print(f"{result['clients']} streaming clients, {result['lanes']} lanes, {result['seconds']:.0f} s: "
          f"{result['requests']} requests, {result['completed']} completed, {result['abandoned']} abandoned "
          f"by the client, {result['failed']} failed")
    print(f"aggregate: {result['completion_tokens']} completion tokens of the completed streams, "
          f"{result['tokens_per_s']:.1f} tokens/s")
    for label in ("refused", "stream_errors", "transport_errors"):
        if result[label]:
            print(f"  {label}: {result[label]}")
    for label, message in result["examples"].items():
        print(f"  e.g. {label}: {message}")
    ttft, latency = result["ttft_ms"], result["latency_ms"]
    print(f"TTFT p50 {ttft['p50']:.0f} ms, p99 {ttft['p99']:.0f} ms; request (to [DONE]) p50 {latency['p50']:.0f} ms, "
          f"p99 {latency['p99']:.0f} ms, max {latency['max']:.0f} ms")
    for name, figures in result["rss"].items():
        print(f"RSS {name:8s} after warm-up {figures['warm_mib']:7.1f} MiB, end {figures['end_mib']:7.1f} MiB, "
              f"peak {figures['peak_mib']:7.1f} MiB, drift {figures['drift'] * 100:+.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--lanes", type=int, default=8, help="API lanes = stage --max-sessions (default 8)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--model", type=Path, help="GGUF model (default: the generated demo model)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per stage (default 1)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--abandon", type=float, default=0.02,
                        help="fraction of requests the client drops after the first chunk (default 0.02)")
    parser.add_argument("--api-key", help="run the API with this key (and send it)")
    parser.add_argument("--queue-timeout", type=float, help="skippy up --queue-timeout")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling period (default 2 s)")
    parser.add_argument("--url", help="soak a running API instead (RSS of no process is sampled)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--log-dir", type=Path, help="keep the stage logs here (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        up: UpProcess | None = None
        if args.url:
            url, pids = args.url, {}
        else:
            command = ["up", "--stages", str(args.stages), "--port", "0", "--threads", str(args.threads),
                       "--max-sessions", str(args.lanes), "--ctx-size", "1024",
                       "--log-dir", str(args.log_dir or Path(directory) / "logs")]
            command += ["--model", str(args.model)] if args.model else ["--generated-model"]
            if args.api_key:
                command += ["--api-key", args.api_key]
            if args.queue_timeout is not None:
                command += ["--queue-timeout", str(args.queue_timeout)]
            up = UpProcess(command, Path(directory)).start()
            assert up.process is not None
            url = up.url
            pids = {"api": up.process.pid}
            for match in re.finditer(r"stage (\d+) \(layers [^)]*\) pid (\d+) ready", up.stderr()):
                pids[f"stage {match.group(1)}"] = int(match.group(2))
        try:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
            result = trio.run(soak, url, model, pids, args)
        finally:
            if up is not None:
                up.stop()
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
