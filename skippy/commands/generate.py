"""``skippy generate [--layers 0:2,2:4 | --first-stage HOST:PORT] "prompt"``: text through a split model.

With ``--first-stage`` the prompt goes through a running chain (``python -m skippy.stage`` processes
or ``skippy up``) via :class:`skippy.driver.Generator`: text streams to the terminal as it is
generated and a timing summary (TTFT, tokens/s, per-stage compute from the reply stats) ends it.

Otherwise the stages of the split are called back to back in this process (``LocalChain``); the
same prompt then runs through the unsplit model; the command prints both texts, whether the tokens
agree, and timings (prefill, decode tokens/s, per-stage compute).  With no ``--model`` it uses the
generated demo model (written once into the model cache).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from skippy.runtime.local import LocalChain, check_split, even_split, parse_split


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text through a split model in one process (compared with the unsplit run)",
        description=__doc__,
    )
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", type=Path, help="GGUF model (default: the generated demo model)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--layers", help="contiguous layer ranges, e.g. 0:4,4:8 (default: two even stages)")
    group.add_argument("--stages", type=int, help="number of even stages")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    parser.add_argument("--no-compare", action="store_true", help="skip the unsplit comparison run")
    parser.add_argument("--first-stage", metavar="HOST:PORT",
                        help="stream through a running chain whose first stage listens here (needs the same --model)")
    parser.add_argument("--chat", action="store_true", help="with --first-stage: wrap the prompt in the chat template")
    parser.add_argument("--stop", action="append", default=[], help="with --first-stage: stop string (repeatable)")
    parser.set_defaults(run=run)


async def _stream_from_chain(path: Path, args: argparse.Namespace) -> int:
    import random

    from skippy.driver import GenerationRequest, Generator, StageClient, StageClientError
    from skippy.runtime import SamplingParams

    generator = Generator.from_model(path)
    try:
        text = args.prompt
        if args.chat:
            text = generator.apply_chat_template([{"role": "user", "content": text}])
        prompt = generator.encode(text)
        max_tokens = generator.check_fits(len(prompt), args.max_tokens)
        params = SamplingParams(temperature=max(0.0, args.temperature), seed=args.seed & 0xFFFFFFFF)
        stop = generator.chat_stop(args.stop) if args.chat else tuple(args.stop)
        request = GenerationRequest(tuple(prompt), max_tokens, params, stop)
        async with await StageClient.connect(args.first_stage) as client:
            run = generator.start(client, request, random.getrandbits(30) + 1)
            if not args.chat:
                sys.stdout.write(args.prompt)
            async for piece in run:
                sys.stdout.write(piece)
                sys.stdout.flush()
        assert run.result is not None
        print()
        print(f"[{run.result.finish_reason}] {run.result.timing.summary(run.result.completion_tokens)}")
        return 0
    except StageClientError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        generator.close()


def _demo_model() -> Path:
    from skippy.models.cache import ensure_model
    from skippy.models.spec import demo

    return ensure_model(demo())


def _timed_generate(path: Path, split: list[tuple[int, int]], prompt: list[int], args: argparse.Namespace
                    ) -> tuple[list[int], float, float, list[float]]:
    from skippy.runtime import SamplingParams

    params = SamplingParams(temperature=max(0.0, args.temperature), seed=args.seed)
    with LocalChain(path, split, n_ctx=max(512, len(prompt) + args.max_tokens + 8), max_sessions=1,
                    n_batch=64, threads=args.threads) as chain:
        started = time.perf_counter()
        tokens = chain.generate(prompt, args.max_tokens, params)
        total_s = time.perf_counter() - started
        prefill_s = chain.prefill_seconds
        decode_s = max(1e-9, total_s - prefill_s)
        per_stage = list(chain.times.compute)
    return tokens, prefill_s, decode_s, per_stage


def run(args: argparse.Namespace) -> int:
    from skippy.runtime import NativeError, read_gguf_info
    from skippy.runtime.tokenizer import Tokenizer

    path = args.model or _demo_model()
    if args.first_stage:
        import trio

        try:
            result: int = trio.run(_stream_from_chain, path, args)
        except (NativeError, ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return result
    try:
        info = read_gguf_info(path)
        if args.layers:
            split = parse_split(args.layers)
            check_split(split, info.n_layer, info.kv_groups)
        else:
            split = even_split(info.n_layer, args.stages or 2, info.kv_groups)
        if split[-1][1] != info.n_layer:
            raise ValueError(f"the ranges end at layer {split[-1][1]} but the model has {info.n_layer} layers")
        with Tokenizer(path) as tokenizer:
            prompt = tokenizer.encode(args.prompt)
            runs = [("split " + ",".join(f"{a}:{b}" for a, b in split), split)]
            if not args.no_compare:
                runs.append(("unsplit", [(0, info.n_layer)]))
            results = []
            for label, layout in runs:
                tokens, prefill_s, decode_s, per_stage = _timed_generate(path, layout, prompt, args)
                results.append(tokens)
                text = tokenizer.decode(tokens)
                print(f"== {label}")
                print(args.prompt + text)
                rate = len(tokens) / decode_s if tokens else 0.0
                stages = ", ".join(f"{a}:{b} {t * 1000:.1f} ms" for (a, b), t in zip(layout, per_stage))
                print(f"   prompt {len(prompt)} tokens in {prefill_s * 1000:.1f} ms; "
                      f"{len(tokens)} tokens at {rate:.1f} tok/s; stage compute: {stages}")
    except (NativeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(results) == 2:
        same = results[0] == results[1]
        print(f"tokens identical to the unsplit run: {'yes' if same else 'NO'}")
        if not same and args.temperature <= 0:
            return 1
    return 0
