"""Choosing and wiring the head split (issue 31): the rows moved, the shares, ``skippy up``'s
choice and the launcher's flags, plan files (one host and across hosts, the link then on TLS) and
``skippy plan``'s output; and, slow, whole ``skippy up`` chains with the head split (plain and
``--tls``) answering exactly what they answer without it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest

from api_helpers import UpProcess
from skippy.deploy.cost import HEAD_ROW_ALIGN, HeadSplit, head_split, split_head_times, split_times
from skippy.deploy.launch import StageChild, _head_options
from skippy.deploy.plan import ModelShape, Plan, balanced_stages, choose_head_split, parse_head_split
from skippy.net.address import Address


def test_the_rows_moved_make_the_final_stage_and_the_least_loaded_equal() -> None:
    times = [4.0, 2.0, 10.0]  # head 8 of the final stage's 10
    chosen = head_split(times, 8.0, 32768)
    assert chosen is not None and chosen.host == 1 and chosen.rows % HEAD_ROW_ALIGN == 0
    after = split_head_times(times, 8.0, 32768, chosen)
    assert after[1] == pytest.approx(after[2], rel=0.01) and sum(after) == pytest.approx(sum(times))
    assert head_split([6.0, 4.0], 3.0, 32768) is None  # within its fair share: no split
    assert head_split([5.0, 5.4], 3.0, 32768) is None  # 5.2 | 5.2 would gain under HEAD_SPLIT_MIN_GAIN
    assert head_split([1.0, 10.0], 9.0, 32768, rows=1000) == HeadSplit(0, 1000)
    assert head_split([1.0, 10.0], 9.0, 32768, rows=40000) == HeadSplit(0, 32768 - HEAD_ROW_ALIGN)
    assert head_split([10.0], 9.0, 32768) is None


def test_layers_and_head_cut_together() -> None:
    """Three stages, a head of 9 of the 18 units: the layers are cut again around the rows moved
    to stage 0, so no stage keeps much more than a third; the simple move of the rows is kept
    where it is as fast and moves fewer rows."""
    from skippy.deploy.cost import balanced_split_head

    layer_ms = [1.0] * 18
    split, chosen = balanced_split_head(layer_ms, 18.0, 3, 65536)
    assert chosen is not None and chosen.host == 0
    bounds = [start for start, _ in split] + [18]
    times = split_head_times(split_times(layer_ms, 18.0, bounds), 18.0, 65536, chosen)
    assert max(times) < 1.05 * sum(times) / 3
    assert balanced_split_head([1.0] * 4, 0.01, 2, 65536)[1] is None  # moving rows gains under 1%
    # 23 units: 11.5 each at best, 12 | 11 without a split: under HEAD_SPLIT_MIN_GAIN, not worth a link
    split, chosen = balanced_split_head([1.0] * 18, 5.0, 2, 65536)
    assert chosen is None and max(split_times([1.0] * 18, 5.0, [0, split[1][0], 18])) == 12.0
    split, chosen = balanced_split_head([1.0] * 4, 6.0, 2, 65536)  # 3 | 7 without: 5 | 5 with 2 units moved
    assert split == [(0, 3), (3, 4)] and chosen is not None and chosen.rows <= 65536 // 3 + 256  # the fewest rows
    assert max(split_head_times(split_times([1.0] * 4, 6.0, [0, 3, 4]), 6.0, 65536, chosen)) <= 5.0 * 1.01


def test_parse_head_split() -> None:
    assert parse_head_split("off") == "off" and parse_head_split("auto") == "auto" and parse_head_split("64") == 64
    for bad in ("0", "-5", "some"):
        with pytest.raises(ValueError, match="head-split"):
            parse_head_split(bad)


def test_real_gemma_head_split_pays_on_three_stages_not_on_two(real_model: Path) -> None:
    """Gemma 3 270M, priced at the stages' batch under 8 sessions (patch 0018 makes its Q8_0 head
    2-3x cheaper a row there): on two stages the cut alone keeps both stages near half (no split
    gains 5%, see test_cost.py); on three, the head is more than a third, and moving rows to stage 0
    brings every stage near a third.  Rows given by hand are moved as given, with their shares."""
    from skippy.deploy.plan import balanced_stages_head

    shape = ModelShape.from_gguf(real_model)
    split, fractions = balanced_stages(shape, 2)
    assert choose_head_split(shape, split, "auto") == (None, pytest.approx(fractions))
    assert balanced_stages_head(shape, 2) == (split, None, pytest.approx(fractions)) and max(fractions) < 0.6
    head, shares = choose_head_split(shape, split, 16384)
    assert head == HeadSplit(0, 16384) and shares[0] > fractions[0] and sum(shares) == pytest.approx(1.0)
    three, three_head, three_shares = balanced_stages_head(shape, 3)
    assert three_head is not None and three_head.host == 0 and max(three_shares) < 0.35 < max(
        balanced_stages(shape, 3)[1])


def test_up_chooses_the_head_split(tiny_llama: Path) -> None:
    from skippy.commands.up import _head

    # three stages of the tiny model: its 32000-row head outweighs two of its layers
    args = argparse.Namespace(layers=None, head_split=None)
    cut, head, how = _head(args, tiny_llama, [(0, 1), (1, 2), (2, 4)])
    assert head is not None and head.host == 0 and f"rows 0:{head.rows} on stage 0" in how
    assert cut[0][0] == 0 and cut[-1][1] == 4 and len(cut) == 3
    # two: 0:3 | 3:4 is within 10% of even, not worth a split
    split = [(0, 2), (2, 4)]
    cut, head, how = _head(args, tiny_llama, split)
    assert head is None and cut == [(0, 3), (3, 4)] and "head not split" in how
    args = argparse.Namespace(layers="0:2,2:4", head_split=None)
    assert _head(args, tiny_llama, split) == (split, None, "")  # --layers: manual
    args = argparse.Namespace(layers="0:2,2:4", head_split="4096")
    assert _head(args, tiny_llama, split)[:2] == (split, HeadSplit(0, 4096))
    args = argparse.Namespace(layers=None, head_split="off")
    assert _head(args, tiny_llama, split) == (split, None, "")


def test_the_launcher_wires_the_shard_port() -> None:
    children = [StageChild(index, f"{index}:{index + 1}", [], Path(f"/tmp/{index}")) for index in range(3)]
    head = HeadSplit(1, 512)
    assert _head_options(None, children[2], children) == []
    assert _head_options(head, children[2], children) == ["--head-split", "512"]
    assert _head_options(head, children[0], children) == []
    children[2].head_shard = Address("127.0.0.1", 4567)
    assert _head_options(head, children[1], children) == ["--serve-head-rows", "512", "--head-shard-dial",
                                                          "127.0.0.1:4567"]


@pytest.mark.slow
@pytest.mark.parametrize("direct,tls", [("on", False), ("off", False), ("on", True)],
                         ids=["direct-return", "hop-by-hop", "direct-return-tls"])
def test_up_with_the_head_split_answers_as_without(tiny_llama: Path, tmp_path: Path, direct: str, tls: bool) -> None:
    """Greedy (speculation on and off), seeded sampling and log-probabilities through ``skippy up``
    with the head's rows 0:9600 on stage 0: the same as the whole head on the final stage (f32
    wire); with ``--tls`` every link, the head shard link too, on mutual TLS."""
    answers = {}
    for mode in ("off", "9600"):
        directory = tmp_path / mode
        directory.mkdir()
        up = UpProcess(["up", "--model", str(tiny_llama), "--layers", "0:2,2:4", "--head-split", mode, "--port", "0",
                        "--ctx-size", "256", "--threads", "1", "--direct-return", direct,
                        *(["--tls"] if tls else []), "--log-dir", str(directory / "logs")], directory)
        up.start()
        try:
            model = httpx.get(up.url + "/v1/models").json()["data"][0]["id"]
            answers[mode] = [httpx.post(up.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": "The quick brown fox", "max_tokens": 12, "logprobs": 2, **extra,
            }).json()["choices"][0] for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 5},
                                                  {"temperature": 0, "speculation": False})]
            logs = "".join(path.read_text() for path in (directory / "logs").glob("stage-*.log"))
        finally:
            up.stop()
        if mode != "off":
            assert "serving head rows 0:9600" in logs and "head shard port on" in logs
            assert ("head shard port on 127.0.0.1:" in logs and "(TLS)" in logs) == tls, logs
    assert json.dumps(answers["off"]) == json.dumps(answers["9600"])


def test_a_head_shard_link_off_loopback_needs_the_tls_files() -> None:
    """The head shard link follows the stage links' TLS rule: off loopback (or ``--tls on``) its
    ends need the stage's certificate, key and CA, and use them."""
    from skippy.stage.config import StageConfig
    from skippy.stage.head_split import head_shard_tls

    files = {"tls_cert": Path("c.pem"), "tls_key": Path("c.key"), "tls_ca": Path("ca.pem")}
    plain = StageConfig(model="m", layers="1:2", head_split=5).validated()
    assert head_shard_tls(plain, listening=True) is None
    with pytest.raises(ValueError, match="the head shard port 10.0.0.1:0 is not a loopback address: TLS is on"):
        StageConfig(model="m", layers="1:2", head_split=5, head_shard_listen=Address("10.0.0.1", 0)).validated()
    with pytest.raises(ValueError, match="the head shard link to 10.0.0.2:7 is not a loopback address: TLS is on"):
        StageConfig(model="m", layers="0:1", serve_head_rows=5, head_shard_dial=Address("10.0.0.2", 7)).validated()
    on = StageConfig(model="m", layers="1:2", head_split=5, tls="on", **files)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot load the stage's TLS files for its head shard link"):
        head_shard_tls(on.validated(), listening=True)  # --tls on: on loopback too (the files are not there)
    dialling = StageConfig(model="m", layers="0:1", serve_head_rows=5, head_shard_dial=Address("10.0.0.2", 7),
                           **files).validated()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot load the stage's TLS files for its head shard link"):
        head_shard_tls(dialling, listening=False)  # (the files are not there)
    StageConfig(model="m", layers="0:1", serve_head_rows=5, head_shard_dial=Address("10.0.0.2", 7), tls="off").validated()
    with pytest.raises(ValueError, match="needs --head-shard-dial"):
        StageConfig(model="m", layers="0:1", serve_head_rows=5).validated()
    with pytest.raises(ValueError, match="head_split is for the final stage"):
        StageConfig(model="m", layers="0:1", head_split=5, downstream=Address("127.0.0.1", 9)).validated()


