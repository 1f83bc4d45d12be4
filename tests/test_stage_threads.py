"""How a stage process's OpenMP helpers wait (skippy.stage.threads): ``--thread-wait auto`` spins
when the compute threads of the host's stages fit its cores and sleeps at once (passive) when they
do not; ``spin`` / ``passive`` force it; ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` in the
environment override everything; other processes that import the stage package keep libgomp's
defaults.  The real tests read libgomp itself (``OMP_DISPLAY_ENV=VERBOSE`` prints its settings as
it loads) and the command lines and logs of the stages ``skippy up`` starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from skippy.stage.threads import (
    SPIN_COUNT,
    apply_wait_default,
    choose_wait,
    host_cores,
    is_stage_process,
    plan_host_threads,
    wait_settings,
)

from api_helpers import UpProcess

ROOT = Path(__file__).resolve().parent.parent
SPIN = {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


def _libgomp_spincount(arguments: list[str], **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    environ.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=environ,
                            timeout=120, check=True)
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr)
    if found is None:
        pytest.skip("the runtime is not built with libgomp (no OpenMP settings printed)")
    return found.group(1)


def test_the_stage_process_chooses_before_libgomp_loads() -> None:
    cores = host_cores()
    stage = ["-m", "skippy.stage", "--help"]
    assert _libgomp_spincount([*stage, "--threads", str(cores)]) == str(SPIN_COUNT)  # fits: spin
    assert _libgomp_spincount([*stage, f"--threads={cores + 1}"]) == "0"  # more threads than cores: PASSIVE
    # any other process importing the package (a test, a launcher) keeps libgomp's default
    assert _libgomp_spincount(["-c", "import skippy.stage"]) == "300000"


@pytest.mark.slow
def test_every_setting_reaches_libgomp_in_the_stage_process() -> None:
    """The other flags and the environment, each in a stage process (choose_wait's own tests
    cover the same decisions in this process; each process costs a third of a second)."""
    cores = host_cores()
    stage = ["-m", "skippy.stage", "--help"]
    assert _libgomp_spincount([*stage, "--threads", "1", "--host-threads", str(cores + 1)]) == "0"
    assert _libgomp_spincount([*stage, "--threads", "1", "--thread-wait", "passive"]) == "0"
    assert _libgomp_spincount([*stage, "--threads", str(cores + 1), "--thread-wait", "spin"]) == str(SPIN_COUNT)
    # the environment overrides every flag
    assert _libgomp_spincount([*stage, "--thread-wait", "passive"], OMP_WAIT_POLICY="ACTIVE") == "30000000000"
    assert _libgomp_spincount([*stage, "--threads", str(cores + 1)], GOMP_SPINCOUNT="1000") == "1000"


def test_only_the_stage_entry_point_is_recognised() -> None:
    python = "python"
    assert is_stage_process([python, "-m", "skippy.stage", "--model", "m"])
    assert is_stage_process([python, "-X", "dev", "-u", "-m", "skippy.stage"])
    assert is_stage_process([python, "-mskippy.stage"])
    for argv in ([python, "-m", "skippy", "up"], [python, "script.py", "-m", "skippy.stage"],
                 [python, "-c", "pass", "-m", "skippy.stage"], [python, "-m", "pytest"], [python],
                 [python, "-mpytest", "-m", "skippy.stage"]):
        assert not is_stage_process(argv), argv
    environ: dict[str, str] = {}
    assert apply_wait_default(environ, [python, "-m", "pytest", "--threads", "64"]) is None
    assert environ == {}


def test_auto_spins_when_the_threads_fit_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    fits = choose_wait("auto", 2, 0, 2, {})
    assert (fits.policy, fits.settings) == ("spin", SPIN)
    assert "2 compute threads of this stage on 2 cores" in fits.reason
    over = choose_wait("auto", 3, 0, 2, {})
    assert (over.policy, over.settings) == ("passive", PASSIVE)
    assert "more threads than cores" in over.reason
    # --threads 0 runs a thread per CPU of the host (os.cpu_count), which an affinity mask may not all give
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert choose_wait("auto", 0, 0, 8, {}).policy == "spin"
    assert choose_wait("auto", 0, 0, 4, {}).policy == "passive"
    one = choose_wait("auto", 1, 0, 1, {})
    assert one.policy == "spin" and "never enters OpenMP" in one.reason


def test_the_launchers_total_decides_for_the_host() -> None:
    # two stages of 2 threads on 4 cores fit; three do not, though each alone would
    assert choose_wait("auto", 2, 4, 4, {}).policy == "spin"
    crowded = choose_wait("auto", 2, 6, 4, {})
    assert crowded.policy == "passive" and "6 compute threads of the stages on this host on 4 cores" in crowded.reason
    # a total below the stage's own threads (a launcher's mistake) counts the stage's own
    assert choose_wait("auto", 8, 2, 4, {}).policy == "passive"
    # an explicit mode is taken as given
    assert choose_wait("spin", 2, 16, 2, {}).settings == SPIN
    assert choose_wait("passive", 1, 0, 64, {}).settings == PASSIVE


def test_the_environment_overrides_everything() -> None:
    for environ in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        for mode in ("auto", "spin", "passive"):
            choice = choose_wait(mode, 2, 64, 2, environ)
            assert choice.policy == "environment" and choice.settings == {}, (mode, environ)
            assert "the environment sets" in choice.reason
    environ = {"GOMP_SPINCOUNT": "10000"}
    choice = apply_wait_default(environ, ["python", "-m", "skippy.stage", "--thread-wait", "passive"], cores=2)
    assert choice is not None and choice.policy == "environment"
    assert environ == {"GOMP_SPINCOUNT": "10000"}  # nothing added
    assert choice.describe(environ).startswith("GOMP_SPINCOUNT=10000 (environment: ")


def test_a_stage_started_by_hand_decides_from_its_own_flags() -> None:
    stage = ["python", "-m", "skippy.stage", "--model", "m.gguf", "--layers", "0:4"]
    environ: dict[str, str] = {}
    choice = apply_wait_default(environ, [*stage, "--threads", "2"], cores=2)
    assert choice is not None and choice.policy == "spin" and environ == SPIN
    assert choice.describe(environ) == (f"GOMP_SPINCOUNT={SPIN_COUNT} (spin: 2 compute threads of this stage on "
                                        "2 cores: each has a core)")
    environ = {}
    assert apply_wait_default(environ, [*stage, "--threads", "2", "--threads=3"], cores=2) is not None
    assert environ == PASSIVE  # the last flag given counts, as in argparse
    # the flags as the stage's parse reads them: --name value, --name=value, - or _ in config keys
    assert wait_settings(["--thread-wait=SPIN", "--host-threads", "6", "--threads", "2"], 2) == ("spin", 2, 6)
    # values the stage's own parse will refuse leave the defaults (it then exits with the message)
    assert wait_settings(["--threads", "two", "--thread-wait", "sometimes", "--host-threads"], 2) == ("auto", 0, 0)


def test_a_config_file_and_a_plan_give_the_settings(tmp_path: Path) -> None:
    toml = tmp_path / "stage.toml"
    toml.write_text('threads = 3\nthread-wait = "passive"\n')
    assert wait_settings(["--config", str(toml)], 4) == ("passive", 3, 0)
    assert wait_settings(["--config", str(toml), "--thread-wait", "auto"], 4) == ("auto", 3, 0)  # flags win
    as_json = tmp_path / "stage.json"
    as_json.write_text(json.dumps({"stage": {"threads": 5}}))
    assert wait_settings([f"--config={as_json}"], 4) == ("auto", 5, 0)
    broken = tmp_path / "broken.toml"
    broken.write_text("threads = [")
    assert wait_settings(["--config", str(broken), "--threads", "2"], 4) == ("auto", 2, 0)
    assert wait_settings(["--config", str(tmp_path / "missing.toml")], 4) == ("auto", 0, 0)
    # a plan: the stages that share this stage's host count (threads 0: all of its cores)
    plan = tmp_path / "plan.toml"
    plan.write_text('[chain]\nmodel = "m.gguf"\nthreads = 2\n'
                    '[[stage]]\nhost = "a"\nlayers = "0:2"\n[[stage]]\nhost = "b"\nlayers = "2:3"\nthreads = 0\n'
                    '[[stage]]\nhost = "a"\nlayers = "3:4"\nthreads = 1\n')
    assert wait_settings(["--config", str(plan), "--plan-stage", "0"], 4) == ("auto", 2, 3)
    assert wait_settings(["--config", str(plan), "--plan-stage", "1"], 4) == ("auto", 0, 4)
    assert wait_settings(["--config", str(plan), "--plan-stage", "2", "--host-threads", "9"], 4) == ("auto", 1, 9)
    assert wait_settings(["--config", str(plan)], 4) == ("auto", 0, 0)  # no stage named: the parse refuses it
    assert plan_host_threads({}, [{"layers": "0:4"}], 0, 4) == 0  # no host in the plan: unknown


def test_the_stage_config_takes_the_settings(tmp_path: Path) -> None:
    from skippy.stage.config import config_from_mapping, load_config_file

    config = config_from_mapping({"model": "m", "layers": "0:1", "thread_wait": "Passive", "host_threads": "4"})
    assert (config.thread_wait, config.host_threads) == ("passive", 4)
    with pytest.raises(ValueError, match="thread_wait 'sometimes' is not one of auto, spin, passive"):
        config_from_mapping({"model": "m", "layers": "0:1", "thread_wait": "sometimes"})
    with pytest.raises(ValueError, match="host_threads must be >= 0"):
        config_from_mapping({"model": "m", "layers": "0:1", "host_threads": -1})
    plan = tmp_path / "plan.toml"
    plan.write_text('[chain]\nmodel = "m.gguf"\nthreads = 2\n'
                    '[[stage]]\nhost = "a"\nlayers = "0:2"\n[[stage]]\nhost = "a"\nlayers = "2:4"\n')
    assert load_config_file(plan, 1)["host_threads"] == 4  # as the scan before the runtime loads counts it


def test_ray_counts_the_stages_on_each_node(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'skippy-llm[ray]')")
    from skippy.deploy.ray_launch import RayChain

    chain = RayChain(Path("m.gguf"), [(0, 1), (1, 2), (2, 3)], stage_options=["--threads", "2"])
    monkeypatch.setattr(chain, "bundle_nodes", lambda: ["node-a", "node-b", "node-a"])
    assert [chain._host_threads(stage) for stage in chain.stages] == [  # noqa: SLF001
        ["--host-threads", "4"], ["--host-threads", "2"], ["--host-threads", "4"]]
    assert RayChain(Path("m.gguf"), [(0, 1)], stage_options=["--threads", "0"])._host_threads(  # noqa: SLF001
        chain.stages[0]) == []  # all cores: each stage decides alone


def test_skippy_up_passes_the_hosts_threads_to_its_stages(tiny_llama: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")  # each stage's libgomp prints its settings into its log
    logs = tmp_path / "logs"
    up = UpProcess(["up", "--model", str(tiny_llama), "--layers", "0:1,1:4", "--port", "0", "--ctx-size", "256",
                    "--threads", "2", "--restarts", "0", "--log-dir", str(logs)], tmp_path).start()
    try:
        cores = host_cores()
        policy, wanted = ("passive", PASSIVE) if 4 > cores else ("spin", SPIN)
        assert len(up.stage_pids) == 2
        for pid in up.stage_pids:  # the launcher's count, on each stage's command line
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            assert command[command.index("--host-threads") + 1] == "4", command
        for log in sorted(logs.glob("stage-*.log")):
            text = log.read_text()
            assert (f"compute threads wait with {next(f'{k}={v}' for k, v in wanted.items())} ({policy}: "
                    f"4 compute threads of the stages on this host on {cores} cores") in text, text
            found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", text)
            if found is not None:  # libgomp's own view of the stage's environment, where the runtime uses it
                assert found.group(1) == ("0" if policy == "passive" else str(SPIN_COUNT))
            assert "the runtime loaded with" not in text  # the parsed settings agree with the scan
    finally:
        up.stop()


def test_a_stage_warns_when_its_settings_would_choose_otherwise(tmp_path: Path) -> None:
    # argparse takes the abbreviation --thread-w; the scan before the runtime loads does not
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    result = subprocess.run(
        [sys.executable, "-m", "skippy.stage", "--model", "null:n_embd=8,n_layer=2", "--layers", "0:2",
         "--threads", "1", "--thread-w", "passive", "--exit-on-stdin-eof", "on"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env=dict(environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    assert f"compute threads wait with GOMP_SPINCOUNT={SPIN_COUNT} (spin: 1 compute thread of this stage" \
        in result.stderr, result.stderr
    assert ("the settings choose passive (--thread-wait passive), but the runtime loaded with spin: give "
            "--threads, --thread-wait and --host-threads unabbreviated") in result.stderr, result.stderr
