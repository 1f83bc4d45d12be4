"""One scheduler per stage: the only path to the runtime, with cross-session decode batching.

Strategy: every connection submits work as a *job* to one queue and awaits its result; a single
scheduler task owns the :class:`~skippy.stage.executor.Executor`.  When the runtime is free the
scheduler takes **every** job that is ready (optionally after a small collection window, off by
default) and runs, in one trip to the worker thread:

* all single-row decode jobs of distinct sessions as one native batch (continuous batching: rows
  that arrived while the previous batch ran are merged, nothing waits for company by default);
* then the other jobs (prefill chunks, verify windows, session control) one by one, in arrival
  order.

Native calls run on the stage's :class:`~skippy.stage.worker.RuntimeThread` (cffi releases the
GIL; one dedicated thread is cheaper per call than ``trio.to_thread``); the null runtime, which
never blocks, runs inline.  *Inline decode* (``inline_decode``, on by default): a lone decode row
while the stage has exactly one working lane (its :class:`~skippy.lane.registry.LaneRegistry`:
return lanes, which only carry predictions written into them, do not count) runs on the trio
thread itself.  Nothing else can need
that thread during the compute (the lane's next message waits on this row's reply, and there is
no other lane), and the hand-off it saves is on every token's critical path: the queue put that
wakes the runtime thread, the GIL passing back and forth, the completion's wake-up fd and run-loop
pass -- 0.2-0.3 ms of CPU per stage per token on the 2-core bench host
(``bench/RESULTS-stage.md``, "Per-boundary cost with real compute").  Prefill chunks, verify
windows, control calls and every job once a second lane is open still go to the runtime thread.
With more than one compute thread (``Executor.compute_threads``) inline decode is off: ggml then
runs each graph in an OpenMP team led by the calling thread, libgomp keeps a pool of helper threads
per calling thread, and once a process has more pool threads than cores libgomp cuts every wait's
spin to 100 rounds (its "throttled" spin) for good, so a stage of ``--threads`` = cores waits as if
passive.  Every native compute of such a stage (decode relays too: :meth:`Scheduler.run_native`)
runs on the one runtime thread, as llama-server runs all of its batches on one.  A job's requester that is cancelled simply
stops waiting: the job still runs, so the runtime and the session table stay consistent.  Each
connection has at most one job queued at a time, so per-session order is the submission order.

*Decode batching* (``decode_batching``, on by default) can be turned off: llama.cpp's CPU kernels
take different paths for one row and for several (a batched row's logits differ from the same row
alone in the last bits: ~2e-6 on the tiny llama), so with batching a session's greedy tokens can
flip at a near-tie depending on what other sessions were decoding at that moment.  Off, every row
is its own native batch: a session's results depend only on its own messages.

Idle fast path: when the runtime is free and nothing is queued (and no batching window is set),
the submitting task runs its job itself, as the scheduler would have, instead of waking the
scheduler task and being woken back (two trio hand-offs per message).  The runtime is claimed
first; for a native decode row the task then yields once, so rows other lanes submit in the same
trio tick join its batch (what one scheduler pass gave), and rows submitted while it runs queue
and are batched by the scheduler as soon as it is released: batching across sessions is kept.  A requester cancelled during
its own run still lets the job finish (the runtime thread's calls are never abandoned).

*Decode groups* (``decode_policy`` "groups", the default; issue 31, ``docs/throughput.md``): on
a chain of P stages, sessions that move in lockstep leave every stage idle while the others
compute.  So each *turn* (one trip to the runtime) runs at most ``ceil(active / G)`` decode rows
(G = ``chain_stages``, the groups; *active*: the sessions that sent a decode row lately, see
:class:`DecodeGroups`), oldest first: the sessions split into G groups that take turns on every
stage, each stage computing one group while its neighbours compute the others.  A session keeps
its group (0..G-1: the one its last batch ran as; a batch is one group, the one most of its rows
were in unless that would exceed the cap).  A turn waits, while it holds fewer rows than the
cap, for the rows that come *soon*, its own group's first: each session's usual turnaround (from
its batch's end to its next row) says when, within the turn's bound (a recent batch's time,
:data:`GATHER_MAX_S` at most); a session that has not come by its turnaround and slack (it
finished, prefills, sent a verify window) is given up.  A full turn takes a group whose rows are
all in first; the other groups' rows fill a turn that is full anyway or has waited.
So a group stays one native batch, fragments merge again, and on one stage (G = 1) every active
session's row shares one batch.  After its decode batch a
turn runs prefill chunks, verify windows and control calls: all of them when no decode row
waits, else control calls and prefill / verify jobs up to :data:`PREFILL_ROWS_PER_TURN` rows
(at least one job), so a long prompt neither stalls the decodes nor is starved by them.
"greedy" (before issue 31): every ready job in one turn.  Either way a batch holds only rows
that are ready; what differs is which rows share a batch, which batching already may change
(above); with ``decode_batching`` off every job runs alone, in arrival order, as before.

*Head shard rows* (issue 31, :meth:`Scheduler.head_rows`): the output head's rows this stage
computes for a split head's final stage are a job of their own kind, on the same one compute
thread as the stage's batches: first in their turn (the final stage waits on them), at once in a
turn that gathers decode rows (which goes on gathering), inline on an idle runtime with one
working lane or beside a decode relay (never stopping it).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Collection, Generic, Sequence, TypeVar

import trio

from skippy.lane.errors import ShuttingDown
from skippy.lane.registry import LaneRegistry
from skippy.stage.executor import Executor, WorkItem, WorkResult
from skippy.stage.stats import StageStats
from skippy.stage.worker import RuntimeThread

T = TypeVar("T")

#: A lane that brought work within this many seconds keeps a decode relay from holding the
#: runtime for another lane (:meth:`Scheduler.hold`): their rows batch instead.
RECENT_WORK_S = 0.5

#: Trio ticks the idle fast path waits, at most, for rows arriving with its own (it stops at the
#: first tick that brings none, so a lone session pays one yield).
_GATHER_TICKS = 3

#: How long a turn gathers, at most: this fraction of a recent decode batch's wall time, and never
#: more than ``GATHER_MAX_S``.  An extra batch costs about a batch's fixed part, and realigning a
#: group whose members drifted a batch apart takes a batch's wait once.
GATHER_FRACTION = 1.0
GATHER_MAX_S = 0.1
#: A session's row is expected by its usual turnaround (from the end of the batch it ran in to its
#: next row) plus this fraction of it, and at least ``TURN_SLACK_S`` more.
TURN_SLACK = 0.5
TURN_SLACK_S = 0.005
#: Rows of prefill chunks and verify windows a turn runs after its decode batch while decode rows
#: wait (a turn runs at least one such job).
PREFILL_ROWS_PER_TURN = 64
#: A session is active (expected back) until this many of its own intervals between decode rows
#: have passed since its last one (at least :data:`ACTIVE_MIN_S`); forgotten after ``FORGET_S``.
ACTIVE_INTERVALS = 3.0
ACTIVE_MIN_S = 0.05
FORGET_S = 10.0

#: ``SKIPPY_SCHED_TRACE=PREFIX``: each scheduler writes one line per turn to ``PREFIX.<pid>.<n>``
#: (:class:`TurnTrace`; a debugging aid, off by default).
TRACE_ENV = "SKIPPY_SCHED_TRACE"


class TurnTrace:
    """A per-turn trace of the scheduler (``SKIPPY_SCHED_TRACE``): one line per turn, written when
    its batch has run::

        t=<ms> via=<fast|serve> idle=<ms> wait=<ms> active=<n> cap=<n> rows=<s>@<ms>,... left=<n> jobs=<n> batch=<ms>
        cpu=<ms> native=<ms>/<ms> at=<ms>

    ``t``: the turn's start (claiming the runtime), ms since the trace began; ``idle``: since the
    previous turn's runtime work ended; ``wait``: how long the turn gathered; ``rows``: the decode
    rows it ran, each a small session number and when it was submitted, ms after the previous
    turn's end (negative: it queued during that turn); ``left``: decode rows left queued;
    ``jobs``: the turn's other jobs; ``batch``: the runtime's wall time for the turn; ``cpu``: its
    thread's CPU time; ``native``: the wall / CPU time of its native decode batch; ``at``: the
    turn's start on ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every stage of a host).
    """

    _count = 0

    def __init__(self, prefix: str) -> None:
        TurnTrace._count += 1
        self.file = open(f"{prefix}.{os.getpid()}.{TurnTrace._count}", "w", buffering=1)  # noqa: SIM115
        self.origin = time.perf_counter_ns()
        self.ended = self.origin  #: when the previous turn's runtime work ended
        self.names: dict[int, int] = {}
        self.line = ""

    def _name(self, session: int) -> int:
        return self.names.setdefault(session, len(self.names))

    def turn(self, via: str, started_ns: int, jobs: Sequence["_Job[Any]"], left: Sequence["_Job[Any]"],
             active: int, cap: int | None) -> None:
        """A turn's jobs were chosen (``started_ns``: when it claimed the runtime)."""
        now = time.perf_counter_ns()
        rows = ",".join(f"{self._name(job.item.session)}@{(job.submitted_ns - self.ended) / 1e6:.1f}"
                        for job in jobs if job.item is not None and job.item.batchable)
        others = sum(1 for job in jobs if job.item is None or not job.item.batchable)
        waiting = sum(1 for job in left if job.item is not None and job.item.batchable)
        self.line = (f"t={(started_ns - self.origin) / 1e6:.1f} via={via} idle={(started_ns - self.ended) / 1e6:.1f} "
                     f"wait={(now - started_ns) / 1e6:.1f} active={active} cap={cap} rows={rows} left={waiting} "
                     f"jobs={others}")

    def ran(self, started_ns: int, cpu_ns: int, native: tuple[int, int]) -> None:
        """The turn's runtime work ended (``cpu_ns``: the runtime thread's CPU in it; ``native``:
        the wall and CPU ns of its native decode batch)."""
        self.ended = time.perf_counter_ns()
        self.file.write(f"{self.line} batch={(self.ended - started_ns) / 1e6:.1f} cpu={cpu_ns / 1e6:.2f} "
                        f"native={native[0] / 1e6:.2f}/{native[1] / 1e6:.2f} "
                        f"at={started_ns / 1e6:.2f}\n")
        self.line = ""


