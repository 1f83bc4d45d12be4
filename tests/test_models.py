# Tests of the synthetic model generator (skippy.models).
#
# Strategy: every arch x dtype x head combination of the tiny shape is written once into a
# session-wide cache directory and read back with the tests' GGUF parser (gguf_helpers) to check
# keys, tensor names, shapes, types and order, and with gguf's own GGUFReader (seconds per file on
# a 32000-token vocabulary) for the tokenizer copy; both are independent of our writer.
# Determinism, dtype consistency (F16/Q8_0 are roundings of the F32 draw), the cache and the CLI
# are tested directly. Whether llama.cpp accepts the files is checked in a subprocess (the
# library path must be set before `import llama_cpp`, and a native crash must not take pytest
# down) against the library the project installs in skippy/lib; that test skips when it is absent.
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

from gguf_helpers import parse_gguf
from skippy.models import (
    PRESETS,
    ModelSpec,
    VocabName,
    VocabNotFoundError,
    ensure_model,
    plan_tensors,
    preset,
    read_tokenizer,
    tiny,
    vocab_path,
    write_model,
)
from skippy.models.__main__ import main as cli_main
from skippy.models.cache import CACHE_ENV, cache_dir, cached_path
from skippy.models.synthetic import SPEC_KEY
from skippy.models.vocab_files import VOCAB_DIR_ENV, _parse_kv

REPO_ROOT = Path(__file__).resolve().parents[1]
LIB_DIR = REPO_ROOT / "skippy" / "lib"

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("F32", "F16", "Q8_0")
QTYPES = {
    "F32": GGMLQuantizationType.F32,
    "F16": GGMLQuantizationType.F16,
    "Q8_0": GGMLQuantizationType.Q8_0,
}


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache directory shared by this module's tests (tiny models are written once).

    Module scope, not session: the redirected cache must end with this module. As a session
    fixture its ``CACHE_ENV`` stayed set for every later test file, which then regenerated
    each model they used into the empty temporary cache instead of the persistent one (about
    15 s of the fast suite)."""
    directory = tmp_path_factory.mktemp("model-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(directory))
        yield directory


def field_value(reader: GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    assert field is not None, f"missing key {key}"
    return field.contents()


def expected_tensors(spec: ModelSpec, n_vocab: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (ggml ne shape, type name), written out independently of plan_tensors."""
    matrix = spec.dtype
    head = spec.n_embd_head
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "token_embd.weight": ((spec.n_embd, n_vocab), matrix),
        "output_norm.weight": ((spec.n_embd,), "F32"),
    }
    if not spec.tied:
        out["output.weight"] = ((spec.n_embd, n_vocab), matrix)
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        out[f"{b}.attn_norm.weight"] = ((spec.n_embd,), "F32")
        out[f"{b}.attn_q.weight"] = ((spec.n_embd, spec.n_head * head), matrix)
        out[f"{b}.attn_k.weight"] = ((spec.n_embd, spec.n_head_kv * head), matrix)
        out[f"{b}.attn_v.weight"] = ((spec.n_embd, spec.n_head_kv * head), matrix)
        out[f"{b}.attn_output.weight"] = ((spec.n_head * head, spec.n_embd), matrix)
        out[f"{b}.ffn_norm.weight"] = ((spec.n_embd,), "F32")
        out[f"{b}.ffn_gate.weight"] = ((spec.n_embd, spec.n_ff), matrix)
        out[f"{b}.ffn_up.weight"] = ((spec.n_embd, spec.n_ff), matrix)
        out[f"{b}.ffn_down.weight"] = ((spec.n_ff, spec.n_embd), matrix)
        if spec.arch == "qwen2":
            out[f"{b}.attn_q.bias"] = ((spec.n_head * head,), "F32")
            out[f"{b}.attn_k.bias"] = ((spec.n_head_kv * head,), "F32")
            out[f"{b}.attn_v.bias"] = ((spec.n_head_kv * head,), "F32")
        if spec.arch == "qwen3":
            out[f"{b}.attn_q_norm.weight"] = ((head,), "F32")
            out[f"{b}.attn_k_norm.weight"] = ((head,), "F32")
    return out


def tensor_array(reader: GGUFReader, name: str) -> np.ndarray:
    tensor = next(t for t in reader.tensors if t.name == name)
    return np.asarray(tensor.data)


