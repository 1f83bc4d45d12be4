"""Issue 26: per-layer token embeddings (Gemma 4) and cuts that keep a KV-sharing group whole.

The legal-cut computation (skippy.runtime.cuts) is checked on hparams alone; then a 6-layer
Gemma 4 whose last two layers reuse the KV of layers 2 (sliding-window) and 3 (global) splits
bitwise at its legal cuts (1 and 2) and refuses the others, in Python (naming the nearest legal
cuts) and, with the Python check bypassed, in the patched loader.  A later stage of a model with
per-layer token embeddings refuses a batch without token ids, in Python and natively.
The bitwise splits at the exactness suite's cuts (no KV sharing) are in test_arch_exactness.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from chain_helpers import InProcessChain, greedy_run
from skippy.models import ensure_model, tiny
from skippy.runtime import InvalidBatch, LayerRange, Model, StageContext
from skippy.runtime.cuts import KvGroup, cut_refusal, kv_groups, legal_cuts, snap_cuts
from skippy.runtime.errors import LayerRangeError, ModelLoadError
from test_arch_exactness import LONG_PROMPT

THREADS = 1
N_LAYER = 6


# --- the cut computation --------------------------------------------------------------------


def gemma4_meta(shared: int, pattern: tuple[bool, ...]) -> dict[str, object]:
    return {"gemma4.attention.shared_kv_layers": shared, "gemma4.attention.sliding_window_pattern": pattern}


def test_gemma4_group_runs_from_the_first_layer_read_to_the_end() -> None:
    # E2B's layout: 35 layers, the last 20 reuse layers 13 (local) and 14 (global)
    pattern = tuple((il + 1) % 5 != 0 for il in range(35))
    groups = kv_groups("gemma4", 35, gemma4_meta(20, pattern))
    assert groups == (KvGroup(13, 35, 15),)
    assert legal_cuts(35, groups) == list(range(1, 14))


def test_only_global_readers_start_the_group_one_later() -> None:
    # every shared layer is global: they all read layer kv_layers - 1
    pattern = (True, True, False, False, False, False)
    assert kv_groups("gemma4", 6, gemma4_meta(2, pattern)) == (KvGroup(3, 6, 4),)


def test_models_without_sharing_have_no_groups() -> None:
    assert kv_groups("gemma4", 4, gemma4_meta(0, (True, False) * 2)) == ()
    assert kv_groups("gemma4", 4, {}) == ()
    assert kv_groups("llama", 32, {}) == ()
    assert legal_cuts(4, ()) == [1, 2, 3]


def test_gemma3n_uses_its_fixed_kv_layer_count_and_default_pattern() -> None:
    # 30 layers, KV from the first 20, default period 5: layer 18 local, 19 global
    assert kv_groups("gemma3n", 30, {}) == (KvGroup(18, 30, 20),)


def test_malformed_sharing_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding-window pattern"):
        kv_groups("gemma4", 6, {"gemma4.attention.shared_kv_layers": 2})
    with pytest.raises(ValueError, match="at least 2"):
        kv_groups("gemma4", 6, gemma4_meta(5, (True,) * 6))
    with pytest.raises(ValueError, match="not a count"):
        kv_groups("gemma4", 6, gemma4_meta(-1, (True,) * 6))


def test_refusal_names_the_nearest_legal_cuts() -> None:
    groups = (KvGroup(13, 35, 15),)
    assert cut_refusal(35, groups, 13) is None
    assert cut_refusal(35, groups, 35) is None  # the model's end is no cut
    message = cut_refusal(35, groups, 20)
    assert message is not None and "nearest legal cuts are 13" in message and "share KV" in message
    whole = (KvGroup(0, 4, 2),)
    assert "no cut is legal" in (cut_refusal(4, whole, 2) or "")


def test_snap_moves_each_cut_to_a_legal_one() -> None:
    groups = (KvGroup(13, 35, 15),)
    assert snap_cuts(35, groups, [12, 23]) == [12, 13]
    assert snap_cuts(35, groups, [8, 17]) == [8, 13]
    assert snap_cuts(35, (), [12, 23]) == [12, 23]
    # 3 stages of the 6-layer model below: only cuts 1 and 2 are legal
    assert snap_cuts(6, (KvGroup(2, 6, 4),), [2, 4]) == [1, 2]
    assert snap_cuts(35, groups, [9, 18, 26]) == [9, 12, 13]
    with pytest.raises(ValueError, match="4 stages need 3 legal cuts; the model allows only \\[1, 2\\]"):
        snap_cuts(6, (KvGroup(2, 6, 4),), [2, 3, 5])


# --- a Gemma 4 with KV sharing ----------------------------------------------------------------


def shared_spec(dtype: str = "F32") -> object:
    """6 layers (local, global, ...), the last 2 reuse the KV of layers 2 and 3: group [2, 6)."""
    return dataclasses.replace(tiny("gemma4", dtype=dtype, n_layer=N_LAYER), n_kv_shared_layers=2)  # type: ignore[arg-type]


def shared_model(dtype: str = "F32") -> Path:
    return ensure_model(shared_spec(dtype))  # type: ignore[arg-type]


def run(path: Path, split: list[tuple[int, int]]) -> tuple[list[np.ndarray], list[int]]:
    with InProcessChain(path, split, threads=THREADS) as chain:
        return greedy_run(chain, LONG_PROMPT, steps=16)


@pytest.mark.parametrize("dtype", ["F32", pytest.param("Q8_0", marks=pytest.mark.slow)])
def test_kv_sharing_model_splits_exactly_at_its_legal_cuts(dtype: str) -> None:
    path = shared_model(dtype)
    expected, expected_tokens = run(path, [(0, N_LAYER)])
    assert float(np.std(expected[-1])) > 0.02
    for split in ([(0, 2), (2, N_LAYER)], [(0, 1), (1, 2), (2, N_LAYER)]):
        logits, tokens = run(path, split)
        assert tokens == expected_tokens, split
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: max diff {np.abs(got - want).max()}"


def test_the_shared_layers_read_other_layers_kv() -> None:
    """Control: the same weights without sharing (the last two layers compute their own K/V
    from weights the shared file lacks) is another model; the sharing is in effect."""
    own = dataclasses.replace(shared_spec(), n_kv_shared_layers=0)  # type: ignore[type-var]
    shared_logits, _ = run(shared_model(), [(0, N_LAYER)])
    own_logits, _ = run(ensure_model(own), [(0, N_LAYER)])  # type: ignore[arg-type]
    assert not np.array_equal(shared_logits[-1], own_logits[-1])


@pytest.mark.parametrize("layers", ["0:3", "3:6", "2:4", "4:6", "1:5"])
def test_a_range_cutting_the_group_is_refused_naming_the_legal_cuts(layers: str) -> None:
    with pytest.raises(LayerRangeError, match=r"share KV .*nearest legal cuts are 2"):
        Model(shared_model(), layers)


def test_the_loader_refuses_a_cut_group_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import skippy.runtime.model as model_module

    monkeypatch.setattr(model_module, "cut_refusal", lambda *args: None)
    with pytest.raises(ModelLoadError, match=r"cuts the KV-sharing group \[2, 6\).*cut at layer 2 or before"):
        Model(shared_model(), "3:6")


# --- token ids on every stage -----------------------------------------------------------------


def test_a_later_stage_needs_the_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_model(tiny("gemma4"))
    with Model(path, LayerRange(2, 4)) as model, StageContext(model, n_ctx=64, max_sessions=1, n_batch=8, threads=1) as ctx:
        assert model.reads_tokens
        hidden = np.zeros((2, model.n_embd), dtype=np.float32)
        with pytest.raises(InvalidBatch, match="needs the token ids beside the activations"):
            ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden)
        with pytest.raises(InvalidBatch, match="needs the token ids beside the activations"):
            ctx.decode(positions=[0, 1], seq_ids=[0, 0], tokens=[1, 2])
        # the patched library refuses it as well
        monkeypatch.setattr(ctx, "_reads_tokens", False)  # the context reads it once, at creation
        with pytest.raises(InvalidBatch, match="per-layer token embeddings needs the token ids"):
            ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden)
        monkeypatch.undo()
        ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden, tokens=[1, 2])


def test_every_stage_holds_the_token_embeddings_and_maps_the_per_layer_table() -> None:
    """A later stage loads the token embeddings and the per-layer projection (counted in its
    weights); the per-layer token table is mapped and read by rows on demand, not loaded whole."""
    path = ensure_model(tiny("gemma4"))
    spec = tiny("gemma4")
    n_vocab = 32000
    token_embd = n_vocab * spec.n_embd * 4
    table = n_vocab * spec.n_embd_per_layer * spec.n_layer * 4
    projection = spec.n_embd_per_layer * spec.n_layer * spec.n_embd * 4
    with Model(path, "2:3") as middle:
        size = middle.size_bytes
    assert token_embd + projection < size < token_embd + projection + table


# --- through skippy up ------------------------------------------------------------------------


def up_completion(tmp_path: Path, path: Path, layers: str) -> str:
    from api_helpers import UpProcess

    directory = tmp_path / layers.replace(":", "_").replace(",", "-")
    directory.mkdir()
    process = UpProcess(["up", "--model", str(path), "--layers", layers, "--port", "0", "--ctx-size", "256",
                         "--threads", "1", "--log-dir", str(directory / "logs")], directory)
    process.start()
    try:
        import httpx

        model = httpx.get(process.url + "/v1/models").json()["data"][0]["id"]
        response = httpx.post(process.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "Once upon a time, in a land far away,", "max_tokens": 24,
            "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] >= 8
        return str(body["choices"][0]["text"])
    finally:
        process.stop()


@pytest.mark.slow
def test_gemma4_split_in_three_through_up_gives_the_unsplit_text(tmp_path: Path) -> None:
    """Three stage processes (frames carry the token ids to the later stages) give the unsplit
    greedy text through the API, prefill and decode."""
    path = ensure_model(tiny("gemma4"))
    whole = up_completion(tmp_path, path, "0:4")
    assert whole.strip()
    assert up_completion(tmp_path, path, "0:1,1:3,3:4") == whole


def test_a_stage_refuses_a_message_without_token_ids() -> None:
    """The stage executor refuses (InvalidMessage, naming why) a later-stage message whose frame
    carried no token ids, before anything reaches the runtime; with them the row runs."""
    from skippy.lane.errors import InvalidMessage
    from skippy.stage.executor import Executor, WorkItem

    path = ensure_model(tiny("gemma4"))
    with Model(path, "2:4") as model, StageContext(model, n_ctx=64, max_sessions=1, n_batch=8, threads=1) as ctx:
        executor = Executor(ctx)
        assert executor.reads_tokens
        hidden = np.full((1, model.n_embd), 0.5, dtype=np.float32)
        item = WorkItem(session=7, positions=np.zeros(1, dtype=np.int32), activations=hidden)
        with pytest.raises(InvalidMessage, match="read the token ids .* 1 rows came with 0 token ids"):
            executor.run_item(item)
        item.tokens = np.asarray([5], dtype=np.int32)
        result = executor.run_item(item)
        assert len(result.tokens) == 1


def test_even_split_plan_and_up_keep_to_the_legal_cuts(tmp_path: Path) -> None:
    """``--stages N`` (even_split), ``--layers`` (check_split) and ``skippy plan`` cut the KV-sharing
    model only at layers 1 and 2."""
    from skippy.runtime.local import check_split, even_split
    from skippy.deploy.plan import HostSpec, ModelShape, PlanError, PlanSettings, plan_chain
    from skippy.runtime import read_gguf_info

    path = shared_model()
    info = read_gguf_info(path)
    assert info.kv_groups == (KvGroup(2, 6, 4),) and info.reads_tokens
    assert even_split(6, 2, info.kv_groups) == [(0, 2), (2, 6)]
    assert even_split(6, 3, info.kv_groups) == [(0, 1), (1, 2), (2, 6)]
    assert even_split(6, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="nearest legal cuts are 2"):
        check_split([(0, 3), (3, 6)], 6, info.kv_groups)
    shape = ModelShape.from_gguf(path)
    hosts = [HostSpec(f"h{i}", memory=1 << 40) for i in range(3)]
    plan = plan_chain(shape, hosts, PlanSettings(ctx_size=256, max_sessions=1))
    assert [(s.start, s.end) for s in plan.stages] == [(0, 1), (1, 2), (2, 6)]
    with pytest.raises(PlanError, match="4 hosts need 3 cuts"):
        plan_chain(shape, [*hosts, HostSpec("h3", memory=1 << 40)], PlanSettings(ctx_size=256, max_sessions=1))


@pytest.mark.parametrize("dtype", ["F32", pytest.param("Q8_0", marks=pytest.mark.slow)])
def test_gemma4_without_per_layer_embeddings_splits_exactly(dtype: str) -> None:
    """The 31B layout (no per-layer token embeddings): an ordinary split, no token ids needed."""
    from test_arch_exactness import SPLITS

    spec = dataclasses.replace(tiny("gemma4", dtype=dtype), n_embd_per_layer=0)  # type: ignore[arg-type]
    path = ensure_model(spec)
    with Model(path, "2:4") as model:
        assert not model.reads_tokens
    expected, expected_tokens = run(path, [(0, 4)])
    assert float(np.std(expected[-1])) > 0.02
    for split in SPLITS:
        logits, tokens = run(path, split)
        assert tokens == expected_tokens, split
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: max diff {np.abs(got - want).max()}"


@pytest.mark.parametrize("dtype", ["F32", pytest.param("Q8_0", marks=pytest.mark.slow)])
def test_gemma4_with_experts_splits_exactly(dtype: str) -> None:
    """The 26B-A4B layout: 8 experts (2 per token) beside the dense MLP on every layer, its own
    router norm and scale, with per-layer token embeddings (both distinctive paths at once)."""
    from test_arch_exactness import SPLITS

    spec = dataclasses.replace(tiny("gemma4", dtype=dtype), n_expert=8, n_expert_used=2, n_ff_exp=32)  # type: ignore[arg-type]
    path = ensure_model(spec)
    expected, expected_tokens = run(path, [(0, 4)])
    assert float(np.std(expected[-1])) > 0.02
    dense, _ = run(ensure_model(tiny("gemma4", dtype=dtype)), [(0, 4)])  # type: ignore[arg-type]
    assert not np.array_equal(dense[-1], expected[-1])  # the experts are in the graph
    for split in SPLITS:
        logits, tokens = run(path, split)
        assert tokens == expected_tokens, split
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: max diff {np.abs(got - want).max()}"
