# Adaptive speculation control: window size K and pipeline depth D from acceptance and timing.
#
# Strategy: a cost model picks the plan with the highest expected committed tokens per second.
#
# * Acceptance a is the per-draft-token conditional acceptance (P(d_i kept | d_1..d_{i-1} kept)),
#   estimated with exponentially discounted counts per confidence bucket (the proposer's match
#   length) plus a pooled estimate; a rejection censors the drafts after it, so only the judged
#   prefix counts.  Steps that do not speculate still score the proposer for free ("shadow"
#   outcomes: the first drafted token against the token the chain actually produced), so the
#   estimate recovers without paying for windows.
# * Time: a traversal of n rows costs L(n) = R + C(n) with C(n) = c_1 + c_row (n - 1) summed over
#   stages.  R (network + protocol) is the discounted mean of wall - compute over traversals sent
#   alone; c_1 from single-row steps, c_row from windows (prior: `row_cost_ratio` * c_1).
# * Serial plan (D = 1): E(K) = (1 - a^(K+1)) / (1 - a) tokens per L(K + 1).
# * Pipelined plan (D >= 2): an epoch streams windows of n = K + 1 rows (the first carries the
#   committed token and K drafts, the rest K + 1 drafts) until the first rejection; it commits
#   1 / (1 - a) tokens on average over E[W] = 1 + a^K / (1 - a^(K+1)) windows, the first after L(n)
#   (or D * C_b(n) once the slowest stage, C_b, saturates) and the next every max(L(n) / D, C_b(n)).
# * Baseline: 1 token per L(1).  A plan is used only when its expected speedup >= `min_gain`;
#   otherwise the step is a plain decode ("off").  While off, every `probe_interval` plain steps
#   with a draft available one small real window (K <= 2) is allowed, refreshing the row cost and
#   the acceptance with real replies; so a wrong prior can neither lock speculation on nor off.
#
# The worst case per step is one rejected window chosen at an estimated gain >= min_gain; the
# loss is bounded by c_row * K, which the model weighs against R + c_1.
#
# Load (docs/throughput.md): the plan is per session, but the rows of a window share the stages'
# batches with the other sessions' rows.  With S sessions decoding on the chain (`SessionLoad`,
# counted by the Generator), a step of all of them is L_S = L(1) + c_row (S - 1); K drafts make it
# L_S + c_row K for every session, and commit E(K) tokens here against 1 for each other session.
# The aggregate gain is G(K) = (S - 1 + E(K)) / S * L_S / (L_S + c_row K) (`shared_gain`; S = 1 is
# the serial speedup above).  With S >= 2 only serial windows are weighed (a pipelined window
# takes the bottleneck stage from the others too), a window is sent only when G >= min_gain, and
# no probe windows are sent (shadow scoring still tracks acceptance).  Even perfect drafts give
# G <= 1 once the rows dominate the step (c_row S >= L_S), so enough sessions keep it off.
# Timing under load: a traversal that shared the chain with other sessions (S >= 2 when sent or
# answered) waited behind their rows and was batched with them, so it teaches neither R nor c_row
# (only a first c_1); the shared rule takes R = 0 until a traversal alone on the chain shows it,
# and c_row / c_1 from the last session that measured it alone (`SessionLoad.row_cost_ratio`).
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Final, final

__all__ = [
    "AcceptanceEstimator",
    "ControllerConfig",
    "CostModel",
    "Plan",
    "SessionLoad",
    "SpeculationController",
    "expected_tokens",
    "pipelined_rate",
    "serial_rate",
    "shared_gain",
]

#: Acceptance is clamped below this so the pipelined formula stays finite.
_MAX_ACCEPTANCE: Final = 0.995
#: Match-length bucket bounds (upper, inclusive) for per-bucket acceptance.
_BUCKETS: Final = (2, 3, 5, 8, 16, 10**9)


