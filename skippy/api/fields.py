"""Which request fields the API serves, which are documented no-ops, and which it refuses.

Strategy: one table per endpoint lists every field of OpenAI's current chat/completions and
completions request bodies (plus the llama.cpp and skippy extensions this server reads), each
with its :class:`Handling` and a one-line note.  :func:`check_fields` runs before anything else
looks at a body: a field that is not in the table, or that asks for something this server does
not do (``modalities: ["audio"]``, ``suffix``, ...),
is a 400 naming the field, so no request is answered with a 200 while a field it set was quietly
dropped.  A *no-op* is a field that cannot change the generated answer (``metadata``,
``service_tier``, ``safety_identifier``, ...); it is accepted and documented as having no effect.
Values of served fields are checked by the handlers (a wrong type or range is a 422 naming it).

``docs/api-fields.md`` is the same table for users; ``tests/test_api_fields.py`` checks that every
field the installed ``openai`` SDK can send appears here and gets the handling written here.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, Callable, Final, Mapping

from skippy.api.errors import ApiError

__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "Field", "Handling", "check_fields", "unsupported"]


class Handling(enum.Enum):
    """What the server does with a field."""

    SERVED = "served"  #: it changes the answer as OpenAI documents (values checked by the handler)
    NO_OP = "no-op"  #: accepted; it cannot change the answer (documented here)
    REFUSED = "refused"  #: any value but the neutral one is a 400 naming the field


#: ``refuse(value)``: why this value is not served (None: it is).
Refusal = Callable[[Any], "str | None"]


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One request field: how it is handled, a note for the docs, and which values are refused."""

    handling: Handling
    note: str
    refuse: Refusal | None = None


def _unless_null(why: str) -> Refusal:
    return lambda value: None if value is None else why


def _unless_in(why: str, *allowed: object) -> Refusal:
    return lambda value: None if value is None or value in allowed else why


def _modalities(value: Any) -> str | None:
    if value is None or value == ["text"]:
        return None
    return 'only ["text"] output is served (no audio)'


def _stream_options(value: Any) -> str | None:
    if value is None or not isinstance(value, dict):
        return None  # the handler answers a non-object with a 422
    unknown = sorted(set(value) - {"include_usage", "include_obfuscation"})
    return f"unknown option(s) {', '.join(unknown)}" if unknown else None


#: Fields both endpoints share, as they behave on both.
_COMMON: Final[dict[str, Field]] = {
    "model": Field(Handling.SERVED, "must name the served model (GET /v1/models); another name is a 404"),
    "stream": Field(Handling.SERVED, "server-sent events, ending with data: [DONE]"),
    "stream_options": Field(Handling.SERVED, "include_usage: a last chunk with usage; include_obfuscation: "
                            "no-op (no obfuscation padding is added)", _stream_options),
    "max_tokens": Field(Handling.SERVED, "sampled tokens at most (default: what the context leaves; 16 for "
                        "completions)"),
    "stop": Field(Handling.SERVED, "up to 4 strings; the text ends before the first one"),
    "temperature": Field(Handling.SERVED, "0..2; 0 is greedy"),
    "top_p": Field(Handling.SERVED, "nucleus sampling"),
    "seed": Field(Handling.SERVED, "the final stage's sampler seed: equal seeds give equal choices"),
    "logit_bias": Field(Handling.SERVED, "token id -> bias in [-100, 100]"),
    "presence_penalty": Field(Handling.SERVED, "-2..2, llama.cpp's penalty sampler"),
    "frequency_penalty": Field(Handling.SERVED, "-2..2, llama.cpp's penalty sampler"),
    "n": Field(Handling.SERVED, "1..8 choices; the prompt is prefilled once and forked per choice"),
    "user": Field(Handling.SERVED, "prefix-cache namespace when prompt_cache_key is absent (no other effect)"),
    # llama.cpp server extensions
    "top_k": Field(Handling.SERVED, "llama.cpp extension: top-k sampling (0: off)"),
    "min_p": Field(Handling.SERVED, "llama.cpp extension: min-p sampling"),
    "repeat_penalty": Field(Handling.SERVED, "llama.cpp extension: repetition penalty"),
    # skippy extensions
    "speculation": Field(Handling.SERVED, "skippy extension: speculative decoding on/off (never changes a "
                         "greedy answer)"),
    "prefix_cache": Field(Handling.SERVED, "skippy extension: false opts out of the prefix KV cache"),
    # structured output (values checked by skippy/api/structured.py; docs/structured-output.md)
    "response_format": Field(Handling.SERVED, "text, json_object, or json_schema (strict or not): the answer is "
                             "sampled under the schema's grammar (docs/structured-output.md)"),
    "grammar": Field(Handling.SERVED, "llama.cpp extension: GBNF grammar the answer follows"),
    "n_predict": Field(Handling.SERVED, "llama.cpp extension: max_tokens (-1: no limit; max_tokens wins)"),
    "cache_prompt": Field(Handling.SERVED, "llama.cpp extension: prefix_cache (false opts out; prefix_cache wins)"),
    "json_schema": Field(Handling.SERVED, "llama.cpp extension: a JSON Schema the answer follows (as response_format "
                         "json_schema; with response_format: 400)"),
    "ignore_eos": Field(Handling.SERVED, "llama.cpp extension: true puts a -100 logit bias on every "
                        "end-of-generation token (the answer runs to max_tokens or a stop string)"),
    "samplers": Field(Handling.SERVED, "llama.cpp extension: the sampler order, mapped onto skippy's chain "
                      "(penalties, top_k, top_p, min_p, temperature; left-out samplers off; another order of "
                      "the active ones: 400; skippy/api/samplers.py)"),
}

