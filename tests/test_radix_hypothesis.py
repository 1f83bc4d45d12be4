"""Property tests of the chained page hash: implementations agree, prefixes, identity seeds."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from skippy.cache import _radix_py  # noqa: E402
from skippy.cache.identity import CacheIdentity  # noqa: E402

_radix = pytest.importorskip("skippy.cache._radix", reason="Cython extension not built")

tokens_st = st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=300)
page_st = st.integers(1, 40)
seed_st = st.integers(0, (1 << 64) - 1)


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_st, seed=seed_st, page_size=page_st)
def test_implementations_agree(tokens: list[int], seed: int, page_size: int) -> None:
    array = np.asarray(tokens, dtype=np.int32)
    assert _radix.page_hashes(array, seed, page_size).tolist() == _radix_py.page_hashes(array, seed, page_size).tolist()


@settings(max_examples=150, deadline=None)
@given(common=tokens_st, a=tokens_st, b=tokens_st, seed=seed_st, page_size=page_st)
def test_equal_prefixes_give_equal_pages_and_a_difference_changes_every_later_page(
        common: list[int], a: list[int], b: list[int], seed: int, page_size: int) -> None:
    left = _radix.page_hashes(common + a, seed, page_size).tolist()
    right = _radix.page_hashes(common + b, seed, page_size).tolist()
    shared = len(common) // page_size
    assert left[:shared] == right[:shared]
    # the first page where the token sequences differ, and every later page, differ in hash
    first_diff = next((i for i, (x, y) in enumerate(zip(common + a, common + b)) if x != y), None)
    if first_diff is not None:
        page = first_diff // page_size
        assert all(x != y for x, y in zip(left[page:], right[page:]))


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 31999), min_size=8, max_size=64),
       first=st.one_of(st.none(), st.text(max_size=8)), second=st.one_of(st.none(), st.text(max_size=8)))
def test_identity_seeds_separate_namespaces(tokens: list[int], first: str | None, second: str | None) -> None:
    base = CacheIdentity(model_identity="m" * 24, layer_start=0, layer_end=2, n_ctx=512, page_size=8)
    one, two = base.with_namespace(first), base.with_namespace(second)
    if first == second:
        assert one == two and one.seed == two.seed
        return
    assert one != two and one.seed != two.seed
    left = _radix.page_hashes(tokens, one.seed, 8).tolist()
    right = _radix.page_hashes(tokens, two.seed, 8).tolist()
    assert not set(left) & set(right)
