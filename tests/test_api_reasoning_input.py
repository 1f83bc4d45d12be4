"""An earlier answer's reasoning sent back: chat's ``reasoning_content``, a Responses ``reasoning``
item, a Messages ``thinking`` block — one assistant turn's reasoning, rendered by the template.

The prompts are rendered with the pinned llama.cpp tree's real templates (no chain is needed: the
prompt is the whole effect).  Qwen3 renders the reasoning of a tool-call turn after the last user
message and drops an older turn's; gpt-oss renders it as the turn's analysis message (its
``thinking``).  The three APIs give the same prompt for the same conversation, a conversation
without the reasoning a different one (so the reasoning is what is rendered), and hostile forms
(encrypted reasoning, reasoning on a user message, a redacted block) are refused naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from skippy.api.errors import ApiError

MODEL = "tiny"
ROOT = Path(__file__).resolve().parent.parent
_TREES = [ROOT / "build" / "llama-src", ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp",
          *([Path(os.environ["SKIPPY_LLAMA_SRC"])] if os.environ.get("SKIPPY_LLAMA_SRC") else [])]
THOUGHT = "the weather tool knows"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _template(name: str) -> str:
    for tree in _TREES:
        path = tree / "models" / "templates" / name
        if path.is_file():
            return path.read_text()
    pytest.skip(f"the pinned llama.cpp tree (its models/templates/{name}) is not here")


@pytest.fixture(params=["Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja"])
def service(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[Any]:
    from skippy.api.app import ChainService
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.runtime.tokenizer import Tokenizer

    generator = Generator(Tokenizer(tiny_llama), chat_template=_template(request.param), n_ctx=2048, chunk_size=8)
    try:
        yield ChainService(generator, LanePool(("127.0.0.1", 9), max_lanes=1), MODEL)  # never connected
    finally:
        generator.close()


def _prompt(service: Any, chat: dict[str, Any]) -> str:
    from skippy.api.app import _prompt_tokens

    tokens, _, _ = _prompt_tokens(service, {"model": MODEL, **chat}, True)
    return service.generator.tokenizer.decode(tokens)


def _responses(service: Any, body: dict[str, Any]) -> str:
    from skippy.api.responses import to_chat_body

    return _prompt(service, to_chat_body({"model": MODEL, **body}))


def _messages(service: Any, body: dict[str, Any]) -> str:
    from skippy.api.messages import to_chat_body

    return _prompt(service, to_chat_body({"model": MODEL, "max_tokens": 10, **body},
                                         template=service.generator.chat_template))


def _rendered(service: Any) -> str:
    """How the template writes THOUGHT when it renders it."""
    if "<|channel|>" in service.generator.chat_template:
        return f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    return f"<think>\n{THOUGHT}\n</think>"


def test_a_tool_call_turn_s_reasoning_is_rendered_alike_from_every_api(service: Any) -> None:
    user = {"role": "user", "content": "Weather in Bern?"}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    chat = _prompt(service, {"tools": TOOLS, "messages": [
        user, {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [CALL]}, result]})
    bare = _prompt(service, {"tools": TOOLS, "messages": [
        user, {"role": "assistant", "content": None, "tool_calls": [CALL]}, result]})
    assert _rendered(service) in chat and THOUGHT not in bare
    # Responses: the SDKs send the reasoning item first, then the call it led to
    responses = _responses(service, {"tools": [{"type": "function", **TOOLS[0]["function"]}], "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Bern?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Bern"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    assert responses == chat
    # Messages: the thinking block before the tool_use, as Anthropic clients send it back
    claude = _messages(service, {"tools": [{"name": "get_weather", "description": "The weather in a city",
                                            "input_schema": TOOLS[0]["function"]["parameters"]}], "messages": [
        user, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": THOUGHT, "signature": "sig"},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Bern"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]}]})
    assert claude == chat


def test_an_answered_turn_s_reasoning_joins_its_message_and_the_template_decides(service: Any) -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": THOUGHT},
             {"role": "user", "content": "Bye"}]
    chat = _prompt(service, {"messages": turns})
    responses = _responses(service, {"input": [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "a summary"}],
         "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "Bye"}]})
    claude = _messages(service, {"messages": [
        turns[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                                    {"type": "text", "text": "Hello."}]}, turns[2]]})
    assert responses == chat == claude
    # both templates drop the reasoning of a turn before the last user message (as the models were trained)
    assert chat == _prompt(service, {"messages": [turns[0], {"role": "assistant", "content": "Hello."}, turns[2]]})
    assert "a summary" not in responses


def test_reasoning_in_the_wrong_place_or_unreadable_is_a_400_naming_it(service: Any) -> None:
    from skippy.api.app import _chat_messages

    def refused(call: Any, param: str, status: int) -> None:  # 422: malformed; 400: not served
        with pytest.raises(ApiError) as caught:
            call()
        assert (caught.value.status, caught.value.param) == (status, param), caught.value.message

    refused(lambda: _chat_messages({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}),
            "messages[0].reasoning_content", 422)
    refused(lambda: _chat_messages({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]}),
            "messages[0].reasoning_content", 422)
    user = {"role": "user", "content": "Hi"}
    refused(lambda: _responses(service, {"input": [user, {"type": "reasoning", "summary": [],
                                                          "encrypted_content": "gAAAA"}]}),
            "input[1].encrypted_content", 400)
    refused(lambda: _responses(service, {"input": [user, {"type": "reasoning", "summary": [],
                                                          "content": [{"type": "output_text", "text": "x"}]}]}),
            "input[1].content[0]", 422)
    refused(lambda: _messages(service, {"messages": [user, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "opaque"}]}]}), "messages[1].content[0]", 400)
    refused(lambda: _messages(service, {"messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "x", "signature": ""}]}]}), "messages[0].content[0]", 400)
