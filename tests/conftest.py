"""Shared fixtures: generated models (cached by spec) and the prompt used across tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy.models.cache import ensure_model
from skippy.models.spec import tiny

#: Token ids of a short English prompt in the llama-spm vocabulary ("Hello world, how are you doing").
PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354]


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return ensure_model(tiny("llama"))


def model_path(arch: str = "llama", dtype: str = "F32", tied: bool = False, **kw: object) -> Path:
    return ensure_model(tiny(arch, dtype=dtype, tied=tied, **kw))  # type: ignore[arg-type]