def expected_tokens(acceptance: float, window: int) -> float:
    """E = (1 - a^(K+1)) / (1 - a): committed tokens per serial window of K drafts."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(window + 1)
    return (1.0 - a ** (window + 1)) / (1.0 - a)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Tuning of the controller.

    Attributes:
        max_window: most drafts per window (K).
        max_depth: most live windows in flight (D); 1 disables pipelining.
        stages: stages in the chain.
        bottleneck_share: the slowest stage's share of the summed compute (None: conservatively
            max(1 / stages, 0.5), since the last stage also runs the output head).
        min_gain: expected speedup needed to speculate on a step.
        prior_acceptance: acceptance assumed before any observation.
        prior_weight: pseudo-observations behind the prior.
        halflife: draft outcomes after which an observation's weight halves.
        row_cost_ratio: prior marginal cost of one more row, as a fraction of a one-row step.
        probe_interval: plain steps with a draft between real probe windows while off.
        timing_halflife: traversals after which a timing observation's weight halves.
    """

    max_window: int = 8
    max_depth: int = 4
    stages: int = 1
    bottleneck_share: float | None = None
    min_gain: float = 1.03
    prior_acceptance: float = 0.3
    prior_weight: float = 2.0
    halflife: float = 24.0
    row_cost_ratio: float = 0.25
    probe_interval: int = 32
    timing_halflife: float = 16.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_window <= 63:
            raise ValueError(f"max_window must be in 1..63 (got {self.max_window})")
        if not 1 <= self.max_depth <= 64:
            raise ValueError(f"max_depth must be in 1..64 (got {self.max_depth})")
        if self.stages < 1 or self.min_gain < 1.0 or self.halflife <= 0 or self.timing_halflife <= 0:
            raise ValueError("stages >= 1, min_gain >= 1 and positive half-lives are required")
        if self.bottleneck_share is not None and not 0.0 < self.bottleneck_share <= 1.0:
            raise ValueError(f"bottleneck_share must be in (0, 1] (got {self.bottleneck_share})")
        if not 0.0 <= self.prior_acceptance < 1.0 or self.prior_weight <= 0 or self.row_cost_ratio < 0:
            raise ValueError("invalid acceptance prior or row cost ratio")


    @property
    def bottleneck(self) -> float:
        if self.bottleneck_share is not None:
            return self.bottleneck_share
        return 1.0 if self.stages == 1 else max(1.0 / self.stages, 0.5)


@final
@dataclass(slots=True)
class AcceptanceEstimator:
    """Discounted success / trial counts shrunk towards a prior."""

    prior: float
    prior_weight: float
    halflife: float
    successes: float = 0.0
    trials: float = 0.0

    def observe(self, accepted: int, judged: int) -> None:
        """Record a window: ``accepted`` drafts kept out of ``judged`` (the prefix then one reject)."""
        trials = min(judged, accepted + 1)
        if trials <= 0:
            return
        decay = 0.5 ** (trials / self.halflife)
        self.successes = self.successes * decay + accepted
        self.trials = self.trials * decay + trials

    @property
    def rate(self) -> float:
        return (self.successes + self.prior * self.prior_weight) / (self.trials + self.prior_weight)


@final
@dataclass(slots=True)
class CostModel:
    """Discounted estimates of round-trip overhead and per-row compute (seconds)."""

    row_cost_ratio: float
    halflife: float
    round_trip: float = 0.0
    single_row: float = 0.0
    extra_row: float | None = None
    _seen_round_trip: bool = False
    _seen_single: bool = False

    def _blend(self, old: float, new: float, seen: bool) -> float:
        if not seen:
            return new
        weight = 1.0 - 0.5 ** (1.0 / self.halflife)
        return old + weight * (new - old)

    def observe(self, rows: int, wall_seconds: float, compute_seconds: float, *, alone: bool = True,
                shared: bool = False) -> None:
        """Record a traversal of ``rows`` rows (compute summed over stages).

        ``alone``: nothing else of this session was in flight.  ``shared``: other sessions ran on
        the chain meanwhile: its wall time includes waiting behind their rows (their compute, no
        free latency) and its compute the rows of theirs it was batched with, so it teaches
        neither R nor c_row; only a first c_1, so that the shared rule can decide at all.
        """
        if rows < 1 or wall_seconds < 0 or compute_seconds < 0:
            return
        if shared:
            if rows == 1 and not self._seen_single:
                self.single_row = compute_seconds
                self._seen_single = True
            return
        if alone:
            self.round_trip = self._blend(self.round_trip, max(wall_seconds - compute_seconds, 0.0),
                                          self._seen_round_trip)
            self._seen_round_trip = True
        if rows == 1:
            self.single_row = self._blend(self.single_row, compute_seconds, self._seen_single)
            self._seen_single = True
        elif self._seen_single:
            per_row = max(compute_seconds - self.single_row, 0.0) / (rows - 1)
            self.extra_row = per_row if self.extra_row is None else self._blend(self.extra_row, per_row, True)

    @property
    def ready(self) -> bool:
        return self._seen_round_trip and self._seen_single

    @property
    def ready_shared(self) -> bool:
        """Enough for the shared rule: c_1 (R is 0 until a traversal alone on the chain shows it)."""
        return self._seen_single

    def compute(self, rows: int) -> float:
        extra = self.row_cost_ratio * self.single_row if self.extra_row is None else self.extra_row
        return self.single_row + extra * (rows - 1)

    def latency(self, rows: int) -> float:
        return self.round_trip + self.compute(rows)

    @property
    def row(self) -> float:
        """The marginal compute of one more row in a traversal (c_row)."""
        return self.row_cost_ratio * self.single_row if self.extra_row is None else self.extra_row


