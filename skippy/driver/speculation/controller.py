# Adaptive speculation control: window size K and pipeline depth D from acceptance and timing.
#
# Strategy: a cost model picks the plan with the highest expected committed tokens per second.
#
# * Acceptance, two rates: a_1, that a window's first draft is kept, and a, that a further draft
#   is kept given the one before it was (a continuation window's drafts, its boundary guess
#   first, are all "further").  Both are exponentially discounted counts per confidence bucket
#   (the proposer's match length); a_1 is shrunk to its pooled rate, a to the lower of a_1 and
#   the pooled a.  A rejection censors the drafts after it.  Steps that do not speculate still
#   score a draft for free ("shadow" outcomes): the plain steps' tokens judge its drafts one by
#   one until one misses, so both rates keep being measured while off.  On a stream that loops
#   for a few tokens at a time the first draft is often right and the fifth rarely; one rate for
#   both (and shadow scores of first drafts only) sent long windows that lost.
# * Time: a traversal of n rows costs L(n) = R + C(n), C summed over stages: C(1) = c_1 and
#   C(n) = c_1 + c_w + c_row (n - 1) for n >= 2 (`CostModel`: on a CPU two rows can cost 2.6
#   one-row steps, the matmuls leaving their one-row kernel, and each further row ~0.3).  R (network
#   + protocol) is the discounted mean of wall - compute over traversals sent alone; c_1 from
#   single-row steps; a window size measured is priced at the fastest of its last 5 windows, the
#   others by c_w and c_row, a line through the measured sizes (slope prior `row_cost_ratio` c_1):
#   after patch 0018 2 and 3 rows cost ~1.2 one-row steps, 4-8 rows 1.7-2.8 and 9 rows 4.6,
#   which no line fits.  Noise only slows a traversal, so one slow sample decides nothing: a
#   size's price is its fastest recent window (and at most a larger size's: more rows never
#   cost less), R and c_1 take a faster sample at once and a slower one as at most twice the
#   estimate (R: R + c_1).  Traced on peer_compare's rounds:
#   one slow early window priced windows out of a chain for good, so chains of 1 and 2 stages
#   that cost the same made different decisions (speculation's 2-stage figure swung by ms).
# * Serial plan (D = 1): E(K) = 1 + a_1 (1 - a^K) / (1 - a) tokens per L(K + 1).
# * Pipelined plan (D >= 2): an epoch streams windows of n = K + 1 rows (the first carries the
#   committed token and K drafts, the rest K + 1 drafts) until the first rejection; it commits
#   1 + a_1 / (1 - a) tokens on average over E[W] = 1 + a_1 a^(K-1) / (1 - a^(K+1)) windows, the
#   first after L(n) (or D * C_b(n) once the slowest stage, C_b, saturates: the new epoch queues
#   behind the stale windows) and the next every max(L(n) / D, C_b(n)).
# * Realized waits (pipelining only: a serial window's R + C(n) is measured directly): each
#   pipelined reply's wait (since the reply before it, or its send) against the wait the model
#   priced it at (an epoch's first: its arrival; a continuation: the interval; a stale window: 0,
#   free while the bottleneck has room); once they took 4 plain steps' time, the pipelined rates
#   are scaled by priced / realized (<= 1).  That catches what the model does not see: stages
#   sharing a host's cores (a pipeline that does not overlap), stale windows' compute delaying
#   the next epoch.  Every plain step ages the record, so pipelining is tried again within ~100.
# * Each continuation window re-plans (K, D) on the later rate: an epoch of a loop never ends.
#   An epoch start priced as pipelined whose first continuation that re-plan would not send is
#   planned serial instead (it would be a serial window priced on continuations that never come).
# * Baseline: 1 token per L(1).  A plan is used only when its expected speedup >= `min_gain`;
#   otherwise the step is a plain decode ("off").  While off, after `probe_interval` plain steps
#   with a draft available one small real window (K <= 2) is allowed while fewer than 3 windows'
#   costs were measured, after `refresh_interval` once they were (shadow scores keep a_1 current);
#   so a wrong prior can neither lock speculation on nor off.  The steps are counted per chain
#   (`BetRecord.plain_steps`): requests shorter than the interval still probe.
# * Each request has its own controller; a request that starts alone on the chain adopts the cost
#   model (R, c_1, the windows' line, the realized waits) of the last one that measured a window
#   alone (`SessionLoad.costs`), so a short request does not pay again to learn what windows cost.
# * Bets (`BetRecord`, carried with the cost model from request to request): the model
#   sends a window when its estimates are highest, and on a stream of short loops that is where a
#   loop ends (the peer benchmark: after 14 kept shadow drafts a1 read 0.63 and every 64-token
#   request sent one pipelined pair that lost; per request, since acceptance is per request).  So
#   every window the estimates alone would send is a bet: its expected kept drafts (E(K) - 1 at the
#   raw rates) against those kept, whether it was sent or, declined, scored in shadow by the plain
#   steps after it (a stale window: 0).  The first-draft rate is planned at a1 q, q = min(1,
#   kept / expected) of the bet's band of raw a1 (< 0.55, < 0.7, < 0.85, above: a loop's sure
#   bets apart from marginal ones) with a prior of as expected (`bet_weight` drafts): a chain where
#   such bets lose stops sending them after one or two (not once per request), and declined bets
#   that would have won bring q back.
#
# The worst case per step is one rejected window chosen at an estimated gain >= min_gain; the
# loss is bounded by C(K + 1) - c_1, which the model weighs against R + c_1; a chain's bets that
# keep losing send no more windows (q), so the loss is paid about once per chain.
#
# Load (docs/throughput.md): the plan is per session, but a window's compute delays the other
# sessions.  With S sessions decoding on the chain (`SessionLoad`, counted by the Generator), a
# step of all of them is L_S = L(1) + c_row (S - 1).  A stage's scheduler runs the decode rows of
# all sessions as one batch and a verify window as a job of its own after it (skippy.stage.
# scheduler), so a session that sends K drafts instead of its row makes that step L(1) + c_row
# (S - 2) + C(K + 1) for every session (its window a traversal of its own, c_w included), and
# commits E(K) tokens against 1 for each other session: G(K) = (S - 1 + E(K)) / S * L_S / that
# (`shared_gain`; S = 1 is the serial speedup above).  Pricing the window's rows as rows of the
# batch (c_row K) sent windows of near-certain drafts at N = 8 (one stage, twothread: 70 of 144
# batches held all 8 rows, 118 with speculation off; 2 x 1t Gemma 94 against 101 tok/s).  Even
# perfect drafts now give G <= 1 at S >= K + 1 on a CPU (C(K + 1) >= c_1 + c_row K).  With S >= 2
# only serial windows are weighed (a pipelined window takes the bottleneck stage from the others
# too; a pipelined epoch under way sends no more continuations once others run), a window is sent
# only when G >= min_gain, and no probe windows are sent (shadow scoring still tracks
# acceptance): a session that starts on a busy chain sends none before it has measured anything.
# Timing under load: a traversal that shared the chain with other sessions (S >= 2 when sent or
# answered) waited behind their rows and was batched with them, so it teaches neither R nor c_row
# nor a window's price (only a first c_1); the shared rule takes R = 0 until a traversal alone on
# the chain shows it, c_row / c_1 from the last session that measured it alone
# (`SessionLoad.row_cost_ratio`), and the window sizes' prices relative to c_1 from that
# session's cost model (`CostModel.shape`).  A request that starts where even drafts that are all
# kept would not gain `load_min_gain` (`speculation_pays`: min_gain and the plain path's lead;
# S >= 4 on a 2 x 1t CPU chain) does not speculate at all: the Generator gives it the plain path
# (a decode run, direct return), cheaper than a speculating request's plain steps.
from __future__ import annotations

