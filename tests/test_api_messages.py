"""Anthropic's Messages API with the official ``anthropic`` client against a real skippy server.

A 2-stage chain of the generated tiny llama runs in this process, behind ``serve_api`` with an
API key (the default path: direct return); the synchronous ``anthropic`` and ``openai`` clients
run in a worker thread.  Every Messages answer must equal the chat-completions answer for the
same prompt and settings (greedy and seeded), streamed or not; ``system``, ``stop_sequences``
(``stop_reason`` / ``stop_sequence``), ``count_tokens``, ``x-api-key`` and errors in Anthropic's
shape are checked, and unread fields are 400s naming them.  The translation of content blocks,
tools and tool results is checked without a chain (:func:`to_chat_body`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from skippy.api.auth import ApiKeys
from skippy.api.errors import ApiError
from skippy.api.messages import to_chat_body
from skippy.api.server import serve_api

from stage_helpers import inprocess_chain

MODEL = "tiny"
KEY = "sk-test-messages"
SYSTEM = "You answer briefly."
QUESTION = "Tell me about the quick brown fox."


def conversation(client_kind: str, **settings: Any) -> dict[str, Any]:
    if client_kind == "anthropic":
        return {"model": MODEL, "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}], **settings}
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            **settings}


def clients_talk(url: str) -> dict[str, Any]:
    """Everything the clients do (a worker thread: the clients block)."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    out: dict[str, Any] = {}
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60) as claude, \
            openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60) as gpt:
        # the current SDK has no sampling parameters in its signature: they go as extra body fields
        for name, settings in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.9, "seed": 7})):
            extra = {"extra_body": settings}
            message = claude.messages.create(**conversation("anthropic", max_tokens=12), **extra)
            chat = gpt.chat.completions.create(**conversation("openai", max_tokens=12, **settings))
            with claude.messages.stream(**conversation("anthropic", max_tokens=12), **extra) as stream:
                pieces = list(stream.text_stream)
                final = stream.get_final_message()
            out[name] = (message, chat, pieces, final)
        text = out["greedy"][0].content[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        out["stop"] = (stop, claude.messages.create(**conversation("anthropic", max_tokens=12), stop_sequences=[stop],
                                                    extra_body={"temperature": 0}))
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        out["json"] = claude.messages.create(**conversation("anthropic", max_tokens=40), extra_body={"seed": 3},
                                             output_config={"format": {"type": "json_schema", "schema": schema}},
                                             speed="standard", cache_control={"type": "ephemeral"})
        out["count"] = claude.messages.count_tokens(**conversation("anthropic"))
        errors = {}
        for label, call in (
                ("unknown field", lambda: claude.messages.create(**conversation("anthropic", max_tokens=4),
                                                                 extra_body={"frequency_penalty": 1})),
                ("image block", lambda: claude.messages.create(model=MODEL, max_tokens=4, messages=[{
                    "role": "user", "content": [{"type": "image", "source": {
                        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])),
                ("thinking", lambda: claude.messages.create(**conversation("anthropic", max_tokens=4),
                                                            thinking={"type": "enabled", "budget_tokens": 1024})),
                ("effort", lambda: claude.messages.create(**conversation("anthropic", max_tokens=4),
                                                          output_config={"effort": "high"})),
                ("container", lambda: claude.messages.create(**conversation("anthropic", max_tokens=4),
                                                             container="c-1")),
                ("model", lambda: claude.messages.create(**{**conversation("anthropic", max_tokens=4),
                                                            "model": "claude-3-haiku"})),
        ):
            try:
                call()
            except anthropic.APIStatusError as exc:
                errors[label] = (exc.status_code, exc.body)
        with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as stranger:
            try:
                stranger.messages.create(**conversation("anthropic", max_tokens=4))
            except anthropic.AuthenticationError as exc:
                errors["key"] = (exc.status_code, exc.body)
        out["errors"] = errors
    return out


@pytest.mark.slow
async def test_the_anthropic_client_gets_the_chat_completions_answers(tiny_llama: Path) -> None:
    pytest.importorskip("anthropic")
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), ctx_size=512) as servers:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(
                serve_api, tiny_llama, servers[0].address, port=0, n_ctx=512, max_lanes=1, model_id=MODEL,
                keys=ApiKeys([KEY]), final_stage=servers[-1].address))
            out = await trio.to_thread.run_sync(clients_talk, url)
            nursery.cancel_scope.cancel()
    for name in ("greedy", "seeded"):
        message, chat, pieces, final = out[name]
        assert message.type == "message" and message.role == "assistant" and message.model == MODEL
        assert [block.type for block in message.content] == ["text"]
        assert message.content[0].text == chat.choices[0].message.content, name
        assert "".join(pieces) == message.content[0].text and final.content[0].text == message.content[0].text
        assert message.stop_reason == final.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
            chat.choices[0].finish_reason]
        usage = message.usage
        assert usage.output_tokens == chat.usage.completion_tokens == final.usage.output_tokens
        assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    stop, stopped = out["stop"]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == out["greedy"][0].content[0].text.split(stop)[0]
    assert out["count"].input_tokens == out["greedy"][1].usage.prompt_tokens
    answer = out["json"]
    if answer.stop_reason == "end_turn":  # the grammar's end (random weights may run out of tokens first)
        assert isinstance(json.loads(answer.content[0].text)["ok"], bool)
    else:
        assert answer.content[0].text.startswith("{")
    errors = out["errors"]
    for label, param in (("unknown field", "frequency_penalty"), ("image block", "messages[0].content[0]"),
                         ("thinking", "thinking"), ("effort", "output_config.effort"), ("container", "container")):
        status, body = errors[label]
        assert status == 400 and body["type"] == "error", (label, body)
        assert body["error"]["type"] == "invalid_request_error" and param in body["error"]["message"], (label, body)
    assert errors["model"][0] == 404 and errors["model"][1]["error"]["type"] == "not_found_error"
    assert errors["key"][0] == 401 and errors["key"][1]["error"]["type"] == "authentication_error"


def test_content_blocks_tools_and_results_become_the_chat_body() -> None:
    body = {
        "model": MODEL, "max_tokens": 20, "system": [{"type": "text", "text": "Be brief.", "cache_control": {
            "type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
                "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [{"name": "get_weather", "description": "Weather of a city", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "metadata": {"user_id": "u-1"}, "thinking": {"type": "disabled"},
    }
    chat = to_chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city", "parameters": body["tools"][0]["input_schema"]}}]
    assert list(chat["tools"][0]["function"]) == ["name", "description", "parameters"]  # the rendered JSON's order
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["stop"], chat["user"], chat["max_tokens"]) == (["END"], "u-1", 20)
    named = to_chat_body({**body, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert to_chat_body({"model": MODEL, "messages": body["messages"]}, counting=True)["messages"] == \
        chat["messages"][1:]


@pytest.mark.parametrize(("change", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages[0].name"),
    ({"tool_choice": {"type": "auto", "name": "x"}}, "tool_choice.name"),
    ({"metadata": {"tenant": "x"}}, "metadata.tenant"),
], ids=["openai-field", "server-tool", "document-block", "user-tool_use", "message-key", "tool_choice-key",
        "metadata-key"])
def test_what_the_messages_api_does_not_read_is_a_400_naming_it(change: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(ApiError) as raised:
        to_chat_body(body)
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


async def test_messages_errors_have_anthropic_shape_and_x_api_key_is_a_key(tiny_llama: Path) -> None:
    """Without a chain (a lane pool pointed nowhere): a key in ``x-api-key`` passes, a wrong one is
    Anthropic's 401, a bad body Anthropic's 400, and chat completions keep OpenAI's shape."""
    from skippy.api.app import ChainService, create_app
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.net.address import Address

    generator = Generator.from_model(tiny_llama, n_ctx=512)
    try:
        app = create_app(ChainService(generator, LanePool(Address("127.0.0.1", 9), max_lanes=1, connect_timeout=0.5),
                                      MODEL, keys=ApiKeys([KEY])))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy") as http:
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            wrong = await http.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
            bad = await http.post("/v1/messages", json={**body, "n": 2}, headers={"x-api-key": KEY})
            missing = await http.post("/v1/messages", json={k: v for k, v in body.items() if k != "max_tokens"},
                                      headers={"x-api-key": KEY})
            counted = await http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": body["messages"]},
                                      headers={"x-api-key": KEY})
            openai_shape = await http.post("/v1/chat/completions", json={**body, "bogus": 1},
                                           headers={"Authorization": f"Bearer {KEY}"})
    finally:
        generator.close()
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert bad.status_code == 400 and bad.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": bad.json()["error"]["message"]}} and "'n'" in bad.text
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 1
    assert openai_shape.status_code == 400 and openai_shape.json()["error"]["param"] == "bogus"


QWEN25 = Path(__file__).resolve().parent.parent / "build" / "llama-src" / "models" / "templates" / \
    "Qwen-Qwen2.5-7B-Instruct.jinja"
WEATHER = {"name": "get_weather", "description": "The weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.mark.slow
async def test_tools_a_forced_call_and_its_result_match_chat_completions() -> None:
    """The demo model served with the published Qwen 2.5 template (it renders tools): a named
    ``tool_choice`` forces a call through the schema's grammar; the ``tool_use`` block equals the
    chat answer's tool call, streamed or not, and a ``tool_result`` turn renders the same prompt
    as the chat body with a ``tool`` message (same ``input_tokens`` as ``prompt_tokens``)."""
    if not QWEN25.is_file():
        pytest.skip(f"{QWEN25} not built (llama.cpp source tree)")
    from skippy.api.app import ChainService, create_app
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.models.cache import ensure_model
    from skippy.models.spec import demo
    from skippy.runtime.tokenizer import Tokenizer

    model = ensure_model(demo())
    generator = Generator(Tokenizer(model), chat_template=QWEN25.read_text(), n_ctx=1024, speculation=False)
    ask = {"model": MODEL, "max_tokens": 60, "temperature": 1.0, "seed": 5,
           "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    try:
        async with inprocess_chain(["0:4", "4:8"], model=str(model), ctx_size=1024) as servers:
            generator.direct_return = lambda: servers[-1].address
            pool = LanePool(servers[0].address, max_lanes=1)
            app = create_app(ChainService(generator, pool, MODEL))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy",
                                         timeout=60) as http:
                message = await http.post("/v1/messages", json={
                    **ask, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}})
                streamed = await http.post("/v1/messages", json={
                    **ask, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "stream": True})
                chat = await http.post("/v1/chat/completions", json={
                    **ask, "tools": [{"type": "function", "function": {
                        "name": "get_weather", "description": WEATHER["description"],
                        "parameters": WEATHER["input_schema"]}}],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
                assert message.status_code == 200, message.text
                use = message.json()["content"][-1]
                follow = [*ask["messages"], {"role": "assistant", "content": [use]}, {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]}]
                counted = await http.post("/v1/messages/count_tokens", json={
                    "model": MODEL, "messages": follow, "tools": [WEATHER]})
                answered = await http.post("/v1/messages", json={**ask, "messages": follow, "tools": [WEATHER]})
                chat_follow = await http.post("/v1/chat/completions", json={
                    **ask, "max_tokens": 8, "tools": [{"type": "function", "function": {
                        "name": "get_weather", "description": WEATHER["description"],
                        "parameters": WEATHER["input_schema"]}}],
                    "messages": [*ask["messages"], {"role": "assistant", "content": None, "tool_calls": [{
                        "id": use["id"], "type": "function", "function": {
                            "name": "get_weather", "arguments": json.dumps(use["input"])}}]},
                                 {"role": "tool", "tool_call_id": use["id"], "content": "sunny"}]})
            await pool.aclose()
    finally:
        generator.direct_return = None
        generator.close()
    body = message.json()
    assert body["stop_reason"] == "tool_use" and use["type"] == "tool_use" and use["name"] == "get_weather"
    (call,) = chat.json()["choices"][0]["message"]["tool_calls"]
    assert use["input"] == json.loads(call["function"]["arguments"]) and isinstance(use["input"]["city"], str)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [event["content_block"] for event in events if event["type"] == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_weather"
    partial = "".join(event["delta"]["partial_json"] for event in events
                      if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == use["input"] and events[-2]["delta"]["stop_reason"] == "tool_use"
    assert answered.status_code == 200, answered.text
    assert counted.json()["input_tokens"] == chat_follow.json()["usage"]["prompt_tokens"]


async def test_routes_without_v1_are_the_same_routes(tiny_llama: Path) -> None:
    """Clients whose base_url lacks /v1 (llama-server serves both): the same handlers, the same errors."""
    from skippy.api.app import ChainService, create_app, endpoint_label
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.net.address import Address

    generator = Generator.from_model(tiny_llama, n_ctx=512)
    try:
        app = create_app(ChainService(generator, LanePool(Address("127.0.0.1", 9), max_lanes=1, connect_timeout=0.5),
                                      MODEL))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy") as http:
            models = (await http.get("/models")).json()
            model = await http.get(f"/models/{MODEL}")
            counted = (await http.post("/messages/count_tokens", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})).json()
            v1_counted = (await http.post("/v1/messages/count_tokens", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})).json()
            bad = await http.post("/chat/completions", json={"model": MODEL, "messages": [], "bogus": 1})
            anthropic_bad = await http.post("/messages", json={"model": MODEL, "bogus": 1})
            tokens = await http.post("/responses/input_tokens", json={"model": MODEL, "input": "hi"})
    finally:
        generator.close()
    assert models["data"][0]["id"] == MODEL and model.status_code == 200
    assert counted == v1_counted and tokens.json()["input_tokens"] > 0
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bogus"
    assert anthropic_bad.status_code == 400 and anthropic_bad.json()["type"] == "error"
    assert endpoint_label("/chat/completions") == "chat_completions" and endpoint_label("/models/x") == "model"
