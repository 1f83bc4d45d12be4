"""``kv_streams``: each session its own KV stream (llama.cpp's non-unified KV), so a session's
answer does not depend on where its cells land, i.e. on the sessions before it.

In the shared (unified) pool a session decoded while another holds cells before it sits at an
offset, and llama.cpp's attention sums its cells in other SIMD lanes: other logits (measured on
the real Gemma 3 270M Q4_K_M, docs/api-fields.md ``n``).  In separate streams every session starts
at cell 0.  A copy between streams (forks of ``n`` > 1, the prefix cache) goes through the
source's state, trimmed to the prefix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skippy.runtime import Model, StageContext
from skippy.runtime.errors import SessionError

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
def no_window() -> Path:  # a fork from an earlier chunk needs cells a sliding window drops
    return model_path("llama", dtype="F16", n_embd=256)


def test_an_answer_does_not_depend_on_the_cells_before_it(quantized: Path) -> None:
    with Model(quantized) as model, StageContext(model, n_ctx=256, max_sessions=4, n_batch=64, threads=1,
                                                 kv_streams=True) as ctx:
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
