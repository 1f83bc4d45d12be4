"""Acceptance rules: greedy cases, sampling transforms, and statistical exactness of the sampled rule.

Statistical tests use a fixed seed, so they are deterministic; the thresholds are nonetheless set so
that a correct rule would fail with probability < 1e-9 per check (< 1e-7 over the module) under any
seed: a check fails only when the chi-square p-value is below ``ALPHA = 1e-9``.  Sample sizes give
power: the deliberately wrong rules below reach p-values far below ALPHA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from skippy.driver.speculation import (
    Verdict,
    accept_greedy,
    accept_point_mass,
    accept_point_mass_batch,
    accept_speculative,
    accept_tokens,
    residual_distribution,
    target_probabilities,
)

ALPHA = 1e-9


def regularized_gamma_q(s: float, x: float) -> float:
    """Q(s, x) = Gamma(s, x) / Gamma(s) (series for x < s + 1, else Lentz continued fraction)."""
    if x <= 0:
        return 1.0
    log_prefix = -x + s * math.log(x) - math.lgamma(s)
    if x < s + 1:
        term = total = 1.0 / s
        a = s
        for _ in range(10_000):
            a += 1
            term *= x / a
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - s
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - s)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h


def chi_square_p_value(counts: np.ndarray, expected_probabilities: np.ndarray) -> float:
    """p-value of Pearson's test; cells of probability 0 must be empty (else p = 0)."""
    counts = counts.ravel().astype(np.float64)
    probabilities = expected_probabilities.ravel()
    if counts[probabilities == 0].sum() > 0:
        return 0.0
    support = probabilities > 0
    expected = probabilities[support] * counts.sum()
    statistic = float((((counts[support] - expected) ** 2) / expected).sum())
    return regularized_gamma_q((support.sum() - 1) / 2.0, statistic / 2.0)


def test_chi_square_helper() -> None:
    assert regularized_gamma_q(1.0, 2.0) == pytest.approx(math.exp(-2.0), rel=1e-12)
    assert regularized_gamma_q(2.5, 1.0) == pytest.approx(0.8491450, rel=1e-6)  # chi2 sf(2, df=5)
    assert regularized_gamma_q(2.5, 10.0) == pytest.approx(0.0012497, rel=1e-4)  # chi2 sf(20, df=5)


# ---------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(("drafts", "predicted", "accepted", "tokens"), [
    ([], [7], 0, (7,)),
    ([1, 2, 3], [1, 2, 3, 4], 3, (1, 2, 3, 4)),
    ([1, 2, 3], [1, 9, 3, 4], 1, (1, 9)),
    ([1, 2, 3], [5, 2, 3, 4], 0, (5,)),
    ([1, 2, 3], [1, 2, 8, 4], 2, (1, 2, 8)),
])
def test_accept_tokens(drafts: list[int], predicted: list[int], accepted: int, tokens: tuple[int, ...]) -> None:
    assert accept_tokens(drafts, predicted) == Verdict(accepted, tokens)


def test_accept_tokens_needs_one_more_row() -> None:
    with pytest.raises(ValueError, match="needs 3 target rows"):
        accept_tokens([1, 2], [1, 2])


def test_accept_greedy_from_logits() -> None:
    logits = np.full((3, 5), -1.0)
    logits[0, 4] = 2.0
    logits[1, 1] = 2.0
    logits[2, 3] = 2.0
    assert accept_greedy([4, 2], logits) == Verdict(1, (4, 1))
    assert accept_greedy([4, 1], logits).tokens == (4, 1, 3)
    with pytest.raises(ValueError):
        accept_greedy([4], logits[0])


# ------------------------------------------------------------------------------------ transforms


@dataclass(frozen=True)
class Settings:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()


LOGITS = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))


