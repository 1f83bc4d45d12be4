"""Rollback of recurrent state (issue 25, deliver 2): hybrid models trim, fork and roll back exactly.

A hybrid model's recurrent layers cannot drop positions; ``StageContext`` rolls a session back by
restoring a checkpoint of its recurrent state and decoding the logged rows again
(:mod:`skippy.runtime.rollback`).  Here, on the tiny hybrids unsplit and as a 3-stage chain (every
KV operation mirrored on each stage, 1 thread): a trim into single-row decodes and one into a
multi-row window give bitwise the logits of a session that never decoded the rolled-back rows (with
the same micro-batch partition); a prefix copy (a fork, a prefix-cache record) likewise; a rollback
past the oldest checkpoint is refused naming it and leaves the session as it was.  On 2- and
3-stage chains a chunk cut to its head (a window's rejected drafts, a fork) gives bitwise the
unsplit run's logits; a 1-row head is made as the driver makes it (the row decoded again alone)
or refused (a prefix copy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest
from chain_helpers import ChainModels, InProcessChain

from skippy.models import ensure_model, tiny
from skippy.runtime import SessionError

#: Hybrid families with writers: (recurrent + attention layers; the 3-stage split below cuts inside
#: a run of recurrent layers and between a recurrent and an attention layer).
HYBRIDS = ["qwen35", "nemotron_h"]
SPLITS = {"unsplit": [(0, 4)], "3 stages": [(0, 1), (1, 3), (3, 4)]}
PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243]
AFTER = [3186, 29892, 920]  # decoded after the rollback point, one row at a time
THREADS = 1


@pytest.fixture(scope="module")
def models() -> Iterator[ChainModels]:
    """The hybrids' stage ranges, loaded once: every chain below gets fresh contexts on them."""
    shared = ChainModels()
    yield shared
    shared.close()


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest) -> Path:
    return ensure_model(tiny(request.param))


def chain(models: ChainModels, path: Path, split: str, **settings: int) -> InProcessChain:
    """Fresh contexts (``settings``: other checkpoint settings) on the shared models of ``split``."""
    return models.chain(path, SPLITS[split], n_ctx=256, max_sessions=4, n_batch=64, threads=THREADS, **settings)


def feed(stages: InProcessChain, seq: int, start: int, batches: Sequence[Sequence[int]]) -> tuple[int, list[np.ndarray]]:
    """Decode ``batches`` (each one call) from ``start``; the last row's logits of each."""
    logits = []
    for batch in batches:
        positions = list(range(start, start + len(batch)))
        logits.append(stages.decode(list(batch), positions, [seq] * len(batch))[-1])
        start += len(batch)
    return start, logits


def never_decoded(models: ChainModels, path: Path, split: str, batches: Sequence[Sequence[int]],
                  tail: int) -> list[np.ndarray]:
    """The reference: a fresh chain (the same KV cell layout: a unified cache's attention sums
    depend on the cells in use) decodes ``batches``; the last ``tail`` logits."""
    with chain(models, path, split) as stages:
        return feed(stages, 0, 0, batches)[1][-tail:]


