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
    """The completion, every logits row the final stage computed (decode call by call: its
    positions and logits), the positions each stage held before the Stop, and the 1-row windows
    the runner sent again."""
    calls: list[tuple[tuple[int, ...], np.ndarray]] = []
    held: list[int] = []
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
        async with await StageClient.connect(servers[0].address) as client:
            stop = client.stop

            async def look_and_stop(*args, **kwargs):  # type: ignore[no-untyped-def]
                for server in servers:
                    (session,) = server.executor._sessions.values()  # type: ignore[attr-defined]
                    held.append(server.executor.context.length(session.seq))  # type: ignore[attr-defined]
                return await stop(*args, **kwargs)

            client.stop = look_and_stop  # type: ignore[method-assign]
            handle = generator.start(client, GenerationRequest(PROMPT, STEPS, speculation=speculation), 1)
            completion = await handle.run()
    return completion, calls, held, 0 if handle._runner is None else handle._runner.redone


def windows_cut_to_their_head(calls: Sequence[tuple[tuple[int, ...], np.ndarray]]) -> list[int]:
    """Starts of the multi-row decodes after the prompt decoded again as one row right after."""
    return [a[0][0] for a, b in zip(calls, calls[1:])
            if len(a[0]) > 1 and a[0][0] >= len(PROMPT) and b[0] == a[0][:1]]


async def compare(hybrid: Path, generator: Generator, stages: int, plain: Sequence[int]):  # type: ignore[no-untyped-def]
    """Speculation on the unsplit model and on ``stages``: both equal to the plain tokens, and
    bitwise to each other; the unsplit run's calls."""
    OracleProposer.calls = itertools.count()
    unsplit, unsplit_calls, unsplit_held, unsplit_redone = await run(hybrid, generator, 1, True)
    OracleProposer.calls = itertools.count()
    chained, chained_calls, chained_held, chained_redone = await run(hybrid, generator, stages, True)
    assert unsplit.tokens == chained.tokens == list(plain)
    usage = chained.speculation
    assert usage is not None and usage.accepted > 0 and usage.rollbacks > 0, usage
    # windows cut to their head: replayed on the unsplit stage, sent again on the chain
    assert unsplit_redone == 0 and chained_redone == len(windows_cut_to_their_head(unsplit_calls)) > 0
    assert [positions for positions, _ in unsplit_calls] == [positions for positions, _ in chained_calls]
    for (positions, a), (_, b) in zip(unsplit_calls, chained_calls):
        assert np.array_equal(a, b), (positions, np.abs(a - b).max())
    assert len(unsplit_held) == 1 and chained_held == unsplit_held * stages
    return unsplit_calls, unsplit_held[0]


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of 3 drafts, serial, from the oracle."""
    monkeypatch.setattr(decoder_module, "NgramProposer", OracleProposer)
    monkeypatch.setattr(SpeculationController, "plan", pinned_plan)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_window_cap", lambda self: DRAFTS)


@pytest.mark.parametrize("stages", [2, 3])
async def test_greedy_speculation_on_a_chain_is_bitwise_the_unsplit_run(hybrid: Path, generator: Generator, stages: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    plain, _, _, _ = await run(hybrid, generator, 1, False)
    OracleProposer.script = (*PROMPT, *plain.tokens)
    monkeypatch.setattr(decoder_module, "NgramProposer", OracleProposer)
    monkeypatch.setattr(SpeculationController, "plan", pinned_plan)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_window_cap", lambda self: DRAFTS)
    _, held = await compare(hybrid, generator, stages, plain.tokens)
    assert held == len(PROMPT) + STEPS - 1


@pytest.mark.parametrize("stages", [2, 3])
async def test_an_end_right_after_a_windows_first_row_is_bitwise_the_unsplit_run(
        hybrid: Path, generator: Generator, stages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generation ends (an end-of-generation token) on a window's first draft, which is kept:
    the final trim keeps only the window's first row (``SpeculativeRunner.finish``)."""
    plain, _, _, _ = await run(hybrid, generator, 1, False)
    OracleProposer.script = (*PROMPT, *plain.tokens)
    monkeypatch.setattr(decoder_module, "NgramProposer", OracleProposer)
    monkeypatch.setattr(SpeculationController, "plan", pinned_plan)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_window_cap", lambda self: DRAFTS)
    OracleProposer.calls = itertools.count()
    _, calls, _, _ = await run(hybrid, generator, 1, True)
    # the last window [token j - 1, token j, ...] keeping token j, which appears nowhere before it
    starts = sorted({positions[0] for positions, _ in calls if len(positions) > 1 and positions[0] >= len(PROMPT)})
    tokens = plain.tokens
    j = max(j for j in (c - len(PROMPT) + 1 for c in starts)
            if 0 < j < len(tokens) - 1 and tokens[j] not in tokens[:j] and j + len(PROMPT) - 1 not in
            windows_cut_to_their_head(calls))
    end = tokens[j]
    monkeypatch.setattr(generator.tokenizer, "is_end_of_generation", lambda token: token == end)
    _, held = await compare(hybrid, generator, stages, tokens[:j])
    assert held == len(PROMPT) + j
