"""Controller: cost model formulas and behaviour under simulated acceptance / RTT regimes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from skippy.driver.speculation import (
    ControllerConfig,
    CostModel,
    SpeculationConfig,
    SpeculationController,
    expected_tokens,
    pipelined_rate,
    serial_rate,
)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def cost(round_trip: float, single: float, extra: float) -> CostModel:
    model = CostModel(0.25, 8.0)
    model.observe(1, round_trip + single, single)
    model.observe(5, round_trip + single + 4 * extra, single + 4 * extra)
    return model


def test_rates() -> None:
    model = cost(0.020, 0.010, 0.001)
    assert model.latency(1) == pytest.approx(0.030)
    assert serial_rate(0.0, 0, model) == pytest.approx(1 / 0.030)
    assert serial_rate(0.8, 4, model) == pytest.approx(expected_tokens(0.8, 4) / 0.034)
    assert pipelined_rate(0.8, 4, 1, model, 0.5) == serial_rate(0.8, 4, model)
    assert pipelined_rate(0.95, 4, 4, model, 0.5) > serial_rate(0.95, 4, model)
    # Compute-bound: a saturated bottleneck makes depth useless.
    heavy = cost(0.0, 0.010, 0.010)
    assert pipelined_rate(0.9, 4, 4, heavy, 1.0) <= serial_rate(0.9, 4, heavy) + 1e-9


def controller(round_trip: float, single: float, extra: float, **config: object) -> SpeculationController:
    control = SpeculationController(ControllerConfig(**config))  # type: ignore[arg-type]
    for _ in range(4):
        control.observe_traversal(1, round_trip + single, single)
        control.observe_traversal(5, round_trip + single + 4 * extra, single + 4 * extra)
    return control


def feed(control: SpeculationController, rate: float, windows: int, seed: int, match_length: int = 6) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(windows):
        outcomes = rng.random(8) < rate
        accepted = int(np.argmin(outcomes)) if not outcomes.all() else 8
        control.observe_outcome(match_length, accepted, 8)


def test_no_plan_before_timing_or_without_drafts() -> None:
    control = SpeculationController()
    assert control.plan(8, 10).window == 0
    control = controller(0.02, 0.01, 0.001)
    assert control.plan(0, 0).window == 0


def test_turns_on_for_high_acceptance_and_high_rtt() -> None:
    control = controller(0.020, 0.005, 0.0005, max_depth=4, stages=2)
    feed(control, 0.9, 30, seed=1)
    plan = control.plan(8, 6)
    assert plan.window >= 4 and plan.speedup > 2.0 and plan.depth >= 2
    assert control.enabled and control.expected_speedup() > 2.0
    assert control.plan(2, 6).window <= 2  # never more than the proposer offers


def test_off_for_low_acceptance_then_probes_and_recovers() -> None:
    control = controller(0.010, 0.010, 0.002, probe_interval=8)
    feed(control, 0.05, 40, seed=2)
    plans = [control.plan(8, 6) for _ in range(8)]
    assert all(p.window == 0 for p in plans[:7]) and not control.enabled
    assert plans[7].probe and 1 <= plans[7].window <= 2 and plans[7].depth == 1
    for _ in range(40):  # shadow scores (judged = 1) while off bring it back
        control.observe_outcome(6, 1, 1)
    assert control.plan(8, 6).window > 0 and control.enabled


def test_off_when_compute_bound() -> None:
    control = controller(0.0, 0.010, 0.010)  # no network, every row costs a full step
    feed(control, 0.6, 40, seed=3)
    assert control.plan(8, 6).window == 0


def test_buckets_separate_confident_drafts() -> None:
    control = controller(0.010, 0.010, 0.002)
    feed(control, 0.95, 40, seed=4, match_length=20)
    feed(control, 0.02, 40, seed=5, match_length=2)
    assert control.plan(8, 20).window >= 3
    assert control.plan(8, 2).window == 0


def test_config_validation() -> None:
    for bad in ({"max_window": 0}, {"max_depth": 65}, {"min_gain": 0.9}, {"bottleneck_share": 0.0},
                {"prior_acceptance": 1.0}):
        with pytest.raises(ValueError):
            ControllerConfig(**bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- simulated chain


def load_sim() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "speculation_sim.py"
    spec = importlib.util.spec_from_file_location("speculation_sim", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["speculation_sim"] = module
    spec.loader.exec_module(module)
    return module


def streams() -> dict[str, tuple[list[int], list[int]]]:
    rng = np.random.default_rng(8)
    lines = [[int(t) for t in rng.integers(100, 5000, size=int(rng.integers(4, 12)))] + [13] for _ in range(30)]
    code = [t for line in lines for t in line]
    edited = [t for i, line in enumerate(lines) for t in (line if i % 7 else [42] + line)]
    noise = [int(t) for t in rng.integers(0, 32000, size=400)]
    return {"repetitive": (code, edited[:240]), "random": (noise[:200], noise[200:400])}


@pytest.mark.parametrize(("single_ms", "extra_ms"), [(2.0, 0.2), (10.0, 3.0)])
def test_simulated_two_stage_chain(single_ms: float, extra_ms: float) -> None:
    sim = load_sim()
    chain = sim.ChainModel([sim.linear_cost(single_ms / 2000, extra_ms / 2000)] * 2, 0.005, 0.0003)
    config = SpeculationConfig(controller=ControllerConfig(stages=2, bottleneck_share=0.5))
    plain_config = SpeculationConfig(enabled=False)
    speedups = {}
    for name, (prompt, stream) in streams().items():
        plain = sim.simulate(prompt, stream, chain, plain_config)
        spec = sim.simulate(prompt, stream, chain, config)
        speedups[name] = spec.tokens_per_second / plain.tokens_per_second
    assert speedups["repetitive"] >= 1.6
    assert speedups["random"] >= 0.95
