"""The generic tool-call format (a chat template that renders no tools), on a real 2-stage chain.

The parser is checked on the documented answer shapes; then the tiny llama, served with the plain
transcript (no tools in its template), gets tools: the system prompt describes them, the grammar of
the generic schema makes random weights answer in its JSON, so ``tool_choice`` required comes back
as calls of the allowed function whose arguments validate against its schema, in chat completions
(streamed and not), Messages and Responses; ``auto`` answers either calls or text; a history with
calls and results renders (calls as JSON, results as a user message).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from skippy.api.generic_tools import FORMAT, generic_messages, generic_schema

from stage_helpers import inprocess_chain

MODEL = "tiny"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
              "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                           "parameters": PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize(("text", "expected"), [
    ('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}',
     ([("f", '{"a": 1}'), ("g", "{}")], "")),
    ('{"tool_call": {"name": "f", "arguments": {"a": 1}}}', ([("f", '{"a": 1}')], "")),
    ('{"response": "Hello."}', ([], "Hello.")),
    ('{"response": 5}', None),
    ('{"tool_calls": []}', None),
    ("not json", None),
])
def test_generic_answers_parse(text: str, expected: Any) -> None:
    parsed = FORMAT.parse(text)
    assert (None if parsed is None else ([(c.name, c.arguments) for c in parsed[0]], parsed[1])) == expected


def test_generic_schema_and_messages() -> None:
    schema = generic_schema(TOOLS, None, False, True)
    jsonschema.validate({"response": "hi"}, schema)
    jsonschema.validate({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Bern"}}]}, schema)
    required = generic_schema(TOOLS, "get_time", True, False)
    jsonschema.validate({"tool_call": {"name": "get_time", "arguments": {}}}, required)
    for wrong in ({"response": "hi"}, {"tool_call": {"name": "get_weather", "arguments": {"city": "x"}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    messages = generic_messages([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "9"}],
        TOOLS, True)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call any of the following tools")
    assert '"get_time"' in messages[0]["content"] and "`tool_calls`" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Bern"},
                                                                  "id": "c1"}]}
    assert [json.loads(line) for line in messages[3]["content"].splitlines()] == [
        {"tool_response": {"tool_call_id": "c1", "content": "sunny"}},
        {"tool_response": {"tool_call_id": "c2", "content": "9"}}]


def _streamed_calls(text: str) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                calls += choice["delta"].get("tool_calls") or []
    return calls


@pytest.mark.slow
async def test_generic_tool_calls_on_a_chain(tiny_llama: Path) -> None:
    from skippy.api.app import ChainService, create_app
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.runtime.tokenizer import Tokenizer

    generator = Generator(Tokenizer(tiny_llama), n_ctx=2048, chunk_size=64)
    user = [{"role": "user", "content": "Weather in Bern?"}]
    ask = {"model": MODEL, "messages": user, "max_tokens": 120, "temperature": 1.0, "seed": 3, "tools": TOOLS,
           "parallel_tool_calls": False}  # random weights would go on adding calls to a list
    try:
        async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), ctx_size=2048) as servers:
            pool = LanePool(servers[0].address, max_lanes=1)
            service = ChainService(generator, pool, MODEL)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                         base_url="http://skippy", timeout=120) as http:
                plain = (await http.post("/v1/chat/completions", json={**ask, "tools": None})).json()
                named = [(await http.post("/v1/chat/completions", json={
                    **ask, "seed": seed, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
                    )).json() for seed in range(4)]
                required = (await http.post("/v1/chat/completions", json={**ask, "tool_choice": "required"})).json()
                streamed = (await http.post("/v1/chat/completions", json={
                    **ask, "tool_choice": "required", "stream": True})).text
                auto = (await http.post("/v1/chat/completions", json=ask)).json()
                unique = {"type": "function", "function": {"name": "tag", "parameters": {
                    "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                              "uniqueItems": True}}}}}
                refused = await http.post("/v1/chat/completions", json={**ask, "tools": [*TOOLS, unique]})
                call = required["choices"][0]["message"]["tool_calls"][0]
                history = (await http.post("/v1/chat/completions", json={**ask, "max_tokens": 4, "messages": [
                    *user, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]})).json()
                claude = (await http.post("/v1/messages", json={
                    "model": MODEL, "messages": user, "max_tokens": 120, "temperature": 1.0, "seed": 3,
                    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                    "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                               "input_schema": t["function"]["parameters"]} for t in TOOLS]})).json()
                responses = (await http.post("/v1/responses", json={
                    "model": MODEL, "input": user, "max_output_tokens": 120, "temperature": 1.0, "seed": 3,
                    "tool_choice": "required", "parallel_tool_calls": False,
                    "tools": [{"type": "function", **t["function"]} for t in TOOLS]})).json()
            await pool.aclose()
    finally:
        generator.close()
    assert refused.status_code == 400  # the generic answer's grammar would not enforce it
    assert refused.json()["error"]["param"] == f"tools[{len(TOOLS)}].function.parameters.properties.tags.uniqueItems"
    # the tools are described in the prompt
    assert required["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50
    for answer in named:
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        for made in choice["message"]["tool_calls"]:
            assert made["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(made["function"]["arguments"]), PARAMETERS)
    choice = required["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    names = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    made_calls = choice["message"]["tool_calls"]
    for made in made_calls:
        jsonschema.validate(json.loads(made["function"]["arguments"]), names[made["function"]["name"]])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in _streamed_calls(streamed)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in made_calls]
    message = auto["choices"][0]["message"]
    assert message.get("tool_calls") or isinstance(message["content"], str)
    assert history["usage"]["prompt_tokens"] > required["usage"]["prompt_tokens"]
    blocks = claude["content"]
    assert claude["stop_reason"] == "tool_use" and blocks and all(b["type"] == "tool_use" for b in blocks)
    for block in blocks:
        jsonschema.validate(block["input"], names[block["name"]])
    items = responses["output"]
    assert items and all(item["type"] == "function_call" for item in items)
    assert [(i["name"], i["arguments"]) for i in items] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in made_calls]
