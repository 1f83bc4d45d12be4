"""Decode speed of a generated Qwen3.5-shaped hybrid: skippy unsplit and 2 stages against stock
``llama-bench`` of the same file, one interleaved run (issue 25, checked by).

Run: ``PYTHONPATH=. .venv/bin/python bench/recurrent_speed.py [--rounds 5] [--steps 32]
[--n-embd 1024] [--layers 8]``.

Strategy: the model is Qwen3.5-shaped (:func:`qwen35_shape`: its head widths at ``--n-embd``,
``--layers`` layers, gated attention every fourth layer, Q8_0, llama-spm vocabulary).  Every variant stays up for the whole run and each round measures each
once, in an order rotated by one per round, so this shared host's drifts hit them alike (the
pieces are :mod:`peer_compare`'s, which compares attention-only models the same way):

* **stock**: ``llama-bench -t 1 -fa 0 -ngl 0 -r 1 -p 0 -n STEPS`` of the unpatched pinned tree
  (``bench/peer_build.py``), its own tokens/s sample; its CPU per token is that run's less a
  1-token run's (load, warm-up) taken right before it in the same round (a baseline taken once,
  on a cold page cache, made stock's figure about half of what it is);
* **in-process**: skippy's runtime in this process (``Model`` + ``StageContext``, 1 thread, a
  greedy sample per token), unsplit;
* **skippy 1 / skippy 2**: stage processes (``--threads 1 --prefix-cache off``) driven over
  loopback, one ``DecodeEmbd`` per token (``peer_compare.stage_decode``); 2 stages cut at
  ``--layers // 2``.

Medians over rounds of tokens/s and of CPU time per token (this host is shared: CPU time is the
steadier figure; peer_compare's accounting: llama-bench's process less a 1-token baseline run,
the in-process thread, the client plus every stage process's threads), and the medians of the
per-round ratios to stock.  No timing is asserted anywhere; the figures go into
bench/RESULTS-recurrent.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_build import build_peer  # noqa: E402
from peer_compare import BenchVariant, InProcess, stage_decode  # noqa: E402
from stage_chain import chain  # noqa: E402

from skippy.models import ModelSpec, ensure_model, tiny  # noqa: E402


def qwen35_shape(n_embd: int, n_layer: int) -> ModelSpec:
    """Qwen3.5's head shapes at ``n_embd``: attention heads of 256 (2 KV heads, 64 dims rotated),
    delta-net heads of 128 (``n_embd / 64`` key and value heads, a 4-wide conv), attention every
    fourth layer, an FFN of 3 x ``n_embd``; Q8_0."""
    heads = n_embd // 64
    return dataclasses.replace(
        tiny("qwen35", n_embd=n_embd, n_layer=n_layer), dtype="Q8_0", n_head=heads // 2, n_head_kv=2, head_dim=256,
        rope_dim=64, n_ff=3 * n_embd, linear_key_head_dim=128, linear_num_key_heads=heads,
        linear_num_value_heads=heads, full_attention_interval=4, name=f"skippy-qwen35-{n_embd}x{n_layer}-shape")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--attention-only", action="store_true",
                        help="the same widths as a llama (every layer attention): the baseline of the hybrid's figures")
    parser.add_argument("--no-stock", action="store_true",
                        help="skippy's variants only (ratios to the in-process run), without llama-bench")
    args = parser.parse_args()
    spec = qwen35_shape(args.n_embd, args.layers)
    if args.attention_only:
        spec = dataclasses.replace(tiny("llama", n_embd=args.n_embd, n_layer=args.layers), dtype="Q8_0",
                                   n_head=spec.n_head, n_head_kv=2, n_ff=spec.n_ff)
    path = ensure_model(spec)
    print(f"{path.name}: {path.stat().st_size / (1 << 20):.0f} MiB, {args.rounds} rounds of {args.steps} decodes, "
          f"1 thread", flush=True)
    stock = None
    if not args.no_stock:
        stock = BenchVariant(build_peer().llama_bench, path, ["-ngl", "0"], [])
        stock.baseline()  # once untimed: the file into the page cache

    def stock_decode() -> tuple[float, float]:
        assert stock is not None
        stock.baseline()  # its 1-token run right before, under the same load
        return stock.decode(args.steps)

    in_process = InProcess(path)
    cut = args.layers // 2
    extra = ["--prefix-cache", "off", "--ctx-size", "1024"]
    with chain(str(path), [f"0:{args.layers}"], extra) as one, chain(str(path), [f"0:{cut}", f"{cut}:{args.layers}"],
                                                                     extra) as two:
        measures = {
            **({"stock": stock_decode} if stock is not None else {}),
            "in-process": lambda: in_process.decode(args.steps),
            "skippy 1": lambda: trio.run(stage_decode, one, args.steps),
            "skippy 2": lambda: trio.run(stage_decode, two, args.steps),
        }
        names = list(measures)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                runs[name].append(measures[name]())
            print(f"round {round_index + 1}: " + ", ".join(
                f"{name} {runs[name][-1][0]:.1f} t/s {runs[name][-1][1] * 1e3:.2f} ms CPU" for name in names), flush=True)
    in_process.close()
    reference = names[0]
    print(f"\n| variant | tokens/s | vs {reference} | CPU ms/token | {reference} CPU / CPU |\n|---|---:|---:|---:|---:|")
    for name in names:
        rate = [value[0] / base[0] for value, base in zip(runs[name], runs[reference])]
        cpu = [base[1] / value[1] for value, base in zip(runs[name], runs[reference])]
        print(f"| {name} | {statistics.median(v[0] for v in runs[name]):.1f} | {statistics.median(rate):.1%} | "
              f"{statistics.median(v[1] for v in runs[name]) * 1e3:.2f} | {statistics.median(cpu):.1%} |")


if __name__ == "__main__":
    main()
