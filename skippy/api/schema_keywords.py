"""JSON Schema keywords: which the grammar serves, the integer bounds it adds, and the refusals.

Strategy: the vendored converter (:mod:`skippy.api._json_schema_grammar`, kept verbatim) picks one
branch per schema (``$ref``, ``anyOf``/``oneOf``, a list of types, ``const``, ``enum``, object,
``allOf``, array, string pattern / format / length, primitive) and reads only that branch's
keywords; every other keyword would be dropped.  :func:`check_keywords` mirrors that choice and
refuses (a 400 naming the keyword's JSON path) every keyword the chosen branch does not enforce,
annotations excepted.  :class:`BoundedConverter` is the converter plus the bounds it lacks:
``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` on integers become
digit-range rules accepting exactly the integers in range (:func:`integer_range_rule`, the approach
of llama.cpp's ``build_min_max_int``), and a lower bound of 0 on numbers drops the minus sign.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from skippy.api import _json_schema_grammar

__all__ = ["ANNOTATIONS", "BoundedConverter", "SchemaRefusal", "check_keywords", "integer_range_rule"]

#: Keywords that constrain nothing (JSON Schema annotations), accepted anywhere.  ``discriminator``
#: (OpenAPI, emitted by pydantic for tagged unions) names the tag whose ``const`` each ``oneOf``
#: alternative already enforces.
ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "discriminator"})
#: Containers of definitions, each checked as a schema of its own.
_DEFINITIONS = ("$defs", "definitions")
#: Integers are at most this many digits where a side is unbounded (the converter's own limit).
INTEGER_DIGITS = 16
#: The longest integer bound served (its digit-range rule nests about one group per digit).
MAX_BOUND_DIGITS = 40
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}


class SchemaRefusal(ValueError):
    """A keyword the grammar would not enforce: ``path`` (relative to the schema) and why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


# --- integer ranges ---------------------------------------------------------------------------


def _digits(count: int) -> str:
    return " ".join(["[0-9]"] * count)


def _same_length(low: str, high: str) -> str:
    """GBNF for the digit strings of one length from ``low`` to ``high`` (leading zeros kept)."""
    if low == high:
        return f'"{low}"'
    if low[0] == high[0]:
        return f'"{low[0]}" ({_same_length(low[1:], high[1:])})'
    rest = len(low) - 1
    parts: list[str] = []
    first, last = int(low[0]), int(high[0])
    if rest and low[1:] != "0" * rest:  # low's first digit, then low's tail up to all nines
        parts.append(f'"{low[0]}" ({_same_length(low[1:], "9" * rest)})')
        first += 1
    if rest and high[1:] != "9" * rest:
        tail = f'"{high[0]}" ({_same_length("0" * rest, high[1:])})'
        last -= 1
    else:
        tail = ""
    if first <= last:  # whole blocks: a leading digit in first..last, then any digits
        lead = f'"{first}"' if first == last else f"[{first}-{last}]"
        parts.append(f"{lead} {_digits(rest)}".strip())
    if tail:
        parts.append(tail)
    return " | ".join(parts)


def _positive(low: int, high: int) -> str:
    """GBNF for the decimal forms (no leading zero) of ``low..high``, ``0 <= low <= high``."""
    parts = []
    for length in range(len(str(low)), len(str(high)) + 1):
        start = max(low, 10 ** (length - 1) if length > 1 else 0)
        end = min(high, 10 ** length - 1)
        if start <= end:
            parts.append(f"({_same_length(str(start), str(end))})")
    return " | ".join(parts)


def integer_range_rule(low: int | None, high: int | None) -> str:
    """GBNF (without trailing space) for exactly the integers in ``low..high`` written as JSON writes
    them (no leading zeros, no ``-0``); an unbounded side reaches :data:`INTEGER_DIGITS` digits (or
    the other bound's length, if longer).

    Raises:
        ValueError: the range is empty.
    """
    widest = max([INTEGER_DIGITS] + [len(str(abs(bound))) for bound in (low, high) if bound is not None])
    low = -(10 ** widest - 1) if low is None else low
    high = 10 ** widest - 1 if high is None else high
    if low > high:
        raise ValueError(f"no integer lies in {low}..{high}")
    parts = []
    if low < 0:
        parts.append(f'"-" ({_positive(max(1, -high), -low)})')
    if high >= 0:
        parts.append(_positive(max(0, low), high))
    return " | ".join(parts)


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The smallest and largest integer ``schema``'s bounds allow (None: unbounded)."""
    low: int | None = None
    high: int | None = None
    minimum, maximum = schema.get("minimum"), schema.get("maximum")
    exclusive_min, exclusive_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    candidates_low: list[int] = []
    candidates_high: list[int] = []
    if minimum is not None:
        if exclusive_min is True:  # draft 4: a flag on minimum
            candidates_low.append(math.floor(minimum) + 1)
        else:
            candidates_low.append(math.ceil(minimum))
    if maximum is not None:
        if exclusive_max is True:
            candidates_high.append(math.ceil(maximum) - 1)
        else:
            candidates_high.append(math.floor(maximum))
    if isinstance(exclusive_min, (int, float)) and not isinstance(exclusive_min, bool):
        candidates_low.append(math.floor(exclusive_min) + 1)
    if isinstance(exclusive_max, (int, float)) and not isinstance(exclusive_max, bool):
        candidates_high.append(math.ceil(exclusive_max) - 1)
    if candidates_low:
        low = max(candidates_low)
    if candidates_high:
        high = min(candidates_high)
    return low, high


