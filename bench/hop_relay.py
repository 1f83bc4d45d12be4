"""Hop-by-hop decode through the data plane: per-token time of 2- and 3-stage chains against 1 stage.

Run: ``PYTHONPATH=. .venv/bin/python bench/hop_relay.py [--model tiny-llama] [--rounds 5] [--steps 64]``.

Stage processes (``bench/stage_chain.py``'s ``chain``, one compute thread each) of a generated
llama preset; a plain client decodes hop by hop (every token answered back through every stage).
Each chain runs with ``--decode-relay on`` (after a session's first decode every stage's
``nogil`` loop carries its decodes and their replies) and ``off`` (the lane's Python path), in
interleaved rounds; the figures are medians over rounds of wall and CPU (client and every stage
process) per token, and the extra cost of one boundary, ``(t_n - t_1) / (n - 1)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stage_chain import chain, decode_cost_per_token  # noqa: E402

from skippy.models.cache import ensure_model  # noqa: E402
from skippy.models.spec import preset  # noqa: E402

PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599]


def splits_for(layers: int, stages: int) -> list[str]:
    cuts = [layers * index // stages for index in range(stages + 1)]
    return [f"{start}:{end}" for start, end in zip(cuts, cuts[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="tiny-llama", help="a generated preset (skippy.models.spec)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    spec = preset(args.model)
    model = str(ensure_model(spec))
    flags = ["--batch-size", "64", "--ctx-size", "1024"]
    cases = {"1 stage": (1, "on")}
    for stages in (2, 3):
        for relay in ("on", "off"):
            cases[f"{stages} stages, relay {relay}"] = (stages, relay)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    with ExitStack() as stack:
        addresses = {name: stack.enter_context(chain(model, splits_for(spec.n_layer, stages),
                                                     [*flags, "--decode-relay", relay]))
                     for name, (stages, relay) in cases.items()}
        names = list(cases)
        for round_ in range(args.rounds):  # interleaved, each round starting with the next case
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                results[name].append(trio.run(decode_cost_per_token, addresses[name], PROMPT, args.steps))
    medians = {name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
               for name, runs in results.items()}
    one_wall, one_cpu = medians["1 stage"]
    print(f"{args.model}, {args.rounds} rounds of {args.steps} hop-by-hop decodes (medians)")
    for name, (stages, _) in cases.items():
        wall, cpu = medians[name]
        extra = "" if stages == 1 else (f"; per boundary {(wall - one_wall) / (stages - 1) * 1e3:+.3f} ms wall, "
                                        f"{(cpu - one_cpu) / (stages - 1) * 1e3:+.3f} ms CPU")
        print(f"{name:22s}: {wall * 1e3:7.3f} ms/token, CPU {cpu * 1e3:7.3f} ms/token{extra}")


if __name__ == "__main__":
    main()