# -- plan files carry the split; a replaced final stage keeps its shard port ---------------------------

def _local_plan(tiny_llama: Path, names: tuple[str, str] = ("127.0.0.1", "127.0.0.1")) -> Plan:
    from skippy.deploy.plan import HostSpec, PlanSettings, plan_chain

    shape = ModelShape.from_gguf(tiny_llama)
    hosts = [HostSpec.parse(f"{name}=8GiB,port={7000 + index}") for index, name in enumerate(names)]
    return plan_chain(shape, hosts, PlanSettings(ctx_size=256, max_sessions=2))


def test_a_plan_file_carries_the_head_split_and_reads_back(tiny_llama: Path, tmp_path: Path) -> None:
    from skippy.deploy.plan import PlanError, load_plan, plan_head
    from skippy.stage.config import load_config_file

    plan = _local_plan(tiny_llama)
    n_vocab = ModelShape.from_gguf(tiny_llama).n_vocab
    split = plan.with_head_split(HeadSplit(0, 4096), 2.0, n_vocab)
    assert split.head_port == 7002  # the final stage's host has 7000 and 7001 taken
    assert [stage.decode_ms for stage in split.stages] == pytest.approx(
        split_head_times([stage.decode_ms for stage in plan.stages], 2.0, n_vocab, HeadSplit(0, 4096)))
    assert sum(stage.share for stage in split.stages) == pytest.approx(1.0)
    assert "head rows 0:4096" in split.describe() and f"head rows 4096:{n_vocab}" in split.describe()
    path = tmp_path / "plan.toml"
    path.write_text(split.to_toml())
    chain, stages = load_plan(path)
    assert plan_head(path, stages) == HeadSplit(0, 4096)
    assert stages[0]["expected"]["head_rows"] == "0:4096" and stages[1]["expected"]["head_rows"] == f"4096:{n_vocab}"
    final, first = load_config_file(path, 1), load_config_file(path, 0)  # each host's stage settings
    assert (final["head_split"], final["head_shard_listen"]) == (4096, "127.0.0.1:7002")
    assert (first["serve_head_rows"], first["head_shard_dial"]) == (4096, "127.0.0.1:7002")
    path.write_text(plan.to_toml())  # no split: the whole head on the final stage
    assert plan_head(path, load_plan(path)[1]) is None and "head_split" not in path.read_text()
    with pytest.raises(PlanError, match="does not fit"):
        plan.with_head_split(HeadSplit(1, 4096), 2.0, n_vocab)  # the final stage cannot serve its own rows
    path.write_text(split.to_toml().replace("serve_head_rows = 4096", "serve_head_rows = 2048"))
    with pytest.raises(PlanError, match="the same rows"):
        plan_head(path, load_plan(path)[1])