#: POST /v1/chat/completions (OpenAI's reference, and the fields the ``openai`` SDK sends).
CHAT_FIELDS: Final[Mapping[str, Field]] = {
    **_COMMON,
    "messages": Field(Handling.SERVED, "system / developer / user / assistant / tool turns, rendered by the "
                      "model's chat template; text content only"),
    "max_completion_tokens": Field(Handling.SERVED, "as max_tokens (max_tokens wins when both are set)"),
    "tools": Field(Handling.SERVED, "function tools, rendered through the model's chat template's tools variable "
                   "(a template without tool support: 400); calls parsed back into tool_calls"),
    "tool_choice": Field(Handling.SERVED, "auto, none, required, or a named function (forced by a grammar from "
                         "the tools' schemas, or by opening the call in the answer)"),
    "parallel_tool_calls": Field(Handling.SERVED, "false keeps the first tool call only"),
    "prompt_cache_key": Field(Handling.SERVED, "prefix-cache namespace (tenant isolation); cannot change the "
                              "answer"),
    "logprobs": Field(Handling.SERVED, "true: choices[].logprobs.content, the model's log-softmax per token"),
    "top_logprobs": Field(Handling.SERVED, "0..20 alternatives per token (needs logprobs: true)"),
    "modalities": Field(Handling.SERVED, 'only ["text"]', _modalities),
    "audio": Field(Handling.REFUSED, "audio output is not served", _unless_null("audio output is not served")),
    "functions": Field(Handling.REFUSED, "deprecated; use tools",
                       _unless_null("the deprecated functions field is not served; use tools")),
    "function_call": Field(Handling.REFUSED, "deprecated; use tool_choice",
                           _unless_null("the deprecated function_call field is not served; use tool_choice")),
    "reasoning_effort": Field(Handling.SERVED, "passed to the chat template as reasoning_effort (a template "
                              "that does not read it: 400)"),
    "chat_template_kwargs": Field(Handling.SERVED, "llama.cpp extension: variables for the chat template (e.g. "
                                  "enable_thinking); one the template does not read: 400"),
    "verbosity": Field(Handling.REFUSED, "no verbosity control",
                       _unless_null("verbosity is not served (it would change the answer)")),
    "web_search_options": Field(Handling.REFUSED, "no web search",
                                _unless_null("web search is not served")),
    "moderation": Field(Handling.REFUSED, "no moderation model", _unless_null("moderation is not served")),
    "store": Field(Handling.REFUSED, "completions are never stored; false is accepted",
                   _unless_in("completions are not stored by this server", False)),
    "metadata": Field(Handling.NO_OP, "accepted and discarded (it only tags stored completions)"),
    "prediction": Field(Handling.NO_OP, "accepted; predicted outputs only change latency, never the answer, "
                        "and are not used"),
    "service_tier": Field(Handling.NO_OP, "accepted; one tier: it cannot change the answer"),
    "safety_identifier": Field(Handling.NO_OP, "accepted and discarded (abuse monitoring)"),
    "prompt_cache_retention": Field(Handling.NO_OP, "accepted; the prefix cache evicts by its own budget "
                                    "(docs/prefix-cache.md)"),
    "prompt_cache_options": Field(Handling.NO_OP, "accepted; the prefix cache needs no breakpoints"),
}

#: POST /v1/completions (OpenAI's legacy completions reference).
COMPLETION_FIELDS: Final[Mapping[str, Field]] = {
    **_COMMON,
    "prompt": Field(Handling.SERVED, "a string, a list of one string, or a list of token ids"),
    "echo": Field(Handling.SERVED, "the prompt's text is returned before the completion"),
    "logprobs": Field(Handling.SERVED, "0..20: the legacy logprobs object (tokens, token_logprobs, top_logprobs, "
                      "text_offset)"),
    "best_of": Field(Handling.SERVED, "best_of choices generated (forked like n), the n with the highest mean "
                     "token log-probability returned; not with stream when greater than n"),
    "suffix": Field(Handling.REFUSED, "no insertion (fill-in-the-middle) completions",
                    _unless_in("suffix (insertion) completions are not served", "")),
}


def unsupported(param: str, why: str) -> ApiError:
    """The 400 for a field (or part of one) this server does not serve."""
    return ApiError(400, f"The field '{param}' is not supported by this server: {why}.", param=param,
                    code="unsupported_field")


def check_fields(body: Mapping[str, Any], chat: bool) -> None:
    """Refuse unknown fields and refused values (see the module header).

    Raises:
        ApiError: 400 naming the first offending field.
    """
    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        rule = table.get(name)
        if rule is None:
            other = COMPLETION_FIELDS if chat else CHAT_FIELDS
            hint = (f" (it belongs to {'/v1/completions' if chat else '/v1/chat/completions'})"
                    if name in other else "")
            raise ApiError(400, f"Unrecognized request field '{name}'{hint}; docs/api-fields.md lists the "
                           "fields this server reads.", param=name, code="unknown_field")
        if rule.refuse is not None:
            why = rule.refuse(value)
            if why is not None:
                raise unsupported(name, f"{why} (got {json.dumps(value)[:80]})")