class SessionLoad:
    """The sessions running on a chain now, counted by whoever starts them (the Generator): the
    speculation controller weighs a window's cost to the others by it.  Held weakly: a session
    dropped without leaving stops counting once it is collected."""

    def __init__(self) -> None:
        self._active: weakref.WeakSet[object] = weakref.WeakSet()
        #: c_row / c_1 last measured by a session alone on the chain (None: not yet): a session
        #: that starts under load measures neither, and takes this over its prior.
        self.row_cost_ratio: float | None = None

    def enter(self, session: object) -> None:
        self._active.add(session)

    def leave(self, session: object) -> None:
        self._active.discard(session)

    @property
    def sessions(self) -> int:
        return len(self._active)


def shared_gain(acceptance: float, window: int, sessions: int, cost: CostModel) -> float:
    """Aggregate throughput gain of one serial window of ``window`` drafts for one of ``sessions``
    sessions sharing every batch (see the module header; 1 session: the serial speedup)."""
    sessions = max(1, sessions)
    step = cost.latency(1) + cost.row * (sessions - 1)
    committed = sessions - 1 + expected_tokens(acceptance, window)
    return committed / sessions * step / max(step + cost.row * window, 1e-12)


def serial_rate(acceptance: float, window: int, cost: CostModel) -> float:
    """Expected committed tokens per second with one window of ``window`` drafts at a time."""
    return expected_tokens(acceptance, window) / max(cost.latency(window + 1), 1e-12)


def pipelined_rate(acceptance: float, window: int, depth: int, cost: CostModel, bottleneck_share: float) -> float:
    """Expected tokens per second streaming windows of ``window + 1`` rows, ``depth`` in flight.

    ``bottleneck_share`` is the slowest stage's fraction of the compute summed over stages.
    """
    if depth <= 1:
        return serial_rate(acceptance, window, cost)
    a = min(max(acceptance, 0.0), _MAX_ACCEPTANCE)
    rows = window + 1
    latency = cost.latency(rows)
    bottleneck = cost.compute(rows) * bottleneck_share
    interval = max(latency / depth, bottleneck)
    # Little's law: with `depth` windows queued at a saturated bottleneck, an epoch's first window
    # waits behind the previous epoch's stale windows, so it takes depth * bottleneck, not latency.
    first = max(latency, depth * bottleneck)
    windows = 1.0 + a ** window / (1.0 - a ** rows)
    return (1.0 / (1.0 - a)) / max(first + (windows - 1.0) * interval, 1e-12)


@dataclass(frozen=True, slots=True)
class Plan:
    """What the next epoch does.

    Attributes:
        window: drafts in the epoch-start window (0: a plain decode step).
        depth: live windows to keep in flight (1: serial).
        speedup: expected speedup over plain decoding.
        probe: this window is a probe taken while speculation is off.
    """

    window: int
    depth: int
    speedup: float
    probe: bool = False


_PLAIN: Final = Plan(0, 1, 1.0)