def test_a_cross_host_plan_carries_the_split_on_tls(tiny_llama: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``skippy plan`` over three hosts (on two, the cost model leaves the tiny head whole): the
    head split is planned (no longer refused for leaving the host), said with its link, and the plan file's stages take it with the link on TLS: the final
    stage listens on 0.0.0.0, the serving stage dials the final stage's host, both with their files."""
    from skippy.__main__ import main
    from skippy.deploy.plan import load_plan, plan_head
    from skippy.stage.config import parse_config
    from skippy.net.tls import link_uses_tls

    out = tmp_path / "plan.toml"
    status = main(["plan", "--model", str(tiny_llama), "--hosts", "10.0.0.1=8GiB", "10.0.0.2=8GiB", "10.0.0.3=8GiB", "--ctx-size",
                   "256", "-o", str(out)])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    head = plan_head(out, load_plan(out)[1])
    assert head is not None and head.host == 1  # the tiny model's 32000-row head outweighs its layers
    n_vocab = ModelShape.from_gguf(tiny_llama).n_vocab
    assert (f"  head split: rows 0:{head.rows} on stage 1, {head.rows}:{n_vocab} on the final stage (its head "
            "shard port 7001, dialled from 10.0.0.2, mutual TLS)") in printed.out, printed.out
    assert f"head rows 0:{head.rows}" in printed.out and "not planned" not in printed.out
    first = parse_config(["--config", str(out), "--plan-stage", "1"])
    final = parse_config(["--config", str(out), "--plan-stage", "2"])
    assert (first.serve_head_rows, str(first.head_shard_dial)) == (head.rows, "10.0.0.3:7001")
    assert (final.head_split, str(final.head_shard_listen)) == (head.rows, "0.0.0.0:7001")
    assert str(final.listen) == "0.0.0.0:7000" and str(first.downstream) == "10.0.0.3:7000"
    for config, end in ((first, first.head_shard_dial), (final, final.head_shard_listen)):
        assert end is not None and link_uses_tls(config.tls, end.host)
        assert config.tls_cert is not None and config.tls_cert.name == f"stage-{2 if config is final else 1}.pem"


def test_up_takes_the_plans_head_split(tiny_llama: Path, tmp_path: Path) -> None:
    from skippy.commands.up import _apply_plan, _head

    path = tmp_path / "plan.toml"
    plan = _local_plan(tiny_llama)
    path.write_text(plan.with_head_split(HeadSplit(0, 4096), 2.0, ModelShape.from_gguf(tiny_llama).n_vocab).to_toml())
    args = argparse.Namespace(plan=path, model=None, ctx_size=512, max_sessions=8, wire_dtype="f32", threads=0,
                              layers=None, head_split=None)
    _apply_plan(args)
    split = [(stage.start, stage.end) for stage in plan.stages]
    assert _head(args, tiny_llama, split) == (split, HeadSplit(0, 4096), "; head split as planned: rows 0:4096 on stage 0")
    args.head_split = "off"  # the flag overrides the plan
    assert _head(args, tiny_llama, split)[1] is None


def test_a_replaced_final_stage_listens_on_its_shard_port_and_a_standby_is_refused() -> None:
    import trio

    from skippy.deploy.launch import Replacement, _listening_on, run_chain

    command = ["python", "-m", "skippy.stage", "--listen", "127.0.0.1:0", "--head-split", "512"]
    pinned = _listening_on(command, Address("127.0.0.1", 9000), Address("127.0.0.1", 9001))
    assert pinned == ["python", "-m", "skippy.stage", "--listen", "127.0.0.1:9000", "--head-split", "512",
                      "--head-shard-listen", "127.0.0.1:9001"]
    assert _listening_on(pinned, Address("127.0.0.1", 9000), Address("127.0.0.1", 9002))[-1] == "127.0.0.1:9002"
    assert _listening_on(command, Address("127.0.0.1", 9000))[4] == "127.0.0.1:9000"

    async def standby() -> None:
        await run_chain(Path("m.gguf"), [(0, 1), (1, 2)], log_dir=Path("/nonexistent/never-made"),
                        replacement=Replacement(restarts=1, standby=True), head=HeadSplit(0, 512))
    with pytest.raises(ValueError, match="no head split with --standby"):
        trio.run(standby)


def test_up_refuses_head_rows_with_a_standby(tiny_llama: Path, tmp_path: Path) -> None:
    up = UpProcess(["up", "--model", str(tiny_llama), "--layers", "0:2,2:4", "--head-split", "4096", "--standby",
                    "--port", "0", "--log-dir", str(tmp_path / "logs")], tmp_path)
    with pytest.raises(RuntimeError, match="--head-split ROWS with --standby"):
        up.start()


@pytest.mark.slow
def test_up_runs_a_plans_head_split_and_a_killed_final_stage_comes_back_on_its_shard_port(
        tiny_llama: Path, tmp_path: Path) -> None:
    """``skippy up --plan`` with the plan's head split; the final stage SIGKILLed is restarted on
    its address and its head shard port, which stage 0 dials again: the next answer is the same."""
    import os
    import re
    import signal
    import time

    path = tmp_path / "plan.toml"
    path.write_text(_local_plan(tiny_llama).with_head_split(
        HeadSplit(0, 4096), 2.0, ModelShape.from_gguf(tiny_llama).n_vocab).to_toml())
    up = UpProcess(["up", "--plan", str(path), "--port", "0", "--threads", "1", "--restarts", "2",
                    "--log-dir", str(tmp_path / "logs")], tmp_path)
    up.start()

    def answer() -> str:
        model = httpx.get(up.url + "/v1/models").json()["data"][0]["id"]
        reply = httpx.post(up.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])

    try:
        before = answer()
        logs = tmp_path / "logs"
        text = "".join(p.read_text() for p in logs.glob("stage-*.log"))
        port = re.search(r"head shard port on (\S+)", text)
        assert port is not None and "serving head rows 0:4096" in text
        final = int(re.findall(r"stage 1 \(layers \S+\) pid (\d+) ready", up.stderr())[0])
        os.kill(final, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "ready again" not in up.stderr():
            assert time.monotonic() < deadline, up.stderr()
            time.sleep(0.05)
        again = re.search(r"stage 1 \(layers \S+\) pid (\d+) restarted", up.stderr())
        assert again is not None
        up.stage_pids.append(int(again.group(1)))
        assert answer() == before
        text = "".join(p.read_text() for p in logs.glob("stage-*.log"))
        assert text.count(f"head shard port on {port.group(1)}") == 2  # the replacement took the same port
    finally:
        up.stop()
