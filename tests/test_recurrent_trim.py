"""A trim that keeps only the first row of a multi-row chunk, on chains of a hybrid model.

A stage of a recurrent or hybrid model rolls a trim back by restoring a checkpoint and decoding
its logged input rows again (:mod:`skippy.runtime.rollback`).  Cut to a chunk's first row, a
later stage of a chain could only replay the row its upstream computed inside the chunk's batch,
where the unsplit model replays it alone: the two differ by about 1e-6.  skippy's driver never
asks for it (it sends the row again as a 1-row window); another driver may, with a TrimSession
or a message whose authoritative position cuts the chunk.  Here, on the tiny Qwen3.5- and
Nemotron-H-shaped hybrids, 1 thread:

* each context of a 2- or 3-stage chain refuses such a trim alike, naming the cut and changing
  nothing (the session then goes on, bitwise the unsplit run); one context running every layer
  trims it;
* stage servers on 2 and 3 stages refuse it from a raw client (a TrimSession, or a verify window
  one position into the last one) on the first stage, before anything is forwarded:
  STATE_MISMATCH naming the cut; the lane closes, every stage releases the session (no KV cell,
  no checkpoint left) and the chain serves the next lane; a plain v11 client (no extensions) sees
  its lane closed;
* one stage of the hybrid takes the same trim (the greedy tokens then), and a chain of an
  attention-only model takes any trim (the unsplit chain's tokens);
* the driver knows every architecture whose stages roll back (it sends the row again on them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest
import trio
from chain_helpers import ChainModels, InProcessChain

from skippy.codec.protocol_ext import ErrorCode
from skippy.driver import StageClient
from skippy.driver.client import StageLost, StageRemoteError
from skippy.models import ensure_model, tiny
from skippy.models.spec import ARCHITECTURES
from skippy.runtime import Model, SessionError
from skippy.runtime.ffi import lib
from skippy.runtime.layer_kinds import rolls_back
from skippy.stage.server import StageServer

from stage_helpers import inprocess_chain, reference_greedy
from test_recurrent_rollback import HYBRIDS

PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243]
WINDOW = [8, 9, 10, 11, 12]
RANGES = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
SPLITS = {stages: [f"{a}:{b}" for a, b in ranges] for stages, ranges in RANGES.items()}
CUT = r"keeps only the first row of a 5-row chunk"


@pytest.fixture(scope="module")
def models() -> Iterator[ChainModels]:
    shared = ChainModels()
    yield shared
    shared.close()


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest) -> Path:
    return ensure_model(tiny(request.param))


def _feed(stages: InProcessChain, start: int, batches: Sequence[Sequence[int]]) -> list[np.ndarray]:
    logits = []
    for batch in batches:
        logits.append(stages.decode(list(batch), list(range(start, start + len(batch))), [0] * len(batch))[-1])
        start += len(batch)
    return logits


@pytest.mark.parametrize("stages", [2, 3])
def test_every_stage_of_a_chain_refuses_a_trim_to_a_chunks_first_row_and_changes_nothing(
        models: ChainModels, hybrid: Path, stages: int) -> None:
    n = len(PROMPT)
    runs = {}
    for count in (1, stages):
        with models.chain(hybrid, RANGES[count], n_ctx=256, max_sessions=4, n_batch=64, threads=1) as chain:
            _feed(chain, 0, [PROMPT, [5], WINDOW])
            if count > 1:
                for context in chain.contexts:
                    held = context.checkpoint_bytes(0)
                    with pytest.raises(SessionError, match=rf"cannot trim session 0 to {n + 2} positions: .*{CUT}"
                                                           rf".*trim to {n + 1} and send that row again"):
                        context.trim(0, n + 2)
                    assert context.remove(0, n + 2, -1) is False  # a tail removed is the same trim
                    assert context.length(0) == n + 6 and context.checkpoint_bytes(0) == held
                    stats = context.rollback_stats
                    assert (stats.rollbacks, stats.refused, stats.replayed_rows) == (0, 2, 0)
            # the session goes on: a head of 2 rows, bitwise on any chain
            chain.each("trim", 0, n + 3)
            runs[count] = _feed(chain, n + 3, [[3186], [29892], [920]])
    for unsplit, chained in zip(runs[1], runs[stages], strict=True):
        assert np.array_equal(unsplit, chained), np.abs(unsplit - chained).max()


async def _window(client: StageClient, *, chunk_size: int = 256) -> tuple[int, int]:
    """Configure session 1, prefill the prompt and send a 5-row verify window; its first row's
    prediction and the position after the window's first row."""
    n = len(PROMPT)
    await client.configure(1, prompt_token_count=n)
    token = (await client.prefill(1, PROMPT, chunk_size=chunk_size)).token
    reply = await client.verify(1, [token, *WINDOW[1:]], n, window_id=1)
    return int(reply.predicted_tokens[0]), n + 1