import bisect
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Final, final

__all__ = [
    "AcceptanceEstimator",
    "BetRecord",
    "ControllerConfig",
    "CostModel",
    "Plan",
    "SessionLoad",
    "SpeculationController",
    "expected_tokens",
    "pipelined_rate",
    "pipelined_waits",
    "serial_rate",
    "shared_gain",
    "speculation_pays",
]

#: Acceptance is clamped below this so the pipelined formula stays finite.
_MAX_ACCEPTANCE: Final = 0.995
#: Match-length bucket bounds (upper, inclusive) for per-bucket acceptance.
_BUCKETS: Final = (2, 3, 5, 8, 16, 10**9)
#: Weight of the prior slope c_row in the windows' line fit, in units of (rows - 1)^2: windows of
#: 2 and 3 rows (spread 0.25 per window) need ~16 windows to outweigh it, of 2 and 9 rows ~1.
_SLOPE_PRIOR: Final = 4.0
#: Replies after which a realized wait record's weight halves, and the plain steps' worth
#: of time pipelined replies must have waited before the record corrects the model's rates.
_REALIZED_HALFLIFE: Final = 32.0
_REALIZED_EVIDENCE: Final = 4.0
#: A window's compute is taken as at most this many times its rows' one-row steps (spikes).
_WINDOW_SPIKE: Final = 4.0
#: A timing sample counts at most this many times the model's estimate of it (one slow sample
#: must not decide the controller's fate; a lasting change still moves it, geometrically).
_SPIKE: Final = 2.0
#: Windows of one size whose fastest prices that size (recent ones: the host's load moves).
_SIZE_SAMPLES: Final = 5
#: Windows measured before probes slow from ``probe_interval`` to ``refresh_interval``.
_SETTLED_WINDOWS: Final = 3
#: The weight of a sample below the estimate of R or c_1 (see CostModel._blend).
_DOWN_WEIGHT: Final = 0.25
#: Bounds of the raw first-draft rate's bands in which bets are recorded apart (`BetRecord`).
_BET_BANDS: Final = (0.55, 0.7, 0.85)


def _clamp(acceptance: float) -> float:
    return min(max(acceptance, 0.0), 1.0)


