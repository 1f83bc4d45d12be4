"""API overhead: TTFT and decode tokens/s through the HTTP API against ``StageClient`` directly.

Run: ``PYTHONPATH=. .venv/bin/python bench/bench_api.py [--model M.gguf] [--stages 2] [--tokens 64]
[--repeat 5]``.  Prints one line per figure.

Strategy: one ``skippy up`` chain (stage processes + API in one process, as a user runs it).  The
same greedy request (completion of the same prompt tokens, EOS biased away so every run makes
exactly ``--tokens`` tokens) runs alternately (a) through ``Generator`` on a ``StageClient`` lane
opened directly to the first stage, and (b) as a streaming ``/v1/completions`` request over HTTP
(httpx, SSE parsed here).  Both are timed at the client: TTFT is the time to the first token's
text, decode time is first to last token.  The API's cost is the relative difference in decode
time per token (target <= 5%).  Medians over ``--repeat`` runs of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from api_helpers import UpProcess  # noqa: E402
from skippy.driver import GenerationRequest, Generator, StageClient  # noqa: E402
from skippy.runtime import SamplingParams  # noqa: E402

PROMPT = "The three best things about distributed inference are"


async def direct_run(generator: Generator, address: str, prompt: list[int], tokens: int,
                     params: SamplingParams, session: int) -> tuple[float, float, int]:
    async with await StageClient.connect(address) as client:
        started = time.perf_counter()
        run = generator.start(client, GenerationRequest(tuple(prompt), tokens, params), session)
        first = last = 0.0
        async for _ in run:
            last = time.perf_counter()
            if not first:
                first = last
    assert run.result is not None
    return first - started, last - first, run.result.completion_tokens


def http_run(url: str, model: str, prompt: list[int], tokens: int, eos: int) -> tuple[float, float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(eos): -100}, "stream_options": {"include_usage": True}}
    count = 0
    with httpx.Client(timeout=120) as http:
        started = time.perf_counter()
        first = last = 0.0
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    count = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0]["finish_reason"] is None:
                    last = time.perf_counter()
                    if not first:
                        first = last
    return first - started, last - first, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="GGUF model (default: the generated demo model)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="compute threads per stage (default 1)")
    parser.add_argument("--log-dir", type=Path, help="keep the stage logs here (default: a temporary directory)")
    args = parser.parse_args()

    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        command = ["up", "--stages", str(args.stages), "--port", "0", "--threads", str(args.threads),
                   "--ctx-size", "1024", "--log-dir", str(args.log_dir or Path(directory) / "logs")]
        if args.model:
            command += ["--model", str(args.model)]
        up = UpProcess(command, Path(directory)).start()
        try:
            first_stage = [line.split("ready on ")[1].strip() for line in up.stderr().splitlines()
                           if line.startswith("stage 0 ") and "ready on" in line][0]
            model_id = httpx.get(up.url + "/v1/models").json()["data"][0]["id"]
            path = args.model or _demo()
            generator = Generator.from_model(path)
            prompt = generator.encode(PROMPT)
            eos = generator.tokenizer.eos
            params = SamplingParams(logit_bias=((eos, -100.0),))
            direct: list[tuple[float, float, int]] = []
            http: list[tuple[float, float, int]] = []
            http_run(up.url, model_id, prompt, 4, eos)  # warm up both paths
            trio.run(direct_run, generator, first_stage, prompt, 4, params, 1)
            for index in range(args.repeat):
                direct.append(trio.run(direct_run, generator, first_stage, prompt, args.tokens, params, 100 + index))
                http.append(http_run(up.url, model_id, prompt, args.tokens, eos))
            generator.close()
        finally:
            up.stop()
    print(f"model {path.name}, {args.stages} stages, {len(prompt)} prompt tokens, {args.tokens} tokens, "
          f"{args.repeat} runs each (medians)")
    rows = {}
    for label, runs in (("StageClient", direct), ("HTTP API", http)):
        ttft = statistics.median(r[0] for r in runs) * 1000
        per_token = statistics.median(r[1] / max(1, r[2] - 1) for r in runs) * 1000
        counts = {r[2] for r in runs}
        rows[label] = per_token
        print(f"{label:12s} TTFT {ttft:7.2f} ms   decode {1000 / per_token:7.1f} tok/s "
              f"({per_token:.3f} ms/token; tokens per run {sorted(counts)})")
    overhead = rows["HTTP API"] / rows["StageClient"] - 1
    print(f"API overhead on decode time per token: {overhead * 100:+.1f}% (target <= 5%)")
    return 0


def _demo() -> Path:
    from skippy.models.cache import ensure_model
    from skippy.models.spec import demo

    return ensure_model(demo())


if __name__ == "__main__":
    sys.exit(main())
