"""OpenAI-style API errors and request validation.

Strategy: every refusal is one :class:`ApiError` carrying the HTTP status and the fields of the
OpenAI error body (``message``, ``type``, ``param``, ``code``); handlers raise it, one exception
handler renders it.  Request bodies are plain JSON objects checked field by field by the small
typed readers here (no schema library): a field of the wrong type or out of range is a 422 naming
the field, malformed JSON a 400, an unknown model a 404.  Which fields a body may carry at all is
:mod:`skippy.api.fields`'s job (an unknown or unserved field is a 400 naming it).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, final


@final
class ApiError(Exception):
    """An error the API answers with ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    """A 422 for one field."""
    return ApiError(422, f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        ApiError: 400 when the body is not JSON or not an object.
    """
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return data


def get_int(body: Mapping[str, Any], name: str, *, minimum: int | None = None, maximum: int | None = None
            ) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"expected an integer, got {json.dumps(value)}")
    if minimum is not None and value < minimum:
        raise invalid(name, f"{value} is less than the minimum of {minimum}")
    if maximum is not None and value > maximum:
        raise invalid(name, f"{value} is greater than the maximum of {maximum}")
    return value


def get_float(body: Mapping[str, Any], name: str, *, minimum: float, maximum: float,
              exclusive_minimum: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(name, f"expected a number, got {json.dumps(value)}")
    if value < minimum or (exclusive_minimum and value == minimum):
        raise invalid(name, f"{value} is {'not greater than' if exclusive_minimum else 'less than'} the minimum of {minimum}")
    if value > maximum:
        raise invalid(name, f"{value} is greater than the maximum of {maximum}")
    return float(value)


def get_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"expected a boolean, got {json.dumps(value)}")
    return value


def get_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value) and len(value) <= 4:
        return tuple(value)
    raise invalid("stop", "expected a string or a list of at most 4 strings")


def get_logit_bias(body: Mapping[str, Any], n_vocab: int) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", "expected an object mapping token ids to biases")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= token < n_vocab:
            raise invalid("logit_bias", f"token id {token} is outside the vocabulary (0..{n_vocab - 1})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"bias for token {token} must be a number in [-100, 100]")
        out.append((token, float(bias)))
    if len(out) > 256:
        raise invalid("logit_bias", f"at most 256 entries are supported (got {len(out)})")
    return tuple(out)
