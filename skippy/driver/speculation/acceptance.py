# Acceptance rules for verify windows: which drafted tokens the target model keeps.
#
# Strategy: a window verifies drafts d_1..d_K after a committed token; the target supplies, for
# every window row i = 0..K, either its chosen token t_i or its distribution p_i over the next
# token given the prefix with d_1..d_i.  Every rule returns a `Verdict`: the number of accepted
# drafts a and the committed tokens d_1..d_a plus one target token (the correction at the first
# rejection, or the bonus row K when every draft was accepted).
#
# * Greedy (temperature <= 0): accept while d_{i+1} == argmax p_i.  Output equals plain greedy
#   decoding token for token.
# * Sampled, point-mass draft q = delta(x) (the n-gram proposer): speculative sampling accepts x
#   with probability min(1, p(x)/q(x)) = p(x); on rejection it samples the residual
#   normalize(max(0, p - q)), i.e. p with x removed.  The committed token is then distributed
#   exactly as p: P(x) = p(x) and P(y != x) = (1 - p(x)) p(y) / (1 - p(x)) = p(y).
#   Key consequence: this is the SAME law as "sample y ~ p independently, accept iff y == x, else
#   commit y".  So when the final stage samples every window row with the session's sampler (what
#   the v11 PredictedTokens reply carries: token ids only), the driver's exact-match rule
#   (`accept_tokens`) is already lossless for sampled requests; no logits need to travel.  The
#   logits form (`accept_point_mass`) is for a driver that holds target distributions (a future
#   logits reply, or tests), and `accept_speculative` covers general draft distributions q.
# * `target_probabilities` turns raw logits into the distribution the stage's llama.cpp chain
#   samples from, in the chain's order: logit bias, top-k, top-p, min-p, temperature, softmax.
#   Repetition penalties need the token history and are out of scope here (see docs).
#
# All math is pure numpy over float64; randomness comes only from the caller's seeded
# `numpy.random.Generator`.  The batched point-mass rule is vectorised over trials so statistical
# tests can run millions of windows.
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "SamplingSettings",
    "Verdict",
    "accept_greedy",
    "accept_point_mass",
    "accept_point_mass_batch",
    "accept_speculative",
    "accept_tokens",
    "residual_distribution",
    "target_probabilities",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class SamplingSettings(Protocol):
    """The sampling transforms applied to logits (``skippy.runtime.SamplingParams`` fits)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of verifying one window.

    Attributes:
        accepted: number of drafts kept (a prefix of the window's drafts).
        tokens: the committed tokens: the accepted drafts then one target token.
    """

    accepted: int
    tokens: tuple[int, ...]

    @property
    def next_token(self) -> int:
        """The target's token after the accepted drafts (correction or bonus)."""
        return self.tokens[-1]


def _check_rows(drafts: Sequence[int], rows: int) -> None:
    if rows != len(drafts) + 1:
        raise ValueError(f"a window of {len(drafts)} drafts needs {len(drafts) + 1} target rows, got {rows}")


def accept_tokens(drafts: Sequence[int], predicted: Sequence[int]) -> Verdict:
    """Exact-match acceptance against the target's chosen token per row.

    Lossless for greedy rows (argmax) and for rows sampled independently from the target
    distribution with point-mass drafts (see the module header).

    Args:
        drafts: d_1..d_K.
        predicted: t_0..t_K, the target's token after the prefix with d_1..d_i.

    Returns:
        The verdict.

    Raises:
        ValueError: ``len(predicted) != len(drafts) + 1``.
    """
    _check_rows(drafts, len(predicted))
    accepted = 0
    while accepted < len(drafts) and int(drafts[accepted]) == int(predicted[accepted]):
        accepted += 1
    return Verdict(accepted, tuple(int(t) for t in drafts[:accepted]) + (int(predicted[accepted]),))


