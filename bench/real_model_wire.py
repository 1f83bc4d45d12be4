"""Lossy activation wires on real weights: token agreement and logit error of f16 / q8 against f32.

Strategy: the real Gemma 3 270M (``skippy-llm[real-model]``), split in this process into stages
(default ``0:9,9:18``) whose boundary activations go through the wire codec exactly as a stage
process sends them (``skippy.codec.wire.encode_activation`` then ``decode_activation``: f32 is the
identity, f16 rounds ties away from zero, q8 is per-row int8 with an f32 scale).  The unsplit
model's greedy run of a chat prompt is the reference.  For each wire two figures are measured:

- *teacher-forced*: the reference's tokens are fed to the lossy chain, so every step's logits are
  comparable; reported are the max absolute logit error over the prefill rows and every decode
  step, and the share of steps whose argmax equals the reference token (``agreement``);
- *free-running*: the lossy chain's own greedy run; reported is how many of its tokens equal the
  reference's position by position, and where it first differs (None: never).

Measured on the 2-vCPU development host (``--tokens 128``, split 0:9,9:18, 15 min under load):
f32 100% / error 0 / 128 of 128 equal; f16 99.22% / 14.73 / 73 of 128 (first divergence at token 0);
q8 98.44% / 12.16 / 0 of 128 (token 0).  Gemma 3's residual stream is large: at layer 9 the BOS
row reaches |82,642| (beyond f16's 65,504, so f16 sends Inf there) and the other rows 4,000-7,000,
and the model's top logits are close (" The" 17.67 vs " " 17.58), so either lossy wire changes the
very first greedy token; the logit error is ~7-15 on every row.

Run: ``.venv/bin/python bench/real_model_wire.py [--tokens 128] [--layers 0:9,9:18] [--threads 2]``.
:func:`measure` is what ``tests/test_real_model.py`` calls with a loose bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy.codec.protocol import WireDType  # noqa: E402
from skippy.codec.wire import decode_activation, encode_activation  # noqa: E402
from skippy.runtime.local import LocalChain, parse_split  # noqa: E402

#: The chat question every real-model figure uses.
QUESTION = "What is the capital of France?"


class WireChain(LocalChain):
    """A LocalChain whose stage boundaries round-trip the activations through a wire dtype."""

    def __init__(self, path: Path, split: Sequence[tuple[int, int]], wire: WireDType, *, n_ctx: int = 512,
                 threads: int = 2) -> None:
        super().__init__(path, list(split), n_ctx=n_ctx, max_sessions=1, n_batch=64, threads=threads)
        self.wire = wire

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
               outputs: Sequence[bool] | None = None) -> None:
        hidden: np.ndarray | None = None
        for context in self.contexts:
            flags = outputs if context.model.is_last else None
            if hidden is None:
                context.decode(tokens=tokens, positions=positions, seq_ids=seq_ids, outputs=flags)
            else:
                context.decode(activations=hidden, positions=positions, seq_ids=seq_ids, outputs=flags)
            if not context.model.is_last:
                raw = context.activations()
                hidden = decode_activation(encode_activation(raw, self.wire), self.wire, *raw.shape).copy()

    def step_logits(self, tokens: Sequence[int], start: int, *, all_rows: bool = False) -> list[np.ndarray]:
        """Decode ``tokens`` at positions ``start...``; the logits of the last row (or of every row)."""
        count = len(tokens)
        outputs = [True] * count if all_rows else [False] * (count - 1) + [True]
        self.decode(list(tokens), list(range(start, start + count)), [0] * count, outputs)
        return [self.last.logits(int(row)).copy() for row in self.last.output_rows]


def chat_prompt(path: Path, question: str = QUESTION) -> list[int]:
    """The driver's prompt tokens for one user message (the template skippy serves the file with)."""
    from skippy.driver.generator import Generator

    generator = Generator.from_model(path)
    try:
        return generator.encode(generator.apply_chat_template([{"role": "user", "content": question}]))
    finally:
        generator.close()


