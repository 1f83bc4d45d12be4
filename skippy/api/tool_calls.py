"""Tool calls: the request's tools checked, the model's tool-call output parsed back.

Strategy: tools reach the prompt through the model's own chat template (its ``tools`` variable;
:meth:`skippy.driver.generator.Generator.apply_chat_template`).  What comes back is text in the
family's own call syntax, which a :class:`ToolFormat` turns into OpenAI ``tool_calls``:

* ``hermes`` (Hermes 2/3, Qwen 2.5/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  any number of them, content allowed before the first;
* ``llama3`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several separated by ``;``);
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name", "arguments", "id"?}]`` (v3 tokenizers)
  or, per call, ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` (v11+, ``[CALL_ID]`` optional);
* ``gemma`` (Gemma 4, FunctionGemma): ``<|tool_call>call:name{key:value,...}<tool_call|>`` where
  strings are wrapped in ``<|"|>`` and keys are bare (:func:`_gemma_value` reads it).

The format is told from the template text (the markers its tool-call rendering writes).
:class:`ToolCallStream` is the streaming side: text before a call's opening marker streams as
content, a tail that could be the start of a marker is held back (as stop strings are), and from
the marker on everything is kept; at the end the kept text is parsed into calls (text a model writes
between or after its calls comes back as content), or, when it does
not parse, returned as content, so no generated text is ever lost.  A call is handed over as soon
as it is closed (formats with a closing marker: hermes, gemma) or when the generation ends (the
others); a stream sends it as one complete ``delta.tool_calls`` entry (id, name, arguments).

``tool_choice`` ``required`` / a named function is forced by a grammar where the format's call is
JSON text (hermes, llama3, mistral-v3: :func:`forcing_grammar`, the tools' parameter schemas turned
into GBNF by llama-cpp-python's converter, sampled under by the final stage): the answer is one
call of an allowed function whose arguments follow its schema.  Otherwise (Mistral's
``[ARGS]`` syntax, Gemma's, or no converter installed) the format's call opening and the name are
written at the start of the assistant turn (:meth:`ToolFormat.forced_prefix`) and the model
continues from inside the call; a model that still writes no valid call gets its text back as
content.  The parser reads prompt suffix + continuation either way.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from typing import Any, Callable, Final, Mapping, Sequence

from skippy.api.errors import ApiError, invalid
from skippy.api.fields import unsupported

__all__ = ["FORMATS", "ToolCall", "ToolCallStream", "ToolChoice", "ToolFormat", "ToolsRequest", "detect_format",
           "parse_tool_choice", "parse_tools", "template_messages"]

_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (``index`` for a stream delta)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call_id(mistral: bool) -> str:
    if mistral:  # Mistral's templates insist on 9 alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def _json_call(data: Any, names: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments"|"parameters": {...}}`` (None: not one)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = next((data[key] for key in names if key in data), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    ident = data.get("id") if isinstance(data.get("id"), str) else ""
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False), ident)


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values in ``text`` separated by whitespace or ``;`` (None: anything else)."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


# -- the formats ---------------------------------------------------------------------------------

#: A parser's answer: the calls and the text between / after them (None: not a call region).
Parsed = tuple[list["ToolCall"], str] | None


def _outside(pieces: list[str]) -> str:
    """Text a model wrote between or after its calls ('' when only whitespace)."""
    text = "".join(pieces)
    return text if text.strip() else ""


def _parse_hermes(text: str) -> Parsed:
    calls, outside = [], []
    for block in re.split(r"<tool_call>", text)[1:]:
        body, _, after = block.partition("</tool_call>")
        values = _json_values(body.strip())
        if not values or len(values) != 1:
            return None
        call = _json_call(values[0])
        if call is None:
            return None
        calls.append(call)
        outside.append(after)
    return (calls, _outside(outside)) if calls else None


def _parse_llama3(text: str) -> Parsed:
    values = _json_values(text.replace("<|python_tag|>", " "))
    if not values:
        return None
    calls = [_json_call(value, ("parameters", "arguments")) for value in values]
    return None if any(call is None for call in calls) else ([call for call in calls if call is not None], "")


_MISTRAL_CALL: Final = re.compile(r"^\s*([A-Za-z0-9_-]{1,64})\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]",
                                  re.DOTALL)


def _parse_mistral(text: str) -> Parsed:
    calls: list[ToolCall] = []
    for block in text.split("[TOOL_CALLS]")[1:]:
        named = _MISTRAL_CALL.match(block)
        if named:  # name[CALL_ID]id[ARGS]{...}
            values = _json_values(block[named.end():].strip())
            if not values or len(values) != 1 or not isinstance(values[0], dict):
                return None
            calls.append(ToolCall(named.group(1), json.dumps(values[0], ensure_ascii=False), named.group(2) or ""))
            continue
        values = _json_values(block.strip())  # [{"name": ..., "arguments": ...}, ...]
        if not values or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
            return None
        for item in values[0]:
            call = _json_call(item)
            if call is None:
                return None
            calls.append(call)
    return (calls, "") if calls else None


_QUOTE: Final = '<|"|>'


def _gemma_value(text: str, at: int) -> tuple[Any, int]:
    """One value of Gemma's call syntax starting at ``at``; (value, end)."""
    while at < len(text) and text[at].isspace():
        at += 1
    if text.startswith(_QUOTE, at):
        end = text.index(_QUOTE, at + len(_QUOTE))
        return text[at + len(_QUOTE):end], end + len(_QUOTE)
    if at < len(text) and text[at] == "{":
        out: dict[str, Any] = {}
        at += 1
        while True:
            while at < len(text) and text[at] in " \n\t,":
                at += 1
            if at < len(text) and text[at] == "}":
                return out, at + 1
            if text.startswith(_QUOTE, at):
                key, at = _gemma_value(text, at)
            else:
                match = re.compile(r"[^:{}\[\],\s]+").match(text, at)
                if match is None:
                    raise ValueError(f"expected a key at {at}")
                key, at = match.group(0), match.end()
            if not text.startswith(":", at):
                raise ValueError(f"expected ':' at {at}")
            out[str(key)], at = _gemma_value(text, at + 1)
    if at < len(text) and text[at] == "[":
        items: list[Any] = []
        at += 1
        while True:
            while at < len(text) and text[at] in " \n\t,":
                at += 1
            if at < len(text) and text[at] == "]":
                return items, at + 1
            item, at = _gemma_value(text, at)
            items.append(item)
    match = re.compile(r"[^,}\]\s]+").match(text, at)
    if match is None:
        raise ValueError(f"expected a value at {at}")
    word = match.group(0)
    if word in ("true", "false"):
        return word == "true", match.end()
    if word == "null":
        return None, match.end()
    try:
        return json.loads(word), match.end()
    except ValueError:
        return word, match.end()  # a bare word: read as a string


