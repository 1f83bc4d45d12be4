# Simulation harness for driver-side speculative decoding over a modelled chain.
#
# Strategy: replay a token stream the target model produced (greedy, so the target's prediction at
# any correct prefix is the next stream token) through the real `SpeculativeDecoder` (proposer,
# controller, window FIFO) against a discrete-event model of the chain:
#
# * stage i runs messages FIFO; a message of n rows occupies it for overhead + c_i(n), where
#   c_i(n) is measured on the real stage split (`LocalChain`, per-stage decode times) or given;
#   with `cores` the stages share that many cores (a message's traversal is placed when sent);
# * each stage boundary adds a one-way delay (default 5 ms); the driver sits next to stage 0 and
#   the final stage returns predictions straight to the driver across one boundary, so a 2-stage
#   chain has a 10 ms network round trip;
# * the driver's own CPU time (proposing, bookkeeping) is measured and added to the clock.
#
# The same harness with speculation disabled gives the plain decode baseline.  Rows past a
# rejected draft get the stream's token too: they are discarded by the acceptance rule anyway.
#
# Usage: PYTHONPATH=. python bench/speculation_sim.py [--tokens 160] [--delay-ms 5] [--stages 2]
#        PYTHONPATH=. python bench/speculation_sim.py --peer-requests 8 [--spikes 0.05] [--old-kernels]
#        (peer_compare's speculation rounds: requests on fresh chains, a noisy host)
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from skippy.driver.speculation import SpeculationConfig, SpeculationUsage, SpeculativeDecoder
from skippy.driver.speculation.controller import ControllerConfig, SessionLoad

StageCost = Callable[[int], float]


@dataclass(frozen=True)
class ChainModel:
    """Per-stage compute (seconds for n rows), one-way delay per boundary, per-message overhead."""

    stage_costs: Sequence[StageCost]
    one_way_delay: float = 0.005
    stage_overhead: float = 0.0003
    #: Cores the stages share (None: one each): a stage computes only on a free core, so a
    #: pipeline of more stages than cores does not overlap fully (this host: 2 cores).
    cores: int | None = None


