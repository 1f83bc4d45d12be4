"""gpt-oss Harmony answers: the analysis channel as reasoning, final as content, commentary calls
to ``functions.NAME`` as tool calls, in chat completions, Messages and Responses, streamed and not.

The stream is checked on its own (any split of the text into pieces gives the same fields), then on
a 2-stage chain of the tiny gpt-oss model served with the pinned llama.cpp tree's gpt-oss chat
template, the answers forced by grammars (random weights write no channels): a reasoning answer and
a tool call come back separated in all three APIs, and each streamed answer reassembles the whole one.
It runs twice: with the markers spelled as text (the SPM vocabulary), and as gpt-oss's special tokens
(the derived ``harmony`` vocabulary, the grammars naming the marker tokens).  Each run also forces a
named call (the grammar writes the header and arguments under the tool's schema, equal in every
API) and counts the next Responses turn with the reasoning sent back or kept by
``previous_response_id`` (the same prompt, longer than without the reasoning).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from skippy.api.harmony import HarmonyStream

from conftest import model_path
from stage_helpers import inprocess_chain

MODEL = "tiny-gpt-oss"
ROOT = Path(__file__).resolve().parent.parent
_TREES = [ROOT / "build" / "llama-src", ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp",
          *([Path(os.environ["SKIPPY_LLAMA_SRC"])] if os.environ.get("SKIPPY_LLAMA_SRC") else []),
          *([Path(os.environ["SKIPPY_VOCAB_DIR"]).parent] if os.environ.get("SKIPPY_VOCAB_DIR") else [])]
REASONED = ('"<|channel|>analysis<|message|>" [a-z]{3,12} "<|end|><|start|>assistant<|channel|>final<|message|>" '
            '[a-z]{3,12}')
CALLED = ('"<|channel|>analysis<|message|>" [a-z]{3,12} "<|end|><|start|>assistant to=functions.get_weather'
          '<|channel|>commentary <|constrain|>json<|message|>{\\"city\\": \\"" [a-z]{3,8} "\\"}"')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _template() -> str:
    for tree in _TREES:
        path = tree / "models" / "templates" / "openai-gpt-oss-120b.jinja"
        if path.is_file():
            return path.read_text()
    pytest.skip("the pinned llama.cpp tree (its models/templates/openai-gpt-oss-120b.jinja) is not here")


def split_all(text: str, pieces: list[int], prefix: str = "") -> tuple[str, str, list[tuple[str, str]]]:
    stream = HarmonyStream(prefix)
    reasoning, content, calls = [], [], []
    start = 0
    for end in [*pieces, len(text)]:
        r, c, k = stream.push(text[start:end])
        reasoning.append(r)
        content.append(c)
        calls += k
        start = end
    r, c, k = stream.finish()
    return "".join(reasoning) + r, "".join(content) + c, [(call.name, call.arguments) for call in calls + k]


@pytest.mark.parametrize(("text", "prefix", "expected"), [
    ("<|channel|>analysis<|message|>plan it<|end|><|start|>assistant<|channel|>final<|message|>The answer.",
     "", ("plan it", "The answer.", [])),
    ("<|channel|>analysis<|message|>look<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     '<|message|>{"a": 1}<|call|>', "", ("look", "", [("f", '{"a": 1}')])),
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a":2}', "", ("", "", [("f", '{"a": 2}')])),
    ('{"a": 3}', "<|channel|>commentary to=functions.g <|constrain|>json<|message|>", ("", "", [("g", '{"a": 3}')])),
    ("<|channel|>commentary to=functions.f<|message|>not json<|call|>", "", ("", "not json", [])),
    ("<|channel|>commentary<|message|>Let me check.<|end|>", "", ("", "Let me check.", [])),
    ("Plain words, no channels <|end|>", "", ("", "Plain words, no channels <|end|>", [])),
    ("<|channel|>analysis<|message|>never closed", "", ("never closed", "", [])),
    ("<|channel|>final<|message|>a <|e b<|return|>", "", ("", "a <|e b", [])),
    ("", "", ("", "", [])),
])
def test_any_split_into_pieces_gives_the_same_fields(text: str, prefix: str,
                                                     expected: tuple[str, str, list[tuple[str, str]]]) -> None:
    assert split_all(text, [], prefix) == expected
    assert split_all(text, list(range(1, len(text))), prefix) == expected  # one character at a time
    for cut in range(len(text) + 1):
        assert split_all(text, [cut], prefix) == expected, cut


def test_not_parallel_keeps_the_first_call() -> None:
    text = ('<|channel|>commentary to=functions.f<|message|>{}<|call|>'
            '<|start|>assistant to=functions.g<|channel|>commentary<|message|>{}<|call|>')
    stream = HarmonyStream(parallel=False)
    calls = stream.push(text)[2] + stream.finish()[2]
    assert [call.name for call in calls] == ["f"]


def _chat_stream(text: str) -> tuple[str, str, list[dict[str, Any]]]:
    reasoning = content = ""
    calls: list[dict[str, Any]] = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
    return reasoning, content, calls


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


#: The same answers with the markers as the vocabulary's special tokens (grammar token references).
SPECIAL_REASONED = ('<|channel|> "analysis" <|message|> [a-z]{3,12} <|end|> <|start|> "assistant" <|channel|> "final" '
                    '<|message|> [a-z]{3,12}')
SPECIAL_CALLED = ('<|channel|> "analysis" <|message|> [a-z]{3,12} <|end|> <|start|> "assistant to=functions.get_weather" '
                  '<|channel|> "commentary " <|constrain|> "json" <|message|> "{\\"city\\": \\"" [a-z]{3,8} "\\"}"')


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["llama-spm", "harmony"], ids=["text-markers", "special-tokens"])
async def test_harmony_answers_are_separated_in_every_api_streamed_or_not(vocab: str) -> None:
    """``text-markers``: the tiny gpt-oss with the SPM vocabulary spells the markers as text;
    ``special-tokens``: the derived ``harmony`` vocabulary (skippy/models/vocab_files.py) has them as
    gpt-oss's special tokens, ``<|return|>`` / ``<|call|>`` end the generation and the grammars
    pick the marker tokens themselves, so the markers reach the parser only because they are rendered."""
    from skippy.api.app import ChainService, create_app
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.runtime.tokenizer import Tokenizer

    template = _template()
    special = vocab == "harmony"
    path = model_path("gpt-oss", dtype="Q8_0", vocab="harmony") if special else model_path("gpt-oss")
    reasoned, called = (SPECIAL_REASONED, SPECIAL_CALLED) if special else (REASONED, CALLED)
    generator = Generator(Tokenizer(path), chat_template=template, n_ctx=1024, chunk_size=32)
    markers = [generator.tokenizer.encode(m, add_special=False, parse_special=True) for m in ("<|channel|>", "<|end|>")]
    assert all(len(ids) == 1 for ids in markers) == special, markers
    if special:  # gpt-oss's ends: <|return|> and <|call|> end the generation, <|end|> (between messages) does not
        ends = generator.tokenizer.end_of_generation_tokens()
        assert {generator.tokenizer.encode(m, add_special=False, parse_special=True)[0]
                for m in ("<|return|>", "<|call|>")} <= ends and markers[1][0] not in ends
    user = [{"role": "user", "content": "Weather in Bern?"}]
    ask = {"model": MODEL, "messages": user, "max_tokens": 200, "temperature": 1.0, "seed": 5,
           "grammar": f"root ::= {reasoned}"}
    tool_ask = {**ask, "tools": TOOLS, "grammar": f"root ::= {called}"}
    claude_tools = [{"name": "get_weather", "description": "The weather in a city",
                     "input_schema": TOOLS[0]["function"]["parameters"]}]
    response_tools = [{"type": "function", **TOOLS[0]["function"]}]
    # a bounded schema (random weights would write an endless string)
    cities = {"type": "object", "properties": {"city": {"enum": ["Bern", "Zurich", "Geneva"]}}, "required": ["city"]}
    forced_tools = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": cities}}]
    forced = {"model": MODEL, "messages": user, "max_tokens": 200, "temperature": 1.0, "seed": 7, "tools": forced_tools,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    results: dict[str, Any] = {}
    try:
        async with inprocess_chain(["0:2", "2:4"], model=str(path), ctx_size=1024) as servers:
            pool = LanePool(servers[0].address, max_lanes=1)
            service = ChainService(generator, pool, MODEL)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                         base_url="http://skippy", timeout=120) as http:
                for name, body in (("chat", ask), ("chat_tool", tool_ask)):
                    results[name] = (await http.post("/v1/chat/completions", json=body)).json()
                    results[name + "_stream"] = (await http.post("/v1/chat/completions",
                                                                 json={**body, "stream": True})).text
                    other = {"model": MODEL, "messages": user, "max_tokens": 200, "temperature": 1.0, "seed": 5,
                             "grammar": body["grammar"], **({"tools": claude_tools} if "tools" in body else {})}
                    results[name + "_claude"] = (await http.post("/v1/messages", json=other)).json()
                    results[name + "_claude_stream"] = (await http.post("/v1/messages",
                                                                        json={**other, "stream": True})).text
                    responses = {"model": MODEL, "input": user, "max_output_tokens": 200, "temperature": 1.0,
                                 "seed": 5, "grammar": body["grammar"],
                                 **({"tools": response_tools} if "tools" in body else {})}
                    results[name + "_responses"] = (await http.post("/v1/responses", json=responses)).json()
                    results[name + "_responses_stream"] = (await http.post("/v1/responses",
                                                                           json={**responses, "stream": True})).text
                # the Responses turn after the call: its reasoning sent back (as the SDKs send the output
                # items), or kept by previous_response_id, renders the same prompt
                first = results["chat_tool_responses"]
                result = {"type": "function_call_output", "call_id": first["output"][-1]["call_id"], "output": "sunny"}
                count = {"model": MODEL, "tools": response_tools}
                results["count_kept"] = (await http.post("/v1/responses/input_tokens", json={
                    **count, "previous_response_id": first["id"], "input": [result]})).json()
                results["count_sent"] = (await http.post("/v1/responses/input_tokens", json={
                    **count, "input": [*user, *first["output"], result]})).json()
                results["count_bare"] = (await http.post("/v1/responses/input_tokens", json={
                    **count, "input": [*user, first["output"][-1], result]})).json()
                # a forced call: the prompt ends in the call's opening, a grammar writes name, header and arguments
                results["forced"] = (await http.post("/v1/chat/completions", json=forced)).json()
                results["forced_stream"] = (await http.post("/v1/chat/completions",
                                                            json={**forced, "stream": True})).text
                results["forced_responses"] = (await http.post("/v1/responses", json={
                    "model": MODEL, "input": user, "max_output_tokens": 200, "temperature": 1.0, "seed": 7,
                    "tools": [{"type": "function", **forced_tools[0]["function"]}],
                    "tool_choice": {"type": "function", "name": "get_weather"}})).json()
                results["forced_claude"] = (await http.post("/v1/messages", json={
                    "model": MODEL, "messages": user, "max_tokens": 200, "temperature": 1.0, "seed": 7,
                    "tools": [{**claude_tools[0], "input_schema": cities}],
                    "tool_choice": {"type": "tool", "name": "get_weather"}})).json()
                service.reasoning_format = "none"
                results["inline"] = (await http.post("/v1/chat/completions", json=ask)).json()
            await pool.aclose()
    finally:
        generator.close()

    # the reasoning answer
    message = results["chat"]["choices"][0]["message"]
    thought, said = message["reasoning_content"], message["content"]
    assert re.fullmatch("[a-z]{3,12}", thought) and re.fullmatch("[a-z]{3,12}", said), message
    assert _chat_stream(results["chat_stream"]) == (thought, said, [])
    raw = results["inline"]["choices"][0]["message"]
    assert "reasoning_content" not in raw and thought in raw["content"] and "<|channel|>final" in raw["content"]
    assert results["chat_claude"]["content"] == [{"type": "thinking", "thinking": thought, "signature": ""},
                                                 {"type": "text", "text": said}]
    deltas = [e["delta"] for e in _events(results["chat_claude_stream"]) if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == thought
    assert "".join(d.get("text", "") for d in deltas) == said
    output = results["chat_responses"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == thought and output[1]["content"][0]["text"] == said
    events = _events(results["chat_responses_stream"])
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == said

    # the tool call
    choice = results["chat_tool"]["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None, choice
    thought = message["reasoning_content"]
    assert re.fullmatch("[a-z]{3,12}", thought)
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert re.fullmatch("[a-z]{3,8}", arguments["city"])
    reasoning, content, streamed_calls = _chat_stream(results["chat_tool_stream"])
    assert (reasoning, content) == (thought, "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed_calls] == \
        [("get_weather", arguments)]
    claude = results["chat_tool_claude"]
    assert claude["stop_reason"] == "tool_use"
    assert [block["type"] for block in claude["content"]] == ["thinking", "tool_use"]
    assert claude["content"][0]["thinking"] == thought
    assert (claude["content"][1]["name"], claude["content"][1]["input"]) == ("get_weather", arguments)
    events = _events(results["chat_tool_claude_stream"])
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [block["type"] for block in starts] == ["thinking", "tool_use"] and starts[1]["name"] == "get_weather"
    partial = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == arguments
    output = results["chat_tool_responses"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert output[0]["content"][0]["text"] == thought
    assert (output[1]["name"], json.loads(output[1]["arguments"])) == ("get_weather", arguments)
    events = _events(results["chat_tool_responses_stream"])
    completed = next(e for e in events if e["type"] == "response.completed")["response"]["output"]
    assert [item["type"] for item in completed] == ["reasoning", "function_call"]
    assert json.loads(completed[1]["arguments"]) == arguments

    # the reasoning sent back renders (gpt-oss renders a tool-call turn's analysis), kept or sent alike
    kept, sent, bare = (results[k]["input_tokens"] for k in ("count_kept", "count_sent", "count_bare"))
    assert kept == sent > bare, (kept, sent, bare)

    # the forced call: arguments under the tool's schema, the same in every API
    choice = results["forced"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and arguments["city"] in ("Bern", "Zurich", "Geneva"), call
    _, _, streamed_calls = _chat_stream(results["forced_stream"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed_calls] == \
        [("get_weather", arguments)]
    output = results["forced_responses"]["output"]
    assert [(item["name"], json.loads(item["arguments"])) for item in output if item["type"] == "function_call"] == \
        [("get_weather", arguments)]
    assert [(block["name"], block["input"]) for block in results["forced_claude"]["content"]
            if block["type"] == "tool_use"] == [("get_weather", arguments)]
