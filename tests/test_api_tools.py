"""Tool calling end to end: LangChain and LiteLLM against the API in front of a real 2-stage chain.

The chain (two stage processes of the demo model, qwen2 vocabulary) is served with the published
Qwen 2.5 chat template, which renders ``tools`` and writes calls as ``<tool_call>`` JSON.  Random
weights cannot be made to write a tool call, so **the token source is a test double, in this file
only**: :class:`ScriptedClient` forwards every message to the real chain (configure, prefill,
decode, stop all run on both stages) and replaces only the token the final stage sampled with the
next token of a script chosen from the prompt, the way a trained model would answer: a
``<tool_call>`` for the question, a sentence once a ``<tool_response>`` is in the prompt, the
rest of a call when the prompt already opens one (``tool_choice`` required / named).  Everything
else (template rendering with the tools, the call parsed back into ``tool_calls``, streamed
``delta.tool_calls``, the tool result rendered back into the prompt) is the real path.

The last part turns the script off: ``tool_choice`` required / named is then forced by a grammar
built from the tools' schemas, and the chain's own sampler (temperature 1.0, random weights)
writes the call: it must parse, name an allowed function and validate against its schema, with
the raw API and with LangChain (forced call streamed, result back in, a final answer).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import pytest
import trio

from skippy.api.app import ChainService, create_app
from skippy.api.lanes import LanePool, Lease
from skippy.driver.client import PrefillResult, StageClient
from skippy.driver.generator import Generator
from skippy.models.cache import ensure_model
from skippy.models.spec import demo
from skippy.runtime.tokenizer import Tokenizer

from stage_helpers import stage_chain

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM must not fetch its price list

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
QWEN25 = ROOT / "build" / "llama-src" / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
MODEL = "skippy-demo"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris, 21 C."
RESULT = "sunny, 21 C"


def script_for(prompt: str) -> str:
    """What the scripted 'model' answers to a rendered prompt."""
    if prompt.endswith('"arguments": '):  # a named tool_choice opened the call
        return '{"city": "Paris"}}\n</tool_call>'
    if prompt.endswith("<tool_call>\n"):  # tool_choice required opened it
        return CALL.removeprefix("<tool_call>\n")
    if "<tool_response>" in prompt:
        assert RESULT in prompt
        return ANSWER
    assert "get_weather" in prompt, "the tools did not reach the prompt"
    return CALL


class ScriptedClient:
    """A lane that runs everything on the real chain but answers with scripted tokens."""

    def __init__(self, inner: StageClient, tokenizer: Tokenizer, end: int, pool: "ScriptedPool") -> None:
        self._inner = inner
        self._pool = pool
        self._tokenizer = tokenizer
        self._end = end
        self._scripts: dict[int, Iterator[int]] = {}
        self.predictions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def prefill(self, session_id: int, tokens: Sequence[int], **kwargs: Any) -> PrefillResult:
        result = await self._inner.prefill(session_id, tokens, **kwargs)
        if not self._pool.scripted:
            self._scripts.pop(session_id, None)
            return result
        text = self._tokenizer.decode(list(tokens))
        script = self._tokenizer.encode(script_for(text), add_special=False, parse_special=True) + [self._end]
        self._scripts[session_id] = iter(script)
        return dataclasses.replace(result, reply=self._replace(session_id, result.reply))

    async def decode(self, session_id: int, token: int, position: int, **kwargs: Any) -> Any:
        reply = await self._inner.decode(session_id, token, position, **kwargs)
        return self._replace(session_id, reply) if session_id in self._scripts else reply

    # docs/protocol.md §11: a decode run's predictions are scripted the same way
    async def start_run(self, session_id: int, token: int, position: int, **kwargs: Any) -> Any:
        reply = await self._inner.start_run(session_id, token, position, **kwargs)
        return self._replace(session_id, reply) if session_id in self._scripts else reply

    async def next_run_token(self, session_id: int) -> Any:
        reply = await self._inner.next_run_token(session_id)
        return self._replace(session_id, reply) if session_id in self._scripts else reply

    def _replace(self, session_id: int, reply: Any) -> Any:
        self.predictions += 1
        return dataclasses.replace(reply, predicted=next(self._scripts[session_id]))


class ScriptedPool(LanePool):
    def __init__(self, *args: Any, tokenizer: Tokenizer, end: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer, self.end = tokenizer, end
        self.clients: list[ScriptedClient] = []
        #: False: the chain's own sampled tokens come back (no script).
        self.scripted = True

    async def acquire(self) -> Lease:
        lease = await super().acquire()
        if not isinstance(lease.client, ScriptedClient):
            lease.client = ScriptedClient(lease.client, self.tokenizer, self.end, self)  # type: ignore[assignment]
            self.clients.append(lease.client)  # type: ignore[arg-type]
        return lease


@pytest.fixture()
async def api(tmp_path: Path) -> AsyncIterator[tuple[str, ScriptedPool]]:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    if not QWEN25.is_file():
        pytest.skip(f"{QWEN25} not built (llama.cpp source tree)")
    model = ensure_model(demo())
    generator = Generator(Tokenizer(model), chat_template=QWEN25.read_text(), n_ctx=1024, speculation=False)
    generator.prefix_cache = False
    end = generator.encode("<|im_end|>")[-1]
    assert generator.tokenizer.is_end_of_generation(end)
    try:
        async with stage_chain(str(model), ["0:4", "4:8"], tmp_path, ["--ctx-size", "1024"]) as stages:
            assert stages[0].address is not None
            pool = ScriptedPool(stages[0].address, max_lanes=2, tokenizer=generator.tokenizer, end=end)
            config = Config()
            config.bind = ["127.0.0.1:0"]
            config.accesslog = None
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(serve, create_app(ChainService(generator, pool, MODEL)), config)
                yield binds[0], pool
                nursery.cancel_scope.cancel()
            await pool.aclose()
    finally:
        generator.close()


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return RESULT


async def in_thread(function: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(function)


def langchain_round_trip(url: str, stream: bool) -> dict[str, Any]:
    from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", max_tokens=64, max_retries=0,
                     timeout=60, stream_usage=True).bind_tools([get_weather])
    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]
    if stream:
        first: Any = None
        for piece in llm.stream(messages):
            assert isinstance(piece, AIMessageChunk)
            first = piece if first is None else first + piece
    else:
        first = llm.invoke(messages)
    calls = list(first.tool_calls)
    messages += [first, ToolMessage(get_weather(**calls[0]["args"]), tool_call_id=calls[0]["id"])]
    if stream:
        final: Any = None
        for piece in llm.stream(messages):
            final = piece if final is None else final + piece
    else:
        final = llm.invoke(messages)
    return {"calls": calls, "first_content": first.content, "final": final.content,
            "final_calls": list(final.tool_calls), "metadata": first.response_metadata}


def litellm_round_trip(url: str, stream: bool) -> dict[str, Any]:
    import litellm

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]

    def ask() -> Any:
        response = litellm.completion(model=f"openai/{MODEL}", api_base=url + "/v1", api_key="unused",
                                      messages=messages, tools=tools, max_tokens=64, stream=stream, timeout=60)
        if stream:
            chunks = list(response)
            return litellm.stream_chunk_builder(chunks, messages=messages)
        return response

    first = ask().choices[0]
    calls = first.message.tool_calls
    messages.append({"role": "assistant", "content": first.message.content,
                     "tool_calls": [{"id": call.id, "type": "function",
                                     "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                    for call in calls]})
    arguments = json.loads(calls[0].function.arguments)
    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": get_weather(**arguments)})
    final = ask().choices[0]
    return {"calls": [(call.function.name, json.loads(call.function.arguments)) for call in calls],
            "finish": first.finish_reason, "final": final.message.content, "final_calls": final.message.tool_calls}


# LiteLLM's own types trip a pydantic warning while it assembles streamed chunks (not ours).
@pytest.mark.filterwarnings("ignore:Item 'index' on TypedDict class:UserWarning")
async def test_langchain_and_litellm_round_trips(api: tuple[str, ScriptedPool]) -> None:
    """A tool call comes back parsed, the result goes back in, the final answer comes out; streamed and not.
    (One test, so the chain starts once.)"""
    url, pool = api
    for stream in (False, True):
        outcome = await in_thread(functools.partial(langchain_round_trip, url, stream))
        assert [(call["name"], call["args"]) for call in outcome["calls"]] == [("get_weather", {"city": "Paris"})]
        assert outcome["calls"][0]["id"].startswith("call_")
        assert outcome["first_content"] == ""
        assert outcome["metadata"]["finish_reason"] == "tool_calls"
        assert outcome["final"] == ANSWER and outcome["final_calls"] == [], stream
    for stream in (False, True):
        outcome = await in_thread(functools.partial(litellm_round_trip, url, stream))
        assert outcome["calls"] == [("get_weather", {"city": "Paris"})], stream
        assert outcome["finish"] == "tool_calls"
        assert outcome["final"] == ANSWER and not outcome["final_calls"], stream
    assert sum(client.predictions for client in pool.clients) >= 8 * 5  # every token came through the chain
    await tool_choice_checks(url)
    pool.scripted = False  # from here on the chain samples for real
    await grammar_forced_calls(url)
    outcome = await in_thread(functools.partial(langchain_forced_round_trip, url))
    assert outcome["name"] == "get_weather" and outcome["args"]["city"] in CITIES, outcome
    assert outcome["finish"] == "tool_calls"
    assert isinstance(outcome["final"], str) and outcome["final_usage"]["output_tokens"] > 0


CITIES = ["Paris", "Rome", "Oslo"]
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "enum": CITIES},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                          "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]


async def grammar_forced_calls(url: str) -> None:
    """tool_choice required / named with the chain's real sampler (random weights): the grammar makes
    the answer one call of an allowed function whose arguments follow its schema."""
    import httpx
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in FORCED_TOOLS}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for seed in range(2):
            for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather or time?"}],
                        "tools": FORCED_TOOLS, "tool_choice": choice, "temperature": 1.0, "seed": seed,
                        "max_tokens": 64}
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                answer = response.json()["choices"][0]
                assert answer["finish_reason"] == "tool_calls", answer
                calls = answer["message"]["tool_calls"]
                assert len(calls) == 1
                name = calls[0]["function"]["name"]
                assert name == "get_time" if isinstance(choice, dict) else name in schemas
                jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schemas[name])
        clash = await http.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
        assert clash.status_code == 400 and clash.json()["error"]["param"] == "tool_choice"
        unique = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}
        refused = await http.post("/v1/chat/completions", json={**body, "tools": [unique], "tool_choice": "required"})
        assert refused.status_code == 400, refused.text  # a forced call's grammar would not enforce it
        assert refused.json()["error"]["param"] == "tools[0].function.parameters.properties.tags.uniqueItems"


def langchain_forced_round_trip(url: str) -> dict[str, Any]:
    """LangChain with a forced (named) tool choice on real sampling, the result back in, a final answer."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", max_tokens=64, max_retries=0,
                      timeout=120, temperature=1.0, seed=3)
    forced = chat.bind_tools([FORCED_TOOLS[0]], tool_choice="get_weather")
    messages: list[Any] = [HumanMessage("What is the weather?")]
    first: Any = None
    for piece in forced.stream(messages):
        first = piece if first is None else first + piece
    assert first.tool_calls, (first.content, first.response_metadata)
    call = first.tool_calls[0]
    messages += [first, ToolMessage("sunny", tool_call_id=call["id"])]
    final = chat.bind_tools([FORCED_TOOLS[0]], tool_choice="none").invoke(messages)
    return {"name": call["name"], "args": call["args"], "finish": first.response_metadata.get("finish_reason"),
            "final": final.content, "final_usage": final.usage_metadata}


async def tool_choice_checks(url: str) -> None:
    import httpx

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Paris?"}], "tools": tools, "max_tokens": 48}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            body = (await http.post("/v1/chat/completions", json={**base, "tool_choice": choice})).json()
            message = body["choices"][0]["message"]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
                == [("get_weather", {"city": "Paris"})], body
            assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
            assert body["usage"]["skippy_timing"]["stage_count"] == 2
        # none: the tools never reach the prompt (the script would assert), the answer is plain content
        none = await http.post("/v1/chat/completions", json={**base, "tool_choice": "none", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                                "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                                    "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]})
        assert none.status_code == 200, none.text
        assert none.json()["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
