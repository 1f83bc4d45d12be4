"""Reasoning models: ``<think>`` text split from the answer, and the template variables that steer it.

Strategy: a chat template that writes ``<think>`` (Qwen3, DeepSeek-R1 distills, ...) makes a
model answer ``<think>reasoning</think>answer``.  With the server's reasoning format ``auto`` (the
default, llama-server's ``deepseek`` behaviour) the chat answer's ``message.reasoning_content``
gets the reasoning and ``content`` the answer (its leading whitespace dropped); ``none`` leaves
the text inline.  :class:`ReasoningSplitter` does the split on streamed text: it holds back
what could still be a tag, so a streamed ``delta.reasoning_content`` / ``delta.content`` pair
concatenates to the whole answer's fields.  A prompt the template already opened with
``<think>`` (the generation prompt ends inside the reasoning) starts the splitter inside.  Only
the opening of the answer can start reasoning: a ``<think>`` later in the answer is content.

``chat_template_kwargs`` (llama-server's field, e.g. ``{"enable_thinking": false}``) and
``reasoning_effort`` are passed to the chat template as variables; a variable the template never
reads would change nothing, so it is a 400 naming it rather than dropped (:func:`template_variables`).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from skippy.api.errors import invalid
from skippy.api.fields import unsupported

__all__ = ["OPEN", "CLOSE", "ReasoningSplitter", "template_variables", "thinks"]

OPEN = "<think>"
CLOSE = "</think>"
#: Reasoning formats the server takes (``--reasoning-format``).
FORMATS = ("auto", "none")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def thinks(template: str) -> bool:
    """Whether a chat template writes ``<think>`` reasoning."""
    return OPEN in template and CLOSE in template


def _reads(template: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", template) is not None


def template_variables(body: Mapping[str, Any], template: str) -> dict[str, Any]:
    """The chat-template variables a chat body sets (``chat_template_kwargs``, ``reasoning_effort``).

    Raises:
        ApiError: a malformed value (422), or a variable the template does not read (400 naming it).
    """
    out: dict[str, Any] = {}
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise invalid("chat_template_kwargs", "expected an object of template variables")
        for name, value in kwargs.items():
            if not _NAME.match(name) or name in ("messages", "tools", "add_generation_prompt", "bos_token",
                                                 "eos_token"):
                raise invalid(f"chat_template_kwargs.{name}", "not a template variable a request may set")
            if not _reads(template, name):
                raise unsupported(f"chat_template_kwargs.{name}", "the model's chat template does not read this "
                                  "variable, so it would change nothing")
            out[name] = value
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
            raise invalid("reasoning_effort", "expected none, minimal, low, medium, high or xhigh")
        if not _reads(template, "reasoning_effort"):
            raise unsupported("reasoning_effort", "the model's chat template has no reasoning-effort control")
        out["reasoning_effort"] = effort
    return out


class ReasoningSplitter:
    """Splits streamed answer text into (reasoning, content) pieces.

    Args:
        inside: the prompt already opened the reasoning (it ends with ``<think>``).
    """

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside
        #: Whether the answer may still open reasoning (only its first non-blank text may).
        self._opening = not inside
        #: Whether content has started after a closed reasoning (its leading whitespace is dropped).
        self._after_close = False
        self._pending = ""

    def push(self, text: str) -> tuple[str, str]:
        """Add text; the (reasoning, content) that is certain now."""
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._opening:
                stripped = self._pending.lstrip()
                if stripped.startswith(OPEN):
                    self._pending = stripped[len(OPEN):]
                    self.inside, self._opening = True, False
                    continue
                if OPEN.startswith(stripped):  # blank, or a tag still arriving
                    break
                self._opening = False
                continue
            if self.inside:
                end = self._pending.find(CLOSE)
                if end >= 0:
                    reasoning.append(self._pending[:end])
                    self._pending = self._pending[end + len(CLOSE):]
                    self.inside, self._after_close = False, True
                    continue
                hold = _partial(self._pending, CLOSE)
                reasoning.append(self._pending[:len(self._pending) - hold])
                self._pending = self._pending[len(self._pending) - hold:]
                break
            if self._after_close:
                stripped = self._pending.lstrip()
                if not stripped:
                    self._pending = ""
                    break
                self._pending, self._after_close = stripped, False
            content.append(self._pending)
            self._pending = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The end of the answer: what was held back (an unclosed reasoning stays reasoning)."""
        pending, self._pending = self._pending, ""
        if self.inside:
            return pending, ""
        if self._after_close or self._opening:
            pending = pending.lstrip() if self._after_close else pending
        return "", pending


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
