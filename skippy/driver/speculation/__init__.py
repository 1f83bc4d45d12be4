"""Driver-side speculative decoding: n-gram drafts, acceptance rules, control, window FIFO.

``SpeculativeDecoder`` is what the Generator drives; the other modules are its parts:
``proposer`` (suffix n-gram drafts), ``acceptance`` (greedy and lossless sampled rules),
``controller`` (window size and pipeline depth from acceptance and timing), ``window``
(in-flight windows, authoritative positions, usage counters).
"""

from skippy.driver.speculation.acceptance import (
    SamplingSettings,
    Verdict,
    accept_greedy,
    accept_point_mass,
    accept_point_mass_batch,
    accept_speculative,
    accept_tokens,
    residual_distribution,
    target_probabilities,
)
from skippy.driver.speculation.controller import (
    BetRecord,
    ControllerConfig,
    CostModel,
    Plan,
    SessionLoad,
    SpeculationController,
    expected_tokens,
    pipelined_rate,
    pipelined_waits,
    serial_rate,
    shared_gain,
    speculation_pays,
)
from skippy.driver.speculation.decoder import SpeculationConfig, SpeculativeDecoder, WindowRequest
from skippy.driver.speculation.proposer import NO_DRAFT, Draft, NgramProposer
from skippy.driver.speculation.window import (
    SpeculationUsage,
    UnknownWindowError,
    Window,
    WindowError,
    WindowId,
    WindowOrderError,
    WindowOutcome,
    WindowShapeError,
    WindowTracker,
)

__all__ = [
    "NO_DRAFT", "BetRecord", "ControllerConfig", "CostModel", "Draft", "NgramProposer", "Plan", "SamplingSettings",
    "SessionLoad", "SpeculationConfig", "SpeculationController", "SpeculationUsage", "SpeculativeDecoder",
    "UnknownWindowError", "Verdict", "Window", "WindowError", "WindowId", "WindowOrderError",
    "WindowOutcome", "WindowRequest", "WindowShapeError", "WindowTracker", "accept_greedy",
    "accept_point_mass", "accept_point_mass_batch", "accept_speculative", "accept_tokens",
    "expected_tokens", "pipelined_rate", "pipelined_waits", "residual_distribution", "serial_rate", "shared_gain",
    "speculation_pays", "target_probabilities",
]
