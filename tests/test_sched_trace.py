"""The scheduler's per-turn trace and bench/sched_trace.py, which reads it: the CPU fields a turn
writes (its thread's CPU, the native decode's wall / CPU, the absolute start) parse back, and the
summary splits a stage's CPU into native decode, the rest of its decode turns and other jobs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import sched_trace  # noqa: E402

from skippy.stage.scheduler import TurnTrace  # noqa: E402


def test_turn_trace_lines_parse_back(tmp_path: Path) -> None:
    trace = TurnTrace(str(tmp_path / "t"))
    started = time.perf_counter_ns()
    trace.line = "t=1.0 via=serve idle=0.5 wait=0.1 active=8 cap=4 rows=0@1.0,1@1.2,2@1.3,3@1.3 left=0 jobs=0"
    trace.ran(started, 9_000_000, (8_000_000, 7_500_000))
    trace.line = "t=20.0 via=fast idle=2.0 wait=0.0 active=8 cap=4 rows= left=0 jobs=1"
    trace.ran(started, 40_000_000, (0, 0))
    trace.file.close()
    (path,) = tmp_path.iterdir()
    turns = sched_trace.parse(path.read_text().splitlines())
    assert [t.rows for t in turns] == [4, 0] and [t.jobs for t in turns] == [0, 1]
    assert (turns[0].cpu, turns[0].native_wall, turns[0].native_cpu) == (9.0, 8.0, 7.5)
    assert abs(turns[0].at - started / 1e6) < 0.01  # CLOCK_MONOTONIC ms, one clock for every process
    lines = sched_trace.summary("s", turns)
    assert "native decode 8 ms CPU (1.88 per row)" in lines[1]  # 7.5 ms over 4 rows
    assert "the rest of the turn 2 ms (1.50 per turn" in lines[1]  # 9.0 - 7.5
    assert "turns with other jobs (prefill, verify, control) 1: 40 ms CPU" in lines[2]


def test_switches_split_a_batch_by_what_the_other_cpu_ran() -> None:
    # CPU 0 runs thread 11 (stage A's runtime) 1.000-1.010 s; CPU 1 runs thread 21 (stage B's) for the
    # first 6 ms of that, then is idle
    lines = [
        " 10/10 [000] 1.000000: prev_comm=a prev_pid=10 prev_prio=120 prev_state=S ==> next_comm=a next_pid=11 next_prio=120",
        " 20/20 [001] 1.000000: prev_comm=b prev_pid=20 prev_prio=120 prev_state=S ==> next_comm=b next_pid=21 next_prio=120",
        " 20/21 [001] 1.006000: prev_comm=b prev_pid=21 prev_prio=120 prev_state=S ==> next_comm=swapper next_pid=0 next_prio=120",
        " 10/11 [000] 1.010000: prev_comm=a prev_pid=11 prev_prio=120 prev_state=S ==> next_comm=a next_pid=10 next_prio=120",
        " 0/0 [001] 1.010000: prev_comm=swapper prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=b next_pid=20 next_prio=120",
    ]
    switches = sched_trace.Switches.parse(lines)
    assert switches.tgid[11] == 10 and switches.busiest_thread(10) == 11
    turn = sched_trace.Turn(rows=4, jobs=0, at=1000.0, wall=10.0, cpu=9.0, native_wall=9.0, native_cpu=8.0,
                            idle=0.0, wait=0.0)
    ((_, with_other, idle),) = sched_trace.beside([turn], switches, 11, 21)
    assert abs(with_other - 0.6) < 1e-6 and abs(idle - 0.4) < 1e-6
