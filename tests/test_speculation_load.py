"""Speculation that knows the load: a window's drafts are weighed against what they cost the other
sessions in the stages' batches (``shared_gain``); a single stream keeps today's plans, enough
concurrent sessions keep speculation off, and greedy outputs stay exact under concurrency."""

from __future__ import annotations
import dataclasses

from pathlib import Path

import pytest
import trio

from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.driver.speculation import (
    ControllerConfig,
    CostModel,
    SessionLoad,
    SpeculationConfig,
    SpeculativeDecoder,
    expected_tokens,
    serial_rate,
    shared_gain,
)

from stage_helpers import stage_chain
from test_speculation_chain import LOOP
from test_speculation_controller import controller, cost, feed


def test_one_session_gain_is_the_serial_speedup() -> None:
    model = cost(0.020, 0.010, 0.001)
    for acceptance, window in ((0.8, 4), (0.3, 2), (0.95, 8)):
        assert shared_gain(acceptance, window, 1, model) == pytest.approx(
            serial_rate(acceptance, window, model) / serial_rate(0.0, 0, model))


def test_gain_falls_with_sessions_and_never_pays_when_rows_dominate() -> None:
    model = cost(0.020, 0.010, 0.002)
    gains = [shared_gain(0.8, 4, sessions, model) for sessions in (1, 2, 4, 8, 16)]
    assert gains == sorted(gains, reverse=True) and gains[0] > 1.5 and gains[-1] < 1.03  # under min_gain
    # compute bound (no round trip, every row a full step): perfect drafts gain nothing with others
    bound = cost(0.0, 0.010, 0.010)
    assert shared_gain(1.0, 8, 2, bound) == pytest.approx(1.0, rel=0.02)  # (the slope's prior pull)
    assert shared_gain(0.99, 8, 4, bound) < 1.0
    assert expected_tokens(1.0, 8) == 9.0


def test_single_stream_speculates_and_concurrent_sessions_back_off() -> None:
    """A CPU chain on loopback (2 ms round trip, 5 ms a step, 2.5 ms a further row; a window's own
    traversal of 5 rows 15 ms): a window runs after the others' batch as a traversal of its own,
    so with one other session it costs that session a window's compute, and stays off."""
    control = controller(0.002, 0.005, 0.0025, max_depth=4, stages=2, probe_interval=4)
    feed(control, 0.9, 30, seed=1)
    alone = control.plan(8, 6)
    assert alone.window >= 1 and alone.speedup > 1.3  # today's plan, unchanged (pipelined windows)
    for sessions in (2, 4, 16):
        crowded = [control.plan(8, 6, sessions=sessions) for _ in range(10)]
        assert all(plan.window == 0 and not plan.probe for plan in crowded)  # off, and no probe windows either
    assert not control.enabled
    assert control.plan(8, 6) == alone and control.enabled  # alone again: back on
    # windows that cost about a step (a GPU; 2-3 rows on a CPU after patch 0018): with a few
    # others near-certain drafts still pay, serial; with many they do not
    cheap = controller(0.002, 0.005, 0.0002, max_depth=4, stages=2)
    feed(cheap, 0.95, 40, seed=1)
    two = cheap.plan(8, 6, sessions=2)
    assert two.window >= 1 and two.depth == 1 and 1.03 <= two.speedup < cheap.plan(8, 6).speedup
    assert cheap.plan(8, 6, sessions=16).window == 0
    # a chain whose round trip dwarfs its compute still gains from drafts with a few others
    network = controller(0.020, 0.005, 0.0005)
    feed(network, 0.9, 30, seed=1)
    assert network.plan(8, 6, sessions=4).window > 0


class Session:
    """Something a SessionLoad can count (held weakly)."""


def test_decoder_reads_the_load_at_each_epoch() -> None:
    load = SessionLoad()
    sessions = [Session() for _ in range(16)]

    def decoder() -> SpeculativeDecoder:
        made = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), max_tokens=64, load=load)
        made.controller.cost = controller(0.002, 0.005, 0.0025).cost
        feed(made.controller, 0.95, 30, seed=2)
        return made

    load.enter(sessions[0])
    first = decoder().next_window()
    assert first is not None and not first.is_decode and len(first.tokens) > 1  # alone: drafts
    for session in sessions[1:]:
        load.enter(session)
    assert load.sessions == 16
    crowded = decoder().next_window()
    assert crowded is not None and crowded.is_decode  # sixteen sessions: a plain step
    for session in sessions[:8]:
        load.leave(session)
    assert load.sessions == 8
    del sessions[8:]  # dropped without leaving: no longer counted
    assert load.sessions == 0


