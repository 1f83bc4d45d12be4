"""Where a stage's CPU goes, from its scheduler trace (``SKIPPY_SCHED_TRACE``), and optionally what ran
beside each decode batch (a ``perf`` record of the scheduler's context switches).

Run::

    SKIPPY_SCHED_TRACE=/tmp/tr/l PYTHONPATH=. .venv/bin/python bench/concurrency.py --models llama \
        --variants skippy-2x1t-nospec --concurrency 8 --seconds 8 --rounds 1
    PYTHONPATH=. .venv/bin/python bench/sched_trace.py /tmp/tr/l

Per trace file (one per stage process): the runtime thread's CPU in decode-only turns, split into
the native decode call (``native=``, thread CPU) and the rest of the turn (the executor's Python
around it and the write-throughs); the turns that ran other jobs (prefill chunks, verify windows,
control calls); per decode batch size, the native CPU per batch (median) and wall.

With ``--switches FILE`` (``perf record -e sched:sched_switch -k CLOCK_MONOTONIC -a`` around the run,
then ``perf script -F pid,tid,cpu,time,trace > FILE``; the trace's ``at=`` is the same clock), each
decode batch of a stage's runtime thread is joined with what the other CPUs ran while that thread
ran: the other stage's runtime thread, nothing (idle), or anything else; the native CPU per batch is
then given for batches that ran mostly beside the other stage and for the rest (memory contention
between two stages streaming their weights at once shows there).  Stages are matched by pid: give
the traces of one chain only.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_FIELD = re.compile(r"(\w+)=(\S*)")
_SWITCH = re.compile(r"^\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+): prev_comm=.* prev_pid=(\d+) .*==> next_comm=.* next_pid=(\d+)")


@dataclasses.dataclass
class Turn:
    """One trace line (times in ms; ``at`` on CLOCK_MONOTONIC)."""

    rows: int
    jobs: int
    at: float
    wall: float
    cpu: float
    native_wall: float
    native_cpu: float
    idle: float
    wait: float


def parse(lines: list[str]) -> list[Turn]:
    """The turns of a trace file written by ``skippy.stage.scheduler.TurnTrace`` (lines without
    the CPU fields, from before they were added, are skipped)."""
    turns = []
    for line in lines:
        fields = dict(_FIELD.findall(line))
        if "at" not in fields or "native" not in fields:
            continue
        native_wall, native_cpu = (float(x) for x in fields["native"].split("/"))
        turns.append(Turn(rows=len([r for r in fields.get("rows", "").split(",") if r]), jobs=int(fields["jobs"]),
                          at=float(fields["at"]), wall=float(fields["batch"]), cpu=float(fields["cpu"]),
                          native_wall=native_wall, native_cpu=native_cpu, idle=float(fields["idle"]),
                          wait=float(fields["wait"])))
    return turns


def summary(name: str, turns: list[Turn]) -> list[str]:
    """The CPU split of one stage's turns (module header)."""
    decode = [t for t in turns if t.jobs == 0 and t.rows > 0]
    other = [t for t in turns if t.jobs > 0]
    rows = sum(t.rows for t in turns)
    native = sum(t.native_cpu for t in decode)
    outside = sum(t.cpu for t in decode) - native
    lines = [f"== {name}: {len(turns)} turns, {rows} decode rows",
             f"  decode-only turns {len(decode)}: native decode {native:.0f} ms CPU ({native / max(rows, 1):.2f} per row), "
             f"the rest of the turn {outside:.0f} ms ({outside / max(len(decode), 1):.2f} per turn, "
             f"{outside / max(rows, 1):.2f} per row)",
             f"  turns with other jobs (prefill, verify, control) {len(other)}: {sum(t.cpu for t in other):.0f} ms CPU "
             f"({sum(t.cpu for t in other) / max(rows, 1):.2f} per decode row)"]
    by_size: dict[int, list[Turn]] = defaultdict(list)
    for turn in decode:
        by_size[turn.rows].append(turn)
    for size in sorted(by_size):
        group = by_size[size]
        lines.append(f"  {size} rows: {len(group)} batches, native CPU median {statistics.median(t.native_cpu for t in group):.2f} ms, "
                     f"wall {statistics.median(t.native_wall for t in group):.2f} ms")
    return lines


