"""Per-session token samplers built from llama.cpp's sampler chain.

Strategy: a request's sampling settings become one ``llama_sampler`` chain owned by the session on
the final stage: logit bias, repetition penalties, then either greedy or top-k, top-p, min-p,
temperature and a seeded draw.  ``llama_sampler_sample`` samples from a row of the last decode
and records the token in the chain's history (for penalties).  Greedy is an exact argmax, so a
split chain and the unsplit reference pick identical tokens from identical logits.

Fast path: greedy with at most a logit bias before it (``ignore_eos``, ``logit_bias``; no
penalties, no grammar) keeps no state, so the context takes its pick from the logits row in place
(:meth:`Sampler.pick_greedy`: the biased entries computed apart, in float32 as llama.cpp adds
them, then the first maximum), the same token as the chain without filling its n_vocab-entry
candidate array (0.05 ms against 0.5 ms a row on Gemma 3's 262,144 tokens).  A row with a NaN
still takes the chain.  A seeded draw keeps the chain: its softmax (``expf``, a double sum) and
its ``mt19937`` draw would have to be reproduced bit for bit.

Structured output: a GBNF ``grammar`` adds llama.cpp's grammar sampler, so the token picked is
one the grammar allows next, and the grammar accepts it (which advances its state).  With top-k,
top-p or min-p the grammar sits in the chain right after the penalties (every later step sees only
allowed tokens: the exact order).  Greedy, or temperature and a draw alone, commute with the
grammar's mask, so there the grammar is kept beside the chain and only checks the chain's pick,
masking the whole vocabulary only when the pick is forbidden (the same distribution, one check
instead of a vocabulary pass per token; see ``skippy_sample_row_checked`` in
``native/cdef/skippy_shim.c``).  Either way the sampler is *checked* (:attr:`Sampler.checked`): the
context samples it with ``skippy_sample_row_checked``, which refuses (:class:`GrammarDeadEnd`)
instead of accepting a token the grammar forbade (when it forbids every token; llama.cpp would
throw through its C API and end the process).  Grammar text
is bounded before llama.cpp parses it (:func:`check_grammar_text`: size and nesting depth; the
parser recurses once per nesting level).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Sequence, final

import numpy as np
import numpy.typing as npt

from skippy.runtime import _callbacks
from skippy.runtime.errors import ClosedError, NativeError
from skippy.runtime.ffi import ffi, lib

#: llama.cpp's "pick a random seed" value.
DEFAULT_SEED = 0xFFFFFFFF
#: Longest GBNF grammar accepted (UTF-8 bytes); JSON-schema grammars are a few KiB.
MAX_GRAMMAR_BYTES = 256 * 1024
#: Deepest nesting of parenthesised groups accepted (llama.cpp's parser recurses per level).
MAX_GRAMMAR_NESTING = 128


class GrammarDeadEnd(NativeError):
    """The session's grammar allows no token of the vocabulary at this position."""


def check_grammar_text(grammar: str) -> None:
    """Bound a GBNF text before llama.cpp parses it: size and parenthesis nesting.

    Raises:
        ValueError: too long, nested too deep, or containing a NUL (C strings end there).
    """
    data = grammar.encode("utf-8", "replace")
    if len(data) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the grammar is {len(data)} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")
    if "\0" in grammar:
        raise ValueError("the grammar contains a NUL character")
    depth = deepest = 0
    index, size = 0, len(grammar)
    while index < size:
        char = grammar[index]
        if char in "\"[":  # a literal or a character class: skip it, escapes included
            close = '"' if char == '"' else "]"
            index += 1
            while index < size and grammar[index] != close:
                index += 2 if grammar[index] == "\\" else 1
        elif char == "#":  # a comment runs to the end of the line
            while index < size and grammar[index] not in "\r\n":
                index += 1
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
        index += 1
    if deepest > MAX_GRAMMAR_NESTING:
        raise ValueError(f"the grammar nests groups {deepest} deep; at most {MAX_GRAMMAR_NESTING} are accepted")


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
    #: GBNF grammar every sampled token must follow (None: unconstrained), and its start rule.
    grammar: str | None = None
    grammar_root: str = "root"

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
            (self.grammar is None or bool(self.grammar_root), "grammar_root must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameters: {message}")
        if self.grammar is not None:
            check_grammar_text(self.grammar)
            check_grammar_text(self.grammar_root)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


