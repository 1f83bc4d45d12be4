"""Activation kernels of the pure-Python codec twin: f32 <-> f16 / q8 bit for bit (protocol.md §4.2).

Strategy
--------
numpy only, with explicit bit manipulation, so the output is exactly the reference's bytes: f16
rounds ties away from zero (not to even) and q8 rounds half away from zero. Split out of
``_wire_py`` to keep that module to the frame codec; ``_activation.h`` is the C counterpart.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from skippy.codec.protocol import Float32Array

__all__ = ["_f16_bits_to_f32", "_f32_to_f16_bits", "_f32_to_q8"]


def _f32_to_f16_bits(values: Float32Array) -> np.ndarray:
    """IEEE binary16 bits of ``values``, ties away from zero, NaN -> sign|0x7e00 (§4.2)."""
    bits = values.view(np.uint32)
    sign = ((bits >> 16) & 0x8000).astype(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    # Normal halves: rebias the exponent by (127-15) << 23; adding half an ulp (bit 12) rounds
    # ties away from zero and lets a mantissa carry roll into the exponent (65520 -> Inf).
    normal = ((magnitude - np.uint32(0x38000000)) + np.uint32(0x1000)) >> 13
    # Subnormal halves: shift the mantissa (with its implicit bit) right by 126 - exponent,
    # adding half of the last kept unit first.
    exponent = (magnitude >> 23).astype(np.int64)
    shift = np.clip(126 - exponent, 1, 31).astype(np.uint32)
    mantissa = ((magnitude & np.uint32(0x7FFFFF)) | np.uint32(0x800000)).astype(np.uint64)
    subnormal = ((mantissa + (np.uint64(1) << (shift - 1).astype(np.uint64)))
                 >> shift.astype(np.uint64)).astype(np.uint32)
    half = np.where(
        magnitude > 0x7F800000, np.uint32(0x7E00),
        np.where(
            magnitude >= 0x47800000, np.uint32(0x7C00),
            np.where(
                magnitude >= 0x38800000, normal,
                np.where(magnitude >= 0x33000000, subnormal, np.uint32(0)),
            ),
        ),
    )
    return (half | sign).astype("<u2")


def _f16_bits_to_f32(halves: np.ndarray) -> Float32Array:
    """Exact binary16 -> binary32, subnormals, Inf and NaN payloads included (§4.2)."""
    h = halves.astype(np.uint32)
    sign = (h & 0x8000) << 16
    exponent = (h >> 10) & 0x1F
    mantissa = h & 0x3FF
    normal = ((exponent + (127 - 15)) << 23) | (mantissa << 13)
    special = np.uint32(0x7F800000) | (mantissa << 13)
    # A subnormal half is mantissa x 2^-24, exactly representable in f32.
    subnormal = (mantissa.astype(np.float32) * np.float32(2.0**-24)).view(np.uint32)
    bits = np.where(exponent == 0x1F, special, np.where(exponent == 0, subnormal, normal))
    return cast(Float32Array, (bits | sign).astype(np.uint32).view(np.float32))


def _f32_to_q8(values: Float32Array) -> bytes:
    """Per-row symmetric int8: all f32 scales first, then the values (§4.2)."""
    with np.errstate(all="ignore"):  # inf/inf and NaN inputs are defined below, not warnings
        magnitude = np.abs(values)
        max_abs = np.fmax.reduce(magnitude, axis=1, initial=np.float32(0.0))  # skips NaN
        scale = np.where(max_abs == 0, np.float32(1.0), max_abs / np.float32(127.0))
        scale = scale.astype(np.float32)
        quotient = values / scale[:, None]
        truncated = np.trunc(quotient)
        fraction = quotient - truncated
        rounded = truncated + np.where(np.abs(fraction) >= 0.5, np.sign(quotient), 0)
        rounded = np.clip(np.where(np.isnan(rounded), 0, rounded), -127, 127)
    return scale.astype("<f4").tobytes() + rounded.astype(np.int8).tobytes()
