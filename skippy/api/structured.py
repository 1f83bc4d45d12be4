"""Structured output and logprobs on the OpenAI API: request fields in, response fields out.

Strategy: the request side turns ``response_format`` (``text``, ``json_object``, ``json_schema``
with ``strict``), llama-server's ``grammar`` (GBNF text) and ``logprobs`` / ``top_logprobs``
into the two things the chain understands (docs/protocol.md §10): one GBNF grammar the final
stage samples under, and the number of alternatives per position to report.  Every field is
checked here and refused with a 400 naming it; a grammar is also *parsed* here, by llama.cpp
against the served model's vocabulary (the driver's vocab-only load), so a grammar that does
not parse never reaches a stage.

JSON Schema → GBNF is llama-cpp-python's converter (the Python port of llama.cpp's
``json_schema_to_grammar``, the one llama-server uses), shipped verbatim in
:mod:`skippy.api._json_schema_grammar` (its header says why and from which version), so a plain
install serves JSON formats without llama-cpp-python; :mod:`skippy.api.schema_keywords` adds the
integer bounds it lacks and refuses, with a 400 naming the keyword's JSON path, every keyword it
would not enforce (docs/structured-output.md lists both).  The schema is first checked as a JSON
Schema (``jsonschema``'s metaschema check).  llama-server's ``{"type": "json_object", "schema":
...}`` is served as a ``json_schema`` format is; any other key of ``response_format`` (or of its
``json_schema``) is a 400 naming it, never dropped.

The response side shapes the final stage's log-probabilities (log-softmax of the model's logits,
before temperature, penalties or the grammar) as OpenAI's chat ``logprobs.content`` entries or
the legacy completions ``logprobs`` object.
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any, Callable, Mapping, Sequence

from skippy.api import _json_schema_grammar, schema_keywords
from skippy.api.errors import ApiError
from skippy.api.fields import unsupported
from skippy.codec.protocol_ext import MAX_TOP_LOGPROBS, TokenLogprobs
from skippy.runtime.sampling import Sampler, SamplingParams
from skippy.runtime.tokenizer import Tokenizer

__all__ = ["Constraints", "LogprobsReport", "chat_logprobs", "check_schema_keywords", "completion_logprobs",
           "parse_constraints", "schema_grammar"]


def bad(param: str, message: str) -> ApiError:
    """A 400 naming the field (structured-output and logprobs refusals)."""
    return ApiError(400, f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


@dataclasses.dataclass(frozen=True, slots=True)
class Constraints:
    """What a request asks of the final stage beyond plain sampling."""

    #: GBNF the sampled text follows (None: unconstrained).
    grammar: str | None = None
    #: Alternatives per position to report (None: no logprobs; 0: the sampled token's only).
    logprobs: int | None = None
    #: The request asked for JSON (json_object / json_schema): what the docs promise holds for it.
    json: bool = False


#: The converter's string-character rule lets raw control characters into strings, which JSON
#: forbids (llama.cpp's own converter has since excluded them), and any code point llama.cpp's
#: UTF-8 decoder produces from byte tokens, surrogates and values past U+10FFFF included, which
#: are not UTF-8 (found by the 100-sample test: a detokenizer shows them as U+FFFD, breaking
#: maxLength).  The one correction we apply to its output.
_CONVERTER_CHAR_RULE = 'char ::= [^"\\\\] | '
_JSON_CHAR_RULE = 'char ::= [^"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF\\U00110000-\\U001FFFFF] | '


def grammar_converter() -> tuple[Any, Callable[[str], str]]:
    """The converter (a namespace whose ``SchemaConverter`` is :class:`schema_keywords.BoundedConverter`)
    and the one correction its output needs (for other builders of schema grammars: forced tool
    calls, skippy/api/tool_calls.py; check their schemas first with :func:`check_schema_keywords`)."""
    converter = types.SimpleNamespace(SchemaConverter=schema_keywords.BoundedConverter)
    return converter, lambda text: text.replace(_CONVERTER_CHAR_RULE, _JSON_CHAR_RULE)


def check_schema_keywords(schema: Any, param: str) -> None:
    """A 400 naming ``param`` + the JSON path of the first keyword of ``schema`` the grammar would
    not enforce (docs/structured-output.md lists what is served)."""
    try:
        schema_keywords.check_keywords(schema)
    except schema_keywords.SchemaRefusal as exc:
        where = f"{param}.{exc.path}" if exc.path else param
        raise unsupported(where, exc.reason) from exc


def schema_grammar(schema: Any, param: str) -> str:
    """GBNF for a JSON Schema (an invalid schema, or one the converter refuses, is a 400 naming ``param``)."""
    if not isinstance(schema, dict):
        raise bad(param, "expected a JSON Schema object")
    try:
        import jsonschema
    except ImportError as exc:  # the api extra installs it; say what is missing rather than guess
        raise ApiError(500, "json_schema needs the 'jsonschema' package on the server", param=param) from exc
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise bad(param, f"not a valid JSON Schema: {exc.message}") from exc
    check_schema_keywords(schema, param)
    try:
        text = schema_keywords.schema_to_gbnf(json.loads(json.dumps(schema)))
    except (ValueError, KeyError, TypeError, AssertionError, NotImplementedError, RecursionError) as exc:
        # the converter's refusals (unsupported or unresolvable parts) come as these
        raise bad(param, f"the schema cannot be turned into a grammar: {type(exc).__name__}: {exc}") from exc
    return text.replace(_CONVERTER_CHAR_RULE, _JSON_CHAR_RULE)


#: The keys each ``response_format`` type reads (OpenAI's, plus llama-server's ``json_object`` ``schema``).
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}


def _only(value: Mapping[str, Any], where: str, keys: set[str]) -> None:
    """A 400 naming the first key of ``value`` outside ``keys`` (a field is never dropped silently)."""
    unknown = sorted(set(value) - keys)
    if unknown:
        raise bad(f"{where}.{unknown[0]}", f"not a field of this response format (it reads {', '.join(sorted(keys))})")


def _response_format(body: Mapping[str, Any]) -> tuple[str | None, bool]:
    value = body.get("response_format")
    if value is None:
        return None, False
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("response_format", "expected an object with a 'type'")
    kind = value["type"]
    if kind in _FORMAT_KEYS:
        _only(value, "response_format", _FORMAT_KEYS[kind])
    if kind == "text":
        return None, False
    if kind == "json_object":
        if "schema" in value:  # llama-server's form: JSON that follows this schema
            return schema_grammar(value["schema"], "response_format.schema"), True
        return _json_schema_grammar.JSON_GBNF, True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("response_format.json_schema", "expected an object with 'name' and 'schema'")
        _only(spec, "response_format.json_schema", {"name", "schema", "strict", "description"})
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise bad("response_format.json_schema.name", "expected a string")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad("response_format.json_schema.strict", "expected a boolean")
        if "schema" not in spec:
            raise bad("response_format.json_schema.schema", "missing: the JSON Schema the answer must follow")
        # strict or not, the answer is sampled under the schema's grammar: every answer that
        # completes (finish_reason "stop") follows it.
        return schema_grammar(spec["schema"], "response_format.json_schema.schema"), True
    raise bad("response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {json.dumps(kind)}")


def _check_grammar(text: str, param: str, tokenizer: Tokenizer) -> None:
    """Parse ``text`` with llama.cpp against the served vocabulary (400 naming ``param`` if it fails)."""
    try:
        params = SamplingParams(grammar=text)
        Sampler(params, tokenizer.n_vocab, tokenizer.vocab_pointer).close()
    except ValueError as exc:  # check_grammar_text's bounds or llama.cpp's parse failure
        raise bad(param, str(exc)) from exc


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise bad("logprobs", f"expected a boolean, got {json.dumps(value)}")
        top = body.get("top_logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise bad("top_logprobs", f"expected an integer in 0..{MAX_TOP_LOGPROBS}, got {json.dumps(top)}")
            if not value:
                raise bad("top_logprobs", "needs 'logprobs': true")
        return (top or 0) if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad("logprobs", f"expected an integer in 0..{MAX_TOP_LOGPROBS}, got {json.dumps(value)}")
    return value


def parse_constraints(body: Mapping[str, Any], chat: bool, tokenizer: Tokenizer) -> Constraints:
    """The request's grammar and logprobs settings.

    Raises:
        ApiError: 400 naming the field: a malformed ``response_format``, an invalid JSON Schema or
            one the converter refuses, a ``grammar`` that does not parse, ``grammar`` together
            with a JSON ``response_format``, ``top_logprobs`` / ``logprobs`` out of range.
    """
    grammar, is_json = _response_format(body)
    param = "response_format"
    raw = body.get("grammar")
    if raw is not None:
        if not isinstance(raw, str):
            raise bad("grammar", "expected GBNF text (a string)")
        if grammar is not None:
            raise bad("grammar", "give either 'grammar' or a JSON 'response_format', not both")
        if raw.strip():
            grammar, param = raw, "grammar"
    if grammar is not None:
        _check_grammar(grammar, param, tokenizer)
    return Constraints(grammar, _logprobs(body, chat), is_json)


def _token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    data = tokenizer.piece(token)
    return data.decode("utf-8", "replace"), list(data)


def chat_logprobs(tokenizer: Tokenizer, rows: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI's chat ``choices[].logprobs`` for the positions ``rows``."""
    content = []
    for row in rows:
        text, data = _token_text(tokenizer, row.token)
        top = []
        for token, logprob in row.top:
            alt_text, alt_data = _token_text(tokenizer, token)
            top.append({"token": alt_text, "logprob": logprob, "bytes": alt_data})
        content.append({"token": text, "logprob": row.logprob, "bytes": data, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, rows: Sequence[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``choices[].logprobs`` (``text_offset`` counts characters from ``offset``)."""
    tokens, values, tops, offsets = [], [], [], []
    position = offset
    for row in rows:
        text, _ = _token_text(tokenizer, row.token)
        tokens.append(text)
        values.append(row.logprob)
        top: dict[str, float] = {}
        for token, logprob in row.top:
            top.setdefault(_token_text(tokenizer, token)[0], logprob)
        tops.append(top)
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


@dataclasses.dataclass(slots=True)
class LogprobsReport:
    """One choice's logprobs in a response: all of them (:meth:`whole`), or those of the tokens
    committed since the last streamed chunk (:meth:`fresh`)."""

    tokenizer: Tokenizer
    chat: bool
    #: Characters before the first token (the completions echo), for ``text_offset``.
    offset: int = 0
    reported: int = 0

    def whole(self, rows: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
        if rows is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, rows)
        return completion_logprobs(self.tokenizer, rows, self.offset)

    def fresh(self, rows: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
        if rows is None:
            return None
        new, self.reported = rows[self.reported:], len(rows)
        shaped = self.whole(new)
        if shaped is not None and not self.chat:
            self.offset += sum(len(token) for token in shaped["tokens"])
        return shaped
