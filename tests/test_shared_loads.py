"""The session's shared loads (tests/shared_loads.py) keep a model's weights while a context uses them.

A test that closes its model before its context (or never closes the context) must not leave that
context on freed weights once an eviction or the session's end frees the load: the context holds
the load until it closes.  Each case here installs a SharedLoads of its own (nested in the
session's) that frees every idle load at once, on a copy of the tiny llama (a file of its own).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from shared_loads import SharedLoads

from skippy.runtime import Model, StageContext
from skippy.runtime.errors import ClosedError

from conftest import PROMPT

KW = {"n_ctx": 64, "max_sessions": 1, "n_batch": 16, "threads": 1}


@pytest.fixture
def eager(tmp_path: Path, tiny_llama: Path) -> Iterator[tuple[SharedLoads, Path]]:
    """A SharedLoads keeping no idle load, and a model file only these tests load."""
    path = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_llama, path)
    loads = SharedLoads(limit=0, budget=0)
    loads.install()
    try:
        yield loads, path
    finally:
        loads.uninstall()


def last_logits(context: StageContext) -> np.ndarray:
    context.decode(tokens=PROMPT, positions=list(range(len(PROMPT))), seq_ids=[0] * len(PROMPT),
                   outputs=[False] * (len(PROMPT) - 1) + [True])
    return context.logits(int(context.output_rows[-1])).copy()


def test_a_context_keeps_the_load_its_model_gave_back(eager: tuple[SharedLoads, Path]) -> None:
    loads, path = eager
    model = Model(path)
    context = StageContext(model, **KW)  # type: ignore[arg-type]
    assert loads.users(model) == 2
    model.close()  # before its context: the load stays, held by the context
    with pytest.raises(ClosedError):
        model.pointer  # noqa: B018 - the test's model is closed all the same
    assert (loads.loads, loads.frees) == (1, 0)
    with Model(path) as again:  # the same load, handed out again while the context holds it
        assert loads.loads == 1 and loads.users(again) == 2
        with StageContext(again, **KW) as fresh:  # type: ignore[arg-type]
            assert np.array_equal(last_logits(context), last_logits(fresh))
    assert loads.frees == 0
    context.close()
    assert loads.frees == 1  # the last user gone: freed at once (limit 0)
    context.close()  # idempotent: gives nothing back twice
    assert loads.frees == 1 and not loads._entries


def test_a_context_left_open_keeps_its_load_at_the_sessions_end(eager: tuple[SharedLoads, Path]) -> None:
    loads, path = eager
    with Model(path) as model:
        context = StageContext(model, **KW)  # type: ignore[arg-type]
    loads.uninstall()  # (what the session's end does): the load under an open context is not freed
    assert loads.frees == 0
    logits = last_logits(context)
    assert np.isfinite(logits).all() and logits.std() > 0.02
    context.close()  # after uninstall: the original close (the load then leaks, as the test's context did)


def test_closing_in_order_frees_the_load(eager: tuple[SharedLoads, Path]) -> None:
    loads, path = eager
    with Model(path) as model, StageContext(model, **KW) as context:  # type: ignore[arg-type]
        last_logits(context)
        assert loads.users(model) == 2
    assert (loads.loads, loads.frees) == (1, 1) and not loads._entries


def test_a_nested_install_gives_the_sessions_objects_back_to_the_session(
        tiny_llama: Path, _shared_loads: SharedLoads, eager: tuple[SharedLoads, Path]) -> None:
    loads, _ = eager
    loads.uninstall()
    outer = Model(tiny_llama)  # shared by the session's loads
    users = _shared_loads.users(outer)
    loads.install()
    context = StageContext(outer, **KW)  # type: ignore[arg-type]
    assert _shared_loads.users(outer) == users + 1 and loads.loads == 0
    outer.close()
    context.close()
    assert loads.frees == 0 and _shared_loads.users(outer) == users - 1
