"""Session forks (``n`` > 1 choices): the stage's parsing of the fork request and the executor's KV copy.

The chain-level behaviour (prefilled once, forks exact) is ``tests/test_api_choices.py``; here the
null runtime shows the copy's bookkeeping and that hostile or impossible fork requests fork nothing.
"""

from __future__ import annotations

import json

import numpy as np

from skippy.runtime.null import NullContext, NullModel, NullSpec
from skippy.stage.executor import Executor, WorkItem
from skippy.stage.prefix_control import fork_settings


def metadata(**section: object) -> str:
    return json.dumps({"skippy.fork": section})


def test_fork_settings_accept_only_sane_numbers() -> None:
    assert fork_settings(metadata(session=7, length=12)) == (7, 12)
    for bad in (metadata(session=0, length=3), metadata(session=7, length=0), metadata(session=-1, length=3),
                metadata(session=7, length=1 << 40), metadata(session=True, length=3),
                metadata(session="7", length=3), json.dumps({"skippy.fork": [7, 3]}), "not json", None, ""):
        assert fork_settings(bad) is None, bad


def test_executor_fork_copies_the_prefix_and_refuses_what_it_cannot() -> None:
    context = NullContext(NullModel(NullSpec(n_embd=8, n_layer=2), "0:2"))
    executor = Executor(context)
    executor.configure(1, None)
    prompt = np.arange(10, 16, dtype=np.int32)
    executor.run_item(WorkItem(1, np.arange(6, dtype=np.int32), tokens=prompt, prompt_tokens=prompt,
                               prefill=True, final_prefill=True))
    assert executor.fork(1, 2, 5) == 5
    assert context.length(executor._sessions[2].seq) == 5
    assert executor._sessions[2].prompt in (None, [10, 11, 12, 13, 14])  # tracked only with a prefix cache
    assert executor.fork(1, 3, 7) == 0  # the parent holds 6 positions
    assert executor.fork(9, 3, 2) == 0  # no such parent on this lane
    assert executor.fork(1, 1, 2) == 0  # not onto itself
    assert context.length(executor._sessions[1].seq) == 6  # the parent is untouched


def test_a_fork_of_a_moved_sliding_window_in_streams_is_refused() -> None:
    """Separate KV streams copy a session through its state, which leaves out the cells a
    sliding-window layer has moved past (the tiny gemma3's window is 8): a fork would lack cells its
    prefix attends to, so the executor forks nothing (the driver prefills the choice in full).  In
    the shared pool the copy shares the cells and the fork holds."""
    from skippy.runtime import Model, StageContext

    from conftest import model_path

    with Model(model_path("gemma3")) as model:
        for streams in (False, True):
            with StageContext(model, n_ctx=128, max_sessions=4, n_batch=64, threads=1, kv_streams=streams) as ctx:
                executor = Executor(ctx)
                executor.configure(1, None)
                prompt = np.arange(10, 18, dtype=np.int32)
                executor.run_item(WorkItem(1, np.arange(8, dtype=np.int32), tokens=prompt, prompt_tokens=prompt,
                                           prefill=True, final_prefill=True))
                parent = executor._sessions[1].seq
                assert executor.fork(1, 2, 4) == 4  # within the window: every cell is in the state
                for step in range(4):  # one-row decodes: the window moves past position 3
                    ctx.decode(tokens=[7], positions=[8 + step], seq_ids=[parent])
                # positions 4 and 5 are still in the state, 0..3 (which position 6 attends to) are not
                expected = 0 if streams else 6
                assert executor.fork(1, 3, 6) == expected, streams
                assert ctx.length(executor._sessions[3].seq) == expected
                assert ctx.length(parent) == 12
