"""The attended KV span (native/patches/0003-kv-attended-span.patch): a ubatch attends only over
the cells of its own sequences, so cells that other sequences hold (cached prefixes, other
sessions) cost nothing and change nothing.

Strategy: a stage context holds a "filler" sequence of 1536 cells below the session under test.
The filler is poisoned: it is decoded from infinite activations on a non-first stage, so its K/V
cells hold NaN.  Attending over a masked NaN cell still poisons the result (0 * NaN = NaN), so
the session's logits are finite only when its attention really leaves those cells out.  They must
then equal, bit for bit, the logits of the same session in an empty context.  A control run with
``SKIPPY_KV_FULL_SPAN=1`` (the library's switch back to the full span, read once per process, so
in a subprocess) shows the poison does reach a full-span attention.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import model_path
from skippy.runtime import Model, StageContext

FILLER_CELLS = 1536
CHUNK = 128
PROMPT_ROWS = 20  # longer than the tiny SWA window (8): crosses it
STEPS = 8


def _rows(model: Model, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, model.n_embd)).astype(np.float32)


def _session_logits(ctx: StageContext, model: Model, seed: int) -> list[np.ndarray]:
    """A prompt of activations, then STEPS single-row decodes; the final stage's logits of each."""
    seq = ctx.open_session()
    prompt = _rows(model, PROMPT_ROWS, seed)
    ctx.decode(activations=prompt, positions=np.arange(PROMPT_ROWS, dtype=np.int32),
               seq_ids=np.full(PROMPT_ROWS, seq, dtype=np.int32))
    out = [np.array(ctx.logits(PROMPT_ROWS - 1), copy=True)]
    steps = _rows(model, STEPS, seed + 1)
    for i in range(STEPS):
        ctx.decode(activations=steps[i:i + 1], positions=[PROMPT_ROWS + i], seq_ids=[seq])
        out.append(np.array(ctx.logits(0), copy=True))
    ctx.close_session(seq)
    return out


def _poison(ctx: StageContext, model: Model) -> None:
    filler = ctx.open_session()
    for start in range(0, FILLER_CELLS, CHUNK):
        ctx.decode(activations=np.full((CHUNK, model.n_embd), np.inf, dtype=np.float32),
                   positions=np.arange(start, start + CHUNK, dtype=np.int32),
                   seq_ids=np.full(CHUNK, filler, dtype=np.int32), outputs=[False] * CHUNK)


def run(arch: str) -> dict[str, object]:
    """Logits of one session in an empty context and beside the poisoned filler."""
    with Model(model_path(arch), "1:4") as model:
        empty = StageContext(model, n_ctx=4096, max_sessions=2, n_batch=CHUNK, threads=1)
        busy = StageContext(model, n_ctx=4096, max_sessions=2, n_batch=CHUNK, threads=1)
        try:
            _poison(busy, model)
            want = _session_logits(empty, model, seed=3)
            got = _session_logits(busy, model, seed=3)
        finally:
            empty.close()
            busy.close()
    return {
        "finite": all(bool(np.isfinite(row).all()) for row in got),
        "bitwise": all(np.array_equal(a, b) for a, b in zip(got, want)),
        "want_finite": all(bool(np.isfinite(row).all()) for row in want),
    }


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # a plain cache and an iSWA one (both caches)
def test_other_sequences_cells_are_left_out_and_change_nothing(arch: str) -> None:
    result = run(arch)
    assert result["want_finite"]
    assert result["finite"], "the session attended over the poisoned cells of another sequence"
    assert result["bitwise"]


@pytest.mark.slow
def test_full_span_control_sees_the_poison() -> None:
    """Without the span (SKIPPY_KV_FULL_SPAN=1) the masked NaN cells do poison the session."""
    code = f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); " \
           "import test_kv_span as t; print(json.dumps(t.run('llama')))"
    env = dict(os.environ, SKIPPY_KV_FULL_SPAN="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["want_finite"]
    assert not result["finite"]