def _number_lower_bound_is_zero(schema: dict[str, Any]) -> bool:
    """``schema`` (a number) asks for ``x >= 0`` and nothing else of its value."""
    return (schema.get("minimum") == 0 and not isinstance(schema.get("minimum"), bool)
            and schema.get("exclusiveMinimum", False) is False and "maximum" not in schema
            and "exclusiveMaximum" not in schema)


class BoundedConverter(_json_schema_grammar.SchemaConverter):  # type: ignore[misc]
    """The vendored converter, plus integer bounds and ``minimum: 0`` on numbers."""

    def visit(self, schema: Any, name: str) -> str:
        kind = schema.get("type") if isinstance(schema, dict) else None
        bounded = kind == "integer" and any(key in schema for key in _BOUNDS) or (
            kind == "number" and _number_lower_bound_is_zero(schema))
        if bounded and not any(key in schema for key in ("$ref", "anyOf", "oneOf", "const", "enum")):
            rule_name = name + "-" if name in _json_schema_grammar.RESERVED_NAMES else name or "root"
            if kind == "integer":
                low, high = _integer_bounds(schema)
                return self._add_rule(rule_name, f"({integer_range_rule(low, high)}) space")
            for dependency in ("integral-part", "decimal-part"):
                self._add_primitive(dependency, _json_schema_grammar.PRIMITIVE_RULES[dependency])
            return self._add_rule(rule_name, '(integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)? space')
        return str(super().visit(schema, name))


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    """:func:`_json_schema_grammar.json_schema_to_gbnf` with :class:`BoundedConverter`."""
    converter = BoundedConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(converter.resolve_refs(schema, "stdin"), "")
    return str(converter.format_grammar())


# --- the keyword check ------------------------------------------------------------------------


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _honoured(schema: dict[str, Any], resolve: Callable[[str], Any], path: str) -> set[str]:
    """The keywords the converter's branch for ``schema`` enforces (the order of its ``visit``)."""
    kind = schema.get("type")
    if "$ref" in schema:
        return {"$ref"}
    if "oneOf" in schema or "anyOf" in schema:
        return {"oneOf"} if schema.get("oneOf") else {"anyOf"}
    if isinstance(kind, list):
        return {"type"}
    if "const" in schema or "enum" in schema:
        return _literal_keys(schema, path)
    if kind in (None, "object") and ("properties" in schema or (
            "additionalProperties" in schema and schema["additionalProperties"] is not True)):
        required = schema.get("required", [])
        missing = [name for name in required if name not in schema.get("properties", {})]
        if missing:
            raise SchemaRefusal(_join(path, "required"), f"required property {missing[0]!r} is not among "
                                "'properties' (the grammar writes only listed properties)")
        return {"type", "properties", "required", "additionalProperties"}
    if kind in (None, "object") and "allOf" in schema:
        for index, component in enumerate(schema["allOf"]):
            where = _join(_join(path, "allOf"), index)
            target = resolve(component["$ref"]) if isinstance(component, dict) and "$ref" in component else component
            if not isinstance(target, dict) or target.get("type", "object") != "object" or "properties" not in target:
                raise SchemaRefusal(where, "an 'allOf' part must be an object schema with 'properties' "
                                    "(the grammar merges their properties)")
            extra = sorted(set(target) - ANNOTATIONS - {"type", "properties", "required", "additionalProperties"}
                           - set(_DEFINITIONS))
            if extra:
                raise SchemaRefusal(_join(where, extra[0]), "inside 'allOf' only type, properties, required "
                                    "and additionalProperties are served")
        return {"type", "allOf"}
    if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
        if not schema.get("items") and "prefixItems" not in schema:
            raise SchemaRefusal(_join(path, "items"), "an empty 'items' is not served (leave it out for any items)")
        items = schema.get("items") or schema["prefixItems"]
        if isinstance(items, list):
            if schema.get("items") and "prefixItems" in schema:
                raise SchemaRefusal(_join(path, "prefixItems"), "served only without 'items' (or with 'items': false)")
            count = len(items)
            if schema.get("minItems", 0) > count or schema.get("maxItems", count) < count:
                raise SchemaRefusal(_join(path, "minItems" if schema.get("minItems", 0) > count else "maxItems"),
                                    "the grammar writes exactly the tuple's items, which this bound refuses")
            return {"type", "items", "prefixItems", "minItems", "maxItems"}
        if "prefixItems" in schema:
            raise SchemaRefusal(_join(path, "prefixItems"), "served only without 'items' (or with 'items': false)")
        return {"type", "items", "minItems", "maxItems"}
    if kind in (None, "string") and "pattern" in schema:
        return {"type", "pattern"}
    if kind in (None, "string") and "format" in schema:
        if schema["format"] not in _FORMATS:
            raise SchemaRefusal(_join(path, "format"), f"format {schema['format']!r} is not served "
                                f"(served: {', '.join(sorted(_FORMATS))})")
        return {"type", "format"}
    if kind == "string":
        return {"type", "minLength", "maxLength"}
    if kind == "integer":
        for key in _BOUNDS:
            bound = schema.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not (
                    math.isfinite(bound) and abs(bound) < 10 ** MAX_BOUND_DIGITS):
                raise SchemaRefusal(_join(path, key), f"integer bounds are served up to {MAX_BOUND_DIGITS} digits")
        return {"type", *_BOUNDS}
    if kind == "number":
        return {"type", *_BOUNDS} if _number_lower_bound_is_zero(schema) else {"type"}
    if kind == "object" and schema.get("additionalProperties", True) is True:
        return {"type", "additionalProperties"}
    return {"type"}