@final
@dataclass(slots=True)
class SpeculationController:
    """Chooses K and D per epoch; see the module header for the model."""

    config: ControllerConfig = field(default_factory=ControllerConfig)
    cost: CostModel = field(init=False)
    pooled: AcceptanceEstimator = field(init=False)
    buckets: list[AcceptanceEstimator] = field(init=False)
    plain_steps_since_window: int = 0
    enabled: bool = True

    def __post_init__(self) -> None:
        c = self.config
        self.cost = CostModel(c.row_cost_ratio, c.timing_halflife)
        self.pooled = AcceptanceEstimator(c.prior_acceptance, c.prior_weight, c.halflife)
        self.buckets = [AcceptanceEstimator(c.prior_acceptance, c.prior_weight, c.halflife) for _ in _BUCKETS]

    @staticmethod
    def bucket_of(match_length: int) -> int:
        for index, upper in enumerate(_BUCKETS):
            if match_length <= upper:
                return index
        return len(_BUCKETS) - 1

    def acceptance(self, match_length: int) -> float:
        """Estimated acceptance for drafts with this confidence hint (bucket shrunk to pooled)."""
        bucket = self.buckets[self.bucket_of(match_length)]
        weight = self.config.prior_weight
        return (bucket.successes + self.pooled.rate * weight) / (bucket.trials + weight)

    def observe_outcome(self, match_length: int, accepted: int, judged: int) -> None:
        """Record a window's drafts (or a shadow score: ``judged`` = 1)."""
        self.buckets[self.bucket_of(match_length)].observe(accepted, judged)
        self.pooled.observe(accepted, judged)

    def observe_traversal(self, rows: int, wall_seconds: float, compute_seconds: float, *,
                          alone: bool = True, shared: bool = False) -> None:
        """Record timing of one reply (``alone``: nothing else of this session was in flight;
        ``shared``: other sessions ran on the chain meanwhile, :meth:`CostModel.observe`)."""
        self.cost.observe(rows, wall_seconds, compute_seconds, alone=alone, shared=shared)

    def best(self, acceptance: float, max_window: int) -> Plan:
        """The best (K, D) for an acceptance, with K <= ``max_window``."""
        if max_window < 1 or not self.cost.ready:
            return _PLAIN
        base = 1.0 / max(self.cost.latency(1), 1e-12)
        best = _PLAIN
        best_rate = base
        for window in range(1, min(max_window, self.config.max_window) + 1):
            for depth in range(1, self.config.max_depth + 1):
                rate = pipelined_rate(acceptance, window, depth, self.cost, self.config.bottleneck)
                if rate > best_rate * (1.0 + 1e-9):
                    best, best_rate = Plan(window, depth, rate / base), rate
        return best

    def best_shared(self, acceptance: float, max_window: int, sessions: int) -> Plan:
        """The best serial window for one of ``sessions`` >= 2 sessions (``speedup``: the
        aggregate gain, :func:`shared_gain`)."""
        if max_window < 1 or not self.cost.ready_shared:
            return _PLAIN
        best = _PLAIN
        for window in range(1, min(max_window, self.config.max_window) + 1):
            gain = shared_gain(acceptance, window, sessions, self.cost)
            if gain > best.speedup * (1.0 + 1e-9):
                best = Plan(window, 1, gain)
        return best

    def plan(self, draft_length: int, match_length: int, sessions: int = 1) -> Plan:
        """The plan for an epoch whose proposer offers ``draft_length`` drafts, with ``sessions``
        sessions (this one included) running on the chain.

        Returns:
            ``window == 0`` for a plain decode step.
        """
        if draft_length <= 0:
            return _PLAIN
        if sessions >= 2:  # the others pay for this session's drafts: weigh the aggregate
            choice = self.best_shared(self.acceptance(match_length), draft_length, sessions)
            self.enabled = (self.best_shared(self.pooled.rate, self.config.max_window, sessions).speedup
                            >= self.config.min_gain)
            if choice.window and choice.speedup >= self.config.min_gain:
                self.plain_steps_since_window = 0
                return choice
            return _PLAIN
        if not self.cost.ready:
            return _PLAIN  # the first plain steps measure R and c_1
        choice = self.best(self.acceptance(match_length), draft_length)
        self.enabled = self.best(self.pooled.rate, self.config.max_window).speedup >= self.config.min_gain
        if choice.window and choice.speedup >= self.config.min_gain:
            self.plain_steps_since_window = 0
            return choice
        self.plain_steps_since_window += 1
        if self.plain_steps_since_window >= self.config.probe_interval:
            self.plain_steps_since_window = 0
            return Plan(min(2, draft_length), 1, choice.speedup, probe=True)
        return _PLAIN

    def expected_speedup(self) -> float:
        """The pooled estimate's best expected speedup (1.0 when off or not yet measured)."""
        return self.best(self.pooled.rate, self.config.max_window).speedup
