"""Measure every CPU variant of a variants build on this host: prefill and decode speed, and whether
a split still equals the unsplit model (and nothing crashes) on a multi-token batch.

Strategy: each variant runs in its own process (``SKIPPY_CPU_VARIANT=<name>``, so a segfault is a
result, not the end of the run): the real Gemma 3 270M when installed (the model the AMX/AVX-512
segfault was seen on), else a generated model; a 64-token prefill, 32 greedy decode steps, and
the logits of a two-stage split compared bitwise with the unsplit run's.  Variants this CPU cannot
run (score 0) are listed and skipped.  The package must be a variants build
(``SKIPPY_CPU_VARIANTS=all``; e.g. the installed CPU wheel):

    python bench/cpu_variants.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import numpy as np
from skippy.runtime import ffi as binding, read_gguf_info
from skippy.runtime.local import LocalChain
try:
    from skippy.models.real import ensure_real_model
    path = ensure_real_model()
except Exception:
    from skippy.models.cache import ensure_model
    from skippy.models.spec import tiny
    path = ensure_model(tiny("llama", n_embd=128))
threads = int(sys.argv[1])
n_layer = read_gguf_info(path).n_layer
prompt = [2] + [(17 * i + 5) % 2000 + 100 for i in range(63)]
def run(split, steps):
    with LocalChain(path, split, n_ctx=256, max_sessions=1, n_batch=64, threads=threads) as chain:
        started = time.perf_counter()
        chain.decode(prompt, list(range(64)), [0] * 64, [True] * 64)
        prefill = time.perf_counter() - started
        rows = list(chain.logits())
        token = int(np.argmax(rows[-1]))
        started = time.perf_counter()
        for step in range(steps):
            chain.decode([token], [64 + step], [0], [True])
            rows += chain.logits()
            token = int(np.argmax(rows[-1]))
        decode = time.perf_counter() - started
        return np.stack(rows), 64 / prefill, steps / max(decode, 1e-9)
unsplit, prefill, decode = run([(0, n_layer)], 32)
split, _, _ = run([(0, n_layer // 2), (n_layer // 2, n_layer)], 32)
print(json.dumps({"variant": binding.BACKENDS.cpu.name if binding.BACKENDS else "linked-in",
                  "model": path.name, "prefill_tok_s": round(prefill, 1), "decode_tok_s": round(decode, 2),
                  "split_equals_unsplit": bool(np.array_equal(split, unsplit)),
                  "finite": bool(np.isfinite(unsplit).all())}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    from skippy.runtime.backends import UNTRUSTED, cpu_variants

    import skippy

    lib_dir = Path(skippy.__file__).resolve().parent / "lib"
    variants = cpu_variants(lib_dir)
    if not variants:
        print(f"{lib_dir} holds no CPU variants (not a SKIPPY_CPU_VARIANTS=all build)", file=sys.stderr)
        return 2
    results = []
    for variant in sorted(variants, key=lambda v: v.score):
        if variant.score == 0:
            results.append({"variant": variant.name, "skipped": "this CPU cannot run it"})
            continue
        env = dict(os.environ, SKIPPY_CPU_VARIANT=variant.name)
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.threads)], env=env, capture_output=True,
                              text=True, timeout=1800)
        if done.returncode != 0:
            results.append({"variant": variant.name, "crashed": done.returncode, "stderr": done.stderr[-500:]})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        results[-1]["score"] = variant.score
        results[-1]["chosen_by_score"] = variant.name not in UNTRUSTED
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
