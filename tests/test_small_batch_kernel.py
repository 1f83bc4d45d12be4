"""Patch 0018's small-batch kernel (2..8 columns; F16 / F32 2..16) gives stock tinyBLAS's bits, column by column.

The prefix cache (copy + short suffix = fresh prefill), chunked replay and the recurrent rollback on
a chain rely on a row's result being the same for every batch of n >= 2 rows.  So the kernel must
give tinyBLAS's bits exactly: each product is computed in a child process with the kernel and with
``SKIPPY_SMALL_BATCH_KERNEL=0`` (stock tinyBLAS), and every output column must match, for F16, F32
and Q8_0 weights whose row counts (m) and lengths (k) are and are not multiples of the tiles, on 1
and 2 threads; and each column must be the same in every product of 2..17 columns (Q8_0 from 9 and F16 /
F32 at 17 are past the kernel: stock tinyBLAS either way; 9..16 F16 / F32 columns take the kernel's passes
given at run time).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import small_batch  # noqa: E402

#: (type, k, m): F16 and F32 take tinyBLAS only where k % 8 == 0 and m % 4 == 0 (else vec_dot, both ways);
#: Q8_0 takes it for every m (m % 4 rows in narrower tiles)
SHAPES = [("f16", 1000, 36), ("f16", 72, 148), ("f16", 104, 150), ("f16", 100, 64),
          ("f32", 256, 100), ("f32", 40, 66),
          ("q8_0", 224, 103), ("q8_0", 640, 102), ("q8_0", 96, 101), ("q8_0", 32, 4), ("q8_0", 1024, 64)]
COUNTS = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17]
THREADS = [1, 2]


Case = tuple[str, int, int, int, int]  # type, k, m, n, threads
Digests = dict[bool, dict[Case, list[str]]]  # kernel on / off -> case -> sha256 per column


@pytest.fixture(scope="module")
def digests() -> Digests:
    if not (small_batch.LIB_DIR / "libggml-cpu.so").exists():
        pytest.skip("no single libggml-cpu.so (a CPU-variants build)")
    cases = [(t, k, m, n, th) for t, k, m in SHAPES for n in COUNTS for th in THREADS]
    out: Digests = {}
    for kernel in (False, True):
        answer = small_batch.run_child({"what": "digests", "cases": cases}, kernel, timeout=300)
        assert isinstance(answer, list) and len(answer) == len(cases)
        out[kernel] = dict(zip(cases, answer))
    return out


@pytest.mark.parametrize(("type_name", "k", "m"), SHAPES)
def test_small_batches_give_stock_tinyblas_bits(digests: Digests, type_name: str, k: int, m: int) -> None:
    for n in COUNTS:
        for threads in THREADS:
            case = (type_name, k, m, n, threads)
            stock, ours = digests[False][case], digests[True][case]
            assert len(ours) == n
            bad = [j for j in range(n) if stock[j] != ours[j]]
            assert not bad, f"{case}: columns {bad} differ from stock tinyBLAS"


@pytest.mark.parametrize(("type_name", "k", "m"), SHAPES)
def test_a_column_does_not_depend_on_the_batch(digests: Digests, type_name: str, k: int, m: int) -> None:
    widest = digests[True][(type_name, k, m, COUNTS[-1], 1)]
    for n in COUNTS:
        for threads in THREADS:
            cols = digests[True][(type_name, k, m, n, threads)]
            assert cols == widest[:n], \
                f"{type_name} k={k} m={m}: n={n} on {threads} thread(s) differs from n={COUNTS[-1]}"
