"""A decode run's request (``docs/protocol.md`` §11): the chat metadata of a run's flagged DecodeEmbd.

Strategy: one frozen value, written by the driver (:meth:`DecodeRunRequest.metadata`) and parsed
by the first stage from hostile metadata with every field checked
(:meth:`DecodeRunRequest.from_metadata`).  It lives with the codec because both ends speak it; the
run itself, on the first stage, is :mod:`skippy.stage.decode_run`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Final, final

from skippy.codec.protocol_ext import DECODE_RUN_METADATA_KEY

__all__ = ["DecodeRunRequest", "MAX_RUN_STOP_TOKENS", "MAX_RUN_TOKENS"]


#: Most predictions one run may ask for (a run is also bounded by the session's KV cells).
MAX_RUN_TOKENS: Final = 1 << 20
#: Most stop tokens one run may name (end-of-generation sets are a handful of ids).
MAX_RUN_STOP_TOKENS: Final = 1024
#: Largest token id (token ids are int32 on the wire).
_TOKEN_END: Final = 1 << 31


@final
@dataclasses.dataclass(frozen=True, slots=True)
class DecodeRunRequest:
    """What a run asks for: at most ``max_tokens`` predictions (the flagged message's own included),
    ending early after a prediction in ``stop_tokens``."""

    max_tokens: int
    stop_tokens: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 1 <= self.max_tokens <= MAX_RUN_TOKENS:
            raise ValueError(f"{DECODE_RUN_METADATA_KEY}.max_tokens must be an integer in 1..{MAX_RUN_TOKENS}")
        if len(self.stop_tokens) > MAX_RUN_STOP_TOKENS:
            raise ValueError(f"{DECODE_RUN_METADATA_KEY}.stop_tokens holds {len(self.stop_tokens)} ids; "
                             f"at most {MAX_RUN_STOP_TOKENS}")
        for token in self.stop_tokens:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < _TOKEN_END:
                raise ValueError(f"{DECODE_RUN_METADATA_KEY}.stop_tokens must hold token ids in 0..{_TOKEN_END - 1}")

    def metadata(self) -> str:
        """The chat metadata of the run's flagged DecodeEmbd."""
        return json.dumps({DECODE_RUN_METADATA_KEY: {"max_tokens": self.max_tokens,
                                                     "stop_tokens": sorted(self.stop_tokens)}},
                          separators=(",", ":"))

    @classmethod
    def from_metadata(cls, metadata: str | None) -> "DecodeRunRequest":
        """Parse a flagged DecodeEmbd's chat metadata (hostile input: every field is checked).

        Raises:
            ValueError: no run section, or a field of the wrong type or out of range (named).
        """
        try:
            data = json.loads(metadata or "")
        except ValueError as exc:
            raise ValueError(f"its chat metadata is not JSON ({exc})") from None
        section = data.get(DECODE_RUN_METADATA_KEY) if isinstance(data, dict) else None
        if not isinstance(section, dict):
            raise ValueError(f"its chat metadata has no {DECODE_RUN_METADATA_KEY} object")
        stops = section.get("stop_tokens", [])
        if not isinstance(stops, list):
            raise ValueError(f"{DECODE_RUN_METADATA_KEY}.stop_tokens must be a list of token ids")
        if len(stops) > MAX_RUN_STOP_TOKENS:  # before building a set from it
            raise ValueError(f"{DECODE_RUN_METADATA_KEY}.stop_tokens holds {len(stops)} ids; "
                             f"at most {MAX_RUN_STOP_TOKENS}")
        for token in stops:
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"{DECODE_RUN_METADATA_KEY}.stop_tokens must hold token ids in 0..{_TOKEN_END - 1}")
        return cls(section.get("max_tokens"), frozenset(stops))  # type: ignore[arg-type]
