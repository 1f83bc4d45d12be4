"""``skippy demo``: the local pipeline end to end in one command.

Strategy: run ``skippy up`` (2 stages of the default model unless told otherwise: the real
Gemma 3 270M when the ``skippy-llm[real-model]`` extra is installed, else the generated demo model) in
this process; once the API answers, send one streaming greedy chat completion over plain HTTP
(urllib in a worker thread, so the demo needs nothing beyond the standard library), print the
answer as it streams and the timings from ``usage``, then stop everything.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from typing import Any

import trio

from skippy.commands.up import DEMO_MODEL_ID, add_chain_arguments, configure_logging, run_up


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="start a local chain, send one chat completion through it, stop",
                                   description=__doc__)
    add_chain_arguments(parser)
    parser.add_argument("--port", type=int, default=0, help="API port (default: any free port)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens to generate (default 24)")
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?",
                        help="the user message")
    parser.set_defaults(run=run)


def _model_id(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        name: str = json.load(response)["data"][0]["id"]
    return name


def chat(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Send one streaming chat completion; print text as it arrives; return the usage."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices", []):
                sys.stdout.write(choice["delta"].get("content") or "")
                sys.stdout.flush()
            usage = event.get("usage") or usage
    print()
    return usage


def run(args: argparse.Namespace) -> int:
    configure_logging()
    outcome: dict[str, Any] = {}

    async def on_ready(url: str) -> None:
        model = outcome["model"] = await trio.to_thread.run_sync(_model_id, url)
        print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
        try:
            outcome["usage"] = await trio.to_thread.run_sync(chat, url, model, args.prompt, args.max_tokens)
        except (OSError, RuntimeError, ValueError) as exc:  # HTTP/URL errors are OSErrors; error events RuntimeError
            outcome["error"] = str(exc)

    code = trio.run(run_up, args, on_ready)
    if "error" in outcome:
        print(f"error: the chat completion failed: {outcome['error']}", file=sys.stderr)
        return 1
    usage = outcome.get("usage")
    if usage:
        timing = usage.get("skippy_timing", {})
        print(f"usage: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens; "
              f"TTFT {timing.get('time_to_first_token_ms', 0):.1f} ms, "
              f"decode {timing.get('decode_tokens_per_second', 0):.1f} tok/s, "
              f"stage compute {timing.get('stage_compute_ms', 0):.1f} ms over {timing.get('stage_count', 0)} stages")
        if outcome.get("model") == DEMO_MODEL_ID:
            print("(the demo model has random weights: the text is gibberish, the pipeline is real)")
    return code
