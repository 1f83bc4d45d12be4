"""Small-batch mul_mat cost: ms per batch of n columns for two ggml builds, rounds interleaved.

Compiles ``bench/small_batch_mul_mat.c`` once and runs it against each library folder in turn
(``LD_LIBRARY_PATH``), ``--rounds`` times alternating, then prints per type, shape and n the median
CPU ms per batch of each build and their ratio.  Typical use: ``--libs build/mm-on/bin,build/mm-off/bin``
(the pristine tree configured with native/build.py's ``BASE_CMAKE_ARGS`` plus ``-DGGML_LLAMAFILE=ON``
/ ``OFF``, target ``ggml-cpu``) to see tinyBLAS against the vec_dot path, or ``--libs OLD,skippy/lib`` for before / after patch 0018.  CPU time (the process's) is what
it reports: on a shared host the wall time is noise.

    SKIPPY_LLAMA_SRC=... python bench/small_batch.py --libs build/mm-on/bin,build/mm-off/bin \\
        --shapes f16:1024:32768,q8_0:1024:65536 --counts 1,2,3,4,8 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "bench" / "small_batch_mul_mat.c"


def _include() -> Path:
    src = os.environ.get("SKIPPY_LLAMA_SRC")
    if src:
        return Path(src) / "ggml" / "include"
    found = sorted((ROOT / "build").glob("llama-src-*/ggml/include"))
    if not found:
        raise SystemExit("no ggml headers: set SKIPPY_LLAMA_SRC or build once (python native/build.py)")
    return found[-1]


def compile_bench(lib: Path, out: Path) -> Path:
    exe = out / "small_batch_mul_mat"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(SOURCE), f"-I{_include()}", f"-L{lib}",
                    "-lggml-cpu", "-lggml-base"], check=True)
    return exe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libs", required=True, help="comma-separated library folders (libggml-cpu.so, libggml-base.so)")
    parser.add_argument("--shapes", default="f16:1024:32768,f32:1024:16384,q8_0:1024:32768,q4_0:1024:32768,"
                                            "q4_K:1024:32768,q5_K:1024:32768,q6_K:1024:32768")
    parser.add_argument("--counts", default="1,2,3,4,5,6,7,8,16,32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-ms", type=float, default=15.0, help="time each of 7 repetitions at least this long")
    args = parser.parse_args()
    libs = [Path(p).resolve() for p in args.libs.split(",")]
    times: dict[tuple[str, str, str, int], list[tuple[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_bench(libs[0], Path(tmp))
        for _ in range(args.rounds):
            for lib in libs:
                env = dict(os.environ, LD_LIBRARY_PATH=str(lib), OMP_WAIT_POLICY="PASSIVE")
                run = subprocess.run([str(exe), str(args.threads), args.shapes, args.counts, str(args.min_ms)],
                                     env=env, check=True, capture_output=True, text=True)
                for line in run.stdout.splitlines():
                    name, k, m, n, _, cpu, _wall = line.split()
                    times[(name, k, m, int(n))].append((str(lib), float(cpu)))
    names = [lib.name if lib.name != "bin" else lib.parent.name for lib in libs]
    print(f"CPU ms per mul_mat batch, {args.threads} thread(s), median of {args.rounds} interleaved rounds "
          f"(each the median of 7 repetitions)\n")
    print("| type | K x M | n | " + " | ".join(names) + f" | {names[1]} / {names[0]} |")
    print("|---|---|---|" + "---|" * (len(libs) + 1))
    for (name, k, m, n), pairs in times.items():
        med = [statistics.median([c for lib, c in pairs if lib == str(p)]) for p in libs]
        print(f"| {name} | {k} x {m} | {n} | " + " | ".join(f"{v:.3f}" for v in med) + f" | {med[1] / med[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
