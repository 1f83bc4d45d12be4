"""Resident memory of each stage of a real-width hybrid against ``skippy plan`` (issue 25, deliver 4).

Run: ``PYTHONPATH=. .venv/bin/python bench/recurrent_memory.py [--experts 32] [--layers 8] [--stages 3]``.

Strategy: the ``qwen35moe-35b-a3b-8l`` preset (Qwen3.5-35B-A3B's block widths: delta-net layers
with 16 key / 32 value heads of 128 and a 4-wide conv, gated attention every fourth layer, experts
of width 512, 8 used, a shared expert; Q8_0) with ``--experts`` experts instead of 256 (the full
preset is a 7.3 GB file; the experts are 94% of it, so fewer experts change the weights per layer,
not the widths or the state).  ``skippy plan`` splits it over ``--stages`` hosts of equal memory;
each planned stage is started from the plan file as a stage process (``--threads 1``), one
120-token request with 8 greedy decode steps is served through the chain, and each process's
VmRSS is compared with the plan's ``resident`` figure (weights + KV of the attention layers +
recurrent state of every sequence id + compute reserve + process overhead).  ``--layers 4
--experts 256`` keeps every width of the real model, the 256 experts included, with its first
group of three delta-net layers and one attention layer (a 3.7 GB file).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from stage_helpers import StageProcess  # noqa: E402

from skippy.deploy.plan import MIB, HostSpec, ModelShape, PlanSettings, plan_chain, stage_memory  # noqa: E402
from skippy.driver.client import StageClient  # noqa: E402
from skippy.models import ensure_model, preset  # noqa: E402


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def main(experts: int, layers: int, n_stages: int) -> None:
    path = ensure_model(preset("qwen35moe-35b-a3b-8l", n_expert=experts, n_layer=layers))
    shape = ModelShape.from_gguf(path)
    settings = PlanSettings(ctx_size=2048, max_sessions=2, batch_size=64, cache_spill_mib=64)
    total = stage_memory(shape, 0, shape.n_layer, settings).peak
    hosts = [HostSpec(chr(ord("a") + i), total * 6 // 10) for i in range(n_stages)]
    plan = plan_chain(shape, hosts, settings)
    print(f"{path.name}: {path.stat().st_size / MIB:.0f} MiB, {shape.n_layer} layers, {experts} experts")
    print(plan.describe())
    with tempfile.TemporaryDirectory() as directory:
        file = Path(directory) / "plan.toml"
        file.write_text(plan.to_toml())
        processes: list[StageProcess] = []
        try:
            downstream = None
            for stage in reversed(plan.stages):
                extra = ["--config", str(file), "--plan-stage", str(stage.index), "--threads", "1"]
                if downstream is not None:
                    extra += ["--downstream", str(downstream)]
                process = StageProcess(str(path), stage.layers, Path(directory) / f"stage{stage.index}.log", extra=extra)
                processes.insert(0, process)
                downstream = await process.start(timeout=300)
            client = await StageClient.connect(processes[0].address)  # type: ignore[arg-type]
            try:
                prompt = [(7 * i) % 1000 + 10 for i in range(120)]
                tokens = await client.generate_greedy(1, prompt, 8, chunk_size=64)
                assert len(tokens) == 8
            finally:
                await client.aclose()
            await trio.sleep(0.5)
            print("\n| stage | layers | weights MiB | KV MiB | state MiB | compute MiB | planned MiB | resident MiB | diff |")
            print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
            for stage, process in zip(plan.stages, processes):
                assert process.process is not None
                memory = stage.memory
                resident = _rss(process.process.pid)
                print(f"| {stage.index} | {stage.layers} | {memory.weights / MIB:.0f} | {memory.kv / MIB:.1f} | "
                      f"{memory.state / MIB:.1f} | {memory.compute / MIB:.0f} | {memory.resident / MIB:.0f} | "
                      f"{resident / MIB:.0f} | {resident / memory.resident - 1:+.1%} |")
        finally:
            for process in processes:
                process.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, args.experts, args.layers, args.stages)
