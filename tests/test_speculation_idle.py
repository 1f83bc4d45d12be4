"""A lone speculating request whose drafts do not come decodes on as a plain request, and speculates
again once they do (skippy.driver.generator ``Generation._step``; docs/speculation.md).

A scripted proposer drafts the reference continuation on some stretches of the generation and
nothing on others (a window's first draft wrong at every third index, so windows keep only their head too);
windows are pinned to 3 drafts.  After ``IDLE_STEPS`` plain steps the request stops speculating
and decodes as a decode run (hop by hop) or with direct return; when drafts come again it ends the
run (a TrimSession behind the steps the first stage had started) and speculates on with the same
decoder.  On 1, 2 and 3 stages of the tiny llama and 2 and 3 of the tiny qwen35 (a hybrid: a
decode run's overshoot is rolled back from a checkpoint; a window cut to its head is sent again as
a 1-row window), f32 wire, every request's completion (tokens, text, finish reason) equals greedy
decoding without speculation, with ``max_tokens``, a stop string and an end-of-generation token
landing at, just before and just after a switch; each stage ends holding the positions the plain
run holds (but after a stop string, where a decode run may have gone on until the Stop).  On the
hybrid's chains the final stage's logits for every position the KV keeps, as last computed, are
bitwise those of the same request on one stage (the rows a decode run computed past the switch
back, trimmed, computed again; windows cut to their head sent again as 1-row windows).  A looping
continuation with the real proposer and controller speculates from its start and never switches;
a request that asks for speculation keeps it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pytest

from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.driver import generator as generator_module
from skippy.driver.generator import Completion, Generation
from skippy.driver.speculation import decoder as decoder_module
from skippy.driver.speculation.controller import Plan, SessionLoad, SpeculationController
from skippy.driver.speculation.decoder import SpeculativeDecoder
from skippy.driver.speculation.proposer import NO_DRAFT, Draft, NgramProposer
from skippy.models import ensure_model, tiny

from stage_helpers import inprocess_chain
from test_speculation_chain import LOOP
from test_speculation_controller import cost

CHAINS = {1: ["0:4"], 2: ["0:2", "2:4"], 3: ["0:1", "1:3", "3:4"]}
PROMPT = (1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243, 310, 278, 7934, 29889, 450, 4996)
STEPS = 64
DRAFTS = 3
#: Generated-token indices at which the scripted proposer drafts (the next token's index): windows
#: at the start, none for long enough to stop speculating (about index 13), drafts again from 22
#: (the run ends, windows), none from 30 (stops again near 38), drafts 46..52, none after.
DRAFTING = (range(1, 5), range(22, 30), range(46, 52))


class ScriptedProposer(NgramProposer):
    """Drafts the reference continuation (``script``) where :data:`DRAFTING` says, nothing
    elsewhere; a window's first draft is wrong at every third index (the first window after each
    switch back among them)."""

    script: Sequence[int] = ()
    prompt_length = len(PROMPT)

    def propose(self, max_tokens: int, *, tail: Sequence[int] = ()) -> Draft:
        at = len(self) + len(tail)
        index = at - self.prompt_length
        if not any(index in span for span in DRAFTING):
            return NO_DRAFT
        tokens = list(self.script[index:index + max_tokens])
        if not tokens:
            return NO_DRAFT
        if index % 3 == 1 and not tail:
            tokens[0] = (tokens[0] + 1) % 32000
        return Draft(tuple(tokens), 8, at)


def pin(monkeypatch: pytest.MonkeyPatch, resume: str = "mid-run") -> dict[str, int]:
    """Serial windows of the script's drafts, a window planned whenever drafts come; a decode run
    ended for any window (``resume`` "mid-run"; else never, and runs of 4 tokens: speculation
    comes back at a run's end); the switches counted."""
    def plan(self: SpeculationController, draft_length: int, match_length: int, sessions: int = 1) -> Plan:
        return Plan(min(draft_length, DRAFTS), 1, 2.0) if draft_length > 0 else Plan(0, 1, 1.0)

    monkeypatch.setattr(decoder_module, "NgramProposer", ScriptedProposer)
    if resume == "mid-run":  # (no shadow draft is scored: the script drafts only where windows go)
        monkeypatch.setattr(decoder_module, "RESUME_HITS", 0)
    else:
        monkeypatch.setattr(decoder_module, "RESUME_HITS", 10**9)
        monkeypatch.setattr(generator_module, "RUN_CHUNK_MIN", 4)
        monkeypatch.setattr(generator_module, "RUN_CHUNK_MAX", 4)
    monkeypatch.setattr(SpeculationController, "plan", plan)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_window_cap", lambda self: DRAFTS)
    return count_switches(monkeypatch)


def count_switches(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"stopped": 0, "resumed": 0, "ended_runs": 0}
    stop, resume = Generation._stop_speculating, Generation._resume_speculating

    async def stopping(self: Generation) -> None:
        counts["stopped"] += 1
        await stop(self)

    async def resuming(self: Generation) -> None:
        counts["ended_runs"] += int(self._client.running)
        counts["resumed"] += 1
        await resume(self)

    monkeypatch.setattr(Generation, "_stop_speculating", stopping)
    monkeypatch.setattr(Generation, "_resume_speculating", resuming)
    return counts


@pytest.fixture(scope="module")
def generators() -> Iterator[dict[str, Generator]]:
    made: dict[str, Generator] = {}
    yield made
    for generator in made.values():
        generator.close()


def text_of(generator: Generator, tokens: Sequence[int]) -> str:
    stream = generator.tokenizer.stream(frozenset())
    return "".join(stream.push(token) for token in tokens) + stream.flush()


def record_logits(servers: list[Any]) -> dict[int, np.ndarray]:
    """The final stage's logits by position, the latest computed for each (a position computed
    again after a trim, a rollback or a 1-row window overwrites what it had)."""
    latest: dict[int, np.ndarray] = {}
    last = servers[-1].executor.context
    decode = last.decode

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = decode(*args, **kwargs)
        positions = np.asarray(kwargs["positions"])
        for row in last.output_rows:
            latest[int(positions[int(row)])] = last.logits(int(row)).copy()
        return out

    last.decode = recording
    return latest


async def complete(generator: Generator, servers: list[Any], request: GenerationRequest,
                   session: int) -> tuple[Completion, list[int]]:
    """The completion of ``request`` and the positions each stage held just before its Stop."""
    held: list[int] = []
    async with await StageClient.connect(servers[0].address) as client:
        stop = client.stop

        async def look_and_stop(*args: Any, **kwargs: Any) -> Any:
            for server in servers:
                (state,) = server.executor._sessions.values()
                held.append(server.executor.context.length(state.seq))
            return await stop(*args, **kwargs)

        client.stop = look_and_stop  # type: ignore[method-assign]
        completion = await generator.start(client, request, session).run()
    return completion, held


async def unsplit_logits(generators: dict[str, Generator], arch: str, resume: str,
                         monkeypatch: pytest.MonkeyPatch) -> dict[int, np.ndarray]:
    """The final logits by position of the full scripted request on one stage (hop by hop)."""
    generator = generators[arch]
    pin(monkeypatch, resume)
    async with inprocess_chain(CHAINS[1], model=str(ensure_model(tiny(arch))), ctx_size=512, threads=1) as servers:
        plain, _ = await complete(generator, servers, GenerationRequest(PROMPT, STEPS, speculation=False), 1)
        ScriptedProposer.script = plain.tokens
        latest = record_logits(servers)
        await complete(generator, servers, GenerationRequest(PROMPT, STEPS), 2)
    return latest


#: (model, stages, path): the llama on 1, 2 and 3 stages, the hybrid on 2 and 3; decode runs ended
#: mid-way ("mid-run") or speculation back at a run's end ("run-end"), or direct return.
CASES = [("llama", 1, "mid-run"), ("llama", 1, "run-end"), ("llama", 2, "mid-run"), ("llama", 2, "run-end"),
         ("llama", 2, "direct"), ("llama", 3, "mid-run"), ("llama", 3, "direct"),
         ("qwen35", 2, "mid-run"), ("qwen35", 2, "run-end"), ("qwen35", 2, "direct"), ("qwen35", 3, "mid-run"),
         ("qwen35", 3, "direct")]
#: The fast suite's share: every path once, on 2 stages of both models; the rest is marked slow.
FAST_CASES = {("llama", 2, "mid-run"), ("llama", 2, "direct"), ("qwen35", 2, "run-end")}


@pytest.mark.parametrize(("arch", "stages", "path"), [
    pytest.param(*case, id="-".join(map(str, case)), marks=() if case in FAST_CASES else pytest.mark.slow)
    for case in CASES])
async def test_a_request_whose_drafts_stop_decodes_on_plainly_and_speculates_again(
        generators: dict[str, Generator], arch: str, stages: int, path: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    direct = path == "direct"
    model = ensure_model(tiny(arch))
    if arch not in generators:
        generators[arch] = Generator.from_model(model, n_ctx=512, chunk_size=8, credit=2)
    generator = generators[arch]
    # the hybrid's stages compute every row in Python (a recurrent stage never relays): its logits are read
    reference_logits = await unsplit_logits(generators, arch, path, monkeypatch) if arch == "qwen35" else None
    monkeypatch.undo()
    counts = pin(monkeypatch, path)
    async with inprocess_chain(CHAINS[stages], model=str(model), ctx_size=512, threads=1) as servers:
        generator.direct_return = (lambda: servers[-1].address) if direct else None
        try:
            session = itertools.count(1)
            plain, plain_held = await complete(generator, servers, GenerationRequest(PROMPT, STEPS, speculation=False),
                                               next(session))
            assert len(plain.tokens) == STEPS
            ScriptedProposer.script = plain.tokens
            latest = record_logits(servers)
            full, full_held = await complete(generator, servers, GenerationRequest(PROMPT, STEPS), next(session))
            assert full.tokens == plain.tokens and full.text == plain.text and full_held == plain_held
            if reference_logits is not None:  # every row the KV keeps, as the unsplit run computed it last
                length = full_held[0]
                assert sorted(p for p in reference_logits if p < length) == sorted(p for p in latest if p < length)
                for position in range(len(PROMPT) - 1, length):
                    assert np.array_equal(latest[position], reference_logits[position]), position
            latest.clear()
            usage = full.speculation
            assert usage is not None and usage.windows >= 6 and usage.rollbacks > 0, (usage, counts)
            assert counts["stopped"] == 3 and counts["resumed"] == 2, counts
            if path == "mid-run":  # the first resume ended a decode run mid-way (the second: at a run's end)
                assert counts["ended_runs"] >= 1, counts
            else:
                assert counts["ended_runs"] == 0, counts

            # the request ends at, right before and right after a switch: max_tokens, a stop string,
            # an end-of-generation token (plain greedy with the same request is the reference)
            requests = [GenerationRequest(PROMPT, steps) for steps in (12, 13, 14, 22, 23, 38, 39, 40)]
            for index in (12, 13, 23, 39):
                stop = text_of(generator, plain.tokens[index:index + 2])
                requests.append(GenerationRequest(PROMPT, STEPS, stop=(stop,)))
            for request in requests:
                spec, spec_held = await complete(generator, servers, request, next(session))
                reference, reference_held = await complete(
                    generator, servers, GenerationRequest(request.prompt, request.max_tokens, stop=request.stop,
                                                          speculation=False), next(session))
                assert (spec.tokens, spec.text, spec.finish_reason) == (
                    reference.tokens, reference.text, reference.finish_reason), request
                if not request.stop:  # (a decode run goes on past a stop string until the Stop reaches it)
                    assert spec_held == reference_held, request
            for index in (12, 13, 14, 23, 39):  # an end-of-generation token first seen near a switch
                end = plain.tokens[index]
                first = plain.tokens.index(end)
                ends = frozenset({end})
                monkeypatch.setattr(generator.tokenizer, "is_end_of_generation", lambda token: token in ends)
                monkeypatch.setattr(generator.tokenizer, "end_of_generation_tokens", lambda: ends)
                spec, spec_held = await complete(generator, servers, GenerationRequest(PROMPT, STEPS), next(session))
                reference, reference_held = await complete(
                    generator, servers, GenerationRequest(PROMPT, STEPS, speculation=False), next(session))
                assert spec.tokens == reference.tokens == plain.tokens[:first] and spec.finish_reason == "stop"
                assert spec_held == reference_held, index
                monkeypatch.undo()
                counts = pin(monkeypatch, path)
        finally:
            generator.direct_return = None


async def test_a_request_that_asks_for_speculation_keeps_it(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``speculation=True`` never stops speculating (the busy switch keeps it too)."""
    counts = pin(monkeypatch)
    generator = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=8, credit=2)
    try:
        async with inprocess_chain(CHAINS[2], model=str(tiny_llama), ctx_size=512, threads=1) as servers:
            plain, _ = await complete(generator, servers, GenerationRequest(PROMPT, STEPS, speculation=False), 1)
            ScriptedProposer.script = plain.tokens
            asked, _ = await complete(generator, servers, GenerationRequest(PROMPT, STEPS, speculation=True), 2)
            assert asked.tokens == plain.tokens and counts == {"stopped": 0, "resumed": 0, "ended_runs": 0}
            assert asked.speculation is not None and asked.speculation.windows >= 8
    finally:
        generator.close()


@pytest.mark.parametrize("stages", [2, 3])
async def test_a_looping_continuation_speculates_from_its_start(tiny_llama: Path, stages: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The real proposer and controller on a continuation that loops: windows from the first
    steps, and the request never stops speculating (its drafts come).

    On chains with a boundary: on one in-process stage of the tiny model the round trip is
    ~0.02 ms and a 6-row window costs ~3 c_1, so the real controller's gains there sit at
    1.0-1.6 and whether windows pay is the host's noise (a CI run under memory pressure sent 3
    windows and stopped); the controller's own tests decide that case with fixed costs."""
    counts = count_switches(monkeypatch)
    generator = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=16, credit=2)
    try:
        async with inprocess_chain(CHAINS[stages], model=str(tiny_llama), ctx_size=512, threads=1) as servers:
            plain, _ = await complete(generator, servers, GenerationRequest(tuple(LOOP), 96, speculation=False), 1)
            for session in (2, 3):  # the first learns what windows cost, the second adopts it
                looping, _ = await complete(generator, servers, GenerationRequest(tuple(LOOP), 96), session)
                assert looping.tokens == plain.tokens
                usage = looping.speculation
                assert usage is not None and usage.windows >= 4 and usage.accepted > 0, usage
            assert counts["stopped"] == 0, counts
    finally:
        generator.close()


# -- the decoder's side, sans-IO ------------------------------------------------------------------
def plain_step(decoder: SpeculativeDecoder, token: int) -> bool:
    """One epoch answered with ``token`` as the next token; whether it was a plain step."""
    request = decoder.next_window()
    assert request is not None
    decoder.on_reply(request.window_id, (token,) * len(request.tokens) if not request.is_decode else (token,))
    return request.is_decode


def test_idle_counts_the_steps_with_no_draft_and_a_declined_draft_resets_it() -> None:
    decoder = SpeculativeDecoder(tuple(range(100, 120)), 500, max_tokens=500)
    decoder.controller.cost = cost(0.020, 0.010, 0.001)
    for token in range(600, 610):
        assert plain_step(decoder, token)
    assert decoder.idle == 10
    assert plain_step(decoder, 600) and decoder.idle == 11  # (one token matches no 2-gram yet)
    plain_step(decoder, 601)  # "600 601" again: the proposer drafts 602 ..., a window or a declined draft
    assert decoder.idle == 12
    request = decoder.next_window()
    assert request is not None and decoder.idle == 0


def test_a_decoder_that_follows_a_run_wants_a_window_once_a_loop_shows() -> None:
    """Stopped after idle steps, the decoder follows the run's tokens: no draft, no window.  On a
    loop it wants the window the controller would send at a run's end (``mid_run=False``); mid-run
    only once ``RESUME_HITS`` tokens in a row confirmed a shadow draft; never with other sessions
    on the chain.  The window it wants is the next epoch's."""
    def follower(load: SessionLoad | None = None) -> SpeculativeDecoder:
        decoder = SpeculativeDecoder(tuple(range(100, 120)), 500, max_tokens=500, load=load)
        decoder.controller.cost = cost(0.020, 0.010, 0.001)
        for token in range(600, 610):
            plain_step(decoder, token)
        return decoder

    with pytest.raises(ValueError):  # only with nothing in flight
        live = SpeculativeDecoder(tuple(range(100, 120)), 500, max_tokens=500)
        live.next_window()
        live.follow((1,))
    wanted: dict[bool, list[int]] = {}
    for mid_run in (False, True):
        decoder = follower()
        assert not decoder.wants_window(mid_run)
        wanted[mid_run] = []
        for index, token in enumerate([7, 8, 9] * 12):
            decoder.follow((token,))
            if decoder.wants_window(mid_run):
                wanted[mid_run].append(index)
                assert not mid_run or decoder.hits >= decoder_module.RESUME_HITS
    assert wanted[False] and wanted[True] and wanted[False][0] < wanted[True][0], wanted
    # the request speculates again from there: the next window drafts the loop (the plan wanted)
    decoder.restart(len(decoder.proposer) - 1)
    request = decoder.next_window()
    assert request is not None and not request.is_decode and request.tokens[1:3] == (7, 8)

    class Busy(SessionLoad):
        sessions = 3  # type: ignore[assignment]

    busy = follower(Busy())
    for token in [7, 8, 9] * 12:
        busy.follow((token,))
        assert not busy.wants_window(False) and not busy.wants_window(True)