def _parse_gemma(text: str) -> Parsed:
    calls, outside = [], []
    for block in re.split(r"<\|tool_call>|<start_function_call>", text)[1:]:
        parts = re.split(r"<tool_call\|>|<end_function_call>", block, maxsplit=1)
        body = parts[0].strip()
        outside.append(parts[1] if len(parts) > 1 else "")
        match = re.match(r"call:([A-Za-z0-9_.-]{1,64})\s*", body)
        if match is None:
            return None
        try:
            arguments, end = _gemma_value(body, match.end())
        except (ValueError, IndexError):
            return None
        if not isinstance(arguments, dict) or body[end:].strip():
            return None
        calls.append(ToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False)))
    return (calls, _outside(outside)) if calls else None


@dataclasses.dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's tool-call syntax."""

    name: str
    #: Texts that open a call; the first one found starts the call region.
    openers: tuple[str, ...]
    #: Text -> (calls, the text outside them); None: the text is not a well-formed call region.
    parse: Callable[[str], Parsed]
    #: Tokens whose special piece must appear in the text for the parser (rendered, not dropped).
    special_markers: tuple[str, ...]
    #: The call region may only start at the very beginning of the answer (llama3's bare JSON).
    at_start_only: bool = False
    #: ``forced_prefix`` templates: any call, and a named one ({name}).
    force_any: str = ""
    force_named: str = ""
    #: Texts that close a call: a closed call is handed over while the generation goes on.
    closers: tuple[str, ...] = ()
    #: Grammar forcing (:func:`forcing_grammar`): the prompt ends in ``grammar_opener`` and the
    #: grammar writes, per allowed function, ``grammar_call`` split at ``{args}`` around the
    #: arguments' JSON; "" when the format's call is not JSON text (Gemma).
    grammar_opener: str = ""
    grammar_call: str = ""

    def forced_prefix(self, name: str | None) -> str:
        """The text written at the start of the answer to force a call (of ``name``, when given)."""
        return self.force_any if name is None else self.force_named.format(name=name)

    def find_opener(self, text: str) -> int:
        """Where the call region starts in ``text`` (-1: not yet)."""
        if self.at_start_only:
            stripped = text.lstrip()
            return 0 if any(stripped.startswith(opener) for opener in self.openers) else -1
        found = [index for index in (text.find(opener) for opener in self.openers) if index >= 0]
        return min(found) if found else -1

    def could_open(self, tail: str) -> int:
        """How many characters at the end of ``tail`` could be the start of an opener (held back)."""
        hold = 0
        for opener in self.openers:
            for length in range(min(len(opener) - 1, len(tail)), hold, -1):
                if tail.endswith(opener[:length]):
                    hold = length
                    break
        return hold


