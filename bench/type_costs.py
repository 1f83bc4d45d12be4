"""CPU time per multiply-add of one matrix product by weight type and batch columns: the table
``skippy.deploy.cost.ROW_NS_PER_MAC`` is calibrated from.

Each type's weight (``K x M``, random, quantized once) is placed as llama.cpp's loader places it on
this CPU: in the CPU repack buffer where ggml repacks that type (Q4_0, Q4_K, IQ4_NL on x86 AVX2:
``ggml_repack_get_optimal_repack_type``; Q5_K / Q6_K only on ARM), else in a plain buffer (F32, F16,
Q8_0 and Q5_0 go through tinyBLAS, patch 0018 for F32 / F16 / Q8_0 at 2..8 columns; Q5_K / Q6_K
through ggml's vec_dot).  Products of 1..8 columns
(and 12, 16) are timed in rounds interleaved over types and column counts, in this one process
(1 thread, CPU time: on a shared host wall time is noise); the table gives each product's median
over the rounds in nanoseconds of CPU per multiply-add of one column (one token row).

    PYTHONPATH=. python bench/type_costs.py --rounds 5
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from small_batch import Ggml, _InitParams  # noqa: E402  (bench/ is not a package)

#: ggml type ids (ggml.h) and whether ggml repacks the type on x86 AVX2 (repack.cpp)
TYPES = {"f32": (0, False), "f16": (1, False), "q4_0": (2, True), "q5_0": (6, False), "q8_0": (8, False),
         "q4_K": (12, True), "q5_K": (13, False), "q6_K": (14, False)}


class _CPlan(ctypes.Structure):
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


class RepackProduct:
    """A ``[k x m]`` weight by ``n`` F32 columns, the weight placed as the loader places it."""

    def __init__(self, g: Ggml, type_name: str, k: int, m: int, counts: list[int]) -> None:
        b, p = g.base, ctypes.c_void_p
        b.ggml_backend_alloc_ctx_tensors_from_buft.argtypes = [p, p]
        b.ggml_backend_alloc_ctx_tensors_from_buft.restype = p
        b.ggml_backend_tensor_set.argtypes = [p, p, ctypes.c_size_t, ctypes.c_size_t]
        b.ggml_backend_buffer_free.argtypes = [p]
        b.ggml_nbytes.argtypes, b.ggml_nbytes.restype = [p], ctypes.c_size_t
        code, repacked = TYPES[type_name]
        self.g, self.k, self.m, self.type_name = g, k, m, type_name
        rng = np.random.default_rng(1)
        weights = np.ascontiguousarray(rng.uniform(-0.5, 0.5, k * m).astype(np.float32))
        raw = ctypes.create_string_buffer(b.ggml_row_size(code, k) * m)
        if type_name == "f32":
            ctypes.memmove(raw, weights.ctypes.data, 4 * k * m)
        elif type_name == "f16":
            b.ggml_fp32_to_fp16_row(weights.ctypes.data, ctypes.addressof(raw), k * m)
        else:
            b.ggml_quantize_chunk(code, weights.ctypes.data, ctypes.addressof(raw), 0, m, k, None)
        self.wctx = b.ggml_init(_InitParams(4 * b.ggml_tensor_overhead(), None, True))
        self.w = b.ggml_new_tensor_2d(self.wctx, code, k, m)
        if repacked:
            buft = ctypes.CDLL(str(Path(g.cpu._name)), mode=ctypes.RTLD_GLOBAL)[
                "_Z35ggml_backend_cpu_repack_buffer_typev"]
            buft.restype = p
            self.buffer = b.ggml_backend_alloc_ctx_tensors_from_buft(self.wctx, buft())
        else:
            b.ggml_backend_cpu_buffer_type.restype = p
            self.buffer = b.ggml_backend_alloc_ctx_tensors_from_buft(self.wctx, b.ggml_backend_cpu_buffer_type())
        if not self.buffer:
            raise RuntimeError(f"cannot allocate the {type_name} weight")
        b.ggml_backend_tensor_set(self.w, raw, 0, b.ggml_nbytes(self.w))
        del raw
        columns = np.ascontiguousarray(rng.uniform(-1.0, 1.0, (max(counts), k)).astype(np.float32))
        self.graphs = {}
        size = 4 * (k + m) * sum(counts) + 4 * len(counts) * (b.ggml_graph_overhead() + b.ggml_tensor_overhead())
        self.ctx = b.ggml_init(_InitParams(size + (32 << 20), None, False))
        for n in counts:
            x = b.ggml_new_tensor_2d(self.ctx, 0, k, n)
            ctypes.memmove(b.ggml_get_data(x), columns.ctypes.data, 4 * k * n)
            y = b.ggml_mul_mat(self.ctx, self.w, x)
            graph = b.ggml_new_graph(self.ctx)
            b.ggml_build_forward_expand(graph, y)
            g.cpu.ggml_graph_plan.argtypes = [p, ctypes.c_int, p]
            g.cpu.ggml_graph_plan.restype = _CPlan
            g.cpu.ggml_graph_compute.argtypes = [p, ctypes.POINTER(_CPlan)]
            plan = g.cpu.ggml_graph_plan(graph, 1, None)
            work = ctypes.create_string_buffer(max(1, plan.work_size))
            plan.work_data = ctypes.addressof(work)
            self.graphs[n] = (graph, plan, work)  # one work buffer per product, reused

    def time_ns_per_mac(self, n: int, min_ms: float) -> float:
        """CPU ns per multiply-add of one column: one timed run of at least ``min_ms`` wall."""
        graph, plan, _ = self.graphs[n]
        compute = self.g.cpu.ggml_graph_compute
        compute(graph, ctypes.byref(plan))  # warm
        iters, c0, w0 = 0, time.process_time(), time.perf_counter()
        while True:
            if compute(graph, ctypes.byref(plan)) != 0:
                raise RuntimeError("ggml_graph_compute failed")
            iters += 1
            if (time.perf_counter() - w0) * 1e3 >= min_ms:
                break
        return (time.process_time() - c0) * 1e9 / iters / (self.k * self.m * n)

    def free(self) -> None:
        self.g.base.ggml_free(self.ctx)
        self.g.base.ggml_backend_buffer_free(self.buffer)
        self.g.base.ggml_free(self.wctx)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--m", type=int, default=24576, help="rows of the weight (default: 24 MiB of Q8_0)")
    parser.add_argument("--counts", default="1,2,3,4,5,6,7,8,12,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-ms", type=float, default=20.0)
    args = parser.parse_args()
    g = Ggml()
    counts = [int(c) for c in args.counts.split(",")]
    products = {name: RepackProduct(g, name, args.k, args.m, counts) for name in args.types.split(",")}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, product in products.items():
            for n in counts:
                times.setdefault((name, n), []).append(product.time_ns_per_mac(n, args.min_ms))
    print(f"CPU ns per multiply-add of one column, {args.k} x {args.m} weights, 1 thread, median of "
          f"{args.rounds} interleaved rounds (repacked: {', '.join(n for n in products if TYPES[n][1])})\n")
    print("| type | " + " | ".join(f"n={n}" for n in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for name in products:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(name, n)]):.4f}" for n in counts) + " |")
    for product in products.values():
        product.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
