"""OpenAI's Responses API on the chain: ``POST /v1/responses`` and ``/v1/responses/input_tokens``.

Strategy: as for Anthropic's Messages (:mod:`skippy.api.messages`), a Responses body is translated
into the chat-completions body it means and runs through the chat handler's parser, lanes,
admission, prefix cache and tenant, so both APIs answer alike.  ``instructions`` becomes the
first system message; ``input`` (a string, or items) becomes messages: message items (``user``,
``system``, ``developer``, ``assistant``; ``input_text`` / ``output_text`` parts), ``function_call``
items an assistant's ``tool_calls``, ``function_call_output`` items ``tool`` messages, ``reasoning``
items (an earlier answer's, sent back) that turn's ``reasoning_content``: llama-server's rule, the
item joins the assistant turn it follows or opens the one its message / calls then join, and the
template renders it where it reads an earlier turn's reasoning (Qwen3's ``reasoning_content``,
gpt-oss's ``thinking`` on a tool-call turn) and drops it elsewhere.  Function
tools (``{"type": "function", "name", "description", "parameters", "strict"}``) and
``tool_choice`` map onto chat's; ``text.format`` onto ``response_format``; ``max_output_tokens``
onto ``max_tokens``.  The answer is shaped back as output items: one ``message`` with an
``output_text`` part, then one ``function_call`` item per call; ``status`` ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` when the budget ran out.  Streamed, the events
are the Responses ones (``response.created``, ``response.in_progress``, per item
``response.output_item.added`` / ``.done``, ``response.content_part.added`` / ``.done``,
``response.output_text.delta`` / ``.done``, ``response.function_call_arguments.delta`` / ``.done``,
then ``response.completed`` or ``response.incomplete``), each with a ``sequence_number``.

Reasoning (a ``<think>`` template, :mod:`skippy.api.reasoning`, or gpt-oss Harmony channels,
:mod:`skippy.api.harmony`) comes back as a ``reasoning`` item
with a ``reasoning_text`` part before the message (streamed as ``response.reasoning_text.delta``);
``reasoning.effort`` is the template's ``reasoning_effort`` variable.

``previous_response_id``: a response stored (``store`` is true by default) is kept in this
server's memory, per tenant, for the last :data:`STORED_RESPONSES` responses; a later request
naming it continues that conversation (its messages plus its output come first).  An id this
server does not hold is a 400 naming the field.  Every other field is served, a documented no-op,
or a 400 naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Mapping

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippy.api.app import _Handlers, _LeasedStreamingResponse, _parse, _prompt_tokens
from skippy.api.auth import scope_tenant
from skippy.api.choices import _Choice
from skippy.api.errors import ApiError, internal_error, invalid, renamed
from skippy.api.fields import unsupported
from skippy.api.messages import _keys, read_body
from skippy.driver.client import StageClientError
from skippy.driver.generator import Generation

__all__ = ["ResponsesHandlers", "to_chat_body"]

log = logging.getLogger("skippy.api")

#: Chat fields a refusal may name, and the Responses field each came from.
_NAMES = {"response_format.json_schema.schema": "text.format.schema",  # before its parent
          "reasoning_effort": "reasoning.effort", "max_tokens": "max_output_tokens", "response_format": "text.format",
          "messages": "input", "stop": "input"}

#: Responses kept for ``previous_response_id`` (per server; the oldest go first).
STORED_RESPONSES = 256

#: Fields and the chat field each becomes (None: read here).
_FIELDS: dict[str, str | None] = {
    "model": "model", "input": None, "instructions": None, "max_output_tokens": "max_tokens",
    "temperature": "temperature", "top_p": "top_p", "stream": "stream", "tools": None, "tool_choice": None,
    "parallel_tool_calls": "parallel_tool_calls", "text": None, "previous_response_id": None, "store": None,
    "metadata": None, "user": "user", "prompt_cache_key": "prompt_cache_key", "safety_identifier": None,
    "service_tier": None, "truncation": None, "include": None, "background": None, "stream_options": None,
    "prompt_cache_retention": None, "reasoning": None, "seed": "seed", "top_k": "top_k", "grammar": "grammar",
}
_COUNT_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                           "previous_response_id", "reasoning", "truncation"})
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(where, "expected a string or a list of content parts")
    texts = []
    for index, part in enumerate(value):
        place = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise unsupported(place, f"{kind!r} content is not served (text only: a text-only model)")
        assert isinstance(part, dict)
        _keys(part, place, {"type", "text", "annotations", "logprobs"})
        if not isinstance(part.get("text"), str):
            raise invalid(f"{place}.text", "expected a string")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning(item: Mapping[str, Any], where: str) -> str:
    """The text of a ``reasoning`` input item (an earlier answer's, sent back).

    Its ``reasoning_text`` parts are the reasoning; ``summary`` parts are a summary of it, not
    the reasoning itself, and are not rendered (this server writes none); encrypted reasoning
    (another server's) cannot be read and is a 400.
    """
    _keys(item, where, {"type", "id", "summary", "content", "encrypted_content", "status"})
    if item.get("encrypted_content") is not None:
        raise unsupported(f"{where}.encrypted_content", "encrypted reasoning is not served (this server writes "
                          "the reasoning as reasoning_text content)")
    summary = item.get("summary", [])
    if not isinstance(summary, list) or not all(
            isinstance(part, dict) and part.get("type") == "summary_text" and isinstance(part.get("text"), str)
            for part in summary):
        raise invalid(f"{where}.summary", "expected a list of {'type': 'summary_text', 'text'} parts")
    content = item.get("content") or []
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "expected a list of reasoning_text parts")
    texts = []
    for index, part in enumerate(content):
        place = f"{where}.content[{index}]"
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            raise invalid(place, "expected a {'type': 'reasoning_text', 'text'} part")
        _keys(part, place, {"type", "text"})
        if not isinstance(part.get("text"), str):
            raise invalid(f"{place}.text", "expected a string")
        texts.append(part["text"])
    return "".join(texts)


def _items(value: Any) -> list[dict[str, Any]]:
    """Chat messages for ``input``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "expected a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(where, "expected an item object")
        kind = item.get("type", "message")
        if kind == "message":
            _keys(item, where, {"type", "role", "content", "id", "status"})
            role = item.get("role")
            if role not in _ROLES:
                raise invalid(f"{where}.role", f"expected one of {', '.join(_ROLES)}, got {json.dumps(role)}")
            text = _content(item.get("content"), f"{where}.content")
            last = out[-1] if out else None
            if role == "assistant" and last is not None and last["role"] == "assistant" and \
                    last["content"] is None and not last.get("tool_calls"):
                last["content"] = text  # the answer after its reasoning item: one assistant turn
            else:
                out.append({"role": _ROLES[role], "content": text})
        elif kind == "function_call":
            _keys(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
            if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
                raise invalid(where, "a function_call item needs string 'call_id', 'name' and 'arguments'")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _keys(item, where, {"type", "call_id", "output", "id", "status"})
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where}.call_id", "expected a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            reasoning = _reasoning(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "reasoning_content" not in last:
                last["reasoning_content"] = reasoning  # llama-server's rule: the turn it follows
            else:  # the usual order: the reasoning opens its turn, the message / calls join it
                out.append({"role": "assistant", "content": None, "reasoning_content": reasoning})
        else:
            raise unsupported(f"{where}.type", f"{kind!r} items are not served (message, reasoning, function_call "
                              "and function_call_output are)")
    return out


def _tools(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", "expected a list of tools")
        converted = []
        for index, tool in enumerate(tools):
            where = f"tools[{index}]"
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise unsupported(f"{where}.type", f"{kind!r} tools are not served (function tools are)")
            _keys(tool, where, {"type", "name", "description", "parameters", "strict"})
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
            converted.append({"type": "function", "function": function})
        chat["tools"] = converted
    choice = body.get("tool_choice")
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        _keys(choice, "tool_choice", {"type", "name"})
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise unsupported("tool_choice", "expected 'auto', 'none', 'required' or {'type': 'function', 'name'}")


def to_chat_body(body: Mapping[str, Any], history: list[dict[str, Any]] | None = None, *,
                 counting: bool = False) -> dict[str, Any]:
    """The chat-completions body a Responses body means, after ``history`` (the stored
    conversation ``previous_response_id`` names).

    Raises:
        ApiError: 400 naming a field that is unknown or not served; 422 for a malformed one.
    """
    allowed = _COUNT_FIELDS if counting else _FIELDS
    for name in body:
        if name not in allowed:
            raise unsupported(name, "not a Responses API field this server serves")
    chat: dict[str, Any] = {_FIELDS[name] or name: value for name, value in body.items()
                            if _FIELDS.get(name) is not None}
    if body.get("safety_identifier") is not None and "user" not in chat:
        chat["user"] = body["safety_identifier"]
    for name, neutral in (("truncation", ("disabled",)), ("background", (False,)), ("include", ([],))):
        if body.get(name) is not None and body[name] not in neutral:
            raise unsupported(name, f"only {json.dumps(neutral[0])} is served")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("reasoning", "expected an object")
        _keys(reasoning, "reasoning", {"effort", "summary", "generate_summary"})
        for key in ("summary", "generate_summary"):
            if reasoning.get(key) is not None:
                raise unsupported(f"reasoning.{key}", "reasoning summaries are not served (the reasoning item "
                                  "carries the reasoning text itself)")
        if reasoning.get("effort") is not None:  # the chat template's variable (a template without it: 400)
            chat["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("text", "expected an object")
        _keys(text, "text", {"format", "verbosity"})
        if text.get("verbosity") not in (None, "medium"):
            raise unsupported("text.verbosity", "only 'medium' is served")
        form = text.get("format")
        if form is not None:
            if not isinstance(form, dict):
                raise invalid("text.format", "expected an object")
            kind = form.get("type")
            if kind == "json_schema":
                _keys(form, "text.format", {"type", "name", "schema", "strict", "description"})
                chat["response_format"] = {"type": "json_schema", "json_schema": {
                    key: form[key] for key in ("name", "schema", "strict", "description") if key in form}}
            else:
                _keys(form, "text.format", {"type"})
                chat["response_format"] = {"type": kind}
    if "input" not in body:
        raise invalid("input", "required")
    messages = list(history or [])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "expected a string")
        messages.insert(0, {"role": "system", "content": instructions})
    chat["messages"] = messages + _items(body["input"])
    _tools(body, chat)
    return chat


@dataclasses.dataclass(frozen=True, slots=True)
class _Stored:
    tenant: str
    #: The chat messages of the conversation, the answer included.
    messages: list[dict[str, Any]]


class _Shaper:
    """The output items of one response, whole or as stream events."""

    def __init__(self, ident: str, model: str, body: Mapping[str, Any]) -> None:
        self.ident = ident
        self.model = model
        self.body = body
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.text: list[str] = []
        self.text_open = False
        self.reasoning_id = f"rs_{uuid.uuid4().hex[:24]}"
        self.reasoning: list[str] = []
        self.reasoning_open = False

    def response(self, status: str, generation: Generation | None = None) -> dict[str, Any]:
        body = self.body
        out: dict[str, Any] = {
            "id": self.ident, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.items, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools", []), "metadata": body.get("metadata") or {}, "store": body.get("store", True),
            "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled", "usage": None,
        }
        if generation is not None and generation.result is not None:
            result = generation.result
            out["usage"] = {"input_tokens": result.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": result.cached_tokens},
                            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": result.prompt_tokens + result.completion_tokens}
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def _message_item(self, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": "".join(self.text), "annotations": [], "logprobs": []}] \
            if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def deltas(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """Stream events for chat stream ``deltas``."""
        out: list[bytes] = []
        for delta in deltas:
            body = delta.get("delta", {})
            thought = body.get("reasoning_content")
            if thought:
                if not self.reasoning_open:
                    self.reasoning_open = True
                    out.append(self.event("response.output_item.added", output_index=len(self.items),
                                          item={**self._reasoning_item(), "content": [], "status": "in_progress"}))
                self.reasoning.append(thought)
                out.append(self.event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                      output_index=len(self.items), content_index=0, delta=thought))
            text = body.get("content")
            if text:
                out += self.close_reasoning()
                if not self.text_open:
                    self.text_open = True
                    out.append(self.event("response.output_item.added", output_index=len(self.items),
                                          item=self._message_item("in_progress")))
                    out.append(self.event("response.content_part.added", item_id=self.message_id,
                                          output_index=len(self.items), content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []}))
                self.text.append(text)
                out.append(self.event("response.output_text.delta", item_id=self.message_id,
                                      output_index=len(self.items), content_index=0, delta=text, logprobs=[]))
            for call in body.get("tool_calls") or ():
                out += self.close_reasoning() + self.close_text()
                item = self.call_item(call)
                index = len(self.items)
                out.append(self.event("response.output_item.added", output_index=index,
                                      item={**item, "arguments": "", "status": "in_progress"}))
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=item["arguments"]))
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
                self.items.append(item)
                out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def _reasoning_item(self) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": "".join(self.reasoning)}]}

    def close_reasoning(self) -> list[bytes]:
        if not self.reasoning_open:
            return []
        self.reasoning_open = False
        index = len(self.items)
        item = self._reasoning_item()
        self.items.append(item)
        return [self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=index,
                           content_index=0, text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        index = len(self.items)
        item = self._message_item("completed")
        self.items.append(item)
        text = item["content"][0]["text"]
        return [self.event("response.output_text.done", item_id=self.message_id, output_index=index,
                           content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=self.message_id, output_index=index,
                           content_index=0, part=item["content"][0]),
                self.event("response.output_item.done", output_index=index, item=item)]

    @staticmethod
    def call_item(call: Mapping[str, Any]) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def whole(self, message: Mapping[str, Any], reasoning: str = "") -> None:
        if reasoning:  # a <think> template's reasoning (skippy/api/reasoning.py)
            self.reasoning.append(reasoning)
            self.items.append(self._reasoning_item())
        if message.get("content"):
            self.text.append(message["content"])
            self.items.append(self._message_item("completed"))
        for call in message.get("tool_calls") or ():
            self.items.append(self.call_item(call))


def _status(generation: Generation, calls: bool) -> str:
    result = generation.result
    assert result is not None
    return "incomplete" if result.finish_reason == "length" and not calls else "completed"


class ResponsesHandlers:
    """The Responses routes, on the chat handlers' service, with the stored responses."""

    def __init__(self, handlers: _Handlers) -> None:
        self.handlers = handlers
        self.service = handlers.service
        self._stored: collections.OrderedDict[str, _Stored] = collections.OrderedDict()

    def _history(self, body: Mapping[str, Any], tenant: str) -> list[dict[str, Any]] | None:
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        stored = self._stored.get(previous) if isinstance(previous, str) else None
        if stored is None or stored.tenant != tenant:
            raise ApiError(400, f"Previous response with id '{previous}' not found: this server keeps the last "
                           f"{STORED_RESPONSES} stored responses in memory.", param="previous_response_id",
                           code="previous_response_not_found")
        return list(stored.messages)

    def _store(self, ident: str, tenant: str, chat: Mapping[str, Any], instructed: bool,
               message: Mapping[str, Any]) -> None:
        answer = {"role": "assistant", "content": message.get("content")}
        if message.get("reasoning_content"):
            answer["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            answer["tool_calls"] = message["tool_calls"]
        # a response's instructions are its own: a continuation gives its own (as OpenAI's does)
        messages = list(chat["messages"][1:] if instructed else chat["messages"])
        self._stored[ident] = _Stored(tenant, [*messages, answer])
        while len(self._stored) > STORED_RESPONSES:
            self._stored.popitem(last=False)

    async def input_tokens(self, raw: Request) -> Response:
        """``{"object": "response.input_tokens", "input_tokens": N}`` for the prompt the body would send."""
        body = await read_body(raw)
        tenant = scope_tenant(raw.scope, self.service.keys).id
        chat = to_chat_body(body, self._history(body, tenant), counting=True)
        if chat.get("model", self.service.model_id) not in self.service.model_names:
            raise ApiError(404, f"The model '{chat['model']}' does not exist; this server serves "
                           f"'{self.service.model_id}'.", param="model", code="model_not_found")
        try:
            tokens, _, _ = _prompt_tokens(self.service, chat, True)
        except ApiError as exc:
            raise renamed(exc, _NAMES) from exc
        self.service.metrics.request_done("responses_input_tokens", 200)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(tokens)})

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw)
        service, handlers = self.service, self.handlers
        tenant = scope_tenant(raw.scope, service.keys)
        chat = to_chat_body(body, self._history(body, tenant.id))
        try:
            parsed = _parse(service, chat, True)
        except ApiError as exc:
            raise renamed(exc, _NAMES) from exc
        parsed = dataclasses.replace(parsed, request=dataclasses.replace(
            parsed.request, cache_namespace=tenant.cache_namespace(parsed.request.cache_namespace)))
        store = body.get("store", True)
        if not isinstance(store, bool):
            raise invalid("store", "expected a boolean")
        service.metrics.in_flight.inc()
        try:
            lease, generation, first = await handlers.start(parsed.request, raw)
        except BaseException:
            service.metrics.in_flight.dec()
            raise
        choice = _Choice(0, generation, first, parsed)
        shaper = _Shaper(f"resp_{uuid.uuid4().hex[:24]}", service.model_id, body)
        on_done = (lambda message: self._store(shaper.ident, tenant.id, chat, body.get("instructions") is not None,
                                                    message)) if store else None
        if parsed.stream:
            service.metrics.request_done("responses", 200)
            return _LeasedStreamingResponse(self._stream(lease, choice, shaper, on_done),
                                            lambda: handlers.finish(lease, [generation]))
        try:
            async for piece in generation:
                choice.text.append(piece)
        except StageClientError as exc:
            raise await handlers.chain_error(exc) from exc
        finally:
            await handlers.finish(lease, [generation])
        message = choice.whole(True)["message"]
        shaper.whole(message, choice.reasoning_text)
        if on_done is not None:
            on_done(message)
        service.metrics.request_done("responses", 200)
        return JSONResponse(shaper.response(_status(generation, bool(message.get("tool_calls"))), generation))

    async def _stream(self, lease: Any, choice: _Choice, shaper: _Shaper, on_done: Any) -> AsyncIterator[bytes]:
        generation = choice.generation
        try:
            yield shaper.event("response.created", response=shaper.response("in_progress"))
            yield shaper.event("response.in_progress", response=shaper.response("in_progress"))
            for event in shaper.deltas(choice.piece(choice.text[0], True)):
                yield event
            try:
                while True:
                    with trio.CancelScope(shield=True):  # a client that leaves stops us between steps
                        try:
                            piece = await generation.__anext__()
                        except StopAsyncIteration:
                            break
                    for event in shaper.deltas(choice.piece(piece, True)):
                        yield event
            except StageClientError as exc:
                error = await self.handlers.chain_error(exc)
                yield shaper.event("error", code=error.code, message=error.message, param=error.param)
                return
            except Exception as exc:  # a bug: the stream still ends with an error event
                log.exception("stream %s failed", shaper.ident)
                error = internal_error(exc)
                yield shaper.event("error", code=error.code, message=error.message, param=None)
                return
            for event in shaper.deltas(choice.closing(True)) + shaper.close_reasoning() + shaper.close_text():
                yield event
            calls = [item for item in shaper.items if item["type"] == "function_call"]
            if on_done is not None:
                on_done({"content": "".join(shaper.text) or None, "reasoning_content": "".join(shaper.reasoning),
                         "tool_calls": [
                    {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                             "arguments": item["arguments"]}}
                    for item in calls]})
            status = _status(generation, bool(calls))
            yield shaper.event(f"response.{status}", response=shaper.response(status, generation))
        finally:
            await self.handlers.finish(lease, [generation])
