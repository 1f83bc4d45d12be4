"""Greedy speculation on chains of the tiny hybrids is bitwise the unsplit run (stage servers in this trio run).

The driver's windows are pinned (3 drafts; serial, or 2 in flight) and an oracle drafts the
reference continuation with the first draft wrong in every third window, so windows keep no draft
(cut to a 1-row head, a stale window behind it when pipelined) as well as all of theirs; and a
run ends right after a window's first row (an end of generation kept as its first draft).  Without
the runner's 1-row windows every case here differs from the unsplit run by ~2e-6 (nemotron_h's
2-stage cut included).  On 2- and 3-stage chains the generated tokens equal greedy
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
    """Drafts the reference continuation (``script``); every third window's first draft is wrong
    (all rejected: the window keeps its first row only)."""

    script: Sequence[int] = ()
    calls = itertools.count()

    def propose(self, max_tokens: int, *, tail: Sequence[int] = ()) -> Draft:
        at = len(self) + len(tail)
        tokens = list(self.script[at:at + max_tokens])
        if not tokens:
            return NO_DRAFT
        wrong = 1 if tail else 0  # a continuation's first token is its guess of the token before
        if next(self.calls) % 3 == 1 and wrong < len(tokens):
            tokens[wrong] = (tokens[wrong] + 1) % 32000
        return Draft(tuple(tokens), 8, at)


def pin(monkeypatch: pytest.MonkeyPatch, depth: int = 1) -> None:
    """Windows of the oracle's 3 drafts, ``depth`` in flight (continuations of the same size)."""
    def plan(self: SpeculationController, draft_length: int, match_length: int, sessions: int = 1) -> Plan:
        return Plan(min(draft_length, DRAFTS), depth, 2.0)

    monkeypatch.setattr(decoder_module, "NgramProposer", OracleProposer)
    monkeypatch.setattr(SpeculationController, "plan", plan)
    monkeypatch.setattr(SpeculationController, "continuation_plan", lambda self, match_length, current: current)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_window_cap", lambda self: DRAFTS)


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
    """Starts of the multi-row decodes after the prompt whose first row was decoded again alone
    (the latest decode that wrote its position before that)."""
    cut = []
    for index, (positions, _) in enumerate(calls):
        if len(positions) == 1:
            before = next((p for p, _ in reversed(calls[:index]) if p[0] <= positions[0] <= p[-1]), ())
            if len(before) > 1 and before[0] == positions[0] >= len(PROMPT):
                cut.append(positions[0])
    return cut


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


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("stages", [2, 3])
async def test_greedy_speculation_on_a_chain_is_bitwise_the_unsplit_run(hybrid: Path, generator: Generator, stages: int,
                                                                       depth: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Serial windows, and pipelined ones (a window cut to its head has a stale one behind it)."""
    plain, _, _, _ = await run(hybrid, generator, 1, False)
    OracleProposer.script = (*PROMPT, *plain.tokens)
    pin(monkeypatch, depth)
    _, held = await compare(hybrid, generator, stages, plain.tokens)
    assert held == len(PROMPT) + STEPS - 1


@pytest.mark.parametrize("stages", [2, 3])
async def test_an_end_right_after_a_windows_first_row_is_bitwise_the_unsplit_run(
        hybrid: Path, generator: Generator, stages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generation ends (an end-of-generation token) on a window's first draft, which is kept:
    the final trim keeps only the window's first row (``SpeculativeRunner.finish``)."""
    plain, _, _, _ = await run(hybrid, generator, 1, False)
    OracleProposer.script = (*PROMPT, *plain.tokens)
    pin(monkeypatch)
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
