"""The greedy pick with a logit bias (``ignore_eos``, ``logit_bias``) taken from the logits row in
place (``Sampler.pick_greedy``) is the token llama.cpp's sampler chain picks, row after row."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PROMPT, model_path
from skippy.runtime import Model, Sampler, SamplingParams, StageContext
from skippy.runtime.ffi import ffi, lib


def _chain_pick(sampler: Sampler, row: np.ndarray) -> int:
    """What the sampler's llama.cpp chain picks from ``row`` (-1: a pick of -inf, which the
    checked sampling refuses)."""
    scratch = ffi.new("llama_token_data[]", row.shape[0])
    picked = ffi.new("llama_token *")
    if lib.skippy_sample_row_checked(sampler.pointer, ffi.NULL, ffi.cast("float *", ffi.from_buffer(row)),
                                     row.shape[0], scratch, picked) != 0:
        return -1
    return int(picked[0])


def _crafted_row(rng: np.random.Generator, n_vocab: int) -> np.ndarray:
    """Logits with many ties (values on a coarse grid), now and then infinities."""
    row = rng.integers(-40, 40, n_vocab).astype(np.float32) / 8
    if rng.random() < 0.3:
        row[rng.integers(0, n_vocab, 3)] = np.inf
    if rng.random() < 0.3:
        row[rng.integers(0, n_vocab, 3)] = -np.inf
    return row


def test_biased_pick_is_the_chains_pick_on_crafted_rows() -> None:
    rng = np.random.default_rng(31)
    n_vocab = 512
    checked = ties = 0
    for case in range(400):
        row = _crafted_row(rng, n_vocab)
        top = int(row.argmax())
        count = int(rng.integers(1, 6))
        tokens = [int(t) for t in rng.integers(0, n_vocab, count)]
        if case % 3 == 0:
            tokens.append(top)  # the row's maximum biased: the pick must come from the others
        if case % 5 == 0:
            tokens.append(tokens[0])  # a token biased twice: the biases add up in the order given
        biases = [float(b) for b in rng.choice([-100.0, -np.inf, -0.125, 0.125, 0.5, 3.0, 100.0, 0.1, -0.3, 1e300],
                                               len(tokens))]
        params = SamplingParams(logit_bias=tuple(zip(tokens, biases)))
        with Sampler(params, n_vocab) as sampler:
            assert sampler.fast_greedy and not sampler.plain_greedy
            fast = sampler.pick_greedy(row)
            expected = _chain_pick(sampler, row)
        effective = row.copy()
        with np.errstate(invalid="ignore", over="ignore"):
            for token, bias in zip(tokens, biases):
                effective[token] += np.float32(bias)
        if np.isnan(effective).any():  # inf - inf: left to the chain
            assert fast == -1
            continue
        if expected < 0:  # every logit -inf: the chain's pick is refused by the checked sampling
            assert effective.max() == -np.inf and fast == 0
            continue
        assert fast == expected, (case, tokens, biases)
        ties += int((effective == effective[fast]).sum() > 1)
        checked += 1
    assert checked > 350 and ties > 50  # the ties (first index wins) were exercised


def test_a_nan_row_is_left_to_the_chain() -> None:
    row = np.linspace(-1, 1, 64, dtype=np.float32)
    with Sampler(SamplingParams(logit_bias=((3, 1.0),)), 64) as sampler:
        assert sampler.pick_greedy(row) == 63
        row[10] = np.nan
        assert sampler.pick_greedy(row) == -1
        row[10] = 0.0
        row[3] = np.inf
        with Sampler(SamplingParams(logit_bias=((3, -np.inf),)), 64) as masked:
            assert masked.pick_greedy(row) == -1  # inf - inf is NaN: the chain decides
        assert sampler.pick_greedy(row) == 3
    assert Sampler(SamplingParams(), 64).fast_greedy
    assert not Sampler(SamplingParams(logit_bias=((3, 1.0),), repeat_penalty=1.1), 64).fast_greedy
    assert not Sampler(SamplingParams(temperature=0.7, seed=3), 64).fast_greedy


@pytest.mark.parametrize("bias", [-100.0, 2.0])
def test_biased_greedy_decode_takes_the_chains_tokens(bias: float) -> None:
    """A greedy decode on the tiny model, 48 steps of several sessions in one batch: the fast pick
    (through StageContext.sample) and the forced chain give the same token at every step, with the
    bias on the tokens the unbiased decode picks (so the biased token is often the row's maximum)."""
    steps, sessions = 48, 3
    with Model(model_path()) as model, StageContext(model, n_ctx=256, n_batch=16, max_sessions=4,
                                                     threads=1) as context:
        def run(samplers: list[Sampler], compare: list[Sampler] | None) -> list[list[int]]:
            for seq in range(sessions):
                context.trim(seq, 0)
            prompts = [PROMPT[:6 + seq] for seq in range(sessions)]
            for seq, prompt in enumerate(prompts):
                context.decode(tokens=prompt, positions=range(len(prompt)), seq_ids=[seq] * len(prompt))
                first = int(context.sample([samplers[seq]], [len(prompt) - 1])[0])
                if compare is not None:
                    assert int(context.sample([compare[seq]], [len(prompt) - 1])[0]) == first
                prompts[seq] = [*prompt, first]
            for _ in range(steps):
                context.decode(tokens=[p[-1] for p in prompts], positions=[len(p) - 1 for p in prompts],
                               seq_ids=list(range(sessions)), outputs=[True] * sessions)
                picked = context.sample(samplers, list(range(sessions))).tolist()
                if compare is not None:
                    assert context.sample(compare, list(range(sessions))).tolist() == picked
                for seq, token in enumerate(picked):
                    prompts[seq].append(token)
            return prompts

        plain = [Sampler(SamplingParams(), model.n_vocab) for _ in range(sessions)]
        unbiased = run(plain, None)
        common = sorted({t for p in unbiased for t in p[6:]}, key=lambda t: -sum(p.count(t) for p in unbiased))
        biased_tokens = common[:4] + [0, model.n_vocab - 1]
        params = SamplingParams(logit_bias=tuple((t, bias) for t in biased_tokens) + ((biased_tokens[0], 0.5),))
        fast = [Sampler(params, model.n_vocab) for _ in range(sessions)]
        chain = [Sampler(params, model.n_vocab) for _ in range(sessions)]
        for sampler in chain:
            sampler.fast_greedy = False  # force llama.cpp's chain
        biased = run(fast, chain)
        assert biased != unbiased  # the bias changed the decode
        if bias < 0:
            assert not {t for p in biased for t in p[6:]} & set(biased_tokens[:4])
        for sampler in plain + fast + chain:
            sampler.close()