GREEDY = SamplingParams()


def _merged_bias(logit_bias: tuple[tuple[int, float], ...]) -> tuple[
        npt.NDArray[np.intp] | None, list[npt.NDArray[np.float32]], frozenset[int]]:
    """A logit bias as :meth:`Sampler.pick_greedy` applies it: the distinct tokens in ascending
    order, then the biases as float32 steps (step k holds each token's k-th bias in the order given,
    0 where it has fewer: adding +0 changes no comparison), and the tokens as a set."""
    if not logit_bias:
        return None, [], frozenset()
    per_token: dict[int, list[float]] = {}
    for token, bias in logit_bias:
        per_token.setdefault(int(token), []).append(bias)
    tokens = sorted(per_token)
    depth = max(len(biases) for biases in per_token.values())
    with np.errstate(over="ignore"):  # a bias beyond float32 is infinite, as in llama.cpp's float
        steps = [np.array([per_token[t][k] if k < len(per_token[t]) else 0.0 for t in tokens], dtype=np.float32)
                 for k in range(depth)]
    return np.array(tokens, dtype=np.intp), steps, frozenset(tokens)


@final
class Sampler:
    """A llama.cpp sampler chain for one session.  Close it (or use ``with``) when done.

    Args:
        params: the settings.
        n_vocab: the vocabulary size.
        vocab: the model's ``llama_vocab`` pointer (needed for a grammar).

    Raises:
        ValueError: a logit bias outside the vocabulary, or a grammar that does not parse (the
            message carries llama.cpp's reason).
    """

    def __init__(self, params: SamplingParams, n_vocab: int, vocab: object = None) -> None:
        self.params = params
        self._n_vocab = n_vocab
        #: Greedy with nothing before it in the chain: the sample is the logits' first maximum
        #: (what the greedy sampler picks), which the context takes without building the
        #: n_vocab-entry candidate array.  Accepting tokens changes nothing in such a chain.
        self.plain_greedy = (params.greedy and not params.uses_penalties and not params.logit_bias
                             and params.grammar is None)
        #: Greedy with at most a logit bias before it (``ignore_eos``, ``logit_bias``): the context
        #: picks from the row itself with :meth:`pick_greedy` (the same token as the chain, without
        #: its n_vocab-entry candidate array); such a chain keeps no state either.
        self.fast_greedy = params.greedy and not params.uses_penalties and params.grammar is None
        self._bias_tokens, self._bias_steps, self._bias_set = _merged_bias(params.logit_bias)
        self._bias_small = all(bool((np.abs(step) <= 1e30).all()) for step in self._bias_steps)
        #: Sampled with a check that the pick is allowed (see the module header).
        self.checked = params.grammar is not None
        self._lock = threading.Lock()
        grammar = ffi.NULL
        if params.grammar is not None:
            if vocab is None or vocab == ffi.NULL:
                raise ValueError("a grammar needs the model's vocabulary (this runtime has none)")
            _callbacks.take_recent_errors()
            grammar = lib.llama_sampler_init_grammar(vocab, params.grammar.encode("utf-8"),
                                                     params.grammar_root.encode("utf-8"))
            if grammar == ffi.NULL:
                reason = _callbacks.take_recent_errors().strip() or "llama.cpp refused it"
                raise ValueError(f"the grammar does not parse: {reason}")
        #: The grammar sampler, beside or in the chain (NULL: none): :meth:`restore` checks tokens with it.
        self._grammar_check = grammar
        #: The grammar kept beside the chain (see the module header), or NULL.
        self._grammar = ffi.NULL
        beside = params.greedy or (params.top_k == 0 and params.top_p >= 1.0 and params.min_p <= 0.0)
        if grammar != ffi.NULL and beside:
            self._grammar, grammar = grammar, ffi.NULL
        #: The chain's seeded draw (NULL: greedy), which :meth:`restore` advances.
        self._dist = ffi.NULL
        chain_params = lib.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        chain = lib.llama_sampler_chain_init(chain_params)
        if params.logit_bias:
            for token, _ in params.logit_bias:
                if not 0 <= token < n_vocab:
                    lib.llama_sampler_free(chain)
                    for owned in (grammar, self._grammar):
                        if owned != ffi.NULL:
                            lib.llama_sampler_free(owned)
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
        if grammar != ffi.NULL:
            lib.llama_sampler_chain_add(chain, grammar)  # the chain owns it from here
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
            self._dist = lib.llama_sampler_init_dist(params.seed)
            lib.llama_sampler_chain_add(chain, self._dist)  # the chain owns it; kept for restore()
        self._ptr = chain

    def pick_greedy(self, row: npt.NDArray[np.float32]) -> int:
        """The token the greedy chain (logit bias, then greedy) picks from ``row``, the logits of one
        row read in place; with a bias, -1 when a NaN is among the values compared (the chain must
        then pick); without one, numpy's argmax as the plain greedy shortcut always took.

        The chain adds each bias to its candidate in float32, in the order given, and takes the
        first candidate whose logit is greater than every one before it: without NaN, the lowest
        index holding the maximum.  Here the first maximum of the unbiased entries (numpy's argmax:
        the first maximum, or the first NaN) is compared with the biased entries, computed apart.
        """
        index = int(row.argmax())
        if self._bias_tokens is None:
            return index
        if index in self._bias_set:  # a biased entry is the row's maximum: the others' maximum
            rest = row.copy()
            rest[self._bias_tokens] = -np.inf
            index = int(rest.argmax())
            top = rest[index]
        else:
            top = row[index]
        biased = row[self._bias_tokens]
        if self._bias_small:  # no bias makes a NaN or an overflow: no warning to silence
            for step in self._bias_steps:
                biased += step
        else:
            with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, handled below
                for step in self._bias_steps:
                    biased += step
        if top != top or np.isnan(biased).any():
            return -1
        best = biased.max()
        if best > top:
            return int(self._bias_tokens[int(biased.argmax())])
        if best == top:  # a tie: the lower index (the biased tokens are in ascending order)
            return min(index, int(self._bias_tokens[int(biased.argmax())]))
        return index

    @property
    def pointer(self) -> object:
        if self._ptr == ffi.NULL:
            raise ClosedError("sampler is closed")
        return self._ptr

    @property
    def grammar_pointer(self) -> object:
        """The grammar sampler kept beside the chain (NULL when the grammar is in the chain, or none)."""
        self.pointer  # raises when closed
        return self._grammar

    def accept(self, token: int) -> None:
        """Record a token that was not sampled here (a prompt token, an accepted draft).

        Raises:
            ValueError: the sampler has a grammar (a token it forbids would end the process).
        """
        if self.checked:
            raise ValueError("a grammar sampler accepts only the tokens it sampled")
        lib.llama_sampler_accept(self.pointer, token)

    def restore(self, tokens: Sequence[int]) -> None:
        """Bring a fresh sampler to where sampling ``tokens`` (in order) left the original
        (docs/protocol.md §14, a replaced final stage): the penalties' history and the grammar
        accept them, and the seeded draw advances once per token (llama.cpp's dist sampler draws
        exactly once per sample).  Exact but for one case: a grammar kept beside the chain whose
        check refused a pick drew twice for that token (``skippy_sample_row_checked``), which
        the token list cannot tell.

        Raises:
            ValueError: a token outside the vocabulary, or one the grammar does not allow there
                (accepting it would end the process); the tokens before it were accepted.
        """
        chain = self.pointer
        for index, token in enumerate(tokens):
            if not 0 <= token < self._n_vocab:
                raise ValueError(f"restored token {index} ({token}) is outside the vocabulary")
            if self._grammar_check != ffi.NULL and not lib.skippy_grammar_allows(self._grammar_check, int(token)):
                raise ValueError(f"restored token {index} ({token}) is not allowed by the grammar there")
            if self._grammar != ffi.NULL:
                lib.llama_sampler_accept(self._grammar, int(token))
            lib.llama_sampler_accept(chain, int(token))
        if self._dist != ffi.NULL and tokens:
            lib.skippy_sampler_draw(self._dist, len(tokens))

    def reset(self) -> None:
        """Forget the history (penalties) and restart the grammar from its root rule."""
        lib.llama_sampler_reset(self.pointer)
        if self._grammar != ffi.NULL:
            lib.llama_sampler_reset(self._grammar)

    def close(self) -> None:
        with self._lock:
            if self._ptr != ffi.NULL:
                lib.llama_sampler_free(self._ptr)
                self._ptr = ffi.NULL
            if self._grammar != ffi.NULL:
                lib.llama_sampler_free(self._grammar)
                self._grammar = ffi.NULL

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