#: The fast suite's share of the matrix (one file; the rest is slow).
FAST_FILES = {("llama", "F32", False)}
FILE_CASES = [
    pytest.param(arch, dtype, tied, id=f"{arch}-{dtype}-{'tied' if tied else 'untied'}",
                 marks=() if (arch, dtype, tied) in FAST_FILES else pytest.mark.slow)
    for arch in ARCHS for dtype in DTYPES for tied in (False, True)
]


@pytest.mark.parametrize("arch, dtype, tied", FILE_CASES)
def test_generated_file_has_expected_keys_and_tensors(
    model_cache: Path, arch: str, dtype: str, tied: bool
) -> None:
    spec = tiny(arch, dtype=dtype, tied=tied)  # type: ignore[arg-type]
    path = ensure_model(spec)
    assert path.parent == model_cache
    parsed = parse_gguf(path)  # the tests' own parser: gguf's reader takes a second on the vocabulary

    def field(key: str) -> object:
        assert key in parsed.fields, f"missing key {key}"
        return parsed.fields[key]

    assert field("general.architecture") == arch
    assert field("general.file_type") == {"F32": 0, "F16": 1, "Q8_0": 7}[dtype]
    hparams = {
        "block_count": spec.n_layer,
        "context_length": spec.context_length,
        "embedding_length": spec.n_embd,
        "feed_forward_length": spec.n_ff,
        "attention.head_count": spec.n_head,
        "attention.head_count_kv": spec.n_head_kv,
        "attention.key_length": spec.n_embd_head,
        "attention.value_length": spec.n_embd_head,
        "rope.dimension_count": spec.n_embd_head,
        "vocab_size": 32000,
    }
    for key, value in hparams.items():
        assert field(f"{arch}.{key}") == value, key
    assert field(f"{arch}.rope.freq_base") == pytest.approx(spec.rope_theta)
    assert field(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(spec.rms_eps)
    stored_spec = json.loads(str(field(SPEC_KEY)))
    assert stored_spec["arch"] == arch and stored_spec["dtype"] == dtype
    assert field("tokenizer.ggml.tokens") == 32000  # an array: its length

    expected = expected_tensors(spec, 32000)
    actual = {name: (ne, kind) for name, (ne, kind, _) in parsed.tensors.items()}
    assert actual == expected

    names = list(parsed.tensors)
    assert names[0] == "token_embd.weight"
    assert names[-1] == ("output_norm.weight" if tied else "output.weight")
    block_of = [int(n.split(".")[1]) for n in names if n.startswith("blk.")]
    assert block_of == sorted(block_of), "blocks must be stored in layer order"


@pytest.mark.slow
def test_tokenizer_is_copied_verbatim(tmp_path: Path) -> None:
    # gguf's own reader on both files, for the 32000-token SPM vocab (it takes seconds per file
    # on the 150k-token BPE vocabs, which the next test covers with our parser).
    spec = dataclasses.replace(tiny("qwen2"), n_layer=1, n_embd=32, dtype="F16")
    path = write_model(spec, tmp_path / "model.gguf")
    source = GGUFReader(vocab_path("llama-spm"))
    written = GGUFReader(path)
    source_keys = [k for k in source.fields if k.startswith("tokenizer.")]
    written_keys = [k for k in written.fields if k.startswith("tokenizer.")]
    assert written_keys == source_keys
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.pre"} <= set(
        source_keys
    )
    for key in source_keys:
        a, b = source.fields[key], written.fields[key]
        assert [t.name for t in a.types] == [t.name for t in b.types], key
        assert a.contents() == b.contents(), key
    # Our fast parser agrees with gguf's reader on the source file.
    ours = {f.key: f for f in read_tokenizer("llama-spm").fields}
    assert list(ours) == source_keys
    for key in source_keys:
        expected = source.fields[key].contents()
        value = ours[key].value
        if isinstance(value, list):
            value = [v.decode("utf-8") if isinstance(v, bytes) else v for v in value]
        elif isinstance(value, bytes):
            value = value.decode("utf-8")
        assert value == expected, key


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["llama-bpe", "qwen2"])
def test_bpe_tokenizer_is_copied_verbatim(tmp_path: Path, vocab: VocabName) -> None:
    spec = dataclasses.replace(tiny("qwen3"), vocab=vocab, n_layer=1, n_embd=32, dtype="F16")
    path = write_model(spec, tmp_path / "model.gguf")
    source = read_tokenizer(vocab)
    written = {f.key: f for f in _parse_kv(path.read_bytes(), str(path))}
    assert "tokenizer.ggml.merges" in {f.key for f in source.fields}
    for field in source.fields:
        assert written[field.key] == field, field.key
    assert written["qwen3.vocab_size"].value == source.n_vocab
    if vocab == "qwen2":
        assert b"<|im_start|>" in written["tokenizer.chat_template"].value  # type: ignore[operator]