def accept_greedy(drafts: Sequence[int], logits: npt.ArrayLike) -> Verdict:
    """Greedy acceptance from target logits, shape (K + 1, V): argmax per row, then exact match."""
    rows = np.asarray(logits)
    if rows.ndim != 2:
        raise ValueError(f"logits must be (rows, vocab), got shape {rows.shape}")
    return accept_tokens(drafts, [int(t) for t in np.argmax(rows, axis=1)])


def target_probabilities(logits: npt.ArrayLike, settings: SamplingSettings) -> FloatArray:
    """The distribution the final stage's sampler draws from, per row.

    Args:
        logits: shape (V,) or (rows, V).
        settings: temperature, top-k, top-p, min-p, logit bias (penalties are not applied).

    Returns:
        float64 probabilities of the same shape; rows sum to 1.  Greedy (temperature <= 0) is
        a point mass on the first argmax.
    """
    values = np.array(logits, dtype=np.float64, ndmin=1)
    single = values.ndim == 1
    rows = values.reshape(1, -1) if single else values
    vocab = rows.shape[1]
    for token, bias in settings.logit_bias:
        if not 0 <= token < vocab:
            raise ValueError(f"logit_bias token {token} is outside the vocabulary (0..{vocab - 1})")
        rows[:, token] += bias
    out = np.zeros_like(rows)
    if settings.temperature <= 0.0:
        out[np.arange(len(rows)), np.argmax(rows, axis=1)] = 1.0
        return out[0] if single else out
    for index, row in enumerate(rows):
        kept = np.ones(vocab, dtype=bool)
        if 0 < settings.top_k < vocab:
            order = np.argsort(-row, kind="stable")
            kept[:] = False
            kept[order[:settings.top_k]] = True
        if settings.top_p < 1.0:
            probabilities = _softmax(np.where(kept, row, -np.inf))
            order = np.argsort(-probabilities, kind="stable")
            cumulative = np.cumsum(probabilities[order])
            count = int(np.searchsorted(cumulative, settings.top_p, side="left")) + 1
            keep_p = np.zeros(vocab, dtype=bool)
            keep_p[order[:min(count, int(kept.sum()))]] = True
            kept &= keep_p
        if settings.min_p > 0.0:
            probabilities = _softmax(np.where(kept, row, -np.inf))
            kept &= probabilities >= settings.min_p * probabilities.max()
        out[index] = _softmax(np.where(kept, row / settings.temperature, -np.inf))
    return out[0] if single else out


def _softmax(row: FloatArray) -> FloatArray:
    shifted = np.exp(row - np.max(row))
    total: FloatArray = shifted / shifted.sum()
    return total


def residual_distribution(p: npt.ArrayLike, draft_token: int) -> FloatArray:
    """normalize(max(0, p - delta(x))): ``p`` with the draft token removed.

    Raises:
        ValueError: ``p`` puts all its mass on the draft (rejection then has probability 0).
    """
    residual = np.array(p, dtype=np.float64)
    residual[draft_token] = 0.0
    total = residual.sum()
    if total <= 0.0:
        raise ValueError("the residual is empty: the target puts all its mass on the draft")
    out: FloatArray = residual / total
    return out


def _sample_rows(probabilities: FloatArray, uniforms: FloatArray) -> IntArray:
    """Inverse-CDF draw per row of (T, V) probabilities with (T,) uniforms."""
    cumulative = np.cumsum(probabilities, axis=1)
    cumulative /= cumulative[:, -1:]
    index = (cumulative <= uniforms[:, None]).sum(axis=1)
    out: IntArray = np.minimum(index, probabilities.shape[1] - 1).astype(np.int64)
    return out