def assert_same_to_rounding(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert int(np.argmax(a)) == int(np.argmax(b))


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("case", ["into one-row decodes", "into a window"])
def test_a_rollback_gives_the_logits_of_never_having_decoded_the_rows(models: ChainModels, hybrid: Path, split: str,
                                                                       case: str) -> None:
    n = len(PROMPT)
    singles = [[5], [6], [7]]
    window = [8, 9, 10, 11, 12]
    after = [[t] for t in AFTER]
    if case == "into one-row decodes":  # after a multi-row window, back into the decode steps before it
        decoded, kept = [PROMPT, *singles, window], [PROMPT, *singles[:2]]
    else:  # a verify window's rejected drafts: the accepted head is decoded again as one chunk
        decoded, kept = [PROMPT, window], [PROMPT, window[:2]]
    with chain(models, hybrid, split) as stages:
        assert all(context.recurrent for context in stages.contexts)
        feed(stages, 0, 0, decoded)
        assert all(bytes_ > 0 for bytes_ in stages.each("checkpoint_bytes", 0))
        stages.each("trim", 0, n + 2)
        assert stages.each("length", 0) == [n + 2] * len(stages.contexts)
        _, rolled = feed(stages, 0, n + 2, after)
        for context in stages.contexts:
            stats = context.rollback_stats
            assert (stats.rollbacks, stats.refused) == (1, 0)
            assert stats.replayed_rows == 2  # from the checkpoint before [5] / before the window
    never = never_decoded(models, hybrid, split, [*kept, *after], len(after))
    assert all(np.array_equal(a, b) for a, b in zip(rolled, never))


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_prefix_copy_is_the_prefix_and_keeps_no_checkpoint(models: ChainModels, hybrid: Path, split: str) -> None:
    """A fork (``n`` > 1: the prompt but its last token) and a prefix-cache record copy a prefix."""
    n = len(PROMPT)
    with chain(models, hybrid, split) as stages:
        feed(stages, 0, 0, [PROMPT, [5]])
        stages.each("copy", 0, 1, 0, n - 1)
        assert stages.each("length", 1) == [n - 1] * len(stages.contexts)
        assert stages.each("checkpoint_bytes", 1) == [0] * len(stages.contexts)
        _, forked = feed(stages, 1, n - 1, [PROMPT[-1:], [5], [6]])
    # the fork's attention shares the parent's cells, so its sums run over another cell layout than
    # a fresh session's: equal to float rounding, the same greedy tokens
    never = never_decoded(models, hybrid, split, [PROMPT[:-1], PROMPT[-1:], [5], [6]], 3)
    for a, b in zip(forked, never):
        assert_same_to_rounding(a, b)
    with chain(models, hybrid, split) as stages:
        feed(stages, 0, 0, [PROMPT, [5]])
        stages.each("copy", 0, 3, 0, n + 1)  # the whole session: nothing to roll back
        _, whole = feed(stages, 3, n + 1, [[6]])
        _, parent = feed(stages, 0, n + 1, [[6]])
        assert_same_to_rounding(whole[0], parent[0])
        assert not np.array_equal(parent[0], forked[-1])  # another prefix: other logits


def test_a_rollback_past_the_oldest_checkpoint_is_refused_and_changes_nothing(models: ChainModels,
                                                                               hybrid: Path) -> None:
    n = len(PROMPT)
    with chain(models, hybrid, "unsplit", checkpoint_depth=2, checkpoint_interval=2) as stages:
        context = stages.contexts[0]
        end, _ = feed(stages, 0, 0, [PROMPT, *([t] for t in range(5, 13))])
        assert end == n + 8
        with pytest.raises(SessionError, match=r"cannot go back from 20 to 13 positions: its oldest checkpoint is at 16"):
            context.trim(0, n + 1)
        assert context.length(0) == end and context.rollback_stats.refused == 1
        assert context.remove(0, n + 1, -1) is False
        assert context.remove(0, 3, 5) is False  # a hole: never possible in a recurrent state
        with pytest.raises(SessionError, match="cannot copy positions"):
            context.copy(0, 1, 0, n + 1)
        assert context.length(1) == 0
        context.trim(0, n + 6)  # within reach: the session goes on
        context.remove(1)
        _, rolled = feed(stages, 0, n + 6, [[42]])
    never = never_decoded(models, hybrid, "unsplit", [PROMPT, *([t] for t in range(5, 11)), [42]], 1)
    assert np.array_equal(rolled[0], never[0])


def test_a_long_way_back_through_thinned_checkpoints(models: ChainModels, hybrid: Path) -> None:
    """A decode run far ahead of its driver (60 one-row steps) goes back 55 positions exactly: the
    older checkpoints are thinned, not dropped; with fewer rows allowed the oldest goes."""
    n = len(PROMPT)
    steps = [[5 + i] for i in range(60)]
    with chain(models, hybrid, "unsplit") as stages:
        context = stages.contexts[0]
        feed(stages, 0, 0, [PROMPT, *steps])
        assert len(context._rings[0]) == context.checkpoint_depth
        context.trim(0, n + 5)
        _, rolled = feed(stages, 0, n + 5, [[42]])
        assert context.rollback_stats.replayed_rows == 5  # from the checkpoint before the first step: kept
    assert np.array_equal(rolled[0], never_decoded(models, hybrid, "unsplit", [PROMPT, *steps[:5], [42]], 1)[0])
    with chain(models, hybrid, "unsplit", checkpoint_rows=32) as stages:
        feed(stages, 0, 0, [PROMPT, *steps])
        with pytest.raises(SessionError, match="oldest checkpoint is at"):
            stages.contexts[0].trim(0, n + 5)



CHAINS = {"2 stages": [(0, 2), (2, 4)], "3 stages": SPLITS["3 stages"]}


@pytest.mark.parametrize("split", list(CHAINS))
@pytest.mark.parametrize("head", [1, 2])
@pytest.mark.parametrize("case", ["window", "fork"])
def test_a_chunk_cut_to_its_head_on_a_chain_is_the_unsplit_run(models: ChainModels, hybrid: Path, split: str,
                                                               head: int, case: str) -> None:
    """A multi-row chunk cut to its first ``head`` rows: a verify window whose drafts are rejected
    (a trim), or a prompt's last prefill chunk forked one position short (a prefix copy).  Each
    stage restores its checkpoint and decodes the kept rows again, a later stage from the
    activations it received, which the whole chunk's batch computed; with 2 rows or more the
    chain gives bitwise the logits (so the greedy tokens) of the unsplit model doing the same.

    A 1-row head is not made so (:mod:`skippy.runtime.rollback`): the unsplit model replays that
    row alone from its token, a later stage could only replay the row its upstream computed in
    the batch.  A window cut to its first row is what the speculation driver sends again as a
    1-row window on a chain (tests/test_recurrent_speculation.py runs it end to end): every stage
    trims to the window's start (a restore, nothing replayed) and decodes the row alone, from its
    upstream's 1-row output, which is bitwise the unsplit trim's replay.  A prefix copy that
    keeps a chunk's first row only is refused on every stage, the unsplit one too (a fork then
    computes its prompt in full; a prefix-cache record is not made)."""
    n = len(PROMPT)
    window = [8, 9, 10, 11, 12]
    after = [[t] for t in AFTER]
    runs = {}
    for name, ranges in (("unsplit", SPLITS["unsplit"]), (split, CHAINS[split])):
        with models.chain(hybrid, ranges, n_ctx=256, max_sessions=4, n_batch=64, threads=THREADS) as stages:
            if case == "window":
                feed(stages, 0, 0, [PROMPT, [5], window])
                if head == 1 and name != "unsplit":  # the driver's form on a chain: the row again, alone
                    stages.each("trim", 0, n + 1)
                    for context in stages.contexts:
                        assert context.rollback_stats.replayed_rows == 0
                    feed(stages, 0, n + 1, [window[:1]])
                else:
                    stages.each("trim", 0, n + 1 + head)
                    for context in stages.contexts:
                        assert context.rollback_stats.rollbacks == 1 and context.rollback_stats.replayed_rows == head
                runs[name] = feed(stages, 0, n + 1 + head, after)[1]
            else:  # the prompt's last chunk: head + 1 rows
                feed(stages, 0, 0, [PROMPT[:-head - 1], PROMPT[-head - 1:], [5]])
                if head == 1:
                    for context in stages.contexts:
                        with pytest.raises(SessionError, match=r"keep only the first row of a 2-row chunk"):
                            context.copy(0, 1, 0, n - 1)
                        assert context.length(1) == 0 and context.length(0) == n + 1
                    stages.each("copy", 0, 1, 0, n - 2)  # at the chunk's start: a restore
                    runs[name] = feed(stages, 1, n - 2, [PROMPT[-2:-1], PROMPT[-1:], *after])[1]
                else:
                    stages.each("copy", 0, 1, 0, n - 1)
                    runs[name] = feed(stages, 1, n - 1, [PROMPT[-1:], *after])[1]
    for unsplit, chained in zip(runs["unsplit"], runs[split], strict=True):
        assert int(np.argmax(unsplit)) == int(np.argmax(chained))
        assert np.array_equal(unsplit, chained), np.abs(unsplit - chained).max()