def drive(decoder: SpeculativeDecoder, steps: int, queueing: float) -> None:
    """Answer ``steps`` messages as a CPU chain would: 90 ms of compute for a step plus 15 ms a
    further row, the wall time ``queueing`` more (the round trip, or waiting behind others)."""
    for _ in range(steps):
        request = decoder.next_window()
        assert request is not None
        rows = len(request.tokens)
        compute = 0.090 + 0.015 * (rows - 1)
        decoder.on_reply(request.window_id, (29871,) * rows, wall_seconds=compute + queueing,
                         compute_seconds=compute)


def test_waiting_behind_other_sessions_is_not_a_round_trip() -> None:
    """The cause of issue 31's loss at N = 8 (a controller traced in bench/concurrency.py, Gemma
    3 270M, 2 stages): a step's wall time under load is mostly waiting behind the other sessions'
    rows (R came out 20-220 ms on loopback), which made L_S look long and every draft look cheap
    (G ~ (S - 1 + E) / S), so windows went out at S = 8.  Traversals shared with other sessions
    now teach neither R nor c_row; eight sessions stay plain, a single stream still speculates."""
    load = SessionLoad()
    others = [Session() for _ in range(8)]
    for session in others:
        load.enter(session)
    crowded = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), load=load)
    drive(crowded, 40, queueing=0.300)
    assert crowded.controller.cost.round_trip == 0.0  # the queueing taught no round trip
    feed(crowded.controller, 0.8, 60, seed=3)
    assert [crowded.controller.plan(8, 6, sessions=8).window for _ in range(5)] == [0] * 5
    alone = SessionLoad()
    one = Session()
    alone.enter(one)
    single = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), load=alone)
    drive(single, 40, queueing=0.002)
    assert single.controller.cost.round_trip == pytest.approx(0.002)
    feed(single.controller, 0.8, 60, seed=3)
    plan = single.controller.plan(8, 6, sessions=1)
    assert plan.window > 0 and plan.speedup > 1.2


def test_a_session_under_load_takes_the_row_cost_measured_alone() -> None:
    """A session that starts under load never measures c_row nor a window; the prior (0.25 of a
    step) is far under a CPU chain's (traced: a further row of Gemma 3 270M, its 262k-row head
    included, cost about what a one-row step did).  The ratio and the window prices a session
    measured alone on the chain are shared through the SessionLoad; with them, and with the
    prior alone (a window is a traversal of its own), near-certain drafts stay plain at S = 8."""
    load = SessionLoad()
    first = Session()
    load.enter(first)
    single = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), load=load)
    drive(single, 60, queueing=0.002)  # alone: plain steps then windows, c_row measured
    assert single.controller.cost.extra_row == pytest.approx(0.015)
    assert load.row_cost_ratio == pytest.approx(0.015 / 0.090)
    gemma = SessionLoad()  # what the Gemma chain measured alone: a further row ~1.2 steps
    gemma_first = Session()
    gemma.enter(gemma_first)
    measured = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), load=gemma)
    for _ in range(60):
        request = measured.next_window()
        assert request is not None
        rows = len(request.tokens)
        measured.on_reply(request.window_id, (29871,) * rows, wall_seconds=0.092 + 0.108 * (rows - 1),
                          compute_seconds=0.090 + 0.108 * (rows - 1))
    assert gemma.row_cost_ratio == pytest.approx(1.2, rel=0.2) and gemma.costs
    load = gemma
    first = gemma_first
    others = [Session() for _ in range(7)]
    for session in others:
        load.enter(session)

    def plain_under_load(shared: SessionLoad) -> bool:
        crowded = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), load=shared)
        drive(crowded, 10, queueing=0.300)
        feed(crowded.controller, 0.99, 60, seed=4)
        request = crowded.next_window()
        assert request is not None
        return request.is_decode

    assert plain_under_load(load)  # the measured ratio and prices: a plain step
    prior = SessionLoad()
    for session in [first, *others]:
        prior.enter(session)
    assert plain_under_load(prior)  # the prior alone: a plain step too (it sent windows before)
    assert single.controller.cost.row_cost_ratio == 0.25  # the lone session kept its own


