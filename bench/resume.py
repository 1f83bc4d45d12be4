"""Resume after a lost stage (docs/protocol.md §14): what the activation log costs, and kill to next token.

Two measurements on a 3-stage chain of real ``python -m skippy.stage`` processes (any GGUF;
default: the tiny generated llama, the worst case for the log's relative cost since its compute
per token is smallest):

* ``cost``: decode tokens/s with the log on (``--resume-log-mib 64``) and off (``0``), two
  chains up at once, rounds interleaved (on, off, on, off, ...); the ratio of the medians.
  Also the log's bytes per position per stage (from the stats file).
* ``step``: the first stage's executor alone (no processes, no sockets), one decode step at a
  time with the log on and off, rounds interleaved: the log's cost where it is paid.
* ``relay``: the decode relay's per-token time on the non-final stages (its compute, which
  includes keeping the row for the log, and its downstream write: the stats' ``compute_us`` and
  ``forward_write_us`` over ``decode_relay_steps``) with the log on and off, two chains with
  direct return up at once, rounds interleaved (which goes first alternating).
* ``kill``: a request with a ``--context``-token prompt; after ``--kill-at`` tokens the middle
  stage is SIGKILLed and restarted on its port.  Reports kill-to-next-token, the replacement's
  start-up (process to READY), and the resume itself (``usage.skippy_resume``'s ``resume_ms``:
  wait + configure + replay), with the log on, and with it off (the survivors recompute).
* ``up-kill``: the same through ``skippy up`` and its API (streamed completion, prefix cache and
  speculation off), the lost stage replaced by the launcher: a fresh start (``--restarts``) and
  the warm standby (``--standby``), one after the other.

    PYTHONPATH=. python bench/resume.py cost --rounds 6 --tokens 64
    PYTHONPATH=. python bench/resume.py step --real --splits 0:6,6:12,12:18 --tokens 150
    PYTHONPATH=. python bench/resume.py relay --rounds 10 --tokens 200
    PYTHONPATH=. python bench/resume.py kill --context 1000
    PYTHONPATH=. python bench/resume.py up-kill --real --splits 0:6,6:12,12:18 --context 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from stage_helpers import StageProcess, stage_chain, wait_for_stats  # noqa: E402

from skippy.driver import GenerationRequest, Generator, StageClient  # noqa: E402
from skippy.models.cache import ensure_model  # noqa: E402
from skippy.models.spec import tiny  # noqa: E402

SPLITS: list[str] = ["0:1", "1:3", "3:4"]


def _generator(model: Path, n_ctx: int) -> Generator:
    generator = Generator.from_model(model, n_ctx=n_ctx, chunk_size=256, credit=2, speculation=False)
    generator.prefix_cache = False
    generator.resume_attempts, generator.resume_wait_s = 3, 60.0
    return generator


async def _decode_rate(generator: Generator, stage: StageProcess, tokens: int, session: int) -> float:
    assert stage.address is not None
    async with await StageClient.connect(stage.address) as client:
        request = GenerationRequest(tuple(range(1, 17)), tokens)
        result = await generator.start(client, request, session).run()
    return result.timing.decode_tokens_per_second(result.completion_tokens)


async def cost(model: Path, rounds: int, tokens: int, ctx: int) -> None:
    generator = _generator(model, ctx)
    with tempfile.TemporaryDirectory() as on_dir, tempfile.TemporaryDirectory() as off_dir:
        async with stage_chain(str(model), SPLITS, Path(on_dir), extra=("--resume-log-mib", "64")) as on, \
                stage_chain(str(model), SPLITS, Path(off_dir), extra=("--resume-log-mib", "0")) as off:
            rates: dict[str, list[float]] = {"on": [], "off": []}
            session = 100
            await _decode_rate(generator, on[0], 8, session)  # warm both
            await _decode_rate(generator, off[0], 8, session + 1)
            for _ in range(rounds):
                for name, chain in (("on", on), ("off", off)):
                    session += 2
                    rates[name].append(await _decode_rate(generator, chain[0], tokens, session))
            on_rate, off_rate = statistics.median(rates["on"]), statistics.median(rates["off"])
            print(f"decode tok/s, median of {rounds} interleaved rounds of {tokens} tokens: "
                  f"log on {on_rate:.1f}, log off {off_rate:.1f}; on/off = {on_rate / off_rate:.4f}")
            print("  rounds on :", " ".join(f"{r:.1f}" for r in rates["on"]))
            print("  rounds off:", " ".join(f"{r:.1f}" for r in rates["off"]))
            # log memory: one session held open mid-decode
            assert on[0].address is not None
            async with await StageClient.connect(on[0].address) as client:
                generation = generator.start(client, GenerationRequest(tuple(range(1, 101)), 50), 999)
                for _ in range(20):
                    await generation.__anext__()
                moment = time.time()
                stats = await wait_for_stats(on[0], lambda s: s.get("refreshed_at", 0) > moment)
                positions = 100 + 19
                print(f"log memory, stage 0, one session of {positions} positions: {stats['resume']['log_bytes']} "
                      f"bytes = {stats['resume']['log_bytes'] / positions:.0f} bytes per position")
                await generation.abort()
    generator.close()


async def relay(model: Path, rounds: int, tokens: int, ctx: int) -> None:
    with tempfile.TemporaryDirectory() as on_dir, tempfile.TemporaryDirectory() as off_dir:
        async with stage_chain(str(model), SPLITS, Path(on_dir), extra=("--resume-log-mib", "64")) as on, \
                stage_chain(str(model), SPLITS, Path(off_dir), extra=("--resume-log-mib", "0")) as off:
            chains = {"on": on, "off": off}
            generators = {name: _generator(model, ctx) for name in chains}
            for name, chain in chains.items():
                generators[name].direct_return = lambda chain=chain: chain[-1].address  # type: ignore[misc]
            per_token: dict[str, list[list[float]]] = {"on": [], "off": []}
            session = 200
            for index in range(rounds + 1):  # the first round warms both
                for name in (("on", "off") if index % 2 else ("off", "on")):
                    chain, session = chains[name], session + 1
                    moment = time.time()
                    before = [await wait_for_stats(s, lambda d: d.get("refreshed_at", 0) > moment) for s in chain[:2]]
                    await trio.sleep(0.6)  # a lane that brought work lately keeps the relay from starting
                    await _decode_rate(generators[name], chain[0], tokens, session)
                    moment = time.time()
                    after = [await wait_for_stats(s, lambda d: d.get("refreshed_at", 0) > moment) for s in chain[:2]]
                    figures = []
                    for old, new in zip(before, after):
                        steps = new["decode_relay_steps"] - old["decode_relay_steps"]
                        spent = sum(new[field] - old[field] for field in ("compute_us", "forward_write_us"))
                        figures.append(spent / steps if steps else float("nan"))
                    if index:
                        per_token[name].append(figures)
            for stage in range(2):
                on_us = statistics.median(r[stage] for r in per_token["on"])
                off_us = statistics.median(r[stage] for r in per_token["off"])
                print(f"stage {stage} ({SPLITS[stage]}): relay us per token (compute + downstream write), median of "
                      f"{rounds} interleaved rounds of {tokens} tokens: log on {on_us:.1f}, off {off_us:.1f}; "
                      f"on/off {on_us / off_us:.4f}")
                print("  rounds on :", " ".join(f"{r[stage]:.1f}" for r in per_token["on"]))
                print("  rounds off:", " ".join(f"{r[stage]:.1f}" for r in per_token["off"]))
            for generator in generators.values():
                generator.close()


async def kill(model: Path, context: int, kill_at: int, ctx: int) -> None:
    generator = _generator(model, ctx)
    prompt = tuple(1 + (i * 7919) % 30000 for i in range(context))
    for budget in ("64", "0"):
        with tempfile.TemporaryDirectory() as directory:
            extra = ("--resume-log-mib", budget, "--ctx-size", str(ctx))
            async with stage_chain(str(model), SPLITS, Path(directory), extra=extra) as stages:
                for stage in stages:
                    assert stage.address is not None
                    stage.listen = f"127.0.0.1:{stage.address.port}"
                assert stages[0].address is not None
                async with await StageClient.connect(stages[0].address) as client:
                    generation = generator.start(client, GenerationRequest(prompt, kill_at + 8), 7)
                    gaps: list[float] = []
                    last = time.perf_counter()
                    killed = ready = 0.0
                    async with trio.open_nursery() as nursery:
                        async for _ in generation:
                            now = time.perf_counter()
                            gaps.append(now - last)
                            last = now
                            if len(generation.tokens) == kill_at:
                                stages[1].kill()
                                killed = time.perf_counter()

                                async def restart() -> None:
                                    nonlocal ready
                                    await stages[1].start()
                                    ready = time.perf_counter()
                                nursery.start_soon(restart)
                            elif killed and len(gaps) == kill_at + 1:
                                break
                    next_token = last - killed
                    assert generation.result is None or generation.result.resumes
                    resumes = generation.resumes
                    await generation.abort()
                print(f"log {'on ' if budget != '0' else 'off'}: context {context} + {kill_at} tokens; kill to next "
                      f"token {next_token * 1e3:.0f} ms; replacement start to READY {(ready - killed) * 1e3:.0f} ms; "
                      f"lane re-opened and replay sent {resumes[0]['reopened_ms']:.0f} ms; next token "
                      f"{(last - ready) * 1e3:.0f} ms after READY; TTFT of the request "
                      f"{generation.timing.time_to_first_token * 1e3:.0f} ms; median token gap "
                      f"before {statistics.median(gaps[1:kill_at]) * 1e3:.1f} ms")
    generator.close()


def up_kill(model: Path, context: int, kill_at: int, ctx: int) -> None:
    import json
    import os
    import re
    import signal

    import httpx
    from api_helpers import UpProcess  # noqa: E402  (tests/, on sys.path above)

    stage = re.compile(r"stage 1 \(layers \S+\) pid (\d+) ready on")
    prompt = "The quick brown fox jumps over the lazy dog. " * max(1, context // 10)
    for how in ("--restarts", "--standby"):
        with tempfile.TemporaryDirectory() as directory:
            extra = ["--restarts", "1"] + (["--standby"] if how == "--standby" else [])
            up = UpProcess(["up", "--model", str(model), "--layers", ",".join(SPLITS), "--port", "0", "--ctx-size",
                            str(ctx), "--threads", "1", "--log-dir", f"{directory}/logs", *extra],
                           Path(directory)).start()
            try:
                if how == "--standby":
                    deadline = time.monotonic() + 120
                    while not any("waiting for activation" in p.read_text(errors="replace")
                                  for p in Path(directory, "logs").glob("stage-1-*standby*.log")):
                        assert time.monotonic() < deadline, "no standby"
                        time.sleep(0.2)
                match = stage.search(up.stderr())
                assert match is not None
                pid = int(match.group(1))
                name = httpx.get(up.url + "/v1/models").json()["data"][0]["id"]
                body = {"model": name, "prompt": prompt, "max_tokens": kill_at + 8, "temperature": 0,
                        "ignore_eos": True, "prefix_cache": False, "speculation": False, "stream": True,
                        "stream_options": {"include_usage": True}}
                chunks, gaps, killed, next_token, usage, last = 0, [], 0.0, 0.0, {}, time.perf_counter()
                with httpx.stream("POST", up.url + "/v1/completions", json=body, timeout=300) as response:
                    if response.status_code != 200:  # a refusal: a JSON body, no data: line
                        raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(f"the stream failed: {chunk['error']}")
                        usage = chunk.get("usage") or usage
                        if not chunk.get("choices"):
                            continue
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last, chunks = now, chunks + 1
                        if chunks == kill_at:
                            lost = re.findall(r"warning: stage \d \(\S+\) lost: [^\n]*", up.stderr())
                            assert not lost, f"a stage was lost before the kill: {lost}"
                            os.kill(pid, signal.SIGKILL)
                            killed = time.perf_counter()
                        elif chunks == kill_at + 1:
                            next_token = now - killed
                resume = (usage.get("skippy_resume") or [{}])[0]
                again = re.search(r"stage 1 \(layers \S+\) pid \d+ (restarted|standby) in ([\d.]+) s", up.stderr())
                print(f"{how[2:]}: prompt {usage.get('prompt_tokens')} tokens + {kill_at}; kill to next token "
                      f"{next_token * 1e3:.0f} ms (replacement ready in {again.group(2) if again else '?'} s; "
                      f"lane re-opened {resume.get('reopened_ms', 0):.0f} ms, resume {resume.get('resume_ms', 0):.0f} "
                      f"ms, mode {resume.get('mode')}); median token gap before "
                      f"{statistics.median(gaps[1:kill_at]) * 1e3:.1f} ms")
            finally:
                up.stop()


def step(model: Path, rounds: int, steps: int, ctx: int) -> None:
    import numpy as np

    from skippy.lane.protocol import Outputs
    from skippy.lane.work import WorkItem
    from skippy.stage.config import config_from_mapping
    from skippy.stage.server import load_runtime

    config = config_from_mapping({"model": str(model), "layers": SPLITS[0], "downstream": "127.0.0.1:1",
                                  "threads": 1, "ctx_size": ctx, "prefix_cache": False})
    executor = load_runtime(config)
    budgets, rates = {"on": 64 << 20, "off": 0}, {"on": [], "off": []}  # type: ignore[var-annotated]
    key = 1
    for index in range(rounds):
        for name in (("on", "off") if index % 2 else ("off", "on")):  # alternate which goes first
            executor.configure_resume(budgets[name], 30.0)
            key += 1
            executor.configure(key, None)
            executor.run_item(WorkItem(key, np.arange(16, dtype=np.int32), np.arange(1, 17, dtype=np.int32), None,
                                       None, Outputs.NONE, prefill=True))
            started = time.perf_counter_ns()
            for position in range(16, 16 + steps):
                executor.run_decode_batch([WorkItem(key, np.array([position], dtype=np.int32),
                                                    np.array([5], dtype=np.int32), None, position, Outputs.LAST)])
            rates[name].append((time.perf_counter_ns() - started) / steps / 1000)
            executor.release(key)
    executor.close()
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(f"{model.name} layers {SPLITS[0]}: us per decode step, median of {rounds} interleaved rounds of {steps}: "
          f"log on {on:.1f}, off {off:.1f}; on/off {on / off:.4f}")
    print("  rounds on :", " ".join(f"{r:.1f}" for r in rates["on"]))
    print("  rounds off:", " ".join(f"{r:.1f}" for r in rates["off"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["cost", "step", "relay", "kill", "up-kill"])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the tiny generated llama)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--splits", default=",".join(SPLITS), help="the chain's layer ranges (3 stages)")
    parser.add_argument("--real", action="store_true", help="the real Gemma 3 270M (skippy[real-model])")
    args = parser.parse_args()
    SPLITS[:] = args.splits.split(",")
    if args.real:
        from skippy.models.real import ensure_real_model
        args.model = ensure_real_model()
    model = args.model or ensure_model(tiny("llama"))
    if args.what == "cost":
        trio.run(cost, model, args.rounds, args.tokens, args.ctx_size)
    elif args.what == "relay":
        trio.run(relay, model, args.rounds, args.tokens, args.ctx_size)
    elif args.what == "up-kill":
        up_kill(model, args.context, args.kill_at, args.ctx_size)
    elif args.what == "step":
        step(model, args.rounds, args.tokens, args.ctx_size)
    else:
        trio.run(kill, model, args.context, args.kill_at, args.ctx_size)


if __name__ == "__main__":
    main()
