"""The generic tool-call format: tools for a model whose chat template renders none.

Strategy: llama-server's fallback.  The tools are described in the system prompt (their JSON
definitions and the instruction to answer in JSON with either ``tool_call`` / ``tool_calls`` or
``response``), and the final stage samples under a grammar built from that JSON Schema (the
tools' ``parameters`` schemas inside, through skippy's converter, :mod:`skippy.api.structured`),
so the answer is always one JSON object: ``{"tool_calls": [{"name", "arguments"}, ...]}``
(``parallel_tool_calls``; ``{"tool_call": {...}}`` without) or ``{"response": "text"}``.
``tool_choice`` ``required`` drops the ``response`` alternative and a named choice allows only that
function.  The answer is parsed whole (:data:`FORMAT`): a streamed answer sends its calls or its
response text when the JSON is complete.  Past turns reach the template in the same shape: an
assistant's calls as that JSON text, tool results as a user message
``{"tool_response": {"tool_call_id", "content"}}`` (consecutive results in one message).
"""

from __future__ import annotations

import json
from typing import Any, Final, Mapping, Sequence

from skippy.api.tool_calls import Parsed, ToolFormat, _json_call

__all__ = ["FORMAT", "INSTRUCTION", "generic_messages", "generic_schema"]

INSTRUCTION: Final = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with "
                      "`response` reply to the user's request")
_PARALLEL: Final = ("Respond in JSON format, either with `tool_calls` (a list of requests to call tools) or "
                    "with `response` reply to the user's request")


def _parse(text: str) -> Parsed:
    """``{"tool_calls": [...]}``, ``{"tool_call": {...}}`` or ``{"response": "..."}`` (None: not one)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or len(data) != 1:
        return None
    key, value = next(iter(data.items()))
    if key == "response" and isinstance(value, str):
        return [], value
    items = value if key == "tool_calls" and isinstance(value, list) else [value] if key == "tool_call" else None
    if not items:
        return None
    calls = [_json_call(item) for item in items]
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None], ""


#: The generic format: the whole answer is one JSON object, parsed when complete.
FORMAT: Final = ToolFormat("generic", ("{",), _parse, (), at_start_only=True)


def generic_schema(tools: Sequence[Mapping[str, Any]], name: str | None, required: bool,
                   parallel: bool) -> dict[str, Any]:
    """The JSON Schema of a generic answer (llama.cpp's ``common_chat_params_init_generic``)."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "const": function["name"]},
                             "arguments": function.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]}
             for function in (tool["function"] for tool in tools) if name is None or function["name"] == name]
    call: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = (
        {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
         "required": ["tool_calls"]} if parallel else
        {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]})
    if required:
        return schema
    return {"anyOf": [schema, {"type": "object", "properties": {"response": {"type": "string"}},
                               "required": ["response"]}]}


def _calls_text(calls: list[dict[str, Any]], parallel: bool) -> str:
    shaped = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"],
               **({"id": call["id"]} if call.get("id") else {})} for call in calls]
    return json.dumps({"tool_calls": shaped} if parallel or len(shaped) > 1 else {"tool_call": shaped[0]},
                      ensure_ascii=False)


def generic_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                     parallel: bool) -> list[dict[str, Any]]:
    """Messages (arguments already objects: :func:`~skippy.api.tool_calls.template_messages`) for a
    template without tools: the tools in the system prompt, calls and results as JSON text."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            content = _calls_text(list(message["tool_calls"]), parallel)
            out.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            result = {"tool_response": {**({"tool_call_id": message["tool_call_id"]}
                                            if message.get("tool_call_id") else {}),
                                        "content": message.get("content", "")}}
            if out and out[-1].get("_results") is not None:
                out[-1]["_results"].append(result)
            else:
                out.append({"role": "user", "_results": [result]})
        else:
            out.append({key: value for key, value in message.items() if key not in ("tool_call_id", "name")}
                       if message["role"] != "assistant" else {"role": "assistant",
                                                                 "content": message.get("content", "")})
    for message in out:
        results = message.pop("_results", None)
        if results is not None:
            message["content"] = "\n".join(json.dumps(result, ensure_ascii=False) for result in results)
    if tools:
        described = ("You can call any of the following tools to satisfy the user's requests: "
                     + json.dumps([tool["function"] for tool in tools], indent=2, ensure_ascii=False)
                     + "\n\n" + (_PARALLEL if parallel else INSTRUCTION))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out