@pytest.mark.slow
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    spec = tiny("qwen3", dtype="Q8_0", n_layer=2)
    first = write_model(spec, tmp_path / "a.gguf").read_bytes()
    second = write_model(spec, tmp_path / "b.gguf").read_bytes()
    other = write_model(dataclasses.replace(spec, seed=1), tmp_path / "c.gguf").read_bytes()
    assert first == second
    assert len(other) == len(first) and other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]


@pytest.mark.slow
def test_lower_precision_files_round_the_same_weights(model_cache: Path) -> None:
    del model_cache
    readers = {dtype: GGUFReader(ensure_model(tiny("llama", dtype=dtype))) for dtype in DTYPES}  # type: ignore[arg-type]
    for name in ("token_embd.weight", "blk.2.ffn_down.weight", "output.weight"):
        full = tensor_array(readers["F32"], name).astype(np.float32)
        half = tensor_array(readers["F16"], name)
        assert half.dtype == np.float16
        np.testing.assert_array_equal(half, full.astype(np.float16))
        q8 = tensor_array(readers["Q8_0"], name)
        np.testing.assert_array_equal(q8, quants.quantize(full, GGMLQuantizationType.Q8_0))
    norm = tensor_array(readers["F32"], "blk.1.attn_norm.weight")
    np.testing.assert_array_equal(norm, tensor_array(readers["Q8_0"], "blk.1.attn_norm.weight"))


@pytest.mark.slow
def test_weight_scales(model_cache: Path) -> None:
    del model_cache
    spec = tiny("qwen2", dtype="F32", n_embd=128)
    reader = GGUFReader(ensure_model(spec))
    embedding = tensor_array(reader, "token_embd.weight")
    assert embedding.std() == pytest.approx(1 / np.sqrt(spec.n_embd), rel=0.05)
    down = tensor_array(reader, "blk.0.ffn_down.weight")
    assert down.std() == pytest.approx(1 / np.sqrt(spec.n_ff), rel=0.05)
    for i in range(spec.n_layer):
        norm = tensor_array(reader, f"blk.{i}.ffn_norm.weight")
        assert 0.5 < norm.min() and norm.max() < 1.5 and norm.std() > 0.1
    bias = tensor_array(reader, "blk.0.attn_k.bias")
    assert 0.0 < bias.std() < 0.3
    # Different layers get different weights.
    assert not np.array_equal(
        tensor_array(reader, "blk.0.attn_q.weight"), tensor_array(reader, "blk.1.attn_q.weight")
    )


def test_cache_writes_once_and_keys_by_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    spec = tiny("llama", dtype="F16", n_layer=1)
    path = ensure_model(spec)
    assert path == cached_path(spec) and path.parent == tmp_path / "cache"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**9))
    before = path.stat().st_mtime_ns
    assert ensure_model(spec) == path
    assert path.stat().st_mtime_ns == before, "a cached model must not be rewritten"
    other = ensure_model(dataclasses.replace(spec, seed=7))
    assert other != path
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [path.name, other.name]
    ), "no temporary files may be left behind"


def test_default_cache_dir_is_outside_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    directory = cache_dir()
    assert directory == Path.home() / ".cache" / "skippy" / "models"
    assert REPO_ROOT not in directory.parents


def test_missing_vocab_names_file_and_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VOCAB_DIR_ENV, str(tmp_path))
    with pytest.raises(VocabNotFoundError) as info:
        vocab_path("no-such-vocab")  # type: ignore[arg-type]
    message = str(info.value)
    assert "ggml-vocab-no-such-vocab.gguf" in message
    assert str(tmp_path) in message and "skippy/models/vocab" in message


def test_vocab_dir_env_takes_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = vocab_path("llama-spm")
    (tmp_path / source.name).write_bytes(source.read_bytes())
    monkeypatch.setenv(VOCAB_DIR_ENV, str(tmp_path))
    assert vocab_path("llama-spm") == tmp_path / source.name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"arch": "gptj"}, "arch"),  # llama.cpp has no model class for it
        ({"n_head": 3}, "n_head_kv"),
        ({"arch": "qwen2", "head_dim": 32}, "qwen2 needs"),
        ({"dtype": "Q8_0", "n_embd": 48, "n_ff": 96}, "Q8_0"),
        ({"n_layer": 0}, "n_layer"),
        ({"head_dim": 15}, "even"),
    ],
)
def test_invalid_specs_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tiny("llama"), **overrides)  # type: ignore[arg-type]


