"""The real Gemma 3 270M Q4_K_M unsplit: skippy against stock llama.cpp, measured in one run.

Run: ``.venv/bin/python bench/real_model.py [--rounds N] [--steps 64] [--no-prefill] [--model M.gguf]``.

Strategy: three ways of running the same file with one compute thread are measured in
interleaved rounds (each round runs every variant once, so the shared machine's load drifts hit
them alike), and the medians and the per-round ratios are printed:

* **stock**: ``llama-bench -t 1 -fa 0 -ngl 0 -r R -p 0 -n 64`` (and ``-p 512 -n 0``) of the
  unpatched tree built by ``bench/peer_build.py`` (same portable CPU level as our build);
  its samples (tokens/s) are read from ``-o json``.
* **in-process**: skippy's runtime called directly: ``Model`` + ``StageContext`` with the stage
  server's defaults (4096 cells, 8 sessions + 8 prefix-cache ids, batch 512, 1 thread), a
  1-token prompt, then 64 single-token decodes each followed by the greedy ``sample`` the final
  stage does (llama-bench's own loop reads no logits; the sample is part of skippy's per-token
  work, so it is timed).
* **stage**: one ``python -m skippy.stage`` process holding all 18 layers (started as
  ``bench/stage_chain.py`` starts its chains), driven over loopback TCP by ``StageClient``:
  configure, a 1-token prefill, 64 decodes, stop.

Prefill: 512 random tokens (a fresh prompt every round, so the stage's prefix cache never hits),
one 512-row batch everywhere (llama-bench's default n_ubatch is 512).  Targets (issue 11):
in-process >= 99% and one stage process >= 97% of stock decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peer_build import build_peer  # noqa: E402
from stage_chain import chain  # noqa: E402

from skippy.driver import StageClient  # noqa: E402
from skippy.stage.config import Address  # noqa: E402

#: The stage server's defaults (skippy/stage/config.py), so "in-process" is the same context.
CTX_SIZE = 4096
SESSIONS = 8
CACHE_SLOTS = 8
BATCH = 512


def model_path(given: str | None) -> Path:
    if given:
        return Path(given)
    from skippy.models.real import ensure_real_model

    return ensure_real_model()


# -- stock llama.cpp -----------------------------------------------------------------------------
def stock_tokens_per_second(bench: Path, model: Path, *, n_prompt: int, n_gen: int, reps: int) -> float:
    """Median tokens/s of llama-bench's samples for one test (decode when ``n_gen``, else prefill)."""
    command = [str(bench), "-m", str(model), "-t", "1", "-fa", "0", "-ngl", "0", "-r", str(reps),
               "-p", str(n_prompt), "-n", str(n_gen), "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({result.returncode}):\n{result.stderr[-3000:]}")
    tests = json.loads(result.stdout)
    return float(statistics.median(tests[0]["samples_ts"]))


# -- skippy in-process ---------------------------------------------------------------------------
class InProcess:
    """The runtime with the stage server's context settings, kept open across rounds."""

    def __init__(self, path: Path) -> None:
        from skippy.runtime import Model, Sampler, StageContext
        from skippy.runtime.sampling import GREEDY

        self.model = Model(path)
        self.ctx = StageContext(self.model, n_ctx=CTX_SIZE, max_sessions=SESSIONS + CACHE_SLOTS,
                                n_batch=BATCH, threads=1)
        self.sampler = Sampler(GREEDY, self.model.n_vocab)
        self.bos = int(_bos(self.model))

    def decode_tokens_per_second(self, steps: int) -> float:
        ctx, samplers = self.ctx, [self.sampler]
        seq = ctx.open_session()
        try:
            ctx.decode(tokens=[self.bos], positions=[0], seq_ids=[seq])
            token = int(ctx.sample(samplers, [0])[0])
            started = time.perf_counter()
            for position in range(1, steps + 1):
                ctx.decode(tokens=[token], positions=[position], seq_ids=[seq])
                token = int(ctx.sample(samplers, [0])[0])
            return steps / (time.perf_counter() - started)
        finally:
            ctx.close_session(seq)

    def prefill_tokens_per_second(self, prompt: Sequence[int]) -> float:
        ctx = self.ctx
        seq = ctx.open_session()
        try:
            n = len(prompt)
            started = time.perf_counter()
            ctx.decode(tokens=np.asarray(prompt, dtype=np.int32), positions=np.arange(n, dtype=np.int32),
                       seq_ids=np.full(n, seq, dtype=np.int32))
            ctx.sample([self.sampler], [n - 1])
            return n / (time.perf_counter() - started)
        finally:
            ctx.close_session(seq)

    def close(self) -> None:
        self.sampler.close()
        self.ctx.close()
        self.model.close()


