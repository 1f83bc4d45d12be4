"""Direct return on and off (docs/protocol.md §8): per-token decode latency of one chain.

Run: ``PYTHONPATH=. .venv/bin/python bench/direct_return.py [--stages 4] [--delay-ms 5] [--rounds 5]
[--steps 40] [--model null|tiny-llama]``.

One chain of stage processes (one compute thread each), started once with ``--wire-delay-ms D``
(every frame a stage writes downstream) and ``--wire-reply-delay-ms D`` (every reply it writes:
upstream, or into a return lane), so each hop, in either direction, costs the simulated one-way
delay.  Rounds alternate a session decoding hop by hop and one whose predictions come over a
return lane to the final stage; each round reports the median wall time per decode step.  Hop by
hop a decode crosses S - 1 forward hops and S reply hops (the last one, stage 0 to the driver);
with direct return it crosses the same S - 1 forward hops and one reply hop, so the expected
saving is (S - 1) hops' delay plus the relay work of S - 1 stages.
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
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy.driver import StageClient  # noqa: E402
from skippy.net.address import Address  # noqa: E402

_READY = re.compile(r"ready on (\S+):(\d+)")
PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599]


@contextmanager
def chain(model: str, splits: Sequence[str], extra: Sequence[str]) -> Iterator[list[Address]]:
    """Stage processes, final first; yields every stage's address in chain order."""
    processes: list[subprocess.Popen[bytes]] = []
    addresses: list[Address] = []
    with tempfile.TemporaryDirectory() as directory:
        try:
            downstream: Address | None = None
            for index in reversed(range(len(splits))):
                log = Path(directory) / f"stage{index}.log"
                command = [sys.executable, "-m", "skippy.stage", "--model", model, "--layers", splits[index],
                           "--threads", "1", *extra]
                if downstream is not None:
                    command += ["--downstream", str(downstream)]
                with log.open("wb") as handle:
                    processes.append(subprocess.Popen(command, stdout=handle, stderr=handle, cwd=ROOT,
                                                      env=dict(os.environ, PYTHONPATH=str(ROOT))))
                deadline = time.monotonic() + 120
                while True:
                    match = _READY.search(log.read_text(errors="replace"))
                    if match:
                        downstream = Address(match.group(1), int(match.group(2)))
                        break
                    if processes[-1].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"stage {splits[index]} did not start:\n{log.read_text()}")
                    time.sleep(0.05)
                addresses.insert(0, downstream)
            yield addresses
        finally:
            for process in processes:
                process.kill()
                process.wait()


async def decode_step_seconds(client: StageClient, session: int, final: Address | None, steps: int) -> float:
    """Median wall seconds per decode step of one session (direct return when ``final`` is given)."""
    await client.configure(session, prompt_token_count=len(PROMPT))
    if final is not None and not await client.open_direct_return(final, session):
        raise RuntimeError(f"final stage {final} refused direct return")
    token, position = (await client.prefill(session, PROMPT, chunk_size=64)).token, len(PROMPT)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        token = (await client.decode(session, token, position)).predicted
        times.append(time.perf_counter() - started)
        position += 1
    await client.stop(session)
    return statistics.median(times)


async def measure(addresses: list[Address], rounds: int, steps: int) -> dict[bool, list[float]]:
    results: dict[bool, list[float]] = {False: [], True: []}
    session = 0
    async with await StageClient.connect(addresses[0]) as client:
        for round_index in range(rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for direct in order:
                session += 1
                results[direct].append(await decode_step_seconds(
                    client, session, addresses[-1] if direct else None, steps))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default="null", help="null (no compute) or tiny-llama")
    args = parser.parse_args()
    if args.model == "null":
        model, layers = "null:n_embd=4096,n_layer=4,n_vocab=32000", 4
    else:
        from skippy.models.cache import ensure_model
        from skippy.models.spec import preset

        model, layers = str(ensure_model(preset(args.model))), 4
    if layers % args.stages:
        raise SystemExit(f"{layers} layers do not split into {args.stages} equal stages")
    width = layers // args.stages
    splits = [f"{i * width}:{(i + 1) * width}" for i in range(args.stages)]
    extra = ["--batch-size", "64", "--ctx-size", "1024", "--wire-delay-ms", str(args.delay_ms),
             "--wire-reply-delay-ms", str(args.delay_ms)]
    with chain(model, splits, extra) as addresses:
        results = trio.run(measure, addresses, args.rounds, args.steps)
    plain, direct = (statistics.median(results[key]) * 1e3 for key in (False, True))
    print(f"{args.model}, {args.stages} stages, wire delay {args.delay_ms:g} ms each way, "
          f"{args.rounds} rounds x {args.steps} decodes (median of round medians)")
    print(f"  hop by hop:    {plain:8.2f} ms/token   rounds: " + " ".join(f"{v * 1e3:.2f}" for v in results[False]))
    print(f"  direct return: {direct:8.2f} ms/token   rounds: " + " ".join(f"{v * 1e3:.2f}" for v in results[True]))
    hops = args.stages - 1
    in_hops = f" = {(plain - direct) / args.delay_ms:.2f} hops of {args.delay_ms:g} ms" if args.delay_ms > 0 else ""
    print(f"  saved:         {plain - direct:8.2f} ms/token{in_hops} (expected: the {hops} reverse hops it removes)")


if __name__ == "__main__":
    main()
