"""What rollback of recurrent state costs: checkpoint bytes per session and time per verify window.

Run: ``PYTHONPATH=. .venv/bin/python bench/recurrent_checkpoint.py [--arch nemotron_h] [--n-embd 256]
[--layers 8] [--stages 3] [--window 8] [--rounds 20]``.

Strategy: a generated hybrid model (the family's tiny shape at ``--n-embd`` / ``--layers``, F32) is
split into ``--stages`` even layer ranges, each a StageContext in this process (1 thread).  One
session prefills 64 tokens, then, per round, sends a verify window of ``--window`` + 1 rows (the
context checkpoints the session's recurrent state before it), rejects all but the first two rows
(a trim: restore the checkpoint, decode the two rows again) and goes on.  Reported per stage:
the bytes of one checkpoint (the recurrent state of the stage's layers for one session), the
bytes all of a session's checkpoints and logged rows hold at most, the time of one checkpoint,
of one restore (the checkpoint copied back, the attention KV trimmed), of the replay of the two
kept rows, and of the window's decode itself (medians over the rounds; the replay is a decode of
two rows, what the window's rows cost per call).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from skippy.models import ensure_model, tiny
from skippy.runtime import LayerRange, Model, StageContext
from skippy.runtime.local import even_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="nemotron_h")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--window", type=int, default=8, help="drafts per verify window")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    spec = tiny(args.arch, n_embd=args.n_embd)  # type: ignore[arg-type]
    if spec.n_layer != args.layers:  # a hybrid's layer pattern repeats
        pattern = getattr(spec, "layer_pattern", "")
        extra = {"layer_pattern": (pattern * args.layers)[:args.layers]} if pattern else {}
        spec = dataclasses.replace(spec, n_layer=args.layers, **extra)
    path = ensure_model(spec)
    print(f"{args.arch} n_embd {args.n_embd}, {args.layers} layers, {args.stages} stages, "
          f"window {args.window + 1} rows, {args.rounds} rounds, 1 thread")
    print(f"{'stage':>8} {'ckpt bytes':>11} {'session max':>12} {'ckpt ms':>8} {'restore ms':>11} {'replay ms':>10} "
          f"{'window ms':>10}")
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 30000, 64).astype(np.int32)
    for start, end in even_split(args.layers, args.stages):
        with Model(path, LayerRange(start, end)) as model, \
                StageContext(model, n_ctx=1024, max_sessions=1, n_batch=64, threads=1) as ctx:
            seq = ctx.open_session()
            width = model.n_embd

            def feed(rows: np.ndarray, at: int) -> None:
                positions = np.arange(at, at + rows.shape[0], dtype=np.int32)
                seqs = np.zeros(rows.shape[0], dtype=np.int32)
                if model.is_first:
                    ctx.decode(tokens=rows, positions=positions, seq_ids=seqs)
                else:
                    hidden = rng.standard_normal((rows.shape[0], width)).astype(np.float32)
                    ctx.decode(activations=hidden, positions=positions, seq_ids=seqs)

            feed(prompt, 0)
            position = prompt.shape[0]
            checkpoint_ms, restore_ms, replay_ms, window_ms = [], [], [], []
            state_bytes = session_bytes = 0
            for _ in range(args.rounds):
                window = rng.integers(100, 30000, args.window + 1).astype(np.int32)
                stats = ctx.rollback_stats
                before = stats.checkpoint_ns
                started = time.perf_counter_ns()
                feed(window, position)
                elapsed = time.perf_counter_ns() - started
                taken = stats.checkpoint_ns - before
                checkpoint_ms.append(taken / 1e6)
                window_ms.append((elapsed - taken) / 1e6)
                ring = ctx._rings[seq]
                state_bytes = len(ring[-1].state or b"")
                session_bytes = max(session_bytes, ctx.checkpoint_bytes(seq))
                rollback, restore = stats.rollback_ns, stats.restore_ns
                ctx.trim(seq, position + 2)
                restore_ms.append((stats.restore_ns - restore) / 1e6)
                replay_ms.append((stats.rollback_ns - rollback - (stats.restore_ns - restore)) / 1e6)
                position += 2
            print(f"{start:>3}:{end:<4} {state_bytes:>11} {session_bytes:>12} {statistics.median(checkpoint_ms):>8.3f} "
                  f"{statistics.median(restore_ms):>11.3f} {statistics.median(replay_ms):>10.3f} "
                  f"{statistics.median(window_ms):>10.3f}")


if __name__ == "__main__":
    main()
