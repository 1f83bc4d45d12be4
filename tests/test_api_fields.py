"""Every request field is served, a documented no-op, or a 400 naming it; /tokenize and /detokenize.

These run the app in-process (httpx's ASGI transport) over the demo model's vocabulary with a lane
pool pointed at a port nothing listens on: a field that passes validation reaches the pool and
gets the 503 of a missing chain, a refused one gets its 400 first.  So "accepted" here means
"validation let it through"; ``tests/test_api_clients.py`` checks on a real chain that the no-op
fields leave a greedy answer unchanged.  The field lists come from the installed ``openai`` SDK's
request types, so a field OpenAI adds shows up here as a failure until it is classified.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

from skippy.api.app import ChainService, create_app
from skippy.api.fields import CHAT_FIELDS, COMPLETION_FIELDS, Handling
from skippy.api.lanes import LanePool
from skippy.driver.generator import Generator
from skippy.models.cache import ensure_model
from skippy.models.spec import demo
from skippy.net.address import Address

openai = pytest.importorskip("openai")

MODEL = "skippy-demo"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "api-fields.md"

#: A value for each refused field that asks for what is not served.
REFUSED_VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"}, "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
    "verbosity": "low", "web_search_options": {}, "moderation": {"model": "m"},
    "store": True, "suffix": "tail", "modalities": ["text", "audio"], "best_of": 3,
}
#: Values for the no-op fields (each must be accepted).
NO_OP_VALUES: dict[str, Any] = {
    "metadata": {"k": "v"}, "prediction": {"type": "content", "content": "x"}, "service_tier": "auto",
    "safety_identifier": "abc", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
}


def sdk_fields(module: Any) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


@pytest.fixture(scope="module")
def generator() -> Iterator[Generator]:
    gen = Generator.from_model(ensure_model(demo()))
    yield gen
    gen.close()


@pytest.fixture()
async def http(generator: Generator) -> AsyncIterator[httpx.AsyncClient]:
    pool = LanePool(Address("127.0.0.1", 9), max_lanes=1, connect_timeout=2.0)
    app = create_app(ChainService(generator, pool, MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy") as client:
        yield client


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **fields}


def test_every_sdk_field_is_classified() -> None:
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    assert sorted(sdk_fields(chat_params) - set(CHAT_FIELDS)) == []
    assert sorted(sdk_fields(completion_create_params) - set(COMPLETION_FIELDS)) == []


def test_the_docs_list_every_field() -> None:
    text = DOCS.read_text()
    for name in {*CHAT_FIELDS, *COMPLETION_FIELDS}:
        assert f"`{name}`" in text, name


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


# (messages in the full suite: importing the Anthropic SDK's types takes a second and more)
@pytest.mark.parametrize("api", ["responses", pytest.param("messages", marks=pytest.mark.slow)])
def test_every_responses_and_messages_sdk_field_is_documented_and_served_or_refused(api: str) -> None:
    """Each field of the official SDK's create() is in the API's docs table, and is either read
    (served or a documented no-op) or a 400 naming it."""
    from skippy.api.errors import ApiError

    if api == "responses":
        from openai.types.responses import response_create_params as params

        from skippy.api.responses import _FIELDS, to_chat_body
        names = set(typing.get_type_hints(params.ResponseCreateParamsBase)) | {"stream"}
        section = _section(DOCS.read_text(), "## OpenAI Responses API")
        body: dict[str, Any] = {"model": MODEL, "input": "hi"}
    else:
        anthropic_params = pytest.importorskip("anthropic.types.message_create_params")
        from skippy.api.messages import _FIELDS, to_chat_body  # type: ignore[assignment]
        names = set(typing.get_type_hints(anthropic_params.MessageCreateParamsBase)) | {"stream"}
        section = _section(DOCS.read_text(), "## Anthropic Messages API")
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert sorted(name for name in names if f"`{name}`" not in section and f"`{name}." not in section) == []
    for name in sorted(names - set(_FIELDS)):
        with pytest.raises(ApiError) as refused:
            to_chat_body({**body, name: {"x": 1}})
        assert (refused.value.status, refused.value.param) == (400, name), refused.value.message


@pytest.mark.parametrize("chat_endpoint", [True, False], ids=["chat", "completions"])
async def test_each_field_gets_its_documented_handling(http: httpx.AsyncClient, chat_endpoint: bool) -> None:
    table = CHAT_FIELDS if chat_endpoint else COMPLETION_FIELDS
    path = "/v1/chat/completions" if chat_endpoint else "/v1/completions"
    make = chat if chat_endpoint else completion
    for name, rule in table.items():
        if name in REFUSED_VALUES and rule.refuse is not None:
            response = await http.post(path, json=make(**{name: REFUSED_VALUES[name]}))
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["param"] == name
            assert response.json()["error"]["code"] == "unsupported_field"
            assert name in response.json()["error"]["message"]
        if rule.handling is Handling.REFUSED:
            assert name in REFUSED_VALUES, f"no refused value to try for {name}"
        if rule.handling is Handling.NO_OP:
            response = await http.post(path, json=make(**{name: NO_OP_VALUES[name]}))
            assert response.status_code == 503, (name, response.text)  # validated, then no chain


@pytest.mark.parametrize("chat_endpoint", [True, False], ids=["chat", "completions"])
async def test_an_unknown_field_is_a_400_naming_it(http: httpx.AsyncClient, chat_endpoint: bool) -> None:
    path, make = ("/v1/chat/completions", chat) if chat_endpoint else ("/v1/completions", completion)
    response = await http.post(path, json=make(mirostat=2))
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": response.json()["error"]["message"], "type": "invalid_request_error", "param": "mirostat",
        "code": "unknown_field"}
    assert "'mirostat'" in response.json()["error"]["message"]
    other = "echo" if chat_endpoint else "messages"
    response = await http.post(path, json=make(**{other: True}))
    assert response.status_code == 400 and "belongs to" in response.json()["error"]["message"]


async def test_neutral_values_of_refused_fields_are_accepted(http: httpx.AsyncClient) -> None:
    for fields in ({"logprobs": False}, {"top_logprobs": None}, {"response_format": {"type": "text"}},
                   {"logprobs": True, "top_logprobs": 3}, {"response_format": {"type": "json_object"}},
                   {"store": False}, {"modalities": ["text"]}, {"audio": None}, {"stream_options": {
                       "include_usage": True, "include_obfuscation": False}}):
        response = await http.post("/v1/chat/completions", json=chat(**fields))
        assert response.status_code == 503, (fields, response.text)
    response = await http.post("/v1/completions", json=completion(best_of=1, suffix="", logprobs=2, grammar='root ::= "a"'))
    assert response.status_code == 503, response.text


async def test_message_parts_and_fields_that_are_not_served(http: httpx.AsyncClient) -> None:
    image = {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": {"url": "data:,"}}]}
    response = await http.post("/v1/chat/completions", json=chat(messages=[image]))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content[1]"
    response = await http.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "a",
                                                                            "colour": "red"}]))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].colour"
    response = await http.post("/v1/chat/completions", json=chat(messages=[{"role": "function", "name": "f",
                                                                            "content": "1"}]))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].role"
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    response = await http.post("/v1/chat/completions", json=chat(messages=developer))
    assert response.status_code == 503, response.text  # developer is served (as system)


async def test_tokenize_and_detokenize_as_llama_server(http: httpx.AsyncClient, generator: Generator) -> None:
    text = "Hello world, 媽 and 🤗"
    response = await http.post("/tokenize", json={"content": text})
    assert response.status_code == 200
    tokens = response.json()["tokens"]
    assert tokens == generator.tokenizer.encode(text, add_special=False, parse_special=True)
    response = await http.post("/detokenize", json={"tokens": tokens})
    assert response.json() == {"content": text}
    pieces = (await http.post("/tokenize", json={"content": text, "with_pieces": True})).json()["tokens"]
    assert [piece["id"] for piece in pieces] == tokens
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes span tokens
    special = "<|im_start|>user"
    parsed = (await http.post("/tokenize", json={"content": special})).json()["tokens"]
    literal = (await http.post("/tokenize", json={"content": special, "parse_special": False})).json()["tokens"]
    assert len(parsed) < len(literal)
    assert (await http.post("/detokenize", json={"tokens": parsed})).json()["content"] == special


async def test_tokenize_refuses_bad_input(http: httpx.AsyncClient, generator: Generator) -> None:
    cases = [("/tokenize", {"content": 5}, "content"), ("/tokenize", {"content": "a", "colour": 1}, "colour"),
             ("/detokenize", {"tokens": [generator.tokenizer.n_vocab]}, "tokens"),
             ("/detokenize", {"tokens": "1 2"}, "tokens")]
    for path, body, param in cases:
        response = await http.post(path, json=body)
        assert response.status_code in (400, 422), (body, response.text)
        assert response.json()["error"]["param"] == param


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


async def test_tools_on_a_template_without_tool_support_take_the_generic_format(http: httpx.AsyncClient) -> None:
    # the demo model's template renders no tools: the generic format serves them (the chain is down: 503)
    for body in (chat(tools=[WEATHER]), chat(tools=[WEATHER], tool_choice="required"),
                 chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}]),
                 chat(tools=[WEATHER], tool_choice="none")):
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 503, response.text
    # its answer is under a grammar of its own: another grammar is a 400 naming tools
    response = await http.post("/v1/chat/completions", json=chat(tools=[WEATHER], response_format={"type": "json_object"}))
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


async def test_bad_tool_definitions_are_400s_naming_the_field(http: httpx.AsyncClient) -> None:
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    for tools, param in (([bad_schema], "tools[0].function.parameters"),
                         ([WEATHER, WEATHER], "tools[1].function.name"),
                         ([{"type": "function", "function": {"name": "f", "strict": True, "x": 1}}],
                          "tools[0].function.x")):
        response = await http.post("/v1/chat/completions", json=chat(tools=tools))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    response = await http.post("/v1/chat/completions", json=chat(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert response.status_code == 422 and response.json()["error"]["param"] == "tool_choice"
