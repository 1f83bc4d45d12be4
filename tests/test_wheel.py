"""The wheel is self-contained: it installs into a fresh virtualenv and runs a split exactly.

Builds the wheel from this tree (reusing the native build directory), installs it with its
dependencies into a new virtualenv, and runs a smoke script from outside the source tree: load a
generated model split in two and compare its logits with the unsplit model's, then serve it with
``skippy up`` (2 stages) and check 100 seeded ``json_schema`` answers against their schema with
``jsonschema`` (a runtime dependency), with no llama-cpp-python in the venv.  The sdist (what a
CUDA host builds its wheel from) carries every source the build needs and no build output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SMOKE = r"""
import numpy as np, skippy, sys
assert "site-packages" in skippy.__file__, skippy.__file__
from skippy.models.spec import tiny
from skippy.models.cache import ensure_model
from skippy.runtime.local import LocalChain
path = ensure_model(tiny("qwen3"))
prompt = [1, 15043, 3186, 29892, 920]
def run(split):
    with LocalChain(path, split, n_ctx=128, max_sessions=1, n_batch=16, threads=2) as chain:
        chain.decode(prompt, list(range(5)), [0] * 5, [True] * 5)
        return np.stack(chain.logits())
assert np.array_equal(run([(0, 2), (2, 4)]), run([(0, 4)]))
# JSON Schema response formats need no llama-cpp-python (skippy ships the converter)
import importlib.util
assert importlib.util.find_spec("llama_cpp") is None
from skippy.api.structured import parse_constraints
from skippy.runtime.tokenizer import Tokenizer
schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
with Tokenizer(path) as tokenizer:
    for form in ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                 {"type": "json_object", "schema": schema}):
        assert "ok" in parse_constraints({"response_format": form}, True, tokenizer).grammar
import importlib.resources
static = importlib.resources.files("skippy.api") / "static"  # the page at GET /
assert all((static / name).is_file() for name in ("index.html", "app.js", "style.css", "favicon.svg"))
# json_schema answers validate against the schema: 100 seeded samples through `skippy up` (2 stages)
import json, re, subprocess, urllib.request
import jsonschema
answer_schema = {"type": "object", "properties": {  # keywords the converter enforces (docs/structured-output.md)
    "ok": {"type": "boolean"}, "n": {"type": "integer"}, "tag": {"enum": ["red", "green"]},
    "name": {"type": "string", "maxLength": 8}, "list": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
    "required": ["ok", "n", "name"], "additionalProperties": False}
up = subprocess.Popen([sys.executable, "-m", "skippy", "up", "--model", str(path), "--stages", "2", "--port", "0",
                       "--threads", "1", "--ctx-size", "512"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
try:
    url = None
    for line in up.stdout:
        found = re.search(r"skippy API(?: for \S+)? on (http://\S+)", line)
        if found:
            url = found.group(1)
            break
    assert url, "skippy up printed no URL"
    samples = 0
    for seed in range(0, 100, 5):
        body = {"model": json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"], "max_tokens": 96,
                "messages": [{"role": "user", "content": "Give me a JSON answer."}], "temperature": 1.0,
                "seed": seed, "n": 5, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "answer", "strict": True, "schema": answer_schema}}}
        request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        for choice in json.load(urllib.request.urlopen(request, timeout=600))["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), answer_schema)
            samples += 1
    assert samples == 100, samples
finally:
    up.terminate()
    up.wait(60)
print("wheel smoke ok")
"""


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_tree(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # no PYTHONPATH: a source tree on it would make pip think skippy is already installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SKIPPY_VOCAB_DIR")}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(ROOT)],
                   check=True, env=env, timeout=1800)
    (wheel,) = dist.glob("skippy_llm-*.whl")
    # auditwheel finds a manylinux tag for it (make wheel repairs to it; README: Wheels)
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True,
                           check=True, timeout=600).stdout
    assert "manylinux_" in shown, shown
    target = tmp_path / "venv"
    venv.create(target, with_pip=True)
    python = target / "bin" / "python"
    # the runtime's dependencies compile nothing: no compiler is allowed for the install
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], check=True,
                   env=dict(env, CC="false", CXX="false"), timeout=1800)
    clean_env = dict(env, SKIPPY_MODEL_CACHE=str(tmp_path / "models"))
    result = subprocess.run([str(python), "-c", SMOKE], cwd=tmp_path, env=clean_env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "wheel smoke ok" in result.stdout
    # the install has no llama-cpp-python: JSON formats above ran without it
    missing = subprocess.run([str(python), "-c", "import llama_cpp"], cwd=tmp_path, env=clean_env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "No module named 'llama_cpp'" in missing.stderr, missing.stderr


@pytest.mark.slow
def test_sdist_carries_the_build_sources_and_no_build_output(tmp_path: Path) -> None:
    import tarfile

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
                   check=True, env=env, timeout=1800, capture_output=True)
    (sdist,) = tmp_path.glob("skippy_llm-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = {str(path.relative_to(ROOT)) for pattern in ("skippy/**/*.pyx", "skippy/**/*.pxd", "skippy/**/*.pxi",
                                                          "skippy/**/*.h", "native/*.py", "native/patches/*",
                                                          "native/cdef/*", "skippy/api/static/*")
              for path in ROOT.glob(pattern)}
    assert {"skippy/codec/_wire.pyx", "native/build.py", "native/patches/0001-layer-range-execution.patch"} <= needed
    assert needed <= names, f"missing from the sdist: {sorted(needed - names)}"
    outputs = [name for name in names if name.endswith(".so") or name.endswith(".gguf")
               or name in ("skippy/_native_stamp.py", "skippy/codec/_wire.c", "skippy/cache/_radix.c")]
    assert outputs == [], f"build outputs in the sdist: {outputs}"
