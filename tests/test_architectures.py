"""Which architectures split, and how the others are refused.

The per-architecture half of the patch, the Python table and docs/architectures.md are generated
from the pinned llama.cpp tree by native/layer_range_gen.py; these tests check that the committed
files are what the generator makes, that the library and the Python table agree, and that every
refusal (architecture, mismatched tensors, truncated file) names what was wrong.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import model_path
from skippy.runtime import LayerRange, Model, ModelLoadError, UnsupportedArchitecture
from skippy.runtime import model as model_module
from skippy.runtime._architectures import REFUSED, SPLIT_ARCHITECTURES, STAGE_TOKEN_EMBEDDINGS, STAGE_TOKEN_IDS

ROOT = Path(__file__).resolve().parent.parent
PRISTINE = ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"


@pytest.mark.slow
def test_generated_files_are_current() -> None:
    if not (PRISTINE / "include" / "llama.h").exists():
        pytest.skip(f"the pinned llama.cpp tree is not extracted at {PRISTINE} (the native build does it)")
    result = subprocess.run(
        [sys.executable, str(ROOT / "native" / "layer_range_gen.py"), "--check", "--source", str(PRISTINE)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr


def test_the_issue_families_split() -> None:
    wanted = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mistral3", "olmo2", "granite", "glm4",
              "qwen2moe", "qwen3moe", "gpt-oss", "glm4moe", "deepseek2"}
    assert wanted <= SPLIT_ARCHITECTURES
    assert not SPLIT_ARCHITECTURES & set(REFUSED)


@pytest.mark.parametrize(
    ("arch", "reason"),
    [("t5", "encoder-decoder"), ("bert", "encoder or embedding model"), ("gemma4-assistant", "draft head"),
     ("eagle3", "draft head"), ("dflash", "draft head"),
     ("pockettts", "not a text-generation model"), ("hrm_text", "hierarchical recurrence"),
     ("llama-embed", "embedding model")],
)
def test_refusal_reasons(arch: str, reason: str) -> None:
    assert reason in REFUSED[arch]


def test_the_layers_reading_token_ids_split_with_the_ids_on_every_stage() -> None:
    # CogVLM picks its weights by the batch's modality (the ids only), Talkie's layers read the
    # input embedding (the ids, embedded on every stage), Granite Switch's router reads the ids
    # (every stage runs it), Qwen4-exp's n-gram input hashes them with the predecessors its cells
    # recorded; patch 0010 reads the same table
    assert {"cogvlm", "talkie", "graniteswitch", "qwen4exp"} <= STAGE_TOKEN_IDS <= SPLIT_ARCHITECTURES
    assert STAGE_TOKEN_EMBEDDINGS == STAGE_TOKEN_IDS & {"talkie"}


def test_library_and_python_table_agree() -> None:
    for name in SPLIT_ARCHITECTURES:
        assert model_module.architecture_refusal(name) is None, name
    for name, reason in REFUSED.items():
        assert model_module.architecture_refusal(name) == reason, name
    assert model_module.architecture_refusal("no-such-arch") == "unknown architecture"


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], *, n_layer: int = 4) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layer)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_refused_architecture_names_the_reason(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bert.gguf", "bert", {"token_embd.weight": np.zeros((8, 64), np.float32)})
    with pytest.raises(UnsupportedArchitecture, match=r"'bert' does not support a partial layer range: encoder or embedding"):
        Model(path, "1:3")


def test_native_loader_names_the_reason_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind the Python check, the patched loader refuses with the same reason."""
    path = _write_gguf(tmp_path / "bert.gguf", "bert", {"token_embd.weight": np.zeros((8, 64), np.float32)})
    monkeypatch.setattr(model_module, "validate_range", lambda *_: None)
    with pytest.raises(ModelLoadError, match="does not support a partial layer range: encoder or embedding"):
        Model(path, LayerRange(1, 3))


@pytest.mark.slow
def test_tensors_that_do_not_match_the_architecture(tmp_path: Path) -> None:
    """A llama-shaped file declared as gemma3 is refused, naming the first missing tensor."""
    source = model_path("llama", "F32", False)
    import gguf

    reader = gguf.GGUFReader(str(source))
    tensors = {t.name: np.array(t.data) for t in reader.tensors if not t.name.startswith("blk.") or t.name.startswith("blk.0.")}
    path = _write_gguf(tmp_path / "fake-gemma3.gguf", "gemma3", tensors, n_layer=1)
    with pytest.raises(ModelLoadError, match=r"tensor|missing|blk\.0"):
        Model(path)


def test_truncated_file(tmp_path: Path) -> None:
    source = model_path("llama", "F32", False)
    truncated = tmp_path / "truncated.gguf"
    with source.open("rb") as src, truncated.open("wb") as out:
        out.write(src.read(source.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match=r"truncated|data is not within the file bounds|file|short"):
        Model(truncated)


def test_docs_table_lists_every_architecture() -> None:
    text = (ROOT / "docs" / "architectures.md").read_text()
    for name in list(SPLIT_ARCHITECTURES) + list(REFUSED):
        assert f"| `{name}` |" in text, name
