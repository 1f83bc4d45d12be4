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