async def _released_everywhere(servers: Sequence[StageServer]) -> None:
    """Wait until no stage holds a session, a KV cell or a checkpoint."""
    with trio.fail_after(10):
        while True:
            for server in servers:
                await server.refresh_runtime_stats()
            if all(s.stats.sessions_in_use == 0 and s.stats.kv_cells_used == 0
                   and s.stats.recurrent_rollback["checkpoint_bytes"] == 0 for s in servers):
                return
            await trio.sleep(0.02)


@pytest.mark.parametrize("stages", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", ["TrimSession", "window at the next position", "plain v11 client"])
async def test_a_chain_refuses_the_cut_on_its_first_stage_and_releases_the_session(hybrid: Path, stages: int,
                                                                                    form: str) -> None:
    reference = reference_greedy(hybrid, PROMPT, 6, chunk_size=256)
    async with inprocess_chain(SPLITS[stages], model=str(hybrid), ctx_size=256, prefix_cache=False,
                               threads=1) as servers:
        async with await StageClient.connect(servers[0].address, extensions=form != "plain v11 client") as client:
            token, length = await _window(client)
            with trio.fail_after(10), pytest.raises(StageLost) as raised:
                if form == "window at the next position":
                    await client.verify(1, [token, 5], length, window_id=2)
                else:
                    await client.trim(1, length)
        if form == "plain v11 client":  # no Error frame for it: the lane closes
            assert not isinstance(raised.value, StageRemoteError)
        else:
            assert isinstance(raised.value, StageRemoteError)
            assert raised.value.code is ErrorCode.STATE_MISMATCH
            what = "TrimSession" if form == "TrimSession" else f"a message at position {length}"
            assert raised.match(rf"state_mismatch at stage 0 \(.*\): {what} refused: the session cannot go back to "
                                rf"{length} positions: that {CUT}")
        await _released_everywhere(servers)
        # the first stage refused before forwarding: no later stage was asked
        assert [s.stats.recurrent_rollback["refused"] for s in servers] == [1] + [0] * (stages - 1)
        async with await StageClient.connect(servers[0].address) as client:  # the chain serves on
            assert await client.generate_greedy(2, PROMPT, 6) == reference


async def _cut_and_decode(servers: Sequence[StageServer]) -> list[int]:
    """The window cut to its first row by a TrimSession, then 4 greedy decodes: the predictions."""
    async with await StageClient.connect(servers[0].address) as client:
        token, length = await _window(client)
        await client.trim(1, length)
        tokens = [token]
        for _ in range(4):
            tokens.append((await client.decode(1, tokens[-1], length + len(tokens) - 1)).predicted)
        await client.stop(1)
    return tokens


async def test_one_stage_of_a_hybrid_takes_the_cut_exactly(hybrid: Path) -> None:
    """One stage replays the kept row from its token, as the greedy run computed it."""
    reference = reference_greedy(hybrid, PROMPT, 6, chunk_size=256)
    async with inprocess_chain(SPLITS[1], model=str(hybrid), ctx_size=256, prefix_cache=False, threads=1) as servers:
        assert await _cut_and_decode(servers) == reference[1:6]
        assert servers[0].stats.trimmed_tokens == 4 and servers[0].stats.connection_errors == 0


@pytest.mark.parametrize("stages", [2, 3])
async def test_an_attention_only_chain_takes_any_trim(tiny_llama: Path, stages: int) -> None:
    runs = {}
    for count in (1, stages):
        async with inprocess_chain(SPLITS[count], model=str(tiny_llama), ctx_size=256, prefix_cache=False,
                                   threads=1) as servers:
            runs[count] = await _cut_and_decode(servers)
            assert all(server.stats.connection_errors == 0 for server in servers)
    assert runs[stages] == runs[1]


@pytest.mark.slow
def test_the_driver_knows_every_architecture_whose_stages_roll_back() -> None:
    """``Generator.recurrent`` (:func:`rolls_back`, read from the GGUF) is what each stage's
    context is (llama.cpp's recurrent or hybrid flag) for every tiny architecture: a driver that
    took a chain of one for attention-only would cut a window to its first row and be refused."""
    wrong = []
    for arch in sorted(ARCHITECTURES):
        with Model(ensure_model(tiny(arch))) as model:
            stages_roll_back = bool(lib.llama_model_is_recurrent(model.pointer) or lib.llama_model_is_hybrid(model.pointer))
            if rolls_back(model.architecture) != stages_roll_back:
                wrong.append((model.architecture, stages_roll_back))
    assert not wrong