FORMATS: Final[Mapping[str, ToolFormat]] = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), _parse_hermes, ("<tool_call>", "</tool_call>"),
                         force_any="<tool_call>\n", force_named='<tool_call>\n{{"name": "{name}", "arguments": ',
                         closers=("</tool_call>",), grammar_opener="<tool_call>\n",
                         grammar_call='{{"name": "{name}", "arguments": {args}}}'),
    "llama3": ToolFormat("llama3", ("<|python_tag|>", "{"), _parse_llama3, ("<|python_tag|>",), at_start_only=True,
                         force_any='{"name": "', force_named='{{"name": "{name}", "parameters": ',
                         grammar_call='{{"name": "{name}", "parameters": {args}}}'),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), _parse_mistral, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
                          force_any="[TOOL_CALLS]", force_named="[TOOL_CALLS]{name}[ARGS]"),
    "mistral-v3": ToolFormat("mistral-v3", ("[TOOL_CALLS]",), _parse_mistral, ("[TOOL_CALLS]",),
                             force_any="[TOOL_CALLS][",
                             force_named='[TOOL_CALLS][{{"name": "{name}", "arguments": ',
                             grammar_opener="[TOOL_CALLS]", grammar_call='[{{"name": "{name}", "arguments": {args}}}]'),
    "gemma": ToolFormat("gemma", ("<|tool_call>", "<start_function_call>"), _parse_gemma,
                        ("<|tool_call>", "<tool_call|>", _QUOTE, "<start_function_call>", "<end_function_call>"),
                        force_any="<|tool_call>call:", force_named="<|tool_call>call:{name}{{",
                        closers=("<tool_call|>", "<end_function_call>")),
}


def forcing_grammar(format: ToolFormat, tools: Sequence[Mapping[str, Any]], name: str | None,
                    converter: Any) -> tuple[str, str] | None:
    """(prompt suffix, GBNF) that make the model write one call of ``name`` (or of any tool) whose
    arguments follow the tool's parameters schema; None when the format cannot be forced this way.

    ``converter`` is llama-cpp-python's ``llama_grammar`` module (its ``SchemaConverter``, the port of
    llama.cpp's JSON-schema-to-grammar); every tool's schema becomes rules of one grammar whose root
    is the alternatives of the allowed calls, written in the format's own syntax.
    """
    if not format.grammar_call:
        return None
    chosen = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    if not chosen:
        return None
    schema_converter = converter.SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    alternatives = []
    for index, function in enumerate(chosen):
        schema = schema_converter.resolve_refs(dict(function.get("parameters") or {"type": "object"}),
                                               f"tool-{index}")
        rule = schema_converter.visit(schema, f"tool-{index}-arguments")
        before, _, after = format.grammar_call.format(name=function["name"], args="\0").partition("\0")
        parts = [schema_converter._format_literal(before), rule]
        if after:
            parts.append(schema_converter._format_literal(after))
        alternatives.append(" ".join(parts))
    schema_converter._add_rule("root", " | ".join(f"( {alternative} )" for alternative in alternatives))
    return format.grammar_opener, schema_converter.format_grammar()


