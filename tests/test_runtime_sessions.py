"""Sessions, KV operations and state on split chains: each result equals the plain computation."""

from __future__ import annotations

import numpy as np
import pytest

from chain_helpers import InProcessChain, greedy_run
from conftest import PROMPT, model_path
from skippy.runtime import SessionError, StateMismatch

SPLIT = [(0, 1), (1, 3), (3, 4)]


def alone(prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    with InProcessChain(model_path(), SPLIT) as chain:
        return greedy_run(chain, prompt, steps)


def interleaved(split: list[tuple[int, int]], prompts: list[list[int]], steps: int
                ) -> tuple[list[list[np.ndarray]], list[list[int]]]:
    """All sessions in every batch: a joint round-robin prefill, then joint decode steps."""
    n_sessions = len(prompts)
    with InProcessChain(model_path(), split) as chain:
        rows = [(s, i) for i in range(max(map(len, prompts))) for s in range(n_sessions) if i < len(prompts[s])]
        tokens = [prompts[s][i] for s, i in rows]
        logits = chain.decode(tokens, [i for _, i in rows], [s for s, _ in rows], [True] * len(rows))
        per_session: list[list[np.ndarray]] = [[] for _ in prompts]
        for (s, _), row_logits in zip(rows, logits):
            per_session[s].append(row_logits)
        positions = [len(p) for p in prompts]
        generated: list[list[int]] = [[] for _ in prompts]
        for _ in range(steps):
            nxt = [int(np.argmax(per_session[s][-1])) for s in range(n_sessions)]
            for s in range(n_sessions):
                generated[s].append(nxt[s])
            out = chain.decode(nxt, positions, list(range(n_sessions)))
            for s in range(n_sessions):
                per_session[s].append(out[s])
                positions[s] += 1
    return per_session, generated


@pytest.mark.slow
@pytest.mark.parametrize("n_sessions", [2, 3])
def test_interleaved_sessions_match_running_alone(n_sessions: int) -> None:
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]][:n_sessions]
    split_logits, split_tokens = interleaved(SPLIT, prompts, 6)
    unsplit_logits, unsplit_tokens = interleaved([(0, 4)], prompts, 6)
    # split vs unsplit with the same batches: bitwise
    assert split_tokens == unsplit_tokens
    for got_rows, want_rows in zip(split_logits, unsplit_logits):
        assert all(np.array_equal(g, w) for g, w in zip(got_rows, want_rows))
    # batched vs alone: the same tokens; logits differ only by float summation order
    # (llama.cpp's kernels round differently for different batch shapes, split or not)
    for s, prompt in enumerate(prompts):
        want_logits, want_tokens = alone(prompt, 6)
        assert split_tokens[s] == want_tokens
        for got, want in zip(split_logits[s], want_logits):
            assert np.allclose(got, want, atol=5e-3), f"session {s}: {np.abs(got - want).max()}"


@pytest.mark.slow
def test_rollback_then_redecode_gives_the_same_logits() -> None:
    with InProcessChain(model_path(), SPLIT) as chain:
        logits, tokens = greedy_run(chain, PROMPT, 5)
        n = len(PROMPT)
        # roll back the last 3 positions on every stage, then decode them again
        assert all(chain.each("remove", 0, n + 2, -1))
        assert chain.each("length", 0) == [n + 2] * 3
        replay = []
        for offset, token in enumerate(tokens[2:5]):
            replay += chain.decode([token], [n + 2 + offset], [0])
    # token i sits at position n+i and produced logits[n+i]
    assert len(replay) == 3
    for got, want in zip(replay, logits[n + 2: n + 5]):
        assert np.array_equal(got, want)


def test_rollback_not_mirrored_is_caught() -> None:
    """Trimming only the first stage makes the next stage reject inconsistent positions."""
    from skippy.runtime import InvalidBatch

    with InProcessChain(model_path(), SPLIT) as chain:
        greedy_run(chain, PROMPT, 2)
        n = len(PROMPT)
        chain.contexts[0].trim(0, n)
        with pytest.raises(InvalidBatch):
            chain.decode([5], [n], [0])


@pytest.mark.slow
def test_prefix_copy_then_suffix_equals_fresh_prefill() -> None:
    prefix, suffix = PROMPT[:8], PROMPT[8:]
    with InProcessChain(model_path(), SPLIT) as chain:
        chain.decode(prefix, list(range(8)), [0] * 8)
        chain.each("copy", 0, 1, 0, 8)
        got = chain.decode(suffix, list(range(8, len(PROMPT))), [1] * len(suffix), [True] * len(suffix))
    with InProcessChain(model_path(), SPLIT) as chain:
        want = chain.decode(PROMPT, list(range(len(PROMPT))), [0] * len(PROMPT), [True] * len(PROMPT))
    for g, w in zip(got, want[8:]):
        assert np.array_equal(g, w)


def test_state_round_trip_on_a_middle_stage_is_exact() -> None:
    with InProcessChain(model_path(), SPLIT) as chain:
        greedy_run(chain, PROMPT, 3)
        middle = chain.contexts[1]
        blob = middle.save_state(0)
        middle.remove(0)
        assert middle.length(0) == 0
        assert middle.load_state(0, blob) == len(PROMPT) + 3
        after_restore = chain.decode([42], [len(PROMPT) + 3], [0])
    with InProcessChain(model_path(), SPLIT) as chain:
        greedy_run(chain, PROMPT, 3)
        never_saved = chain.decode([42], [len(PROMPT) + 3], [0])
    assert np.array_equal(after_restore[0], never_saved[0])


@pytest.mark.slow
def test_state_from_another_range_or_model_is_refused() -> None:
    path = model_path()
    same_shape_other_model = model_path(seed=7)
    with InProcessChain(path, [(0, 2), (2, 4)]) as chain, \
            InProcessChain(path, [(1, 3)]) as other_range, \
            InProcessChain(same_shape_other_model, [(0, 2)]) as other_model:
        greedy_run(chain, PROMPT, 1)
        blob = chain.contexts[0].save_state(0)  # layers 0:2
        with pytest.raises(StateMismatch, match="layers 0:2"):
            other_range.contexts[0].load_state(0, blob)  # same layer count, other range
        with pytest.raises(StateMismatch, match="another model"):
            other_model.contexts[0].load_state(0, blob)
        with pytest.raises(StateMismatch):
            chain.contexts[0].load_state(0, b"garbage" * 10)
        # the stage is still usable after the refusals
        assert chain.contexts[0].load_state(1, blob) == len(PROMPT) + 1


def test_sessions_are_sequence_ids_and_closing_frees_kv() -> None:
    with InProcessChain(model_path(), [(0, 4)], max_sessions=2) as chain:
        context = chain.contexts[0]
        a, b = context.open_session(), context.open_session()
        assert {a, b} == {0, 1}
        with pytest.raises(SessionError, match="all 2 sessions"):
            context.open_session()
        chain.decode(PROMPT, list(range(len(PROMPT))), [a] * len(PROMPT))
        assert context.kv_cells_used() == len(PROMPT)
        context.close_session(a)
        assert context.kv_cells_used() == 0
        assert context.sessions_in_use == 1
        assert context.open_session() == a
        with pytest.raises(SessionError):
            context.close_session(99)
