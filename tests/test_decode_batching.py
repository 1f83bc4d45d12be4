"""``--decode-batching``: cross-session decode batches, and turning them off for reproducibility.

On a real tiny llama stage (in-process server, real llama.cpp, real sockets), four lanes decode
at once:

* batching on (the default): rows of different sessions that are ready together run as one
  native batch (the stage's ``max_decode_batch`` exceeds 1);
* batching off: every row runs alone (``max_decode_batch`` is 1) and every lane's greedy tokens
  are bitwise those of the same prompt decoded alone by the unsplit model, whatever the other
  lanes were doing.

On the runtime directly: a row of a small batch is bitwise the same row alone (native patch 0018
sends matrix products of a few columns to ggml's vec_dot path, the one a single row takes; patch
0016 places each session's KV cells as alone): F32 weights up to 3 rows, F16 and Q8_0 (F16 KV
cache) up to 4.  A larger batch goes through llamafile's tinyBLAS, whose rows round differently
(which is why the switch exists: the fuzz campaign's legitimate session saw greedy tokens flip with
attackers' rows in its batches).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from skippy.driver import StageClient
from skippy.runtime import Model, StageContext

from conftest import model_path
from stage_helpers import inprocess_chain, reference_greedy

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 450, 4996, 17354], [1, 306, 626, 263, 1243], [1, 3439, 17632]]
STEPS = 24


async def _decode_all(address: object) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def lane(index: int) -> None:
        async with await StageClient.connect(address) as client:  # type: ignore[arg-type]
            session = index + 1
            await client.configure(session)
            token = (await client.prefill(session, PROMPTS[index], chunk_size=4)).token
            tokens, position = [token], len(PROMPTS[index])
            while len(tokens) < STEPS:
                token = (await client.decode(session, token, position)).predicted
                tokens.append(token)
                position += 1
            await client.stop(session)
            results[index] = tokens

    async with trio.open_nursery() as nursery:
        for index in range(len(PROMPTS)):
            nursery.start_soon(lane, index)
    return results


async def test_decodes_of_different_sessions_share_a_batch_by_default(tiny_llama: Path) -> None:
    async with inprocess_chain(["0:4"], model=str(tiny_llama)) as (stage,):
        assert stage.address is not None
        await _decode_all(stage.address)
        assert stage.stats.max_decode_batch > 1


async def test_with_batching_off_each_session_gets_its_solo_tokens(tiny_llama: Path) -> None:
    async with inprocess_chain(["0:4"], model=str(tiny_llama), decode_batching=False) as (stage,):
        assert stage.address is not None
        results = await _decode_all(stage.address)
        assert stage.stats.max_decode_batch == 1
        assert stage.stats.decode_batches >= len(PROMPTS) * (STEPS - 1)
    for prompt, tokens in zip(PROMPTS, results):
        assert tokens == reference_greedy(tiny_llama, prompt, STEPS, chunk_size=4)


async def test_separate_kv_streams_keep_both(tiny_llama: Path) -> None:
    """``kv_streams`` on (each session its own KV stream): decodes of several sessions still share
    a native batch (llama.cpp splits it per stream), and with batching off every lane still gets
    its solo tokens."""
    async with inprocess_chain(["0:4"], model=str(tiny_llama), kv_streams=True, ctx_size=256) as (stage,):
        assert stage.address is not None
        await _decode_all(stage.address)
        assert stage.stats.max_decode_batch > 1
    async with inprocess_chain(["0:4"], model=str(tiny_llama), kv_streams=True, ctx_size=256,
                               decode_batching=False) as (stage,):
        assert stage.address is not None
        results = await _decode_all(stage.address)
    for prompt, tokens in zip(PROMPTS, results):
        assert tokens == reference_greedy(tiny_llama, prompt, STEPS, chunk_size=4)


def _rows_alone_and_batched(path: Path, rows: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each of ``rows`` sessions' next-token logits decoded alone, then all in one batch."""
    prompts = [PROMPTS[s % len(PROMPTS)][: 3 + s % 3] for s in range(rows)]
    with Model(path) as model, StageContext(model, n_ctx=512, max_sessions=rows, n_batch=64, threads=1) as ctx:
        seqs = [ctx.open_session() for _ in range(rows)]
        for seq, prompt in zip(seqs, prompts):
            ctx.decode(tokens=prompt, positions=list(range(len(prompt))), seq_ids=[seq] * len(prompt))
        alone = []
        for row, (seq, prompt) in enumerate(zip(seqs, prompts)):
            ctx.decode(tokens=[7 + row], positions=[len(prompt)], seq_ids=[seq])
            alone.append(np.array(ctx.logits(0), copy=True))
            ctx.trim(seq, len(prompt))
        ctx.decode(tokens=[7 + row for row in range(rows)], positions=[len(p) for p in prompts], seq_ids=seqs)
        batched = [np.array(ctx.logits(row), copy=True) for row in range(rows)]
    return alone, batched


@pytest.mark.parametrize(("dtype", "rows"), [("F32", 2), ("F32", 3), ("F16", 4), ("Q8_0", 4)])
def test_a_row_of_a_small_batch_is_bitwise_the_row_alone(dtype: str, rows: int) -> None:
    alone, batched = _rows_alone_and_batched(model_path("llama", dtype=dtype), rows)
    assert not np.array_equal(alone[0], alone[1])  # different rows
    for row in range(rows):
        assert np.array_equal(alone[row], batched[row]), (row, float(np.abs(alone[row] - batched[row]).max()))


def test_a_row_of_a_large_batch_is_the_row_alone_up_to_summation_order(tiny_llama: Path) -> None:
    alone, batched = _rows_alone_and_batched(tiny_llama, 8)
    assert not all(np.array_equal(a, b) for a, b in zip(alone, batched))
    for a, b in zip(alone, batched):
        assert np.allclose(a, b, atol=2e-3)  # the same row, up to summation order


@pytest.mark.parametrize(("dtype", "rows"), [("F32", 3), ("F16", 4)])
def test_a_small_verify_window_is_bitwise_its_rows_decoded_one_by_one(dtype: str, rows: int) -> None:
    """Rows of one session at consecutive positions (a speculation verify window) in one batch."""
    prompt, window = PROMPTS[0], [7, 11, 13, 17][:rows]
    with Model(model_path("llama", dtype=dtype)) as model, StageContext(model, n_ctx=256, max_sessions=1, n_batch=64,
                                                                        threads=1) as ctx:
        seq = ctx.open_session()
        ctx.decode(tokens=prompt, positions=list(range(len(prompt))), seq_ids=[seq] * len(prompt))
        single = []
        for offset, token in enumerate(window):
            ctx.decode(tokens=[token], positions=[len(prompt) + offset], seq_ids=[seq])
            single.append(np.array(ctx.logits(0), copy=True))
        ctx.trim(seq, len(prompt))
        ctx.decode(tokens=window, positions=[len(prompt) + i for i in range(rows)], seq_ids=[seq] * rows,
                   outputs=[True] * rows)
        batched = [np.array(ctx.logits(row), copy=True) for row in range(rows)]
    for row in range(rows):
        assert np.array_equal(single[row], batched[row]), (row, float(np.abs(single[row] - batched[row]).max()))
