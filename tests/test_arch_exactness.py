"""Every newly split architecture: a split gives bitwise the unsplit logits (f32 activations).

For each family x weight dtype x head tying (where its loader has both), three splits of the
4-layer tiny model ([0:1)+[1:4), [0:2)+[2:4), [0:1)+[1:3)+[3:4)) are run over a 20-token prefill
(all rows' logits) and 16 greedy decode steps, with the same micro-batch partition on every
stage, and compared with the unsplit model row by row with ``np.array_equal``.

The tiny shapes are chosen so the tests exercise what is particular to each family: the
sliding-window families (gemma2, gemma3, gpt-oss) have a window of 8 with every other layer
global, so the 20-token prompt crosses the window and every split puts both layer kinds on some
stage (`test_sliding_window_is_in_effect` shows the window changes the logits); the MoE families
have 8 experts of which 2 are used per token (`test_router_spreads_the_prompt_over_experts`, a
proxy for every MoE family, and `test_qwen3moe_block_reference_shows_the_routing`, llama.cpp's
actual choices for one qwen3moe block);
glm4moe's first block is dense, so [0:1) holds only it; granite's multipliers are not 1.

The fast subset is one configuration (F32, the family's first head option, the [0:2)+[2:4)
split, or the 3-stage one for sliding-window families) of one family per mechanism
(FAST_FAMILIES, FAST_LATER); the full matrix is slow. The splits need the layer-range patch for
these architectures: before it covers one, loading a partial range of it raises
UnsupportedArchitecture and its tests fail (they are not skipped). deepseek2 (MLA) is covered
like the others (its 4 tiny layers: one dense block, then experts). The further families with
writers (gemma, olmoe, smollm3, exaone4, ernie4_5, starcoder2, cohere2, seed_oss, llama4,
minimax-m2, dots1, ernie4_5-moe, command-r, internlm2, phi2, stablelm, arcee, olmo, hunyuan-moe,
bailingmoe2, exaone, nemotron) get the same
cases, which check the runtime's refusal while it does not split them. The state-space families
of issue 25 (mamba, mamba2, jamba, falcon-h1, granitehybrid, nemotron_h, nemotron_h_moe, plamo2)
keep per-layer recurrent state; their tiny hybrids start "MM*", so the splits cut inside a run of
Mamba layers and between a Mamba and an attention layer (tests/test_models_ssm.py checks it).
Issue 26's families also run at published widths (fewer layers and experts, never narrower) in
the slow `test_real_shape_issue26_split_logits_are_bitwise_equal`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Final

import numpy as np
import pytest
from chain_helpers import InProcessChain, greedy_run
from conftest import PROMPT
from gguf_helpers import parse_gguf, tensor_f32
from skippy.models import ensure_model, family, tiny
from skippy.models.blocks_linear import is_recurrent
from skippy.models.spec import EXTRA_ARCHITECTURES, LATER_ARCHITECTURES, NEW_ARCHITECTURES, ModelSpec
from skippy.models.spec import LINEAR_ATTENTION_ARCHITECTURES
from skippy.runtime import UnsupportedArchitecture
from skippy.runtime.cuts import legal_cuts
from skippy.runtime.model import SPLIT_ARCHITECTURES

#: 20 tokens of the llama-spm vocabulary: longer than the tiny sliding window (8).
LONG_PROMPT = [*PROMPT, 3681, 338, 263, 1243, 310, 278, 7934, 29889]
N_LAYER = 4
SPLITS = [
    [(0, 1), (1, 4)],
    [(0, 2), (2, 4)],
    [(0, 1), (1, 3), (3, 4)],
]
FAST_SPLIT = SPLITS[1]
DTYPES = ["F32", "F16", "Q8_0"]
STEPS = 16
#: One compute thread: on a shared 2-core machine ggml's worker threads spin-wait for each
#: other and a 2-thread run of these tiny models is ~20x slower than a 1-thread one.
THREADS = 1


def chain(path: Path, split: list[tuple[int, int]]) -> InProcessChain:
    return InProcessChain(path, split, threads=THREADS)


def split_id(split: list[tuple[int, int]]) -> str:
    return "+".join(f"{a}:{b}" for a, b in split)


def head_options(arch: str) -> list[bool]:
    return sorted(family(arch).heads)


def spec_of(arch: str, dtype: str, tied: bool) -> ModelSpec:
    return tiny(arch, dtype=dtype, tied=tied)  # type: ignore[arg-type]


#: The families of issue 11 and the further ones in the fast suite, one per mechanism (their
#: layer-range edits are the generator's generic rules): soft-capping with a sliding window and a
#: tied head (gemma2), attention sinks with a window and biased experts (gpt-oss), MLA after a
#: dense block (deepseek2), a dense first block alone on [0:1) with a sigmoid router (glm4moe),
#: multipliers (granite), a parallel block with a window and a logit scale (cohere2), LayerNorm
#: with biases and partial rotary (phi2), dense blocks between MoE ones (llama4).  The other
#: families run the same cases in the full suite.
FAST_FAMILIES: frozenset[str] = frozenset(
    {"gemma2", "gpt-oss", "deepseek2", "glm4moe", "granite", "cohere2", "phi2", "llama4"})


def cases(archs: tuple[str, ...] = NEW_ARCHITECTURES) -> list[object]:
    """arch x dtype x head x split; one configuration of each of FAST_FAMILIES is in the fast suite."""
    out: list[object] = []
    for arch in archs:
        first_head = head_options(arch)[0]
        for dtype in DTYPES:
            for tied in head_options(arch):
                for split in SPLITS:
                    # Sliding-window families keep the 3-stage split in the fast suite: its
                    # one-layer stages hold one layer kind only (only local, only global).
                    fast_split = SPLITS[2] if tiny(arch).sliding_window else FAST_SPLIT
                    fast = (arch in FAST_FAMILIES and dtype == "F32" and tied == first_head
                            and split == fast_split)
                    head = "tied" if tied else "untied"
                    out.append(
                        pytest.param(
                            arch, dtype, tied, split,
                            id=f"{arch}-{dtype}-{head}-{split_id(split)}",
                            marks=() if fast else (pytest.mark.slow,),
                        )
                    )
    return out


@functools.lru_cache(maxsize=None)
def model_file(arch: str, dtype: str, tied: bool) -> Path:
    return ensure_model(spec_of(arch, dtype, tied))


#: The splits of one configuration run one after another (``cases()``), so the unsplit run of the
#: last few is all that is worth keeping: ~8 MB of logits each (32000-token vocabulary), and the
#: full suite's ~300 configurations, all kept, held 2.3 GB of its process to the end.
@functools.lru_cache(maxsize=4)
def unsplit(arch: str, dtype: str, tied: bool) -> tuple[tuple[np.ndarray, ...], tuple[int, ...]]:
    with chain(model_file(arch, dtype, tied), [(0, N_LAYER)]) as whole:
        logits, tokens = greedy_run(whole, LONG_PROMPT, steps=STEPS)
    return tuple(logits), tuple(tokens)


def test_every_split_architecture_has_a_writer_and_exactness_cases() -> None:
    """The runtime splits only what a synthetic writer and an exactness suite cover (llama,
    qwen2 and qwen3 in test_runtime_exactness.py, the others here)."""
    covered = {"llama", "qwen2", "qwen3"} | set(NEW_ARCHITECTURES) | set(EXTRA_ARCHITECTURES)
    covered |= set(LATER_ARCHITECTURES)
    assert SPLIT_ARCHITECTURES <= covered, sorted(SPLIT_ARCHITECTURES - covered)


def assert_split_is_exact(arch: str, dtype: str, tied: bool, split: list[tuple[int, int]]) -> None:
    spec = spec_of(arch, dtype, tied)
    assert spec.n_layer * max(1, spec.num_loops) == N_LAYER  # nanbeige: layer slots over looped blocks
    if spec.sliding_window:
        assert len(LONG_PROMPT) > spec.sliding_window, "the prompt must cross the window"
    expected_logits, expected_tokens = unsplit(arch, dtype, tied)
    with chain(model_file(arch, dtype, tied), split) as stages:
        logits, tokens = greedy_run(stages, LONG_PROMPT, steps=STEPS)
    assert tokens == list(expected_tokens)
    assert len(logits) == len(expected_logits) == len(LONG_PROMPT) + STEPS
    for row, (got, want) in enumerate(zip(logits, expected_logits)):
        assert np.array_equal(got, want), f"row {row}: max diff {np.abs(got - want).max()}"
    # The logits are informative, not a constant (granite's logit_scale 8 divides them by 8,
    # command-r's 0.0625 multiplies them; chameleon masks its image tokens with -FLT_MAX, left
    # out of the spread).
    last = expected_logits[-1]
    rows = family(arch).output_rows
    if rows:  # Qwen3-TTS: the codec head's logits are the vocabulary's last rows, the rest -inf
        assert (last[:-rows] == -np.inf).all()
        last = last[-rows:]
    assert np.isfinite(last).all()
    assert float(np.std(last[last > np.finfo(np.float32).min])) > 0.02


@pytest.mark.parametrize(("arch", "dtype", "tied", "split"), cases())
def test_split_logits_are_bitwise_equal(
    arch: str, dtype: str, tied: bool, split: list[tuple[int, int]]
) -> None:
    assert_split_is_exact(arch, dtype, tied, split)


@pytest.mark.parametrize(("arch", "dtype", "tied", "split"), cases(EXTRA_ARCHITECTURES))
def test_further_family_splits_exactly_or_is_refused(
    arch: str, dtype: str, tied: bool, split: list[tuple[int, int]]
) -> None:
    """Families with writers beyond issue 11's list (gemma, olmoe, smollm3, exaone4, ernie4_5,
    starcoder2, cohere2, seed_oss, llama4, minimax-m2, dots1, ernie4_5-moe, command-r,
    internlm2, phi2, stablelm, arcee, olmo, hunyuan-moe, bailingmoe2, exaone, nemotron): once the runtime splits one, the same bitwise exactness as
    above; while it does not, a partial range must be refused with the reason."""
    if arch not in SPLIT_ARCHITECTURES:
        with pytest.raises(UnsupportedArchitecture, match=f"{arch}.*partial layer range: .+"):
            chain(model_file(arch, dtype, tied), split)
        return
    assert_split_is_exact(arch, dtype, tied, split)


#: The families of issues 25 and 26 in the fast suite: one per kind of mechanism (per-layer
#: token inputs, Mamba and delta-net hybrids, a wide boundary, a per-token adapter router); the rest
#: run in the full suite.
FAST_LATER: frozenset[str] = frozenset({"gemma4", "nemotron_h", "qwen35", "rwkv7", "graniteswitch", "deepseek4"})


def later_cases() -> list[object]:
    """arch x dtype for the families of issues 25 and 26; each case checks all three splits
    against one unsplit run (one model load per split, not one test per split)."""
    out: list[object] = []
    for arch in LATER_ARCHITECTURES:
        for dtype in DTYPES:
            if arch in FAST_LATER and dtype == "F32":
                # the fast suite's: the cut at 2 and the 3-stage split (its cut at 1 is [0:1)+[1:4)'s)
                out.append(pytest.param(arch, dtype, SPLITS[1:], id=f"{arch}-{dtype}"))
                out.append(pytest.param(arch, dtype, SPLITS[:1], id=f"{arch}-{dtype}-{split_id(SPLITS[0])}",
                                        marks=pytest.mark.slow))
            else:
                out.append(pytest.param(arch, dtype, SPLITS, id=f"{arch}-{dtype}", marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize(("arch", "dtype", "splits"), later_cases())
def test_later_family_splits_are_bitwise_equal(arch: str, dtype: str, splits: list[list[tuple[int, int]]]) -> None:
    """Issues 25 and 26: every split of SPLITS gives the unsplit logits and tokens, with the
    family's first head option (the other, where the loader has both, in the slow suite's F16
    case)."""
    heads = head_options(arch)
    tied = heads[-1] if dtype == "F16" else heads[0]
    for split in splits:
        assert_split_is_exact(arch, dtype, tied, split)


def fast_only(archs: list[str], fast: set[str]) -> list[object]:
    """Parameters over ``archs``, all but ``fast`` marked slow (the fast suite keeps one of each
    kind of check)."""
    return [pytest.param(a, marks=() if a in fast else (pytest.mark.slow,)) for a in archs]


@pytest.mark.parametrize(
    "arch",
    fast_only([a for a in NEW_ARCHITECTURES + EXTRA_ARCHITECTURES if tiny(a).sliding_window], {"gemma2"}),
)
def test_sliding_window_is_in_effect(arch: str) -> None:
    """Control: the same weights with a window longer than the prompt give the same logits for
    the rows that see no more than the window, and different ones after it (unsplit runs), so
    the exactness tests above do cross a sliding-window boundary."""
    spec = tiny(arch)  # type: ignore[arg-type]
    wide = dataclasses.replace(spec, sliding_window=4096)
    n = len(LONG_PROMPT)
    rows = {}
    for label, s in (("narrow", spec), ("wide", wide)):
        with chain(ensure_model(s), [(0, s.n_layer)]) as whole:
            rows[label] = whole.decode(LONG_PROMPT, list(range(n)), [0] * n, [True] * n)
    window = spec.sliding_window
    for row in range(window):
        np.testing.assert_allclose(rows["narrow"][row], rows["wide"][row], rtol=0, atol=1e-4)
    late = max(float(np.abs(rows["narrow"][r] - rows["wide"][r]).max()) for r in range(window, n))
    assert late > 1e-3, "the sliding window changes nothing past it"


def _chunked_run(path: Path, split: list[tuple[int, int]], chunk: int) -> list[np.ndarray]:
    """Prefill LONG_PROMPT in micro-batches of ``chunk`` rows (all rows output), then 8 greedy
    decode steps; the same partition whatever the split."""
    logits: list[np.ndarray] = []
    with chain(path, split) as stages:
        for start in range(0, len(LONG_PROMPT), chunk):
            part = LONG_PROMPT[start : start + chunk]
            positions = list(range(start, start + len(part)))
            logits += stages.decode(part, positions, [0] * len(part), [True] * len(part))
        position = len(LONG_PROMPT)
        for _ in range(8):
            token = int(np.argmax(logits[-1]))
            logits += stages.decode([token], [position], [0])
            position += 1
    return logits


@pytest.mark.parametrize(
    "arch",
    fast_only(
        [
            a for a in NEW_ARCHITECTURES + EXTRA_ARCHITECTURES
            if tiny(a).sliding_window and (a in NEW_ARCHITECTURES or a in SPLIT_ARCHITECTURES)
        ],
        {"gpt-oss", "cohere2"},
    ),
)
def test_prefill_in_micro_batches_across_the_window_is_bitwise_equal(arch: str) -> None:
    """Micro-batches of 6 rows: the window (8) boundary falls inside the second one, so each
    stage's sliding-window cache must evict and mask across batches exactly as unsplit."""
    path = ensure_model(tiny(arch))  # type: ignore[arg-type]
    expected = _chunked_run(path, [(0, N_LAYER)], 6)
    got = _chunked_run(path, SPLITS[2], 6)
    assert len(got) == len(expected) == len(LONG_PROMPT) + 8
    for row, (a, b) in enumerate(zip(got, expected)):
        assert np.array_equal(a, b), f"row {row}: max diff {np.abs(a - b).max()}"


