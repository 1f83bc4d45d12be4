"""Chained page hashes: both implementations, the spec written out, pinned values, input forms."""

from __future__ import annotations

import array
import importlib
import os
from types import ModuleType

import numpy as np
import pytest

from skippy.cache import radix

IMPLEMENTATIONS = {"py": "skippy.cache._radix_py", "c": "skippy.cache._radix"}
M64 = (1 << 64) - 1


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def radix_impl(request: pytest.FixtureRequest) -> ModuleType:
    if request.param == "c":
        return pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    return importlib.import_module(IMPLEMENTATIONS[request.param])


def test_the_extension_is_used_unless_disabled() -> None:
    if os.environ.get("SKIPPY_NO_EXTENSIONS") == "1":
        assert radix.IMPLEMENTATION == "python"
    else:
        assert radix.EXTENSION_IMPORT_ERROR is None
        assert radix.IMPLEMENTATION == "cython"


def spec_hashes(tokens: list[int], seed: int, page_size: int) -> list[int]:
    """The module header's definition, token by token, with Python ints only."""
    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & M64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & M64
        return x ^ (x >> 31)

    state = mix(seed ^ ((page_size * 0x9E3779B97F4A7C15) & M64))
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = [t & 0xFFFFFFFF for t in tokens[start:start + page_size]] + [0]
        for j in range(0, page_size, 2):
            state = mix(state ^ (page[j] | (page[j + 1] << 32 if j + 1 < page_size else 0)))
        out.append(state)
    return out


@pytest.mark.parametrize("page_size", [1, 2, 3, 7, 16, 64])
@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF, M64])
def test_matches_the_written_spec(radix_impl: ModuleType, page_size: int, seed: int) -> None:
    tokens = np.random.default_rng(page_size).integers(-(1 << 31), 1 << 31, 150, dtype=np.int64).tolist()
    got = radix_impl.page_hashes(np.asarray(tokens, dtype=np.int32), seed, page_size)
    assert got.dtype == np.uint64
    assert got.tolist() == spec_hashes(tokens, seed, page_size)


def test_pinned_values(radix_impl: ModuleType) -> None:
    """Cached prefixes are keyed by these values: a change must bump the identity version."""
    assert radix_impl.page_hashes(list(range(128)), 0, 64).tolist() == [0xC75C5C8343725EF3, 0xE2BE1C91FDE31ED3]
    assert radix_impl.page_hashes([1, 2, 3, 4, 5], 0xDEADBEEF, 2).tolist() == [0x1814AE69B5CEEF2F, 0x7553A71F8EB1E97A]
    assert radix_impl.page_hashes([-1, 2**31 - 1, -2**31], 7, 3).tolist() == [0xC60B7BA499240401]


def test_only_full_pages_are_hashed(radix_impl: ModuleType) -> None:
    tokens = np.arange(200, dtype=np.int32)
    assert len(radix_impl.page_hashes(tokens, 0, 64)) == 3
    assert len(radix_impl.page_hashes(tokens[:63], 0, 64)) == 0
    assert len(radix_impl.page_hashes(np.zeros(0, dtype=np.int32), 0, 64)) == 0
    assert radix_impl.page_hashes(tokens[:192], 0).tolist() == radix_impl.page_hashes(tokens, 0).tolist()


def test_input_forms_agree(radix_impl: ModuleType) -> None:
    values = [5, 1, 31999, 0, 7, 7, 2, 3] * 5
    want = radix_impl.page_hashes(np.asarray(values, dtype=np.int32), 9, 8).tolist()
    forms: list[object] = [
        values, tuple(values), np.asarray(values, dtype=np.int64), array.array("i", values),
        np.asarray(values, dtype="<i4").tobytes(), bytearray(np.asarray(values, dtype="<i4").tobytes()),
        memoryview(np.asarray(values, dtype=np.int32)), np.repeat(np.asarray(values, dtype=np.int32), 2)[::2],
    ]
    for form in forms:
        assert radix_impl.page_hashes(form, 9, 8).tolist() == want, type(form)


@pytest.mark.parametrize("bad", [
    np.zeros((2, 8), dtype=np.int32), [1 << 31], [-(1 << 31) - 1], np.zeros(4, dtype=np.float32), b"abc",
])
def test_bad_tokens_are_refused(radix_impl: ModuleType, bad: object) -> None:
    with pytest.raises(ValueError):
        radix_impl.page_hashes(bad, 0, 2)


@pytest.mark.parametrize("seed, page_size", [(-1, 64), (1 << 64, 64), (0, 0), (0, -3), (0, 1 << 17), (0, 2.0)])
def test_bad_seed_or_page_size_is_refused(radix_impl: ModuleType, seed: int, page_size: int) -> None:
    with pytest.raises(ValueError):
        radix_impl.page_hashes([1, 2, 3, 4], seed, page_size)


def test_chained_property(radix_impl: ModuleType) -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 32000, 512, dtype=np.int32)
    hashes = radix_impl.page_hashes(base, 3, 64)
    for position in (0, 63, 64, 200, 511):
        other = base.copy()
        other[position] += 1
        changed = radix_impl.page_hashes(other, 3, 64)
        page = position // 64
        assert changed[:page].tolist() == hashes[:page].tolist()
        assert all(a != b for a, b in zip(changed[page:].tolist(), hashes[page:].tolist()))


def test_seed_and_page_size_separate_hashes(radix_impl: ModuleType) -> None:
    tokens = np.arange(256, dtype=np.int32)
    a = radix_impl.page_hashes(tokens, 1, 64).tolist()
    b = radix_impl.page_hashes(tokens, 2, 64).tolist()
    c = radix_impl.page_hashes(tokens, 1, 32).tolist()
    assert not set(a) & set(b)
    assert not set(a) & set(c)
