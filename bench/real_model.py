"""The real Gemma 3 270M Q4_K_M unsplit: skippy against stock llama.cpp, measured in one run.

Run: ``.venv/bin/python bench/real_model.py [--rounds 7] [--steps 64] [--reps 1] [--no-prefill] [--model M.gguf]``;
``--loaders`` for the loader and huge-page comparison in fresh processes (below).

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
  configure, a 1-token prefill, 64 decodes, stop.  Twice: with the defaults (prefix cache on:
  earlier rounds' prompts stay resident in the KV cells, as they would in service) and with
  ``--prefix-cache off`` (every cell free between requests, as in llama-bench).  And once more
  with the defaults as one **decode run** (docs/protocol.md §11): the 64 tokens are asked for in
  one flagged DecodeEmbd and the stage feeds each prediction to its next step itself, so the
  driver's round trip leaves each token's critical path.

Every figure comes twice: wall tokens/s (what the targets are stated in) and CPU seconds per token
(llama-bench: its process's CPU minus that of a run decoding one token per repetition, so loading
and warm-up cancel; in-process: the calling thread's CPU, where llama.cpp computes with one
thread; stage: this client plus every thread of the stage process).  On this shared 2-core host
the wall figures swing with the neighbours' load even interleaved; CPU per token is the steady
one, and on a quiet host the two agree.

Loaders (``--loaders``): llama-bench maps the file by default (``-lm mmap``); skippy reads the
range's tensors into buffers that sit on transparent huge pages (native/patches/0004).  That mode
measures stock with both loaders and skippy's runtime read on huge pages, read on 4 KiB pages
(``SKIPPY_HUGE_PAGES=0``) and mapped, each measurement in a fresh process (rounds rotated), so the
figures say what the loader and the pages are worth apart from the rest of the runtime.  The
main mode's in-process variant runs in this long-lived process and also measures the same
runtime with the file mapped.

Prefill: 512 random tokens (a fresh prompt every round, so the stage's prefix cache never hits),
one 512-row batch everywhere (llama-bench's default n_ubatch is 512).  Targets (issue 11):
in-process >= 99% and one stage process >= 97% of stock decode tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
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
from stage_chain import FINALS, PROCESSES, chain, cpu_seconds  # noqa: E402

from skippy.driver import StageClient  # noqa: E402
from skippy.net.address import Address  # noqa: E402

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
def stock_run(bench: Path, model: Path, *, n_prompt: int, n_gen: int, reps: int,
              mmap: bool = True) -> tuple[float, float]:
    """(median tokens/s of llama-bench's samples for one test, CPU seconds of the whole process)."""
    command = [str(bench), "-m", str(model), "-t", "1", "-fa", "0", "-ngl", "0", "-r", str(reps),
               "-p", str(n_prompt), "-n", str(n_gen), "-lm", "mmap" if mmap else "none", "-o", "json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({result.returncode}):\n{result.stderr[-3000:]}")
    tests = json.loads(result.stdout)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return float(statistics.median(tests[0]["samples_ts"])), cpu


class Stock:
    """Stock llama-bench; CPU per token from two runs that differ only in the tokens timed."""

    def __init__(self, bench: Path, model: Path, reps: int, mmap: bool = True) -> None:
        self.bench, self.model, self.reps, self.mmap = bench, model, reps, mmap

    def baseline_cpu(self) -> float:
        """CPU of a run that loads, warms up and decodes one token per repetition."""
        return stock_run(self.bench, self.model, n_prompt=0, n_gen=1, reps=self.reps, mmap=self.mmap)[1]

    def decode(self, steps: int, baseline: float) -> tuple[float, float]:
        rate, cpu = stock_run(self.bench, self.model, n_prompt=0, n_gen=steps, reps=self.reps, mmap=self.mmap)
        return rate, (cpu - baseline) / ((steps - 1) * self.reps)

    def prefill(self, n_prompt: int, baseline: float, decode_cpu: float) -> tuple[float, float]:
        """Its warm-up is a whole prompt run, and it decodes none of the baseline's 1 + reps tokens."""
        rate, cpu = stock_run(self.bench, self.model, n_prompt=n_prompt, n_gen=0, reps=self.reps, mmap=self.mmap)
        return rate, (cpu - baseline + (1 + self.reps) * decode_cpu) / (n_prompt * (1 + self.reps))


# -- skippy in-process ---------------------------------------------------------------------------
class InProcess:
    """The runtime with the stage server's context settings, kept open across rounds."""

    def __init__(self, path: Path, cells: int = CTX_SIZE, model: object | None = None) -> None:
        from skippy.runtime import Model, Sampler, StageContext
        from skippy.runtime.sampling import GREEDY

        self.owns_model = model is None
        self.model = Model(path) if model is None else model
        self.ctx = StageContext(self.model, n_ctx=cells, max_sessions=SESSIONS + CACHE_SLOTS,
                                n_batch=BATCH, threads=1)
        self.sampler = Sampler(GREEDY, self.model.n_vocab)
        self.bos = int(_bos(self.model))

    def decode(self, steps: int) -> tuple[float, float]:
        """(tokens/s, CPU seconds per token) of ``steps`` decodes after a 1-token prompt."""
        ctx, samplers = self.ctx, [self.sampler]
        seq = ctx.open_session()
        try:
            ctx.decode(tokens=[self.bos], positions=[0], seq_ids=[seq])
            token = int(ctx.sample(samplers, [0])[0])
            started, cpu_started = time.perf_counter(), time.thread_time()
            for position in range(1, steps + 1):
                ctx.decode(tokens=[token], positions=[position], seq_ids=[seq])
                token = int(ctx.sample(samplers, [0])[0])
            return steps / (time.perf_counter() - started), (time.thread_time() - cpu_started) / steps
        finally:
            ctx.close_session(seq)

    def prefill(self, prompt: Sequence[int]) -> tuple[float, float]:
        ctx = self.ctx
        seq = ctx.open_session()
        try:
            n = len(prompt)
            started, cpu_started = time.perf_counter(), time.thread_time()
            ctx.decode(tokens=np.asarray(prompt, dtype=np.int32), positions=np.arange(n, dtype=np.int32),
                       seq_ids=np.full(n, seq, dtype=np.int32))
            ctx.sample([self.sampler], [n - 1])
            return n / (time.perf_counter() - started), (time.thread_time() - cpu_started) / n
        finally:
            ctx.close_session(seq)

    def close(self) -> None:
        self.sampler.close()
        self.ctx.close()
        if self.owns_model:
            self.model.close()


def _bos(model: object) -> int:
    from skippy.runtime.ffi import lib

    return int(lib.llama_vocab_bos(model.vocab_pointer))  # type: ignore[attr-defined]


# -- skippy as one stage process -----------------------------------------------------------------
async def stage_decode(address: Address, bos: int, steps: int, run: bool = False,
                       direct: bool = False) -> tuple[float, float]:
    """(tokens/s, CPU seconds per token of this client and the stage processes).

    ``run``: the ``steps`` tokens as one decode run (docs/protocol.md §11: the stage feeds each
    token to the next step itself) instead of one DecodeEmbd per token.  ``direct``: the
    predictions come straight from the final stage (docs/protocol.md §8), as the API decodes a
    chain of two or more stages (every stage relays the steady decode outside Python).
    """
    pids = [process.pid for process in PROCESSES.get(address, [])]
    client = await StageClient.connect(address)
    try:
        await client.configure(1)
        if direct:
            assert await client.open_direct_return(FINALS[address], 1)
        token = (await client.prefill(1, [bos], chunk_size=BATCH)).token
        started, cpu_started = time.perf_counter(), cpu_seconds(pids)
        if run:
            token = (await client.start_run(1, token, 1, max_tokens=steps)).predicted
            done = 1
            while client.running:
                token = (await client.next_run_token(1)).predicted
                done += 1
            if done != steps:
                raise AssertionError(f"the decode run made {done} predictions, not {steps}")
        else:
            for position in range(1, steps + 1):
                token = (await client.decode(1, token, position)).predicted
        rate, cpu = steps / (time.perf_counter() - started), (cpu_seconds(pids) - cpu_started) / steps
        await client.stop(1)
        return rate, cpu
    finally:
        await client.aclose()


async def stage_prefill(address: Address, prompt: Sequence[int]) -> tuple[float, float]:
    pids = [process.pid for process in PROCESSES.get(address, [])]
    client = await StageClient.connect(address)
    try:
        await client.configure(1, prompt_token_count=len(prompt))
        started, cpu_started = time.perf_counter(), cpu_seconds(pids)
        await client.prefill(1, prompt, chunk_size=BATCH)
        rate = len(prompt) / (time.perf_counter() - started)
        cpu = (cpu_seconds(pids) - cpu_started) / len(prompt)
        await client.stop(1)
        return rate, cpu
    finally:
        await client.aclose()


# -- KV experiments (in-process A/Bs) -------------------------------------------------------------
def _interleaved_decode(model: object, contexts: dict[str, object], steps: int, rounds: int) -> dict[str, list[float]]:
    """Thread CPU seconds of every decode+sample, the contexts alternated token by token."""
    from skippy.runtime import Sampler
    from skippy.runtime.sampling import GREEDY

    sampler = Sampler(GREEDY, model.n_vocab)  # type: ignore[attr-defined]
    bos = _bos(model)
    costs: dict[str, list[float]] = {name: [] for name in contexts}
    last: dict[str, list[int]] = {name: [] for name in contexts}
    try:
        for _ in range(rounds):
            state = {}
            for name, ctx in contexts.items():
                seq = ctx.open_session()  # type: ignore[attr-defined]
                ctx.decode(tokens=[bos], positions=[0], seq_ids=[seq])  # type: ignore[attr-defined]
                state[name] = (seq, int(ctx.sample([sampler], [0])[0]))  # type: ignore[attr-defined]
            for position in range(1, steps + 1):
                for name, ctx in contexts.items():
                    seq, token = state[name]
                    started = time.thread_time()
                    ctx.decode(tokens=[token], positions=[position], seq_ids=[seq])  # type: ignore[attr-defined]
                    token = int(ctx.sample([sampler], [0])[0])  # type: ignore[attr-defined]
                    costs[name].append(time.thread_time() - started)
                    state[name] = (seq, token)
            for name, ctx in contexts.items():
                last[name].append(state[name][1])
                ctx.close_session(state[name][0])  # type: ignore[attr-defined]
    finally:
        sampler.close()
    if len({tuple(tokens) for tokens in last.values()}) != 1:
        raise AssertionError(f"the variants generated different tokens: {last}")
    return costs


def _report(costs: dict[str, list[float]]) -> None:
    names = list(costs)
    base = costs[names[0]]
    for name in names:
        ratio = statistics.median(b / c for b, c in zip(base, costs[name]))
        print(f"  {name:<34} {statistics.median(costs[name]) * 1e3:6.2f} ms CPU/token; "
              f"speed vs {names[0]}: {100 * ratio:5.1f}% (median of token-paired ratios)")


def kv_experiments(path: Path, rounds: int, steps: int) -> None:
    """(a) a resident prefix in another sequence; (b) a power-of-two KV capacity."""
    from skippy.runtime import Model, StageContext

    with Model(path) as model:
        def context(cells: int = CTX_SIZE) -> StageContext:
            return StageContext(model, n_ctx=cells, max_sessions=SESSIONS + CACHE_SLOTS, n_batch=BATCH, threads=1)

        print("(a) a resident 2048-token prefix in another sequence of the same (unified) KV:")
        empty, busy = context(), context()
        try:
            filler = busy.open_session()
            rng = np.random.default_rng(7)
            for start in range(0, 2048, BATCH):
                busy.decode(tokens=rng.integers(1000, model.n_vocab - 1000, BATCH).astype(np.int32),
                            positions=np.arange(start, start + BATCH, dtype=np.int32),
                            seq_ids=np.full(BATCH, filler, dtype=np.int32))
            _report(_interleaved_decode(model, {"no other cells in use": empty,
                                                "2048 cells of another sequence": busy}, steps, rounds))
        finally:
            empty.close()
            busy.close()
        print("(b) KV capacity (transposed V: a layer's V rows are a cell count apart):")
        variants = {"4096 cells": context(4096), "4352 cells (odd multiple of 256)": context(4352),
                    "4096 cells again (noise floor)": context(4096), "256 cells": context(256)}
        try:
            _report(_interleaved_decode(model, variants, steps, rounds))
        finally:
            for ctx in variants.values():
                ctx.close()


# -- token-paired wall-clock A/B: in-process against stage processes -----------------------------
async def paired_decode(path: Path, rounds: int, steps: int) -> None:
    """Wall time of each token, the variants advanced one token at a time in turn.

    Neighbours on a shared VM move every figure by 10-30% from one minute to the next; a token of
    each variant taken back to back sees the same machine, so the median of the token-paired
    ratios is steady where whole-run medians are not.  Variants: the runtime in-process at 256
    cells (llama-bench's KV size: the stand-in for stock, whose loop cannot be interleaved) and at
    the stage's 4096 cells, and one stage process with the prefix cache on and off.
    """
    n_layer = None
    inproc = InProcess(path)
    small = InProcess(path, cells=256, model=inproc.model)
    n_layer = inproc.model.n_layer
    flags = ["--ctx-size", str(CTX_SIZE), "--batch-size", str(BATCH)]
    with contextlib.ExitStack() as stack:
        stages = {"stage, prefix cache on": stack.enter_context(chain(str(path), [f"0:{n_layer}"], flags)),
                  "stage, prefix cache off": stack.enter_context(
                      chain(str(path), [f"0:{n_layer}"], flags + ["--prefix-cache", "off"]))}
        clients = {name: await StageClient.connect(address) for name, address in stages.items()}
        walls: dict[str, list[float]] = {"in-process, 256 cells": [], "in-process, 4096 cells": [], **{n: [] for n in stages}}
        try:
            for _ in range(rounds + 1):  # the first round warms every path up and is not counted
                warm = not walls["in-process, 256 cells"] and _ == 0
                state: dict[str, tuple[object, int]] = {}
                for name, runtime in (("in-process, 256 cells", small), ("in-process, 4096 cells", inproc)):
                    seq = runtime.ctx.open_session()
                    runtime.ctx.decode(tokens=[runtime.bos], positions=[0], seq_ids=[seq])
                    state[name] = (seq, int(runtime.ctx.sample([runtime.sampler], [0])[0]))
                for name, client in clients.items():
                    await client.configure(1)
                    state[name] = (1, (await client.prefill(1, [inproc.bos], chunk_size=BATCH)).token)
                runtimes = {"in-process, 256 cells": small, "in-process, 4096 cells": inproc}
                for position in range(1, steps + 1):
                    for name in walls:
                        seq, token = state[name]
                        started = time.perf_counter()
                        if name in runtimes:
                            runtime = runtimes[name]
                            runtime.ctx.decode(tokens=[token], positions=[position], seq_ids=[seq])
                            token = int(runtime.ctx.sample([runtime.sampler], [0])[0])
                        else:
                            token = (await clients[name].decode(1, token, position)).predicted
                        if not warm:
                            walls[name].append(time.perf_counter() - started)
                        state[name] = (seq, token)
                finals = {name: state[name][1] for name in walls}
                if len(set(finals.values())) != 1:
                    raise AssertionError(f"the variants generated different tokens: {finals}")
                for name, runtime in runtimes.items():
                    runtime.ctx.close_session(state[name][0])  # type: ignore[arg-type]
                for client in clients.values():
                    await client.stop(1)
        finally:
            for client in clients.values():
                await client.aclose()
            small.close()
            inproc.close()
    base = walls["in-process, 256 cells"]
    print(f"{rounds} rounds x {steps} tokens, token-paired wall time (speed relative to the first line):")
    for name, samples in walls.items():
        ratio = statistics.median(b / c for b, c in zip(base, samples))
        print(f"  {name:<26} {statistics.median(samples) * 1e3:6.2f} ms/token (median); "
              f"speed {100 * ratio:5.1f}% (median of token-paired ratios)")


# -- the run -------------------------------------------------------------------------------------
Sample = tuple[float, float]  # (tokens/s, CPU seconds per token)


#: One in-process measurement in a fresh process (``--loaders``): load, warm up, three blocks of
#: decodes, print the median tokens/s.  A fresh process per measurement, as llama-bench is one:
#: a process keeps the physical pages its weights landed on, and between processes that alone
#: moves decode speed by up to 10% on this host, so a long-lived worker is one draw, not a figure.
_FRESH_WORKER = r"""
import statistics, sys, time
from skippy.runtime import Model, Sampler, StageContext
from skippy.runtime.sampling import GREEDY
path, load, steps, cells, sessions = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = Model(path, use_mmap=load == "mmap")
context = StageContext(model, n_ctx=cells, max_sessions=sessions, n_batch=512, threads=1)
sampler = Sampler(GREEDY, model.n_vocab)
bos = 2 if model.n_vocab > 2 else 0
def block(n):
    seq = context.open_session()
    context.decode(tokens=[bos], positions=[0], seq_ids=[seq])
    token = int(context.sample([sampler], [0])[0])
    started = time.perf_counter()
    for position in range(1, n + 1):
        context.decode(tokens=[token], positions=[position], seq_ids=[seq])
        token = int(context.sample([sampler], [0])[0])
    rate = n / (time.perf_counter() - started)
    context.close_session(seq)
    return rate
block(2)
print(statistics.median(block(steps) for _ in range(3)))
"""


def fresh_in_process(path: Path, steps: int, *, load: str, huge_pages: bool) -> float:
    """Median decode tokens/s of three blocks in a fresh process (the stage's context settings)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SKIPPY_HUGE_PAGES", None)
    if not huge_pages:
        env["SKIPPY_HUGE_PAGES"] = "0"
    result = subprocess.run([sys.executable, "-c", _FRESH_WORKER, str(path), load, str(steps), str(CTX_SIZE),
                             str(SESSIONS + CACHE_SLOTS)], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"in-process worker failed:\n{result.stderr[-3000:]}")
    return float(result.stdout.split()[-1])


def loader_experiment(path: Path, rounds: int, steps: int) -> None:
    """Stock llama-bench and skippy's runtime, each loader, a fresh process per measurement."""
    peer = build_peer()

    def stock(load: str) -> float:
        command = [str(peer.llama_bench), "-m", str(path), "-t", "1", "-fa", "0", "-ngl", "0", "-r", "3",
                   "-p", "0", "-n", str(steps), "-lm", load, "-o", "json"]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        return float(statistics.median(json.loads(result.stdout)[0]["samples_ts"]))

    variants = {
        "stock llama-bench (-lm mmap, its default)": lambda: stock("mmap"),
        "stock llama-bench -lm none": lambda: stock("none"),
        "skippy, read + huge pages (default)": lambda: fresh_in_process(path, steps, load="read", huge_pages=True),
        "skippy, read, SKIPPY_HUGE_PAGES=0": lambda: fresh_in_process(path, steps, load="read", huge_pages=False),
        "skippy, file mapped (--mmap on)": lambda: fresh_in_process(path, steps, load="mmap", huge_pages=True),
    }
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:  # order rotated each round
            rates[name].append(variants[name]())
        print(f"round {index + 1}: " + ", ".join(f"{rates[n][-1]:.1f}" for n in names), flush=True)
    stock_rates, stock_read = rates[names[0]], rates[names[1]]
    print(f"decode tg{steps}, tokens/s (median of {rounds} rounds, a fresh process each), 1 thread:")
    for name in names:
        ratio = statistics.median(r / s for r, s in zip(rates[name], stock_rates))
        same = statistics.median(r / s for r, s in zip(rates[name], stock_read))
        print(f"  {name:<44} {statistics.median(rates[name]):6.2f}   {100 * ratio:5.1f}% of stock,"
              f" {100 * same:5.1f}% of stock -lm none (per-round ratios)")


def _summary(name: str, samples: list[Sample], reference: list[Sample] | None, target: str = "") -> str:
    rates = [rate for rate, _ in samples]
    cpus = [cpu for _, cpu in samples]
    line = f"  {name:<24} {statistics.median(rates):7.2f} tok/s, {statistics.median(cpus) * 1e3:6.2f} ms CPU/token"
    if reference is not None:
        ref_rates = [rate for rate, _ in reference]
        ref_cpus = [cpu for _, cpu in reference]
        wall = [100 * r / s for r, s in zip(rates, ref_rates)]
        cpu = [100 * s / c for c, s in zip(cpus, ref_cpus)]
        line += (f"\n      wall: {100 * statistics.median(rates) / statistics.median(ref_rates):5.1f}% of stock"
                 f" (median of per-round ratios {statistics.median(wall):5.1f}%: {', '.join(f'{x:.0f}' for x in wall)})"
                 f"\n      CPU:  {100 * statistics.median(ref_cpus) / statistics.median(cpus):5.1f}% of stock's speed"
                 f" (median of per-round ratios {statistics.median(cpu):5.1f}%: {', '.join(f'{x:.0f}' for x in cpu)})"
                 f"{'  ' + target if target else ''}")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the real Gemma 3 270M from skippy-llm[real-model])")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=64, help="decode tokens per measurement")
    parser.add_argument("--reps", type=int, default=1, help="llama-bench repetitions per round")
    parser.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--no-stage", action="store_true", help="skip the stage-process variant")
    parser.add_argument("--split", type=int, default=0, metavar="N",
                        help="also an N-stage chain (even layer split), decoded hop by hop and with direct "
                             "return (the API's way from two stages on)")
    parser.add_argument("--kv-experiments", action="store_true",
                        help="only the in-process KV A/Bs (resident prefix; power-of-two capacity)")
    parser.add_argument("--loaders", action="store_true",
                        help="only decode in fresh processes: stock with each loader against skippy's runtime "
                             "read on huge pages (default), read on 4 KiB pages, and mapped")
    parser.add_argument("--paired", action="store_true",
                        help="only the token-paired wall-clock A/B of in-process and stage-process decode")
    args = parser.parse_args()

    path = model_path(args.model)
    if args.paired:
        trio.run(paired_decode, path, args.rounds, args.steps)
        return
    if args.loaders:
        loader_experiment(path, args.rounds, args.steps)
        return
    if args.kv_experiments:
        kv_experiments(path, args.rounds, args.steps)
        return
    peer = build_peer()
    stock = Stock(peer.llama_bench, path, args.reps)
    # llama-bench maps the file by default; skippy reads the range's tensors into memory (faster on
    # the hosts measured): both loaders are measured on both sides, so the table shows what is whose
    stock_read = Stock(peer.llama_bench, path, args.reps, mmap=False)
    inproc = InProcess(path)
    from skippy.runtime import Model

    mapped = InProcess(path, model=Model(path, use_mmap=True))
    mapped.owns_model = True
    # llama-bench's own context is n_prompt + n_gen cells (256 here): the same runtime at that size
    # separates what llama.cpp's transposed-V layout costs at the stage's 4096 cells from skippy
    small = InProcess(path, cells=256, model=inproc.model)
    n_layer = inproc.model.n_layer
    print(f"model {path.name}: {inproc.model.architecture}, {n_layer} layers, n_embd {inproc.model.n_embd}, "
          f"n_vocab {inproc.model.n_vocab}; KV {inproc.ctx.n_ctx} cells; 1 thread everywhere; "
          f"{args.steps} decode tokens; {args.rounds} interleaved rounds", flush=True)
    rng = np.random.default_rng(1234)
    names = ("stock", "stock-read", "in-process", "in-process-mmap", "in-process-256", "stage", "stage-nocache", "stage-run", "split", "split-direct", "stock-pp", "in-process-pp", "stage-pp", "stage-nocache-pp")
    runs: dict[str, list[Sample]] = {name: [] for name in names}
    flags = ["--ctx-size", str(CTX_SIZE), "--batch-size", str(BATCH)]
    try:
        with contextlib.ExitStack() as stack:
            if not args.no_stage:
                address = stack.enter_context(chain(str(path), [f"0:{n_layer}"], flags))
                bare = stack.enter_context(chain(str(path), [f"0:{n_layer}"], flags + ["--prefix-cache", "off"]))
                trio.run(stage_decode, address, inproc.bos, 4)  # warm the stage's first-request paths
                trio.run(stage_decode, bare, inproc.bos, 4)
                trio.run(stage_decode, address, inproc.bos, 4, True)
            if args.split > 1:
                bounds = [round(n_layer * index / args.split) for index in range(args.split + 1)]
                split = stack.enter_context(chain(str(path), [f"{a}:{b}" for a, b in zip(bounds, bounds[1:])],
                                                  flags))
                trio.run(stage_decode, split, inproc.bos, 4)
                trio.run(stage_decode, split, inproc.bos, 4, False, True)
            for round_index in range(args.rounds):
                baseline = stock.baseline_cpu()
                runs["stock"].append(stock.decode(args.steps, baseline))
                runs["stock-read"].append(stock_read.decode(args.steps, stock_read.baseline_cpu()))
                runs["in-process"].append(inproc.decode(args.steps))
                runs["in-process-mmap"].append(mapped.decode(args.steps))
                runs["in-process-256"].append(small.decode(args.steps))
                if not args.no_stage:
                    runs["stage"].append(trio.run(stage_decode, address, inproc.bos, args.steps))
                    runs["stage-nocache"].append(trio.run(stage_decode, bare, inproc.bos, args.steps))
                    runs["stage-run"].append(trio.run(stage_decode, address, inproc.bos, args.steps, True))
                if args.split > 1:
                    runs["split"].append(trio.run(stage_decode, split, inproc.bos, args.steps))
                    runs["split-direct"].append(trio.run(stage_decode, split, inproc.bos, args.steps, False, True))
                if not args.no_prefill:
                    prompt = [inproc.bos] + [int(t) for t in rng.integers(1000, inproc.model.n_vocab - 1000,
                                                                          args.prompt - 1)]
                    runs["stock-pp"].append(stock.prefill(args.prompt, baseline, runs["stock"][-1][1]))
                    runs["in-process-pp"].append(inproc.prefill(prompt))
                    if not args.no_stage:
                        runs["stage-pp"].append(trio.run(stage_prefill, address, prompt))
                        runs["stage-nocache-pp"].append(trio.run(stage_prefill, bare, prompt))
                print(f"round {round_index + 1}: " + ", ".join(
                    f"{k} {v[-1][0]:.1f} tok/s {v[-1][1] * 1e3:.2f} ms" for k, v in runs.items() if v), flush=True)
    finally:
        small.close()
        mapped.close()
        inproc.close()
    print(f"decode (tg{args.steps}), medians; CPU = seconds of CPU per token (stage: client + stage process):")
    print(_summary("stock llama-bench", runs["stock"], None))
    print(_summary("stock llama-bench -lm none", runs["stock-read"], runs["stock"], "(tensors read, not mapped)"))
    print(_summary("skippy in-process", runs["in-process"], runs["stock"], "(target >= 99%)"))
    print(_summary("  same, file mapped", runs["in-process-mmap"], runs["stock"], "(llama-bench's loader)"))
    print(_summary("  same, 256 KV cells", runs["in-process-256"], runs["stock"], "(llama-bench's KV size)"))
    if runs["stage"]:
        print(_summary("skippy 1 stage process", runs["stage"], runs["stock"], "(target >= 97%)"))
        print(_summary("  same, prefix cache off", runs["stage-nocache"], runs["stock"], "(target >= 97%)"))
        print(_summary("  same, one decode run", runs["stage-run"], runs["stock"], "(docs/protocol.md §11)"))
    if runs["split"]:
        print(_summary(f"skippy {args.split} stages, hop by hop", runs["split"], runs["stock"]))
        print(_summary(f"skippy {args.split} stages, direct return", runs["split-direct"], runs["stock"],
                       "(the API's default; relayed outside Python)"))
    if runs["stock-pp"]:
        print(f"prefill (pp{args.prompt}), medians:")
        print(_summary("stock llama-bench", runs["stock-pp"], None))
        print(_summary("skippy in-process", runs["in-process-pp"], runs["stock-pp"]))
        if runs["stage-pp"]:
            print(_summary("skippy 1 stage process", runs["stage-pp"], runs["stock-pp"]))
            print(_summary("  same, prefix cache off", runs["stage-nocache-pp"], runs["stock-pp"]))


if __name__ == "__main__":
    main()