def accept_point_mass_batch(drafts: npt.ArrayLike, probabilities: npt.ArrayLike,
                            rng: np.random.Generator) -> tuple[IntArray, IntArray]:
    """The lossless rule for point-mass drafts, vectorised over T independent windows.

    Args:
        drafts: int array (T, K).
        probabilities: target distributions (T, K + 1, V); row i is the target after d_1..d_i.
        rng: the only source of randomness.

    Returns:
        ``(accepted, next_token)``, both shape (T,): the accepted prefix length per window and
        the target token committed after it.
    """
    draft_array = np.asarray(drafts, dtype=np.int64)
    target = np.asarray(probabilities, dtype=np.float64)
    trials, count = draft_array.shape
    if target.shape[:2] != (trials, count + 1):
        raise ValueError(f"probabilities must be ({trials}, {count + 1}, V), got {target.shape}")
    accepted = np.zeros(trials, dtype=np.int64)
    next_token = np.full(trials, -1, dtype=np.int64)
    live = np.ones(trials, dtype=bool)
    rows = np.arange(trials)
    for position in range(count + 1):
        if not live.any():
            break
        p = target[:, position, :]
        uniforms: npt.NDArray[np.float64] = rng.random(int(trials))
        if position == count:  # bonus row: a plain sample
            bonus = _sample_rows(p, uniforms)
            next_token[live] = bonus[live]
            break
        x = draft_array[:, position]
        keep = live & (uniforms < p[rows, x])
        reject = live & ~keep
        if reject.any():
            residual = p[reject].copy()
            residual[np.arange(int(reject.sum())), x[reject]] = 0.0
            next_token[reject] = _sample_rows(residual, rng.random(int(reject.sum())))
        accepted[keep] += 1
        live = keep
    return accepted, next_token


def accept_point_mass(drafts: Sequence[int], probabilities: npt.ArrayLike,
                      rng: np.random.Generator) -> Verdict:
    """Sampled acceptance of point-mass drafts from target distributions (K + 1, V)."""
    _check_rows(drafts, np.asarray(probabilities).shape[0])
    accepted, next_token = accept_point_mass_batch(
        np.asarray([list(drafts)], dtype=np.int64).reshape(1, len(drafts)),
        np.asarray(probabilities, dtype=np.float64)[None], rng)
    count = int(accepted[0])
    return Verdict(count, tuple(int(t) for t in drafts[:count]) + (int(next_token[0]),))


def accept_speculative(drafts: Sequence[int], target: npt.ArrayLike, draft_distributions: npt.ArrayLike,
                       rng: np.random.Generator) -> Verdict:
    """Speculative sampling with general draft distributions q (Leviathan et al. 2023).

    Args:
        drafts: d_1..d_K, d_i drawn from q_i.
        target: p_0..p_K, shape (K + 1, V).
        draft_distributions: q_1..q_K, shape (K, V) (row i-1 is the law d_i was drawn from).
        rng: the only source of randomness.

    Returns:
        The verdict: accept d_i with probability min(1, p(d_i)/q(d_i)); on rejection commit a
        sample of normalize(max(0, p - q)); after K acceptances the bonus is a sample of p_K.
    """
    p = np.asarray(target, dtype=np.float64)
    q = np.asarray(draft_distributions, dtype=np.float64)
    _check_rows(drafts, p.shape[0])
    if q.shape != (len(drafts), p.shape[1]):
        raise ValueError(f"draft distributions must be ({len(drafts)}, {p.shape[1]}), got {q.shape}")
    for index, token in enumerate(int(d) for d in drafts):
        ratio = p[index, token] / q[index, token] if q[index, token] > 0 else 0.0
        if rng.random() < min(1.0, ratio):
            continue
        residual = np.maximum(p[index] - q[index], 0.0)
        if residual.sum() <= 0.0:  # p == q exactly: rejection had probability 0 (rounding only)
            residual = p[index].copy()
        choice = int(_sample_rows(residual[None], rng.random(1))[0])
        return Verdict(index, tuple(int(t) for t in drafts[:index]) + (choice,))
    bonus = int(_sample_rows(p[-1][None], rng.random(1))[0])
    return Verdict(len(drafts), tuple(int(t) for t in drafts) + (bonus,))