@dataclasses.dataclass
class Switches:
    """Who ran on each CPU when, from ``perf script`` lines of sched_switch events."""

    segments: dict[int, list[tuple[float, float, int]]]  #: cpu -> (start s, end s, tid), in order
    tgid: dict[int, int]  #: tid -> pid

    @classmethod
    def parse(cls, lines: list[str]) -> "Switches":
        segments: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
        current: dict[int, tuple[float, int]] = {}
        tgid: dict[int, int] = {}
        for line in lines:
            match = _SWITCH.match(line)
            if not match:
                continue
            pid, tid, cpu, when, _, following = (int(match[1]), int(match[2]), int(match[3]), float(match[4]),
                                                 int(match[5]), int(match[6]))
            tgid[tid] = pid
            if cpu in current:
                start, who = current[cpu]
                segments[cpu].append((start, when, who))
            current[cpu] = (when, following)
        return cls(dict(segments), tgid)

    def running(self, cpu: int, start: float, end: float) -> list[tuple[float, float, int]]:
        """The segments of ``cpu`` inside [start, end), clipped."""
        segments = self.segments[cpu]
        index = max(bisect.bisect_right([s[0] for s in segments], start) - 1, 0)
        found = []
        while index < len(segments) and segments[index][0] < end:
            s, e, who = segments[index]
            if e > start:
                found.append((max(s, start), min(e, end), who))
            index += 1
        return found

    def busiest_thread(self, pid: int) -> int:
        """The thread of ``pid`` with the most time on a CPU (a stage's runtime thread)."""
        time_on: dict[int, float] = defaultdict(float)
        for segments in self.segments.values():
            for s, e, who in segments:
                if self.tgid.get(who) == pid:
                    time_on[who] += e - s
        return max(time_on, key=lambda tid: time_on[tid])


def beside(turns: list[Turn], switches: Switches, thread: int, other: int) -> list[tuple[Turn, float, float]]:
    """Each decode-only turn of ``thread`` with the shares of its time on a CPU during which another
    CPU ran ``other`` (the other stage's runtime thread) and nothing (idle)."""
    found = []
    for turn in turns:
        if turn.jobs or not turn.rows or turn.native_wall <= 0:
            continue
        start, end = turn.at / 1e3, (turn.at + turn.wall) / 1e3
        mine = with_other = idle = 0.0
        for cpu in switches.segments:
            for s, e, who in switches.running(cpu, start, end):
                if who != thread:
                    continue
                mine += e - s
                for cpu2 in switches.segments:
                    if cpu2 != cpu:
                        for s2, e2, who2 in switches.running(cpu2, s, e):
                            with_other += (e2 - s2) if who2 == other else 0.0
                            idle += (e2 - s2) if who2 == 0 else 0.0
        if mine > 0:
            found.append((turn, with_other / mine, idle / mine))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="the SKIPPY_SCHED_TRACE prefix (files PREFIX.<pid>.<n>)")
    parser.add_argument("--switches", type=Path, help="perf script output of sched_switch events (module header)")
    args = parser.parse_args()
    files = sorted(Path(args.prefix).parent.glob(Path(args.prefix).name + ".*"))
    traces = {int(f.name.split(".")[-2]): parse(f.read_text().splitlines()) for f in files}
    traces = {pid: turns for pid, turns in traces.items() if turns}
    if not traces:
        print(f"no trace with CPU fields under {args.prefix}", file=sys.stderr)
        return 1
    for pid, turns in traces.items():
        print("\n".join(summary(f"stage pid {pid}", turns)))
    if args.switches and len(traces) == 2:
        switches = Switches.parse(args.switches.read_text().splitlines())
        threads = {pid: switches.busiest_thread(pid) for pid in traces}
        for pid, turns in traces.items():
            other = next(threads[p] for p in traces if p != pid)
            joined = beside(turns, switches, threads[pid], other)
            for size in sorted({t.rows for t, _, _ in joined}):
                group = [(t, w, i) for t, w, i in joined if t.rows == size]
                along = [t.native_cpu for t, w, _ in group if w > 0.7]
                apart = [t.native_cpu for t, w, _ in group if w < 0.1]
                if len(group) < 10 or not along or not apart:
                    continue
                print(f"stage pid {pid}, {size} rows: {len(group)} batches; other CPU ran the other stage "
                      f"{statistics.mean(w for _, w, _ in group):.0%} and idled {statistics.mean(i for _, _, i in group):.0%} "
                      f"of their time; native CPU median beside the other stage (> 70%) {statistics.median(along):.2f} ms "
                      f"({len(along)}), not (< 10%) {statistics.median(apart):.2f} ms ({len(apart)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