def detect_format(template: str) -> ToolFormat | None:
    """The tool-call syntax a chat template writes for assistant tool calls (None: none known)."""
    if "<|tool_call>" in template or "<start_function_call>" in template:
        return FORMATS["gemma"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral" if "[ARGS]" in template else "mistral-v3"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if '"parameters"' in template and ("<|start_header_id|>" in template or "<|python_tag|>" in template):
        return FORMATS["llama3"]
    return None


# -- the request side ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class ToolChoice:
    """``tool_choice`` reduced: ``mode`` none / auto / required, and the function a named choice forces."""

    mode: str
    name: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ToolsRequest:
    """The tools of one chat request (``tools`` for the template; ``choice``; ``parallel``)."""

    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the tools reach the template and the answer is parsed for calls."""
        return bool(self.tools) and self.choice.mode != "none"


def _check_schema(where: str, schema: Any) -> None:
    if not isinstance(schema, dict):
        raise ApiError(400, f"Invalid value for '{where}': a JSON schema object is expected, got "
                       f"{json.dumps(schema)[:60]}", param=where, code="invalid_value")
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise ApiError(400, f"Invalid value for '{where}': the parameters schema must describe an object "
                       f"(type 'object'), got type {json.dumps(kind)}", param=where, code="invalid_value")
    properties = schema.get("properties")
    if properties is not None and (not isinstance(properties, dict)
                                   or not all(isinstance(v, dict) for v in properties.values())):
        raise ApiError(400, f"Invalid value for '{where}.properties': expected an object of schemas",
                       param=f"{where}.properties", code="invalid_value")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise ApiError(400, f"Invalid value for '{where}.required': expected a list of property names",
                       param=f"{where}.required", code="invalid_value")
    try:
        import jsonschema
    except ImportError:  # the API's dependency; without it only the checks above run
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.exceptions.SchemaError as exc:
            raise ApiError(400, f"Invalid value for '{where}': not a valid JSON Schema: {exc.message}",
                           param=where, code="invalid_value") from exc


def parse_tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """The ``tools`` list, checked (function tools only; a bad parameters schema is a 400 naming it)."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid("tools", "expected a list of tools")
    out = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(where, "expected a tool object")
        if tool.get("type") != "function":
            raise unsupported(f"{where}.type", f"only function tools are served (got {json.dumps(tool.get('type'))})")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "expected an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(400, f"Invalid value for '{where}.function.name': expected 1-64 letters, digits, "
                           f"'_' or '-', got {json.dumps(name)}", param=f"{where}.function.name", code="invalid_value")
        if name in seen:
            raise ApiError(400, f"Invalid value for '{where}.function.name': {name!r} is defined twice",
                           param=f"{where}.function.name", code="invalid_value")
        seen.add(name)
        if "parameters" in function:
            _check_schema(f"{where}.function.parameters", function["parameters"])
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.function.description", "expected a string")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise unsupported(f"{where}.function.{unknown[0]}", "not a function field this server reads")
        clean = {key: value for key, value in function.items() if key != "strict"}
        clean.setdefault("parameters", {"type": "object", "properties": {}})
        out.append({"type": "function", "function": clean})
    return tuple(out)