def expected_tokens(acceptance: float, window: int, later: float | None = None) -> float:
    """E = 1 + a_1 (1 - a^K) / (1 - a): committed tokens per serial window of K drafts, the first
    kept with probability a_1 (``acceptance``), each further one, given the one before it was
    kept, with a (``later``; None: a_1, which gives (1 - a^(K+1)) / (1 - a))."""
    first = _clamp(acceptance)
    a = first if later is None else _clamp(later)
    if a >= 1.0:
        return 1.0 + first * window
    return 1.0 + first * (1.0 - a ** window) / (1.0 - a)


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
        load_min_gain: the speedup that drafts all kept must promise before a request on a chain
            other sessions share takes the speculating path at all (:func:`speculation_pays`):
            min_gain and the plain path's lead, whose steps cost less per token than a
            speculating request's plain steps (2 x 1t Gemma at N = 8: 100.8 against 94.3 tok/s,
            6.9%).
        prior_acceptance: acceptance assumed before any observation.
        prior_weight: pseudo-observations behind the prior.
        halflife: draft outcomes after which an observation's weight halves.
        row_cost_ratio: prior marginal cost of one more row, as a fraction of a one-row step.
        probe_interval: plain steps with a draft between real probe windows while off and no
            window's cost was measured yet.
        refresh_interval: the same once a window's cost was measured (shadow scores keep the
            acceptance current meanwhile; a probe only refreshes the window cost).
        timing_halflife: traversals after which a timing observation's weight halves.
        bet_weight: the bets' prior, in expected kept drafts (realized as expected).
        bet_halflife: bets after which one's weight halves.
        calibrate: plan the first-draft rate at a1 q (the bets' realized over expected kept
            drafts, :class:`BetRecord`); False plans at a1 (the bets are still recorded).
    """

    max_window: int = 8
    max_depth: int = 4
    stages: int = 1
    bottleneck_share: float | None = None
    min_gain: float = 1.03
    load_min_gain: float = 1.10
    prior_acceptance: float = 0.3
    prior_weight: float = 2.0
    halflife: float = 24.0
    row_cost_ratio: float = 0.25
    probe_interval: int = 32
    refresh_interval: int = 256
    timing_halflife: float = 16.0
    bet_weight: float = 2.0
    bet_halflife: float = 16.0
    calibrate: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_window <= 63:
            raise ValueError(f"max_window must be in 1..63 (got {self.max_window})")
        if not 1 <= self.max_depth <= 64:
            raise ValueError(f"max_depth must be in 1..64 (got {self.max_depth})")
        if self.probe_interval < 1 or self.refresh_interval < 1:
            raise ValueError("probe_interval and refresh_interval must be >= 1")
        if (self.stages < 1 or self.min_gain < 1.0 or self.load_min_gain < 1.0 or self.halflife <= 0
                or self.timing_halflife <= 0):
            raise ValueError("stages >= 1, min_gain >= 1, load_min_gain >= 1 and positive half-lives are required")
        if self.bottleneck_share is not None and not 0.0 < self.bottleneck_share <= 1.0:
            raise ValueError(f"bottleneck_share must be in (0, 1] (got {self.bottleneck_share})")
        if not 0.0 <= self.prior_acceptance < 1.0 or self.prior_weight <= 0 or self.row_cost_ratio < 0:
            raise ValueError("invalid acceptance prior or row cost ratio")
        if self.bet_weight <= 0 or self.bet_halflife <= 0:
            raise ValueError("bet_weight and bet_halflife must be positive")


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
class BetRecord:
    """The windows the raw estimates bet on, sent or scored in shadow: discounted expected kept
    drafts (E(K) - 1 at the rates that chose them) against the drafts kept, by band of the raw
    first-draft rate (``_BET_BANDS``): marginal bets (a1 ~0.6, where a loop tends to end) and sure
    ones (a1 > 0.85, a loop under way) keep separate records."""

    weight: float = 2.0
    halflife: float = 16.0
    #: Per band: (expected, kept), discounted.
    bands: list[tuple[float, float]] = field(default_factory=lambda: [(0.0, 0.0)] * (len(_BET_BANDS) + 1))
    bets: int = 0
    #: Plain steps with a draft since the chain's last window (the probes' clock: per chain, so
    #: that short requests still probe every ``refresh_interval`` steps; per request they never did
    #: and a window cost measured under load, adopted by every request, kept windows off for good).
    plain_steps: int = 0

    @staticmethod
    def band(rate: float) -> int:
        return bisect.bisect_right(_BET_BANDS, rate)

    def observe(self, rate: float, expected: float, kept: int) -> None:
        """A bet chosen at first-draft rate ``rate``: ``expected`` kept drafts, ``kept`` kept."""
        if expected <= 0:
            return
        band = self.band(rate)
        decay = 0.5 ** (1.0 / self.halflife)
        old_expected, old_kept = self.bands[band]
        self.bands[band] = (old_expected * decay + expected, old_kept * decay + kept)
        self.bets += 1

    def factor(self, rate: float) -> float:
        """q = min(1, kept / expected) of ``rate``'s band, the prior (``weight`` drafts kept as
        expected) included."""
        expected, kept = self.bands[self.band(rate)]
        return min(1.0, (kept + self.weight) / (expected + self.weight))


@final
@dataclass(slots=True)
class CostModel:
    """Estimates of round-trip overhead and per-row compute (seconds).

    A traversal of n rows computes C(1) = c_1; a window size measured costs the fastest of its last
    _SIZE_SAMPLES windows, and one not measured C(n) = c_1 + c_w + c_row (n - 1):
    on a CPU a batch of two rows can cost far more than one (llama.cpp's F16 matmuls leave the
    one-row vector kernel: 19.4 ms for one row of llama-16x1024, 50.3 ms for 2 and 3, 65 for 4
    and 5, 88 for 9, 140 for 17 rows; bench/RESULTS-stage.md), so a line through c_1 either
    underprices a 2-row window threefold or overprices a 9-row one.  c_w (the window step) and
    c_row come from a least-squares line through the measured sizes' extra compute over c_1
    (x = n - 1 rows, each size weighted by its samples), its slope shrunk towards the prior
    ``row_cost_ratio * c_1`` (weight ``_SLOPE_PRIOR`` in x^2 units) so that windows of one or two
    nearby sizes cannot extrapolate a slope of 0 to large windows; c_w >= 0, and c_row at least
    half the prior unless the windows' own mean says less.  (Patch 0018 made 2 and 3 rows cost
    ~1.2 one-row steps and 9 rows 4.6: a size's own price, not the line, is what fits.)
    """

    row_cost_ratio: float
    halflife: float
    round_trip: float = 0.0
    single_row: float = 0.0
    #: c_row once a window was measured (None: the prior ``row_cost_ratio * c_1``).
    extra_row: float | None = None
    #: c_w, the step from a one-row traversal to any window (0 until a window is measured).
    window_step: float = 0.0
    _seen_round_trip: bool = False
    _seen_single: bool = False
    #: Sums over the sizes' prices (x = rows - 1, y = price - c_1, weighted by samples): w, x, y, xx, xy.
    _sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    #: The last _SIZE_SAMPLES windows' compute (capped, seconds) by rows.
    _sizes: dict[int, list[float]] = field(default_factory=dict)
    #: By rows: the price of a window of that size (the fastest of its last ones in _sizes, at
    #: most a larger size's), and the sizes measured, in order.
    _prices: dict[int, float] = field(default_factory=dict)
    _measured_sizes: list[int] = field(default_factory=list)
    #: By plan kind (1: serial windows, 2: pipelined), discounted: (priced wait, realized wait).
    _waits: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: The bets and the probes' clock, carried with the costs (:meth:`adopt`).
    bets: BetRecord = field(default_factory=BetRecord)
    #: A model measured alone on the same chain: under load, where no window teaches a price,
    #: its window prices relative to its c_1 (:meth:`shared_compute`).
    shape: CostModel | None = None

    def _blend(self, old: float, new: float, seen: bool) -> float:
        """Discounted mean, quick to come down: noise (a stall, a fresh stage's first batches)
        only slows a traversal, so a faster sample is believed at once, a slower one slowly."""
        if not seen:
            return new
        weight = 1.0 - 0.5 ** (1.0 / self.halflife)
        return old + (max(weight, _DOWN_WEIGHT) if new < old else weight) * (new - old)

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
        # One slow sample (a host stall, a fresh stage's first batch of a shape) moves no estimate
        # by more than its weight times the estimate: a sample counts at most _SPIKE times what
        # the model expects (R: R + c_1 more).  Faster samples count in full (noise only slows).
        if alone:
            overhead = max(wall_seconds - compute_seconds, 0.0)
            if self._seen_round_trip and self._seen_single:
                overhead = min(overhead, self.round_trip + self.single_row)
            self.round_trip = self._blend(self.round_trip, overhead, self._seen_round_trip)
            self._seen_round_trip = True
        if rows == 1:
            single = min(compute_seconds, _SPIKE * self.single_row) if self._seen_single else compute_seconds
            self.single_row = self._blend(self.single_row, single, self._seen_single)
            self._seen_single = True
        elif self._seen_single:
            # A window's spike (11.4 s for a 2-row window on a loaded host, once) priced windows
            # out for good: nothing re-measured them.  A size is priced at its fastest recent
            # window, so a slow one counts only while it is the size's only one, and then at most
            # _SPIKE times what the line through the other sizes says (and never more than
            # _WINDOW_SPIKE times its rows' sequential steps).
            compute = min(compute_seconds, _WINDOW_SPIKE * max(rows, 3) * self.single_row)
            if rows not in self._sizes and self._sizes:
                compute = min(compute, _SPIKE * self.compute(rows))
            samples = self._sizes.setdefault(rows, [])
            samples.append(compute)
            del samples[:-_SIZE_SAMPLES]
            self._fit()

    def _fit(self) -> None:
        """Each size's price (its fastest recent window: noise only slows a traversal), and the
        line through the sizes' prices (each weighted by its samples, up to _SIZE_SAMPLES),
        which prices the sizes not measured."""
        w = sx = sy = sxx = sxy = 0.0
        ceiling = float("inf")  # more rows never cost less: a size costs at most any larger one
        for rows in sorted(self._sizes, reverse=True):
            ceiling = self._prices[rows] = min(min(self._sizes[rows]), ceiling)
        self._measured_sizes = sorted(self._sizes)
        for rows, samples in self._sizes.items():
            price = self._prices[rows]
            x, y, weight = rows - 1.0, max(price - self.single_row, 0.0), float(len(samples))
            w, sx, sy = w + weight, sx + weight * x, sy + weight * y
            sxx, sxy = sxx + weight * x * x, sxy + weight * x * y
        self._sums = (w, sx, sy, sxx, sxy)
        if w <= 0:
            return
        mean_x, mean_y = sx / w, sy / w
        spread = sxx - w * mean_x * mean_x  # sum of w (x - mean_x)^2
        covariance = sxy - w * mean_x * mean_y
        prior = self.row_cost_ratio * self.single_row
        slope = (covariance + _SLOPE_PRIOR * prior) / (max(spread, 0.0) + _SLOPE_PRIOR)
        # c_w >= 0 at the windows' mean size; a slope under half the prior is taken for noise
        # (windows measured at different loads), never extrapolated to free rows.
        slope = min(max(slope, 0.5 * prior), mean_y / mean_x)
        self.extra_row = slope
        self.window_step = max(mean_y - slope * mean_x, 0.0)

    def observe_wait(self, kind: int, expected: float, seconds: float) -> None:
        """Record how long the session waited for a window's reply (since the reply before it, or
        its send when later) against the wait the model priced it at: ``kind`` 1 for a serial
        window (L(n)), 2 for a pipelined one (an epoch's first: its arrival; a continuation: the
        interval; a stale one: 0, the model's price of a stale window when the bottleneck has
        room).  A time ratio, so the request's acceptance does not enter it."""
        if seconds < 0 or expected < 0:
            return
        decay = 0.5 ** (1.0 / _REALIZED_HALFLIFE)
        for other, (priced, waited) in self._waits.items():
            self._waits[other] = (priced * decay, waited * decay)
        priced, waited = self._waits.get(kind, (0.0, 0.0))
        self._waits[kind] = (priced + expected, waited + seconds)

    def age(self) -> None:
        """A plain step went by: every kind's record ages, so a kind not chosen any more (its
        record too poor) is forgotten, and tried again, within ~100 steps."""
        decay = 0.5 ** (1.0 / _REALIZED_HALFLIFE)
        for kind, (priced, waited) in self._waits.items():
            self._waits[kind] = (priced * decay, waited * decay)

    def correction(self, kind: int) -> float:
        """Priced over realized waits of a plan kind (1 serial, 2 pipelined), in [0.25, 1]: 1
        until its replies took as long as ``_REALIZED_EVIDENCE`` plain steps.  What the model
        does not see shows here: stages sharing a host's cores (a pipeline that does not
        overlap), a stale window's compute delaying the next epoch, load."""
        priced, waited = self._waits.get(kind, (0.0, 0.0))
        if waited <= 0 or waited < _REALIZED_EVIDENCE * self.latency(1):
            return 1.0
        return min(1.0, max(0.25, priced / waited))

    def adopt(self, other: CostModel) -> None:
        """Start from what another session measured on the same chain alone (R, c_1, the
        windows' line, the realized waits, the bets and the probes' clock); this model's own
        traversals then take over."""
        self.round_trip, self.single_row = other.round_trip, other.single_row
        self.extra_row, self.window_step, self._sums = other.extra_row, other.window_step, other._sums
        self._sizes = {rows: list(samples) for rows, samples in other._sizes.items()}
        self._prices, self._measured_sizes = dict(other._prices), list(other._measured_sizes)
        self._seen_round_trip, self._seen_single = other._seen_round_trip, other._seen_single
        self._waits = dict(other._waits)
        self.bets = dataclasses.replace(other.bets, bands=list(other.bets.bands))

    @property
    def ready(self) -> bool:
        return self._seen_round_trip and self._seen_single

    @property
    def ready_shared(self) -> bool:
        """Enough for the shared rule: c_1 (R is 0 until a traversal alone on the chain shows it)."""
        return self._seen_single

    @property
    def windows_measured(self) -> bool:
        """A window's compute has been seen (the window cost is measured, not only the prior)."""
        return bool(self._sizes)

    @property
    def windows_settled(self) -> bool:
        """Enough windows were measured (_SETTLED_WINDOWS) that probes come every
        ``refresh_interval``, not every ``probe_interval``: a chain whose first window was slow
        (a stall) re-measures soon instead of pricing windows out for hundreds of steps."""
        return sum(len(samples) for samples in self._sizes.values()) >= _SETTLED_WINDOWS

    def compute(self, rows: int) -> float:
        """C(n): c_1; a size measured, its fastest recent window; else the line c_1 + c_w + c_row (n - 1);
        either at most what a larger size measured costs (a slow size otherwise stays priced out:
        traced, a 2-stage chain's 2-row windows at 3 c_1 from its first request, never sent
        again, while 3-row ones cost 1.2 c_1)."""
        if rows <= 1:
            return self.single_row
        price = self._prices.get(rows)
        if price is not None:
            return price
        line = self.single_row + self.window_step + self.row * (rows - 1)
        larger = bisect.bisect_right(self._measured_sizes, rows)  # the nearest larger size measured caps it
        return line if larger == len(self._measured_sizes) else min(line, self._prices[self._measured_sizes[larger]])

    def latency(self, rows: int) -> float:
        return self.round_trip + self.compute(rows)

    def shared_compute(self, rows: int) -> float:
        """C(n) for the shared rule: this model's own price once it measured a window, else the
        price relative to c_1 of :attr:`shape` (a model measured alone on the chain) times c_1."""
        shape = self.shape
        if self._sizes or shape is None or shape.single_row <= 0 or rows <= 1:
            return self.compute(rows)
        return shape.compute(rows) / shape.single_row * self.single_row

    @property
    def row(self) -> float:
        """The marginal compute of one more row in a window (c_row)."""
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
        #: The cost model of the last session that measured a window alone on the chain, by the
        #: chain's stage count (a Generator drives one chain; the count keeps a benchmark's
        #: chains apart): a session that starts alone adopts it (R, c_1 and the windows' line),
        #: so that each request does not pay again for the windows that teach what one costs.
        self.costs: dict[int, CostModel] = {}

    def enter(self, session: object) -> None:
        self._active.add(session)

    def leave(self, session: object) -> None:
        self._active.discard(session)

    @property
    def sessions(self) -> int:
        return len(self._active)


