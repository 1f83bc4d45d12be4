"""What mutual TLS costs a chain: the decode boundary and a 512-token prefill, TLS on and off.

Run: ``PYTHONPATH=. .venv/bin/python bench/tls_cost.py [--width 2048] [--stages 2] [--rounds 5]
[--steps 64] [--prefill 512] [--model null|PATH.gguf]``.

Two chains of stage processes (one compute thread each, the null runtime by default so the figures
are the links' cost, not compute) are started side by side: one plain, one with ``--tls on`` on
every stage and a TLS driver lane, certificates from :func:`skippy.deploy.certs.make_chain_certificates`.
Rounds alternate the two chains; each round reports the median wall time of one decode step (S
boundaries plus the driver's hop) and of a ``--prefill``-token prompt sent as one chunk (its
``prefill`` x ``width`` f32 activation crosses each boundary).  The printed difference per boundary
is (TLS - plain) / S.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy.deploy.certs import make_chain_certificates  # noqa: E402
from skippy.driver import StageClient  # noqa: E402
from skippy.net.address import Address  # noqa: E402
from skippy.net.tls import TlsFiles, client_context  # noqa: E402

_READY = re.compile(r"ready on (\S+):(\d+)")


def start_chain(model: str, stages: int, n_layer: int, directory: Path, tls: Path | None,
                ctx: int) -> tuple[list[subprocess.Popen[bytes]], Address]:
    """Start the stages (last first); returns the processes and the first stage's address."""
    bounds = [round(i * n_layer / stages) for i in range(stages + 1)]
    processes: list[subprocess.Popen[bytes]] = []
    downstream: Address | None = None
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for index in reversed(range(stages)):
        log = directory / f"{'tls' if tls else 'plain'}-{index}.log"
        command = [sys.executable, "-m", "skippy.stage", "--model", model, "--layers",
                   f"{bounds[index]}:{bounds[index + 1]}", "--threads", "1", "--ctx-size", str(ctx),
                   "--batch-size", "512", "--prefix-cache", "off"]
        if downstream is not None:
            command += ["--downstream", str(downstream)]
        if tls is not None:
            files = TlsFiles.in_directory(tls, f"stage-{index}")
            command += ["--tls", "on", "--tls-cert", str(files.cert), "--tls-key", str(files.key),
                        "--tls-ca", str(files.ca)]
        with log.open("wb") as out:
            processes.append(subprocess.Popen(command, stdout=out, stderr=out, env=env, cwd=ROOT))
        deadline = time.monotonic() + 120
        while not (match := _READY.search(log.read_text(errors="replace"))):
            if processes[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stage {index} did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)
        downstream = Address(match.group(1), int(match.group(2)))
    assert downstream is not None
    return processes, downstream


async def measure(client: StageClient, session: int, steps: int, prefill: int) -> tuple[float, float]:
    """(median decode step, prefill time) in seconds for one fresh session."""
    prompt = [1 + (i % 900) for i in range(prefill)]
    started = time.perf_counter()
    result = await client.prefill(session, prompt, chunk_size=prefill)
    prefill_s = time.perf_counter() - started
    token, position, times = result.token, prefill, []
    for _ in range(steps):
        started = time.perf_counter()
        token = (await client.decode(session, token % 900, position)).predicted
        times.append(time.perf_counter() - started)
        position += 1
    await client.stop(session)
    return statistics.median(times), prefill_s


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="skippy-tls-bench-") as tmp:
        directory = Path(tmp)
        certs = directory / "certs"
        make_chain_certificates(certs, [*(f"stage-{i}" for i in range(args.stages)), "driver-0"])
        model = args.model if args.model != "null" else f"null:n_embd={args.width},n_layer=8,n_vocab=1000"
        n_layer = 8 if args.model == "null" else int(args.n_layer)
        ctx = max(1024, args.prefill + args.steps + 16)
        plain_procs, plain_at = start_chain(model, args.stages, n_layer, directory, None, ctx)
        tls_procs, tls_at = start_chain(model, args.stages, n_layer, directory, certs, ctx)
        try:
            plain = await StageClient.connect(plain_at)
            secure = await StageClient.connect(tls_at, tls=client_context(TlsFiles.in_directory(certs, "driver-0")))
            results: dict[str, list[tuple[float, float]]] = {"plain": [], "tls": []}
            session = 1
            for _ in range(args.rounds):
                for name, client in (("plain", plain), ("tls", secure)):
                    results[name].append(await measure(client, session, args.steps, args.prefill))
                    session += 1
            await plain.aclose()
            await secure.aclose()
        finally:
            for process in (*plain_procs, *tls_procs):
                process.kill()
    print(f"{args.stages} stages, {model}, {args.rounds} rounds x {args.steps} decode steps, "
          f"{args.prefill}-token prefill in one chunk")
    print("| | decode step (median of rounds) | prefill |")
    print("|---|---|---|")
    summary = {}
    for name, rows in results.items():
        decode = statistics.median(r[0] for r in rows) * 1000
        prefill = statistics.median(r[1] for r in rows) * 1000
        summary[name] = (decode, prefill)
        print(f"| {name} | {decode:.3f} ms | {prefill:.1f} ms |")
    boundaries = args.stages  # S - 1 stage links plus the driver's lane
    print(f"TLS cost per link: decode {(summary['tls'][0] - summary['plain'][0]) / boundaries * 1000:.0f} us, "
          f"{args.prefill}-token prefill {(summary['tls'][1] - summary['plain'][1]) / boundaries:.2f} ms "
          f"({boundaries} links: the driver's and {args.stages - 1} between stages)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048, help="activation width of the null model")
    parser.add_argument("--model", default="null", help="null, or a GGUF path (then give --n-layer)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
