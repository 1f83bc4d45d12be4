"""Subprocess probe: load one stage, decode once, print its memory figures as JSON.

Run as ``python memory_probe.py MODEL A:B``; a fresh process per stage keeps the figures clean.
"""

from __future__ import annotations

import json
import sys

from skippy.runtime import Model, StageContext, resident_bytes


def main() -> None:
    path, layers = sys.argv[1], sys.argv[2]
    baseline = resident_bytes()
    model = Model(path, layers)
    context = StageContext(model, n_ctx=1024, max_sessions=1, n_batch=32, threads=2)
    n = 16
    if model.is_first:
        context.decode(tokens=list(range(1, n + 1)), positions=list(range(n)), seq_ids=[0] * n)
    else:
        import numpy as np

        tokens = list(range(1, n + 1)) if model.reads_tokens else None  # per-layer token embeddings
        context.decode(activations=np.zeros((n, model.n_embd), np.float32), positions=list(range(n)), seq_ids=[0] * n,
                       tokens=tokens)
    report = context.memory()
    print(json.dumps({
        "layers": layers,
        "weights": report.weights,
        "kv_capacity": report.kv_capacity,
        "resident_delta": report.resident - baseline,
        "mmap": model.use_mmap,
    }))


if __name__ == "__main__":
    main()