def shared_gain(acceptance: float, window: int, sessions: int, cost: CostModel, later: float | None = None) -> float:
    """Aggregate throughput gain of one serial window of ``window`` drafts for one of ``sessions``
    sessions (see the module header: the others' rows batch, the window is a traversal of its
    own; 1 session: the serial speedup)."""
    sessions = max(1, sessions)
    step = cost.latency(1) + cost.row * (sessions - 1)
    others = cost.single_row + cost.row * (sessions - 2) if sessions >= 2 else 0.0
    with_window = cost.round_trip + others + cost.shared_compute(window + 1)
    committed = sessions - 1 + expected_tokens(acceptance, window, later)
    return committed / sessions * step / max(with_window, 1e-12)


def speculation_pays(load: SessionLoad, config: ControllerConfig) -> bool:
    """Whether a request that starts now, with ``load.sessions`` sessions on the chain (itself
    included), could gain from a window at all: False when even drafts that are all kept give
    every window size a shared gain under ``load_min_gain`` (:func:`shared_gain` at the window prices
    and c_row / c_1 a session measured alone on the chain, ``load.costs``; without one the prior,
    ``row_cost_ratio``, and c_w = 0).  Such a request does not speculate at all: it takes the plain
    path (a decode run, direct return), which costs the stages and the driver less per token than
    a speculating request's plain steps (2 x 1t Gemma at N = 8: 94.3 against 100.8 tok/s), hence
    the margin of ``load_min_gain`` over ``min_gain``: with the costs one such chain measured alone
    (c_1 18.5 ms, c_row 6.5 ms, windows of 2-9 rows 21.7-72.9 ms) kept drafts gain at most 1.19,
    1.10, 1.05, 1.02, 1.00 and 0.99 at S = 3..8: a margin of min_gain alone let requests speculate
    up to S = 5, and in a run whose costs came out noisier at S = 8 (docs/throughput.md, session
    19)."""
    sessions = load.sessions
    if sessions <= 1:
        return True
    alone = load.costs.get(config.stages) or next(reversed(load.costs.values()), None)
    if alone is None or alone.single_row <= 0:
        alone = CostModel(config.row_cost_ratio if load.row_cost_ratio is None else load.row_cost_ratio, 1.0)
        alone.single_row, alone._seen_single = 1.0, True
    return any(shared_gain(1.0, window, sessions, alone) >= config.load_min_gain
               for window in range(1, config.max_window + 1))


