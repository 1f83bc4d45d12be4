"""Render a chat template (Jinja, as in a GGUF's ``tokenizer.chat_template``) into prompt text.

Strategy: a chat template comes from a model file, so it is untrusted code: it runs in Jinja2's
``ImmutableSandboxedEnvironment`` (no attribute access to internals, no mutation of the values
passed in).  The environment and the names a template sees are the ones Hugging Face's
``apply_chat_template`` and llama.cpp's Jinja formatters give it, so a template written for them
renders the same text here: ``trim_blocks`` and ``lstrip_blocks`` on; the loop-control extension
(``{% break %}``, ``{% continue %}``); HF's ``{% generation %}`` block tag passed through; a
``tojson`` filter that writes JSON the way Python's ``json.dumps`` does with ``ensure_ascii`` off
(HF's, not Jinja's HTML-escaping one); and the globals ``messages``, ``bos_token``,
``eos_token``, ``add_generation_prompt``, ``tools``, ``tool_choice``, ``functions``,
``function_call``, ``raise_exception(message)`` and ``strftime_now(format)`` (local time).
Extra keyword arguments of :meth:`ChatRenderer.render` (``enable_thinking``, ``documents``, ...)
are passed to the template as they are.  A template's ``raise_exception`` and every Jinja error
surface as :class:`ChatTemplateError`, a ``ValueError`` whose message is the template's own.

``tests/test_chat_render.py`` checks the output against llama-cpp-python's formatter for every
template skippy ships or meets.  Only Jinja2 is needed: no second llama.cpp at run time.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Final, Mapping, NoReturn, Sequence, final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatRenderer", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template could not be compiled, or refused the messages (its own ``raise_exception``)."""


class _GenerationBlock(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): its
    body renders as if the tags were not there."""

    tags: Final = {"generation"}  # type: ignore[misc]

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the tag name
        body: list[jinja2.nodes.Node] = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return body


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@final
class ChatRenderer:
    """A compiled chat template with the model's BOS/EOS texts.

    Args:
        source: the Jinja source.
        bos_token: the text of the BOS token ("" when the vocabulary has none).
        eos_token: the text of the EOS token.

    Raises:
        ChatTemplateError: the source is not a valid Jinja template.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        environment = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        environment.filters["tojson"] = _tojson
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
               functions: Sequence[Mapping[str, Any]] | None = None, function_call: Any = None,
               **extra: Any) -> str:
        """The prompt text for ``messages``.

        Raises:
            ChatTemplateError: the template raised (its message), or failed while rendering.
        """
        try:
            return self._template.render(
                **extra, messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt, tools=tools, tool_choice=tool_choice,
                functions=functions, function_call=function_call, raise_exception=_raise_exception,
                strftime_now=_strftime_now,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
            # the template's own Python-level failure (e.g. a string method on None)
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
