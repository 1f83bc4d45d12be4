"""Small-batch mul_mat through skippy's own ggml (ctypes): per-column bits and CPU ms per product.

Patch 0018 gives products of 2..8 columns a faster kernel with stock tinyBLAS's bits;
``SKIPPY_SMALL_BATCH_KERNEL=0`` (read once per process) keeps stock tinyBLAS.  Each measurement runs
in a child process per setting, the settings alternating round by round; the table gives medians of
the rounds (CPU time of the child: on a shared host wall time is noise).
``tests/test_small_batch_kernel.py`` uses :func:`column_digests` for the bitwise check.

    PYTHONPATH=. python bench/small_batch.py --shapes f16:1024:32768,q8_0:640:65536 --counts 1,2,3,4,8
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LIB_DIR = ROOT / "skippy" / "lib"
SWITCH = "SKIPPY_SMALL_BATCH_KERNEL"
#: ggml's type ids (ggml.h), checked against ggml_type_name at load
TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "q4_K": 12}
#: The most columns a product here takes (the kernel takes F16 / F32 up to 16)
MAX_COLUMNS = 24


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """The few ggml calls a mul_mat needs, from ``libggml-base`` and ``libggml-cpu`` in ``lib_dir``."""

    def __init__(self, lib_dir: Path = LIB_DIR) -> None:
        cpu = lib_dir / "libggml-cpu.so"
        if not cpu.exists():
            raise FileNotFoundError(f"{cpu} not found (a CPU-variants build has no single libggml-cpu)")
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(cpu), mode=ctypes.RTLD_GLOBAL)
        b, c, p, i64 = self.base, self.cpu, ctypes.c_void_p, ctypes.c_int64
        b.ggml_init.argtypes, b.ggml_init.restype = [_InitParams], p
        b.ggml_free.argtypes = [p]
        b.ggml_new_tensor_2d.argtypes, b.ggml_new_tensor_2d.restype = [p, ctypes.c_int, i64, i64], p
        b.ggml_get_data.argtypes, b.ggml_get_data.restype = [p], p
        b.ggml_row_size.argtypes, b.ggml_row_size.restype = [ctypes.c_int, i64], ctypes.c_size_t
        b.ggml_type_name.argtypes, b.ggml_type_name.restype = [ctypes.c_int], ctypes.c_char_p
        b.ggml_mul_mat.argtypes, b.ggml_mul_mat.restype = [p, p, p], p
        b.ggml_new_graph.argtypes, b.ggml_new_graph.restype = [p], p
        b.ggml_build_forward_expand.argtypes = [p, p]
        b.ggml_quantize_chunk.argtypes = [ctypes.c_int, p, p, i64, i64, i64, p]
        b.ggml_quantize_chunk.restype = ctypes.c_size_t
        b.ggml_fp32_to_fp16_row.argtypes = [p, p, i64]
        b.ggml_tensor_overhead.restype = ctypes.c_size_t
        b.ggml_graph_overhead.restype = ctypes.c_size_t
        c.ggml_cpu_init.argtypes = []
        c.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
        c.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        for name, code in TYPES.items():
            if b.ggml_type_name(code).decode() != name:
                raise RuntimeError(f"ggml type {code} is {b.ggml_type_name(code)!r}, not {name}")
        c.ggml_cpu_init()


class Product:
    """A [k x m] weight of one type by n F32 columns of k (random, seeded), ready to compute."""

    def __init__(self, g: Ggml, type_name: str, k: int, m: int, n: int, seed: int = 1) -> None:
        self.g, self.m, self.n = g, m, n
        t = TYPES[type_name]
        if not 1 <= n <= MAX_COLUMNS:
            raise ValueError(f"n = {n}: 1 to {MAX_COLUMNS} columns")
        rng = np.random.default_rng(seed)
        weight_bytes = g.base.ggml_row_size(t, k) * m
        size = weight_bytes + 4 * (k + m) * n * 3 + 16 * g.base.ggml_tensor_overhead() + g.base.ggml_graph_overhead()
        self.ctx = g.base.ggml_init(_InitParams(size + (8 << 20), None, False))
        w = g.base.ggml_new_tensor_2d(self.ctx, t, k, m)
        x = g.base.ggml_new_tensor_2d(self.ctx, TYPES["f32"], k, n)
        weights = np.ascontiguousarray(rng.uniform(-0.5, 0.5, k * m).astype(np.float32))
        wdata = g.base.ggml_get_data(w)
        if type_name == "f32":
            ctypes.memmove(wdata, weights.ctypes.data, 4 * k * m)
        elif type_name == "f16":
            g.base.ggml_fp32_to_fp16_row(weights.ctypes.data, wdata, k * m)
        else:
            g.base.ggml_quantize_chunk(t, weights.ctypes.data, wdata, 0, m, k, None)
        # the first n of the seed's columns: a product of fewer columns has the same leading columns
        columns = np.ascontiguousarray(rng.uniform(-1.0, 1.0, (MAX_COLUMNS, k)).astype(np.float32)[:n])
        ctypes.memmove(g.base.ggml_get_data(x), columns.ctypes.data, 4 * k * n)
        self.y = g.base.ggml_mul_mat(self.ctx, w, x)
        self.graph = g.base.ggml_new_graph(self.ctx)
        g.base.ggml_build_forward_expand(self.graph, self.y)

    def compute(self, threads: int = 1) -> None:
        if self.g.cpu.ggml_graph_compute_with_ctx(self.ctx, self.graph, threads) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")

    def columns(self) -> list[bytes]:
        """The output, one bytes object per column (m float32 each)."""
        raw = ctypes.string_at(self.g.base.ggml_get_data(self.y), 4 * self.m * self.n)
        return [raw[4 * self.m * j: 4 * self.m * (j + 1)] for j in range(self.n)]

    def free(self) -> None:
        self.g.base.ggml_free(self.ctx)


def column_digests(type_name: str, k: int, m: int, n: int, threads: int = 1, seed: int = 1) -> list[str]:
    """sha256 of each output column of one product (the first n of the seed's columns)."""
    product = Product(Ggml(), type_name, k, m, n, seed)
    try:
        product.compute(threads)
        cols = product.columns()
        if any(np.isnan(np.frombuffer(col, dtype=np.float32)).any() for col in cols):
            raise RuntimeError("NaN in a product's output")
        return [hashlib.sha256(col).hexdigest() for col in cols]
    finally:
        product.free()


def _time_product(g: Ggml, type_name: str, k: int, m: int, n: int, threads: int, min_ms: float) -> float:
    """CPU ms per product: the median of 5 repetitions, each at least ``min_ms`` of wall time."""
    product = Product(g, type_name, k, m, n)
    try:
        product.compute(threads)
        reps = []
        for _ in range(5):
            iters, c0, w0 = 0, time.process_time(), time.perf_counter()
            while True:
                product.compute(threads)
                iters += 1
                if (time.perf_counter() - w0) * 1e3 >= min_ms:
                    break
            reps.append((time.process_time() - c0) * 1e3 / iters)
        return statistics.median(reps)
    finally:
        product.free()


def _child(spec: str) -> int:
    job = json.loads(spec)
    if job["what"] == "digests":
        print(json.dumps([column_digests(*case) for case in job["cases"]]))
        return 0
    g = Ggml()
    out = []
    for type_name, k, m in job["shapes"]:
        for n in job["counts"]:
            out.append([type_name, k, m, n, _time_product(g, type_name, k, m, n, job["threads"], job["min_ms"])])
    print(json.dumps(out))
    return 0


def run_child(job: dict[str, object], kernel: bool, timeout: float = 600.0) -> object:
    """Run one job in a child process with the small-batch kernel on or off; its JSON answer."""
    env = dict(os.environ, **{SWITCH: "1" if kernel else "0"})
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)],
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"small_batch child failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="f16:1024:32768,q8_0:640:65536", help="TYPE:K:M,...")
    parser.add_argument("--counts", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-ms", type=float, default=30.0)
    args = parser.parse_args()
    if args.child:
        return _child(args.child)
    shapes = [(s.split(":")[0], int(s.split(":")[1]), int(s.split(":")[2])) for s in args.shapes.split(",")]
    job = {"what": "time", "shapes": shapes, "counts": [int(c) for c in args.counts.split(",")],
           "threads": args.threads, "min_ms": args.min_ms}
    times: dict[tuple[str, int, int, int], dict[bool, list[float]]] = {}
    for _ in range(args.rounds):
        for kernel in (False, True):
            for type_name, k, m, n, ms in run_child(job, kernel):  # type: ignore[union-attr]
                times.setdefault((type_name, k, m, n), {False: [], True: []})[kernel].append(ms)
    print(f"CPU ms per product, {args.threads} thread(s), median of {args.rounds} interleaved rounds "
          "(each the median of 5 repetitions); stock = SKIPPY_SMALL_BATCH_KERNEL=0\n")
    print("| type | k x m | n | stock tinyBLAS | patch 0018 | ratio |")
    print("|---|---|---|---|---|---|")
    for (type_name, k, m, n), both in times.items():
        old, new = statistics.median(both[False]), statistics.median(both[True])
        print(f"| {type_name} | {k} x {m} | {n} | {old:.3f} | {new:.3f} | {new / old:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
