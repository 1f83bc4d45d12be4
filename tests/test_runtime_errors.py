"""Bad input raises a clear, typed error and leaves the process usable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chain_helpers import InProcessChain
from conftest import PROMPT, model_path
from skippy.runtime import (
    InvalidBatch,
    LayerRange,
    LayerRangeError,
    Model,
    ModelLoadError,
    StageContext,
    UnsupportedArchitecture,
)


@pytest.mark.parametrize(
    ("layers", "message"),
    [("3:2", "empty"), ("0:99", "out of bounds: .* has 4 layers"), ("2:2", "empty"), ("-1:2", "empty or negative"),
     ("1-2", "START:END"), ("a:b", "integers")],
)
def test_bad_layer_ranges(layers: str, message: str) -> None:
    with pytest.raises(LayerRangeError, match=message):
        Model(model_path(), layers)


def test_missing_file(tmp_path: object) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Model("/nonexistent/model.gguf", "0:1")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    from pathlib import Path

    bogus = Path(tmp_path) / "bogus.gguf"
    bogus.write_bytes(b"not a model at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        Model(bogus)


def test_unsupported_architecture_with_partial_range(tmp_path: Path) -> None:
    """A file whose architecture the patch does not cover is refused for a partial range."""
    from pathlib import Path

    gguf = pytest.importorskip("gguf")
    path = Path(tmp_path) / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(4)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitecture, match="'bert' does not support a partial layer range"):
        Model(path, "1:3")


def test_native_loader_refuses_a_bad_range_too() -> None:
    """The patch itself validates the range (defence in depth behind the Python check)."""
    from skippy.runtime import model as model_module

    info = model_module.read_gguf_info(model_path())
    original = model_module.validate_range
    model_module.validate_range = lambda *_: None  # bypass the Python check only
    try:
        with pytest.raises(ModelLoadError, match=r"invalid layer range \[3, 9\)"):
            Model(info.path, LayerRange(3, 9))
    finally:
        model_module.validate_range = original


def test_wrong_input_kinds_and_widths_then_still_usable() -> None:
    with InProcessChain(model_path(), [(0, 2), (2, 4)]) as chain:
        first, second = chain.contexts
        n = len(PROMPT)
        with pytest.raises(InvalidBatch, match="tokens given to a stage starting at layer 2"):
            second.decode(tokens=PROMPT, positions=list(range(n)), seq_ids=[0] * n)
        with pytest.raises(InvalidBatch, match="activations given to the first stage"):
            first.decode(activations=np.zeros((n, 64), np.float32), positions=list(range(n)), seq_ids=[0] * n)
        with pytest.raises(InvalidBatch, match=r"rows x 64 \(the model width\); got shape \(12, 32\)"):
            second.decode(activations=np.zeros((n, 32), np.float32), positions=list(range(n)), seq_ids=[0] * n)
        with pytest.raises(InvalidBatch, match="3 activation rows for 12 positions"):
            second.decode(activations=np.zeros((3, 64), np.float32), positions=list(range(n)), seq_ids=[0] * n)
        with pytest.raises(InvalidBatch, match="token ids must be in 0..31999"):
            first.decode(tokens=[40000], positions=[0], seq_ids=[0])
        with pytest.raises(InvalidBatch, match="exceed the context's batch size"):
            first.decode(tokens=[1] * 65, positions=list(range(65)), seq_ids=[0] * 65)
        with pytest.raises(InvalidBatch, match="sequence ids must be in 0..3"):
            first.decode(tokens=[1], positions=[0], seq_ids=[9])
        with pytest.raises(InvalidBatch, match="not the final stage"):
            first.logits(0)
        # the chain still works
        logits = chain.decode(PROMPT, list(range(n)), [0] * n)
        assert np.isfinite(logits[0]).all()


def test_closed_objects_raise() -> None:
    from skippy.runtime import ClosedError

    model = Model(model_path(), "0:2")
    context = StageContext(model, n_ctx=64, n_batch=16)
    context.close()
    context.close()  # idempotent
    with pytest.raises(ClosedError):
        context.decode(tokens=[1], positions=[0], seq_ids=[0])
    model.close()
    with pytest.raises(ClosedError):
        _ = model.size_bytes
