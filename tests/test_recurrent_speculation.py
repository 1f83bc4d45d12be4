"""Greedy speculation on chains of the tiny hybrids is bitwise the unsplit run (stage servers in this trio run).

The driver's windows are pinned (3 drafts, serial) and an oracle drafts the reference continuation
with its first draft wrong in every other window, so windows keep no draft (cut to a 1-row head)
as well as some or all of theirs.  On 2- and 3-stage chains the generated tokens equal greedy
decoding with speculation off, and the final stage computes, decode call by decode call, bitwise
the logits of the unsplit run of the same driver: the window rows, the rows decoded again after
a window kept only its head (the chain's 1-row window, :mod:`skippy.driver.speculation.runner`;
the unsplit stage's replay from its checkpoint), and the last one; each stage ends holding the
positions the unsplit stage holds.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest

from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.driver.speculation import decoder as decoder_module
from skippy.driver.speculation.controller import Plan, SpeculationController
from skippy.driver.speculation.proposer import NO_DRAFT, Draft, NgramProposer
from skippy.models import ensure_model, tiny

from stage_helpers import inprocess_chain
from test_recurrent_rollback import HYBRIDS

CHAINS = {1: ["0:4"], 2: ["0:2", "2:4"], 3: ["0:1", "1:3", "3:4"]}
PROMPT = (1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243, 310, 278, 7934, 29889, 450, 4996)
STEPS = 30
DRAFTS = 3


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest) -> Path:
    return ensure_model(tiny(request.param))


@pytest.fixture(scope="module")
def generator(hybrid: Path) -> Iterator[Generator]:
    gen = Generator.from_model(hybrid, n_ctx=512, chunk_size=8, credit=2)
    gen.decode_runs = False
    yield gen
    gen.close()


class OracleProposer(NgramProposer):
    """Drafts the reference continuation (``script``); every other window's first draft is wrong."""

    script: Sequence[int] = ()
    calls = itertools.count()

    def propose(self, max_tokens: int, *, tail: Sequence[int] = ()) -> Draft:
        at = len(self) + len(tail)
        tokens = list(self.script[at:at + max_tokens])
        if not tokens:
            return NO_DRAFT
        if next(self.calls) % 2 == 1:
            tokens[0] = (tokens[0] + 1) % 32000
        return Draft(tuple(tokens), 8, at)


def pinned_plan(self: SpeculationController, draft_length: int, match_length: int, sessions: int = 1) -> Plan:
    return Plan(min(draft_length, DRAFTS), 1, 2.0)


async def run(hybrid: Path, generator: Generator, stages: int, speculation: bool):  # type: ignore[no-untyped-def]
    """The tokens, every logits row the final stage computed (decode call by call), the positions
    each stage held at the end, and the runner's 1-row windows."""
    calls: list[tuple[tuple[int, ...], np.ndarray]] = []
    held: list[int] = []
    redone: list[int] = []
    async with inprocess_chain(CHAINS[stages], model=str(hybrid), ctx_size=512, threads=1) as servers:
        last = servers[-1].executor.context  # type: ignore[attr-defined]
        decode = last.decode

        def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = decode(*args, **kwargs)
            positions = tuple(int(p) for p in np.asarray(kwargs["positions"]))
            rows = [last.logits(int(r)) for r in last.output_rows]
            calls.append((positions, np.stack(rows) if rows else np.zeros(0, dtype=np.float32)))
            return out

        last.decode = recording
        contexts = [server.executor.context for server in servers]  # type: ignore[attr-defined]
        stop_lengths = [c.length for c in contexts]

        async with await StageClient.connect(servers[0].address) as client:
            handle = generator.start(client, GenerationRequest(PROMPT, STEPS, speculation=speculation), 1)
            finish = handle._finish

            async def finish_and_look(*args, **kwargs):  # type: ignore[no-untyped-def]
                if handle._runner is not None:
                    redone.append(handle._runner.redone)
                    await handle._runner.finish(len(PROMPT) + len(handle.tokens) - 1)
                for server, length in zip(servers, stop_lengths):
                    (session,) = server.executor._sessions.values()  # type: ignore[attr-defined]
                    held.append(length(session.seq))
                return await finish(*args, **kwargs)

            handle._finish = finish_and_look
            completion = await handle.run()
    return completion, calls, held, redone


@pytest.mark.parametrize("stages", [2, 3])
async def test_greedy_speculation_on_a_chain_is_bitwise_the_unsplit_run(hybrid: Path, generator: Generator, stages: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    plain, _, _, _ = await run(hybrid, generator, 1, False)
    OracleProposer.script = (*PROMPT, *plain.tokens)
    monkeypatch.setattr(decoder_module, "NgramProposer", OracleProposer)
    monkeypatch.setattr(SpeculationController, "plan", pinned_plan)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_window_cap", lambda self: DRAFTS)
    OracleProposer.calls = itertools.count()
    unsplit, unsplit_calls, unsplit_held, unsplit_redone = await run(hybrid, generator, 1, True)
    OracleProposer.calls = itertools.count()
    chained, chained_calls, chained_held, chained_redone = await run(hybrid, generator, stages, True)
    assert unsplit.tokens == chained.tokens == plain.tokens
    usage = chained.speculation
    assert usage is not None and usage.accepted > 0 and usage.rollbacks > 0, usage
    assert unsplit_redone == [0] and chained_redone[0] > 0  # windows cut to their head: sent again on the chain
    assert [positions for positions, _ in unsplit_calls] == [positions for positions, _ in chained_calls]
    for (positions, a), (_, b) in zip(unsplit_calls, chained_calls):
        assert np.array_equal(a, b), (positions, np.abs(a - b).max())
    assert unsplit_held == [len(PROMPT) + STEPS - 1] and chained_held == unsplit_held * stages