async def test_concurrent_greedy_sessions_stay_exact_and_are_counted(tiny_llama: Path, tmp_path: Path) -> None:
    """Four sessions at once on a 2-stage chain: each gets the tokens it gets alone without
    speculation, the controllers saw the others, and the count returns to zero."""
    generator = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=16, credit=2)
    seen: list[int] = []
    original = SessionLoad.sessions.fget  # type: ignore[attr-defined]

    class Watched(SessionLoad):
        @property
        def sessions(self) -> int:
            count = original(self)
            seen.append(count)
            return count

    generator.load = Watched()
    prompts = [tuple(LOOP), tuple(LOOP[:-3]), tuple(LOOP[:-6]), tuple(LOOP[:-9])]
    try:
        async with stage_chain(str(tiny_llama), ["0:2", "2:4"], tmp_path) as stages:
            assert stages[0].address is not None
            address = stages[0].address
            plain: list[list[int]] = []
            for index, prompt in enumerate(prompts):
                async with await StageClient.connect(address) as client:
                    done = await generator.generate(client, GenerationRequest(prompt, 32, speculation=False),
                                                    200 + index)
                plain.append(done.tokens)
            results: dict[int, list[int]] = {}

            async def one(index: int) -> None:
                async with await StageClient.connect(address) as client:
                    done = await generator.generate(client, GenerationRequest(prompts[index], 32, speculation=True),
                                                    300 + index)
                results[index] = done.tokens

            async with trio.open_nursery() as nursery:
                for index in range(len(prompts)):
                    nursery.start_soon(one, index)
            assert [results[i] for i in range(len(prompts))] == plain
            assert max(seen) >= 2  # the controllers were told about the other sessions
            assert generator.load.sessions == 0
    finally:
        generator.close()


def test_a_lone_session_adopts_the_window_cost_measured_before() -> None:
    """Each request has its own controller: on the peer benchmark (64-token requests) every
    request paid again for the windows that taught it what a window costs.  A session that starts
    alone takes the cost model of the last session that measured a window alone."""
    load = SessionLoad()
    first_session = Session()
    load.enter(first_session)
    first = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), load=load)
    drive(first, 60, queueing=0.002)
    assert first.controller.cost.windows_measured and load.costs == {1: first.controller.cost}
    load.leave(first_session)
    second_session = Session()
    load.enter(second_session)
    second = SpeculativeDecoder(LOOP, 29871, config=SpeculationConfig(), load=load)
    assert not second.controller.cost.ready
    second.next_window()
    cost = second.controller.cost
    assert cost.ready and cost.windows_measured and cost is not first.controller.cost
    assert cost.compute(9) == pytest.approx(first.controller.cost.compute(9))
    assert cost.round_trip == pytest.approx(0.002)
    # the bets (and the probes' clock) come with the costs, as a copy
    assert cost.bets.bets == first.controller.bets.bets > 0 and cost.bets.bands == first.controller.bets.bands
    assert cost.bets is not first.controller.bets and cost.bets.bands is not first.controller.bets.bands


