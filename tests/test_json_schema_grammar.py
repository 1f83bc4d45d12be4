"""JSON response formats without llama-cpp-python: skippy's own copy of the converter.

A plain install (``pip install skippy-llm``, no test extra) has no ``llama_cpp``; a subprocess that
cannot import it must still turn ``json_schema`` and llama-server's ``json_object`` + ``schema``
into grammars llama.cpp parses against the served vocabulary, and never import ``llama_cpp``.
The vendored text must equal the pinned llama-cpp-python's file (when that is installed), and
``response_format`` keys that are not read are 400s naming them.  (Samples validating against
the schema on a real chain: tests/test_structured_output.py.)
"""

from __future__ import annotations

import datetime
import enum
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Literal, Optional
import uuid

import pytest

from skippy.api import _json_schema_grammar
from skippy.api.errors import ApiError
from skippy.api.structured import parse_constraints, schema_grammar
from skippy.runtime.ffi import lib
from skippy.runtime.sampling import Sampler, SamplingParams
from skippy.runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok"]}
MARKER = "# ---- vendored text below; do not edit ----\n"

PLAIN = r"""
import importlib.abc, json, sys

class NoLlamaCpp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError("a plain install has no llama_cpp")
        return None

sys.meta_path.insert(0, NoLlamaCpp())
from skippy.api.structured import parse_constraints
from skippy.runtime.tokenizer import Tokenizer
schema = json.loads(sys.argv[2])
with Tokenizer(sys.argv[1]) as tokenizer:
    grammars = [parse_constraints({"response_format": form}, True, tokenizer).grammar for form in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        {"type": "json_object", "schema": schema}, {"type": "json_object"})]
assert "llama_cpp" not in sys.modules
print(json.dumps(grammars))
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Iterator[Tokenizer]:
    with Tokenizer(tiny_llama) as vocabulary:
        yield vocabulary


def test_json_formats_are_served_by_a_process_that_cannot_import_llama_cpp(tiny_llama: Path,
                                                                        tokenizer: Tokenizer) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", PLAIN, str(tiny_llama), json.dumps(SCHEMA)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    schema_grammar, object_schema_grammar, object_grammar = json.loads(result.stdout)
    assert schema_grammar == object_schema_grammar  # llama-server's json_object + schema is the schema's grammar
    assert '"\\"ok\\""' in schema_grammar and object_grammar == _json_schema_grammar.JSON_GBNF
    here = parse_constraints({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                             True, tokenizer)
    assert here.grammar == schema_grammar and here.json


def test_the_vendored_converter_is_the_pinned_llama_cpp_python_file() -> None:
    vendored = Path(_json_schema_grammar.__file__).read_text()
    assert vendored.count(MARKER) == 1
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama-cpp-python is not installed (the test extra pins it)")
    from importlib.metadata import version

    if version("llama-cpp-python") != "0.3.36":
        pytest.skip(f"llama-cpp-python {version('llama-cpp-python')} is not the pinned 0.3.36")
    original = Path(next(iter(spec.submodule_search_locations))) / "llama_grammar.py"
    assert vendored.split(MARKER, 1)[1] == original.read_text()


@pytest.mark.parametrize(("form", "param"), [
    ({"type": "json_object", "schema": {"type": "nonsense"}}, "response_format.schema"),
    ({"type": "json_object", "schema": "not an object"}, "response_format.schema"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}, "schema": SCHEMA}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}},
     "response_format.json_schema.extra"),
    ({"type": "text", "schema": SCHEMA}, "response_format.schema"),
], ids=["object-invalid-schema", "object-schema-not-object", "object-with-json_schema", "schema-with-schema",
        "json_schema-extra", "text-with-schema"])
def test_what_a_response_format_does_not_read_is_a_400_naming_it(tokenizer: Tokenizer, form: dict[str, Any],
                                                                  param: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_constraints({"response_format": form}, True, tokenizer)
    assert raised.value.status == 400 and raised.value.param == param, raised.value


# --- keywords: integer bounds served exactly, the rest refused with their path -------------------


class GrammarMatcher:
    """Whether llama.cpp's grammar engine accepts a whole string of digits, ``-`` and ``.`` (one
    vocabulary token per character, then the end of generation)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        wanted = set("-0123456789.eE+")
        self.tokens: dict[str, int] = {}
        for token in range(tokenizer.n_vocab):
            text = tokenizer.piece(token).decode("utf-8", "replace")
            if text in wanted and text not in self.tokens:
                self.tokens[text] = token
        assert set(self.tokens) == wanted, sorted(wanted - set(self.tokens))

    def accepts(self, sampler: Sampler, text: str) -> bool:
        sampler.reset()
        try:
            sampler.restore([self.tokens[char] for char in text])
        except ValueError:  # a character the grammar does not allow there
            return False
        return bool(lib.skippy_grammar_allows(sampler.grammar_pointer, self.tokenizer.eos))

    def sampler(self, grammar: str) -> Sampler:
        return Sampler(SamplingParams(grammar=grammar), self.tokenizer.n_vocab, self.tokenizer.vocab_pointer)


