"""Anthropic's Messages API on the chain: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Strategy: a Messages body is translated into the chat-completions body it means, and that body
goes through the chat handler's own parser, lease, admission, prefix cache and tenant
(:mod:`skippy.api.app`), so both APIs give the same answer for the same prompt and settings.
``system`` becomes a system message; text blocks become message text; an assistant's
``tool_use`` blocks become its ``tool_calls`` and a user's ``tool_result`` blocks become ``tool``
messages (before the user's text); ``tools`` become function tools (``input_schema`` is the
parameters schema), ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` the OpenAI choices
(``disable_parallel_tool_use`` → ``parallel_tool_calls``), ``stop_sequences`` the stop strings,
``metadata.user_id`` the cache key ``user`` does.  The answer is shaped back: ``text`` and
``tool_use`` content blocks, ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``
with the sequence that matched, ``tool_use``) and ``usage`` (``input_tokens`` not counting the
prefix-cache hit, which is ``cache_read_input_tokens``).  Streamed, the events are Anthropic's:
``message_start``, ``ping``, per block ``content_block_start`` / ``_delta`` (``text_delta``,
``input_json_delta``) / ``_stop``, ``message_delta`` with the stop reason and output tokens,
``message_stop``; a chain failure after the first event ends the stream with an ``error`` event.

Reasoning (a ``<think>`` template, :mod:`skippy.api.reasoning`, or gpt-oss Harmony channels,
:mod:`skippy.api.harmony`) comes back as a ``thinking`` block
(streamed as ``thinking_delta``, with an empty signature); ``thinking`` sets the template's
``enable_thinking`` switch when it has one, else only ``disabled`` is served.  An assistant's
``thinking`` block sent back is its ``reasoning_content`` (the template renders it where it reads
an earlier turn's reasoning, and drops it elsewhere, as llama-server does; the signature is not
checked: this server signs nothing).  Anything else is
refused with a 400 naming it, never dropped: an unknown field, image or document blocks, server
tools.  ``grammar`` (GBNF) is llama.cpp's extension, as in chat.
``cache_control`` marks are accepted and have no effect (the prefix cache is automatic), as are
``service_tier`` and ``metadata``'s key.  ``seed`` is a skippy extension (sampled answers
reproduce).  Errors have Anthropic's shape (:func:`skippy.api.errors.error_shape`), and keys come
as ``x-api-key`` or a bearer token (:mod:`skippy.api.auth`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from typing import Any, AsyncIterator, Mapping

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippy.api.app import INLINE_PARSE_BYTES, _Handlers, _LeasedStreamingResponse, _parse, _prompt_tokens
from skippy.api.auth import scope_tenant
from skippy.api.choices import Parsed, _Choice
from skippy.api.errors import ApiError, internal_error, invalid, parse_json_object, renamed
from skippy.api.fields import unsupported
from skippy.driver.client import StageClientError
from skippy.driver.generator import Generation

__all__ = ["MessagesHandlers", "read_body", "to_chat_body"]

log = logging.getLogger("skippy.api")

#: Fields of a Messages body, and what each becomes in the chat body (None: read here only).
#: ``temperature`` / ``top_p`` / ``top_k`` are gone from the current SDK's signature but older
#: clients send them (and ``extra_body`` can): they are served.
_FIELDS: dict[str, str | None] = {
    "model": "model", "max_tokens": "max_tokens", "messages": None, "system": None, "stop_sequences": "stop",
    "stream": "stream", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "metadata": None,
    "tools": None, "tool_choice": None, "thinking": None, "service_tier": None, "seed": "seed", "grammar": "grammar",
    "output_config": None, **dict.fromkeys(("cache_control", "speed", "inference_geo", "user_profile_id",
                                            "workspace_id")),
}
#: Chat fields a refusal may name, and the Messages field each came from.
_NAMES = {"response_format.json_schema.schema": "output_config.format.schema",  # before its parent
          "stop": "stop_sequences", "chat_template_kwargs": "thinking", "response_format": "output_config.format"}
#: Accepted with no effect on the answer: prompt caching is automatic (``cache_control``), there is
#: one speed, one place and one workspace.
_NO_OPS = frozenset({"cache_control", "speed", "inference_geo", "user_profile_id", "workspace_id", "service_tier"})
#: Fields count_tokens reads (the output settings cannot change the prompt's count).
_COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                           "output_format", "cache_control", "speed", "user_profile_id", "workspace_id"})
_BLOCK_KEYS = {"text": {"type", "text", "cache_control", "citations"},
               "tool_use": {"type", "id", "name", "input", "cache_control"},
               "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
               "thinking": {"type", "thinking", "signature", "cache_control"}}


def _keys(value: Mapping[str, Any], where: str, allowed: set[str] | frozenset[str]) -> None:
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise unsupported(f"{where}.{unknown[0]}" if where else unknown[0],
                          "not a field this server reads for the Messages API")


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as text."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(where, "expected a string or a list of text blocks")
    texts = []
    for index, block in enumerate(value):
        place = f"{where}[{index}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise unsupported(place, f"{kind!r} blocks are not served here (text only: a text-only model)")
        _keys(block, place, _BLOCK_KEYS["text"])
        if block.get("citations"):
            raise unsupported(f"{place}.citations", "citations are not served")
        if not isinstance(block.get("text"), str):
            raise invalid(f"{place}.text", "expected a string")
        texts.append(block["text"])
    return "".join(texts)


def _message(index: int, message: Any) -> list[dict[str, Any]]:
    """The chat messages one Messages message becomes."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(where, "expected an object with 'role' and 'content'")
    _keys(message, where, {"role", "content"})
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role", f"expected 'user' or 'assistant', got {json.dumps(role)}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "expected a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for number, block in enumerate(content):
        place = f"{where}.content[{number}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCK_KEYS or (kind in ("tool_use", "thinking") and role != "assistant") or \
                (kind == "tool_result" and role != "user"):
            raise unsupported(place, f"{kind!r} blocks are not served in {role} messages (text, an assistant's "
                              "thinking and tool_use and a user's tool_result are)")
        assert isinstance(block, dict)
        _keys(block, place, _BLOCK_KEYS[kind])
        if kind == "text":
            if block.get("citations"):
                raise unsupported(f"{place}.citations", "citations are not served")
            if not isinstance(block.get("text"), str):
                raise invalid(f"{place}.text", "expected a string")
            texts.append(block["text"])
        elif kind == "thinking":  # an earlier answer's reasoning, sent back: the template's to render
            if not isinstance(block.get("thinking"), str):
                raise invalid(f"{place}.thinking", "expected a string")
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(place, "a tool_use block needs a string 'id' and 'name'")
            if not isinstance(block.get("input"), dict):
                raise invalid(f"{place}.input", "expected an object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{place}.tool_use_id", "expected a string")
            text = _text_blocks(block.get("content", ""), f"{place}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or thoughts or not results:
        out.append({"role": role, "content": "".join(texts)})
    if thoughts:
        out[-1]["reasoning_content"] = "".join(thoughts)
    return out


def _tools(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", "expected a list of tools")
        converted = []
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            if not isinstance(tool, dict):
                raise invalid(where, "expected an object")
            if tool.get("type", "custom") != "custom":
                raise unsupported(f"{where}.type", f"server tools ({tool.get('type')!r}) are not served; "
                                  "client tools (name, description, input_schema) are")
            _keys(tool, where, {"type", "name", "description", "input_schema", "cache_control", "strict",
                                "eager_input_streaming"})
            # OpenAI's key order (the template renders the tools as JSON: the prompt is the chat one)
            function = {"name": tool.get("name"), **({"description": tool["description"]} if "description" in tool
                                                     else {}), "parameters": tool.get("input_schema")}
            if "strict" in tool:
                function["strict"] = tool["strict"]
            converted.append({"type": "function", "function": function})
        chat["tools"] = converted
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice", "expected {'type': 'auto' | 'any' | 'tool' | 'none'}")
    _keys(choice, "tool_choice", {"type", "name", "disable_parallel_tool_use"} if choice["type"] == "tool"
          else {"type", "disable_parallel_tool_use"})
    kind = choice["type"]
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise invalid("tool_choice.disable_parallel_tool_use", "expected a boolean")
        chat["parallel_tool_calls"] = not disable


def to_chat_body(body: Mapping[str, Any], *, counting: bool = False, template: str = "") -> dict[str, Any]:
    """The chat-completions body a Messages body means (see the module header); ``template``: the
    chat template, whose ``enable_thinking`` variable ``thinking`` sets when it reads one.

    Raises:
        ApiError: 400 naming a field that is unknown or not served; 422 for a malformed one.
    """
    allowed = _COUNT_FIELDS if counting else _FIELDS
    for name in body:
        if name not in allowed:
            raise unsupported(name, "not a Messages API field this server reads" +
                              (" for count_tokens" if counting and name in _FIELDS else ""))
    if not counting and "max_tokens" not in body:
        raise invalid("max_tokens", "required")
    chat: dict[str, Any] = {_FIELDS[name] or name: value for name, value in body.items()
                            if _FIELDS.get(name) is not None}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise invalid("thinking", "expected {'type': 'enabled' | 'disabled' | 'adaptive'}")
        if re.search(r"\benable_thinking\b", template):  # a <think> template's switch (Qwen3's)
            chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
        elif kind != "disabled":
            raise unsupported("thinking", "the model's chat template has no thinking switch (only "
                              "{'type': 'disabled'} is served)")
    tier = body.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise invalid("service_tier", "expected 'auto' or 'standard_only'")
    output = body.get("output_config")
    if output is not None and not counting:
        if not isinstance(output, dict):
            raise invalid("output_config", "expected an object")
        _keys(output, "output_config", {"format", "effort"})
        if output.get("effort") is not None:
            raise unsupported("output_config.effort", "effort levels are not served")
        form = output.get("format")
        if form is not None:
            if not isinstance(form, dict) or form.get("type") != "json_schema" or "schema" not in form:
                raise invalid("output_config.format", "expected {'type': 'json_schema', 'schema': {...}}")
            _keys(form, "output_config.format", {"type", "schema"})
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": form["schema"]}}
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise invalid("metadata", "expected an object")
        _keys(metadata, "metadata", {"user_id"})
        if metadata.get("user_id") is not None:
            chat["user"] = metadata["user_id"]
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops)):
        raise invalid("stop_sequences", "expected a list of strings")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty list of messages")
    converted: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        converted.append({"role": "system", "content": _text_blocks(system, "system")})
    for index, message in enumerate(messages):
        converted += _message(index, message)
    chat["messages"] = converted
    _tools(body, chat)
    return chat