def serial_rate(acceptance: float, window: int, cost: CostModel, later: float | None = None) -> float:
    """Expected committed tokens per second with one window of ``window`` drafts at a time."""
    return expected_tokens(acceptance, window, later) / max(cost.latency(window + 1), 1e-12)


def pipelined_rate(acceptance: float, window: int, depth: int, cost: CostModel, bottleneck_share: float,
                   later: float | None = None) -> float:
    """Expected tokens per second streaming windows of ``window + 1`` rows, ``depth`` in flight.

    ``bottleneck_share`` is the slowest stage's fraction of the compute summed over stages;
    ``acceptance`` / ``later``: as in :func:`expected_tokens`.
    """
    if depth <= 1:
        return serial_rate(acceptance, window, cost, later)
    first = min(_clamp(acceptance), _MAX_ACCEPTANCE)
    a = first if later is None else min(_clamp(later), _MAX_ACCEPTANCE)
    rows = window + 1
    arrival, interval = pipelined_waits(window, depth, cost, bottleneck_share)
    # Drafts kept: P(>= j) = a_1 a^(j-1); the epoch's j-th window is used when the first
    # K + (j - 2)(K + 1) drafts were all kept.
    windows = 1.0 + first * a ** (window - 1) / (1.0 - a ** rows)
    tokens = 1.0 + first / (1.0 - a)
    return tokens / max(arrival + (windows - 1.0) * interval, 1e-12)