def _native_ns(executor: Executor) -> tuple[int, int]:
    """The executor's native decode wall and CPU ns so far (0 for a stand-in without them)."""
    return getattr(executor, "native_wall_ns", 0), getattr(executor, "native_cpu_ns", 0)


def decode_groups(policy: str, chain_stages: int, executor: Executor) -> int:
    """The scheduler's ``decode_groups`` for a stage's settings: 0 for the greedy policy, else the
    chain's stages (when not given: 1 for a stage that holds the whole model, else 2)."""
    if policy == "greedy":
        return 0
    if chain_stages > 0:
        return chain_stages
    return 1 if executor.is_first and executor.is_last else 2


@dataclasses.dataclass(slots=True)
class _Member:
    seen: float  #: when its last decode row arrived
    interval: float = 0.0  #: between its last two rows (0: one so far)
    ran_at: float = 0.0  #: when the last decode batch it ran in ended (0: none yet)
    turn: float = 0.0  #: its usual time from there to its next row (an exponential average; 0: unknown)
    group: int = -1  #: its group, 0..G-1 (-1: it has not run yet)

    def due(self) -> float:
        """Until when its next row is expected, once its last one ran (0: not expected: it has not
        run, its row is here, or its turnaround is unknown)."""
        if self.ran_at <= self.seen or self.turn <= 0:
            return 0.0
        return self.ran_at + self.turn + max(TURN_SLACK_S, TURN_SLACK * self.turn)


