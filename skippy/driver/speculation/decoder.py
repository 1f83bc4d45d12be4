# The per-request speculative decoder the Generator drives: proposer + controller + window FIFO.
#
# Strategy: sans-IO.  The Generator asks `next_window()` for messages to send until it returns
# None, sends each (a plain DecodeEmbd when `request.is_decode`, else a VerifyWindow with
# `seq_id = window_id` at `base_position`), then feeds every reply, in arrival order, to
# `on_reply()`, which returns the newly committed tokens and the authoritative position.  The
# decoder never blocks, reads clocks or touches sockets; timings come in with the replies.
#
# * Epoch start (no live window): propose up to K drafts from the committed history; the
#   controller picks (K, D) or a plain step, weighing the other sessions on the chain (`load`):
#   with others, serial windows only, priced as traversals of their own, and a pipelined epoch
#   under way sends no more continuations.
#   A plain step with a draft available is scored in shadow (its first draft against the token
#   the chain returns), so acceptance keeps being measured while speculation is off.
# * Pipelining: while fewer than D live windows are in flight, propose K + 1 more drafts from the
#   optimistic tail (drafts in flight, never indexed) and send them as a continuation window; (K, D)
#   are re-planned for each on the later-draft acceptance (an epoch of a loop never ends, so a
#   plan fixed at its start would keep its first, least informed, window size for good).
# * Slow start: after a rejection past a kept drafts the next window carries at most 2a + 1
#   (a run kept whole doubles the cap), unless its extra compute is at most a plain step's.
# * Each window's drafts are bounded so the committed count cannot pass `max_tokens`.
# * Bets (`BetRecord`, carried from request to request with the cost model): every window sent
#   is scored, its expected kept drafts at the raw rates against those kept (a stale window, or a
#   continuation whose boundary guess missed: 0, its compute spent for nothing); a plain step the
#   raw estimates would have made a window scores that window in shadow, its first K shadow drafts
#   against the plain steps' tokens.
# * Idle epochs (`idle`): plain steps in a row for which the proposer offered no draft at all.
#   The Generator ends speculation after `IDLE_STEPS` of them on a lone request and decodes on as
#   a plain request (a decode run or direct return, cheaper per token than plain steps); it then
#   feeds the tokens it decodes to `follow()` (the proposer grows, shadow drafts are scored as
#   plain steps score them) and asks `wants_window()` at each token whether a window would go now
#   (docs/throughput.md, "A lone request whose drafts do not come").
#   A draft the controller declines does not count: it is scored in shadow, and that is how a
#   loop starts (the prior declines a loop's first drafts until a few are scored).
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, final

from skippy.driver.speculation.acceptance import Verdict, accept_tokens
from skippy.driver.speculation.controller import (
    ControllerConfig,
    Plan,
    SessionLoad,
    SpeculationController,
    pipelined_waits,
)
from skippy.driver.speculation.proposer import NO_DRAFT, Draft, NgramProposer
from skippy.driver.speculation.window import (
    MAX_WINDOWS_IN_FLIGHT,
    SpeculationUsage,
    WindowId,
    WindowOutcome,
    WindowTracker,
)

__all__ = ["SpeculationConfig", "SpeculativeDecoder", "WindowRequest"]


#: Plain steps in a row with no draft after which a lone request stops speculating and decodes on
#: as a plain request (module header): each costs the driver's round trip more than a decode run's
#: step, and leaving costs nothing (speculation comes back at the next run's end for free), so the
#: count only lets a request's first drafts arrive.
IDLE_STEPS = 8
#: Tokens in a row that confirmed a shadow draft's next token before a request that stopped
#: speculating ends its decode run mid-way to speculate again (`SpeculativeDecoder.wants_window`):
#: ending a run throws away the step(s) the first stage had started (about one) and waits for a
#: TrimSession's round trip, which one window rarely repays, while a loop that confirmed two drafts
#: in a row usually goes on (Gemma 3's stretches of hits run 5-12 tokens; the generated llama's
#: text confirms two in a row almost only inside such loops).
RESUME_HITS = 2
#: A request that stopped speculating decodes in runs of RUN_CHUNK_MIN tokens, doubling up to
#: RUN_CHUNK_MAX: at a run's end the session holds the plain loop's KV and nothing is in flight,
#: so speculation comes back there for any window the controller would send, at no cost; each
#: run's start costs one driver round trip (1/8 to 1/64 of what plain steps cost per token).
RUN_CHUNK_MIN = 8
RUN_CHUNK_MAX = 64


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """Per-request speculation settings.

    Attributes:
        enabled: False sends plain decode steps only (the per-request opt-out).
        n_min: shortest suffix n-gram the proposer matches.
        n_max: longest suffix n-gram the proposer looks up.
        controller: window / depth control.
    """

    enabled: bool = True
    n_min: int = 2
    n_max: int = 12
    controller: ControllerConfig = ControllerConfig()


