"""Memory contention between two stages: two processes (layers A and B of a model, one thread each,
pinned to CPUs 0 and 1) decode batches of n rows in lockstep reps (a barrier per rep).

    PYTHONPATH=. .venv/bin/python bench/stage_pair.py MODEL.gguf 0:9 9:16 4 300

Modes per rep, interleaved: 'alone' (only the measured side A runs, B waits at the barrier), 'both'
(both run a batch at once), 'spin' (B spins in registers: its CPU busy, no memory traffic).  A rep
counts where every running side kept its CPU for the whole rep (thread CPU / wall >= 0.97), which
filters out a shared host's other load (on a busy host few reps qualify: run more).  Prints A's median
thread-CPU ms per batch per mode (docs/throughput.md, "Where the rest of a token's CPU goes").
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics as st
import sys
import time
from typing import Any

import numpy as np

#: Each session's prompt length; every rep decodes one row per session at this position, trimmed back.
PREFIX = 64
#: (mode, wall s, thread CPU s) of each rep of one side
Reps = list[tuple[str, float, float]]


def worker(index: int, path: str, layers: tuple[int, int], rows: int, reps: int, modes: list[str],
           barrier: Any, queue: Any) -> None:
    """One side, pinned to CPU ``index``: load ``layers``, then run ``reps`` reps (module header)."""
    os.sched_setaffinity(0, {index})
    from skippy.runtime import Model, StageContext
    from skippy.runtime.model import LayerRange

    with Model(path, LayerRange(*layers)) as model, StageContext(
            model, n_ctx=rows * 512, max_sessions=rows, n_batch=max(rows, PREFIX), threads=1) as context:
        noise = np.random.default_rng(index)
        seqs = list(range(rows))
        for seq in seqs:  # a prompt per session
            if model.is_first:
                context.decode(positions=list(range(PREFIX)), seq_ids=[seq] * PREFIX,
                               tokens=[1 + i % 100 for i in range(PREFIX)])
            else:
                context.decode(positions=list(range(PREFIX)), seq_ids=[seq] * PREFIX,
                               activations=noise.standard_normal((PREFIX, context.input_width)).astype(np.float32))
        hidden = noise.standard_normal((rows, context.input_width)).astype(np.float32)

        def step() -> None:
            if model.is_first:
                context.decode(positions=[PREFIX] * rows, seq_ids=seqs, tokens=[5 + seq for seq in seqs])
            else:
                context.decode(positions=[PREFIX] * rows, seq_ids=seqs, activations=hidden,
                               outputs=[True] * rows if model.is_last else None)
            for seq in seqs:
                context.trim(seq, PREFIX)

        for _ in range(3):  # warm-up
            step()
        out: Reps = []
        x = 1.0
        for rep in range(reps):
            mode = modes[rep % len(modes)]
            barrier.wait()
            wall, cpu = time.perf_counter(), time.thread_time()
            if index == 0 or mode == "both":
                step()
            elif mode == "spin":  # busy in registers for about a batch's time
                end = time.perf_counter() + 0.018
                while time.perf_counter() < end:
                    for _ in range(200):
                        x *= 1.0000001
            out.append((mode, time.perf_counter() - wall, time.thread_time() - cpu))
        queue.put((index, out))


def main() -> int:
    path, first, second, rows, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    modes = sys.argv[6].split(",") if len(sys.argv) > 6 else ["alone", "both", "spin"]
    barrier, queue = mp.Barrier(2), mp.Queue()
    sides = [mp.Process(target=worker, args=(index, path, tuple(int(v) for v in layers.split(":")), rows, reps, modes,
                                             barrier, queue))
             for index, layers in enumerate((first, second))]
    for side in sides:
        side.start()
    results: dict[int, Reps] = dict(queue.get() for _ in sides)
    for side in sides:
        side.join()
    for mode in modes:
        clean = [a[2] * 1e3 for a, b in zip(results[0], results[1]) if a[0] == mode and a[2] / a[1] >= 0.97
                 and (mode == "alone" or b[2] / b[1] >= 0.97)]
        every = [a[2] * 1e3 for a in results[0] if a[0] == mode]
        median = f"{st.median(clean):.2f}" if clean else "-"
        print(f"rows={rows} {first} (other {second}) {mode:5s}: clean {len(clean):3d}/{len(every)}, CPU ms median {median}; "
              f"all reps median {st.median(every):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