def parse_tool_choice(body: Mapping[str, Any], tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """``tool_choice`` checked against ``tools`` (default: auto with tools, none without)."""
    value = body.get("tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid("tool_choice", f"expected none, auto, required or a function, got {value!r}")
        if value != "none" and not tools:
            raise invalid("tool_choice", f"{value!r} needs tools")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise invalid("tool_choice", f"names function {json.dumps(name)}, which is not among the tools "
                          f"({', '.join(names) or 'none given'})")
        return ToolChoice("required", str(name))
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        raise unsupported("tool_choice", f"tool_choice of type {value['type']!r} is not served "
                          "(none, auto, required or a function)")
    raise invalid("tool_choice", "expected none, auto, required or {\"type\": \"function\", ...}")


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a tool call's ``arguments`` as an object, not JSON text."""
    out = []
    for index, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            out.append(dict(message))
            continue
        if not isinstance(calls, list):
            raise invalid(f"messages[{index}].tool_calls", "expected a list")
        converted = []
        for number, call in enumerate(calls):
            where = f"messages[{index}].tool_calls[{number}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise invalid(where, "expected {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    raise invalid(f"{where}.function.arguments", "expected a JSON object as text") from None
            converted.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": converted})
    return out


# -- the answer side -----------------------------------------------------------------------------

class ToolCallStream:
    """Splits generated text into content and tool calls (see the module header).

    Args:
        format: the template's call syntax.
        prefix: text written into the prompt to force a call; it opens the answer's call region.
        parallel: False keeps only the first call.
    """

    def __init__(self, format: ToolFormat, prefix: str = "", *, parallel: bool = True) -> None:
        self.format = format
        self.parallel = parallel
        self._pending = prefix
        self._region: str | None = None
        self._ready: list[ToolCall] = []
        self._handed = 0
        self._after_call = False
        if prefix:
            self._enter(0)

    def _enter(self, at: int) -> None:
        self._region, self._pending = self._pending[at:], ""

    def push(self, text: str) -> str:
        """Add generated text; returns the content that can be shown now (closed calls wait in
        :meth:`take_calls`)."""
        if self._region is not None:
            self._region += text
            return self._release()
        self._pending += text
        at = self.format.find_opener(self._pending)
        if at >= 0:
            out = self._pending[:at]
            if self._after_call and not out.strip():
                out = ""  # only whitespace between two calls
            self._after_call = False
            self._enter(at)
            return out + self._release()
        if self._after_call:
            held = self.format.could_open(self._pending)
            if not self._pending[:len(self._pending) - held].strip():
                return ""  # whitespace after a call (perhaps before the next): shown only if text follows
            self._after_call = False
        if self.format.at_start_only:
            if not self._pending.strip():
                return ""  # nothing but whitespace yet: the answer could still start with a call
            stripped = self._pending.lstrip()
            if any(opener.startswith(stripped) for opener in self.format.openers):
                return ""
            out, self._pending = self._pending, ""
            self._disarm()
            return out
        hold = self.format.could_open(self._pending)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def _release(self) -> str:
        """When every call of the region so far is closed and parses, hand the calls over and read
        what follows as content again (a call that does not parse waits for :meth:`finish`)."""
        region = self._region
        assert region is not None
        ends = [region.rfind(closer) + len(closer) for closer in self.format.closers if closer in region]
        if not ends:
            return ""
        end = max(ends)
        parsed = self.format.parse(region[:end])
        if parsed is None or parsed[1]:
            return ""
        self._ready += parsed[0]
        self._region, self._pending, self._after_call = None, "", True
        return self.push(region[end:])

    def _disarm(self) -> None:
        """A start-only format whose answer did not start with a call: the rest is plain content."""
        self.format = dataclasses.replace(self.format, openers=(), at_start_only=False)

    def take_calls(self) -> list[ToolCall]:
        """The calls closed since the last take, with their ids (only the first call of all when
        ``parallel`` is off)."""
        mistral = self.format.name.startswith("mistral")
        calls = [dataclasses.replace(call, id=call.id or _call_id(mistral)) for call in self._ready]
        self._ready = []
        if not self.parallel:
            calls = calls[:max(0, 1 - self._handed)]
        self._handed += len(calls)
        return calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet returned, the calls not yet taken); a region that does not parse comes
        back as content."""
        if self._region is None:
            out, self._pending = self._pending, ""
            return ("" if self._after_call and not out.strip() else out), self.take_calls()
        region, self._region = self._region, None
        parsed = self.format.parse(region)
        if parsed is None:
            return region, self.take_calls()
        calls, outside = parsed
        self._ready += calls
        return outside, self.take_calls()


# -- the template side ---------------------------------------------------------------------------

#: A tool no real request names: the capability probe looks for it in the rendered prompt.
_PROBE_TOOL: Final = {"type": "function", "function": {
    "name": "skippy_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


def renders_tools(render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]) -> bool:
    """Whether a template renders the ``tools`` it is given (the probe tool's name reaches the prompt)."""
    try:
        return "skippy_probe_tool" in render([{"role": "user", "content": "ping"}], [_PROBE_TOOL])
    except Exception:  # a template that refuses tools, or the probe conversation
        return False


def marker_tokens(format: ToolFormat, encode: Callable[[str], list[int]]) -> frozenset[int]:
    """The format's markers that are single (special) tokens: they must be rendered into the text."""
    out = set()
    for marker in format.special_markers:
        tokens = encode(marker)
        if len(tokens) == 1:
            out.add(tokens[0])
    return frozenset(out)