@dataclass
class SimResult:
    tokens: int
    seconds: float
    usage: SpeculationUsage
    window_sizes: list[int] = field(default_factory=list)
    #: Per reply of a window with drafts: (rows, continuation, drafts kept, drafts judged, stale).
    windows: list[tuple[int, bool, int, int, bool]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def linear_cost(single_row: float, extra_row: float) -> StageCost:
    """c(n) = single_row + extra_row * (n - 1)."""
    return lambda rows: single_row + extra_row * (rows - 1)


def simulate(prompt: Sequence[int], stream: Sequence[int], chain: ChainModel,
             config: SpeculationConfig, *, driver_time: bool = True, load: SessionLoad | None = None) -> SimResult:
    """Decode ``stream`` (the target's tokens after ``prompt``) through the modelled chain.

    ``driver_time``: the decoder's own Python time (measured) advances the simulated clock; off, the
    run is deterministic (the tests' setting: a loaded host must not change a decision).
    ``load``: the chain's :class:`SessionLoad`, shared by consecutive requests as the Generator's
    is (what one request measured, the next adopts).

    Returns:
        Tokens, simulated seconds from the first decode step, and the usage counters.
    """
    full = list(prompt) + list(stream)
    stages = len(chain.stage_costs)
    decoder = SpeculativeDecoder(prompt, stream[0], config=config, max_tokens=len(stream), load=load)
    free = [0.0] * stages
    cores = [0.0] * (chain.cores or stages)  # when each core is next free
    in_flight: deque[tuple[float, int, float, float, tuple[int, ...], int]] = deque()
    now = 0.0
    last_reply = 0.0
    sizes: list[int] = []
    windows: list[tuple[int, bool, int, int, bool]] = []

    def send(base: int, tokens: tuple[int, ...], window_id: int, sent_at: float) -> None:
        rows = len(tokens)
        arrival = sent_at
        compute = 0.0
        for index, cost in enumerate(chain.stage_costs):
            busy = cost(rows)
            compute += busy
            core = min(range(len(cores)), key=cores.__getitem__)
            start = max(arrival, free[index], cores[core])
            free[index] = cores[core] = start + chain.stage_overhead + busy
            arrival = free[index] + (chain.one_way_delay if stages > 1 else 0.0)
        in_flight.append((arrival, window_id, sent_at, compute, tokens, base))

    while not decoder.done:
        started = time.perf_counter()
        while (request := decoder.next_window()) is not None:
            sizes.append(len(request.tokens))
            send(request.base_position, request.tokens, request.window_id, now)
        now += time.perf_counter() - started if driver_time else 0.0
        if not in_flight:
            raise RuntimeError("the decoder sent nothing while not done")
        arrival, window_id, sent_at, compute, tokens, base = in_flight.popleft()
        now = max(now, arrival)
        predicted = [full[base + i + 1] if base + i + 1 < len(full) else 0 for i in range(len(tokens))]
        started = time.perf_counter()
        outcome = decoder.on_reply(window_id, predicted, wall_seconds=now - sent_at, compute_seconds=compute,
                                   interval_seconds=now - max(sent_at, last_reply))
        if outcome.window.drafts:
            windows.append((len(tokens), outcome.window.continuation, outcome.accepted, outcome.proposed,
                            outcome.stale))
        last_reply = now
        now += time.perf_counter() - started if driver_time else 0.0
    if decoder.generated != list(stream):
        raise AssertionError("speculative decoding changed the greedy output")
    return SimResult(len(stream), now, decoder.usage, sizes, windows)


def measure_stage_costs(path: Path, split: list[tuple[int, int]], max_rows: int, reps: int = 5) -> list[StageCost]:
    """Median per-stage decode seconds for 1..max_rows rows on the real split (interpolated).

    A first sweep warms llama.cpp up (the first batches of a new shape are much slower).
    """
    from skippy.runtime.local import LocalChain

    with LocalChain(path, split, n_ctx=512) as chain:
        chain.prefill(list(range(100, 132)))
        table: list[list[float]] = [[0.0] * (max_rows + 1) for _ in split]
        for rows in [*range(1, max_rows + 1)] * 2:
            chain.decode(list(range(200, 200 + rows)), list(range(32, 32 + rows)), [0] * rows, [True] * rows)
            chain.each("remove", 0, 32, -1)
        for rows in range(1, max_rows + 1):
            samples: list[list[float]] = [[] for _ in split]
            for _ in range(reps):
                before = list(chain.times.compute)
                chain.decode(list(range(200, 200 + rows)), list(range(32, 32 + rows)), [0] * rows,
                             [True] * rows)
                for index, total in enumerate(chain.times.compute):
                    samples[index].append(total - before[index])
                chain.each("remove", 0, 32, -1)
            for index in range(len(split)):
                table[index][rows] = statistics.median(samples[index])
    # Fit c(n) = c1 + extra (n - 1) per stage: medians on shared CPUs are noisy and a lone spike in
    # the table would otherwise decide the controller's fate.
    costs: list[StageCost] = []
    rows_axis = list(range(1, max_rows + 1))
    for row in table:
        slope = statistics.linear_regression(rows_axis, row[1:]).slope
        costs.append(linear_cost(row[1], max(slope, 0.0)))
    return costs


def edit_stream(text: str) -> str:
    """A plausible "apply an edit" answer: the same code with a renamed identifier and a new line."""
    renamed = re.sub(r"\bself\b", "this", text)
    lines = renamed.splitlines(keepends=True)
    middle = len(lines) // 2
    return "".join(lines[:middle] + ["    # edited: renamed self to this\n"] + lines[middle:])


#: Compute of one traversal of llama-16x1024 F16 on one CPU thread, by rows (thread time;
#: bench/RESULTS-stage.md): two rows cost 2.6 one-row steps, further rows ~0.3 each.
CPU_F16 = {1: 0.0194, 2: 0.0503, 3: 0.0504, 4: 0.0647, 5: 0.0653, 9: 0.0882, 17: 0.1398}


def cpu_f16(rows: int) -> float:
    """CPU_F16 interpolated (pairs of rows cost alike)."""
    if rows in CPU_F16:
        return CPU_F16[rows]
    below = max(n for n in CPU_F16 if n < rows)
    above = min((n for n in CPU_F16 if n > rows), default=17)
    if above == below:
        return CPU_F16[17] + (rows - 17) * (CPU_F16[17] - CPU_F16[9]) / 8
    return CPU_F16[below] + (CPU_F16[above] - CPU_F16[below]) * (rows - below) / (above - below)


#: The same after patch 0018 (small batches on a kernel that reads the weights once; thread time of
#: ``LocalChain`` decodes of 1..17 rows in process, 2026-12-06, shared host, rounded): 2 and 3 rows cost
#: ~1.2 one-row steps, 4-8 rows 1.7-2.8, 9 rows (past the kernel's 8 columns) 4.6.
CPU_F16_0018 = {1: 0.0194, 2: 0.0225, 3: 0.0230, 4: 0.0330, 5: 0.0370, 6: 0.0430, 7: 0.0500, 8: 0.0540,
                9: 0.0900, 12: 0.1120, 17: 0.1500}


def table_cost(table: dict[int, float], rows: int) -> float:
    """``table`` interpolated between its sizes (extrapolated past the largest by its last slope)."""
    if rows in table:
        return table[rows]
    below = max(n for n in table if n < rows)
    above = min((n for n in table if n > rows), default=None)
    if above is None:
        previous = max(n for n in table if n < below)
        return table[below] + (rows - below) * (table[below] - table[previous]) / (below - previous)
    return table[below] + (table[above] - table[below]) * (rows - below) / (above - below)


def noisy(cost: StageCost, rng: random.Random, spikes: float, low: float = 2.0, high: float = 6.0) -> StageCost:
    """``cost`` slowed ``low``..``high`` times on a fraction ``spikes`` of traversals (a shared
    host's stalls: noise only slows a traversal)."""
    return lambda rows: cost(rows) * (rng.uniform(low, high) if rng.random() < spikes else 1.0)


def peer_requests(requests: int, steps: int, *, table: dict[int, float] = CPU_F16_0018, spikes: float = 0.0,
                  seed: int = 1) -> None:
    """bench/peer_compare.py's speculation as consecutive requests on one chain (their
    SessionLoad shared, as the Generator's): the llama-16x1024 greedy streams of its code prompt
    and of its LOOP, through chains of 1, 2 and 4 stages on 2 shared cores (``table`` split
    evenly, 0.2 ms each way, 0.5 ms a message; ``spikes``: that fraction of each stage's
    traversals 2-6x slower, :func:`noisy`, seeded), each request on a fresh chain after one request
    of its own as ``peer_compare --fresh-chains`` measures; each measured request's extra ms per
    token over plain decode (under the same noise), and the windows it sent."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_compare import CODE, LOOP, MODEL_PRESET

    from skippy.driver import Generator
    from skippy.models.cache import ensure_model
    from skippy.models.spec import preset
    from skippy.runtime import SamplingParams
    from skippy.runtime.local import LocalChain

    path = ensure_model(preset(MODEL_PRESET))
    generator = Generator.from_model(path, n_ctx=1024)
    try:
        code = generator.encode(CODE)
    finally:
        generator.close()
    workloads: dict[str, tuple[list[int], list[int]]] = {}
    with LocalChain(path, [(0, preset(MODEL_PRESET).n_layer)], n_ctx=1024, threads=1) as chain:
        for name, prompt in (("code", code), ("loop", list(LOOP))):
            workloads[name] = (prompt, chain.generate(prompt, steps, SamplingParams(), stop_at_eog=False))
            chain.each("remove", 0)
    rng = random.Random(seed)
    for name, (prompt, stream) in workloads.items():
        for stages in (1, 2, 4):
            def chain() -> ChainModel:
                def stage_cost(rows: int) -> float:
                    return table_cost(table, rows) / stages
                return ChainModel([noisy(stage_cost, rng, spikes)] * stages, 0.0002, 0.0005, cores=2)
            config = SpeculationConfig(controller=ControllerConfig(stages=stages))
            load = SessionLoad()
            extra, windows = [], []
            for _ in range(requests):
                model = chain()
                simulate(prompt, stream, model, config, driver_time=False, load=load)  # the fresh chain's first
                run = simulate(prompt, stream, model, config, driver_time=False, load=load)
                plain = simulate(prompt, stream, chain(), SpeculationConfig(enabled=False), driver_time=False)
                extra.append((run.seconds - plain.seconds) / len(stream) * 1e3)
                windows.append(len(run.windows))
            print(f"{name} {stages} stage(s): speculation's extra ms/token by request "
                  f"{' '.join(f'{x:+.2f}' for x in extra)}; median {statistics.median(extra):+.2f}; windows "
                  f"{' '.join(map(str, windows))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=160, help="tokens generated per workload")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay per stage boundary")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--overhead-ms", type=float, default=0.3, help="per-stage per-message overhead")
    parser.add_argument("--model", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--depth", type=int, default=4, help="max verify windows in flight")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="fixed one-row compute summed over stages (skips measuring; split evenly)")
    parser.add_argument("--row-ms", type=float, default=None, help="fixed extra compute per row, summed")
    parser.add_argument("--peer-requests", type=int, default=0,
                        help="only peer_compare's speculation, N consecutive requests per chain (peer_requests)")
    parser.add_argument("--spikes", type=float, default=0.0,
                        help="with --peer-requests: the fraction of stage traversals 2-6x slower (seeded noise)")
    parser.add_argument("--old-kernels", action="store_true",
                        help="with --peer-requests: the costs before patch 0018 (CPU_F16) instead of CPU_F16_0018")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.peer_requests:
        peer_requests(args.peer_requests, 64, table=CPU_F16 if args.old_kernels else CPU_F16_0018,
                      spikes=args.spikes, seed=args.seed)
        return

    from skippy.runtime.local import LocalChain, even_split
    from skippy.models.cache import ensure_model
    from skippy.models.spec import demo, tiny
    from skippy.runtime import SamplingParams
    from skippy.runtime.tokenizer import Tokenizer

    spec = demo() if args.model == "demo" else tiny()
    path = ensure_model(spec)
    split = even_split(spec.n_layer, args.stages)
    tokenizer = Tokenizer(path)
    code = Path(__file__).resolve().parents[1].joinpath("skippy", "runtime", "local.py").read_text()[:2400]
    prompts = {
        "repetitive (code, greedy)": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n" * 3,
        "non-repetitive prompt (greedy)": "The quick brown fox jumps over the lazy dog while seven zebras quietly vanish.",
    }
    workloads: dict[str, tuple[list[int], list[int]]] = {}
    started = time.perf_counter()
    with LocalChain(path, split, n_ctx=2048) as chain:
        for name, text in prompts.items():
            prompt = tokenizer.encode(text)
            workloads[name] = (prompt, chain.generate(prompt, args.tokens, SamplingParams(), stop_at_eog=False))
            chain.each("remove", 0)
        prompt = tokenizer.encode(prompts["non-repetitive prompt (greedy)"])
        sampled = chain.generate(prompt, args.tokens, SamplingParams(temperature=1.0, seed=7), stop_at_eog=False)
        workloads["non-repetitive (sampled stream)"] = (prompt, sampled)
    code_prompt = tokenizer.encode("Rename self to this in:\n" + code)
    workloads["code edit (synthetic)"] = (code_prompt, tokenizer.encode(edit_stream(code))[:args.tokens])
    generated = time.perf_counter() - started

    if args.compute_ms is not None:
        row_ms = args.row_ms if args.row_ms is not None else 0.1 * args.compute_ms
        costs = [linear_cost(args.compute_ms / 1000 / args.stages, row_ms / 1000 / args.stages)] * args.stages
    else:
        costs = measure_stage_costs(path, split, ControllerConfig().max_window + 2)
    share = max(cost(5) for cost in costs) / sum(cost(5) for cost in costs)
    controller = ControllerConfig(stages=args.stages, max_depth=args.depth, bottleneck_share=share)
    chain_model = ChainModel(costs, args.delay_ms / 1000.0, args.overhead_ms / 1000.0)
    one_row = sum(cost(1) for cost in costs) * 1000
    nine_rows = sum(cost(9) for cost in costs) * 1000
    print(f"model {args.model} split {split}; streams generated in {generated:.1f}s; compute summed over "
          f"stages: 1 row {one_row:.2f} ms, 9 rows {nine_rows:.2f} ms; one-way delay {args.delay_ms} ms "
          f"per boundary; overhead {args.overhead_ms} ms per stage message; depth <= {args.depth}; "
          f"bottleneck share {share:.2f}")
    print(f"{'workload':34} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'accept':>7} "
          f"{'proposed':>8} {'windows':>7} {'stale':>5} {'rollbk':>6}")
    for name, (prompt, stream) in workloads.items():
        plain = simulate(prompt, stream, chain_model, SpeculationConfig(enabled=False, controller=controller))
        spec_run = simulate(prompt, stream, chain_model, SpeculationConfig(controller=controller))
        usage = spec_run.usage
        print(f"{name:34} {plain.tokens_per_second:11.1f} {spec_run.tokens_per_second:10.1f} "
              f"{spec_run.tokens_per_second / plain.tokens_per_second:7.2f}x {usage.acceptance_rate:7.2f} "
              f"{usage.proposed:8d} {usage.windows:7d} {usage.stale_windows:5d} {usage.rollbacks:6d}")


if __name__ == "__main__":
    main()
