"""Decode cost of splitting, in one process: unsplit vs 2 and 4 stages called back to back.

Usage: python bench/split_decode.py [--preset qwen3-0.6b] [--steps 32] [--rounds 5] [--threads N]
[--window K]

All three layouts are loaded side by side (weights are mmapped, so they share the page cache) and
measured in interleaved rounds, so machine noise hits them alike; each round prefills the same
prompt, then times ``--steps`` greedy single-token decodes.  Prints decode tokens/s per layout
(best round and median) and the split's cost relative to the unsplit baseline of the same run.
``--window K``: each step is a speculative verify window instead, K + 1 rows at the same position
with every row's logits, its rows removed after (all drafts rejected), and the figure is windows
per second with the split's cost in ms per window: issue 27's speculation per boundary, apart
from processes and sockets (``--preset llama-16x1024 --window 5``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from skippy.models.cache import ensure_model
from skippy.models.spec import preset
from skippy.runtime import read_gguf_info
from skippy.runtime.local import LocalChain, even_split


def decode_rate(chain: LocalChain, prompt: list[int], steps: int) -> float:
    chain.each("remove", 0, -1, -1)
    chain.prefill(prompt)
    last = chain.last
    token = int(last.logits(int(last.output_rows[-1])).argmax())
    position = len(prompt)
    started = time.perf_counter()
    for _ in range(steps):
        chain.decode([token], [position], [0])
        token = int(last.logits(int(last.output_rows[-1])).argmax())
        position += 1
    return steps / (time.perf_counter() - started)


def window_rate(chain: LocalChain, prompt: list[int], steps: int, window: int) -> float:
    """Verify windows of ``window`` + 1 rows per second (each at the prompt's end, then removed)."""
    chain.each("remove", 0, -1, -1)
    chain.prefill(prompt)
    position, rows = len(prompt), window + 1
    tokens, positions = list(range(200, 200 + rows)), list(range(position, position + rows))
    started = time.perf_counter()
    for _ in range(steps):
        chain.decode(tokens, positions, [0] * rows, outputs=[True] * rows)
        chain.last.logits(int(chain.last.output_rows[-1]))
        chain.each("remove", 0, position, -1)
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="F16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--window", type=int, default=0, help="time verify windows of K drafts (K + 1 rows)")
    args = parser.parse_args()
    path = ensure_model(preset(args.preset, dtype=args.dtype))
    n_layer = read_gguf_info(path).n_layer
    layouts = {name: even_split(n_layer, n) for name, n in (("unsplit", 1), ("2 stages", 2), ("4 stages", 4))}
    prompt = list(range(100, 164))
    chains = {name: LocalChain(path, split, n_ctx=512, max_sessions=1, n_batch=64, threads=args.threads)
              for name, split in layouts.items()}
    rates: dict[str, list[float]] = {name: [] for name in chains}
    def rate(chain: LocalChain, steps: int) -> float:
        return window_rate(chain, prompt, steps, args.window) if args.window else decode_rate(chain, prompt, steps)

    for chain in chains.values():  # warm-up: graph allocation, page cache
        rate(chain, 4)
    for _ in range(args.rounds):
        for name, chain in chains.items():
            rates[name].append(rate(chain, args.steps))
    base_best = max(rates["unsplit"])
    base_median = statistics.median(rates["unsplit"])
    unit = f"verify windows of {args.window + 1} rows" if args.window else "decode steps"
    print(f"model {path.name} ({n_layer} layers), {args.steps} {unit} x {args.rounds} rounds")
    print(f"{'layout':<10} {'best tok/s':>11} {'median':>8} {'cost (best)':>12} {'cost (median)':>14}")
    for name, values in rates.items():
        best, median = max(values), statistics.median(values)
        print(f"{name:<10} {best:>11.2f} {median:>8.2f} {100 * (1 - best / base_best):>11.1f}% "
              f"{100 * (1 - median / base_median):>13.1f}%  ({1e3 / median - 1e3 / base_median:+.3f} ms a step, median)")
    for chain in chains.values():
        chain.close()


if __name__ == "__main__":
    main()