def _bos(model: object) -> int:
    from skippy.runtime.ffi import lib

    return int(lib.llama_vocab_bos(model.vocab_pointer))  # type: ignore[attr-defined]


# -- skippy as one stage process -----------------------------------------------------------------
async def stage_decode_tokens_per_second(address: Address, bos: int, steps: int) -> float:
    client = await StageClient.connect(address)
    try:
        await client.configure(1)
        token = (await client.prefill(1, [bos], chunk_size=BATCH)).token
        started = time.perf_counter()
        for position in range(1, steps + 1):
            token = (await client.decode(1, token, position)).predicted
        rate = steps / (time.perf_counter() - started)
        await client.stop(1)
        return rate
    finally:
        await client.aclose()


async def stage_prefill_tokens_per_second(address: Address, prompt: Sequence[int]) -> float:
    client = await StageClient.connect(address)
    try:
        await client.configure(1, prompt_token_count=len(prompt))
        started = time.perf_counter()
        await client.prefill(1, prompt, chunk_size=BATCH)
        rate = len(prompt) / (time.perf_counter() - started)
        await client.stop(1)
        return rate
    finally:
        await client.aclose()


# -- the run -------------------------------------------------------------------------------------
def _summary(name: str, rates: list[float], reference: list[float] | None) -> str:
    line = f"  {name:<22} {statistics.median(rates):7.2f} tok/s"
    if reference is not None:
        ratios = [100 * r / s for r, s in zip(rates, reference)]
        line += (f"  = {100 * statistics.median(rates) / statistics.median(reference):5.1f}% of stock"
                 f" (median of per-round ratios {statistics.median(ratios):5.1f}%;"
                 f" rounds {', '.join(f'{x:.1f}' for x in ratios)})")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the real Gemma 3 270M from skippy[real-model])")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64, help="decode tokens per measurement")
    parser.add_argument("--reps", type=int, default=2, help="llama-bench repetitions per round (median)")
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--no-stage", action="store_true", help="skip the stage-process variant")
    args = parser.parse_args()

    path = model_path(args.model)
    peer = build_peer()
    inproc = InProcess(path)
    n_layer = inproc.model.n_layer
    print(f"model {path.name}: {inproc.model.architecture}, {n_layer} layers, n_embd {inproc.model.n_embd}, "
          f"n_vocab {inproc.model.n_vocab}; 1 thread everywhere; {args.steps} decode tokens; "
          f"{args.rounds} interleaved rounds", flush=True)
    rng = np.random.default_rng(1234)
    rates: dict[str, list[float]] = {k: [] for k in
                                     ("stock", "in-process", "stage", "stock-pp", "in-process-pp", "stage-pp")}
    flags = ["--ctx-size", str(CTX_SIZE), "--batch-size", str(BATCH)]
    try:
        with chain(str(path), [f"0:{n_layer}"], flags) as address:
            for round_index in range(args.rounds):
                rates["stock"].append(stock_tokens_per_second(peer.llama_bench, path, n_prompt=0,
                                                              n_gen=args.steps, reps=args.reps))
                rates["in-process"].append(statistics.median(
                    inproc.decode_tokens_per_second(args.steps) for _ in range(args.reps)))
                if not args.no_stage:
                    rates["stage"].append(statistics.median(
                        trio.run(stage_decode_tokens_per_second, address, inproc.bos, args.steps)
                        for _ in range(args.reps)))
                if not args.no_prefill:
                    prompt = [inproc.bos] + [int(t) for t in rng.integers(1000, inproc.model.n_vocab - 1000,
                                                                          args.prompt - 1)]
                    rates["stock-pp"].append(stock_tokens_per_second(peer.llama_bench, path, n_prompt=args.prompt,
                                                                     n_gen=0, reps=1))
                    rates["in-process-pp"].append(inproc.prefill_tokens_per_second(prompt))
                    if not args.no_stage:
                        rates["stage-pp"].append(trio.run(stage_prefill_tokens_per_second, address, prompt))
                print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items() if v),
                      flush=True)
    finally:
        inproc.close()
    print(f"decode (tg{args.steps}), medians:")
    print(_summary("stock llama-bench", rates["stock"], None))
    print(_summary("skippy in-process", rates["in-process"], rates["stock"]) + "  (target >= 99%)")
    if rates["stage"]:
        print(_summary("skippy 1 stage process", rates["stage"], rates["stock"]) + "  (target >= 97%)")
    if rates["stock-pp"]:
        print(f"prefill (pp{args.prompt}), medians:")
        print(_summary("stock llama-bench", rates["stock-pp"], None))
        print(_summary("skippy in-process", rates["in-process-pp"], rates["stock-pp"]))
        if rates["stage-pp"]:
            print(_summary("skippy 1 stage process", rates["stage-pp"], rates["stock-pp"]))


if __name__ == "__main__":
    main()
