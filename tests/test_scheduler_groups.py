"""Decode groups (issue 31 item 1): which rows share a turn, and that groups rotate and stay whole.

The policy (``DecodeGroups``, ``select_turn``) is tested with fake jobs and explicit times; the
scheduler with a fake blocking executor whose batches take virtual time (trio's ``autojump_clock``,
the scheduler's clocks on it: its decisions depend on the events it saw, not on the host's load)
and are recorded; and a real 2-stage chain checks that concurrent sessions still get their solo
tokens with batching off, and batches no more than a group with it on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import pytest
import trio
from trio.testing import MockClock

from skippy.driver import StageClient
from skippy.lane.work import WorkItem, WorkResult
from skippy.stage import scheduler as scheduler_module
from skippy.stage.scheduler import DecodeGroups, Scheduler, _Job, select_turn
from skippy.stage.stats import StageStats

from stage_helpers import inprocess_chain, reference_greedy

T = TypeVar("T")


def _row(session: int) -> WorkItem:
    return WorkItem(session=session, positions=np.array([7], dtype=np.int32), tokens=np.array([5], dtype=np.int32))


def _chunk(session: int, rows: int) -> WorkItem:
    return WorkItem(session=session, positions=np.arange(rows, dtype=np.int32),
                    tokens=np.ones(rows, dtype=np.int32), prefill=True)


def _job(item: WorkItem | None) -> _Job[Any]:
    return _Job(item, None if item is not None else (lambda: None), 0)


def _sessions(jobs: Sequence[_Job[Any]]) -> list[int | None]:
    return [None if job.item is None else job.item.session for job in jobs]


# -- the policy ------------------------------------------------------------------------------------

def test_the_cap_splits_the_active_sessions_into_the_groups() -> None:
    groups = DecodeGroups(2)
    for session in range(1, 8):  # 7 sessions, rows every 20 ms
        groups.arrived(session, 0.0)
        groups.arrived(session, 0.02)
    assert groups.active(0.03) == 7 and groups.cap(0.03) == 4
    assert DecodeGroups(1).cap(0.0) == 1  # nobody active: one row at a time is all there is
    # a session that stops sending is expected for 3 of its intervals (at least ACTIVE_MIN_S)
    assert groups.active(0.079) == 7 and groups.active(0.081) == 0
    groups.arrived(1, 1.0)
    groups.arrived(1, 2.0)  # 1 s between its rows: still expected 2.9 s later
    assert groups.active(4.9) == 1 and groups.active(5.1) == 0
    with pytest.raises(ValueError, match="decode groups"):
        DecodeGroups(0)


def test_a_row_that_waited_through_a_long_batch_counts_for_the_cap() -> None:
    """A new session's first row queued behind a 70 ms batch is no longer "active" by its
    arrival alone (ACTIVE_MIN_S), but the turn it waited for must take it: one stage, 8 rows."""
    groups = DecodeGroups(1)
    for session in range(1, 8):
        groups.arrived(session, 0.0)
    groups.ran(list(range(1, 8)), 0.07, 0.07)
    groups.arrived(8, 0.005)  # the newcomer, while that batch ran
    for session in range(1, 8):
        groups.arrived(session, 0.0705)
    assert groups.active(0.071) == 7  # the newcomer's row is 66 ms old
    chosen, until = groups.plan(list(range(1, 9)), 0.071)
    assert chosen == list(range(1, 9)) and until == 0.071
    assert groups.cap(0.071, range(1, 9)) == 8 and DecodeGroups(2).cap(0.0, [1, 2, 3]) == 2


def _back(groups: DecodeGroups, ran_at: float, turns: dict[int, float]) -> None:
    """Each session of ``turns`` sends its next row ``turns[session]`` after ``ran_at``."""
    for session, turn in sorted(turns.items(), key=lambda item: item[1]):
        groups.arrived(session, ran_at + turn)


def _round(groups: DecodeGroups, batch: Sequence[int], turns: dict[int, float], start: float,
           batch_s: float) -> float:
    """The sessions of ``batch`` come back ``turns[session]`` after ``start`` (their last batch's
    end) and run as one batch of ``batch_s`` when the last is in; returns when it ended."""
    _back(groups, start, {session: turns[session] for session in batch})
    end = start + max(turns[session] for session in batch) + batch_s
    groups.ran(batch, batch_s, end)
    return end


def test_a_turn_waits_for_its_groups_rows_that_are_due_and_no_longer() -> None:
    slack = scheduler_module.TURN_SLACK_S
    groups = DecodeGroups(1)
    turns = {1: 0.001, 2: 0.002, 3: 0.003, 4: 0.004}  # each session's turnaround
    end = _round(groups, [1, 2, 3, 4], turns, 0.0, 0.02)
    end = _round(groups, [1, 2, 3, 4], turns, end, 0.02)
    assert groups.plan([], end) == ([], end)  # a chunk or a control call never waits
    # 1 is back: the turn waits for 2, 3 and 4, until the last is due (its turnaround and slack)
    rows, until = groups.plan([1], end + 0.001)
    assert rows == [1] and until == pytest.approx(end + 0.004 + max(slack, 0.002))
    assert groups.plan([1, 2, 3], end + 0.003)[1] == pytest.approx(until)
    assert groups.plan([2, 1, 3, 4], end + 0.004) == ([2, 1, 3, 4], end + 0.004)  # all here: it runs
    # a session that does not come (it finished, prefills, sent a verify window) is given up once due
    late = until + 0.0001
    assert groups.plan([1, 2, 3], late) == ([1, 2, 3], late)
    groups.forget(4)  # released: not waited for, not active
    assert groups.plan([1, 2, 3], end + 0.003) == ([1, 2, 3], end + 0.003) and groups.cap(end + 0.003) == 3
    # the wait: a recent batch's time, at most GATHER_MAX_S
    assert groups.gather_s() == pytest.approx(0.02)
    groups.ran([1], 1.0, end + 0.01)
    assert groups.gather_s() == scheduler_module.GATHER_MAX_S


def test_groups_stay_apart_and_a_complete_group_goes_first() -> None:
    """Stage 0 of two: group A ran, then group B; A's rows come back through stage 1 and the
    driver (12-15 ms after A's batch), then B's."""
    groups = DecodeGroups(2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for session in a + b:
        groups.arrived(session, 0.0)
    groups.ran(a, 0.01, 0.01)
    groups.ran(b, 0.01, 0.02)
    turns = {s: 0.012 + 0.001 * ((s - 1) % 4) for s in a + b}
    _back(groups, 0.01, {s: turns[s] for s in a})
    _back(groups, 0.02, {s: turns[s] for s in b})
    groups.ran(a, 0.01, 0.035)
    groups.ran(b, 0.01, 0.045)
    assert groups.group_of(1) == groups.group_of(4) != groups.group_of(5) == groups.group_of(8)
    _back(groups, 0.035, {1: 0.012, 2: 0.013, 3: 0.014})
    now = 0.049
    # 1, 2, 3 lack one row: they wait for the soonest (4, by its turnaround; then its slack)
    rows, until = groups.plan([1, 2, 3], now)
    assert rows == [1, 2, 3] and until == pytest.approx(0.035 + 0.015 + 0.5 * 0.015)
    # B complete while A waits: B runs, alone
    assert groups.plan([1, 2, 5, 6, 7, 8], now) == ([5, 6, 7, 8], now)
    # a full turn runs at once: the oldest row's group first, then the oldest others
    assert groups.plan([1, 5, 2, 6, 3], now) == ([1, 2, 3, 5], now)


def test_a_batch_is_one_group_and_groups_stay_within_the_cap() -> None:
    groups = DecodeGroups(2)
    for session in range(1, 9):
        groups.arrived(session, 0.0)
    groups.ran([1, 2, 3, 4], 0.01, 0.01)  # new sessions: the smallest group
    groups.ran([5, 6, 7, 8], 0.01, 0.02)
    first, second = groups.group_of(1), groups.group_of(5)
    assert first != second and first >= 0 and second >= 0
    groups.forget(5)
    groups.forget(6)  # 6 sessions now: the cap is 3
    for session in (1, 2, 3, 4, 7, 8):
        groups.arrived(session, 0.03)
    groups.ran([1, 2, 3], 0.01, 0.04)
    groups.ran([4, 7, 8], 0.01, 0.05)  # most were in the second group, which has room for 4
    assert [groups.group_of(s) for s in (1, 2, 3, 4, 7, 8)] == [first] * 3 + [second] * 3
    groups.forget(7)
    for session in (9, 10):
        groups.arrived(session, 0.06)
    groups.ran([9, 10], 0.01, 0.07)  # new sessions join the smallest group
    assert groups.group_of(9) == groups.group_of(10) == second
    # a batch that would make its group larger than the cap takes the smallest group
    groups.ran([1, 2, 3, 9], 0.01, 0.08)  # cap 4: first would hold 1, 2, 3, 9 (fits)
    assert groups.group_of(9) == first
    groups.ran([10, 4, 8], 0.01, 0.09)
    groups.ran([8, 1], 0.01, 0.1)  # second would hold 4, 10, 8, 1 (fits); first 2, 3, 9 + 8, 1: no
    assert groups.group_of(1) == second


def test_a_turn_takes_the_oldest_rows_up_to_the_cap_and_leaves_the_rest_in_order() -> None:
    jobs = [_job(_row(s)) for s in (1, 2, 3, 4, 5)] + [_job(None)]
    turn, left = select_turn(jobs, 2)
    assert _sessions(turn) == [1, 2, None]  # control calls always go
    assert _sessions(left) == [3, 4, 5]
    assert select_turn(jobs, None) == (jobs, [])  # greedy / batching off: everything, as before
    # a second row of a session already in the batch waits for a later turn
    again = [_job(_row(1)), _job(_row(1)), _job(_row(2))]
    turn, left = select_turn(again, 4)
    assert turn == [again[0], again[2]] and left == [again[1]]


def test_prefill_runs_between_decode_batches_within_its_budget() -> None:
    budget = scheduler_module.PREFILL_ROWS_PER_TURN
    rows = [_job(_row(s)) for s in (1, 2, 3, 4)]
    chunks = [_job(_chunk(10 + i, budget // 2)) for i in range(4)]
    big = _job(_chunk(20, 4 * budget))
    # decode rows left over: the chunks up to the budget (at least one, however big) run
    turn, left = select_turn([big, *rows, *chunks], 2)
    assert turn == [big, *rows[:2]] and left == [*rows[2:], *chunks]
    turn, left = select_turn([*rows, *chunks], 2)
    assert turn == [*rows[:2], *chunks[:2]] and left == [*rows[2:], *chunks[2:]]
    # no decode row waits: every chunk runs, unless sessions decode (their rows are due)
    turn, left = select_turn([*rows[:2], *chunks], 2)
    assert turn == [*rows[:2], *chunks] and left == []
    turn, left = select_turn(chunks, 2, decoding=True)
    assert turn == chunks[:2] and left == chunks[2:]
    # a stream of decode rows never keeps a chunk out of the turn
    turn, left = select_turn([*rows, chunks[0]], 1)
    assert chunks[0] in turn


# -- the scheduler ---------------------------------------------------------------------------------

class _VirtualTime:
    """The scheduler's clocks (its module's ``time``) on trio's virtual clock (pytest-trio's
    ``autojump_clock``, which the test must take as an argument to run on it).

    A native call runs on the trio thread (:class:`_VirtualThread`) and takes no real time: the
    stand-in runtime adds its compute to :attr:`computing`, which the clocks read during the call
    (so the scheduler times the batch as it would a real one), and the call's task then sleeps
    that long in trio's time while the other tasks (the other stage, the sessions) go on.  The
    scheduler's decisions then depend only on the events it saw and their (virtual) times, not
    on how loaded the host is.  What is left to chance is the order in which trio runs the tasks
    woken at one instant (trio shuffles it, and breaks ties by object ids)."""

    def __init__(self, clock: MockClock) -> None:
        self.clock = clock
        self.computing = 0.0  #: seconds of compute of the native call running now

    def monotonic(self) -> float:
        return self.clock.current_time() + self.computing

    perf_counter = monotonic

    def perf_counter_ns(self) -> int:
        return round(self.monotonic() * 1e9)

    @staticmethod
    def thread_time_ns() -> int:
        return time.thread_time_ns()


class _VirtualThread:
    """The scheduler's runtime thread in virtual time (:class:`_VirtualTime`); never abandoned,
    as the real one."""

    def __init__(self, clock: _VirtualTime) -> None:
        self.clock = clock
        self.inside = False

    async def run_sync(self, function: Callable[[], T]) -> T:
        self.inside = True
        try:
            result = function()
        finally:
            self.inside = False
            seconds, self.clock.computing = self.clock.computing, 0.0
        with trio.CancelScope(shield=True):
            await trio.sleep(seconds)
        return result

    def close(self) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch, autojump_clock: MockClock) -> _VirtualTime:
    """The scheduler's clocks in virtual time (:class:`_VirtualTime`; the test takes
    ``autojump_clock`` too)."""
    assert isinstance(autojump_clock, MockClock)
    virtual = _VirtualTime(autojump_clock)
    monkeypatch.setattr(scheduler_module, "time", virtual)
    return virtual


class _Runtime:
    """An executor stand-in: a native batch takes ``fixed`` plus ``seconds`` per row of virtual
    time (:class:`_VirtualTime`) and is recorded (a prefill chunk's session negated)."""

    blocking = True
    compute_threads = 1

    def __init__(self, clock: _VirtualTime, seconds: float = 0.002, fixed: float = 0.0) -> None:
        self.clock = clock
        self.seconds = seconds
        self.fixed = fixed
        self.thread = _VirtualThread(clock)
        self.batches: list[list[int]] = []
        self.ends: list[float] = []  #: when each decode batch ended (virtual time)

    def _compute(self, seconds: float) -> None:
        assert self.thread.inside, "a native call ran outside the (virtual) runtime thread"
        self.clock.computing += seconds

    def run_decode_batch(self, items: Sequence[WorkItem]) -> list[WorkResult]:
        self.batches.append([item.session for item in items])
        self._compute(self.fixed + self.seconds * len(items))
        self.ends.append(self.clock.monotonic())
        return [WorkResult(None, [1], len(items)) for _ in items]

    def run_item(self, item: WorkItem) -> WorkResult:
        self.batches.append([item.session] if item.batchable else [-item.session])
        self._compute((self.fixed if item.batchable else 0.0) + self.seconds * min(item.rows, 4))
        if item.batchable:
            self.ends.append(self.clock.monotonic())
        return WorkResult(None, [1])


def _scheduler(runtime: _Runtime, groups: int) -> Scheduler:
    scheduler = Scheduler(runtime, StageStats(), decode_groups=groups)  # type: ignore[arg-type]
    scheduler._thread.close()
    scheduler._thread = runtime.thread  # type: ignore[assignment]
    return scheduler


async def _rows_at_once(scheduler: Scheduler, sessions: Sequence[int]) -> None:
    async with trio.open_nursery() as nursery:
        for session in sessions:
            nursery.start_soon(scheduler.execute, _row(session))


@pytest.mark.parametrize("groups", [0, 2])
async def test_rows_that_queue_together_run_in_groups_of_the_cap(clock: _VirtualTime, autojump_clock: MockClock, groups: int) -> None:
    runtime = _Runtime(clock)
    scheduler = _scheduler(runtime, groups)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await _rows_at_once(scheduler, range(1, 9))  # 8 sessions become active
        runtime.batches.clear()
        await _rows_at_once(scheduler, range(1, 9))
        nursery.cancel_scope.cancel()
    sizes = [len(batch) for batch in runtime.batches]
    if groups:
        assert sizes == [4, 4]  # ceil(8 / 2): two groups
        assert sorted(runtime.batches[0] + runtime.batches[1]) == list(range(1, 9))
    else:  # greedy: every row of the moment in one batch
        assert sizes == [8]


#: A message's trip from one stage (or the driver) to the next, in virtual time: a row that came
#: back at the very instant its batch ended would have no turnaround to learn (``_Member.due``).
HOP_S = 0.0001


async def _pipeline(clock: _VirtualTime, steps: int, seconds: float, fixed: float = 0.0,
                    turnaround: float = 0.0) -> tuple[list[_Runtime], list[list[float]]]:
    """Two schedulers (stage 0, stage 1) of two decode groups, each batch ``fixed`` plus
    ``seconds`` a row, and 8 sessions in a loop of ``steps``: a session's row goes to stage 1 when
    stage 0 has run it, back to stage 0 ``turnaround`` times its number after stage 1 has (the
    driver turning them around one by one), each message taking :data:`HOP_S` more.  Returns the
    runtimes (their batches) and when each session finished each step."""
    runtimes = [_Runtime(clock, seconds, fixed), _Runtime(clock, seconds, fixed)]
    stages = [_scheduler(runtime, 2) for runtime in runtimes]
    done: list[list[float]] = [[] for _ in range(steps)]
    async with trio.open_nursery() as nursery:
        for stage in stages:
            await nursery.start(stage.run)

        async def session(key: int) -> None:
            for step in range(steps):
                await stages[0].execute(_row(key))
                await trio.sleep(HOP_S)
                await stages[1].execute(_row(key))
                done[step].append(trio.current_time())
                await trio.sleep(HOP_S + turnaround * key)
            for stage in stages:  # its Stop
                stage.forget(key)

        async with trio.open_nursery() as clients:
            for key in range(1, 9):
                clients.start_soon(session, key)
        nursery.cancel_scope.cancel()
    return runtimes, done


def _alternating_groups(batches: Sequence[Sequence[int]]) -> bool:
    """Every batch is one of two disjoint groups of 4 and the two take turns."""
    return (all(len(batch) == 4 for batch in batches)
            and all(not set(a) & set(b) for a, b in zip(batches, batches[1:]))
            and all(set(a) == set(b) for a, b in zip(batches, batches[2:])))


async def test_groups_rotate_through_a_two_stage_pipeline(clock: _VirtualTime, autojump_clock: MockClock) -> None:
    """8 sessions through 2 stages, 2 ms of compute per row on each (:func:`_pipeline`).  In
    lockstep a step is 8 rows on stage 0, then 8 on stage 1 (32 ms); with two groups each stage
    computes one group of 4 while the other computes the other group (16 ms and the turns'
    gathering).  In virtual time (:func:`clock`) the groups form within the first two steps and
    then alternate, whole, on both stages until the sessions end, steps taking at most 24 ms:
    so in each of 300 of trio's orders of the tasks woken together tried (the only thing left
    to chance); the test runs 4."""
    steps = 16
    for run in range(4):
        runtimes, done = await _pipeline(clock, steps, 0.002)
        step_s = [max(done[s]) - max(done[s - 1]) for s in range(steps // 2, steps)]
        assert max(step_s) < 0.75 * 0.032, (run, step_s)
        formed, first_done = max(done[2]), min(done[-1])
        for runtime in runtimes:
            steady = [batch for batch, end in zip(runtime.batches, runtime.ends) if formed < end < first_done]
            assert len(steady) >= 20 and _alternating_groups(steady), (run, runtime.batches)


def _rows_per_batch(batches: Sequence[Sequence[int]]) -> float:
    later = [batch for batch in batches[len(batches) // 2:] if batch[0] > 0]  # the groups have formed
    return sum(map(len, later)) / len(later)


async def test_one_stage_runs_every_session_in_one_batch_though_they_come_back_spread(clock: _VirtualTime, autojump_clock: MockClock) -> None:
    """One stage, 8 sessions, a batch costs 20 ms and 1 ms a row; after its reply, session i sends
    its next row i ms later (a driver or a lane turning 8 sessions around one after another).
    The stage waits for them (their turnaround is well within a batch's time): 8 rows a batch,
    where a short gather split them into fragments that never merged again."""
    runtime = _Runtime(clock, 0.001, fixed=0.02)
    scheduler = _scheduler(runtime, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)

        async def session(key: int) -> None:
            await trio.sleep(0.0005 * key)  # staggered starts
            for _ in range(14):
                await scheduler.execute(_row(key))
                await trio.sleep(0.001 * key)

        async with trio.open_nursery() as clients:
            for key in range(1, 9):
                clients.start_soon(session, key)
        nursery.cancel_scope.cancel()
    assert _rows_per_batch(runtime.batches) >= 6, runtime.batches  # fragments that never merge: 4


async def test_two_stages_fill_with_two_groups_though_rows_come_back_spread(clock: _VirtualTime,
                                                                            autojump_clock: MockClock) -> None:
    """Two stages (a batch: 10 ms and 1 ms a row each), 8 sessions; after stage 1's reply, session
    i's next row reaches stage 0 i ms later (the driver turning them around one by one).  Once the
    groups have formed, two groups of 4 alternate on both stages, both busy most of the time.

    In virtual time (:func:`clock`) only trio's order of the tasks woken together is left to
    chance: in each of 300 orders tried the middle third ran at least 3.6 rows a batch and kept
    both stages at least 71% busy (fragments that never merge: 2.6-2.7 rows; lockstep: 41%).
    The test runs 4."""
    for run in range(4):
        runtimes, _ = await _pipeline(clock, 30, 0.001, fixed=0.01, turnaround=0.001)
        # the middle third of the run: the groups have formed, and no session has finished yet
        began = min(runtime.ends[0] for runtime in runtimes)
        ended = max(runtime.ends[-1] for runtime in runtimes)
        start, stop = began + (ended - began) / 3, began + 2 * (ended - began) / 3
        for runtime in runtimes:
            middle = [batch for batch, end in zip(runtime.batches, runtime.ends) if start < end <= stop]
            assert len(middle) >= 15 and sum(map(len, middle)) / len(middle) >= 3.3, (run, middle)
            busy = sum(0.01 + 0.001 * len(batch) for batch in middle)
            assert busy / (stop - start) > 0.55, (run, busy, stop - start)  # lockstep: 18 ms of every 44


async def test_a_groups_late_rows_are_gathered_into_one_batch(clock: _VirtualTime, autojump_clock: MockClock) -> None:
    runtime = _Runtime(clock, 0.01)
    scheduler = _scheduler(runtime, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        for _ in range(3):  # the group forms (and the recent batch time and turnarounds are known)
            await trio.sleep(HOP_S)
            await _rows_at_once(scheduler, [1, 2, 3])
        runtime.batches.clear()

        async def late(session: int, delay: float) -> None:
            await trio.sleep(delay)
            await scheduler.execute(_row(session))

        async with trio.open_nursery() as rows:  # 1 ms apart, well within half a batch's time
            for index, session in enumerate((1, 2, 3)):
                rows.start_soon(late, session, 0.001 * index)
        nursery.cancel_scope.cancel()
    assert [sorted(batch) for batch in runtime.batches] == [[1, 2, 3]]


async def test_a_group_does_not_wait_for_a_row_that_does_not_come(clock: _VirtualTime, autojump_clock: MockClock) -> None:
    runtime = _Runtime(clock, 0.01)
    scheduler = _scheduler(runtime, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        for _ in range(3):
            await trio.sleep(HOP_S)
            await _rows_at_once(scheduler, [1, 2])
        runtime.batches.clear()
        with trio.fail_after(1):
            began = trio.current_time()
            await scheduler.execute(_row(1))  # 2 stays away (it ended, or prefills)
            waited = trio.current_time() - began
        nursery.cancel_scope.cancel()
    assert runtime.batches == [[1]]
    assert waited < 0.01 + scheduler_module.GATHER_MAX_S + 0.05


async def test_prefill_chunks_and_decode_rows_take_turns(clock: _VirtualTime, autojump_clock: MockClock) -> None:
    """Decode rows of 4 sessions keep coming while 3 lanes send prefill chunks: every turn runs a
    decode batch and one chunk (the budget), so neither waits for all of the other."""
    runtime = _Runtime(clock, 0.005)
    scheduler = _scheduler(runtime, 1)
    budget = scheduler_module.PREFILL_ROWS_PER_TURN
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await _rows_at_once(scheduler, [1, 2, 3, 4])
        runtime.batches.clear()

        async def decoding(session: int) -> None:
            for _ in range(6):
                await scheduler.execute(_row(session))

        async def prefilling(session: int) -> None:
            for _ in range(2):
                await scheduler.execute(_chunk(session, budget))

        async with trio.open_nursery() as work:
            work.start_soon(scheduler.execute, _row(1))  # claims the runtime: the rest queue
            await trio.sleep(0)
            for session in (11, 12, 13):
                work.start_soon(prefilling, session)
            for session in (2, 3, 4):
                work.start_soon(decoding, session)
        nursery.cancel_scope.cancel()
    kinds = "".join("P" if batch[0] < 0 else "D" for batch in runtime.batches)
    # the first chunk runs in the first turn after the lead row's; while sessions decode, no two
    # chunks run back to back; the decodes do not wait for all the chunks either
    assert kinds.index("P") <= 2 and "PP" not in kinds.rstrip("P"), kinds
    assert kinds.index("D", 1) < kinds.rindex("P"), kinds


# -- a real chain ----------------------------------------------------------------------------------

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 450, 4996, 17354], [1, 306, 626, 263, 1243], [1, 3439, 17632]]
STEPS = 16


async def _decode_all(address: object) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def lane(index: int) -> None:
        async with await StageClient.connect(address) as client:  # type: ignore[arg-type]
            session = index + 1
            await client.configure(session)
            token = (await client.prefill(session, PROMPTS[index], chunk_size=4)).token
            tokens, position = [token], len(PROMPTS[index])
            while len(tokens) < STEPS:
                token = (await client.decode(session, token, position)).predicted
                tokens.append(token)
                position += 1
            await client.stop(session)
            results[index] = tokens

    async with trio.open_nursery() as nursery:
        for index in range(len(PROMPTS)):
            nursery.start_soon(lane, index)
    return results


@pytest.mark.parametrize("batching", [False, True])
async def test_concurrent_sessions_on_two_stages(tiny_llama: Path, batching: bool) -> None:
    """Batching off: each of 4 concurrent sessions gets its solo tokens through 2 stages.  On:
    the decode groups hold at most ceil(4 / 2) rows per batch on either stage."""
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), decode_batching=batching,
                               chain_stages=2) as stages:
        assert stages[0].address is not None
        results = await _decode_all(stages[0].address)
        sizes = [stage.stats.max_decode_batch for stage in stages]
        for stage in stages:  # the busy time, each batch once, and its thread's CPU in it
            assert stage.stats.runtime_cpu_us > 0 and stage.stats.runtime_busy_us > 0
    if batching:
        assert all(size <= 2 for size in sizes), sizes
        assert all(len(tokens) == STEPS for tokens in results)
    else:
        assert sizes == [1, 1]
        for prompt, tokens in zip(PROMPTS, results):
            assert tokens == reference_greedy(tiny_llama, prompt, STEPS, chunk_size=4)


async def test_many_lanes_plan_no_decode_relay(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With other lanes working, ``Scheduler.hold`` refuses a decode relay, so a lane among many
    does not plan one per message (the relay's plan and run built only to be refused: about 2% of
    a stage's CPU at N = 8 before); a lane alone still relays."""
    from skippy.stage import connection as connection_module

    planned: list[int] = []
    plan = connection_module.relay_plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        planned.append(1)
        return plan(*args, **kwargs)

    monkeypatch.setattr(connection_module, "relay_plan", counting)
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), chain_stages=2) as stages:
        assert stages[0].address is not None
        results = await _decode_all(stages[0].address)
        assert all(len(tokens) == STEPS for tokens in results)
        together = len(planned)
        assert scheduler_module.RECENT_WORK_S < 1.0
        await trio.sleep(scheduler_module.RECENT_WORK_S + 0.1)  # the other lanes' work is old now
        alone = await _decode_all_one(stages[0].address)
        assert len(alone) == STEPS
    # 4 sessions x 15 decodes on 2 stages went past the relay: at most a lane's first or last
    # message, when the others had not yet brought work or had stopped, may plan one
    assert together <= 8, together
    assert len(planned) > together  # one lane alone: its decodes may leave Python


async def _decode_all_one(address: object) -> list[int]:
    async with await StageClient.connect(address) as client:  # type: ignore[arg-type]
        await client.configure(99)
        token = (await client.prefill(99, PROMPTS[0], chunk_size=4)).token
        tokens, position = [token], len(PROMPTS[0])
        while len(tokens) < STEPS:
            token = (await client.decode(99, token, position)).predicted
            tokens.append(token)
            position += 1
        await client.stop(99)
    return tokens
