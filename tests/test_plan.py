"""The planner (skippy/deploy/plan.py, ``skippy plan``): shapes from the header, splits that fit, refusals
that name the host and the shortfall, and plan files the stage and ``skippy up`` accept.

The slow test runs each planned stage as a real stage process from the plan file and checks its
resident memory against the plan's figure (within 10%) on real model shapes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import trio

from skippy.deploy.plan import (
    GIB,
    MIB,
    HostSpec,
    ModelShape,
    PlanError,
    PlanSettings,
    load_plan,
    plan_chain,
    stage_memory,
)
from skippy.driver.client import StageClient
from skippy.models.cache import ensure_model
from skippy.models.spec import preset
from skippy.runtime import Model
from skippy.stage.config import parse_config

from conftest import model_path
from stage_helpers import StageProcess


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layers", ["0:4", "0:1", "1:3", "2:4", "3:4"])
def test_stage_weights_match_what_llama_loads(tied: bool, layers: str) -> None:
    """The header-only weight figure of a range is exactly what llama.cpp loads for it."""
    path = model_path("llama", tied=tied)
    shape = ModelShape.from_gguf(path)
    start, end = map(int, layers.split(":"))
    with Model(path, layers) as model:
        assert stage_memory(shape, start, end, PlanSettings()).weights == model.size_bytes


def test_shape_counts_every_tensor_once() -> None:
    shape = ModelShape.from_gguf(model_path("qwen3moe"))
    assert shape.n_layer == 4 and len(shape.layer_bytes) == 4 and min(shape.layer_bytes) > 0
    assert shape.embed_bytes > 0 and shape.head_bytes > 0 and not shape.tied_head
    assert len(shape.digest) == 64
    assert shape.kv_bytes_per_cell_layer > 0


def test_host_spec_parsing() -> None:
    host = HostSpec.parse("10.0.0.2=16GiB,gpu=24GiB,speed=1.5,port=7100")
    assert (host.name, host.memory, host.gpu_memory, host.speed, host.port) == ("10.0.0.2", 16 * GIB, 24 * GIB, 1.5, 7100)
    assert HostSpec.parse("a=512MiB").memory == 512 * MIB
    for bad in ("a", "a=lots", "a=1G,colour=red", "a=1G,speed=0", "a=1G,port=0", "=1G"):
        with pytest.raises(PlanError):
            HostSpec.parse(bad)


def test_plan_fits_every_host_and_balances() -> None:
    shape = ModelShape.from_gguf(model_path("llama"))
    settings = PlanSettings(ctx_size=512, max_sessions=2, batch_size=32, cache_spill_mib=16)
    hosts = [HostSpec.parse(f"h{i}=1GiB") for i in range(3)]
    plan = plan_chain(shape, hosts, settings)
    assert [s.start for s in plan.stages] == [0, plan.stages[0].end, plan.stages[1].end]
    assert plan.stages[-1].end == shape.n_layer
    for stage in plan.stages:
        assert stage.memory.peak <= stage.host.memory
        assert stage.end > stage.start
    # a host four times as fast takes more layers than a slow one (head made negligible: tiny
    # models are mostly vocabulary)
    assert shape.costs is not None
    no_head = dataclasses.replace(shape, costs=dataclasses.replace(shape.costs, head_macs=0, head_read_bytes=0))
    fast = plan_chain(no_head, [HostSpec.parse("slow=1GiB"), HostSpec.parse("fast=1GiB,speed=4")], settings)
    assert fast.stages[1].end - fast.stages[1].start > fast.stages[0].end - fast.stages[0].start


def test_memory_moves_layers_to_the_host_with_room() -> None:
    shape = ModelShape.from_gguf(model_path("llama"))
    settings = PlanSettings(ctx_size=16384, max_sessions=1, batch_size=8, prefix_cache=False)
    small = stage_memory(shape, 0, 1, settings).peak + 1024  # room for its first layer only
    big = stage_memory(shape, 0, shape.n_layer, settings).peak
    plan = plan_chain(shape, [HostSpec("small", small), HostSpec("big", big)], settings)
    assert [s.layers for s in plan.stages] == ["0:1", f"1:{shape.n_layer}"]
    assert all(s.memory.peak <= s.host.memory for s in plan.stages)


def test_impossible_plan_names_host_and_shortfall() -> None:
    shape = ModelShape.from_gguf(model_path("llama"))
    settings = PlanSettings(ctx_size=512, max_sessions=1, batch_size=32, prefix_cache=False)
    need = stage_memory(shape, 2, 4, settings).peak
    with pytest.raises(PlanError) as caught:
        plan_chain(shape, [HostSpec("roomy", 8 * GIB), HostSpec("tiny-box", need // 4)], settings)
    text = str(caught.value)
    assert "tiny-box" in text and "short" in text and "roomy" not in text
    with pytest.raises(PlanError, match="only 4 layers"):
        plan_chain(shape, [HostSpec(f"h{i}", GIB) for i in range(5)], settings)


def test_gpu_budget_is_checked_separately() -> None:
    shape = ModelShape.from_gguf(model_path("llama"))
    settings = PlanSettings(ctx_size=512, max_sessions=1, batch_size=32, prefix_cache=False)
    with pytest.raises(PlanError, match="GPU memory"):
        plan_chain(shape, [HostSpec("gpu-box", 8 * GIB, gpu_memory=1024)], settings)
    plan = plan_chain(shape, [HostSpec("gpu-box", 8 * GIB, gpu_memory=8 * GIB)], settings)
    assert plan.stages[0].memory.gpu > 0


def test_plan_file_feeds_the_stage_config(tmp_path: Path) -> None:
    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    settings = PlanSettings(ctx_size=1024, max_sessions=3, batch_size=64, wire_dtype="f16")
    hosts = [HostSpec.parse("10.1.0.1=1GiB"), HostSpec.parse("10.1.0.2=1GiB,port=7123")]
    plan = plan_chain(shape, hosts, settings)
    file = tmp_path / "plan.toml"
    file.write_text(plan.to_toml())
    chain, stages = load_plan(file)
    assert chain["model_digest"] == shape.digest and [s["layers"] for s in stages] == [s.layers for s in plan.stages]
    first = parse_config(["--config", str(file), "--plan-stage", "0"])
    last = parse_config(["--config", str(file), "--plan-stage", "1", "--listen", "127.0.0.1:0"])
    assert first.layers == plan.stages[0].layers and str(first.downstream) == "10.1.0.2:7123"
    assert (first.ctx_size, first.max_sessions, first.batch_size, first.wire_dtype.name) == (1024, 3, 64, "F16")
    assert last.downstream is None and last.listen.port == 0 and last.model == str(path)
    with pytest.raises(SystemExit):
        parse_config(["--config", str(file)])  # a plan needs --plan-stage
    with pytest.raises(SystemExit):
        parse_config(["--config", str(file), "--plan-stage", "2"])


def test_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``skippy plan``'s main in this process (``python -m skippy`` runs as a process in test_offload.py)."""
    from skippy.__main__ import main

    path = model_path("llama")
    out = tmp_path / "p.toml"
    command = ["plan", "--model", str(path), "--ctx-size", "512"]
    status = main([*command, "--hosts", "a=1GiB", "b=1GiB", "-o", str(out)])
    ok = capsys.readouterr()
    assert status == 0, ok.err
    assert "stage 1 on b" in ok.out and out.exists()
    status = main([*command, "--hosts", "a=1GiB", "b=1MiB"])
    short = capsys.readouterr()
    assert status == 1 and "host b" in short.err and "short" in short.err


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b", "qwen3moe-30b-a3b-8e"])
async def test_planned_stages_resident_within_ten_percent(name: str, tmp_path: Path) -> None:
    """Real shapes (Q8_0): a 3-host plan, each stage started from the plan file, a request served,
    and each stage process's resident memory within 10% of the plan's figure."""
    path = ensure_model(preset(name, dtype="Q8_0"))
    shape = ModelShape.from_gguf(path)
    settings = PlanSettings(ctx_size=2048, max_sessions=2, batch_size=64, cache_spill_mib=64)
    total = stage_memory(shape, 0, shape.n_layer, settings).peak
    hosts = [HostSpec("a", total * 6 // 10), HostSpec("b", total * 45 // 100), HostSpec("c", total * 6 // 10)]
    plan = plan_chain(shape, hosts, settings)
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
            downstream = await process.start(timeout=120)
        client = await StageClient.connect(processes[0].address)  # type: ignore[arg-type]
        try:
            prompt = [(7 * i) % 1000 + 10 for i in range(120)]
            tokens = await client.generate_greedy(1, prompt, 8, chunk_size=64)
            assert len(tokens) == 8
        finally:
            await client.aclose()
        await trio.sleep(0.2)
        print(f"\n{name}: {plan.describe()}")
        for stage, process in zip(plan.stages, processes):
            assert process.process is not None
            resident, expected = _rss(process.process.pid), stage.memory.resident
            print(f"  stage {stage.index} {stage.layers}: measured {resident / MIB:.0f} MiB, planned "
                  f"{expected / MIB:.0f} MiB ({resident / expected - 1:+.1%})")
            assert stage.memory.peak <= stage.host.memory
            assert abs(resident - expected) <= 0.10 * expected, (stage.layers, resident, expected)
    finally:
        for process in processes:
            process.kill()


@pytest.mark.slow
def test_up_runs_a_plan(tmp_path: Path) -> None:
    """``skippy up --plan``: the plan's ranges and settings, served through the API."""
    import httpx

    from api_helpers import UpProcess

    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    plan = plan_chain(shape, [HostSpec("a", GIB), HostSpec("b", GIB, port=7001)],
                      PlanSettings(ctx_size=256, max_sessions=2, batch_size=32, cache_spill_mib=8))
    file = tmp_path / "plan.toml"
    file.write_text(plan.to_toml())
    up = UpProcess(["up", "--plan", str(file), "--port", "0", "--threads", "1"], tmp_path).start()
    try:
        for stage in plan.stages:
            assert f"stage {stage.index} (layers {stage.layers})" in up.stderr()
        reply = httpx.post(f"{up.url}/v1/completions", json={"model": path.name.removesuffix(".gguf"),
                                                             "prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        up.stop()


def test_measured_layer_times_drive_the_plan() -> None:
    """``--measure``: each layer and the head timed here with the runtime; the plan says so."""
    from skippy.deploy.plan import measure_layer_times

    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    layer_ms, head_ms = measure_layer_times(shape, threads=1)
    assert len(layer_ms) == shape.n_layer and all(t > 0 for t in layer_ms) and head_ms > 0
    plan = plan_chain(shape, [HostSpec("a", GIB), HostSpec("b", GIB)], PlanSettings(ctx_size=256),
                      layer_ms=layer_ms, head_ms=head_ms)
    assert plan.measured and "measured on this machine" in plan.describe()
    assert abs(sum(s.decode_ms for s in plan.stages) - (sum(layer_ms) + head_ms)) < 1e-9


def test_each_hosts_own_layer_times_share_the_layers() -> None:
    """Per-host figures (``--measure`` on each Ray node): a host measured twice as slow gets fewer
    layers than with one shared figure, and each stage's time is its own host's."""
    from skippy.deploy.plan import LayerTimes

    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    hosts = [HostSpec("fast", GIB), HostSpec("slow", GIB)]
    even = LayerTimes((1.0,) * shape.n_layer, 0.0, "measured on Ray node aaaa")
    slow = LayerTimes((3.0,) * shape.n_layer, 0.0, "measured on Ray node bbbb")
    shared = plan_chain(shape, hosts, PlanSettings(ctx_size=256), host_times=[even, even])
    own = plan_chain(shape, hosts, PlanSettings(ctx_size=256), host_times=[even, slow])
    assert [s.layers for s in shared.stages] == ["0:2", "2:4"]
    assert [s.layers for s in own.stages] == ["0:3", "3:4"]
    assert [s.decode_ms for s in own.stages] == [3.0, 3.0]
    assert [s.decode_source for s in own.stages] == [even.source, slow.source]
    text = own.describe()
    assert "(measured on Ray node aaaa)" in text and "(measured on Ray node bbbb)" in text
    assert 'decode_source = "measured on Ray node bbbb"' in own.to_toml()
    with pytest.raises(PlanError, match="1 host timings for 2 hosts"):
        plan_chain(shape, hosts, PlanSettings(ctx_size=256), host_times=[even])


def test_measure_names_hosts_it_could_not_reach(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``skippy plan --measure`` with named hosts and no Ray cluster: this machine is measured, and
    a host that is not this machine keeps this machine's figure, which the plan says for it.  The
    command's main in this process, measuring with one compute thread as the rest of the suite (it
    takes the machine's CPU count, and on a busy 2-core host two spin-waiting workers cost several
    times the CPU); ``python -m skippy`` runs as a process in test_offload.py."""
    from skippy.__main__ import main

    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    path = model_path("llama")
    out = tmp_path / "plan.toml"
    status = main(["plan", "--model", str(path), "--hosts", "127.0.0.1=1GiB", "far-away-host=1GiB", "--ctx-size",
                   "256", "--measure", "-o", str(out)])
    result = capsys.readouterr()
    assert status == 0, result.err
    lines = result.out.splitlines()
    # (each line may end with the head rows the plan's head split gives its stage)
    stage0 = next(line for line in lines if line.startswith("  stage 0 on 127.0.0.1")).split("; head rows")[0]
    stage1 = next(line for line in lines if line.startswith("  stage 1 on far-away-host")).split("; head rows")[0]
    assert stage0.endswith("(measured on this machine)"), stage0
    assert stage1.endswith("(this machine's figure: far-away-host was not measured)"), stage1
    _, stages = load_plan(out)
    assert stages[1]["expected"]["decode_source"] == "this machine's figure: far-away-host was not measured"


def test_kv_streams_plan_ctx_size_cells_per_sequence_id(tmp_path: Path) -> None:
    """``--kv-streams``: every sequence id (sessions and cache slots) holds ctx_size cells, padded to
    256 as llama.cpp pads each stream; the plan counts what the context allocates and its file
    turns the stages' flag on."""
    from skippy.deploy.plan import sequence_ids
    from skippy.runtime import StageContext

    path = model_path("llama")
    shape = ModelShape.from_gguf(path)
    shared = PlanSettings(ctx_size=300, max_sessions=3, batch_size=64)
    streams = dataclasses.replace(shared, kv_streams=True)
    ids = sequence_ids(streams)
    assert stage_memory(shape, 0, 4, streams).kv == 512 * ids * stage_memory(shape, 0, 4, shared).kv // 300
    with Model(path) as model, StageContext(model, n_ctx=300, max_sessions=ids, n_batch=64, threads=1,
                                            kv_streams=True) as ctx:
        assert ctx.n_ctx * ctx.kv_bytes_per_cell == stage_memory(shape, 0, 4, streams).kv
    file = tmp_path / "plan.toml"
    file.write_text(plan_chain(shape, [HostSpec.parse("10.1.0.1=4GiB")], streams).to_toml())
    assert parse_config(["--config", str(file), "--plan-stage", "0"]).kv_streams
    file.write_text(plan_chain(shape, [HostSpec.parse("10.1.0.1=4GiB")], shared).to_toml())
    assert not parse_config(["--config", str(file), "--plan-stage", "0"]).kv_streams
