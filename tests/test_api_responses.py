"""OpenAI's Responses API with the official ``openai`` client against a real skippy server.

A 2-stage chain of the generated tiny llama runs in this process behind ``serve_api`` (the default
path: direct return); the synchronous ``openai`` client runs in a worker thread.  Every response
must equal the chat-completions answer for the same prompt and settings (greedy and seeded),
plain, streamed (raw events, and the SDK's ``responses.stream`` accumulator) and continued with
``previous_response_id``; ``input_tokens.count`` equals chat's ``prompt_tokens``; a JSON Schema
``text.format`` is followed; unknown ids and unserved fields are 400s naming them.  Function
tools, a forced call and its output item run on the Qwen 2.5 template (it renders tools).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from skippy.api.errors import ApiError
from skippy.api.responses import to_chat_body
from skippy.api.server import serve_api

from stage_helpers import inprocess_chain

MODEL = "tiny"
SYSTEM = "You answer briefly."
QUESTION = "Tell me about the quick brown fox."
QWEN25 = Path(__file__).resolve().parent.parent / "build" / "llama-src" / "models" / "templates" / \
    "Qwen-Qwen2.5-7B-Instruct.jinja"


def clients_talk(url: str) -> dict[str, Any]:
    openai = pytest.importorskip("openai")
    out: dict[str, Any] = {}
    chat_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for name, settings in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.9, "extra_body": {"seed": 7}})):
            seed = settings.get("extra_body", {}).get("seed")
            response = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12,
                                               **settings)
            chat = client.chat.completions.create(model=MODEL, messages=chat_messages, max_tokens=12,
                                                  temperature=settings["temperature"],
                                                  **({"seed": seed} if seed is not None else {}))
            events = list(client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION,
                                                  max_output_tokens=12, stream=True, **settings))
            out[name] = (response, chat, events)
        first = out["greedy"][0]
        follow = client.responses.create(model=MODEL, instructions=SYSTEM, previous_response_id=first.id,
                                         input="And then?", max_output_tokens=8, temperature=0)
        follow_chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
            *chat_messages, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}])
        out["follow"] = (follow, follow_chat)
        out["count"] = client.responses.input_tokens.count(model=MODEL, instructions=SYSTEM, input=QUESTION)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        json_request = {"model": MODEL, "input": QUESTION, "max_output_tokens": 40, "extra_body": {"seed": 3},
                        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
        out["json"] = client.responses.create(**json_request)
        # the SDK's accumulator (it needs response.completed: the grammar ends the answer)
        with client.responses.stream(**json_request) as stream:
            out["accumulated"] = stream.get_final_response()
        errors = {}
        for label, call in (
                ("previous", lambda: client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")),
                ("reasoning", lambda: client.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})),
                ("web search", lambda: client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])),
                ("background", lambda: client.responses.create(model=MODEL, input="hi", background=True)),
        ):
            try:
                call()
            except openai.APIStatusError as exc:
                errors[label] = (exc.status_code, exc.body)
        out["errors"] = errors
    return out


@pytest.mark.slow
async def test_the_openai_client_gets_the_chat_completions_answers(tiny_llama: Path) -> None:
    pytest.importorskip("openai")
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), ctx_size=512) as servers:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(
                serve_api, tiny_llama, servers[0].address, port=0, n_ctx=512, max_lanes=1, model_id=MODEL,
                final_stage=servers[-1].address))
            out = await trio.to_thread.run_sync(clients_talk, url)
            nursery.cancel_scope.cancel()
    for name in ("greedy", "seeded"):
        response, chat, events = out[name]
        text = chat.choices[0].message.content
        assert response.object == "response" and response.model == MODEL and response.output_text == text, name
        assert [item.type for item in response.output] == ["message"]
        length = chat.choices[0].finish_reason == "length"
        assert response.status == ("incomplete" if length else "completed")
        if length:
            assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == f"response.{response.status}"
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == text
        assert events[-1].response.output_text == text
    follow, follow_chat = out["follow"]
    assert follow.output_text == follow_chat.choices[0].message.content
    assert follow.usage.input_tokens == follow_chat.usage.prompt_tokens
    assert out["count"].input_tokens == out["greedy"][1].usage.prompt_tokens
    answer = out["json"]
    assert answer.status == "completed" and isinstance(json.loads(answer.output_text)["ok"], bool)
    assert out["accumulated"].output_text == answer.output_text
    errors = out["errors"]
    for label, param in (("previous", "previous_response_id"), ("reasoning", "reasoning.effort"),
                         ("web search", "tools[0].type"), ("background", "background")):
        status, body = errors[label]
        assert status == 400 and body["param"] == param, (label, body)


def test_items_become_the_chat_body() -> None:
    body = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 9, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "developer", "content": "Answer in French."},
    ], "tools": [{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "text": {"format": {"type": "json_object"}},
        "store": False, "truncation": "disabled", "include": []}
    chat = to_chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "system", "content": "Answer in French."},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                               "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat["max_tokens"], chat["response_format"]) == (9, {"type": "json_object"})


@pytest.mark.parametrize(("change", "param"), [
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
], ids=["encrypted-reasoning", "computer-call", "image", "truncation", "conversation", "verbosity", "tool-choice"])
def test_what_the_responses_api_does_not_serve_is_a_400_naming_it(change: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as raised:
        to_chat_body({"model": MODEL, "input": "hi", **change})
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


@pytest.mark.slow
async def test_function_tools_a_forced_call_and_its_output_match_chat_completions() -> None:
    if not QWEN25.is_file():
        pytest.skip(f"{QWEN25} not built (llama.cpp source tree)")
    from skippy.api.app import ChainService, create_app
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.models.cache import ensure_model
    from skippy.models.spec import demo
    from skippy.runtime.tokenizer import Tokenizer

    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                  "additionalProperties": False}
    model = ensure_model(demo())
    generator = Generator(Tokenizer(model), chat_template=QWEN25.read_text(), n_ctx=1024, speculation=False)
    ask = {"model": MODEL, "temperature": 1.0, "seed": 5}
    tool = {"type": "function", "name": "get_weather", "description": "The weather of a city", "parameters": parameters}
    chat_tool = {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")}}
    try:
        async with inprocess_chain(["0:4", "4:8"], model=str(model), ctx_size=1024) as servers:
            generator.direct_return = lambda: servers[-1].address
            pool = LanePool(servers[0].address, max_lanes=1)
            app = create_app(ChainService(generator, pool, MODEL))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy",
                                         timeout=60) as http:
                forced = {**ask, "max_output_tokens": 60, "input": "Weather in Paris?", "tools": [tool],
                          "tool_choice": {"type": "function", "name": "get_weather"}}
                response = await http.post("/v1/responses", json=forced)
                streamed = await http.post("/v1/responses", json={**forced, "stream": True})
                chat = await http.post("/v1/chat/completions", json={
                    **ask, "max_tokens": 60, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "tools": [chat_tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
                assert response.status_code == 200, response.text
                call = response.json()["output"][-1]
                answered = await http.post("/v1/responses", json={
                    **ask, "max_output_tokens": 8, "tools": [tool], "previous_response_id": response.json()["id"],
                    "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]})
                chat_answered = await http.post("/v1/chat/completions", json={
                    **ask, "max_tokens": 8, "tools": [chat_tool], "messages": [
                        {"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": None, "tool_calls": [{
                            "id": call["call_id"], "type": "function",
                            "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}]})
            await pool.aclose()
    finally:
        generator.direct_return = None
        generator.close()
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    (expected,) = chat.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["arguments"]) == json.loads(expected["function"]["arguments"])
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    done = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert json.loads(done[-1]["arguments"]) == json.loads(call["arguments"])
    assert events[-1]["type"] == "response.completed"
    assert answered.status_code == 200, answered.text
    answer = answered.json()
    text = "".join(part["text"] for item in answer["output"] if item["type"] == "message" for part in item["content"])
    assert text == chat_answered.json()["choices"][0]["message"]["content"]
    assert answer["usage"]["input_tokens"] == chat_answered.json()["usage"]["prompt_tokens"]
