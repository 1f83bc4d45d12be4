"""Codec benchmarks: Cython vs the pure twin vs a plain-numpy baseline, one group per operation.

Run: ``.venv/bin/python -m pytest bench/test_bench_wire.py --benchmark-only
--benchmark-group-by=group --benchmark-columns=min,median,mean,ops`` (CI: ``--benchmark-disable``).
Throughput benchmarks put the bytes they process in ``extra_info["bytes"]``, so GB/s is
``bytes / mean``. The numpy baseline is what a straightforward codec would do (``struct`` for the
header, ``astype(float16)`` for f16 -- ties to even, so not byte-compatible -- and vectorised numpy
for q8); it bounds what the codec should reach.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from skippy.codec.protocol import MessageKind, StageMessage, WireDType

IMPLEMENTATIONS = {"cython": "skippy.codec._wire", "python": "skippy.codec._wire_py"}
RNG = np.random.default_rng(7)
HEADER = struct.Struct("<5i10i2Q")


def implementation(name: str) -> ModuleType:
    if name == "cython":
        return pytest.importorskip(IMPLEMENTATIONS[name])
    return importlib.import_module(IMPLEMENTATIONS[name])


def activation(rows: int, width: int) -> np.ndarray:
    return RNG.standard_normal((rows, width)).astype(np.float32)


def frame_message(kind: MessageKind, rows: int, width: int) -> StageMessage:
    return StageMessage.create(
        kind, pos_start=17, token_count=rows, tokens=np.arange(rows, dtype=np.int32),
        request_id=1, session_id=2, activation=activation(rows, width),
        state_changes={"source_stage_index": 0, "decode_step": 3},
    )


# ------------------------------------------------------------------------------------------
# Plain-numpy baseline codec (header via struct, activation via numpy)
# ------------------------------------------------------------------------------------------


def numpy_encode_activation(values: np.ndarray, dtype: WireDType) -> bytes:
    if dtype == WireDType.F32:
        return values.tobytes()
    if dtype == WireDType.F16:
        return values.astype(np.float16).tobytes()
    max_abs = np.abs(values).max(axis=1)
    scale = np.where(max_abs == 0, np.float32(1), max_abs / np.float32(127)).astype(np.float32)
    quantized = np.clip(np.round(values / scale[:, None]), -127, 127).astype(np.int8)
    return scale.tobytes() + quantized.tobytes()


def numpy_decode_activation(data: bytes, offset: int, dtype: WireDType, rows: int,
                            width: int) -> np.ndarray:
    if dtype == WireDType.F32:
        return np.frombuffer(data, np.float32, rows * width, offset).reshape(rows, width)
    if dtype == WireDType.F16:
        halves = np.frombuffer(data, np.float16, rows * width, offset)
        return halves.astype(np.float32).reshape(rows, width)
    scale = np.frombuffer(data, np.float32, rows, offset)
    quantized = np.frombuffer(data, np.int8, rows * width, offset + 4 * rows)
    return quantized.reshape(rows, width).astype(np.float32) * scale[:, None]


def numpy_round_trip(message: StageMessage, dtype: WireDType, width: int) -> Any:
    state = message.state
    tokens = np.asarray(message.tokens, dtype=np.int32)
    frame = b"".join((
        HEADER.pack(int(message.kind), message.pos_start, message.token_count, len(tokens), 0,
                    state.version, state.seq_id, state.phase, state.flags,
                    state.checkpoint_generation, state.prompt_token_count, state.decode_step,
                    state.current_token, state.source_stage_index, int(dtype),
                    message.request_id, message.session_id),
        tokens.tobytes(),
        numpy_encode_activation(message.activation, dtype),  # type: ignore[arg-type]
    ))
    fields = HEADER.unpack_from(frame)
    decoded_tokens = np.frombuffer(frame, np.int32, fields[3], 76)
    rows = fields[2]
    return fields, decoded_tokens, numpy_decode_activation(frame, 76 + 4 * fields[3], dtype,
                                                           rows, width)


def codec_round_trip(wire: ModuleType) -> Callable[[StageMessage, WireDType, int], Any]:
    def round_trip(message: StageMessage, dtype: WireDType, width: int) -> Any:
        decoder = wire.MessageDecoder(width)
        decoder.receive_data(wire.encode_message(message, dtype, width))
        return decoder.next_message()

    return round_trip


ALL = ["cython", "python", "numpy"]


def round_trip_for(name: str) -> Callable[[StageMessage, WireDType, int], Any]:
    return numpy_round_trip if name == "numpy" else codec_round_trip(implementation(name))


# ------------------------------------------------------------------------------------------
# Frames
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8"])
@pytest.mark.parametrize("width", [2048, 4096])
def test_decode_frame_round_trip(benchmark: Any, name: str, dtype: str, width: int) -> None:
    """Encode + decode one 1-token DecodeEmbd frame."""
    benchmark.group = f"decode frame round trip w{width} {dtype}"
    message = frame_message(MessageKind.DECODE_EMBD, 1, width)
    benchmark(round_trip_for(name), message, WireDType[dtype.upper()], width)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8"])
def test_prefill_frame_round_trip(benchmark: Any, name: str, dtype: str) -> None:
    """Encode + decode one 512-token PrefillEmbd frame at width 4096."""
    benchmark.group = f"prefill 512x4096 round trip {dtype}"
    message = frame_message(MessageKind.PREFILL_EMBD, 512, 4096)
    benchmark.extra_info["bytes"] = 512 * 4096 * 4
    benchmark(round_trip_for(name), message, WireDType[dtype.upper()], 4096)


# ------------------------------------------------------------------------------------------
# Quantization throughput (8 MiB of f32: 512 x 4096)
# ------------------------------------------------------------------------------------------

THROUGHPUT_VALUES = activation(512, 4096)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", ["f16", "q8"])
def test_quantize(benchmark: Any, name: str, dtype: str) -> None:
    benchmark.group = f"{dtype} quantize (8 MiB f32 in)"
    benchmark.extra_info["bytes"] = THROUGHPUT_VALUES.nbytes
    wire_dtype = WireDType[dtype.upper()]
    if name == "numpy":
        benchmark(numpy_encode_activation, THROUGHPUT_VALUES, wire_dtype)
    else:
        benchmark(implementation(name).encode_activation, THROUGHPUT_VALUES, wire_dtype)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", ["f16", "q8"])
def test_dequantize(benchmark: Any, name: str, dtype: str) -> None:
    benchmark.group = f"{dtype} dequantize (8 MiB f32 out)"
    benchmark.extra_info["bytes"] = THROUGHPUT_VALUES.nbytes
    wire_dtype = WireDType[dtype.upper()]
    encoded = implementation("python").encode_activation(THROUGHPUT_VALUES, wire_dtype)
    if name == "numpy":
        benchmark(numpy_decode_activation, encoded, 0, wire_dtype, 512, 4096)
    else:
        benchmark(implementation(name).decode_activation, encoded, wire_dtype, 512, 4096)


# ------------------------------------------------------------------------------------------
# Sidebands
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_sideband_parse_128k(benchmark: Any, name: str) -> None:
    """Parse 128k i32 token ids out of a frame (as views where alignment allows)."""
    benchmark.group = "sideband parse 128k tokens"
    data = b"\x00" * 76 + np.arange(131072, dtype="<i4").tobytes()
    benchmark.extra_info["bytes"] = 131072 * 4
    if name == "numpy":
        benchmark(np.frombuffer, data, np.int32, 131072, 76)
    else:
        benchmark(implementation(name).int32_sideband, data, 76, 131072)


@pytest.mark.parametrize("name", ALL)
def test_prefill_frame_with_128k_token_sideband(benchmark: Any, name: str) -> None:
    """Decode a driver prefill frame carrying 128k tokens and no activation."""
    benchmark.group = "decode driver frame 128k tokens"
    message = StageMessage.create(MessageKind.PREFILL_EMBD, token_count=131072,
                                  tokens=np.arange(131072, dtype=np.int32))
    frame = implementation("python").encode_message(message, WireDType.F32)
    if name == "numpy":
        def decode() -> Any:
            fields = HEADER.unpack_from(frame)
            return fields, np.frombuffer(frame, np.int32, fields[3], 76)
        benchmark(decode)
        return
    wire = implementation(name)

    def decode_codec() -> Any:
        decoder = wire.MessageDecoder(4096)
        decoder.receive_data(frame)
        return decoder.next_message()

    benchmark(decode_codec)
