"""Suffix n-gram proposer: long drafts on repetitive text, few on random text, bounded memory."""

from __future__ import annotations

import numpy as np
import pytest

from skippy.driver.speculation import NO_DRAFT, NgramProposer


def replay_acceptance(prompt: list[int], output: list[int], window: int = 8) -> tuple[float, float]:
    """Greedy replay: (accepted drafts / proposed drafts, tokens per step)."""
    proposer = NgramProposer(prompt)
    position = 0
    proposed = accepted = steps = 0
    while position < len(output):
        draft = proposer.propose(window)
        kept = 0
        while kept < len(draft.tokens) and position + kept < len(output) and draft.tokens[kept] == output[position + kept]:
            kept += 1
        proposed += len(draft.tokens)
        accepted += kept
        commit = output[position: position + kept + 1]
        proposer.extend(commit)
        position += len(commit)
        steps += 1
    return (accepted / proposed if proposed else 0.0), len(output) / steps


def code_tokens(seed: int = 1, lines: int = 40) -> list[int]:
    rng = np.random.default_rng(seed)
    body: list[int] = []
    for _ in range(lines):
        body += [int(t) for t in rng.integers(100, 5000, size=int(rng.integers(4, 12)))] + [13]
    return body


def test_code_edit_finds_long_drafts() -> None:
    original = code_tokens()
    edited = list(original)
    edited[50:52] = [7, 7, 7]  # a small edit in the middle
    edited[200] = 9
    prompt = [1, 2, 3] + original + [4, 5]
    acceptance, per_step = replay_acceptance(prompt, edited)
    assert acceptance > 0.8
    assert per_step > 5.0


def test_quoting_a_passage() -> None:
    passage = code_tokens(seed=2, lines=10)
    prompt = code_tokens(seed=3, lines=5) + passage + code_tokens(seed=4, lines=5)
    proposer = NgramProposer(prompt)
    proposer.extend(passage[:3])
    draft = proposer.propose(16)
    assert draft.tokens == tuple(passage[3:19])
    assert draft.match_length >= 3


def test_random_text_rarely_drafts() -> None:
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(0, 32000, size=3000)]
    proposer = NgramProposer(tokens[:500])
    drafted = 0
    for token in tokens[500:]:
        drafted += bool(proposer.propose(8).tokens)
        proposer.append(token)
    assert drafted / 2500 < 0.01
    acceptance, _ = replay_acceptance(tokens[:500], tokens[500:])
    assert acceptance < 0.1


def test_periodic_text_copies_past_the_end() -> None:
    proposer = NgramProposer([5, 6, 7, 5, 6, 7, 5])
    assert proposer.propose(7).tokens == (6, 7, 5, 6, 7, 5, 6)


def test_longest_then_most_recent_match_wins() -> None:
    proposer = NgramProposer([1, 2, 3, 9, 0, 2, 3, 8, 0, 1, 2, 3], n_min=2, n_max=4)
    draft = proposer.propose(1)
    assert draft.tokens == (9,)  # "1 2 3" (n=3) beats the more recent "2 3" (n=2) -> 8
    assert NgramProposer([0, 2, 3, 8, 4, 2, 3]).propose(1).tokens == (8,)


def test_no_match_and_zero_request() -> None:
    proposer = NgramProposer([1, 2, 3, 4])
    assert proposer.propose(4) is NO_DRAFT
    assert proposer.propose(0) is NO_DRAFT
    assert NgramProposer().propose(3) is NO_DRAFT


def test_current_suffix_is_not_its_own_match() -> None:
    proposer = NgramProposer([1, 2])
    assert proposer.propose(3) is NO_DRAFT
    proposer.extend([1, 2])
    assert proposer.propose(2).tokens == (1, 2)


def test_tail_is_searched_not_indexed() -> None:
    proposer = NgramProposer([10, 11, 12, 13, 14, 20])
    draft = proposer.propose(2, tail=[10, 11])
    assert draft.tokens == (12, 13)
    assert len(proposer) == 6
    assert proposer.propose(2) is NO_DRAFT


def test_memory_is_bounded_and_recent_repeats_still_match() -> None:
    rng = np.random.default_rng(6)
    proposer = NgramProposer(n_min=2, n_max=4, max_history=64)
    for token in rng.integers(0, 10**6, size=1000):
        proposer.append(int(token))
    assert len(proposer) == 1000
    assert all(len(table) <= 2 * 64 + 1 for table in proposer._index.values())
    proposer.extend([1, 2, 3, 4, 5, 1, 2])
    assert proposer.propose(3).tokens == (3, 4, 5)


def test_confidence_grows_with_match_length() -> None:
    short = NgramProposer([1, 2, 9, 1, 2]).propose(1)
    long = NgramProposer([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 6]).propose(1)
    assert short.match_length == 2 and long.match_length == 6
    assert 0.0 < short.confidence < long.confidence < 1.0


@pytest.mark.parametrize("kwargs", [{"n_min": 0}, {"n_min": 5, "n_max": 4}, {"n_max": 8, "max_history": 8}])
def test_invalid_bounds(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        NgramProposer(**kwargs)