def greedy(chain: WireChain, prompt: Sequence[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill (every row's logits) then ``steps`` greedy tokens; (logits per row and step, tokens)."""
    logits = chain.step_logits(prompt, 0, all_rows=True)
    tokens: list[int] = []
    for step in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        if step + 1 < steps:  # the last token's own logits would predict one past `steps`
            logits += chain.step_logits([tokens[-1]], len(prompt) + step)
    return logits, tokens


def teacher_forced(chain: WireChain, prompt: Sequence[int], tokens: Sequence[int]) -> list[np.ndarray]:
    """Logits of every prefill row and of each step fed the reference ``tokens``."""
    logits = chain.step_logits(prompt, 0, all_rows=True)
    for index, token in enumerate(tokens[:-1]):
        logits += chain.step_logits([token], len(prompt) + index)
    return logits


@dataclasses.dataclass(frozen=True)
class WireFigures:
    wire: str
    steps: int
    max_logit_error: float
    agreement: float
    free_matches: int
    first_divergence: int | None
    seconds: float

    def line(self) -> str:
        where = "never" if self.first_divergence is None else f"at token {self.first_divergence}"
        return (f"{self.wire:>3}: teacher-forced argmax agreement {self.agreement * 100:6.2f}% over {self.steps} "
                f"tokens, max |logit error| {self.max_logit_error:.4g}; free-running {self.free_matches}/{self.steps} "
                f"tokens equal, first divergence {where} ({self.seconds:.1f} s)")


def measure(path: Path, split: Sequence[tuple[int, int]], wires: Sequence[WireDType], *, steps: int = 128,
            threads: int = 2, question: str = QUESTION,
            free_running: bool = True) -> tuple[list[int], list[WireFigures]]:
    """The reference tokens of the unsplit model and one :class:`WireFigures` per wire.

    ``free_running=False`` skips the lossy chains' own greedy runs (``free_matches`` is then 0 and
    ``first_divergence`` None).
    """
    prompt = chat_prompt(path, question)
    n_layer = split[-1][1]
    with WireChain(path, [(0, n_layer)], WireDType.F32, threads=threads) as whole:
        reference_logits, reference = greedy(whole, prompt, steps)
    figures: list[WireFigures] = []
    for wire in wires:
        started = time.perf_counter()
        with WireChain(path, split, wire, threads=threads) as chain:
            forced = teacher_forced(chain, prompt, reference)
        free: list[int] = []
        if free_running:
            with WireChain(path, split, wire, threads=threads) as chain:
                _, free = greedy(chain, prompt, steps)
        error = max(float(np.abs(got - want).max()) for got, want in zip(forced, reference_logits))
        decode_rows = forced[len(prompt) - 1:]
        agreement = sum(int(np.argmax(row)) == token for row, token in zip(decode_rows, reference)) / steps
        matches = sum(a == b for a, b in zip(free, reference))
        divergence = next((index for index, (a, b) in enumerate(zip(free, reference)) if a != b), None)
        figures.append(WireFigures(wire.name.lower(), steps, error, agreement, matches, divergence,
                                   time.perf_counter() - started))
    return reference, figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per run (default 128)")
    parser.add_argument("--layers", default="0:9,9:18", help="the split (default 0:9,9:18)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args(argv)
    from skippy.models.real import ensure_real_model

    path = ensure_real_model()
    split = parse_split(args.layers)
    reference, figures = measure(path, split, [WireDType.F32, WireDType.F16, WireDType.Q8], steps=args.tokens,
                                 threads=args.threads, question=args.question)
    from skippy.runtime.tokenizer import Tokenizer

    with Tokenizer(path) as tokenizer:
        text = tokenizer.decode(reference)
    print(f"{path.name}, split {args.layers}, chat prompt {args.question!r}, {args.tokens} greedy tokens (no EOG stop)")
    print(f"reference text: {text[:160]!r}{'...' if len(text) > 160 else ''}")
    for figure in figures:
        print(figure.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
