"""Runtime API details: load progress, samplers, activations view, the generate command, no leaks."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from chain_helpers import InProcessChain
from conftest import PROMPT, model_path
from skippy.runtime import Model, ModelLoadError, Sampler, SamplingParams, StageContext, resident_bytes


def test_load_progress_is_reported_and_can_abort() -> None:
    seen: list[float] = []
    with Model(model_path(), "0:2", progress=seen.append) as model:
        assert model.layers.n_layers == 2
    assert seen and seen[-1] == 1.0 and seen == sorted(seen)

    def stop(_: float) -> bool:
        return False

    with pytest.raises(ModelLoadError):
        Model(model_path(), "0:2", progress=stop)

    def explode(_: float) -> None:
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        Model(model_path(), "0:2", progress=explode)


def _sample(params: SamplingParams, steps: int = 8) -> list[int]:
    with InProcessChain(model_path(), [(0, 2), (2, 4)]) as chain:
        return chain.generate(PROMPT, steps, params, stop_at_eog=False)


@pytest.mark.slow
def test_samplers() -> None:
    greedy = _sample(SamplingParams())
    assert greedy == _sample(SamplingParams())
    seeded = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, min_p=0.01, seed=1234)
    assert _sample(seeded) == _sample(seeded)  # reproducible for a fixed seed
    assert _sample(seeded) != _sample(SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=99))
    forced = _sample(SamplingParams(logit_bias=((777, 100.0),)))
    assert forced == [777] * 8
    # penalties steer away from repeating the forced token
    penalised = _sample(SamplingParams(logit_bias=((777, 3.0),), repeat_penalty=50.0, penalty_last_n=8), steps=4)
    assert penalised.count(777) < 4
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplingParams(logit_bias=((10**7, 1.0),)), 32000)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_plain_greedy_takes_the_greedy_samplers_pick() -> None:
    """The argmax shortcut for plain greedy picks what llama.cpp's greedy sampler picks, per row."""
    with Model(model_path()) as model, StageContext(model, n_ctx=64, n_batch=16, threads=1) as context:
        context.decode(tokens=PROMPT[:6], positions=range(6), seq_ids=[0] * 6, outputs=[True] * 6)
        fast, chain = Sampler(SamplingParams(), model.n_vocab), Sampler(SamplingParams(), model.n_vocab)
        chain.plain_greedy = chain.fast_greedy = False  # force the llama.cpp sampler chain
        assert fast.plain_greedy
        rows = list(range(6))
        expected = context.sample([chain] * 6, rows)
        assert context.sample([fast] * 6, rows).tolist() == expected.tolist()
        assert expected.tolist() == [int(np.argmax(context.logits(row))) for row in rows]
        assert not Sampler(SamplingParams(repeat_penalty=1.1), model.n_vocab).plain_greedy
        assert not Sampler(SamplingParams(logit_bias=((5, 1.0),)), model.n_vocab).plain_greedy
        fast.close()
        chain.close()
        from skippy.runtime import ClosedError

        with pytest.raises(ClosedError):
            context.sample([fast], [0])


@pytest.mark.parametrize("layers", ["0:4", "0:2", "2:4"])
def test_read_and_mapped_weights_compute_the_same(layers: str) -> None:
    """The default loader reads the range's tensors into memory; a mapped file is the same weights,
    so every output (logits or hidden states) is bitwise the same."""
    outputs = []
    for use_mmap in (False, True):
        with Model(model_path(), layers, use_mmap=use_mmap) as model, \
                StageContext(model, n_ctx=64, n_batch=16, threads=1) as context:
            assert model.use_mmap is use_mmap
            if model.is_first:
                context.decode(tokens=PROMPT[:6], positions=range(6), seq_ids=[0] * 6, outputs=[True] * 6)
            else:
                rows = np.random.default_rng(7).standard_normal((6, model.n_embd)).astype(np.float32)
                context.decode(activations=rows, positions=range(6), seq_ids=[0] * 6, outputs=[True] * 6)
            outputs.append(np.stack([context.logits(row) for row in range(6)]) if model.is_last
                           else np.array(context.activations()))
    assert outputs[0].tobytes() == outputs[1].tobytes()
    assert np.isfinite(outputs[0]).all()
    with Model(model_path(), "0:2") as model:
        assert model.use_mmap is False  # the default


def test_activations_view_is_rows_by_width_without_copy() -> None:
    with Model(model_path(), "0:2") as model, StageContext(model, n_ctx=64, n_batch=16, threads=1) as context:
        context.decode(tokens=PROMPT[:5], positions=range(5), seq_ids=[0] * 5)
        view = context.activations()
        assert view.shape == (5, model.n_embd) and view.dtype == np.float32
        assert not view.flags.owndata and np.isfinite(view).all()


@pytest.mark.slow
@pytest.mark.own_loads
def test_open_close_does_not_leak() -> None:
    def cycle() -> None:
        with Model(model_path(), "1:3") as model, StageContext(model, n_ctx=128, n_batch=16, threads=1) as ctx:
            ctx.decode(activations=np.ones((4, model.n_embd), np.float32), positions=range(4), seq_ids=[0] * 4)

    for _ in range(3):
        cycle()
    fds_before, rss_before = len(os.listdir("/proc/self/fd")), resident_bytes()
    for _ in range(20):
        cycle()
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    assert resident_bytes() - rss_before < 32 << 20


@pytest.mark.slow
def test_generate_command_prints_both_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "skippy", "generate", "--model", str(model_path()), "--layers", "0:1,1:4",
         "--max-tokens", "6", "--threads", "1", "Hello world"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "== split 0:1,1:4" in result.stdout and "== unsplit" in result.stdout
    assert "tokens identical to the unsplit run: yes" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "skippy", "generate", "--model", str(model_path()),
                          "--layers", "0:1,2:4", "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not contiguous" in bad.stderr