def test_presets_have_the_published_shapes() -> None:
    for name in PRESETS:
        assert isinstance(preset(name), ModelSpec)
    qwen3 = preset("qwen3-0.6b")
    assert (qwen3.arch, qwen3.n_layer, qwen3.n_embd, qwen3.n_ff) == ("qwen3", 28, 1024, 3072)
    assert (qwen3.n_head, qwen3.n_head_kv, qwen3.n_embd_head, qwen3.tied) == (16, 8, 128, True)
    params = sum(p.n_values for p in plan_tensors(qwen3, 151936))
    assert params == pytest.approx(596e6, rel=0.01)  # Qwen3-0.6B: 0.6B incl. embedding
    llama = preset("llama-3.2-1b")
    assert (llama.arch, llama.n_layer, llama.n_embd, llama.n_ff) == ("llama", 16, 2048, 8192)
    assert (llama.n_head, llama.n_head_kv, llama.vocab, llama.tied) == (32, 8, "llama-bpe", True)
    params = sum(p.n_values for p in plan_tensors(llama, 128256))
    assert params == pytest.approx(1.236e9, rel=0.01)  # Llama-3.2-1B: 1.24B
    memory = preset("llama-16x1024", tied=True, dtype="Q8_0")
    assert (memory.n_layer, memory.n_embd, memory.tied, memory.dtype) == (16, 1024, True, "Q8_0")
    with pytest.raises(KeyError, match="known"):
        preset("gpt-5")


@pytest.mark.slow
def test_cli_writes_to_out_and_to_cache(
    model_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.gguf"
    argv = ["--arch", "qwen3", "--layers", "2", "--embd", "64", "--head-dim", "16"]
    assert cli_main([*argv, "--dtype", "F16", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    reader = GGUFReader(out)
    assert field_value(reader, "qwen3.block_count") == 2
    assert field_value(reader, "qwen3.attention.key_length") == 16

    assert cli_main(["tiny-llama", "--tied", "--quiet"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed.parent == model_cache
    assert printed == cached_path(tiny("llama", tied=True))

    with pytest.raises(SystemExit):
        cli_main(["--arch", "qwen2", "--head-dim", "8", "--quiet"])
    assert "qwen2 needs" in capsys.readouterr().err


_LLAMA_CHECK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from llama_cpp import Llama

    results = []
    for path in sys.argv[1:]:
        model = Llama(model_path=path, n_ctx=64, n_threads=2, logits_all=True, verbose=False)
        tokens = model.tokenize(b"Hello, world! The quick brown fox")
        model.eval(tokens)
        logits = np.array(model.scores[: len(tokens)])
        generated = model.generate(tokens, temp=0.0)
        new = [next(generated) for _ in range(4)]
        results.append({
            "n_vocab": model.n_vocab(),
            "finite": bool(np.isfinite(logits).all()),
            "spread": float(logits.std(axis=1).min()),
            "distinct_rows": len({row.tobytes() for row in logits}),
            "rows": len(tokens),
            "new_tokens": len(new),
        })
        del model
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_llama_cpp_loads_and_runs_every_arch(model_cache: Path) -> None:
    if not (LIB_DIR / "libllama.so").is_file():
        pytest.skip(f"no libllama.so in {LIB_DIR}: the native build has not installed it yet")
    specs = [
        tiny(arch, dtype=dtype, tied=tied)  # type: ignore[arg-type]
        for arch in ARCHS
        for dtype, tied in (("F32", False), ("F16", True), ("Q8_0", False))
    ]
    paths = [str(ensure_model(spec)) for spec in specs]
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(LIB_DIR)}
    completed = subprocess.run(
        [sys.executable, "-c", _LLAMA_CHECK, *paths],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    for spec, result in zip(specs, results, strict=True):
        label = spec.short_name()
        assert result["n_vocab"] == 32000, label
        assert result["finite"], label
        assert result["spread"] > 0.1, f"{label}: logits nearly constant"
        assert result["distinct_rows"] == result["rows"], label
        assert result["new_tokens"] == 4, label
    del model_cache
