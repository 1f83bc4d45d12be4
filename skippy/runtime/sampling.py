"""Per-session token samplers built from llama.cpp's sampler chain.

Strategy: a request's sampling settings become one ``llama_sampler`` chain owned by the session on
the final stage: logit bias, repetition penalties, then either greedy or top-k, top-p, min-p,
temperature and a seeded draw.  ``llama_sampler_sample`` samples from a row of the last decode
and records the token in the chain's history (for penalties).  Greedy is an exact argmax, so a
split chain and the unsplit reference pick identical tokens from identical logits.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import final

from skippy.runtime.errors import ClosedError
from skippy.runtime.ffi import ffi, lib

#: llama.cpp's "pick a random seed" value.
DEFAULT_SEED = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the final stage picks the next token.  ``temperature <= 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.temperature), "temperature must be finite"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0.0 and math.isfinite(self.repeat_penalty), "repeat_penalty must be > 0"),
            (math.isfinite(self.frequency_penalty), "frequency_penalty must be finite"),
            (math.isfinite(self.presence_penalty), "presence_penalty must be finite"),
            (self.penalty_last_n >= -1, "penalty_last_n must be >= -1"),
            (0 <= self.seed <= 0xFFFFFFFF, "seed must fit in 32 bits"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameters: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


GREEDY = SamplingParams()


@final
class Sampler:
    """A llama.cpp sampler chain for one session.  Close it (or use ``with``) when done."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self.params = params
        #: Greedy with nothing before it in the chain: the sample is the logits' first maximum
        #: (what the greedy sampler picks), which the context takes without building the
        #: n_vocab-entry candidate array.  Accepting tokens changes nothing in such a chain.
        self.plain_greedy = params.greedy and not params.uses_penalties and not params.logit_bias
        self._lock = threading.Lock()
        chain_params = lib.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        chain = lib.llama_sampler_chain_init(chain_params)
        if params.logit_bias:
            for token, _ in params.logit_bias:
                if not 0 <= token < n_vocab:
                    lib.llama_sampler_free(chain)
                    raise ValueError(f"logit_bias token {token} is outside the vocabulary (0..{n_vocab - 1})")
            biases = ffi.new("llama_logit_bias[]", len(params.logit_bias))
            for slot, (token, bias) in enumerate(params.logit_bias):
                biases[slot].token = token
                biases[slot].bias = bias
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases)
            )
        if params.uses_penalties:
            lib.llama_sampler_chain_add(
                chain,
                lib.llama_sampler_init_penalties(
                    n_vocab, params.penalty_last_n, params.repeat_penalty,
                    params.frequency_penalty, params.presence_penalty,
                ),
            )
        if params.greedy:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(params.min_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(params.temperature))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(params.seed))
        self._ptr = chain

    @property
    def pointer(self) -> object:
        if self._ptr == ffi.NULL:
            raise ClosedError("sampler is closed")
        return self._ptr

    def accept(self, token: int) -> None:
        """Record a token that was not sampled here (a prompt token, an accepted draft)."""
        lib.llama_sampler_accept(self.pointer, token)

    def reset(self) -> None:
        lib.llama_sampler_reset(self.pointer)

    def close(self) -> None:
        with self._lock:
            if self._ptr != ffi.NULL:
                lib.llama_sampler_free(self._ptr)
                self._ptr = ffi.NULL

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
