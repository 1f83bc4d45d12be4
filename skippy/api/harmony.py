"""gpt-oss Harmony answers: the ``analysis`` channel as reasoning, ``final`` as content, and
``commentary`` messages addressed ``to=functions.NAME`` as tool calls.

Strategy: a Harmony answer is a run of messages, each ``[<|start|>assistant]<|channel|>CHANNEL
[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`` closed by ``<|end|>``, ``<|call|>`` or
``<|return|>`` (the last two are end-of-generation tokens of the real vocabulary, so the answer's
end closes its last message too).  :class:`HarmonyStream` reads the text as it streams: a header
is held until its ``<|message|>``; a body streams as reasoning (``analysis``) or content (``final``,
and a ``commentary`` preamble without recipient), a tail that could be the start of a marker held
back; a body addressed to ``functions.NAME`` is kept and becomes one tool call when its message
closes (its JSON arguments; a body that is not a JSON object comes back as content, so no text is
lost).  An answer that does not start with a Harmony header is content as written.  A forced call
(``tool_choice`` required / named) writes the call's header into the prompt; the stream starts
from that prefix, as :class:`~skippy.api.tool_calls.ToolCallStream` does; the rest of the call (the
name, its header and the arguments under the tool's schema) is grammar-forced as in the other
formats: a grammar's string literal matches a special token by its text, so ``<|constrain|>`` and
``<|message|>`` are the vocabulary's own tokens when the model picks them.

An earlier answer's reasoning sent back (``reasoning_content``; a Responses ``reasoning`` item, a
Messages ``thinking`` block) is the template's ``thinking`` field, as llama.cpp's gpt-oss handler
passes it (:func:`template_messages`); the template renders it only for a tool-call turn after the
last final answer and drops it elsewhere, gpt-oss's own rule.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, Mapping, Sequence

from skippy.api.tool_calls import ToolCall, ToolFormat, _call_id

__all__ = ["FORMAT", "HarmonyStream", "MARKERS", "is_harmony", "template_messages"]

START: Final = "<|start|>"
CHANNEL: Final = "<|channel|>"
MESSAGE: Final = "<|message|>"
CONSTRAIN: Final = "<|constrain|>"
#: Markers that close a message.
ENDS: Final = ("<|end|>", "<|call|>", "<|return|>")
#: Every Harmony marker (rendered into the text: the parser reads them).
MARKERS: Final = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_CHANNEL_NAME: Final = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT: Final = re.compile(r"\bto=([^\s<]+)")


def is_harmony(template: str) -> bool:
    """Whether a chat template writes Harmony messages (gpt-oss)."""
    return CHANNEL in template and MESSAGE in template and START in template


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a Harmony template: an assistant's ``reasoning_content`` as its ``thinking``.

    On a tool-call turn with reasoning the content is dropped, as llama.cpp does: the template
    renders one analysis message there and refuses both.
    """
    out = []
    for message in messages:
        message = dict(message)
        reasoning = message.pop("reasoning_content", None)
        if isinstance(reasoning, str):
            message["thinking"] = reasoning
            if message.get("tool_calls"):
                message.pop("content", None)
        out.append(message)
    return out


def _partial(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of a marker."""
    hold = 0
    for marker in (*ENDS, START):
        for length in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:length]):
                hold = length
                break
    return hold


class HarmonyStream:
    """Splits a Harmony answer into (reasoning, content, tool calls), whole or streamed.

    Args:
        prefix: text the prompt ends with to force a call (the call's header); read first.
        parallel: False keeps only the first call.
    """

    def __init__(self, prefix: str = "", *, parallel: bool = True) -> None:
        self.parallel = parallel
        self._pending = ""
        self._header = True
        #: Not Harmony after all: everything is content.
        self._raw = False
        self._channel = ""
        self._recipient = ""
        self._call: list[str] = []
        self._calls = 0
        self._prefix = prefix

    def push(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """Add generated text; the (reasoning, content, closed calls) that are certain now."""
        self._pending += self._prefix + text
        self._prefix = ""
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._pending:
            if self._raw:
                content.append(self._pending)
                self._pending = ""
                break
            if self._header:
                at = self._pending.find(MESSAGE)
                if at < 0:
                    head = self._pending.lstrip()
                    if head and not any(head.startswith(m[:len(head)]) or head.startswith(m)
                                        for m in (START, CHANNEL)):
                        self._raw = True
                        continue
                    break
                header, self._pending = self._pending[:at], self._pending[at + len(MESSAGE):]
                channel = _CHANNEL_NAME.search(header)
                recipient = _RECIPIENT.search(header)
                self._channel = channel.group(1) if channel else ""
                self._recipient = recipient.group(1) if recipient else ""
                self._header = False
                continue
            found = [(self._pending.find(marker), marker) for marker in (*ENDS, START)]
            found = [(at, marker) for at, marker in found if at >= 0]
            if found:
                at, marker = min(found)
                self._body(self._pending[:at], reasoning, content)
                self._close(content, calls)
                self._pending = self._pending[at + (0 if marker == START else len(marker)):]
                self._header = True
                continue
            hold = _partial(self._pending)
            self._body(self._pending[:len(self._pending) - hold], reasoning, content)
            self._pending = self._pending[len(self._pending) - hold:]
            break
        return "".join(reasoning), "".join(content), calls

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """The end of the answer: what was held back, and the last message closed."""
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        pending, self._pending = self._pending, ""
        if self._raw or self._header:
            content.append(pending if pending.strip() else "")
        else:
            self._body(pending, reasoning, content)
            self._close(content, calls)
        return "".join(reasoning), "".join(content), calls

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self._recipient:
            self._call.append(text)
        elif self._channel == "analysis":
            reasoning.append(text)
        else:  # final, or a commentary preamble to the user
            content.append(text)

    def _close(self, content: list[str], calls: list[ToolCall]) -> None:
        if not self._recipient:
            return
        body, self._call = "".join(self._call), []
        name = self._recipient.removeprefix("functions.")
        try:
            arguments = json.loads(body)
        except ValueError:
            arguments = None
        if self._recipient.startswith("functions.") and isinstance(arguments, dict):
            if self.parallel or self._calls == 0:
                calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False), _call_id(False)))
                self._calls += 1
        else:
            content.append(body)
        self._recipient = ""


def _parse(text: str) -> tuple[list[ToolCall], str] | None:
    stream = HarmonyStream()
    _, content, calls = stream.push(text)
    _, rest, more = stream.finish()
    calls += more
    return (calls, content + rest) if calls else None


#: The tool-call "format" of a Harmony template (parsed by :class:`HarmonyStream`; a forced call
#: writes the call's header into the prompt).
FORMAT: Final = ToolFormat("harmony", (CHANNEL,), _parse, MARKERS,
                           force_any="<|channel|>commentary to=functions.",
                           force_named="<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
                           grammar_opener="<|channel|>commentary to=functions.",
                           grammar_call="{name} <|constrain|>json<|message|>{args}")