def _stop_reason(generation: Generation, calls: bool, stops: list[str]) -> tuple[str, str | None]:
    result = generation.result
    assert result is not None
    if calls:
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.stop_string is not None and result.stop_string in stops:
        return "stop_sequence", result.stop_string
    return "end_turn", None


def _usage(generation: Generation) -> dict[str, Any]:
    result = generation.result
    assert result is not None
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
            "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0}


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


@dataclasses.dataclass(slots=True)
class _Blocks:
    """The content blocks of a streamed message: which one is open, and the next index."""

    index: int = 0
    text_open: bool = False
    thinking_open: bool = False

    def events(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """Anthropic events for chat stream ``deltas`` (reasoning, content text and tool calls)."""
        out: list[bytes] = []
        for delta in deltas:
            body = delta.get("delta", {})
            thought = body.get("reasoning_content")
            if thought:
                if not self.thinking_open:
                    out.append(_event("content_block_start", {
                        "type": "content_block_start", "index": self.index,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
                    self.thinking_open = True
                out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                          "delta": {"type": "thinking_delta", "thinking": thought}}))
            text = body.get("content")
            if text:
                out += self.close_thinking()
                if not self.text_open:
                    out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                              "content_block": {"type": "text", "text": ""}}))
                    self.text_open = True
                out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                          "delta": {"type": "text_delta", "text": text}}))
            for call in body.get("tool_calls") or ():
                out += self.close_thinking() + self.close()
                function = call["function"]
                out.append(_event("content_block_start", {
                    "type": "content_block_start", "index": self.index,
                    "content_block": {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}}))
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))
                out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
                self.index += 1
        return out

    def close_thinking(self) -> list[bytes]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        self.index += 1
        return [_event("content_block_delta", {"type": "content_block_delta", "index": self.index - 1,
                                               "delta": {"type": "signature_delta", "signature": ""}}),
                _event("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]

    def close(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]


async def read_body(raw: Request) -> dict[str, Any]:
    """The request's JSON object (a large one parsed in a worker thread, as chat's are)."""
    data = await raw.body()
    if len(data) <= INLINE_PARSE_BYTES:
        return parse_json_object(data)
    return await trio.to_thread.run_sync(lambda: parse_json_object(data))


class MessagesHandlers:
    """The Messages routes, on the chat handlers' service (lanes, admission, metrics)."""

    def __init__(self, handlers: _Handlers) -> None:
        self.handlers = handlers
        self.service = handlers.service

    async def count_tokens(self, raw: Request) -> Response:
        """``{"input_tokens": N}``: the prompt the same body would send (system, messages, tools)."""
        body = await read_body(raw)
        chat = to_chat_body(body, counting=True, template=self.service.generator.chat_template)
        model = chat.get("model")
        if model not in self.service.model_names:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.service.model_id}'.",
                           param="model", code="model_not_found")
        try:
            tokens, _, _ = _prompt_tokens(self.service, chat, True)
        except ApiError as exc:
            raise renamed(exc, _NAMES) from exc
        self.service.metrics.request_done("count_tokens", 200)
        return JSONResponse({"input_tokens": len(tokens)})

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw)
        chat = to_chat_body(body, template=self.service.generator.chat_template)
        service, handlers = self.service, self.handlers
        try:
            parsed = _parse(service, chat, True)
        except ApiError as exc:
            raise renamed(exc, _NAMES) from exc
        tenant = scope_tenant(raw.scope, service.keys)
        parsed = dataclasses.replace(parsed, request=dataclasses.replace(
            parsed.request, cache_namespace=tenant.cache_namespace(parsed.request.cache_namespace)))
        stops = list(body.get("stop_sequences") or ())
        service.metrics.in_flight.inc()
        try:
            lease, generation, first = await handlers.start(parsed.request, raw)
        except BaseException:
            service.metrics.in_flight.dec()
            raise
        choice = _Choice(0, generation, first, parsed)
        ident = f"msg_{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            service.metrics.request_done("messages", 200)
            return _LeasedStreamingResponse(self._stream(lease, choice, ident, parsed, stops),
                                            lambda: handlers.finish(lease, [generation]))
        try:
            async for piece in generation:
                choice.text.append(piece)
        except StageClientError as exc:
            raise await handlers.chain_error(exc) from exc
        finally:
            await handlers.finish(lease, [generation])
        message = choice.whole(True)["message"]
        content: list[dict[str, Any]] = []
        if choice.reasoning_text:  # a <think> template's reasoning (skippy/api/reasoning.py)
            content.append({"type": "thinking", "thinking": choice.reasoning_text, "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        for call in calls:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"] or "{}")})
        reason, sequence = _stop_reason(generation, bool(calls), stops)
        service.metrics.request_done("messages", 200)
        return JSONResponse({"id": ident, "type": "message", "role": "assistant", "model": service.model_id,
                             "content": content, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": _usage(generation)})

    async def _stream(self, lease: Any, choice: _Choice, ident: str, parsed: Parsed,
                      stops: list[str]) -> AsyncIterator[bytes]:
        generation = choice.generation
        blocks = _Blocks()
        try:
            prompt = len(parsed.request.prompt)
            yield _event("message_start", {"type": "message_start", "message": {
                "id": ident, "type": "message", "role": "assistant", "model": self.service.model_id, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt - generation.cached_tokens, "output_tokens": 0,
                          "cache_read_input_tokens": generation.cached_tokens, "cache_creation_input_tokens": 0}}})
            yield _event("ping", {"type": "ping"})
            for event in blocks.events(choice.piece(choice.text[0], True)):
                yield event
            try:
                while True:
                    with trio.CancelScope(shield=True):  # a client that leaves stops us between steps
                        try:
                            piece = await generation.__anext__()
                        except StopAsyncIteration:
                            break
                    for event in blocks.events(choice.piece(piece, True)):
                        yield event
            except StageClientError as exc:
                error = await self.handlers.chain_error(exc)
                yield _event("error", error.body_for("/v1/messages"))
                return
            except Exception as exc:  # a bug: the stream still ends with an error event
                log.exception("stream %s failed", ident)
                yield _event("error", internal_error(exc).body_for("/v1/messages"))
                return
            for event in blocks.events(choice.closing(True)) + blocks.close_thinking() + blocks.close():
                yield event
            reason, sequence = _stop_reason(generation, bool(choice.calls), stops)
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": {"output_tokens": len(generation.tokens)}})
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            await self.handlers.finish(lease, [generation])