def _literal_keys(schema: dict[str, Any], path: str) -> set[str]:
    """``const`` / ``enum``: the grammar writes exactly those values, so a sibling keyword is
    enforced when every value already satisfies it (checked with ``jsonschema``)."""
    key = "const" if "const" in schema else "enum"
    values = [schema["const"]] if key == "const" else list(schema["enum"])
    siblings = {name: value for name, value in schema.items()
                if name not in ANNOTATIONS and name not in ("const", "enum", *_DEFINITIONS)}
    if not siblings:
        return {key}
    if "$ref" in str(siblings):
        raise SchemaRefusal(_join(path, sorted(siblings)[0]), f"not served beside '{key}' together with a '$ref'")
    import jsonschema

    validator = jsonschema.validators.validator_for(siblings)(siblings)
    for value in values:
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            keyword = str(error.validator)
            raise SchemaRefusal(_join(path, keyword if keyword in siblings else sorted(siblings)[0]),
                                f"the {key} value {value!r} does not satisfy it ({error.message})")
    return {key, *siblings}


def _no_op(key: str, value: Any) -> bool:
    """A keyword whose value asks nothing (``uniqueItems: false``, ``minItems: 0``, ...)."""
    return ((key in ("uniqueItems", "additionalItems") and value is False)
            or (key in ("minItems", "minLength", "minProperties") and value == 0 and not isinstance(value, bool)))


def check_keywords(schema: Any, path: str = "") -> None:
    """Refuse every keyword of ``schema`` (and of its subschemas) the grammar would not enforce.

    Raises:
        SchemaRefusal: the first such keyword, its path relative to the schema (``properties.tags.uniqueItems``).
    """
    root = schema

    def resolve(ref: str) -> Any:
        if not ref.startswith("#/"):
            return None  # the converter refuses remote references itself
        target = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        return target

    def walk(node: Any, where: str) -> None:
        if isinstance(node, bool):
            raise SchemaRefusal(where, "a boolean schema is not served here (write {} or a schema)")
        if not isinstance(node, dict):
            return  # malformed parts: the metaschema check has refused them
        honoured = _honoured(node, resolve, where)
        for key in sorted(node, key=lambda key: key == "minimum" and node[key] == 0):  # name what spoils 'minimum': 0
            if key in ANNOTATIONS or key in _DEFINITIONS or key in honoured or _no_op(key, node[key]):
                continue
            reason = "the grammar would not enforce this JSON Schema keyword (docs/structured-output.md)"
            if key in _BOUNDS and node.get("type") == "number":
                reason = "on a number only 'minimum': 0 alone is served (integers take any bounds)"
            raise SchemaRefusal(_join(where, key), reason)
        for container in _DEFINITIONS:
            for name, sub in (node.get(container) or {}).items():
                walk(sub, _join(_join(where, container), name))
        if "$ref" in honoured:
            return
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if key in honoured and isinstance(node.get(key), list):
                for index, sub in enumerate(node[key]):
                    walk(sub, _join(_join(where, key), index))
        if "properties" in honoured:
            for name, sub in (node.get("properties") or {}).items():
                walk(sub, _join(_join(where, "properties"), name))
        if "additionalProperties" in honoured and isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], _join(where, "additionalProperties"))
        if "items" in honoured and "items" in node:
            items = node["items"]
            if items is False and "prefixItems" in node:
                pass  # no items past the tuple: what the grammar writes
            elif isinstance(items, list):
                for index, sub in enumerate(items):
                    walk(sub, _join(_join(where, "items"), index))
            else:
                walk(items, _join(where, "items"))

    walk(schema, path)
