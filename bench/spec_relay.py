"""Speculation through the data plane: greedy verify windows at 1, 2 and 4 stages, relay on and off.

Run: ``PYTHONPATH=. .venv/bin/python bench/spec_relay.py [--preset tiny-llama] [--rounds 3] [--steps 32]
[--max-depth 1 | --eager | --window K [--direct]] [--counts]``.

Stage processes (``bench/stage_chain.py``'s ``chain``, one compute thread each) of a generated
llama preset; the driver's :class:`~skippy.driver.Generator` speculates greedily (n-gram drafts,
verify windows, partly rejected) on ``bench/peer_compare.py``'s looping code prompt
(``peer_compare.Speculation``: a fresh session per request, the CPU of a 1-token request taken
off; hop by hop: the driver never asks for direct return when it speculates).  Each chain of 2
and 4 stages runs with ``--decode-relay on`` (the data plane carries the windows of every size
and the decodes between them, their rollbacks trimmed in its loop, pipelined as the driver sends
them; a run starts on a quiet lane, or with the lane's messages in flight, which it answers
first: a stage that always has a window in flight, the first of a long chain, carries them too)
and ``off`` (the lane's Python path), in interleaved rounds; the figures are medians over rounds of wall and
CPU (this client and every stage process) per token, and the extra cost of one boundary,
``(t_n - t_1) / (n - 1)``.  The chains' tokens are compared every round.

``--counts`` has every stage write its counters (``--stats-file``, every 0.1 s: a little CPU, so
the CPU figures are best taken without it) and prints, per chain, each stage's decodes and
windows and how many of them the data plane carried.

``--eager`` has the driver pipeline from its first window (a prior acceptance of 0.9 worth 50
drafts: each request's first epoch sends all its windows before the first reply, so no stage is
quiet when the first window's template comes back).

``--window K`` drives the windows itself instead (a plain :class:`~skippy.driver.StageClient`, one
window in flight): every window is the last committed token and K drafts from the driver's n-gram
proposer (padded with token 0 when it has fewer: rejected), accepted greedily, so every window
has K + 1 rows and the data plane carries all but the session's first; ``--direct`` sends them
with direct return.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peer_compare import STAGE_FLAGS, Speculation, even_layout  # noqa: E402
from stage_chain import FINALS, PROCESSES, chain, cpu_seconds  # noqa: E402

from skippy.driver import StageClient  # noqa: E402
from skippy.driver.speculation.proposer import NgramProposer  # noqa: E402
from skippy.net.address import Address  # noqa: E402

from skippy.models.cache import ensure_model  # noqa: E402
from skippy.models.spec import preset  # noqa: E402


async def windows(speculation: Speculation, address: Address, steps: int, drafts: int,
                  direct: bool) -> tuple[float, float]:
    """(tokens/s, CPU s/token) of ``steps`` tokens committed by windows of ``drafts`` drafts
    (speculation.tokens: the committed tokens; speculation.acceptance: accepted / proposed)."""
    pids = [process.pid for process in PROCESSES.get(address, [])]
    speculation.session += 1
    session, prompt = speculation.session, list(speculation.prompt)
    proposer = NgramProposer(prompt)
    async with await StageClient.connect(address) as client:
        await client.configure(session, prompt_token_count=len(prompt))
        if direct:
            assert await client.open_direct_return(FINALS[address], session)
        committed = [(await client.prefill(session, prompt, chunk_size=128)).token]
        proposer.append(committed[0])
        position, proposed, accepted_total, window_id = len(prompt), 0, 0, 0
        started, cpu_started = time.perf_counter(), cpu_seconds(pids)
        while len(committed) <= steps:
            draft = list(proposer.propose(drafts).tokens)
            draft += [0] * (drafts - len(draft))
            window_id += 1
            reply = await client.verify(session, [committed[-1], *draft], position, window_id=window_id)
            predicted = list(reply.predicted_tokens)
            accepted = 0
            while accepted < drafts and predicted[accepted] == draft[accepted]:
                accepted += 1
            new = draft[:accepted] + [predicted[accepted]]
            committed += new
            proposer.extend(new)
            position += accepted + 1
            proposed, accepted_total = proposed + drafts, accepted_total + accepted
        elapsed = time.perf_counter() - started
        cpu = cpu_seconds(pids) - cpu_started
        await client.stop(session)
    count = len(committed) - 1
    speculation.tokens, speculation.acceptance = committed[:steps + 1], accepted_total / max(1, proposed)
    return count / elapsed, cpu / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="tiny-llama", help="a generated preset (skippy.models.spec)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--stages", default="2,4", help="the chains besides 1 stage")
    parser.add_argument("--max-depth", type=int, default=0,
                        help="windows the driver keeps in flight at most (0: the controller's default)")
    parser.add_argument("--eager", action="store_true", help="the driver pipelines from its first window")
    parser.add_argument("--window", type=int, default=0, help="drive windows of K drafts with a plain client")
    parser.add_argument("--direct", action="store_true", help="with --window: direct return")
    parser.add_argument("--counts", action="store_true", help="count the messages each stage's data plane carried")
    args = parser.parse_args()
    spec = preset(args.preset)
    model = ensure_model(spec)
    counts = [int(value) for value in args.stages.split(",")]
    cases = {"1 stage": (1, "on")}
    for count in counts:
        for relay in ("on", "off"):
            cases[f"{count} stages, relay {relay}"] = (count, relay)
    load = os.getloadavg()
    print(f"model {model.name}; {args.steps} tokens; {args.rounds} interleaved rounds; "
          f"{f'client windows of {args.window} drafts' if args.window else 'the driver'}"
          f"{', direct return' if args.direct else ''}{', eager' if args.eager else ''}; max depth {args.max_depth or 'default'}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
          flush=True)
    started = time.monotonic()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    with ExitStack() as stack:
        files = Path(stack.enter_context(tempfile.TemporaryDirectory()))

        def stats_files(name: str, count: int) -> list[Path]:
            return [files / f"{name.replace(' ', '-').replace(',', '')}-{index}.json" for index in range(count)]

        addresses = {name: stack.enter_context(chain(
            str(model), even_layout(spec.n_layer, count), [*STAGE_FLAGS, "--decode-relay", relay],
            [["--stats-file", str(path)] for path in stats_files(name, count)] if args.counts else ()))
            for name, (count, relay) in cases.items()}
        speculation = Speculation(model, args.steps)
        stack.callback(speculation.close)
        generator = speculation.generator
        if args.max_depth:
            generator.controller = dataclasses.replace(generator.controller, max_depth=args.max_depth)
        if args.eager:
            generator.controller = dataclasses.replace(generator.controller, prior_acceptance=0.9, prior_weight=50.0)

        def decode(name: str) -> tuple[float, float]:
            if args.window:
                return trio.run(windows, speculation, addresses[name], args.steps, args.window, args.direct)
            return trio.run(speculation.decode, addresses[name])

        for name in cases:  # the stages' first-request paths
            decode(name)
        names = list(cases)
        for round_index in range(args.rounds):
            tokens = set()
            for name in names[round_index % len(names):] + names[:round_index % len(names)]:
                rate, cpu = decode(name)
                results[name].append((1.0 / rate, cpu))
                tokens.add(tuple(speculation.tokens))
                print(f"  round {round_index + 1} {name}: {1e3 / rate:.2f} ms/token, CPU {cpu * 1e3:.2f} ms/token, "
                      f"acceptance {speculation.acceptance:.2f}", flush=True)
            if len(tokens) > 1:
                print("  MISMATCH: the chains' greedy tokens differ", flush=True)
        if args.counts:  # (the files are rewritten every 0.1 s)
            time.sleep(0.3)
            print("messages each stage computed (decodes + windows) and those the data plane carried, "
                  "every request included:")
            for name, (count, _) in cases.items():
                figures = [json.loads(path.read_text()) for path in stats_files(name, count)]
                print(f"  {name:20s} " + "; ".join(
                    f"stage {index}: {stats['decode_relay_steps'] + stats['decode_relay_windows']} of "
                    f"{stats['decode_items'] + stats['verify_windows']} ({stats['decode_relay_windows']} of "
                    f"{stats['verify_windows']} windows)" for index, stats in enumerate(figures)))
    medians = {name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
               for name, runs in results.items()}
    one_wall, one_cpu = medians["1 stage"]
    print(f"medians of {args.rounds} rounds (ms per token; per boundary: (t_n - t_1) / (n - 1)):")
    for name, (wall, cpu) in medians.items():
        count = cases[name][0]
        extra = "" if count == 1 else (f"; per boundary wall {(wall - one_wall) * 1e3 / (count - 1):+.3f}, "
                                       f"CPU {(cpu - one_cpu) * 1e3 / (count - 1):+.3f}")
        print(f"  {name:20s} wall {wall * 1e3:8.3f}  CPU {cpu * 1e3:8.3f}{extra}")
    load = os.getloadavg()
    print(f"took {time.monotonic() - started:.0f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