class DecodeGroups:
    """Which decode rows share a turn, and how long a turn waits for more (sans-IO: the caller
    passes the time; module header).

    Args:
        groups: G, the groups the active sessions split into (the chain's stages).
    """

    def __init__(self, groups: int) -> None:
        if groups < 1:
            raise ValueError(f"decode groups must be >= 1 (got {groups})")
        self.groups = groups
        self._members: dict[int, _Member] = {}
        self._batches = 0
        #: A recent decode batch's wall time (an exponential average), seconds; 0: none yet.
        self.batch_s = 0.0

    def arrived(self, session: int, now: float) -> None:
        """A decode row of ``session`` was submitted."""
        member = self._members.get(session)
        if member is None:
            self._members[session] = _Member(now)
            return
        if member.ran_at > member.seen:  # back from the batch it ran in: its turnaround
            turn = now - member.ran_at
            member.turn = turn if member.turn <= 0 else 0.7 * member.turn + 0.3 * turn
        member.interval, member.seen = now - member.seen, now

    def forget(self, session: int) -> None:
        """``session`` ended: no turn waits for it, and it no longer counts as active."""
        self._members.pop(session, None)

    @staticmethod
    def _active(member: _Member, now: float) -> bool:
        return now - member.seen <= max(ACTIVE_MIN_S, ACTIVE_INTERVALS * member.interval)

    def active(self, now: float) -> int:
        """Sessions that sent a decode row lately (expected back)."""
        return sum(1 for member in self._members.values() if self._active(member, now))

    def cap(self, now: float, ready: Collection[int] = ()) -> int:
        """The most decode rows one turn runs: ``ceil(active / G)``, a session whose row is
        ``ready`` counted as active however long it has waited (a new session's first row that
        queued behind a batch longer than :data:`ACTIVE_MIN_S` must not be left for the next)."""
        members = self._members
        late = sum(1 for session in ready
                   if (member := members.get(session)) is None or not self._active(member, now))
        return max(1, -(-(self.active(now) + late) // self.groups))

    def gather_s(self) -> float:
        """How long a turn waits for more rows, at most."""
        return min(GATHER_MAX_S, GATHER_FRACTION * self.batch_s) if self.batch_s > 0 else GATHER_MAX_S / 20

    def group_of(self, session: int) -> int:
        member = self._members.get(session)
        return -1 if member is None else member.group

    def plan(self, ready: Sequence[int], now: float, limit: float | None = None) -> tuple[list[int], float]:
        """The sessions whose rows a turn runs, of those with a row ready (``ready``, oldest
        first), and until when the turn waits for more rows first (<= ``now``: it runs now).

        At most :meth:`cap` rows.  A full turn runs at once: a group whose members are all here
        first (else the group of the oldest row), then the rows of sessions that have not run
        yet, then the other groups' rows, oldest first.  A turn with fewer rows waits for the rows
        that are *soon*: of active sessions on their way whose usual turnaround brings them by
        ``limit`` (the latest the turn may start: default :meth:`gather_s` from now), each at most
        until that turnaround and its slack have passed (a session that has not come by then, as
        it finished, prefills or sent a verify window, is given up); it waits for as many as it
        lacks, its own group's first, then the soonest.  Rows further away (on a chain, the other
        groups on their way through the other stages) form a later turn's batch.
        """
        if not ready:  # a chunk or a control call leads: it never waits for rows
            return [], now
        if limit is None:
            limit = now + self.gather_s()
        cap = self.cap(now, ready)
        here = set(ready)
        soon: dict[int, list[float]] = {}  # group -> when its rows on their way by ``limit`` are given up
        for session, member in self._members.items():
            if session not in here:
                until = member.due()
                if until > now and member.ran_at + member.turn <= limit and self._active(member, now):
                    soon.setdefault(member.group, []).append(until)
        labels = [self.group_of(session) for session in ready]
        order = list(dict.fromkeys(label for label in labels if label >= 0))  # groups by their oldest row
        complete = [label for label in order if label not in soon]
        chosen = complete[0] if complete else order[0] if order else -1
        own = [s for s, label in zip(ready, labels) if label == chosen or label < 0]
        rest = [s for s, label in zip(ready, labels) if label != chosen and label >= 0]
        full = (own + rest)[:cap]
        if len(ready) >= cap or not soon:
            return full, now
        # the rows it lacks: its own group's first (they ran together), then the soonest others
        mine = sorted(soon.get(chosen, ()))
        others = sorted(until for group, times in soon.items() if group != chosen for until in times)
        return full, max((mine + others)[:cap - len(ready)])

    def ran(self, sessions: Sequence[int], seconds: float, now: float) -> None:
        """``sessions`` ran as one decode batch of ``seconds``, ending ``now``: they are one group
        (the one most of them were in, unless that would make it larger than the cap: then the
        smallest one)."""
        self._batches += 1
        members = [m for m in (self._members.get(session) for session in sessions) if m is not None]
        if members:
            cap = self.cap(now, sessions)
            size = [0] * self.groups
            inside = set(map(id, members))
            for member in self._members.values():
                if member.group >= 0 and id(member) not in inside and self._active(member, now):
                    size[member.group] += 1
            votes = [0] * self.groups
            for member in members:
                if member.group >= 0:
                    votes[member.group] += 1
            group = max(range(self.groups), key=lambda g: (votes[g], -g))
            if votes[group] == 0 or size[group] + len(members) > cap:
                group = min(range(self.groups), key=lambda g: (size[g], -votes[g], g))
            for member in members:
                member.ran_at = now
                member.group = group
        self.batch_s = seconds if self.batch_s <= 0 else 0.8 * self.batch_s + 0.2 * seconds
        if self._batches % 256 == 0:
            for session in [s for s, m in self._members.items() if now - m.seen > FORGET_S]:
                del self._members[session]


@dataclasses.dataclass(slots=True, eq=False)
class _Job(Generic[T]):
    item: WorkItem | None
    call: Callable[[], T] | None
    submitted_ns: int
    #: The write made where the result is computed (the runtime thread), with (result, queue_us):
    #: a write-through placement (:mod:`skippy.stage.write_through`).  It must not raise.
    then: Callable[[WorkResult, int], None] | None = None
    done: trio.Event | None = None  #: made when the job is queued (the fast path never waits)
    result: Any = None
    error: BaseException | None = None
    wait_us: int = 0
    #: Head shard rows (:meth:`Scheduler.head_rows`): first in its turn; a gathering turn runs it at once.
    urgent: bool = False


def _has_urgent(jobs: Sequence[_Job[Any]]) -> bool:
    return any(job.urgent for job in jobs)


def _ready_sessions(jobs: Sequence[_Job[Any]]) -> list[int]:
    """The sessions of the decode rows among ``jobs``, each once, in order."""
    sessions: dict[int, None] = {}
    for job in jobs:
        item = job.item
        if item is not None and item.batchable:
            sessions.setdefault(item.session)
    return list(sessions)


def select_turn(pending: Sequence[_Job[Any]], cap: int | None, *, decoding: bool = False,
                chosen: Collection[int] | None = None) -> tuple[list[_Job[Any]], list[_Job[Any]]]:
    """The jobs of one turn and those left for a later one, each in arrival order.

    ``cap`` None (the greedy policy, or batching off): every job.  Else at most ``cap`` decode
    rows of distinct sessions (the oldest; only of the ``chosen`` sessions when given), every
    control call, and prefill / verify jobs up to :data:`PREFILL_ROWS_PER_TURN` rows (at least
    one) while decode rows are left over or ``decoding`` (sessions decode, so their rows are
    due).  Without ``chosen`` the first job is always in the turn.
    """
    if cap is None:
        return list(pending), []
    rows: list[_Job[Any]] = []
    sessions: set[int] = set()
    others: list[_Job[Any]] = []
    for job in pending:
        item = job.item
        if (item is not None and item.batchable and item.session not in sessions and len(rows) < cap
                and (chosen is None or item.session in chosen)):
            sessions.add(item.session)
            rows.append(job)
        else:
            others.append(job)
    decode_left = decoding or any(job.item is not None and job.item.batchable for job in others)
    taken: list[_Job[Any]] = []
    left: list[_Job[Any]] = []
    budget = 0
    for job in others:
        item = job.item
        if item is None:  # a control call: cheap, and its lane waits on it
            taken.append(job)
        elif item.batchable or (decode_left and budget >= PREFILL_ROWS_PER_TURN):
            left.append(job)  # a decode row of a later turn, or a chunk past this turn's budget
        else:
            taken.append(job)
            budget += item.rows
    order = {id(job): index for index, job in enumerate(pending)}
    return sorted(rows + taken, key=lambda job: order[id(job)]), left


@dataclasses.dataclass(slots=True)
class _Trip:
    """What one trip to the runtime ran (the stats are updated on the trio thread)."""

    decode_batches: list[int] = dataclasses.field(default_factory=list)
    native: int = 0
    #: The sessions of the trip's decode batch (a lone row included), and its seconds.
    batch_sessions: list[int] = dataclasses.field(default_factory=list)
    batch_s: float = 0.0
    cpu_ns: int = 0


class Scheduler:
    """Serialises and batches runtime work for all connections of a stage.

    Args:
        executor: the runtime and its session table.
        stats: counters to update.
        batch_window: seconds to wait for more decode rows once one is ready (0 = none).
        decode_groups: the decode groups (module header; :func:`decode_groups`); 0: the greedy
            policy, every ready row at once.
        lanes: the stage's working lanes (the lanes register themselves; None: a new registry).
    """

    def __init__(self, executor: Executor, stats: StageStats, *, batch_window: float = 0.0,
                 inline_decode: bool = True, decode_batching: bool = True, decode_groups: int = 0,
                 lanes: LaneRegistry | None = None) -> None:
        self.executor = executor
        self.stats = stats
        #: The lanes that may bring work (the placement policy's input; never the statistics).
        self.lanes = lanes if lanes is not None else LaneRegistry()
        self.batch_window = batch_window
        #: False (``--decode-batching off``): every decode row runs as its own native batch.
        self.decode_batching = decode_batching
        #: Off with several compute threads: one OpenMP pool per process (the module header).
        self.inline_decode = inline_decode and executor.compute_threads == 1
        #: The decode-group policy (None: greedy, or batching off).
        self.groups = DecodeGroups(decode_groups) if decode_groups > 0 and decode_batching else None
        #: Jobs submitted and not yet started, in arrival order.
        self._pending: list[_Job[Any]] = []
        #: Set when a job is queued: the scheduler loop's and a gathering turn's wake-ups.
        self._wake = trio.Event()
        self._arrival = trio.Event()
        self._closed = False
        #: The runtime is claimed: a turn gathers or runs (the scheduler's or a caller's fast path).
        self._busy = False
        self._released: trio.Event | None = None
        #: The decode relay holding the runtime: called when a job is queued behind it.
        self._holder_stop: Callable[[], None] | None = None
        self._holder_idle: Callable[[], float] | None = None
        self._held_at = 0.0
        #: When each lane (a session key's upper bits) last submitted a work item.
        self._last_work: dict[int, float] = {}
        self._thread = RuntimeThread()
        trace = os.environ.get(TRACE_ENV)
        #: The per-turn trace (:class:`TurnTrace`; None: off).
        self._trace = TurnTrace(trace) if trace else None

    async def run_native(self, function: Callable[[], T]) -> T:
        """Run ``function()`` (a decode relay's loop, while it holds the runtime) on the runtime
        thread, where every batch runs: a stage's native compute stays on one thread (the module
        header).  Never abandoned: a cancelled caller waits for it to return."""
        return await self._thread.run_sync(function)

    def hold(self, stop: Callable[[], None], lane: int, idle_since: Callable[[], float] | None = None) -> bool:
        """Claim the idle runtime for a decode relay (:mod:`skippy.stage.decode_relay`) of lane
        ``lane``; ``stop`` is called (on the trio thread) when a job is queued behind it;
        ``idle_since`` says when (trio's clock) it last began reading a frame.  False
        when the runtime is busy, jobs wait, or another working lane brought work in the last
        :data:`RECENT_WORK_S` (idle lanes, such as an API pool keeps open, do not count, nor
        lanes closed since: a driver's next request on a new connection)."""
        if self._busy or self._pending:
            return False
        now = time.monotonic()
        for other, when in list(self._last_work.items()):
            if now - when > RECENT_WORK_S:
                del self._last_work[other]
            elif other != lane and other in self.lanes:
                return False
        self._busy = True
        self._holder_stop = stop
        self._holder_idle = idle_since
        self._held_at = trio.current_time()
        return True

    def others_working(self, lane: int) -> bool:
        """Another lane brought work in the last :data:`RECENT_WORK_S`, so :meth:`hold` refuses
        lane ``lane``: a cheap test (nothing changes), so that each of many sessions' lanes does
        not plan a decode relay per message only to have it refused."""
        now = time.monotonic()
        lanes = self.lanes
        return any(other != lane and now - when <= RECENT_WORK_S and other in lanes
                   for other, when in self._last_work.items())

    def forget(self, session: int) -> None:
        """Session ``session`` was released: the decode groups stop expecting its rows."""
        if self.groups is not None:
            self.groups.forget(session)
            self._arrival.set()  # a turn gathering may have waited for it

    @property
    def held(self) -> bool:
        """A decode relay holds the runtime now."""
        return self._holder_stop is not None

    def holder_idle_s(self) -> float:
        """How long the relay holding the runtime has waited for its next frame (0: none holds
        it, or it cannot say)."""
        idle = self._holder_idle
        if self._holder_stop is None or idle is None:
            return 0.0
        # a run that has read no frame yet says nothing useful (its clock starts at 0): count from the hold
        return max(0.0, trio.current_time() - max(idle(), self._held_at))

    def release_hold(self) -> None:
        """The relay gave the runtime back: queued jobs run."""
        self._holder_stop = None
        self._holder_idle = None
        self._release()

    def _release(self) -> None:
        self._busy = False
        if self._released is not None:
            self._released.set()
            self._released = None

    async def execute(self, item: WorkItem, then: Callable[[WorkResult, int], None] | None = None
                      ) -> tuple[WorkResult, int]:
        """Run one executable item; returns its result and the microseconds it queued.

        ``then`` is called with them where the result is computed (the runtime thread: a
        write-through), before this returns; it must not raise.

        Raises:
            StageError: the item was refused or the runtime failed it (the subclass names why);
            any other exception is a bug, passed through with its traceback.
        """
        job: _Job[WorkResult] = _Job(item, None, time.perf_counter_ns(), then)
        result = await self._submit(job)
        return result, job.wait_us

    async def call(self, function: Callable[[], T]) -> T:
        """Run ``function(…)`` on the runtime thread, in order with the compute jobs."""
        job: _Job[T] = _Job(None, function, time.perf_counter_ns())
        result: T = await self._submit(job)
        return result

    async def head_rows(self, compute: Callable[[], T]) -> T:
        """Run ``compute``, a head shard's rows for the final stage (:mod:`skippy.stage.head_split`),
        where the stage's own work runs, one thing at a time: the shard never competes with the
        stage's batches for its core.

        Placement (docs/throughput.md, "The head split"): with a turn running or jobs queued, it
        runs first in the next turn, before its decode batch, on the runtime thread; a turn
        gathering its decode rows runs it at once and goes on gathering; with the runtime idle it
        runs at once, on the trio thread itself (as inline decode does) when the stage has at most
        one working lane, else on the runtime thread; a decode relay holding the runtime is not stopped: the rows run at once on
        the trio thread (the relay carries the stage's only working lane, whose next step waits on
        these very rows, so the two never compute at once).
        """
        idle = not self._busy and not self._pending
        beside = self._holder_stop is not None and not self._pending
        if self.executor.blocking and self.inline_decode and (beside or (idle and self.lanes.working <= 1)):
            started, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return compute()
            finally:
                self.stats.runtime_busy_us += (time.perf_counter_ns() - started) // 1000
                self.stats.runtime_cpu_us += (time.thread_time_ns() - cpu) // 1000
        job: _Job[T] = _Job(None, compute, time.perf_counter_ns(), urgent=True)
        result: T = await self._submit(job)
        return result

    async def _submit(self, job: _Job[T]) -> T:
        item = job.item
        if item is not None:
            now = time.monotonic()
            self._last_work[item.session >> 64] = now
            if self.groups is not None and item.batchable:
                self.groups.arrived(item.session, now)
        if not self._busy and not self._pending and (self.batch_window <= 0 or item is None):
            await self._run_here(job)
        else:
            if self._closed:
                raise ShuttingDown("the stage's scheduler has stopped")
            job.done = trio.Event()
            self._pending.append(job)
            self._wake.set()
            self._arrival.set()
            if self._holder_stop is not None and not job.urgent:  # a decode relay holds the runtime: end its run
                self._holder_stop()
            await job.done.wait()
        if job.error is not None:
            raise job.error
        result: T = job.result
        return result

    async def _run_here(self, job: _Job[Any]) -> None:
        """The idle fast path: run a turn led by ``job`` on this task."""
        self._busy = True
        try:
            item = job.item
            # With one lane open nobody else can bring a row this tick (a lane has at most one job
            # queued): skip the yield, a trip through trio's run loop per message.
            if (self.decode_batching and self.executor.blocking and item is not None
                    and (item.batchable or self.groups is not None) and self.lanes.working != 1):
                # Let the other lanes' tasks of this trio tick queue their rows behind the claimed
                # runtime, and take them into this turn: the batching a scheduler pass used to give
                # (a chunk's turn, with decode groups, runs them before it).
                for _ in range(_GATHER_TICKS):
                    before = len(self._pending)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    if len(self._pending) == before:  # a quiet tick: the rows of this moment are in
                        break
            jobs = await self._turn([job], "fast")
        except BaseException:
            self._release()
            raise
        try:
            await self._run_batch(jobs)
        finally:
            for other in jobs:
                if other.done is not None:
                    other.done.set()
        if job not in jobs:  # queued for a later turn (the groups policy)
            assert job.done is not None
            await job.done.wait()

    async def _turn(self, lead: list[_Job[Any]], via: str) -> list[_Job[Any]]:
        """With the runtime claimed: wait for the group's late rows (the groups policy), then take
        this turn's jobs, ``lead`` (jobs not queued) first, out of the queue (``via``: who runs
        the turn, for the trace)."""
        started_ns = time.perf_counter_ns() if self._trace is not None else 0
        cap: int | None = None
        decoding = False
        chosen: list[int] | None = None
        groups = self.groups
        if groups is not None:
            limit = trio.current_time() + groups.gather_s()
            while True:
                now = time.monotonic()
                chosen, until = groups.plan(_ready_sessions([*lead, *self._pending]), now,
                                            now + (limit - trio.current_time()))
                if not self.executor.blocking:  # the null runtime: nothing to wait for
                    break
                if _has_urgent(self._pending):  # head shard rows: run now, on the runtime this turn holds
                    with trio.CancelScope(shield=True):  # as the gathering: a started fast-path job runs
                        await self._run_urgent()
                    continue
                deadline = min(limit, trio.current_time() + (until - now))
                if deadline <= trio.current_time():
                    break
                self._arrival = trio.Event()
                # shielded (GATHER_MAX_S at most): a fast-path job, once started, runs (module header)
                with trio.CancelScope(deadline=deadline, shield=True):
                    await self._arrival.wait()
            now = time.monotonic()
            cap = groups.cap(now, _ready_sessions([*lead, *self._pending]))
            decoding = groups.active(now) > 0
        jobs, left = select_turn([*lead, *self._pending], cap, decoding=decoding, chosen=chosen)
        for job in lead:
            if job not in jobs:  # its group's turn is a later one: it queues as any job
                job.done = trio.Event()
                self._wake.set()
        self._pending = left
        if self._trace is not None:
            self._trace.turn(via, started_ns, jobs, left, groups.active(time.monotonic()) if groups is not None else 0,
                             cap)
        return jobs

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler loop; runs until cancelled."""
        task_status.started()
        try:
            await self._serve()
        finally:
            self._closed = True
            pending, self._pending = self._pending, []
            for job in pending:  # never started: their requesters learn why
                job.error = ShuttingDown("the stage's scheduler has stopped")
                assert job.done is not None
                job.done.set()
            self._thread.close()

    async def _serve(self) -> None:
        while True:
            while not self._pending:
                self._wake = trio.Event()
                await self._wake.wait()
            first = self._pending[0]
            if self.batch_window > 0 and first.item is not None and first.item.batchable:
                await trio.sleep(self.batch_window)
            while self._busy:  # a caller's fast-path turn or a relay holds the runtime
                self._released = trio.Event()
                await self._released.wait()
            if self.groups is not None:
                # the lanes the last turn answered queue their next rows now (a first stage's
                # decode runs, at once): let them, so they join this turn rather than the next
                # (two passes: trio runs the tasks woken together in either order)
                await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
            if not self._pending or self._busy:  # a fast-path turn took them, or holds the runtime
                continue
            self._busy = True
            try:
                jobs = await self._turn([], "serve")
            except BaseException:
                self._release()
                raise
            try:
                await self._run_batch(jobs)
            finally:
                for job in jobs:
                    assert job.done is not None
                    job.done.set()

    async def _run_batch(self, jobs: list[_Job[Any]]) -> None:
        """Run ``jobs`` with the runtime claimed (on the worker thread unless it never blocks),
        release it, account."""
        self._busy = True
        trip = _Trip()
        native = _native_ns(self.executor) if self._trace is not None else (0, 0)
        try:
            started = time.perf_counter_ns()
            for job in jobs:
                job.wait_us = (started - job.submitted_ns) // 1000
            if self.executor.blocking and not self._runs_inline(jobs):
                await self._thread.run_sync(lambda: self._run_jobs(jobs, trip))
            else:
                self._run_jobs(jobs, trip)
        finally:
            self._release()
        if self._trace is not None:
            now = _native_ns(self.executor)
            self._trace.ran(started, trip.cpu_ns, (now[0] - native[0], now[1] - native[1]))
        self.stats.runtime_busy_us += (time.perf_counter_ns() - started) // 1000
        self.stats.runtime_cpu_us += trip.cpu_ns // 1000
        self.stats.native_batches += trip.native
        for size in trip.decode_batches:
            self.stats.observe_decode_batch(size)
        if self.groups is not None and trip.batch_sessions:
            self.groups.ran(trip.batch_sessions, trip.batch_s, time.monotonic())
        for job in jobs:
            self._account(job)

    async def _run_urgent(self) -> None:
        """A gathering turn's head shard rows (:meth:`head_rows`), at once on the runtime thread it
        holds, the turn's rows still to come (its decode group stays whole)."""
        jobs = [job for job in self._pending if job.urgent]
        self._pending = [job for job in self._pending if not job.urgent]
        trip = _Trip()
        started = time.perf_counter_ns()
        for job in jobs:
            job.wait_us = (started - job.submitted_ns) // 1000
        try:
            await self._thread.run_sync(lambda: self._run_jobs(jobs, trip))
        finally:
            for job in jobs:
                assert job.done is not None
                job.done.set()
        self.stats.runtime_busy_us += (time.perf_counter_ns() - started) // 1000
        self.stats.runtime_cpu_us += trip.cpu_ns // 1000
        self.stats.touch()

    def _runs_inline(self, jobs: list[_Job[Any]]) -> bool:
        """Inline decode (module header): one decode row, and this stage's only lane asked for it."""
        if not self.inline_decode or len(jobs) != 1 or self.lanes.working != 1:
            return False
        item = jobs[0].item
        return item is not None and item.batchable

    def _account(self, job: _Job[Any]) -> None:
        result = job.result
        if isinstance(result, WorkResult):
            self.stats.queue_histogram.observe(max(0, job.wait_us))
            self.stats.compute_us += result.compute_us
            self.stats.compute_histogram.observe(max(0, result.compute_us))
            if result.trimmed_tokens:
                self.stats.auto_aligns += 1
                self.stats.trimmed_tokens += result.trimmed_tokens
        self.stats.touch()

    def _run_jobs(self, jobs: list[_Job[Any]], trip: _Trip) -> None:
        """Worker-thread side: one decode batch, then the rest in order (into ``trip``)."""
        cpu = time.thread_time_ns()
        try:
            self._run_trip(jobs, trip)
        finally:
            trip.cpu_ns = time.thread_time_ns() - cpu

    def _run_trip(self, jobs: list[_Job[Any]], trip: _Trip) -> None:
        if len(jobs) > 1 and _has_urgent(jobs):  # head shard rows first: another stage waits on them
            urgent = [job for job in jobs if job.urgent]
            for job in urgent:
                self._run_one(job, trip)
            jobs = [job for job in jobs if not job.urgent]
        if len(jobs) == 1 or not self.decode_batching:  # no batch to form / every row alone, in order
            for job in jobs:
                self._run_one(job, trip)
            return
        batch: list[_Job[Any]] = []
        rest: list[_Job[Any]] = []
        sessions: set[int] = set()
        for job in jobs:
            item = job.item
            if item is not None and item.batchable and item.session not in sessions:
                sessions.add(item.session)
                batch.append(job)
            else:
                rest.append(job)
        if len(batch) == 1:
            rest.insert(0, batch.pop())
        if batch:
            items = [job.item for job in batch if job.item is not None]
            outcomes: Sequence[WorkResult | Exception]
            started = time.perf_counter()
            try:
                outcomes = self.executor.run_decode_batch(items)
            except Exception as exc:  # a bug fails these jobs (their lanes log it), not the stage
                outcomes = [exc] * len(items)
            trip.batch_s = time.perf_counter() - started
            trip.batch_sessions = [item.session for item in items]
            trip.native += 1
            trip.decode_batches.append(len(items))
            for job, outcome in zip(batch, outcomes):
                if isinstance(outcome, Exception):
                    job.error = outcome
                else:
                    job.result = outcome
                    if job.then is not None:
                        job.then(outcome, job.wait_us)
        for job in rest:
            self._run_one(job, trip)

    def _run_one(self, job: _Job[Any], trip: _Trip) -> None:
        """Run one job alone (its error kept on it); a lone decode row is the trip's batch."""
        try:
            item = job.item
            if item is not None:
                started = time.perf_counter()
                job.result = self.executor.run_item(item)
                if job.then is not None:
                    job.then(job.result, job.wait_us)
                trip.native += 1
                if item.batchable:
                    trip.decode_batches.append(1)
                    if not trip.batch_sessions:
                        trip.batch_sessions = [item.session]
                        trip.batch_s = time.perf_counter() - started
                return
            if job.call is not None:
                job.result = job.call()
        except Exception as exc:  # a refusal or a bug fails this one job (its lane reports it), not the stage
            job.error = exc
