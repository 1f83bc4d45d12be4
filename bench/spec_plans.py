"""Greedy speculation through chains of 1, 2 and 4 stages by the controller's pipeline depth.

Usage: PYTHONPATH=. python bench/spec_plans.py [--variants 1:4,2:1,2:4,4:1,4:4] [--rounds 7]
[--steps 64] [--loop] [--preset llama-16x1024]

A variant is ``STAGES:DEPTH``: the generator's speculation on a chain of STAGES stages (the even
split peer_compare uses) with ``ControllerConfig(max_depth=DEPTH)`` (1: serial windows only; 4:
the default, pipelined epochs allowed).  Each variant has its own Generator, so its controller's
costs and bets carry from request to request as a server's do; the chains are shared by the
variants of one stage count.  Rounds are interleaved (one request of every variant per round), on
peer_compare's code prompt (``--loop``: its looping continuation).  Prints per request the decode
ms per token, windows, stale windows and the chain's compute per token (the stages' Timings
records, prefill included), then per variant the median and the per-round differences from the
first variant: what a pipelined epoch costs or gains against serial windows on this host, where
stages share its cores (issue 27's speculation line; bench/RESULTS-stage.md, session 21).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_compare import LOOP, STAGE_FLAGS, Speculation, even_layout  # noqa: E402
from stage_chain import chain  # noqa: E402

from skippy.driver import GenerationRequest, StageClient  # noqa: E402
from skippy.driver.generator import Completion  # noqa: E402
from skippy.driver.speculation import ControllerConfig  # noqa: E402
from skippy.models.cache import ensure_model  # noqa: E402
from skippy.models.spec import preset  # noqa: E402
from skippy.net.address import Address  # noqa: E402


def variant(text: str) -> tuple[int, int]:
    stages, depth = (int(part) for part in text.split(":"))
    if stages not in (1, 2, 4) or not 1 <= depth <= 64:
        raise argparse.ArgumentTypeError(f"a variant is STAGES:DEPTH with STAGES 1, 2 or 4 (got {text!r})")
    return stages, depth


async def generate(speculation: Speculation, address: Address, tokens: int) -> Completion:
    speculation.session += 1
    request = GenerationRequest(speculation.prompt, tokens, speculation=True)
    async with await StageClient.connect(address) as client:
        return await speculation.generator.generate(client, request, speculation.session)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="1:4,2:1,2:4,4:1,4:4",
                        type=lambda text: [variant(part) for part in text.split(",")])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--loop", action="store_true", help="the looping continuation, not the code prompt")
    parser.add_argument("--preset", default="llama-16x1024")
    args = parser.parse_args(argv)
    spec = preset(args.preset)
    model = ensure_model(spec)
    walls: dict[tuple[int, int], list[float]] = {key: [] for key in args.variants}
    stale: dict[tuple[int, int], int] = dict.fromkeys(args.variants, 0)
    with contextlib.ExitStack() as stack:
        chains = {count: stack.enter_context(chain(str(model), even_layout(spec.n_layer, count), STAGE_FLAGS))
                  for count in sorted({count for count, _ in args.variants})}
        runs = {}
        for count, depth in args.variants:
            runs[count, depth] = Speculation(model, args.steps, prompt=LOOP if args.loop else None,
                                             controller=ControllerConfig(max_depth=depth))
            stack.callback(runs[count, depth].close)
            trio.run(generate, runs[count, depth], chains[count], 16)  # the first request's paths
        for number in range(1, args.rounds + 1):
            line = []
            for (count, depth), run in runs.items():
                done = trio.run(generate, run, chains[count], args.steps)
                steps = max(1, done.completion_tokens - 1)
                wall = done.timing.decode_seconds / steps * 1e3
                usage = done.speculation.as_dict() if done.speculation else {}
                walls[count, depth].append(wall)
                stale[count, depth] += int(usage.get("stale_windows", 0))
                line.append(f"{count}:{depth} {wall:.2f} ms ({usage.get('windows', 0)} windows, "
                            f"{usage.get('stale_windows', 0)} stale, compute "
                            f"{done.timing.compute_us / steps / 1e3:.2f})")
            print(f"round {number}: " + "; ".join(line), flush=True)
    first = walls[args.variants[0]]
    print(f"decode ms per token, medians of {args.rounds} rounds ({'loop' if args.loop else 'code prompt'}):")
    for (count, depth), values in walls.items():
        differences = [value - base for value, base in zip(values, first)]
        print(f"  {count} stages, depth {depth}: {statistics.median(values):6.2f} ms "
              f"({1e3 / statistics.median(values):6.1f} tok/s), {stale[count, depth]} stale windows; "
              f"against {args.variants[0][0]}:{args.variants[0][1]} {statistics.median(differences):+.2f} "
              f"({', '.join(f'{d:+.2f}' for d in differences)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
