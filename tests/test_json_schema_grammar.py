"""JSON response formats without llama-cpp-python: skippy's own copy of the converter.

A plain install (``pip install skippy-llm``, no test extra) has no ``llama_cpp``; a subprocess that
cannot import it must still turn ``json_schema`` and llama-server's ``json_object`` + ``schema``
into grammars llama.cpp parses against the served vocabulary, and never import ``llama_cpp``.
The vendored text must equal the pinned llama-cpp-python's file (when that is installed), and
``response_format`` keys that are not read are 400s naming them.  (Samples validating against
the schema on a real chain: tests/test_structured_output.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from skippy.api import _json_schema_grammar
from skippy.api.errors import ApiError
from skippy.api.structured import parse_constraints
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
