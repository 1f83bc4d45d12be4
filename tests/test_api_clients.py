"""Client libraries round-trip through skippy's Responses and Messages APIs (127.0.0.1 only).

A 2-stage chain of the generated tiny llama runs in this process behind ``serve_api`` (its plain
transcript renders no tools, so tools take the generic format, docs/tools.md); the synchronous
clients run in a worker thread.  LangChain's ``ChatOpenAI(use_responses_api=True)`` and
``ChatAnthropic``, and LiteLLM's ``responses`` (OpenAI) and ``completion`` (Anthropic) each get the
chat-completions answer for the same prompt (greedy, 16 tokens: LiteLLM raises a smaller
``max_output_tokens`` to OpenAI's minimum of 16), streamed and not, and a forced tool call
parsed into their own tool-call objects; the OpenAI Agents SDK runs one tool-calling agent turn
(the tool runs with the model's arguments, which follow its schema).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from pathlib import Path
from typing import Any, Literal

import pytest
import trio

from skippy.api.server import serve_api

from stage_helpers import inprocess_chain

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM must not fetch its price list

MODEL = "tiny"
QUESTION = "Tell me about the quick brown fox."
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}


def _text(content: Any) -> str:
    """LangChain message content as text (a string, or a list of blocks)."""
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content
                   if isinstance(block, dict) and block.get("type") == "text")


def langchain_and_litellm(url: str) -> dict[str, Any]:
    import litellm
    import openai
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Bern", "Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    out: dict[str, Any] = {}
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        out["chat"] = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                     max_tokens=16, temperature=0).choices[0].message.content
    responses = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=16,
                           max_retries=0, use_responses_api=True)
    out["lc_responses"] = _text(responses.invoke(QUESTION).content)
    out["lc_responses_stream"] = "".join(_text(chunk.content) for chunk in responses.stream(QUESTION))
    forced = responses.model_copy(update={"max_tokens": 60}).bind_tools([get_weather], tool_choice="get_weather",
                                                                         parallel_tool_calls=False)
    out["lc_responses_tool"] = forced.invoke("Weather in Bern?").tool_calls
    claude = ChatAnthropic(model=MODEL, base_url=url, api_key="unused", temperature=0, max_tokens=16, max_retries=0)
    out["lc_anthropic"] = _text(claude.invoke(QUESTION).content)
    out["lc_anthropic_stream"] = "".join(_text(chunk.content) for chunk in claude.stream(QUESTION))
    out["lc_anthropic_tool"] = claude.model_copy(update={"max_tokens": 60}).bind_tools(
        [get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke("Weather in Bern?").tool_calls
    response = litellm.responses(model=f"openai/{MODEL}", api_base=url + "/v1", api_key="unused", input=QUESTION,
                                 max_output_tokens=16, temperature=0)
    out["litellm_responses"] = response.output[0].content[0].text
    out["litellm_responses_stream"] = "".join(
        event.delta for event in litellm.responses(model=f"openai/{MODEL}", api_base=url + "/v1", api_key="unused",
                                                   input=QUESTION, max_output_tokens=16, temperature=0, stream=True)
        if getattr(event, "type", "") == "response.output_text.delta")
    messages = [{"role": "user", "content": QUESTION}]
    out["litellm_anthropic"] = litellm.completion(model=f"anthropic/{MODEL}", api_base=url, api_key="unused",
                                                  messages=messages, max_tokens=16, temperature=0
                                                  ).choices[0].message.content
    chunks = list(litellm.completion(model=f"anthropic/{MODEL}", api_base=url, api_key="unused", messages=messages,
                                     max_tokens=16, temperature=0, stream=True))
    out["litellm_anthropic_stream"] = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": CITY}}]
    called = litellm.completion(model=f"anthropic/{MODEL}", api_base=url, api_key="unused", max_tokens=60,
                                temperature=0, messages=[{"role": "user", "content": "Weather in Bern?"}], tools=tools,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                parallel_tool_calls=False)  # random weights would go on adding calls
    out["litellm_anthropic_tool"] = called.choices[0].message.tool_calls
    return out


def agent_turn(url: str) -> dict[str, Any]:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Bern", "Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    async def run() -> Any:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60,
                                                   parallel_tool_calls=False),
                      tool_use_behavior="stop_on_first_tool")
        try:
            return await Runner.run(agent, "Weather in Bern?", max_turns=2)
        finally:
            await client.close()

    result = asyncio.run(run())
    return {"seen": seen, "final": result.final_output,
            "items": [item.type for item in result.new_items]}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Item:UserWarning")  # LiteLLM's TypedDicts with ReadOnly / index items
@pytest.mark.filterwarnings("ignore:Items:UserWarning")
async def test_client_libraries_round_trip(tiny_llama: Path) -> None:
    for module in ("langchain_openai", "langchain_anthropic", "litellm", "agents"):
        pytest.importorskip(module)
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), ctx_size=2048) as servers:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(
                serve_api, tiny_llama, servers[0].address, port=0, n_ctx=2048, max_lanes=1, model_id=MODEL,
                final_stage=servers[-1].address))
            out = await trio.to_thread.run_sync(langchain_and_litellm, url)
            agent = await trio.to_thread.run_sync(agent_turn, url)
            nursery.cancel_scope.cancel()
    answer = out["chat"]
    assert answer
    for name in ("lc_responses", "lc_responses_stream", "lc_anthropic", "lc_anthropic_stream", "litellm_responses",
                 "litellm_responses_stream", "litellm_anthropic", "litellm_anthropic_stream"):
        assert out[name] == answer, name
    for name in ("lc_responses_tool", "lc_anthropic_tool"):
        assert len(out[name]) == 1, (name, out[name])
        [call] = out[name]
        assert call["name"] == "get_weather" and call["args"]["city"] in ("Bern", "Paris", "Rome"), (name, call)
    [call] = out["litellm_anthropic_tool"]
    assert call.function.name == "get_weather"
    assert len(json.loads(call.function.arguments)["city"]) <= 6
    [city] = agent["seen"]
    assert city in ("Bern", "Paris", "Rome") and agent["final"] == f"sunny in {city}"
    assert agent["items"] == ["tool_call_item", "tool_call_output_item"]
