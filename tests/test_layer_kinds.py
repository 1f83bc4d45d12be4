# Issue 25's bad-input and memory checks of recurrent and hybrid models (skippy.runtime.layer_kinds).
#
# Strategy: a tiny hybrid is copied with one tensor added or removed (gguf_helpers.copy_gguf: the
# key/value section byte for byte, the other tensors unchanged), so its recurrent tensors no longer match the layer
# kinds its metadata declares; every stage of it, whichever layers it holds, is refused before
# llama.cpp sees it, naming the tensor.  The memory figures are checked against what llama.cpp
# itself keeps: a session's saved state on a stage is its recurrent state per sequence plus, per
# token, a cell's metadata and its KV in the stage's attention layers, so two prompt lengths give
# both the per-cell and the per-sequence figure; ``skippy plan`` and the runtime (GGUFInfo, the
# context's MemoryReport) report the same ones.
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from chain_helpers import ChainModels, InProcessChain
from gguf_helpers import RawTensor, copy_gguf
from stage_helpers import inprocess_chain

from skippy.deploy.plan import ModelShape
from skippy.models import ensure_model, tiny
from skippy.models.spec import LINEAR_ATTENTION_ARCHITECTURES, RWKV_CONV_ARCHITECTURES, SSM_ARCHITECTURES
from skippy.runtime import Model
from skippy.runtime.errors import ModelLoadError
from skippy.runtime.gguf_header import read_layout
from skippy.runtime.model import read_gguf_info

RECURRENT = (*SSM_ARCHITECTURES, *LINEAR_ATTENTION_ARCHITECTURES, *RWKV_CONV_ARCHITECTURES)
#: Bytes llama.cpp's saved sequence state holds per KV cell beside the K and V values.
CELL_METADATA = 12
#: ... and, with M-RoPE, a llama_kv_cell_ext (x, y, token).
CELL_EXT = 12
PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]
Tensors = list[tuple[str, RawTensor]]


def _conv_on_attention_layer(tensors: Tensors) -> Tensors:
    """Layer 2 (attention in the tiny hybrids) also carries layer 1's convolution."""
    conv = dict(tensors)["blk.1.ssm_conv1d.weight"]
    out: Tensors = []
    for name, tensor in tensors:
        out.append((name, tensor))
        if name == "blk.2.attn_norm.weight":
            out.append(("blk.2.ssm_conv1d.weight", conv))
    return out


def _without(name: str) -> Callable[[Tensors], Tensors]:
    return lambda tensors: [(n, t) for n, t in tensors if n != name]


@pytest.mark.parametrize("arch", ["qwen35", pytest.param("nemotron_h", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_conv_on_attention_layer, r"tensor 'blk\.2\.ssm_conv1d\.weight' is a recurrent layer's, but the metadata "
                                   r"declares layer 2 an attention layer"),
        (_without("blk.1.ssm_conv1d.weight"), r"tensor 'blk\.1\.ssm_conv1d\.weight' is missing: the metadata "
                                              r"declares layer 1 recurrent"),
    ],
    ids=["conv-on-attention-layer", "missing-conv"],
)
def test_recurrent_tensors_that_do_not_match_the_declared_layers_are_refused(
        tmp_path: Path, arch: str, edit: Callable[[Tensors], Tensors], message: str) -> None:
    """Every stage refuses, also one that does not hold the layer (llama.cpp alone would load
    [0:2) and [2:4) of the first file, and the whole of it fails without naming the tensor)."""
    bad = copy_gguf(ensure_model(tiny(arch)), tmp_path / f"{arch}-bad.gguf", edit)
    for layers in (None, "0:2", "2:4"):
        with pytest.raises(ModelLoadError, match=message):
            Model(bad, layers)


def test_an_unchanged_copy_loads(tmp_path: Path) -> None:
    """The copy itself is faithful: without an edit it is the source byte for byte, and the file
    loads (so the refusals above are the edits')."""
    source = ensure_model(tiny("qwen35"))
    good = copy_gguf(source, tmp_path / "qwen35-copy.gguf", lambda tensors: tensors)
    assert good.read_bytes() == source.read_bytes()
    with Model(good, "0:2") as model:
        assert model.layers.n_layers == 2