@pytest.mark.parametrize("stages", [1, 2])
def test_a_busy_chain_sends_no_window_from_its_start(stages: int) -> None:
    """Issue 31 item 3, traced at N = 8 on one stage (twothread): a run that started straight at
    N = 8 sent verify windows (70 of 144 batches held all 8 rows, 118 with speculation off).  On a
    chain busy with 7 other sessions (a fake load: the SessionLoad counts them) requests on a
    looping stream send no window from their first token (no learning period), on the kernels
    of patch 0018 or with a cost model measured alone before; a lone stream then speculates and
    gains as alone, and a request whose company leaves midway speculates from then on."""
    from test_speculation_controller import load_sim

    sim = load_sim()

    def stage_cost(rows: int) -> float:
        return float(sim.table_cost(sim.CPU_F16_0018, rows)) / stages

    chain = sim.ChainModel([stage_cost] * stages, 0.0002, 0.0005, cores=2)
    config = SpeculationConfig(controller=ControllerConfig(stages=stages))
    prompt, stream = [101, 102] * 20, [103] * 64
    plain = sim.simulate(prompt, stream, chain, SpeculationConfig(enabled=False), driver_time=False)
    load = SessionLoad()
    others = [Session() for _ in range(7)]
    for session in others:
        load.enter(session)
    for _ in range(3):  # busy from the start: never a window
        busy = sim.simulate(prompt, stream, chain, config, driver_time=False, load=load)
        assert busy.windows == [] and busy.usage.proposed == 0
    for session in others:
        load.leave(session)
    lone = [sim.simulate(prompt, stream, chain, config, driver_time=False, load=load) for _ in range(2)]
    assert all(run.windows and plain.seconds / run.seconds >= 1.8 for run in lone)
    for session in others:  # busy again, with a cost model measured alone: still no window
        load.enter(session)
    assert load.costs and sim.simulate(prompt, stream, chain, config, driver_time=False, load=load).windows == []

    class Leaving(SessionLoad):
        """The other sessions leave after the load was read 30 times (about 10 plain steps)."""

        reads = 0

        @property
        def sessions(self) -> int:
            Leaving.reads += 1
            return 8 if Leaving.reads <= 30 else 1

    midway = sim.simulate(prompt, stream, chain, config, driver_time=False, load=Leaving())
    assert midway.window_sizes[:8] == [1] * 8 and midway.windows  # plain while busy, windows once alone
    assert plain.seconds / midway.seconds >= 1.3


def test_a_request_on_a_busy_chain_takes_the_plain_path() -> None:
    """A request that starts where even drafts that are all kept could not pay the others does not
    speculate at all: its plain steps would cost more per token than the plain path (a decode run,
    direct return; 2 x 1t Gemma at N = 8: 94.3 against 100.8 tok/s with speculation off).  A lone
    stream, a few sessions and an explicit opt-in still speculate."""
    from skippy.driver.speculation import speculation_pays

    config = ControllerConfig()
    load = SessionLoad()
    sessions = [Session() for _ in range(8)]
    load.enter(sessions[0])
    assert speculation_pays(load, config)
    for session in sessions[1:]:
        load.enter(session)
    assert not speculation_pays(load, config)  # the prior: 8 sessions
    for session in sessions[2:]:
        load.leave(session)
    assert speculation_pays(load, config)  # two: a loop's windows may pay
    from test_speculation_controller import cpu_0018

    cpu = CostModel(0.25, 16.0)  # a session alone measured c_1 and windows of 2-9 rows (patch 0018's CPU)
    for rows in [1] * 4 + [*range(2, 10)] * 2:
        cpu.observe(rows, cpu_0018(rows) + 0.0005, cpu_0018(rows))
    load.costs[1] = cpu
    for session in sessions[2:4]:
        load.enter(session)
    assert load.sessions == 4 and speculation_pays(load, config)  # an 8-row window beside 3 rows: 7 ms a token
    for session in sessions[4:]:
        load.enter(session)
    assert load.sessions == 8 and not speculation_pays(load, config)

    class Busy(SessionLoad):
        @property
        def sessions(self) -> int:
            return 8

    generator = Generator.__new__(Generator)  # its load and settings only
    generator.load, generator.controller, generator.speculation = Busy(), ControllerConfig(), True
    greedy = GenerationRequest((1, 2, 3), 16)
    assert generator.speculates(greedy) and not generator.speculates(greedy, load_aware=True)
    assert generator.speculates(GenerationRequest((1, 2, 3), 16, speculation=True), load_aware=True)
    generator.load = SessionLoad()
    assert generator.speculates(greedy, load_aware=True)