@pytest.fixture(scope="module")
def matcher(tokenizer: Tokenizer) -> GrammarMatcher:
    return GrammarMatcher(tokenizer)


def _ranges(drawn: bool) -> list[tuple[int | None, int | None]]:
    """Chosen edge cases, or (``drawn``) 40 ranges drawn at random."""
    edges: list[tuple[int | None, int | None]] = [
        (0, 0), (5, 5), (-7, -7), (0, 9), (0, 10), (1, 99), (10, 99), (-1, 1), (-10, 10), (-100, -10), (-99, -1),
        (-15, 123), (100, 999), (101, 998), (19, 1001), (-1000, 1000), (0, None), (1, None), (-5, None),
        (37, None), (None, 0), (None, -1), (None, 42), (None, -38), (123456, 123789),
        (10 ** 15, 10 ** 16 - 1), (-(10 ** 16 - 1), -(10 ** 15)), (9_999_999_999_999_990, 10 ** 16 + 7),
        (1234567890123456, 1234567890123499), (-1234567890123499, 1234567890123456 - 10 ** 15)]
    if not drawn:
        return edges
    rng = random.Random(28)
    ranges: list[tuple[int | None, int | None]] = []
    for _ in range(40):
        digits = rng.choice([1, 2, 3, 4, 6, 9, 16])
        low = rng.randint(-(10 ** digits), 10 ** digits)
        ranges.append((low, low + rng.choice([0, 1, 3, 17, 250, 10 ** rng.randint(0, digits)])))
    return ranges


def _window(low: int | None, high: int | None) -> set[int]:
    """Integers around the range's ends (and its inside, sampled), where a mistake would show."""
    points = {0, 1, -1, 9, 10, -9, -10, 99, 100, -100}
    for bound in (low, high):
        if bound is not None:
            points.update(range(bound - 25, bound + 26))
            for digits in range(1, 18):  # around each power of ten near it
                points.update({10 ** digits - 1, 10 ** digits, -(10 ** digits) + 1, -(10 ** digits)})
    if low is not None and high is not None and high - low <= 3000:
        points.update(range(low, high + 1))
    rng = random.Random(f"{low}:{high}")
    for _ in range(200):
        points.add(rng.randint(-(10 ** 17), 10 ** 17))
        points.add(rng.randint(min(low or 0, high or 0) - 1000, max(low or 0, high or 0) + 1000))
    return {point for point in points if len(str(abs(point))) <= 17}


@pytest.mark.parametrize("drawn", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["edges", "drawn"])
def test_integer_bounds_accept_exactly_the_integers_in_range(matcher: GrammarMatcher, drawn: bool) -> None:
    checked = 0
    for low, high in _ranges(drawn):
        schema: dict[str, Any] = {"type": "integer"}
        if low is not None:
            schema["minimum"] = low
        if high is not None:
            schema["maximum"] = high
        grammar = schema_grammar(schema, "schema")
        widest = max([16] + [len(str(abs(bound))) for bound in (low, high) if bound is not None])
        with matcher.sampler(grammar) as sampler:
            for value in sorted(_window(low, high)):
                inside = ((low is None or value >= low) and (high is None or value <= high)
                          and len(str(abs(value))) <= widest)
                assert matcher.accepts(sampler, str(value)) == inside, (low, high, value, grammar)
                checked += 1
            for text in ("", "-", "-0", "00", "01", "+1", "1.0", "1e3"):  # never JSON's form of an in-range integer
                assert not matcher.accepts(sampler, text), (low, high, text)
    assert checked > 10_000


@pytest.mark.parametrize(("schema", "low", "high"), [
    ({"exclusiveMinimum": 3, "exclusiveMaximum": 9}, 4, 8),
    ({"minimum": 2.5, "maximum": 7.5}, 3, 7),
    ({"exclusiveMinimum": 2.5, "exclusiveMaximum": 7.5}, 3, 7),
    ({"minimum": -4, "exclusiveMinimum": -2, "maximum": 6, "exclusiveMaximum": 9}, -1, 6),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 3, "exclusiveMinimum": True,
      "maximum": 9, "exclusiveMaximum": True}, 4, 8),
], ids=["exclusive", "fractional", "fractional-exclusive", "both-kinds", "draft-4-flags"])
def test_exclusive_and_fractional_integer_bounds(matcher: GrammarMatcher, schema: dict[str, Any], low: int,
                                                 high: int) -> None:
    with matcher.sampler(schema_grammar({"type": "integer", **schema}, "schema")) as sampler:
        for value in range(low - 30, high + 30):
            assert matcher.accepts(sampler, str(value)) == (low <= value <= high), value


def test_a_number_with_minimum_zero_has_no_minus_sign(matcher: GrammarMatcher) -> None:
    with matcher.sampler(schema_grammar({"type": "number", "minimum": 0}, "schema")) as sampler:
        for text in ("0", "0.5", "12", "3.25e-4", "1E+9"):
            assert matcher.accepts(sampler, text), text
        for text in ("-1", "-0.5", "-0", "-3e2"):
            assert not matcher.accepts(sampler, text), text