@pytest.mark.parametrize(
    "split", [pytest.param(split, marks=() if split == SPLITS[2] else (pytest.mark.slow,)) for split in SPLITS],
    ids=split_id)
def test_ngram_inputs_in_micro_batches_are_bitwise_equal(split: list[tuple[int, int]]) -> None:
    """Qwen4-exp's n-gram embeddings (PLE, on layer 3: a later stage in every split) hash each
    token with its 2 predecessors, which the first tokens of a micro-batch of 3 rows read from the
    cells the stage's earlier batches recorded (its own KV cells, filled from the token ids it
    receives), and its conv history spans 6 tokens, two batches back."""
    path = ensure_model(tiny("qwen4exp"))
    expected = _chunked_run(path, [(0, N_LAYER)], 3)
    got = _chunked_run(path, split, 3)
    assert len(got) == len(expected) == len(LONG_PROMPT) + 8
    for row, (a, b) in enumerate(zip(got, expected)):
        assert np.array_equal(a, b), f"row {row}: max diff {np.abs(a - b).max()}"


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


@pytest.mark.parametrize(
    "arch",
    fast_only(
        [
            a for a in NEW_ARCHITECTURES + EXTRA_ARCHITECTURES
            if tiny(a).n_expert and (a in NEW_ARCHITECTURES or a in SPLIT_ARCHITECTURES)
        ],
        {"glm4moe"},
    ),
)
def test_router_spreads_the_prompt_over_experts(arch: str) -> None:
    """The MoE tests route to several experts.

    What this proves, and what not: the hidden states entering each MoE block l (l >= 1) are
    taken from a real split chain (the activations out of stage [0:l)), normalised with the
    block's FFN-input norm and multiplied by its router weights, read from the file. In the
    model the router sees the same norm applied to h_l plus block l's attention output, which
    this leaves out, so the top-k sets below are a close proxy of llama.cpp's choices, not the
    choices themselves. It shows that with these weights and this prompt routing is far from
    degenerate: over the prompt the top-k picks cover most experts and differ between tokens.
    For qwen3moe, `test_qwen3moe_block_reference_shows_the_routing` checks the real choices.
    """
    spec = tiny(arch)  # type: ignore[arg-type]
    path = ensure_model(spec)
    parsed = parse_gguf(path)
    tensors = {
        name: tensor_f32(parsed, name) for name, (_, kind, _) in parsed.tensors.items() if kind == "F32"
    }
    norm_name = "post_attention_norm" if arch in ("gpt-oss", "glm4moe") else "ffn_norm"  # their FFN input norm
    n = len(LONG_PROMPT)
    checked = 0
    for layer in range(max(1, spec.n_dense_lead), spec.n_layer):
        if f"blk.{layer}.ffn_gate_inp.weight" not in tensors:
            continue  # a dense block between MoE ones (llama4)
        with chain(path, [(0, layer)]) as first:
            first.contexts[0].decode(tokens=LONG_PROMPT, positions=list(range(n)), seq_ids=[0] * n)
            hidden = first.contexts[0].activations().copy().reshape(n, spec.n_embd)
        x = _rms_norm(hidden, tensors[f"blk.{layer}.{norm_name}.weight"], spec.rms_eps)
        router = tensors[f"blk.{layer}.ffn_gate_inp.weight"].reshape(spec.n_expert, spec.n_embd)
        scores = x @ router.T
        if f"blk.{layer}.ffn_gate_inp.bias" in tensors:
            scores = scores + tensors[f"blk.{layer}.ffn_gate_inp.bias"]
        if f"blk.{layer}.exp_probs_b.bias" in tensors:  # glm4moe: sigmoid, biased selection
            scores = 1 / (1 + np.exp(-scores)) + tensors[f"blk.{layer}.exp_probs_b.bias"]
        chosen = np.argsort(-scores, axis=1)[:, : spec.n_expert_used]
        sets = {tuple(sorted(row)) for row in chosen.tolist()}
        used = set(chosen.ravel().tolist())
        assert len(used) >= spec.n_expert // 2, f"layer {layer}: only experts {sorted(used)}"
        assert len(sets) >= n // 4, f"layer {layer}: only {len(sets)} distinct top-k sets"
        checked += 1
    assert checked >= 2


