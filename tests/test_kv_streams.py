"""A session's answer does not depend on the other sessions' KV cells: in the shared (unified)
pool by default, and with ``kv_streams`` (each session its own KV stream, llama.cpp's non-unified KV).

Without flash attention llama.cpp's CPU attention sums a row's softmax in float trees of 8 (AVX2)
or 16 (AVX-512) consecutive cells and the KQV product in 8 or 16 SIMD lanes, lane = cell index mod
8/16 (ggml_vec_soft_max_f32; tinyBLAS in llamafile/sgemm.cpp).  A session whose cells sit at an
offset that is not a multiple of 8, or interleave with another's, rounds differently (measured on
the real Gemma 3 270M Q4_K_M: another session's 1 to 33 cells first, logits 0.35 to 1.4 apart).
Native patch 0016 places each sequence's cells as it would hold them alone (cell = position mod
32, ascending); ``SKIPPY_KV_PLACEMENT=llama`` turns that off, and the last test shows the difference
then comes back (so do the other shared-pool checks on the tiny models; the real Gemma's, in the
slow suite, are the same checks).  In separate streams every session starts at cell 0.  A copy
between streams (forks of ``n`` > 1, the prefix cache) goes through the source's state, trimmed to
the prefix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from skippy.runtime import Model, StageContext
from skippy.runtime.errors import KvSlotUnavailable, SessionError

from conftest import model_path

PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354]
STEPS = 16  # the offset shows from the 11th step on (the tiny gemma3's window is 8)


def _run(ctx: StageContext, seq: int, start: int = 0, chunk: int = 8,
         steps: list[int] | None = None) -> tuple[list[np.ndarray], list[int]]:
    """Prefill PROMPT[start:] in chunks of ``chunk`` (positions from ``start``), then 16 steps, of
    ``steps`` (default: greedy); the logits of the last prompt token and of every step, and the steps."""
    for begin in range(start, len(PROMPT), chunk):
        end = min(len(PROMPT), begin + chunk)
        ctx.decode(tokens=PROMPT[begin:end], positions=list(range(begin, end)), seq_ids=[seq] * (end - begin))
    out = [np.array(ctx.logits(end - begin - 1), copy=True)]
    taken: list[int] = []
    for index in range(STEPS):
        taken.append(int(np.argmax(out[-1])) if steps is None else steps[index])
        ctx.decode(tokens=taken[-1:], positions=[len(PROMPT) + index], seq_ids=[seq])
        out.append(np.array(ctx.logits(0), copy=True))
    return out, taken


@pytest.fixture(scope="module")
def quantized() -> Path:
    return model_path("gemma3", dtype="Q8_0", n_embd=256)  # 64 wide rounds alike at any offset


@pytest.fixture(scope="module")
def quantized_full() -> Path:  # no window: every cell attended (shows the placement at every step)
    return model_path("qwen2", dtype="Q8_0", n_embd=256)


@pytest.fixture(scope="module")
def no_window() -> Path:  # a fork from an earlier chunk needs cells a sliding window drops
    return model_path("llama", dtype="F16", n_embd=256)


def _cells_before(ctx: StageContext) -> None:
    first = ctx.open_session()
    alone, steps = _run(ctx, first, chunk=len(PROMPT))
    ctx.close_session(first)
    for held in (1, 7, 13, 33):  # another session holds cells first (it got the lower cells in a pool)
        other, own = ctx.open_session(), ctx.open_session()
        ctx.decode(tokens=(PROMPT * 3)[:held], positions=list(range(held)), seq_ids=[other] * held)
        after, _ = _run(ctx, own, chunk=len(PROMPT), steps=steps)
        assert all(np.array_equal(a, b) for a, b in zip(alone, after)), held
        assert ctx.kv_cells_used() == held + len(PROMPT) + STEPS
        ctx.close_session(other)
        ctx.close_session(own)


@pytest.mark.parametrize("streams", [False, True], ids=["shared-pool", "kv-streams"])
def test_an_answer_does_not_depend_on_the_cells_before_it(quantized: Path, streams: bool) -> None:
    with Model(quantized) as model, StageContext(model, n_ctx=256, max_sessions=4, n_batch=64, threads=1,
                                                 kv_streams=streams) as ctx:
        _cells_before(ctx)


@pytest.mark.slow  # the fast suite: the same check on the tiny gemma3 (above), which fails without the placement
@pytest.mark.real_model
def test_a_real_gemma_answer_does_not_depend_on_the_cells_before_it(real_model: Path) -> None:
    """The shared pool (the default) on the real Gemma 3 270M Q4_K_M."""
    with Model(real_model) as model, StageContext(model, n_ctx=1024, max_sessions=4, n_batch=64,
                                                  threads=1) as ctx:
        _cells_before(ctx)


LONG = (PROMPT * 4)[:44]  # 44 tokens: chunks [0, 32) and [32, 44), or [0, 18), [18, 36) and [36, 44)


def _side_by_side(model: Model, fork: bool, chunk: int = 32) -> None:
    """Three sessions decoded step by step in turn (llama.cpp would interleave their cells) in the
    shared pool, each given its own steps, answer as each alone; with ``fork`` the second and third
    are forks of the first (its prefix up to its last chunk shared, that chunk recomputed, as ``n``
    > 1 does; chunks of 18: the prefix [0, 36) ends inside a block of 32 cells and a group of 8).
    One row a call: several rows in one batch take other kernel paths (decode batching,
    skippy/stage/scheduler.py), which is not what this tests."""
    with StageContext(model, n_ctx=512, max_sessions=4, n_batch=32, threads=1) as ctx:
        def prefill(seq: int, start: int = 0) -> np.ndarray:
            for begin in range(start, len(LONG), chunk):
                end = min(len(LONG), begin + chunk)
                ctx.decode(tokens=LONG[begin:end], positions=list(range(begin, end)), seq_ids=[seq] * (end - begin))
            return np.array(ctx.logits(end - begin - 1), copy=True)

        steps = [[(7 * index + 3 * s) % 200 + 20 for index in range(STEPS)] for s in range(3)]
        alone: list[list[np.ndarray]] = []
        for s in range(3):
            seq = ctx.open_session()
            rows = [prefill(seq)]
            for index, token in enumerate(steps[s]):
                ctx.decode(tokens=[token], positions=[len(LONG) + index], seq_ids=[seq])
                rows.append(np.array(ctx.logits(0), copy=True))
            alone.append(rows)
            ctx.close_session(seq)
        other = ctx.open_session()  # 5 cells first: nothing of the three starts at cell 0
        ctx.decode(tokens=PROMPT[:5], positions=list(range(5)), seq_ids=[other] * 5)
        seqs = [ctx.open_session() for _ in range(3)]
        together = [[prefill(seqs[0])]]
        for seq in seqs[1:]:
            if fork:
                last = (len(LONG) - 1) // chunk * chunk
                ctx.copy(seqs[0], seq, 0, last)
                together.append([prefill(seq, start=last)])
            else:
                together.append([prefill(seq)])
        for index in range(STEPS):  # one row a call: a batch of rows rounds otherwise (scheduler.py)
            for s in range(3):
                ctx.decode(tokens=[steps[s][index]], positions=[len(LONG) + index], seq_ids=[seqs[s]])
                together[s].append(np.array(ctx.logits(0), copy=True))
    for s in range(3):
        assert all(np.array_equal(a, b) for a, b in zip(alone[s], together[s])), s
    assert not np.array_equal(alone[1][-1], alone[2][-1])  # three different answers


@pytest.mark.parametrize(("fork", "chunk"), [(False, 32), (True, 32), (True, 18)],
                         ids=["sessions", "forks", "forks-mid-block"])
def test_sessions_decoded_side_by_side_answer_as_alone(quantized_full: Path, fork: bool, chunk: int) -> None:
    with Model(quantized_full) as model:
        _side_by_side(model, fork, chunk)


@pytest.mark.slow  # the fast suite: the same forks on the tiny qwen2 (above), which fail without the placement
@pytest.mark.real_model
@pytest.mark.parametrize("chunk", [32, 18])
def test_real_gemma_forks_decoded_side_by_side_answer_as_alone(real_model: Path, chunk: int) -> None:
    with Model(real_model) as model:
        _side_by_side(model, fork=True, chunk=chunk)


def test_a_fork_that_recomputes_the_last_chunk_is_the_session_alone(no_window: Path) -> None:
    with Model(no_window) as model, StageContext(model, n_ctx=256, max_sessions=4, n_batch=64, threads=1,
                                                 kv_streams=True) as ctx:
        parent = ctx.open_session()
        alone, steps = _run(ctx, parent)  # chunks [0, 8) and [8, 12)
        fork = ctx.open_session()
        ctx.copy(parent, fork, 0, 8)
        assert ctx.length(fork) == 8 and ctx.length(parent) == len(PROMPT) + STEPS
        forked, _ = _run(ctx, fork, start=8, steps=steps)
        assert all(np.array_equal(a, b) for a, b in zip(alone, forked))
        with pytest.raises(SessionError, match="prefix"):
            ctx.copy(parent, fork, 2, 8)
        ctx.keep(fork)  # every other stream emptied
        assert ctx.length(parent) == 0 and ctx.length(fork) == len(PROMPT) + STEPS


def test_separate_streams_batch_sessions_together(no_window: Path) -> None:
    """Rows of several sessions (ids not consecutive, unequal row counts) in one decode: llama.cpp
    splits them into per-stream micro-batches; each session's logits come back at its rows."""
    with Model(no_window) as model, StageContext(model, n_ctx=256, max_sessions=8, n_batch=64, threads=1,
                                                 kv_streams=True) as ctx:
        seqs = [ctx.open_session() for _ in range(4)][::2]
        for seq in seqs:
            ctx.decode(tokens=PROMPT, positions=list(range(len(PROMPT))), seq_ids=[seq] * len(PROMPT))
        n = len(PROMPT)
        ctx.decode(tokens=[7, 11, 12, 13], positions=[n, n, n + 1, n + 2], seq_ids=[seqs[0], seqs[1], seqs[1], seqs[1]])
        batched = [np.array(ctx.logits(row), copy=True) for row in (0, 3)]
        for seq in seqs:
            ctx.trim(seq, n)
        ctx.decode(tokens=[7], positions=[n], seq_ids=[seqs[0]])
        alone = [np.array(ctx.logits(0), copy=True)]
        ctx.decode(tokens=[11, 12, 13], positions=[n, n + 1, n + 2], seq_ids=[seqs[1]] * 3)
        alone.append(np.array(ctx.logits(2), copy=True))
    assert not np.allclose(alone[0], alone[1], atol=1e-2)  # two different rows
    for a, b in zip(alone, batched):
        assert np.allclose(a, b, atol=1e-3)  # the same rows, up to summation order


