"""``python -m skippy.codec.wire`` reproduces every shared vector, both directions, via subprocess.

The options, malformed input and invalid frames (one process each would be most of the module's
cost) go through the command's ``main`` in this process, with its standard streams replaced; every
message vector's encoding and one invalid frame run the real process (status 2, no traceback).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import wire_vectors as vectors
from skippy.codec.wire_cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, stdin: bytes, pure: bool = False) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if pure:
        env["SKIPPY_NO_EXTENSIONS"] = "1"
    return subprocess.run([sys.executable, "-m", "skippy.codec.wire", *args], input=stdin,
                          capture_output=True, env=env, cwd=ROOT, timeout=120, check=False)


def run_main(*args: str, stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    """What ``run_cli`` returns, from ``main`` in this process (an exception it lets out fails the test;
    it closes the input, as it does stdin)."""
    streams = {name: io.TextIOWrapper(io.BytesIO(stdin if name == "stdin" else b""), encoding="utf-8")
               for name in ("stdin", "stdout", "stderr")}
    with pytest.MonkeyPatch.context() as patch:
        for name, stream in streams.items():
            patch.setattr(sys, name, stream)
        status = main(list(args))
    outputs = []
    for name in ("stdout", "stderr"):
        streams[name].flush()
        outputs.append(streams[name].buffer.getvalue())  # type: ignore[attr-defined]
    out, err = outputs
    return subprocess.CompletedProcess(["main", *args], status, out, err)


def json_lines(output: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.decode().splitlines()]


@pytest.mark.parametrize("pure", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "pure"])
def test_encode_every_message_vector(pure: bool) -> None:
    stdin = json.dumps(vectors.MESSAGE_CASES).encode()
    result = run_cli("encode", "--hex", stdin=stdin, pure=pure)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == [case["hex"] for case in vectors.MESSAGE_CASES]


@pytest.mark.parametrize("case", vectors.MESSAGE_CASES[:3], ids=vectors.ids(vectors.MESSAGE_CASES[:3]))
def test_encode_fields_with_options_binary_output(case: dict[str, Any]) -> None:
    """Bare ``fields`` objects with --dtype/--width, binary frames on stdout."""
    stdin = json.dumps(case["fields"]).encode()
    result = run_main("encode", "--dtype", case["wire_dtype"], "--width",
                     str(case["activation_width"]), stdin=stdin)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == bytes.fromhex(case["hex"])


@pytest.mark.slow
@pytest.mark.parametrize("pure", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "pure"])
def test_decode_every_message_vector(pure: bool) -> None:
    by_width: dict[int, list[dict[str, Any]]] = {}
    for case in vectors.MESSAGE_CASES:
        by_width.setdefault(case["activation_width"], []).append(case)
    for width, cases in by_width.items():
        stdin = "\n".join(case["hex"] for case in cases).encode()
        result = run_cli("decode", "--width", str(width), "--hex", stdin=stdin, pure=pure)
        assert result.returncode == 0, result.stderr.decode()
        decoded = json_lines(result.stdout)
        assert len(decoded) == len(cases)
        for fields, case in zip(decoded, cases):
            lossy = case["wire_dtype"] != "f32"
            assert vectors.comparable_fields(fields, lossy) == vectors.comparable_fields(
                case["fields"], lossy), case["name"]


@pytest.mark.slow
def test_decode_binary_file_and_decode_only(tmp_path: Path) -> None:
    for case in vectors.MESSAGE_DECODE_ONLY:
        path = tmp_path / f"{case['name']}.bin"
        data = bytes.fromhex(case["hex"])
        frames = case["frames"]
        # Trailing unread bytes are a cut frame at the end of the input: decode what precedes.
        path.write_bytes(data[:len(data) - case["trailing_unread_bytes"]])
        result = run_cli("decode", "--width", str(case["activation_width"]), str(path),
                         stdin=b"")
        assert result.returncode == 0, result.stderr.decode()
        decoded = json_lines(result.stdout)
        assert [vectors.comparable_fields(f, True) for f in decoded] == [
            vectors.comparable_fields(frame["fields"], True) for frame in frames]


@pytest.mark.slow
def test_replies_both_directions() -> None:
    stdin = json.dumps([case["fields"] for case in vectors.REPLY_CASES]).encode()
    encoded = run_cli("encode", "--replies", "--hex", stdin=stdin)
    assert encoded.returncode == 0, encoded.stderr.decode()
    assert encoded.stdout.decode().split() == [case["hex"] for case in vectors.REPLY_CASES]
    decoded = run_cli("decode", "--replies", "--hex", stdin=encoded.stdout)
    assert decoded.returncode == 0, decoded.stderr.decode()
    assert json_lines(decoded.stdout) == [case["fields"] for case in vectors.REPLY_CASES]
    for case in vectors.REPLY_DECODE_ONLY:
        result = run_cli("decode", "--replies", "--hex", stdin=case["hex"].encode())
        assert json_lines(result.stdout) == [frame["fields"] for frame in case["frames"]]


INVALID_FRAMES = [case for case in vectors.INVALID_CASES
                  if case["target"] != "ready" and case["hex"]]


def _invalid_frame_args(case: dict[str, Any]) -> list[str]:
    args = ["decode", "--hex"]
    if case["target"] == "reply":
        args.append("--replies")
    else:
        args += ["--width", str(case["activation_width"])]
    return args


def _check_invalid_frame_refused(result: subprocess.CompletedProcess[bytes], case: dict[str, Any]) -> None:
    assert result.returncode == 2
    assert result.stdout == b""
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr
    if case["error_kind"] == "InvalidData":
        assert any(reason in stderr for reason in {case["error"],
                                                   *case.get("equivalent_errors", [])})
    else:
        assert "failed to fill whole buffer" in stderr


@pytest.mark.parametrize("case", INVALID_FRAMES, ids=vectors.ids(INVALID_FRAMES))
def test_decode_invalid_frame_exits_2(case: dict[str, Any]) -> None:
    result = run_main(*_invalid_frame_args(case), stdin=case["hex"].encode())
    _check_invalid_frame_refused(result, case)


def test_the_process_decoding_an_invalid_frame_exits_2() -> None:
    case = INVALID_FRAMES[0]
    _check_invalid_frame_refused(run_cli(*_invalid_frame_args(case), stdin=case["hex"].encode()), case)


@pytest.mark.parametrize(
    ("args", "stdin"),
    [
        (["encode"], b"{not json"),
        (["encode", "--hex"], b'{"kind": "Nope"}'),
        (["encode", "--dtype", "f16", "--width", "8"],
         b'{"kind": "DecodeEmbd", "token_count": 1, "state": {"source_stage_index": 0},'
         b' "activation": [1.0, 2.0, 3.0]}'),
        (["encode", "--replies"], b'{"kind": "PredictedToken", "predicted": 4294967296}'),
        (["decode", "--hex", "--width", "8"], b"zz"),
    ],
)
def test_malformed_input_exits_2(args: list[str], stdin: bytes) -> None:
    result = run_main(*args, stdin=stdin)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr.decode()
    assert result.stderr.decode().startswith("skippy.codec.wire:")
