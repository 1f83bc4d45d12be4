"""``n`` > 1 on a real 2-stage chain: the prompt is prefilled once and forked per choice.  (The same
chain also serves completions' ``best_of`` and shows that the documented no-op fields of skippy/api/fields.py leave an answer unchanged.)

The stages' stats files show it: for ``n=4`` each stage computes the prompt once plus, per further
choice, the first choice's last prefill chunk (a fork copies the KV before it and computes that
chunk as the first choice did, so its first token is made the same way), and forks three
sessions.  Greedy forked choices equal the plain ``n=1`` answer (a wrong KV copy would diverge at
once); sampled choices differ from one another and a seeded request reproduces them.  (Requests
here opt out of the prefix cache so repeats are computed the same way.)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from skippy.api.server import serve_api
from skippy.driver.generator import Generator
from skippy.models.cache import ensure_model
from skippy.models.spec import demo

from stage_helpers import stage_chain

pytestmark = pytest.mark.slow

MODEL = "skippy-demo"
PROMPT = "Once upon a time, in a small village by the sea, there lived"
#: Longer than the driver's short-prompt limit (128 tokens), so its prefill takes several chunks.
LONG = " ".join(["Once upon a time, in a small village by the sea, there lived a fisherman."] * 30)


async def stats(paths: list[Path]) -> list[dict[str, Any]]:
    await trio.sleep(0.5)  # the stats files are rewritten a few times a second
    return [json.loads(path.read_text()) for path in paths]


async def test_n_choices_prefill_the_prompt_once_and_reproduce(tmp_path: Path) -> None:
    model = ensure_model(demo())
    generator = Generator.from_model(model)
    prompt_tokens = len(generator.encode(PROMPT))
    long_tokens = len(generator.encode(LONG))
    generator.close()
    async with stage_chain(str(model), ["0:4", "4:8"], tmp_path, ["--ctx-size", "1024"]) as stages:
        assert stages[0].address is not None
        paths = [stage.stats_path for stage in stages]
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve_api, model, stages[0].address, port=0, n_ctx=1024,
                                                        max_lanes=2, model_id=MODEL,
                                                        final_stage=stages[-1].address))  # direct return, the default
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 1234, "n": 4,
                    "prefix_cache": False}
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                response = await http.post("/v1/completions", json=body)
                before = await stats(paths)
                long = (await http.post("/v1/completions", json={**body, "prompt": LONG, "temperature": 0,
                                                                   "n": 4})).json()
                after = await stats(paths)
                assert response.status_code == 200, response.text
                first = response.json()
                again = (await http.post("/v1/completions", json=body)).json()
                greedy = {**body, "temperature": 0, "n": 3}
                forks = (await http.post("/v1/completions", json=greedy)).json()
                # n = 8 on stages with the default per-lane session quota (4): the forks run one at
                # a time, so a request never holds more than two sessions of its lane
                eight = await http.post("/v1/completions", json={**greedy, "n": 8})
                eight_streamed = await http.post("/v1/completions", json={**greedy, "n": 8, "stream": True})
                single = (await http.post("/v1/completions", json={**greedy, "n": 1})).json()
                streamed = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                    "temperature": 1.0, "seed": 7, "n": 3, "stream": True})
                chat = (await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                    "temperature": 1.0, "seed": 7, "n": 3})).json()
                too_many = await http.post("/v1/completions", json={**body, "n": 9})
                scored = (await http.post("/v1/completions", json={**body, "n": 3, "logprobs": 0})).json()
                best = (await http.post("/v1/completions", json={**body, "n": 1, "best_of": 3})).json()
                best_streamed = await http.post("/v1/completions", json={**body, "n": 1, "best_of": 3, "stream": True})
                plain = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                         "temperature": 0, "prefix_cache": False}
                no_ops = {"metadata": {"k": "v"}, "service_tier": "auto", "safety_identifier": "u1",
                          "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
                          "prediction": {"type": "content", "content": "unrelated"}, "store": False,
                          "parallel_tool_calls": True, "modalities": ["text"], "logprobs": False}
                answers = [(await http.post("/v1/chat/completions", json=fields)).json()
                           for fields in (plain, {**plain, **no_ops})]
            nursery.cancel_scope.cancel()
    texts = [choice["text"] for choice in first["choices"]]
    assert [choice["index"] for choice in first["choices"]] == [0, 1, 2, 3]
    assert len(set(texts)) > 1, texts
    assert [choice["text"] for choice in again["choices"]] == texts  # seeded: reproducible
    assert [choice["text"] for choice in forks["choices"]] == [single["choices"][0]["text"]] * 3  # forks are exact
    assert first["usage"]["prompt_tokens"] == prompt_tokens
    assert first["usage"]["completion_tokens"] == 4 * 8  # max_tokens 8 each (random weights rarely stop)
    assert forks["usage"]["completion_tokens"] == 3 * single["usage"]["completion_tokens"]
    assert eight.status_code == 200, eight.text
    assert [choice["index"] for choice in eight.json()["choices"]] == list(range(8))
    assert [choice["text"] for choice in eight.json()["choices"]] == [single["choices"][0]["text"]] * 8
    assert eight_streamed.status_code == 200, eight_streamed.text
    streamed_texts: dict[int, str] = {}
    for line in eight_streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                streamed_texts[choice["index"]] = streamed_texts.get(choice["index"], "") + choice["text"]
    assert streamed_texts == {index: single["choices"][0]["text"] for index in range(8)}
    # every stage: the prompt once, and each of the 3 forks copies the prompt up to the first
    # choice's last prefill chunk and computes that chunk again
    assert len({choice["text"] for choice in long["choices"]}) == 1, long  # greedy: four times the same
    forked = (after[0]["forked_tokens"] - before[0]["forked_tokens"]) // 3
    assert 0 < forked < long_tokens
    for old, new in zip(before, after):
        assert new["prefill_tokens"] - old["prefill_tokens"] == long_tokens + 3 * (long_tokens - forked), (old, new)
        assert new["forked_sessions"] - old["forked_sessions"] == (3 if forked else 0)
        assert new["forked_tokens"] - old["forked_tokens"] == 3 * forked
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    pieces: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            pieces[choice["index"]] = pieces.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(finishes) == [0, 1, 2]
    assert [pieces[index] for index in range(3)] == [choice["message"]["content"] for choice in chat["choices"]]
    assert too_many.status_code == 422 and too_many.json()["error"]["param"] == "n"
    # best_of: the choice with the highest mean token logprob of the same three seeded choices
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in scored["choices"]]
    assert [c["text"] for c in scored["choices"]] == texts[:3]  # logprobs do not change the samples
    assert [c["text"] for c in best["choices"]] == [texts[means.index(max(means))]]
    assert best["choices"][0]["logprobs"] is None and best["choices"][0]["index"] == 0
    assert best["usage"]["completion_tokens"] == scored["usage"]["completion_tokens"]
    assert best_streamed.status_code == 400 and best_streamed.json()["error"]["param"] == "best_of"
    # the documented no-op fields do not change the answer
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