def _rope_neox(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    half = n_rot // 2
    freqs = base ** (-np.arange(half, dtype=np.float64) * 2 / n_rot)
    angle = positions[:, None, None] * freqs[None, None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    first, second = x[..., :half], x[..., half:n_rot]
    rotated = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return np.concatenate([rotated, x[..., n_rot:]], axis=-1)


def test_qwen3moe_block_reference_shows_the_routing() -> None:
    """The experts llama.cpp picks, exactly (up to float rounding), for one qwen3moe block.

    A numpy reference of block 1 (attention with q/k norms, rope, GQA, f16 KV; softmax top-2
    of 8 experts, renormalised) is run on the hidden states entering the block (out of stage
    [0:1)) and must reproduce the hidden states leaving it (out of stage [0:2)) to within
    rounding (llama.cpp's attention accumulates in f16), while routing any token to another
    expert pair would move its row at least 10x further: so the top-k sets computed on the way
    are the ones llama.cpp used. They must cover most experts and differ between tokens.
    """
    spec = tiny("qwen3moe")
    path = ensure_model(spec)
    parsed = parse_gguf(path)

    def weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return tensor_f32(parsed, f"blk.1.{name}").astype(np.float64).reshape(shape)

    n = len(LONG_PROMPT)
    hidden = {}
    for end in (1, 2):
        with chain(path, [(0, end)]) as first:
            first.contexts[0].decode(tokens=LONG_PROMPT, positions=list(range(n)), seq_ids=[0] * n)
            hidden[end] = first.contexts[0].activations().astype(np.float64).reshape(n, spec.n_embd)
    e, hd, nh, nkv = spec.n_embd, spec.n_embd_head, spec.n_head, spec.n_head_kv
    x = hidden[1]
    a = _rms_norm(x, weight("attn_norm.weight", (e,)), spec.rms_eps)
    q = (a @ weight("attn_q.weight", (nh * hd, e)).T).reshape(n, nh, hd)
    k = (a @ weight("attn_k.weight", (nkv * hd, e)).T).reshape(n, nkv, hd)
    v = (a @ weight("attn_v.weight", (nkv * hd, e)).T).reshape(n, nkv, hd)
    q = _rms_norm(q, weight("attn_q_norm.weight", (hd,)), spec.rms_eps)
    k = _rms_norm(k, weight("attn_k_norm.weight", (hd,)), spec.rms_eps)
    positions = np.arange(n, dtype=np.float64)
    q = _rope_neox(q, positions, spec.n_rot, spec.rope_theta)
    k = _rope_neox(k, positions, spec.n_rot, spec.rope_theta)
    # the KV cache stores k and v as f16
    k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
    q = q.astype(np.float16).astype(np.float64)  # and the attention kernel takes q in f16
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    attn = np.einsum("hij,jhd->ihd", probs, v).reshape(n, nh * hd)
    ffn_in = x + attn @ weight("attn_output.weight", (e, nh * hd)).T
    y = _rms_norm(ffn_in, weight("ffn_norm.weight", (e,)), spec.rms_eps)
    router = y @ weight("ffn_gate_inp.weight", (spec.n_expert, e)).T
    gates = np.exp(router - router.max(axis=1, keepdims=True))
    gates /= gates.sum(axis=1, keepdims=True)
    chosen = np.argsort(-gates, axis=1)[:, : spec.n_expert_used]
    f = spec.n_ff_exp
    gate_w = weight("ffn_gate_exps.weight", (spec.n_expert, f, e))
    up_w = weight("ffn_up_exps.weight", (spec.n_expert, f, e))
    down_w = weight("ffn_down_exps.weight", (spec.n_expert, e, f))

    def moe(i: int, experts: np.ndarray) -> np.ndarray:
        picked = gates[i, experts]
        total = np.zeros(e)
        for expert, w in zip(experts, picked / picked.sum()):
            g = gate_w[expert] @ y[i]
            total += w * (down_w[expert] @ (g / (1 + np.exp(-g)) * (up_w[expert] @ y[i])))
        return ffn_in[i] + total

    out = np.stack([moe(i, chosen[i]) for i in range(n)])
    # Any other choice of experts moves a row far more than the reference's rounding error:
    # here, the second choice swapped for the third.
    ranked = np.argsort(-gates, axis=1)
    swapped = np.stack([moe(i, ranked[i, [0, 2]]) for i in range(n)])
    row_err = np.abs(out - hidden[2]).max(axis=1)
    row_alt = np.abs(swapped - hidden[2]).max(axis=1)
    assert float(row_err.max()) < 1e-2, f"the reference misses block 1 by {row_err.max():.2e}"
    assert float((row_alt / row_err).min()) > 10, "the check cannot tell expert choices apart"
    # No near-tie at the top-k boundary, so llama.cpp's float32 choice is the same set.
    ordered = np.sort(gates, axis=1)[:, ::-1]
    assert float((ordered[:, 1] - ordered[:, 2]).min()) > 1e-4
    used = set(chosen.ravel().tolist())
    sets = {tuple(sorted(row)) for row in chosen.tolist()}
    assert len(used) >= 6, f"only experts {sorted(used)}"
    assert len(sets) >= n // 2, f"only {len(sets)} distinct expert pairs over {n} tokens"


#: 48 tokens (the 20-token prompt, then more of the llama-spm vocabulary).
REAL_SHAPE_PROMPT = [*LONG_PROMPT, *range(1000, 28000, 1000), 29889]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides", "splits"),
    [
        # Gemma 3 270M's shape; the window cut to 32 so the 48-token prompt crosses it (the
        # weights do not depend on the window).
        ("gemma3-270m", {"sliding_window": 32}, [[(0, 9), (9, 18)], [(0, 6), (6, 12), (12, 18)]]),
        ("qwen3moe-30b-a3b-8e", {}, [[(0, 6), (6, 12)], [(0, 1), (1, 7), (7, 12)]]),
        ("gpt-oss-20b-4l", {"sliding_window": 32}, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]),
    ],
    ids=["gemma3-270m", "qwen3moe-30b-a3b-8e", "gpt-oss-20b-4l"],
)
def test_real_shape_split_logits_are_bitwise_equal(
    name: str, overrides: dict[str, object], splits: list[list[tuple[int, int]]]
) -> None:
    from skippy.models import preset

    spec = preset(name, **overrides)
    assert len(REAL_SHAPE_PROMPT) == 48 and len(REAL_SHAPE_PROMPT) > spec.sliding_window
    path = ensure_model(spec)
    with chain(path, [(0, spec.n_layer)]) as whole:
        expected, expected_tokens = greedy_run(whole, REAL_SHAPE_PROMPT, steps=8)
    for split in splits:
        with chain(path, split) as stages:
            logits, tokens = greedy_run(stages, REAL_SHAPE_PROMPT, steps=8)
        assert tokens == expected_tokens, split
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: max diff {np.abs(got - want).max()}"


