"""``n > 1`` through ``skippy up`` (real processes, the default chain path: direct return with the
decode relay), on 2 and 4 stages of the real Gemma 3 270M and of a generated model served with a
tools template.

* ``n = 4`` greedy is four copies of the ``n = 1`` greedy answer.
* ``n = 3`` sampled with ``seed``: choice ``i`` is the ``n = 1`` answer with ``seed + i``, the
  same request again gives the same three answers, and the choices differ.  Both models run with
  the default flags (one KV pool shared by the sessions): native patch 0016 places each session's
  cells as it would hold them alone, so the forks decoding side by side round as the ``n = 1`` runs
  (llama.cpp's own placement interleaves them and choice 1 differs on the real Gemma, Q4_K_M); a
  fork recomputes its parent's last prefill chunk, so its first token is made as the ``n = 1``
  run's (docs/api-fields.md, ``n``).
* With the tools template the requests carry tools (the prompt renders them), and a forced call
  (``tool_choice`` required, grammar-forced arguments) is checked as the sampled answers are.

The matrix of features x chain paths on in-process chains is tests/test_api_paths.py; this is the
issue's check on the launcher's own chain.  The real model comes from the ``skippy-llm[real-model]``
extra (sha256-checked; those cases skip without it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from api_helpers import UpProcess
from conftest import model_path

ROOT = Path(__file__).resolve().parent.parent
_TREES = [ROOT / "build" / "llama-src", ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp",
          *([Path(os.environ["SKIPPY_LLAMA_SRC"])] if os.environ.get("SKIPPY_LLAMA_SRC") else [])]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Bern", "Zurich", "Geneva"]}},
                   "required": ["city"]}}}]
SEED = 1234


def _tools_template() -> Path:
    for tree in _TREES:
        path = tree / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
        if path.is_file():
            return path
    pytest.skip("the pinned llama.cpp tree (its Qwen2.5 tools template) is not here")


@pytest.fixture(scope="module", params=[
    pytest.param(("real", 2), marks=pytest.mark.real_model, id="real-gemma-2-stages"),
    pytest.param(("real", 4), marks=pytest.mark.real_model, id="real-gemma-4-stages"),
    pytest.param(("tools", 2), id="tools-template-2-stages"),
    pytest.param(("tools", 4), id="tools-template-4-stages"),
])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, int]]:
    kind, stages = request.param
    if kind == "real":
        model = request.getfixturevalue("real_model")
        extra: list[str] = []
    else:
        model = model_path("llama")
        extra = ["--chat-template", str(_tools_template())]
    directory = tmp_path_factory.mktemp(f"up-{kind}-{stages}")
    up = UpProcess(["up", "--model", str(model), "--stages", str(stages), "--port", "0", "--ctx-size", "1024",
                    "--threads", "1", "--log-dir", str(directory / "logs"), *extra], directory).start(timeout=300)
    try:
        yield kind, up.url, stages
    finally:
        up.stop()


def _chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _answers(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(choice["message"].get("content"), choice["message"].get("tool_calls") and [
        (call["function"]["name"], call["function"]["arguments"]) for call in choice["message"]["tool_calls"]],
        choice["finish_reason"]) for choice in sorted(result["choices"], key=lambda choice: choice["index"])]


@pytest.mark.slow
def test_n_choices_equal_n_one_answers_through_skippy_up(served: tuple[str, str, int]) -> None:
    kind, url, stages = served
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    base: dict[str, Any] = {"model": model, "max_tokens": 16,
                            "messages": [{"role": "user", "content": "Name three rivers of Europe."}]}
    if kind == "tools":
        base["tools"] = TOOLS
    greedy = _chat(url, {**base, "temperature": 0})
    assert greedy["usage"]["skippy_timing"]["stage_count"] == stages
    four = _chat(url, {**base, "temperature": 0, "n": 4})
    assert _answers(four) == _answers(greedy) * 4
    sampled = {**base, "temperature": 0.8, "seed": SEED}
    three = _chat(url, {**sampled, "n": 3})
    ones = [_chat(url, {**sampled, "seed": SEED + index}) for index in range(3)]
    assert _answers(_chat(url, {**sampled, "n": 3})) == _answers(three)  # seeded choices reproduce
    assert len({answer[0] for answer in _answers(three)}) == 3  # and differ (not one answer thrice)
    assert _answers(three) == [answer for one in ones for answer in _answers(one)]
    assert three["usage"]["completion_tokens"] == sum(one["usage"]["completion_tokens"] for one in ones)
    if kind == "tools":  # a forced call: the call opening in the prompt, the arguments under a grammar
        forced = {**sampled, "tool_choice": "required", "max_tokens": 40}
        three = _chat(url, {**forced, "n": 3})
        ones = [_chat(url, {**forced, "seed": SEED + index}) for index in range(3)]
        assert _answers(three) == [answer for one in ones for answer in _answers(one)]
        assert all(answer[1] and answer[1][0][0] == "get_weather" for answer in _answers(three)), _answers(three)
