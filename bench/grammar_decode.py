"""Decode tokens/s with a json_schema grammar against the same prompt without one.

Run: ``PYTHONPATH=. .venv/bin/python bench/grammar_decode.py [--model real|tiny|M.gguf] [--stages 2]
[--tokens 48] [--rounds 3] [--sampling greedy|top-k]``.  Prints one line per run and a summary.

Strategy: one ``skippy up`` chain (stage processes + API, as a user runs it).  Each round sends
the same completions request twice, in alternating order: once with ``response_format``
json_schema (a person: name, age, hobbies; it ends when the JSON does), once without (the
end-of-generation token biased away, so it runs to ``--tokens``; completions add no chat-template
stop string).  The figures are the API's own ``usage.skippy_timing``: decode tokens/s (first
to last token, at the driver) and the final stage's compute per token (where the grammar runs).
``greedy`` keeps the grammar beside the sampler (it checks the greedy pick and masks the
vocabulary only when the pick is forbidden); ``top-k`` (temperature 0.8, top_k 40) puts it in the
chain, masking the whole vocabulary at every token.  Medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from api_helpers import UpProcess  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PROMPT = "Here is a fictional person described as JSON, with a name, an age and hobbies:\n"


def model_path(name: str) -> Path:
    if name == "real":
        from skippy.models.real import ensure_real_model

        return ensure_real_model()
    if name == "tiny":
        from skippy.models.cache import ensure_model
        from skippy.models.spec import tiny

        return ensure_model(tiny("llama"))
    return Path(name)


def run(http: httpx.Client, url: str, model: str, tokens: int, grammar: bool, sampling: str, eos: int,
        seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "seed": seed,
                            "speculation": False, "prefix_cache": False}
    body.update({"temperature": 0} if sampling == "greedy" else {"temperature": 0.8, "top_k": 40})
    if grammar:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    else:
        body["logit_bias"] = {str(eos): -100}
    response = http.post(url + "/v1/completions", json=body)
    response.raise_for_status()
    data = response.json()
    usage = data["usage"]
    timing = usage["skippy_timing"]
    final = timing["stages"][-1]
    count = usage["completion_tokens"]
    return {"tokens": count, "tok_s": timing["decode_tokens_per_second"],
            "final_compute_ms_per_token": final["compute_ms"] / max(1, count),  # the (cached) prefill included
            "text": data["choices"][0]["text"], "finish": data["choices"][0]["finish_reason"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="real", help="real (Gemma 3 270M), tiny (generated llama) or a GGUF path")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sampling", choices=("greedy", "top-k"), default="greedy")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    path = model_path(args.model)
    from skippy.runtime.tokenizer import Tokenizer

    with Tokenizer(path) as tokenizer:
        eos = tokenizer.eos
    with tempfile.TemporaryDirectory() as directory:
        up = UpProcess(["up", "--model", str(path), "--stages", str(args.stages), "--port", "0", "--ctx-size", "1024",
                        "--threads", str(args.threads), "--log-dir", str(Path(directory) / "logs")],
                       Path(directory)).start(timeout=300)
        try:
            model = path.stem
            results: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            with httpx.Client(timeout=600) as http:
                run(http, up.url, model, 8, True, args.sampling, eos, 0)  # warm-up (grammar parse, caches)
                for index in range(args.rounds):
                    for grammar in ((True, False) if index % 2 == 0 else (False, True)):
                        result = run(http, up.url, model, args.tokens, grammar, args.sampling, eos, index)
                        results[grammar].append(result)
                        print(f"round {index} {'grammar' if grammar else 'plain  '}: {result['tokens']:3d} tokens, "
                              f"{result['tok_s']:7.2f} tok/s, final stage {result['final_compute_ms_per_token']:6.2f} "
                              f"ms/token, finish {result['finish']}", flush=True)
                        if grammar and result["finish"] == "stop":
                            json.loads(result["text"])  # a finished grammar answer is JSON
        finally:
            up.stop()
    plain = statistics.median(r["tok_s"] for r in results[False])
    constrained = statistics.median(r["tok_s"] for r in results[True])
    plain_ms = statistics.median(r["final_compute_ms_per_token"] for r in results[False])
    constrained_ms = statistics.median(r["final_compute_ms_per_token"] for r in results[True])
    print(f"model {path.name}, {args.stages} stages, {args.sampling}: decode {constrained:.2f} tok/s with the "
          f"json_schema grammar vs {plain:.2f} without ({constrained / plain * 100:.1f}%); final stage "
          f"{constrained_ms:.2f} vs {plain_ms:.2f} ms compute per token (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
