"""``--decode-batching``: cross-session decode batches, and turning them off for reproducibility.

On a real tiny llama stage (in-process server, real llama.cpp, real sockets), four lanes decode
at once:

* batching on (the default): rows of different sessions that are ready together run as one
  native batch (the stage's ``max_decode_batch`` exceeds 1);
* batching off: every row runs alone (``max_decode_batch`` is 1) and every lane's greedy tokens
  are bitwise those of the same prompt decoded alone by the unsplit model, whatever the other
  lanes were doing.

That a batched row's logits really differ from the same row alone (which is why the switch
exists: the fuzz campaign's legitimate session saw greedy tokens flip with attackers' rows in its
batches) is shown on the runtime directly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import trio

from skippy.driver import StageClient
from skippy.runtime import Model, StageContext

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


def test_a_batched_row_is_not_bitwise_the_row_alone(tiny_llama: Path) -> None:
    with Model(tiny_llama) as model, StageContext(model, n_ctx=256, max_sessions=8, n_batch=64, threads=1) as ctx:
        own, other = ctx.open_session(), ctx.open_session()
        for seq, prompt in ((own, PROMPTS[0]), (other, PROMPTS[1])):
            ctx.decode(tokens=prompt, positions=list(range(len(prompt))), seq_ids=[seq] * len(prompt))
        position = len(PROMPTS[0])
        ctx.decode(tokens=[7], positions=[position], seq_ids=[own])
        alone = np.array(ctx.logits(0), copy=True)
        ctx.trim(own, position)
        ctx.decode(tokens=[7, 11], positions=[position, len(PROMPTS[1])], seq_ids=[own, other])
        batched = np.array(ctx.logits(0), copy=True)
    assert not np.array_equal(alone, batched)
    assert np.allclose(alone, batched, atol=1e-4)  # the same row, up to summation order