def test_llama_cpp_placement_makes_the_answers_differ(quantized_full: Path) -> None:
    """The same check with llama.cpp's own placement (``SKIPPY_KV_PLACEMENT=llama``, read once per
    process, hence a child process) fails: the placement is what makes the answers equal."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_kv_streams as t; "
            "from skippy.runtime import Model\n"
            "with Model(sys.argv[2]) as model:\n"
            "    try:\n        t._side_by_side(model, fork=False)\n    except AssertionError:\n        sys.exit(3)\n")
    env = {**os.environ, "SKIPPY_KV_PLACEMENT": "llama"}
    result = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(quantized_full)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]


def test_the_shared_pool_still_takes_every_cell(quantized_full: Path) -> None:
    """The placement costs no cells: five sessions of 51 tokens fill 255 of 256 cells although
    blocks of 32 would need 320 (the fifth goes where llama.cpp's own search finds room)."""
    with Model(quantized_full) as model, StageContext(model, n_ctx=256, max_sessions=8, n_batch=64,
                                                      threads=1) as ctx:
        assert ctx.n_ctx == 256
        for _ in range(5):
            seq = ctx.open_session()
            tokens = (PROMPT * 5)[:51]
            ctx.decode(tokens=tokens, positions=list(range(51)), seq_ids=[seq] * 51)
        assert ctx.kv_cells_used() == 255
        extra = ctx.open_session()
        with pytest.raises(KvSlotUnavailable):  # one cell left
            ctx.decode(tokens=PROMPT[:2], positions=[0, 1], seq_ids=[extra] * 2)
        ctx.decode(tokens=PROMPT[:1], positions=[0], seq_ids=[extra])  # the 256th
        assert ctx.kv_cells_used() == 256
