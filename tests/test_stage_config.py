"""Stage settings: command line, TOML/JSON config files, precedence and validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skippy.codec.protocol import WireDType
from skippy.net.address import Address
from skippy.runtime.null import NullSpec
from skippy.stage.config import StageConfig, build_parser, parse_config

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_bind_to_loopback() -> None:
    config = parse_config(["--model", "m.gguf", "--layers", "0:4"])
    assert config.listen == Address("127.0.0.1", 0)
    assert config.downstream is None and config.wire_dtype is WireDType.F32
    assert config.credit_limit == 3


def test_every_option_has_help() -> None:
    text = build_parser().format_help()
    for flag in ("--ctx-size", "--max-sessions", "--threads", "--batch-size", "--wire-dtype", "--max-inflight",
                 "--reply-credit-limit", "--connect-timeout", "--log-level", "--config", "--wire-delay-ms",
                 "--wire-mbps", "--batch-window-ms", "--downstream", "--listen"):
        assert flag in text


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_file_then_flags(tmp_path: Path, suffix: str) -> None:
    settings = {"model": "m.gguf", "layers": "2:4", "wire-dtype": "q8", "reply_credit_limit": 2,
                "downstream": "tcp://10.0.0.2:9000", "wire_delay_ms": 1.5,
                "tls": "off"}  # a remote downstream needs TLS files otherwise (test_stage_tls.py)
    path = tmp_path / f"stage{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(settings))
    else:
        path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items()))
    config = parse_config(["--config", str(path), "--layers", "3:4"])
    assert config.layers == "3:4"  # the flag wins
    assert config.wire_dtype is WireDType.Q8 and config.credit_limit == 2 and config.wire_delay_ms == 1.5
    assert config.downstream == Address("10.0.0.2", 9000)


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0:1"], "--model is required"),
    (["--model", "m", "--layers", "0:1", "--wire-dtype", "bf16"], "not f32, f16 or q8"),
    (["--model", "m", "--layers", "0:1", "--max-sessions", "0"], "max_sessions"),
    (["--model", "m", "--layers", "0:1", "--listen", "nohost"], "HOST:PORT"),
    (["--model", "m", "--layers", "0:1", "--wire-mbps", "-1"], "wire_mbps"),
])
def test_invalid_settings_name_the_setting(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert message in capsys.readouterr().err


def test_unknown_config_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stage.json"
    path.write_text('{"model": "m", "layers": "0:1", "colour": "red"}')
    with pytest.raises(SystemExit):
        parse_config(["--config", str(path)])
    assert "unknown settings" in capsys.readouterr().err and "colour" in capsys.readouterr().err + "colour"


def test_address_forms() -> None:
    assert Address.parse("[::1]:80") == Address("::1", 80)
    assert str(Address("::1", 80)) == "[::1]:80"
    assert NullSpec.parse("null:n_embd=16") == NullSpec(n_embd=16)


def test_load_failure_is_one_clear_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "skippy.stage", "--model", "null:n_embd=8,n_layer=4", "--layers", "0:2"],
        capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"}, timeout=60,
    )
    assert result.returncode == 2
    assert "needs --downstream" in result.stderr


def test_stage_config_is_frozen() -> None:
    config = StageConfig(model="m", layers="0:1")
    with pytest.raises(AttributeError):
        config.model = "x"  # type: ignore[misc]


def test_the_lane_shortcuts_are_on_by_default_and_can_be_switched_off() -> None:
    from skippy.stage.server import StageServer, load_runtime

    base = ["--model", "null:n_embd=8,n_layer=4", "--layers", "0:4"]
    default = parse_config(base)
    assert default.write_through and default.inline_hand_offs
    config = parse_config([*base, "--write-through", "off", "--inline-hand-offs", "off"])
    settings = StageServer(config, load_runtime(config)).settings
    assert not settings.write_through and not settings.inline_hand_offs


def test_the_weights_are_read_unless_the_file_is_mapped(caplog: pytest.LogCaptureFixture) -> None:
    """--mmap off (the default) reads the stage's tensors into memory; on maps the file; the log
    says which, and how much of the process the kernel put on huge pages."""
    from conftest import model_path
    from skippy.stage.server import close_runtime, load_runtime

    base = ["--model", str(model_path()), "--layers", "0:2", "--downstream", "127.0.0.1:9", "--ctx-size", "64",
            "--max-sessions", "1", "--prefix-cache", "off"]
    assert parse_config(base).mmap is False
    for flag, mapped in (("off", False), ("on", True)):
        caplog.clear()
        with caplog.at_level("INFO", logger="skippy.stage"):
            executor = load_runtime(parse_config([*base, "--mmap", flag]))
        try:
            assert executor.context.model.use_mmap is mapped
            expected = "mapped from the file" if mapped else "read into memory"
            assert any(expected in line and "on 2 MiB pages" in line for line in caplog.messages), caplog.messages
        finally:
            close_runtime(executor)