def _cautious(rate: float, trials: float) -> float:
    """A rate estimated from ``trials`` less one standard error, sqrt(m (1 - m) / trials): a plan
    is chosen on what the drafts surely do, not on two lucky ones (traced on the peer benchmark:
    a bucket with 2 hits of 2 read 0.77 and sent 5-row pipelined windows at acceptance 0.5)."""
    return max(0.0, rate - (rate * (1.0 - rate) / trials) ** 0.5)


def pipelined_waits(window: int, depth: int, cost: CostModel, bottleneck_share: float) -> tuple[float, float]:
    """(an epoch's first reply, each further one) in seconds, streaming windows of ``window + 1``
    rows ``depth`` deep (depth 1: both L(n))."""
    latency = cost.latency(window + 1)
    if depth <= 1:
        return latency, latency
    bottleneck = cost.compute(window + 1) * bottleneck_share
    # Little's law: with `depth` windows queued at a saturated bottleneck, an epoch's first window
    # waits behind the previous epoch's stale windows, so it takes depth * bottleneck, not latency.
    return max(latency, depth * bottleneck), max(latency / depth, bottleneck)


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
    #: Per bucket: drafts after a window's first, given the one before was kept (continuations'
    #: drafts too).
    later: list[AcceptanceEstimator] = field(init=False)
    later_pooled: AcceptanceEstimator = field(init=False)
    #: The last :meth:`plan`'s bet: (drafts, expected kept, raw first-draft rate) of the window the
    #: raw estimates chose (None: they chose a plain step); the decoder scores it, sent or in shadow.
    bet: tuple[int, float, float] | None = None
    #: The sessions the last plan was made for (what :attr:`enabled` weighs).
    _sessions: int = 1

    def __post_init__(self) -> None:
        c = self.config
        self.cost = CostModel(c.row_cost_ratio, c.timing_halflife)
        self.pooled = AcceptanceEstimator(c.prior_acceptance, c.prior_weight, c.halflife)
        self.buckets = [AcceptanceEstimator(c.prior_acceptance, c.prior_weight, c.halflife) for _ in _BUCKETS]
        self.later = [AcceptanceEstimator(c.prior_acceptance, c.prior_weight, c.halflife) for _ in _BUCKETS]
        self.later_pooled = AcceptanceEstimator(c.prior_acceptance, c.prior_weight, c.halflife)
        self.cost.bets = BetRecord(c.bet_weight, c.bet_halflife)

    @property
    def bets(self) -> BetRecord:
        """The windows the raw estimates chose, and what they kept (carried with the costs)."""
        return self.cost.bets

    def calibration(self, rate: float) -> float:
        """q at raw first-draft rate ``rate``, the factor on it (1 when ``calibrate`` is off)."""
        return self.bets.factor(rate) if self.config.calibrate else 1.0

    def expected_kept(self, match_length: int, drafts: int, continuation: bool = False) -> tuple[float, float]:
        """A window's expected kept drafts at the raw rates, E(K) - 1, and its raw first-draft rate
        (a continuation's drafts all follow kept ones: the later rate for its first too)."""
        later = self.later_acceptance(match_length)
        first = later if continuation else self.acceptance(match_length)
        return expected_tokens(first, drafts, later) - 1.0, first

    @property
    def plain_steps_since_window(self) -> int:
        """Plain steps with a draft since the chain's last window (:attr:`BetRecord.plain_steps`)."""
        return self.bets.plain_steps

    @plain_steps_since_window.setter
    def plain_steps_since_window(self, steps: int) -> None:
        self.bets.plain_steps = steps

    @staticmethod
    def bucket_of(match_length: int) -> int:
        for index, upper in enumerate(_BUCKETS):
            if match_length <= upper:
                return index
        return len(_BUCKETS) - 1

    def acceptance(self, match_length: int) -> float:
        """Estimated acceptance of a first draft with this confidence hint (bucket shrunk to
        pooled), less one standard error (:func:`_cautious`)."""
        bucket = self.buckets[self.bucket_of(match_length)]
        weight = self.config.prior_weight
        rate = (bucket.successes + self.pooled.rate * weight) / (bucket.trials + weight)
        # As sure as the bucket's own trials and, through the shrink, the pooled ones'.
        return _cautious(rate, bucket.trials + weight + self.pooled.trials * weight / (bucket.trials + weight))

    def later_acceptance(self, match_length: int) -> float:
        """Estimated acceptance of a further draft given the one before was kept: the bucket's,
        shrunk to the lower of its first-draft rate and the pooled later rate (itself shrunk to
        the pooled first-draft rate): until windows show otherwise one rate for every draft, and
        windows failing past their first draft in any bucket make long windows suspect in all."""
        weight = self.config.prior_weight
        pooled = self.later_pooled
        anchor = min((pooled.successes + self.pooled.rate * weight) / (pooled.trials + weight),
                     self.acceptance(match_length))
        later = self.later[self.bucket_of(match_length)]
        return (later.successes + anchor * weight) / (later.trials + weight)  # (anchor: cautious)

    def observe_outcome(self, match_length: int, accepted: int, judged: int) -> None:
        """Record an epoch-start window's drafts (or a shadow score: ``judged`` = 1): its first
        draft teaches the first-draft rates, the rest (once the first was kept) the later rate."""
        if judged <= 0:
            return
        first = min(accepted, 1)
        self.buckets[self.bucket_of(match_length)].observe(first, 1)
        self.pooled.observe(first, 1)
        if accepted >= 1 and judged >= 2:
            self.observe_later(match_length, accepted - 1, judged - 1)

    def observe_later(self, match_length: int, accepted: int, judged: int) -> None:
        """Record drafts that each followed a kept one (a continuation window's, its boundary
        guess first)."""
        self.later[self.bucket_of(match_length)].observe(accepted, judged)
        self.later_pooled.observe(accepted, judged)

    def observe_traversal(self, rows: int, wall_seconds: float, compute_seconds: float, *,
                          alone: bool = True, shared: bool = False) -> None:
        """Record timing of one reply (``alone``: nothing else of this session was in flight;
        ``shared``: other sessions ran on the chain meanwhile, :meth:`CostModel.observe`)."""
        self.cost.observe(rows, wall_seconds, compute_seconds, alone=alone, shared=shared)

    def best(self, acceptance: float, max_window: int, later: float | None = None,
             max_depth: int | None = None) -> Plan:
        """The best (K, D) for a first-draft acceptance and a later one (None: the same), with
        K <= ``max_window`` (and D <= ``max_depth``, None: the config's)."""
        if max_window < 1 or not self.cost.ready:
            return _PLAIN
        cost = self.cost
        base = 1.0 / max(cost.latency(1), 1e-12)
        best = _PLAIN
        best_rate = base
        correction = cost.correction(2)  # pipelined only: a serial window's cost is measured directly
        share = self.config.bottleneck
        # pipelined_rate for every (K, D), its per-K terms hoisted (a plan per plain step with a
        # draft: the nested calls cost ~0.4 ms of the driver's CPU per token).
        first = min(_clamp(acceptance), _MAX_ACCEPTANCE)
        a = first if later is None else min(_clamp(later), _MAX_ACCEPTANCE)
        tokens = 1.0 + first / (1.0 - a)
        for window in range(1, min(max_window, self.config.max_window) + 1):
            rows = window + 1
            latency = cost.latency(rows)
            bottleneck = cost.compute(rows) * share
            windows = 1.0 + first * a ** (window - 1) / (1.0 - a ** rows)
            for depth in range(1, (self.config.max_depth if max_depth is None else max_depth) + 1):
                if depth == 1:
                    rate = expected_tokens(acceptance, window, later) / max(latency, 1e-12)
                else:
                    arrival, interval = max(latency, depth * bottleneck), max(latency / depth, bottleneck)
                    rate = tokens / max(arrival + (windows - 1.0) * interval, 1e-12) * correction
                if rate > best_rate * (1.0 + 1e-9):
                    best, best_rate = Plan(window, depth, rate / base), rate
        return best

    def continuation_plan(self, match_length: int, current: Plan) -> Plan:
        """(K, D) for the next continuation window of a pipelined epoch: its drafts all follow
        kept ones, so both rates are the later one.  A plan of depth 1 (or none) ends the
        epoch's pipelining; otherwise the best pipelined plan (``current`` if none pays)."""
        later = self.later_acceptance(match_length)
        fresh = self.best(later * self.calibration(later), self.config.max_window, later)
        if fresh.window and fresh.speedup >= self.config.min_gain:
            return fresh if fresh.depth >= 2 else Plan(current.window, 1, fresh.speedup)
        return Plan(current.window, 1, fresh.speedup)

    def best_shared(self, acceptance: float, max_window: int, sessions: int, later: float | None = None) -> Plan:
        """The best serial window for one of ``sessions`` >= 2 sessions (``speedup``: the
        aggregate gain, :func:`shared_gain`)."""
        if max_window < 1 or not self.cost.ready_shared:
            return _PLAIN
        best = _PLAIN
        for window in range(1, min(max_window, self.config.max_window) + 1):
            gain = shared_gain(acceptance, window, sessions, self.cost, later)
            if gain > best.speedup * (1.0 + 1e-9):
                best = Plan(window, 1, gain)
        return best

    def plan(self, draft_length: int, match_length: int, sessions: int = 1) -> Plan:
        """The plan for an epoch whose proposer offers ``draft_length`` drafts, with ``sessions``
        sessions (this one included) running on the chain.

        Returns:
            ``window == 0`` for a plain decode step.
        """
        self.bet = None
        if draft_length <= 0:
            return _PLAIN
        first, later = self.acceptance(match_length), self.later_acceptance(match_length)
        q = self.calibration(first)
        if sessions >= 2:  # the others pay for this session's drafts: weigh the aggregate
            raw = self.best_shared(first, draft_length, sessions, later)
            choice = raw if q >= 1.0 or not raw.window else self.best_shared(first * q, draft_length, sessions, later)
            self._sessions = sessions
            if raw.window and raw.speedup >= self.config.min_gain:
                self.bet = (raw.window, expected_tokens(first, raw.window, later) - 1.0, first)
            if choice.window and choice.speedup >= self.config.min_gain:
                self.plain_steps_since_window = 0
                return choice
            return _PLAIN
        if not self.cost.ready:
            return _PLAIN  # the first plain steps measure R and c_1
        raw = self.best(first, draft_length, later)
        choice = raw if q >= 1.0 or not raw.window else self.best(first * q, draft_length, later)
        if choice.depth >= 2 and self.continuation_plan(match_length, choice).depth < 2:
            # Priced as the start of a pipelined epoch whose continuations would not be sent
            # (they are re-planned on the later rate, its own band's q): a serial window then.
            choice = self.best(first * min(q, 1.0), draft_length, later, max_depth=1)
        self._sessions = 1
        if raw.window and raw.speedup >= self.config.min_gain:
            self.bet = (raw.window, expected_tokens(first, raw.window, later) - 1.0, first)
        if choice.window and choice.speedup >= self.config.min_gain:
            self.plain_steps_since_window = 0
            return choice
        self.plain_steps_since_window += 1
        interval = self.config.refresh_interval if self.cost.windows_settled else self.config.probe_interval
        if self.plain_steps_since_window >= interval:
            self.plain_steps_since_window = 0
            return Plan(min(2, draft_length), 1, choice.speedup, probe=True)
        return _PLAIN

    @property
    def enabled(self) -> bool:
        """Whether the pooled estimate would speculate now (for the sessions of the last plan;
        computed when asked: a plan per step does not pay for it)."""
        if self._sessions >= 2:
            return (self.best_shared(self.pooled.rate * self.calibration(self.pooled.rate), self.config.max_window,
                                     self._sessions).speedup >= self.config.min_gain)
        return self.cost.ready and self.expected_speedup() >= self.config.min_gain

    def expected_speedup(self) -> float:
        """The pooled estimate's best expected speedup, bets' calibration included (1.0 when off
        or not yet measured)."""
        return self.best(self.pooled.rate * self.calibration(self.pooled.rate), self.config.max_window).speedup
