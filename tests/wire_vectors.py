"""Golden frames of the reference Rust codec (copied from ``../shared/wire-vectors``).

One table drives both the encode and the decode tests (convention 7). The copies in
``tests/data/wire-vectors`` keep the suite self-contained; when the shared directory sits beside
the repository (as in CI) ``test_vector_copies_match_shared`` checks the copies are current.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

VECTOR_DIR = Path(__file__).parent / "data" / "wire-vectors"
SHARED_VECTOR_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "wire-vectors"
VECTOR_FILES = ("messages.json", "replies.json", "invalid.json")


def load(name: str) -> dict[str, Any]:
    with open(VECTOR_DIR / name, encoding="utf-8") as handle:
        return json.load(handle)  # type: ignore[no-any-return]


MESSAGES = load("messages.json")
REPLIES = load("replies.json")
INVALID = load("invalid.json")

MESSAGE_CASES: list[dict[str, Any]] = MESSAGES["cases"]
MESSAGE_DECODE_ONLY: list[dict[str, Any]] = MESSAGES["decode_only"]
REPLY_CASES: list[dict[str, Any]] = REPLIES["cases"]
REPLY_DECODE_ONLY: list[dict[str, Any]] = REPLIES["decode_only"]
INVALID_CASES: list[dict[str, Any]] = INVALID["cases"]
WRITER_REJECTS: list[dict[str, Any]] = INVALID["writer_rejects"]

#: Keys of a message's ``fields`` that hold the float32 *inputs*: a lossy (f16/q8) decode cannot
#: recover them, so decode tests compare ``decoded_activation*`` instead.
LOSSY_INPUT_KEYS = ("activation", "activation_f32_hex")


FLOAT_LIST_KEYS = ("activation", "decoded_activation")
SAMPLING_FLOAT_KEYS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                       "repeat_penalty")


def float32_key(value: Any) -> Any:
    """A JSON float32 as its bit pattern: two shortest decimals of one float32 may differ in the
    last digit when the float32 lies exactly between them (Rust and numpy break that tie
    differently), so floats compare by value."""
    if isinstance(value, str) or value is None:
        return value
    return int(np.float32(value).view(np.uint32))


def comparable_fields(fields: dict[str, Any], lossy: bool) -> dict[str, Any]:
    """``fields`` without the keys a decoder cannot reproduce, floats as float32 bits."""
    out = {key: value for key, value in fields.items()
           if not (lossy and key in LOSSY_INPUT_KEYS)}
    for key in FLOAT_LIST_KEYS:
        if out.get(key) is not None:
            out[key] = [float32_key(v) for v in out[key]]
    if out.get("sampling") is not None:
        sampling = dict(out["sampling"])
        for key in SAMPLING_FLOAT_KEYS:
            sampling[key] = float32_key(sampling[key])
        sampling["logit_bias"] = [(b["token_id"], float32_key(b["bias"]))
                                  for b in sampling["logit_bias"]]
        out["sampling"] = sampling
    return out


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [case["name"] for case in cases]
