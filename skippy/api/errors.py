"""OpenAI-style API errors and request validation.

Strategy: every refusal is one :class:`ApiError` carrying the HTTP status and the fields of the
OpenAI error body (``message``, ``type``, ``param``, ``code``); handlers raise it, one exception
handler renders it.  Request bodies are plain JSON objects checked field by field by the small
typed readers here (no schema library): a field of the wrong type or out of range is a 422 naming
the field, malformed JSON a 400, an unknown model a 404.  Which fields a body may carry at all is
:mod:`skippy.api.fields`'s job (an unknown or unserved field is a 400 naming it).  A body is
refused 400 before any field is read when it nests deeper than :data:`MAX_JSON_DEPTH` or holds a
lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but no text: it could be neither tokenised nor
echoed back in an error).
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping, final

#: Deepest nesting of arrays and objects a request body may have (OpenAI bodies need about 6).
MAX_JSON_DEPTH = 64


@final
class ApiError(Exception):
    """An error the API answers with ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        #: Extra response headers (``Retry-After`` on a 429).
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The body in the shape of the API ``path`` belongs to (Anthropic's for the Messages API)."""
        return error_shape(path, self.status, self.message, self.type, self.param, self.code)


#: Paths whose errors take Anthropic's shape (the Messages API, skippy/api/messages.py).
ANTHROPIC_PATHS = ("/v1/messages", "/messages")
#: Anthropic's error type for an HTTP status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                    422: "invalid_request_error", 429: "rate_limit_error", 501: "invalid_request_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is served in Anthropic's shapes (errors included)."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in ANTHROPIC_PATHS)


def error_shape(path: str, status: int, message: str, type: str = "invalid_request_error",
                param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An error body for ``path``: OpenAI's ``{"error": {...}}``, or on the Messages API Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` (the field, when one is named, in the message)."""
    if not is_anthropic_path(path):
        return {"error": {"message": message, "type": type, "param": param, "code": code}}
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def renamed(exc: ApiError, names: Mapping[str, str]) -> ApiError:
    """``exc`` naming another API's field: a field ``names`` maps (or a part of it) under its new name,
    in ``param`` and in the message (an API translated onto chat completions names its own fields)."""
    param = exc.param
    for old, new in names.items():
        if param is not None and (param == old or param.startswith((old + ".", old + "["))):
            shown = new + param[len(old):]
            return ApiError(exc.status, exc.message.replace(f"'{param}'", f"'{shown}'"), type=exc.type, param=shown,
                            code=exc.code, headers=exc.headers)
    return exc


def internal_error(exc: BaseException) -> ApiError:
    """A 500 for an unexpected exception (a bug); the details go to the server log, not the client."""
    return ApiError(500, f"The server had an error while processing your request ({type(exc).__name__}); "
                         "the server log has the details.", type="server_error", code="internal_error")


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
    except RecursionError:  # the C scanner's own recursion guard: far deeper than MAX_JSON_DEPTH
        raise ApiError(400, f"The JSON body nests arrays or objects more than {MAX_JSON_DEPTH} deep.",
                       code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    _check_tree(data)
    return data


def _check_tree(root: dict[str, Any]) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings with lone surrogates (iteratively)."""
    stack: list[tuple[Any, int, str]] = [(root, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"The JSON body nests arrays or objects more than {MAX_JSON_DEPTH} deep "
                                f"(at '{path}').", code="invalid_json")
        items: Iterable[tuple[str, Any]]
        if isinstance(value, dict):
            for key in value:
                _check_text(key, f"{path}.{_shown(key)}" if path else _shown(key))
            items = ((f"{path}.{_shown(k)}" if path else _shown(k), v) for k, v in value.items())
        else:
            items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
        for where, item in items:
            if isinstance(item, str):
                _check_text(item, where)
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1, where))


def _shown(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("ascii", "replace")[:64]


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"Invalid value for '{where}': the string holds a lone UTF-16 surrogate "
                            f"(\\u{ord(text[exc.start]):04x} at offset {exc.start}), which is not text.",
                       param=where, code="invalid_json") from None


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _brief(value: Any) -> str:
    """A field's value for an error message, at most 80 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def get_int(body: Mapping[str, Any], name: str, *, minimum: int | None = None, maximum: int | None = None
            ) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"expected an integer, got {_brief(value)}")
    if minimum is not None and value < minimum:
        raise invalid(name, f"{_brief(value)} is less than the minimum of {minimum}")
    if maximum is not None and value > maximum:
        raise invalid(name, f"{_brief(value)} is greater than the maximum of {maximum}")
    return value


def get_float(body: Mapping[str, Any], name: str, *, minimum: float, maximum: float,
              exclusive_minimum: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise invalid(name, f"expected a finite number, got {_brief(value)}")
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
        raise invalid(name, f"expected a boolean, got {_brief(value)}")
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
            raise invalid("logit_bias", f"key {_brief(key)} is not a token id") from None
        if not 0 <= token < n_vocab:
            raise invalid("logit_bias", f"token id {token} is outside the vocabulary (0..{n_vocab - 1})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"bias for token {token} must be a number in [-100, 100]")
        out.append((token, float(bias)))
    if len(out) > 256:
        raise invalid("logit_bias", f"at most 256 entries are supported (got {len(out)})")
    return tuple(out)