def test_transforms() -> None:
    np.testing.assert_allclose(target_probabilities(LOGITS, Settings()), np.exp(LOGITS), rtol=1e-12)
    assert target_probabilities(LOGITS, Settings(temperature=0.0)).tolist() == [1, 0, 0, 0, 0]
    np.testing.assert_allclose(target_probabilities(LOGITS, Settings(top_k=2)), [4 / 7, 3 / 7, 0, 0, 0])
    np.testing.assert_allclose(target_probabilities(LOGITS, Settings(top_p=0.7)), [4 / 7, 3 / 7, 0, 0, 0])
    np.testing.assert_allclose(target_probabilities(LOGITS, Settings(top_p=0.71)), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])
    np.testing.assert_allclose(target_probabilities(LOGITS, Settings(min_p=0.3)), [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])
    hot = target_probabilities(LOGITS, Settings(temperature=0.5))
    np.testing.assert_allclose(hot, np.array([0.4, 0.3, 0.15, 0.1, 0.05]) ** 2 / (np.array([0.4, 0.3, 0.15, 0.1, 0.05]) ** 2).sum())
    biased = target_probabilities(LOGITS, Settings(temperature=0.0, logit_bias=((4, 10.0),)))
    assert biased.tolist() == [0, 0, 0, 0, 1]
    rows = target_probabilities(np.stack([LOGITS, LOGITS[::-1]]), Settings(top_k=1))
    assert rows.tolist() == [[1, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        target_probabilities(LOGITS, Settings(logit_bias=((9, 1.0),)))


def test_residual() -> None:
    np.testing.assert_allclose(residual_distribution([0.5, 0.25, 0.25], 0), [0, 0.5, 0.5])
    with pytest.raises(ValueError, match="residual is empty"):
        residual_distribution([0.0, 1.0], 1)


# ---------------------------------------------------------------------- sampled: distributional

#: (p, draft): uniform, peaked on the draft, peaked elsewhere, draft impossible, draft certain,
#: sparse support.
SHAPES = [
    (np.full(6, 1 / 6), 2),
    (np.array([0.05, 0.05, 0.7, 0.1, 0.05, 0.05]), 2),
    (np.array([0.6, 0.1, 0.05, 0.1, 0.1, 0.05]), 2),
    (np.array([0.3, 0.2, 0.0, 0.2, 0.2, 0.1]), 2),
    (np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), 2),
    (np.array([0.5, 0.0, 0.25, 0.0, 0.25, 0.0]), 4),
]


def first_token(drafts: np.ndarray, accepted: np.ndarray, next_token: np.ndarray) -> np.ndarray:
    return np.where(accepted >= 1, drafts[:, 0], next_token)


@pytest.mark.parametrize(("p", "draft"), SHAPES)
def test_point_mass_rule_reproduces_target(p: np.ndarray, draft: int) -> None:
    rng = np.random.default_rng(1234)
    trials = 60_000
    drafts = np.full((trials, 1), draft)
    rows = np.broadcast_to(np.stack([p, np.full(6, 1 / 6)]), (trials, 2, 6))
    accepted, next_token = accept_point_mass_batch(drafts, rows, rng)
    counts = np.bincount(first_token(drafts, accepted, next_token), minlength=6)
    assert chi_square_p_value(counts, p) > ALPHA
    assert abs(accepted.mean() - p[draft]) < 6 * math.sqrt(0.25 / trials)


def conditional_tables(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    p0 = rng.dirichlet(np.full(vocab, 0.7))
    p1 = rng.dirichlet(np.full(vocab, 0.7), size=vocab)  # p1[y1] = law of y2 given y1
    return p0, p1


def joint_counts(p0: np.ndarray, p1: np.ndarray, drafts: tuple[int, int], rule: str,
                 rng: np.random.Generator, trials: int) -> np.ndarray:
    """Sample (y1, y2) by windows of two drafts, continuing with a fresh step after a rejection."""
    vocab = len(p0)
    d1, d2 = drafts
    rows = np.broadcast_to(np.stack([p0, p1[d1], np.full(vocab, 1 / vocab)]), (trials, 3, vocab))
    draft_array = np.broadcast_to(np.array([d1, d2]), (trials, 2))
    if rule == "point-mass":
        accepted, next_token = accept_point_mass_batch(draft_array, rows, rng)
    else:  # the stage samples every row independently; the driver matches exactly
        cumulative = np.cumsum(rows, axis=2)
        sampled = (cumulative <= rng.random((trials, 3, 1))).sum(axis=2)
        match = sampled[:, :2] == draft_array
        accepted = np.where(~match[:, 0], 0, np.where(~match[:, 1], 1, 2))
        next_token = sampled[np.arange(trials), accepted]
    y1 = np.where(accepted >= 1, d1, next_token)
    fresh = (np.cumsum(p1[y1], axis=1) <= rng.random((trials, 1))).sum(axis=1)
    y2 = np.where(accepted >= 2, d2, np.where(accepted == 1, next_token, fresh))
    return np.bincount(y1 * vocab + y2, minlength=vocab * vocab)


@pytest.mark.parametrize("rule", ["point-mass", "stage-sampled"])
@pytest.mark.parametrize("seed", [11, 12])
def test_two_position_joint_distribution(rule: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    p0, p1 = conditional_tables(rng, 4)
    drafts = (int(np.argmax(p0)), int(np.argmax(p1[np.argmax(p0)])))  # plausible drafts
    counts = joint_counts(p0, p1, drafts, rule, rng, 120_000)
    assert chi_square_p_value(counts, p0[:, None] * p1) > ALPHA


def test_wrong_rules_are_detected() -> None:
    """Power: resampling from p (not the residual) or always accepting is caught."""
    rng = np.random.default_rng(99)
    p = np.array([0.05, 0.05, 0.7, 0.1, 0.05, 0.05])
    trials = 60_000
    accept = rng.random(trials) < p[2]
    resampled = (np.cumsum(p) <= rng.random((trials, 1))).sum(axis=1)
    wrong = np.where(accept, 2, resampled)  # forgot to remove the draft from the residual
    assert chi_square_p_value(np.bincount(wrong, minlength=6), p) < 1e-12
    always = np.full(trials, 2)
    assert chi_square_p_value(np.bincount(always, minlength=6), p) < 1e-12


@pytest.mark.slow
def test_general_draft_distribution() -> None:
    rng = np.random.default_rng(5)
    p = np.array([0.1, 0.4, 0.2, 0.3])
    q = np.array([0.4, 0.1, 0.4, 0.1])
    trials = 30_000
    firsts = np.empty(trials, dtype=np.int64)
    target = np.stack([p, p])
    for trial in range(trials):
        draft = int((np.cumsum(q) <= rng.random()).sum())
        firsts[trial] = accept_speculative([draft], target, q[None], rng).tokens[0]
    assert chi_square_p_value(np.bincount(firsts, minlength=4), p) > ALPHA


def test_scalar_point_mass_rule() -> None:
    rng = np.random.default_rng(3)
    rows = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_point_mass([1, 2], rows, rng) == Verdict(2, (1, 2, 0))
    assert accept_point_mass([1, 0], rows, rng) == Verdict(1, (1, 2))
    assert accept_point_mass([0, 2], rows, rng) == Verdict(0, (1,))
    with pytest.raises(ValueError):
        accept_point_mass([1], rows, rng)
    with pytest.raises(ValueError):
        accept_speculative([1], rows[:2], rows[:2], rng)