#: A tiny preset's overrides towards a real shape: Q8_0 (the 32000-token SPM vocab and 4 layers stay).
_REAL_Q8: Final[dict[str, object]] = {"dtype": "Q8_0"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # Qwen3.5-35B-A3B's widths (delta-net 16 key / 32 value heads of 128, conv 4; attention 16 / 2
        # heads of 256; experts of 512, 8 used, and a shared one) with its first 4 layers, 16 experts
        # instead of 256 (the same widths at a tenth of the file: 3.7 GB with all 256)
        ("qwen35moe-35b-a3b-8l", {"n_layer": 4, "n_expert": 16}),
        # Qwen3-Next-80B-A3B's are the same but for its routing (10 of 512 experts used) and rope
        ("qwen35moe-35b-a3b-8l", {"arch": "qwen3next", "name": "skippy-qwen3next-80b-a3b-4l-shape",
                                  "n_layer": 4, "n_expert": 16, "n_expert_used": 10}),
        # Nemotron-H-8B's widths (Mamba-2 of 128 heads of 64, 8 groups, state 128; attention 32 / 8
        # heads of 128; squared-ReLU MLP of 21504): two Mamba layers, attention, MLP
        ("nemotron-h-8b-8l", {"n_layer": 4, "layer_pattern": "MM*-"}),
        # Mamba-2 2.7B's widths (2560; 80 heads of 64 over d_inner 5120, one group, state 128, conv 4)
        ("tiny-mamba2", {"n_embd": 2560, "ssm_d_inner": 5120, "ssm_d_state": 128, "ssm_dt_rank": 80,
                         "ssm_n_group": 1, "rms_eps": 1e-5, "name": "skippy-mamba2-2.7b-4l-shape", **_REAL_Q8}),
        # Mamba 1.4B's (2048; d_inner 4096, state 16, dt rank 128, conv 4)
        ("tiny-mamba", {"n_embd": 2048, "ssm_d_inner": 4096, "ssm_dt_rank": 128, "rms_eps": 1e-5,
                        "name": "skippy-mamba-1.4b-4l-shape", **_REAL_Q8}),
        # RWKV-6 World 1.6B's (2048 in 32 heads of 64, channel mix 7168, low-rank 32 / 64); the
        # state still halves every 2nd layer (the real one: every 6th) so a stage starts after one
        ("tiny-rwkv6", {"n_embd": 2048, "n_ff": 7168, "n_head": 32, "n_head_kv": 32, "wkv_head_size": 64,
                        "time_mix_extra_dim": 32, "time_decay_extra_dim": 64,
                        "name": "skippy-rwkv6-1.6b-4l-shape", **_REAL_Q8}),
        # RWKV-7 World 1.5B's (2048 in 32 heads of 64, channel mix 8192, decay / iclr / value /
        # gate low-rank 96 / 96 / 64 / 256)
        ("tiny-rwkv7", {"n_embd": 2048, "n_ff": 8192, "n_head": 32, "n_head_kv": 32, "decay_lora_rank": 96,
                        "iclr_lora_rank": 96, "value_residual_mix_lora_rank": 64, "gate_lora_rank": 256,
                        "name": "skippy-rwkv7-1.5b-4l-shape", **_REAL_Q8}),
        # LFM2-1.2B's (2048; conv cache 3; attention 32 / 8 heads of 64, rope 1e6; FFN 8192):
        # conv, conv, attention, conv
        ("tiny-lfm2", {"n_embd": 2048, "n_ff": 8192, "n_head": 32, "n_head_kv": 8, "rope_theta": 1e6,
                       "rms_eps": 1e-5, "name": "skippy-lfm2-1.2b-4l-shape", **_REAL_Q8}),
        # Granite 4.0-H-Tiny's (1536; Mamba-2 of 48 heads of 64, one group, state 128; attention
        # 12 / 4 heads of 128; experts of 512, 6 used, a shared one of 1024; logit scale 6):
        # Mamba, Mamba, attention, Mamba; all 64 experts
        ("tiny-granitehybrid", {"n_embd": 1536, "n_ff": 512, "n_head": 12, "n_head_kv": 4,
                                "ssm_d_inner": 3072, "ssm_d_state": 128, "ssm_dt_rank": 48, "ssm_n_group": 1,
                                "n_expert": 64, "n_expert_used": 6, "n_ff_shexp": 1024, "logit_scale": 6.0,
                                "rms_eps": 1e-5, "name": "skippy-granite-4.0-h-tiny-4l-shape", **_REAL_Q8}),
        # Falcon-H1-0.5B's (1024; attention 8 / 2 heads of 64, rope 1e11, beside Mamba-2 of 24 heads
        # of 64 (d_ssm 1536), one group, state 128; FFN 2048): both kinds in every layer
        ("tiny-falcon-h1", {"n_embd": 1024, "n_ff": 2048, "n_head": 8, "n_head_kv": 2, "head_dim": 64,
                            "rope_theta": 1e11, "ssm_d_inner": 1536, "ssm_d_state": 128, "ssm_dt_rank": 24,
                            "ssm_n_group": 1, "rms_eps": 1e-5, "name": "skippy-falcon-h1-0.5b-4l-shape",
                            **_REAL_Q8}),
        # Kimi-Linear-48B-A3B's (2304; KDA of 32 heads of 128, conv 4; NoPE MLA of 32 heads, keys
        # 128 + 64, values 128, KV latent 512; a dense lead of 9216, then experts of 1024, 8 used,
        # scale 2.446, one shared): KDA, KDA, MLA, KDA; 16 experts instead of 256
        ("tiny-kimi-linear", {"n_embd": 2304, "n_ff": 9216, "n_head": 32, "head_dim": 192, "rope_dim": 64,
                              "kv_lora_rank": 512, "v_head_dim": 128, "kda_head_dim": 128, "n_expert": 16,
                              "n_expert_used": 8, "n_ff_exp": 1024, "expert_weights_scale": 2.446,
                              "rms_eps": 1e-5, "name": "skippy-kimi-linear-48b-a3b-4l-shape", **_REAL_Q8}),
        # Jamba-v0.1's (4096; Mamba of d_inner 8192, state 16, dt rank 256, conv 4; attention 32 / 8
        # heads of 128; FFN 14336, experts as wide on every other layer, 2 used): Mamba, Mamba,
        # attention, Mamba; 4 experts instead of 16 (each is 190 MB in Q8_0)
        ("tiny-jamba", {"n_embd": 4096, "n_ff": 14336, "n_head": 32, "n_head_kv": 8, "ssm_d_inner": 8192,
                        "ssm_dt_rank": 256, "n_expert": 4, "name": "skippy-jamba-v0.1-4l-shape", **_REAL_Q8}),
    ],
    ids=["qwen35moe-35b-a3b-4l", "qwen3next-80b-a3b-4l", "nemotron-h-8b-4l", "mamba2-2.7b-4l",
         "mamba-1.4b-4l", "rwkv6-1.6b-4l", "rwkv7-1.5b-4l", "lfm2-1.2b-4l", "granite-4.0-h-tiny-4l",
         "falcon-h1-0.5b-4l", "kimi-linear-48b-a3b-4l", "jamba-v0.1-4l"],
)
def test_real_shape_hybrid_split_logits_are_bitwise_equal(name: str, overrides: dict[str, object]) -> None:
    """Issue 25 at real widths: the splits cut inside a run of recurrent layers (at 1) and
    between a recurrent and an attention layer (at 2 or 3; a pure recurrent model's cuts all fall
    inside its run); 48-token prefill, 8 greedy steps, bitwise the unsplit logits."""
    from skippy.models import preset

    from skippy.deploy.plan import ModelShape

    spec = dataclasses.replace(preset(name), **overrides)
    path = ensure_model(spec)
    shape = ModelShape.from_gguf(path)  # the planner's per-layer figures: state, KV
    recurrent, attention = [b > 0 for b in shape.state_layer_bytes], [b > 0 for b in shape.kv_layer_bytes]
    assert recurrent[:2] == [True, True]  # the cut at 1
    if any(attention):  # a hybrid: a cut between a recurrent and an attention layer
        assert any(recurrent[cut - 1] and attention[cut] for cut in (2, 3)), (recurrent, attention)
    else:  # a pure recurrent model: every cut falls inside the run
        assert all(recurrent), recurrent
    with chain(path, [(0, spec.n_layer)]) as whole:
        expected, expected_tokens = greedy_run(whole, REAL_SHAPE_PROMPT, steps=8)
    last = expected[-1]
    assert np.isfinite(last).all() and float(np.std(last)) > 0.02
    for split in ([(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]):
        with chain(path, split) as stages:
            logits, tokens = greedy_run(stages, REAL_SHAPE_PROMPT, steps=8)
        assert tokens == expected_tokens, split
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: max diff {np.abs(got - want).max()}"


@pytest.mark.parametrize("arch", fast_only(list(LINEAR_ATTENTION_ARCHITECTURES), {"qwen35"}))
def test_hybrid_stage_of_one_layer_kind_is_bitwise_equal(arch: str) -> None:
    """Issue 25, linear attention: the tiny hybrids are R R A R (recurrent, attention), so in
    [0:2)+[2:3)+[3:4) the first stage holds no attention layer and the second no recurrent
    one; each builds the unused inputs of the kind it lacks (which get no buffer) and must still
    give the unsplit logits."""
    spec = tiny(arch)  # type: ignore[arg-type]
    assert [is_recurrent(spec, layer) for layer in range(N_LAYER)] == [True, True, False, True]
    assert_split_is_exact(arch, "F32", head_options(arch)[0], [(0, 2), (2, 3), (3, 4)])


def test_qwen35_trunk_with_a_nextn_block_splits_exactly() -> None:
    """Issue 25: a Qwen3.5 file with a multi-token-prediction (NextN) block after its 4 trunk
    blocks (block_count 5, nextn_predict_layers 1) splits its trunk exactly as the plain one:
    the NextN block belongs to the last stage and the trunk's layer count stays 4."""
    spec = dataclasses.replace(tiny("qwen35"), n_nextn=1)
    path = ensure_model(spec)
    with chain(path, [(0, N_LAYER)]) as whole:
        assert whole.contexts[0].model.n_layer == N_LAYER
        expected, expected_tokens = greedy_run(whole, LONG_PROMPT, steps=STEPS)
    for split in SPLITS:
        with chain(path, split) as stages:
            logits, tokens = greedy_run(stages, LONG_PROMPT, steps=STEPS)
        assert tokens == expected_tokens, split
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: max diff {np.abs(got - want).max()}"


def _deepseek4_flash_4l() -> ModelSpec:
    """DeepSeek-V4-Flash's widths (tests/test_hyper_connections.py's shape) with its first 4 of 43
    layers (hash-routed 3, compressed 0, 0, 4, 128) and 8 of its 256 experts (2 used)."""
    from test_hyper_connections import deepseek4_flash_shape

    return dataclasses.replace(deepseek4_flash_shape(), n_layer=4, compress_ratios=(0, 0, 4, 128),
                               name="skippy-deepseek4-flash-4l-8e-shape")


def _deepseek_v3_4l(arch: str = "deepseek2", **changes: object) -> ModelSpec:
    """DeepSeek-V3's widths (7168; MLA of 128 heads, q_lora 1536, kv_lora 512, keys 128 + 64,
    values 128; a dense lead of 18432, then sigmoid experts of 2048 with one shared) with 4 of its
    61 layers (1 dense lead instead of 3) and 8 of its 256 experts (2 used instead of 8)."""
    return dataclasses.replace(
        tiny(arch, dtype="Q8_0"), n_layer=4, n_embd=7168, n_ff=18432, n_head=128, head_dim=192, rope_dim=64,
        q_lora_rank=1536, kv_lora_rank=512, v_head_dim=128, n_ff_exp=2048, n_expert=8, n_expert_used=2,
        name=f"skippy-{arch}-v3-4l-8e-shape", **changes)


def _deepseek_v32_4l() -> ModelSpec:
    """DeepSeek-V3.2's: V3's widths and its lightning indexer (64 heads of 128); each query keeps
    32 keys instead of 2048, so the 48-token prompt's later queries attend to a subset."""
    return _deepseek_v3_4l("deepseek32", indexer_n_head=64, indexer_head_size=128, indexer_top_k=32)


def _glm5_4l() -> ModelSpec:
    """GLM-5's widths (6144; MLA of 64 heads, q_lora 2048, kv_lora 512, keys 192 + 64, values
    256; a dense lead of 12288, then experts of 2048 with one shared; an indexer of 32 heads of
    128) with 4 of its 78 layers (1 dense lead instead of 3), 8 of its 256 experts (2 used instead
    of 8), each query keeping 32 keys instead of 2048."""
    return dataclasses.replace(
        tiny("glm-dsa", dtype="Q8_0"), n_layer=4, n_embd=6144, n_ff=12288, n_head=64, head_dim=256, rope_dim=64,
        q_lora_rank=2048, kv_lora_rank=512, v_head_dim=256, n_ff_exp=2048, n_expert=8, n_expert_used=2,
        indexer_n_head=32, indexer_head_size=128, indexer_top_k=32, name="skippy-glm5-4l-8e-shape")


def _gemma4_e2b_10l() -> ModelSpec:
    """Gemma 4 E2B's preset with 10 of its 35 layers: layers 0-4 (4 global) keep their KV and
    5-9 reuse that of layers 3 (local) and 4 (global), as its last 20 do, so the legal cuts are
    1, 2 and 3; the window cut from 512 to 32 so the 48-token prompt crosses it."""
    from skippy.models import preset

    return dataclasses.replace(preset("gemma4-e2b"), n_layer=10, n_kv_shared_layers=5, sliding_window=32,
                               name="skippy-gemma4-e2b-10l-shape")


def _qwen3vl_8b_4l() -> ModelSpec:
    """Qwen3-VL-8B's text tower on text input (4096; 32 / 8 heads of 128, interleaved M-RoPE
    sections 24:20:20, rope 5e6; FFN 12288) with 4 of its 36 layers."""
    return dataclasses.replace(
        tiny("qwen3vl", dtype="Q8_0"), n_layer=4, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8, head_dim=128,
        rope_sections=(24, 20, 20, 0), rope_theta=5e6, name="skippy-qwen3vl-8b-4l-shape")


def _qwen3vlmoe_30b_a3b_4l() -> ModelSpec:
    """Qwen3-VL-30B-A3B's text tower on text input (2048; 32 / 4 heads of 128, M-RoPE 24:20:20,
    rope 5e6; experts of 768, 8 used) with 4 of its 48 layers and 32 of its 128 experts."""
    return dataclasses.replace(
        tiny("qwen3vlmoe", dtype="Q8_0"), n_layer=4, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
        rope_sections=(24, 20, 20, 0), rope_theta=5e6, n_ff_exp=768, n_expert=32, n_expert_used=8,
        name="skippy-qwen3vlmoe-30b-a3b-4l-32e-shape")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "splits"),
    [
        (_deepseek4_flash_4l, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]),
        (_deepseek_v3_4l, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]),
        (_deepseek_v32_4l, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]),
        (_glm5_4l, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]),
        (_gemma4_e2b_10l, [[(0, 3), (3, 10)], [(0, 1), (1, 3), (3, 10)]]),
        (_qwen3vl_8b_4l, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]),
        (_qwen3vlmoe_30b_a3b_4l, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]]),
    ],
    ids=["deepseek4-flash-4l-8e", "deepseek2-v3-4l-8e", "deepseek32-v3.2-4l-8e", "glm-dsa-glm5-4l-8e",
         "gemma4-e2b-10l", "qwen3vl-8b-4l", "qwen3vlmoe-30b-a3b-4l-32e"],
)
def test_real_shape_issue26_split_logits_are_bitwise_equal(
    make: Callable[[], ModelSpec], splits: list[list[tuple[int, int]]]
) -> None:
    """Issue 26 at real widths (fewer layers and experts, never narrower): 48-token prefill, 8
    greedy steps, each split (one of them 3-stage, all at legal cuts) bitwise the unsplit logits."""
    spec = make()
    path = ensure_model(spec)
    from skippy.deploy.plan import ModelShape

    legal = legal_cuts(spec.n_layer, ModelShape.from_gguf(path).kv_groups)  # as `skippy plan` sees the file
    assert all(cut in legal for split in splits for _, cut in split[:-1]), legal
    with chain(path, [(0, spec.n_layer)]) as whole:
        expected, expected_tokens = greedy_run(whole, REAL_SHAPE_PROMPT, steps=8)
    last = expected[-1]
    assert np.isfinite(last).all() and float(np.std(last)) > 0.02
    for split in splits:
        with chain(path, split) as stages:
            logits, tokens = greedy_run(stages, REAL_SHAPE_PROMPT, steps=8)
        assert tokens == expected_tokens, split
        for row, (got, want) in enumerate(zip(logits, expected)):
            assert np.array_equal(got, want), f"{split} row {row}: max diff {np.abs(got - want).max()}"