def test_an_empty_integer_range_is_a_400() -> None:
    with pytest.raises(ApiError) as raised:
        schema_grammar({"type": "integer", "minimum": 5, "exclusiveMaximum": 5}, "schema")
    assert raised.value.status == 400 and "no integer" in raised.value.message


P = "response_format.json_schema.schema"


@pytest.mark.parametrize(("schema", "path"), [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     "properties.tags.uniqueItems"),
    ({"type": "number", "maximum": 1}, "maximum"),
    ({"type": "number", "minimum": 0, "maximum": 1}, "maximum"),
    ({"type": "number", "exclusiveMinimum": 0}, "exclusiveMinimum"),
    ({"type": "number", "minimum": 0, "exclusiveMinimum": 0}, "exclusiveMinimum"),
    ({"type": "integer", "multipleOf": 2}, "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "contains"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}, "minProperties"),
    ({"type": "object", "maxProperties": 1}, "maxProperties"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "if": {"minLength": 2}, "then": {"maxLength": 3}}, "if"),
    ({"type": "string", "format": "email"}, "format"),
    ({"type": "object", "properties": {"site": {"type": "string", "format": "uri"}}}, "properties.site.format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
    ({"type": "string", "format": "date", "minLength": 3}, "minLength"),
    ({"type": "array", "minItems": 1}, "minItems"),
    ({"type": ["string", "null"], "maxLength": 3}, "maxLength"),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}], "minLength": 1}, "minLength"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}, "maxLength": 2}, "maxLength"),
    ({"$defs": {"a": {"type": "array", "items": {}, "uniqueItems": True}}, "$ref": "#/$defs/a"}, "$defs.a.items"),
    ({"type": "object", "properties": {"a": {}}, "allOf": [{"required": ["a"]}]}, "allOf"),
    ({"type": "object", "required": ["a"]}, "required"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
    ({"enum": [1, 5], "minimum": 3}, "minimum"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, "prefixItems"),
    ({"type": "object", "properties": {"a": True}}, "properties.a"),
    ({"type": "integer", "maximum": 10 ** 41}, "maximum"),
    ({"type": "string", "minimum": 3}, "minimum"),
    ({"type": "object", "properties": {"n": {"type": "array", "items": {"anyOf": [
        {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0}}, "unevaluatedProperties": False}]}}}},
     "properties.n.items.anyOf[0].unevaluatedProperties"),
])
def test_a_keyword_the_grammar_would_not_enforce_is_a_400_naming_its_path(tokenizer: Tokenizer, schema: dict[str, Any],
                                                                        path: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_constraints({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                          True, tokenizer)
    error = raised.value
    assert error.status == 400 and error.param == f"{P}.{path}", error.message
    assert f"'{P}.{path}' is not supported" in error.message


def test_annotations_served_formats_and_no_op_values_are_accepted(tokenizer: Tokenizer) -> None:
    annotations = {"title": "T", "description": "d", "examples": [1], "default": 1, "$comment": "c",
                   "deprecated": False, "readOnly": False, "writeOnly": False}
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/s",
              "type": "object", "properties": {
                  "n": {"type": "integer", "minimum": 1, **annotations},
                  "when": {"type": "string", "format": "date-time"}, "day": {"type": "string", "format": "date"},
                  "at": {"type": "string", "format": "time"}, "id": {"type": "string", "format": "uuid"},
                  "list": {"type": "array", "items": {"type": "number", "minimum": 0}, "uniqueItems": False,
                           "minItems": 0},
                  "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                           "items": False, "minItems": 2},
                  "kind": {"type": "string", "enum": ["a", "b"], "maxLength": 1}}}
    constraints = parse_constraints({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}, True, tokenizer)
    assert constraints.grammar is not None and "[1-9]" in constraints.grammar


def test_pydantic_and_openai_sdk_schemas_are_served(tokenizer: Tokenizer) -> None:
    pydantic = pytest.importorskip("pydantic")
    openai_pydantic = pytest.importorskip("openai.lib._pydantic")

    class Color(str, enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Part(pydantic.BaseModel):
        count: int = pydantic.Field(ge=0, le=10, description="how many")
        kind: Literal["bolt"]
        weight: float = pydantic.Field(ge=0)

    class Order(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20, title="Name")
        when: datetime.datetime
        id: uuid.UUID
        color: Color
        main: Part
        parts: list[Part]
        note: Optional[str] = None
        extra: dict[str, int]
        quantity: pydantic.conint(gt=0, lt=100)  # type: ignore[valid-type]

    for schema in (Order.model_json_schema(), openai_pydantic.to_strict_json_schema(Order)):
        constraints = parse_constraints({"response_format": {"type": "json_schema", "json_schema": {
            "name": "order", "schema": schema, "strict": True}}}, True, tokenizer)
        assert constraints.grammar is not None and constraints.json