@dataclass(frozen=True, slots=True)
class WindowRequest:
    """One message to send.

    Attributes:
        window_id: VerifyWindow ``seq_id`` (pass it back to ``on_reply`` for plain steps too).
        base_position: the message's ``pos_start`` (authoritative position).
        tokens: the tokens to send.
        is_decode: a single committed token: send DecodeEmbd (PredictedToken reply).
    """

    window_id: WindowId
    base_position: int
    tokens: tuple[int, ...]
    is_decode: bool


@final
class SpeculativeDecoder:
    """Drafts, windows and acceptance for one request, after its prefill."""

    def __init__(self, prompt: Sequence[int], first_token: int, *, config: SpeculationConfig = SpeculationConfig(),
                 max_tokens: int | None = None, load: SessionLoad | None = None) -> None:
        """Args:
            prompt: the prompt tokens (already prefilled on every stage).
            first_token: the token the prefill reply predicted (committed, position len(prompt)).
            config: speculation settings.
            max_tokens: generated tokens wanted in total (first_token included); None: unbounded.
            load: the sessions running on the chain (None: this one alone); the controller
                weighs what a window costs the others by it.
        """
        self.config = config
        self.load = load
        self.max_tokens = max_tokens
        self.proposer = NgramProposer(prompt, n_min=config.n_min, n_max=config.n_max)
        self.proposer.append(first_token)
        self.controller = SpeculationController(config.controller)
        self.tracker = WindowTracker(int(first_token), len(prompt))
        self.generated: list[int] = [int(first_token)]
        self._plan = Plan(0, 1, 1.0)
        self._shadow: Draft = NO_DRAFT  # the draft plain steps are scoring, token by token
        self._shadow_kept = 0  # its drafts the plain steps confirmed so far
        self._alone: dict[int, bool] = {}
        self._shared: dict[int, bool] = {}  # other sessions ran on the chain when it was sent
        self._adopted = False  # an epoch alone on the chain looked at its shared cost model
        #: Most drafts the next window may carry ("slow start"): 2 a + 1 after a rejection past a
        #: kept drafts, twice a run that was kept whole; so a loop that breaks costs one long
        #: window, not one per epoch until the estimates catch up (the peer benchmark's stream).
        #: Windows whose extra compute is at most a plain step's latency are never capped.
        self._cap = config.controller.max_window
        self._kind: dict[int, tuple[int, float]] = {}  # plan kind (0 plain, 1 serial, 2 pipelined), priced wait
        self._bets: dict[int, tuple[float, float]] = {}  # by window id: expected kept drafts, raw first rate
        self._shadow_bet: tuple[int, float, float] | None = None  # the shadow draft's bet (`SpeculationController.bet`)
        #: Plain steps in a row with no draft (module header: idle epochs).
        self.idle = 0
        #: The draft and plan :meth:`wants_window` accepted: the next epoch's.
        self._wanted: tuple[Draft, Plan] | None = None
        #: Tokens :meth:`follow` got in a row that confirmed the shadow draft's next token.
        self.hits = 0

    def restart(self, pending_position: int) -> None:
        """Forget the windows in flight (their lane is gone, docs/protocol.md §14): the next
        window starts at ``pending_position`` with the last committed token; the drafts, the
        controller's estimates and the counters go on."""
        old = self.tracker
        self.tracker = WindowTracker(self.generated[-1], pending_position, old.usage)
        self.tracker._next_id = old._next_id  # ids stay unique over the request
        self._alone.clear()
        self._shared.clear()
        self._kind.clear()
        self._bets.clear()
        self._shadow = NO_DRAFT
        self._shadow_kept = 0
        self._shadow_bet = None

    def _grow(self, kept: int, judged: int) -> None:
        """Move the window cap on drafts judged (a window's, or a shadow draft's by plain steps)."""
        if kept < judged:
            self._cap = 2 * kept + 1
        else:
            self._cap = min(self.controller.config.max_window, max(self._cap, 2 * kept))

    def _window_cap(self) -> int:
        cost = self.controller.cost
        cap = self._cap
        if cost.ready:
            limit = cost.latency(1) + cost.compute(1)
            while cap < self.controller.config.max_window and cost.compute(cap + 2) <= limit:
                cap += 1
        return cap

    def _sessions(self) -> int:
        return 1 if self.load is None else max(1, self.load.sessions)

    @property
    def usage(self) -> SpeculationUsage:
        return self.tracker.usage

    @property
    def kv_length(self) -> int:
        """Positions whose KV is valid on every stage once in-flight windows drain (trim target)."""
        return self.tracker.pending_position

    @property
    def done(self) -> bool:
        return self.max_tokens is not None and len(self.generated) >= self.max_tokens

    def _budget(self) -> int:
        """Drafts that may still be sent (beyond what is in flight) without passing max_tokens."""
        if self.max_tokens is None:
            return self.controller.config.max_window * self.controller.config.max_depth
        return self.max_tokens - len(self.generated) - len(self.tracker.optimistic_tail) - 1

    def next_window(self) -> WindowRequest | None:
        """The next message to send now, or None (wait for a reply, or done)."""
        if self.done or self.tracker.in_flight >= MAX_WINDOWS_IN_FLIGHT:
            return None
        tracker = self.tracker
        live = tracker.live
        if not live:
            budget = self._budget()
            draft = NO_DRAFT
            wanted, self._wanted = self._wanted, None
            if wanted is not None:  # the epoch `wants_window` planned (its plan is not made twice)
                draft = wanted[0]
            elif self.config.enabled and budget > 0:
                draft = self.proposer.propose(min(budget, self.controller.config.max_window, self._window_cap()))
            sessions = self._sessions()
            cost = self.controller.cost
            if sessions >= 2 and self.load is not None:  # what windows cost, from a session alone on the chain
                if cost.extra_row is None and self.load.row_cost_ratio is not None:
                    cost.row_cost_ratio = self.load.row_cost_ratio
                alone = self.load.costs.get(self.controller.config.stages)
                if alone is not cost:
                    cost.shape = alone
            elif sessions == 1 and not self._adopted and self.load is not None:
                # a session alone (from its start, or once the others left) takes what a window
                # costs on this chain, measured alone before
                self._adopted = True
                measured = self.load.costs.get(self.controller.config.stages)
                if measured is not None and measured is not cost and not cost.windows_measured:
                    cost.adopt(measured)
            if wanted is not None:
                self._plan = wanted[1]
            else:
                self._plan = (self.controller.plan(len(draft), draft.match_length, sessions) if draft.tokens
                              else Plan(0, 1, 1.0))
            drafts = draft.tokens[:self._plan.window]
            if drafts or not self._shadow.tokens:  # a window scores itself; else keep scoring
                self._shadow, self._shadow_kept = (NO_DRAFT if drafts else draft), 0
                self._shadow_bet = self.controller.bet if draft.tokens and not drafts else None
            self.idle = 0 if draft.tokens else self.idle + 1
            window = tracker.open_epoch(drafts, match_length=draft.match_length)
            if drafts:
                self._bets[window.id] = self.controller.expected_kept(draft.match_length, len(drafts))
            self._alone[window.id] = tracker.in_flight == 1
            self._shared[window.id] = sessions >= 2
            if drafts:
                arrival, _ = pipelined_waits(len(drafts), self._plan.depth, cost, self.controller.config.bottleneck)
                self._kind[window.id] = (1 if self._plan.depth == 1 else 2, arrival)
            else:
                self._kind[window.id] = (0, 0.0)
            return WindowRequest(window.id, window.base_position, window.inputs, not drafts)
        if self._plan.window == 0 or len(live) >= self._plan.depth or self._sessions() >= 2:
            return None  # (with other sessions on the chain a pipelined epoch ends with what is in flight)
        if self._plan.depth >= 2:  # every draft of a continuation follows kept ones: re-plan on that
            self._plan = self.controller.continuation_plan(live[-1].match_length, self._plan)
            if len(live) >= self._plan.depth:
                return None  # pipelining no longer pays: the epoch ends with the windows in flight
        budget = min(self._budget(), self._plan.window + 1, self._window_cap() + 1)
        if budget <= 0:
            return None
        draft = self.proposer.propose(budget, tail=tracker.optimistic_tail)
        if not draft.tokens:
            return None
        window = tracker.open_continuation(draft.tokens, match_length=draft.match_length)
        self._bets[window.id] = self.controller.expected_kept(draft.match_length, len(draft.tokens), True)
        self._alone[window.id] = False
        self._shared[window.id] = self._sessions() >= 2
        _, interval = pipelined_waits(len(window.inputs) - 1, max(2, self._plan.depth), self.controller.cost,
                                      self.controller.config.bottleneck)
        self._kind[window.id] = (2, interval)
        return WindowRequest(window.id, window.base_position, window.inputs, False)

    def on_reply(self, window_id: int, predicted: Sequence[int], *, wall_seconds: float | None = None,
                 compute_seconds: float | None = None, verdict: Verdict | None = None,
                 interval_seconds: float | None = None) -> WindowOutcome:
        """Process one reply (PredictedTokens, or PredictedToken for a plain step).

        Args:
            window_id: the reply's window id (for a plain step, the request's ``window_id``).
            predicted: the target's token per input row.
            wall_seconds: send-to-reply time, for the cost model.
            compute_seconds: compute summed over stages (reply stats), for the cost model.
            verdict: a verdict computed elsewhere (e.g. from logits); default exact match.
            interval_seconds: how long the session waited for this reply (since the reply before
                it, or its send when later), against the wait the model priced it at
                (:meth:`CostModel.observe_wait`).

        Returns:
            The outcome: ``tokens`` are newly committed, in order.

        Raises:
            WindowError: unknown id, out-of-order reply, or a wrong prediction count.
        """
        tracker = self.tracker
        window = tracker.take_reply(window_id, len(predicted))
        alone = self._alone.pop(window.id, False)
        shared = self._shared.pop(window.id, False) or self._sessions() >= 2  # others at send or now
        kind, priced = self._kind.pop(window.id, (0, 0.0))
        bet = self._bets.pop(window.id, None)
        if window.epoch != tracker.epoch and bet is not None:
            self.controller.bets.observe(bet[1], bet[0], 0)  # a stale window's compute was spent for nothing
        if interval_seconds is not None and not shared:
            if kind == 0:
                self.controller.cost.age()
            elif kind == 2:  # a stale window is priced at 0: the model counts it free while the bottleneck has room
                self.controller.cost.observe_wait(kind, 0.0 if window.epoch != tracker.epoch else priced,
                                                  interval_seconds)
        if wall_seconds is not None and compute_seconds is not None:
            self.controller.observe_traversal(len(window.inputs), wall_seconds, compute_seconds, alone=alone,
                                              shared=shared)
            cost = self.controller.cost
            if not shared and self.load is not None and cost.windows_measured and cost.single_row > 0:
                if cost.extra_row is not None:
                    self.load.row_cost_ratio = cost.extra_row / cost.single_row
                self.load.costs[self.controller.config.stages] = cost
        if window.epoch != tracker.epoch:  # stale: drained and counted, never emitted
            return tracker.commit(window, Verdict(0, (int(predicted[0]),)))
        following = tracker.live
        if verdict is None:
            verdict = accept_tokens(window.inputs[1:], predicted)
        outcome = tracker.commit(window, verdict)
        bets = self.controller.bets
        if bet is not None:
            bets.observe(bet[1], bet[0], outcome.accepted)
        if outcome.diverged and following and outcome.accepted == outcome.proposed:
            missed = self._bets.pop(following[0].id, None)  # its boundary guess missed: nothing kept
            if missed is not None:
                bets.observe(missed[1], missed[0], 0)
        if window.drafts:
            self._grow(outcome.accepted, outcome.proposed)
            if window.continuation:  # every draft followed a kept one
                self.controller.observe_later(window.match_length, outcome.accepted, outcome.proposed)
            else:
                self.controller.observe_outcome(window.match_length, outcome.accepted, outcome.proposed)
            if outcome.diverged and following and outcome.accepted == outcome.proposed:
                self.controller.observe_later(following[0].match_length, 0, 1)  # its boundary guess missed
        elif self._shadow.tokens:  # a plain step: its token judges the shadow draft's next one
            self._score_shadow(outcome.tokens[0])
        room = len(outcome.tokens) if self.max_tokens is None else self.max_tokens - len(self.generated)
        self.generated.extend(outcome.tokens[:room])
        self.proposer.extend(outcome.tokens)
        return outcome

    def _score_shadow(self, token: int) -> None:
        """A plain step's ``token`` judges the shadow draft's next token."""
        shadow = self._shadow
        hit = int(shadow.tokens[self._shadow_kept] == token)
        if self._shadow_kept == 0:
            self.controller.observe_outcome(shadow.match_length, hit, 1)
        else:  # the drafts before it were kept
            self.controller.observe_later(shadow.match_length, hit, 1)
        self._shadow_kept += hit
        if self._shadow_bet is not None and (not hit or self._shadow_kept >= self._shadow_bet[0]):
            drafts, expected, rate = self._shadow_bet
            self.controller.bets.observe(rate, expected, min(self._shadow_kept, drafts))
            self._shadow_bet = None  # the declined window is judged
        if not hit or self._shadow_kept == len(shadow.tokens):
            self._grow(self._shadow_kept, self._shadow_kept + 1 - hit)
            self._shadow, self._shadow_kept = NO_DRAFT, 0
            self._shadow_bet = None

    # -- a request that stopped speculating (module header: idle epochs) ------------------------
    def follow(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` decoded without windows (a decode run, direct return), in order, as
        plain steps' replies: the proposer grows by them and they score the shadow draft.  Only
        with nothing in flight (the runner finished)."""
        if self.tracker.in_flight:
            raise ValueError("follow() with windows in flight")
        if tokens:
            self._wanted = None
        for token in tokens:
            if self.done:
                break
            if self._shadow.tokens:
                scored = self._shadow.tokens[self._shadow_kept]
                self._score_shadow(int(token))
                self.hits = self.hits + 1 if scored == int(token) else 0
            else:
                self.hits = 0
            self.controller.cost.age()
            self.generated.append(int(token))
            self.proposer.append(int(token))

    def wants_window(self, mid_run: bool = True) -> bool:
        """Whether the next epoch would send a window: this session alone on the chain, a draft,
        and a plan with a window.  ``mid_run`` (a decode run would have to be ended for it): only a
        plan that is not a probe (a probe measures a window's cost; the window that ends the run
        measures it as well), after :data:`RESUME_HITS` tokens in a row confirmed a shadow draft;
        else (at the end of a decode run, or with direct return: speculating again costs nothing
        there) any window the controller would send.  When it would, that epoch is the next one
        :meth:`next_window` opens (after :meth:`restart`); otherwise the step is planned as a plain
        step is (the draft, if any, scored in shadow by the next tokens :meth:`follow` gets)."""
        budget = self._budget() if not self.done else 0
        if not self.config.enabled or budget <= 0 or self._sessions() >= 2:
            return False
        draft = self.proposer.propose(min(budget, self.controller.config.max_window, self._window_cap()))
        plan = self.controller.plan(len(draft), draft.match_length, 1) if draft.tokens else Plan(0, 1, 1.0)
        if plan.window and (not mid_run or (not plan.probe and self.hits >= RESUME_HITS)):
            self._wanted = (draft, plan)
            return True
        if not self._shadow.tokens:
            self._shadow, self._shadow_kept = draft, 0
            self._shadow_bet = self.controller.bet if draft.tokens else None
        return False