async def test_a_run_that_finds_the_chain_busy_decodes_on_plainly(tiny_llama: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that started alone speculates; once the chain is busy (a fake load: 8 sessions
    once it committed 12 tokens) it ends its speculation between windows (a pipelined epoch sends
    no more continuations), the KV trimmed to what the plain loop leaves, and decodes on as a
    decode run: the same tokens as without speculation.  A request that starts on the busy chain
    never speculates."""
    from skippy.driver import generator as generator_module

    class Recording(SpeculativeDecoder):
        last: "Recording | None" = None

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            Recording.last = self

    class Rising(SessionLoad):
        mode = "alone"  # "alone", "rising", "busy"

        @property
        def sessions(self) -> int:
            last = Recording.last
            if Rising.mode == "busy" or (Rising.mode == "rising" and last is not None and len(last.generated) >= 12):
                return 8
            return 1

    monkeypatch.setattr(generator_module, "SpeculativeDecoder", Recording)
    # on the tiny llama a window costs about a step and the round trip dominates: windows would pay
    # even at S = 8 (speculation_pays, tested above); here the switch itself is tested
    monkeypatch.setattr(generator_module, "speculation_pays", lambda load, config: load.sessions <= 1)
    generator = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=16, credit=2)
    try:
        async with stage_chain(str(tiny_llama), ["0:2", "2:4"], tmp_path) as stages:
            assert stages[0].address is not None
            address = stages[0].address
            async with await StageClient.connect(address) as client:
                plain = await generator.generate(client, GenerationRequest(tuple(LOOP), 96, speculation=False), 400)
            generator.load = Rising()
            async with await StageClient.connect(address) as client:  # alone: what windows cost is learnt
                alone = await generator.generate(client, GenerationRequest(tuple(LOOP), 96), 401)
            assert alone.tokens == plain.tokens and alone.speculation is not None and alone.speculation.windows
            Rising.mode, Recording.last = "rising", None
            async with await StageClient.connect(address) as client:
                switched = await generator.generate(client, GenerationRequest(tuple(LOOP), 96), 402)
            assert switched.tokens == plain.tokens and switched.speculation is not None
            assert Recording.last is not None and 12 <= len(Recording.last.generated) < len(switched.tokens) - 8
            Rising.mode, Recording.last = "busy", None
            async with await StageClient.connect(address) as client:
                busy = await generator.generate(client, GenerationRequest(tuple(LOOP), 96), 403)
            assert busy.tokens == plain.tokens and busy.speculation is None and Recording.last is None
            Rising.mode = "alone"
            async with await StageClient.connect(address) as client:
                again = await generator.generate(client, GenerationRequest(tuple(LOOP), 96), 404)
            assert again.tokens == plain.tokens and again.speculation is not None
    finally:
        generator.close()


def test_a_busy_chain_takes_the_speculating_path_only_with_a_margin_over_the_plain_path() -> None:
    """The costs a 2 x 1t Gemma chain measured alone (session 19's probe: R 0.15 ms, c_1 18.5 ms,
    windows of 2-9 rows 21.7-72.9 ms): drafts all kept gain at most 1.38, 1.19, 1.10, 1.05, 1.02,
    1.00, 0.99 at S = 2..8.  A request takes the speculating path up to S = 3, from S = 4 on the
    plain path, whose steps cost less per token; with min_gain alone as the margin it speculated
    up to S = 5 (and in a run whose costs were noisier, at S = 8: docs/throughput.md)."""
    from skippy.driver.speculation import speculation_pays

    prices = {1: 18.52, 2: 21.66, 3: 46.01, 4: 38.9, 5: 50.44, 6: 52.48, 7: 59.28, 8: 66.07, 9: 72.86}
    measured = CostModel(0.25, 16.0)
    for rows in [1] * 4 + [*range(2, 10)] * 2:
        measured.observe(rows, (prices[rows] + 0.15) / 1000, prices[rows] / 1000)
    config = ControllerConfig(stages=2)
    lenient = dataclasses.replace(config, load_min_gain=config.min_gain)
    load = SessionLoad()
    load.costs[2] = measured
    sessions = [Session() for _ in range(8)]
    pays, pays_lenient = [], []
    for session in sessions:
        load.enter(session)
        pays.append(speculation_pays(load, config))
        pays_lenient.append(speculation_pays(load, lenient))
    assert pays == [True] * 3 + [False] * 5
    assert pays_lenient == [True] * 5 + [False] * 3
    with pytest.raises(ValueError, match="load_min_gain"):
        ControllerConfig(load_min_gain=0.9)