@pytest.mark.parametrize("arch", RECURRENT)
def test_every_tiny_recurrent_model_passes_the_check_and_plan_agrees(arch: str) -> None:
    """No false refusal on any family's own file; the planner's figures are the runtime's."""
    path = ensure_model(tiny(arch))
    info = read_gguf_info(path)
    shape = ModelShape.from_gguf(path)
    assert any(info.state_layer_bytes), arch
    for start, end in ((0, 1), (1, 3), (2, 4), (0, 4)):
        assert info.kv_bytes_per_cell(start, end) == shape.kv_bytes_per_cell(start, end)
        assert info.state_bytes_per_sequence(start, end) == shape.state_bytes_per_sequence(start, end)


def _saved_sizes(path: Path, splits: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Each stage's saved state after 4 and after all of PROMPT, each in fresh contexts (on one load)."""
    sizes = []
    models = ChainModels()
    try:
        for n in (4, len(PROMPT)):
            with models.chain(path, list(splits), threads=1) as chain:
                chain.decode(PROMPT[:n], list(range(n)), [0] * n)
                sizes.append([len(context.save_state(0)) for context in chain.contexts])
    finally:
        models.close()
    return sizes


#: One family per group in the fast suite (delta-net, Mamba-2 hybrid, RWKV, short convolution).
FAST = ("qwen35", "nemotron_h", "rwkv6", "lfm2")


@pytest.mark.parametrize("arch", [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in RECURRENT])
def test_figures_are_what_llama_cpp_keeps(arch: str) -> None:
    """Per stage of a 3-stage split: the saved state grows by a cell's metadata plus the planned
    KV per token, and holds the planned recurrent state (plus a little framing)."""
    path = ensure_model(tiny(arch))
    info = read_gguf_info(path)
    splits = [(0, 1), (1, 3), (3, 4)]
    short, long = _saved_sizes(path, splits)
    tokens = len(PROMPT) - 4
    # a model with attention anywhere keeps a KV cache (cells) on every stage; a pure SSM / RWKV none
    # (M-RoPE cells carry their 2D positions and token too: llama_kv_cell_ext)
    cell = CELL_METADATA if any(info.kv_layer_bytes) or not all(info.state_layer_bytes) else 0
    if cell and read_layout(path).metadata.get(f"{arch}.rope.dimension_sections") is not None:
        cell += CELL_EXT
    for (start, end), small, large in zip(splits, short, long):
        kv, state = info.kv_bytes_per_cell(start, end), info.state_bytes_per_sequence(start, end)
        assert large - small == tokens * (cell + kv), (arch, start, end, kv)
        framing = small - 4 * (cell + kv) - state
        assert 0 <= framing <= 1024, (arch, start, end, state, framing)


def test_memory_report_counts_attention_kv_and_state_per_sequence() -> None:
    """The context's report: KV capacity of the stage's attention layers only, and the state of
    each sequence id it holds."""
    path = ensure_model(tiny("qwen35"))
    info = read_gguf_info(path)
    with InProcessChain(path, [(0, 2), (2, 4)], threads=1, max_sessions=3) as chain:
        first, second = (context.memory() for context in chain.contexts)
        assert first.kv_capacity == 0 and first.state_per_sequence == info.state_bytes_per_sequence(0, 2) > 0
        assert first.state_capacity == 3 * first.state_per_sequence
        assert second.kv_capacity == chain.contexts[1].n_ctx * info.kv_bytes_per_cell(2, 4) > 0


async def test_stage_statistics_report_kv_per_cell_and_state_per_sequence() -> None:
    """The stage's statistics (its stats file) carry the same two figures for its own layers."""
    path = ensure_model(tiny("qwen35"))
    info = read_gguf_info(path)
    async with inprocess_chain(["0:2", "2:4"], model=str(path), ctx_size=256, threads=1) as servers:
        for server, (start, end) in zip(servers, ((0, 2), (2, 4))):
            await server.refresh_runtime_stats()
            assert server.stats.kv_bytes_per_cell == info.kv_bytes_per_cell(start, end)
            assert server.stats.state_bytes_per_sequence == info.state_bytes_per_sequence(start, end)
        assert servers[0].stats.kv_bytes_per_cell == 0 < servers[0].stats.state_bytes_per_sequence
