"""Issue 26: a Gemma 4 stage's memory, as the planner and the runtime count it and as it is resident.

Gemma 4's layers do not all keep the same KV: the sliding-window layers' heads are narrower than the
global ones' (``key_length_swa``) and the trailing ``shared_kv_layers`` keep none (they read earlier
layers'), and without flash attention llama.cpp pads every V row to the widest layer's.  The fast
test checks the per-layer figures against the KV buffers llama.cpp allocates for a stage.  The slow
test plans a
real-shape Gemma 4 (E2B's widths) over three hosts, runs each planned stage as a real stage process
and checks its resident memory against the plan's figure (within 7%), printing the table.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import trio
from skippy.deploy.plan import MIB, HostSpec, ModelShape, PlanSettings, plan_chain, stage_memory
from skippy.driver.client import StageClient
from skippy.models import ensure_model, preset, tiny
from skippy.runtime import LayerRange, Model, StageContext, read_gguf_info
from stage_helpers import StageProcess

#: llama.cpp's report of a KV cache it allocates (each of the sliding-window and global caches).
KV_LOG = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells")


def test_kv_per_cell_is_what_llama_cpp_allocates(caplog: pytest.LogCaptureFixture) -> None:
    """6 layers (local, global, ...), local heads half as wide as global ones, the last two sharing
    the KV of layers 2 and 3: each stage's KV buffers (llama.cpp's own report, at a context where
    they are whole MiB) are the stage's layers' K plus V rows padded to the widest layer's, none for
    the sharing layers; the runtime (GGUFInfo) and the planner (ModelShape) agree."""
    spec = dataclasses.replace(tiny("gemma4", n_layer=6), n_kv_shared_layers=2)  # type: ignore[arg-type]
    path = ensure_model(spec)
    info, shape = read_gguf_info(path), ModelShape.from_gguf(path)
    v_row = spec.n_head_kv * spec.n_embd_head
    local, wide = (spec.n_head_kv * spec.head_dim_swa + v_row) * 2, (spec.n_head_kv * spec.n_embd_head + v_row) * 2
    assert info.kv_layer_bytes == (local, wide, local, wide, 0, 0)
    n_ctx = 16384
    for start, end in ((0, 2), (2, 6), (0, 6)):
        assert info.kv_bytes_per_cell(start, end) == shape.kv_bytes_per_cell(start, end)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="skippy.llama"):
            with Model(path, LayerRange(start, end)) as model, StageContext(model, n_ctx=n_ctx, max_sessions=1, n_batch=8, threads=1):
                pass
        reports = [KV_LOG.search(r.getMessage()) for r in caplog.records]
        sizes = [(float(m.group(1)), int(m.group(2))) for m in reports if m]
        assert sizes and all(cells == n_ctx for _, cells in sizes), sizes
        assert sum(mib for mib, _ in sizes) * MIB == n_ctx * info.kv_bytes_per_cell(start, end), (start, end, sizes)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
async def test_e2b_planned_stages_resident_within_seven_percent(tmp_path: Path) -> None:
    """Gemma 4 E2B's shape (Q8_0): a 3-host plan (cuts at or before layer 13, where the KV-sharing
    group starts), each stage started from the plan file, a request served, and each stage
    process's resident memory within 7% of the plan's figure."""
    path = ensure_model(preset("gemma4-e2b"))
    shape = ModelShape.from_gguf(path)
    settings = PlanSettings(ctx_size=2048, max_sessions=2, batch_size=64, cache_spill_mib=64)
    total = stage_memory(shape, 0, shape.n_layer, settings).peak
    hosts = [HostSpec("a", total * 6 // 10), HostSpec("b", total * 6 // 10), HostSpec("c", total)]
    plan = plan_chain(shape, hosts, settings)
    assert all(s.end <= 13 for s in plan.stages[:2]) and plan.stages[-1].end == 35
    file = tmp_path / "plan.toml"
    file.write_text(plan.to_toml())
    processes: list[StageProcess] = []
    try:
        downstream = None
        for stage in reversed(plan.stages):
            extra = ["--config", str(file), "--plan-stage", str(stage.index), "--threads", "1"]
            if downstream is not None:
                extra += ["--downstream", str(downstream)]
            process = StageProcess(str(path), stage.layers, tmp_path / f"stage{stage.index}.log", extra=extra)
            processes.insert(0, process)
            downstream = await process.start(timeout=180)
        client = await StageClient.connect(processes[0].address)  # type: ignore[arg-type]
        try:
            prompt = [(7 * i) % 1000 + 10 for i in range(120)]
            tokens = await client.generate_greedy(1, prompt, 8, chunk_size=64)
            assert len(tokens) == 8
        finally:
            await client.aclose()
        await trio.sleep(0.2)
        print(f"\ngemma4-e2b: {plan.describe()}")
        print("| stage | layers | weights | KV | compute | planned resident | measured resident | diff |")
        print("|---|---|---|---|---|---|---|---|")
        for stage, process in zip(plan.stages, processes):
            assert process.process is not None
            resident, memory = _rss(process.process.pid), stage.memory
            expected = memory.resident
            print(f"| {stage.index} | {stage.layers} | {memory.weights / MIB:.0f} MiB | {memory.kv / MIB:.0f} MiB | "
                  f"{memory.compute / MIB:.0f} MiB | {expected / MIB:.0f} MiB | {resident / MIB:.0f} MiB | "
                  f"{resident / expected - 1:+.1%} |")
            assert memory.peak <= stage.host.memory
            assert abs(resident - expected) <= 0.07 * expected, (stage.layers, resident, expected)
    finally:
        for process in processes:
            process.kill()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_stage_weights_are_what_llama_cpp_loads(tied: bool) -> None:
    """The planner's weights of each range are llama.cpp's own count: every stage holds the token
    embeddings (per-layer inputs), and a tied head on the last stage is a second copy of them (the
    loader creates it first, so it cannot share token_embd's tensor); the per-layer table is mapped
    and read by rows, in neither.  The one difference: the global layers' rope frequencies (a file
    tensor the planner gives every stage), which a stage of sliding-window layers only never loads."""
    spec = tiny("gemma4", tied=tied)
    path = ensure_model(spec)
    shape = ModelShape.from_gguf(path)
    assert shape.tied_head == tied
    rope_freqs = spec.n_embd_head // 2 * 4
    for start, end in ((0, 1), (1, 3), (2, 4), (3, 4)):
        planned = stage_memory(shape, start, end, PlanSettings()).weights
        with Model(path, LayerRange(start, end)) as model:
            only_local = all((il + 1) % spec.swa_period for il in range(start, end))
            assert planned == model.size_bytes + (rope_freqs if only_local else 0), (start, end)
