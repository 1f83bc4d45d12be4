"""An earlier answer's reasoning sent back: chat's ``reasoning_content``, a Responses ``reasoning``
item, a Messages ``thinking`` block — one assistant turn's reasoning, rendered by the template.

The prompts are rendered with the pinned llama.cpp tree's real templates (no chain is needed: the
prompt is the whole effect).  Qwen3 renders the reasoning of a tool-call turn after the last user
message and drops an older turn's; gpt-oss renders it as the turn's analysis message (its
``thinking``).  The three APIs give the same prompt for the same conversation, a conversation
without the reasoning a different one (so the reasoning is what is rendered), and hostile forms
(encrypted reasoning, reasoning on a user message, a redacted block) are refused naming the field.
Then end to end (slow): the official openai (Responses and chat) and anthropic clients send a tiny
gpt-oss's reasoning tool call back as they received it, and the next turn is served.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import trio

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


def _template_file(name: str) -> Path:
    for tree in _TREES:
        path = tree / "models" / "templates" / name
        if path.is_file():
            return path
    pytest.skip(f"the pinned llama.cpp tree (its models/templates/{name}) is not here")


def _template(name: str) -> str:
    return _template_file(name).read_text()


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


GPT_OSS = "tiny-gpt-oss"
#: A gpt-oss answer that reasons, then calls get_weather (the markers as the vocabulary's special tokens).
CALLED = ('<|channel|> "analysis" <|message|> [a-z]{3,12} <|end|> <|start|> "assistant to=functions.get_weather" '
          '<|channel|> "commentary " <|constrain|> "json" <|message|> "{\\"city\\": \\"" [a-z]{3,8} "\\"}"')
FINAL = '<|channel|> "final" <|message|> [a-z]{3,12}'


def _sdks_send_the_reasoning_back(url: str) -> dict[str, Any]:
    """The second turn of a tool call as each official SDK builds it: the first answer's output
    items / content blocks / message passed back as they came."""
    import openai

    anthropic = pytest.importorskip("anthropic")
    out: dict[str, Any] = {}
    question = "Weather in Bern?"
    tool = {"type": "function", **TOOLS[0]["function"]}
    first_grammar = {"seed": 5, "grammar": f"root ::= {CALLED}"}
    then = {"seed": 5, "grammar": f"root ::= {FINAL}"}
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        first = client.responses.create(model=GPT_OSS, input=question, tools=[tool], max_output_tokens=200,
                                        extra_body=first_grammar)
        call = first.output[-1]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        sent = [{"role": "user", "content": question}, *first.output, result]
        out["responses_first"] = first
        out["responses_second"] = client.responses.create(model=GPT_OSS, input=sent, tools=[tool],
                                                          max_output_tokens=100, extra_body=then)
        out["responses_counts"] = [client.responses.input_tokens.count(model=GPT_OSS, input=items, tools=[tool])
                                   .input_tokens for items in (sent, [sent[0], call, result])]
        chat_first = client.chat.completions.create(model=GPT_OSS, messages=[{"role": "user", "content": question}],
                                                    tools=TOOLS, max_tokens=200, extra_body=first_grammar)
        message = chat_first.choices[0].message
        out["chat_reasoning"] = (message.model_extra or {}).get("reasoning_content")
        out["chat_second"] = client.chat.completions.create(model=GPT_OSS, max_tokens=100, tools=TOOLS, extra_body=then,
                                                            messages=[{"role": "user", "content": question},
                                                                      message.model_dump(exclude_none=True),
                                                                      {"role": "tool", "tool_call_id":
                                                                       message.tool_calls[0].id, "content": "sunny"}])
    claude_tool = {"name": "get_weather", "description": "The weather in a city",
                   "input_schema": TOOLS[0]["function"]["parameters"]}
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120) as claude:
        first_claude = claude.messages.create(model=GPT_OSS, max_tokens=200, tools=[claude_tool],
                                              messages=[{"role": "user", "content": question}], extra_body=first_grammar)
        use = first_claude.content[-1]
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": first_claude.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        out["claude_first"] = first_claude
        out["claude_second"] = claude.messages.create(model=GPT_OSS, max_tokens=100, tools=[claude_tool], messages=turns,
                                                      extra_body=then)
        bare = [turns[0], {"role": "assistant", "content": [use]}, turns[2]]
        out["claude_counts"] = [claude.messages.count_tokens(model=GPT_OSS, tools=[claude_tool], messages=messages)
                                .input_tokens for messages in (turns, bare)]
    return out


@pytest.mark.slow
async def test_the_official_sdks_send_a_gpt_oss_answer_s_reasoning_back() -> None:
    """On a 2-stage chain of the tiny gpt-oss with gpt-oss's special tokens (the derived
    ``harmony`` vocabulary) and its template: a reasoning tool call's next turn, as the openai
    (Responses and chat) and anthropic clients send it back, is served, and its reasoning counts
    in the prompt (the template renders a tool-call turn's analysis)."""
    from conftest import model_path
    from stage_helpers import inprocess_chain

    from skippy.api.server import serve_api

    template = str(_template_file("openai-gpt-oss-120b.jinja"))
    path = model_path("gpt-oss", dtype="Q8_0", vocab="harmony")
    async with inprocess_chain(["0:2", "2:4"], model=str(path), ctx_size=1024) as servers:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(
                serve_api, path, servers[0].address, port=0, n_ctx=1024, max_lanes=1, model_id=GPT_OSS,
                final_stage=servers[-1].address, chat_template=template))
            out = await trio.to_thread.run_sync(_sdks_send_the_reasoning_back, url)
            nursery.cancel_scope.cancel()
    first = out["responses_first"]
    assert [item.type for item in first.output] == ["reasoning", "function_call"], first.output
    assert [item.type for item in out["responses_second"].output] == ["message"]
    with_reasoning, without = out["responses_counts"]
    assert with_reasoning > without
    assert out["chat_reasoning"] == first.output[0].content[0].text  # the same seed and grammar: the same answer
    assert out["chat_second"].choices[0].message.content
    assert [block.type for block in out["claude_first"].content] == ["thinking", "tool_use"]
    assert [block.type for block in out["claude_second"].content] == ["text"]
    with_thinking, bare = out["claude_counts"]
    assert with_thinking == with_reasoning and bare == without  # one prompt, whichever API sent it
