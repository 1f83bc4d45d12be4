"""C callbacks into Python (cffi ``extern "Python"``): llama.cpp logging and load progress.

Strategy: callbacks never raise into C.  Log lines go to the ``skippy.llama`` logger; the most
recent warning/error lines are kept per thread so a failed native call can quote them in its
exception.  The progress callback receives its Python callable as a ``new_handle`` payload; if the
callable raises, the exception is stored on the payload and loading is aborted (return false);
the caller re-raises after the C call returns.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

from skippy._llama import ffi, lib  # type: ignore[import-not-found]  # cffi-compiled, no stub

_LOG = logging.getLogger("skippy.llama")
_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.DEBUG,  # llama.cpp's info is chatty: keep it at debug
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}
_recent = threading.local()
_last_level = [logging.DEBUG]


def recent_errors() -> collections.deque[str]:
    """The last warning/error lines llama.cpp logged on this thread."""
    lines = getattr(_recent, "lines", None)
    if lines is None:
        lines = collections.deque(maxlen=8)
        _recent.lines = lines
    return lines


def install_log_handler() -> None:
    """(Re)route llama.cpp's log to Python; other bindings in the process (llama-cpp-python sets
    its own handler at import) may have replaced it."""
    lib.llama_log_set(lib.skippy_on_log, ffi.NULL)


def take_recent_errors() -> str:
    """The recent warning/error lines as one string, forgetting them; re-installs our handler
    so that the next native call's messages are captured."""
    install_log_handler()
    lines = recent_errors()
    text = "; ".join(line.strip() for line in lines if line.strip())
    lines.clear()
    return text


@ffi.def_extern()  # type: ignore[misc]
def skippy_on_log(level: int, text: Any, user_data: Any) -> None:
    message = ffi.string(text).decode("utf-8", "replace")
    if level == lib.GGML_LOG_LEVEL_CONT:
        py_level = _last_level[0]
    else:
        py_level = _LEVELS.get(level, logging.DEBUG)
        _last_level[0] = py_level
    if py_level >= logging.WARNING:
        recent_errors().append(message)
    if _LOG.isEnabledFor(py_level):
        _LOG.log(py_level, "%s", message.rstrip("\n"))


class ProgressPayload:
    """Carries a progress callable into C and any exception it raised back out."""

    def __init__(self, callback: Callable[[float], object]) -> None:
        self.callback = callback
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error


@ffi.def_extern()  # type: ignore[misc]
def skippy_on_progress(progress: float, user_data: Any) -> bool:
    payload: ProgressPayload = ffi.from_handle(user_data)
    try:
        result = payload.callback(float(progress))
    except BaseException as exc:  # noqa: BLE001 - must not unwind through C; re-raised by the loader
        payload.error = exc
        return False
    return result is not False
