"""Start a whole chain on this machine: stage processes final stage first, then the API.

Strategy: every stage is a ``python -m skippy.stage`` child listening on port 0; a reader task per
child copies its stderr into a log file, keeps the last lines, turns the loading lines into
progress and catches ``ready on HOST:PORT``, which gives the bound address.  Stages start from
the last one backwards, each only after the one downstream of it is READY (a stage dials its
downstream when a lane opens, so the order is what makes the first lane work).  The API then runs
in this process (:func:`skippy.api.server.serve_api`).  With ``metrics``, every stage also serves
Prometheus metrics on a port of its own (``--metrics-listen HOST:0``; the log line that names it
comes before READY), which the page at ``/`` reads.

Replacement (docs/replacement.md): once all are READY, a supervisor per stage waits for its loss:
the process exits, or it leaves the launcher's heartbeats (:func:`skippy.net.liveness.heartbeat`)
unanswered for ``Replacement.heartbeat_timeout`` seconds (then it is killed).  It publishes
"lost", then, up to ``Replacement.restarts`` times per stage, replaces it on the same address: a
warm standby (``--standby on``: loaded, activated by a line ``activate HOST:PORT`` on its stdin)
when one is loaded, else a fresh process with ``--listen`` set to that address; then "ready"
(:class:`skippy.net.liveness.ChainEvents`).

Ownership: everything runs in one nursery.  A stage lost with no replacement left is a
:class:`ChildFailed` (with the child's last log lines), which cancels the nursery (or, given
``on_child_exit``, is handed to it and the rest keeps running: the API then reports the stage
lost); SIGINT and SIGTERM cancel it too.  On the way out, in a shielded scope, every process still running
(standbys and replacements included) gets SIGTERM (and SIGCONT, should it be stopped), then SIGKILL
after a grace period, and is reaped.  Children run in their own session (a
terminal's Ctrl-C reaches only the launcher, which stops them in order).  No parent-death signal
is used: Linux ties PR_SET_PDEATHSIG to the *thread* that forked, and trio spawns from worker
threads that exit when idle, which would SIGTERM healthy stages about ten seconds after start.
Instead each stage's stdin is a pipe this process never writes, and stages run with
``--exit-on-stdin-eof on``: when the launcher dies, however (SIGKILL included), the kernel
closes the pipe and every stage drains and exits.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

import trio

from skippy.api.lanes import StageInfo
from skippy.deploy.cost import HeadSplit
from skippy.net.liveness import PERIOD, SILENCE, ChainEvents, HeartbeatRefused, StageEvent, heartbeat
from skippy.net.address import Address

_READY = re.compile(r"ready on (\S+):(\d+)")
_LOADING = re.compile(r"loading .* layers \S+:\s*(\d+)%")
_METRICS = re.compile(r"metrics on http://(\S+)/metrics")
_HEAD_PORT = re.compile(r"head shard port on (\S+):(\d+)")
_STANDBY = re.compile(r"standby layers \S+ loaded, waiting for activation")

#: progress(stage index, stage count, fraction of that stage loaded)
Progress = Callable[[int, int, float], None]


class ChildFailed(Exception):
    """A stage process exited (or failed to start) while the chain should be running."""


@dataclasses.dataclass
class StageChild:
    """One stage process and what its log told us (a warm standby is one too, until it takes over)."""

    index: int
    layers: str
    command: list[str]
    log_path: Path
    process: trio.Process | None = None
    address: Address | None = None
    #: Where it serves ``GET /metrics`` (started with ``--metrics-listen``), once logged.
    metrics: Address | None = None
    #: The final stage of a split head: the port the stage serving its other rows dials.
    head_shard: Address | None = None
    ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    tail: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=30))
    #: Replacements started so far (restarts and standby takeovers).
    restarts: int = 0
    #: A standby process only: loaded and waiting for its activation.
    loaded: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: The warm standby of this stage's range (``standby=True``), once started.
    standby: StageChild | None = None

    @property
    def name(self) -> str:
        return f"stage {self.index} (layers {self.layers})"

    def info(self) -> StageInfo:
        assert self.address is not None
        return StageInfo(self.index, self.layers, self.address, self.metrics)

    def failure(self, what: str) -> ChildFailed:
        lines = "".join(f"    {line}\n" for line in self.tail)
        return ChildFailed(f"{self.name} {what}; its last log lines ({self.log_path}):\n{lines}".rstrip())


@dataclasses.dataclass(frozen=True)
class Replacement:
    """What :func:`run_chain` does when a stage is lost (docs/replacement.md).

    Args:
        restarts: replacements allowed per stage over the chain's life (0: none, a loss is final).
        standby: keep a warm standby process per range (loaded, not listening) that takes over by
            binding the lost stage's address; a fresh one is then loaded behind it.
        heartbeat_timeout: seconds a stage may leave the launcher's heartbeats unanswered before
            it is lost (killed and replaced); 0: only an exit counts.
        tls: the launcher's client context for heartbeats on a TLS chain.
    """

    restarts: int = 0
    standby: bool = False
    heartbeat_timeout: float = SILENCE
    tls: ssl.SSLContext | None = None


def stage_command(model: Path, layers: str, *, downstream: Address | None, host: str,
                  options: Sequence[str]) -> list[str]:
    command = [sys.executable, "-m", "skippy.stage", "--model", str(model), "--layers", layers,
               "--listen", f"{host}:0", "--exit-on-stdin-eof", "on", *options]
    if downstream is not None:
        command += ["--downstream", str(downstream)]
    return command


def _listening_on(command: list[str], address: Address, head_shard: Address | None = None) -> list[str]:
    """``command`` with its ``--listen`` value replaced by ``address`` (a replacement's) and, for
    the final stage of a split head, its head shard port pinned to ``head_shard``: the port the
    stage serving the other rows dials again after the loss (issue 31)."""
    at = command.index("--listen") + 1
    command = [*command[:at], str(address), *command[at + 1:]]
    if head_shard is not None:
        if "--head-shard-listen" in command:
            at = command.index("--head-shard-listen") + 1
            command = [*command[:at], str(head_shard), *command[at + 1:]]
        else:
            command += ["--head-shard-listen", str(head_shard)]
    return command


async def _read_log(child: StageChild, process: trio.Process, progress: Progress | None, count: int) -> None:
    assert process.stderr is not None
    buffer = b""
    with child.log_path.open("ab") as log:
        async for data in process.stderr:
            log.write(data)
            log.flush()
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                child.tail.append(line)
                loading = _LOADING.search(line)
                if loading and progress is not None:
                    progress(child.index, count, int(loading.group(1)) / 100)
                metrics = _METRICS.search(line)
                if metrics:
                    child.metrics = Address.parse(metrics.group(1))
                head_port = _HEAD_PORT.search(line)
                if head_port:
                    child.head_shard = Address(head_port.group(1), int(head_port.group(2)))
                if _STANDBY.search(line):
                    child.loaded.set()
                ready = _READY.search(line)
                if ready and not child.ready.is_set():
                    child.address = Address(ready.group(1), int(ready.group(2)))
                    child.ready.set()


async def _stop(children: Sequence[StageChild], grace: float) -> None:
    running: list[trio.Process] = []
    for child in children:
        process = child.process
        if process is not None and process.returncode is None and all(process is not p for p in running):
            running.append(process)
    for process in running:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)  # a stopped one (SIGSTOP) must run to take its SIGTERM
    with trio.move_on_after(grace):
        for process in running:
            await process.wait()
    for process in running:
        if process.returncode is None:
            process.kill()
            await process.wait()


class _Chain:
    """The processes of one :func:`run_chain` and how they are started, watched and replaced."""

    def __init__(self, children: list[StageChild], nursery: trio.Nursery, env: dict[str, str],
                 progress: Progress | None, ready_timeout: float, replacement: Replacement,
                 events: ChainEvents | None) -> None:
        self.children = children
        #: Every StageChild that ever had a process (standbys included): what _stop stops.
        self.spawned: list[StageChild] = []
        self.nursery = nursery
        self.env = env
        self.progress = progress
        self.ready_timeout = ready_timeout
        self.replacement = replacement
        self.events = events

    async def spawn(self, child: StageChild, command: list[str], *, progress: bool = True) -> trio.Process:
        child.command = command
        try:
            process = await trio.lowlevel.open_process(
                command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env=self.env, start_new_session=True,
            )
        except OSError as exc:
            raise ChildFailed(f"cannot start {child.name}: {exc}") from exc
        child.process = process
        self.spawned.append(child)
        self.nursery.start_soon(_read_log, child, process, self.progress if progress else None, len(self.children))
        return process

    async def wait_for(self, child: StageChild, event: trio.Event, what: str) -> None:
        """Until ``event`` (the child's ready or loaded), failing if its process exits first or it takes too long."""
        process = child.process
        assert process is not None
        with trio.move_on_after(self.ready_timeout) as waited:
            async with trio.open_nursery() as race:
                async def exited() -> None:
                    await process.wait()
                    race.cancel_scope.cancel()

                async def happened() -> None:
                    await event.wait()
                    race.cancel_scope.cancel()

                race.start_soon(exited)
                race.start_soon(happened)
        if event.is_set():
            return
        if waited.cancelled_caught:
            raise child.failure(f"did not get {what} within {self.ready_timeout:g} s")
        await trio.sleep(0.1)  # let the log reader take the last lines
        raise child.failure(f"exited with status {process.returncode}")

    # -- watching --------------------------------------------------------------------------------
    async def wait_loss(self, child: StageChild) -> str:
        """Until ``child`` is lost: its process exited, or it left heartbeats unanswered (then it is killed)."""
        process = child.process
        assert process is not None and child.address is not None
        address, silence = child.address, self.replacement.heartbeat_timeout
        why: list[str] = []
        async with trio.open_nursery() as race:
            async def exited() -> None:
                code = await process.wait()
                why.append(f"exited with status {code}")
                race.cancel_scope.cancel()

            async def silent() -> None:
                if silence <= 0:
                    return
                while True:
                    try:
                        loss = await heartbeat(address, silence=silence, period=min(PERIOD, silence / 4),
                                               connect_timeout=silence, tls=self.replacement.tls)
                    except HeartbeatRefused as exc:
                        if exc.silent:  # a stage of this tree answers: one that says nothing is hung
                            why.append(f"stopped answering: {exc}")
                            race.cancel_scope.cancel()
                            return
                        log.warning("%s does not answer heartbeats (%s)", child.name, exc)  # not of this tree
                        return
                    except TimeoutError as exc:  # its process runs (exited() would say), yet READY never came
                        why.append(f"stopped answering: {exc}")
                        race.cancel_scope.cancel()
                        return
                    except OSError as exc:  # refused or closed at once (e.g. --max-connections): alive, retry
                        log.debug("heartbeat to %s: %s", child.name, exc)
                        await trio.sleep(0.1)
                        continue
                    if loss.reason == "silent":
                        why.append(f"stopped answering: {loss.describe()}")
                        race.cancel_scope.cancel()
                        return
                    await trio.sleep(0.05)  # closed: an exit says so at once; else dial again

            race.start_soon(exited)
            race.start_soon(silent)
        if process.returncode is None:  # hung (SIGSTOP, a wedged host): it is replaced, so it must go
            process.kill()
            await process.wait()
            await trio.sleep(0.1)  # let the log reader take the last lines
        return why[0]

    async def supervise(self, child: StageChild, on_exit: Callable[[ChildFailed], None] | None,
                        on_replaced: Callable[[StageChild, StageEvent], None] | None) -> None:
        """Replace ``child`` each time it is lost, up to ``replacement.restarts`` times; then fail."""
        while True:
            why = await self.wait_loss(child)
            assert child.address is not None
            lost_at = time.monotonic()
            failure = child.failure(why)
            self.publish("lost", child, why, lost_at)
            log.info("%s lost: %s", child.name, why)
            while True:
                if child.restarts >= self.replacement.restarts:
                    if self.replacement.restarts:
                        failure = child.failure(f"{why} after {child.restarts} replacement(s) "
                                                f"(--restarts {self.replacement.restarts})")
                    if on_exit is None:
                        raise failure
                    on_exit(failure)
                    return
                child.restarts += 1
                try:
                    how = await self.replace(child)
                    break
                except ChildFailed as exc:
                    why = str(exc).split(";")[0]
                    log.warning("replacing %s failed: %s", child.name, exc)
            event = self.publish("ready", child, how, time.monotonic(), outage=time.monotonic() - lost_at)
            if on_replaced is not None:
                on_replaced(child, event)

    def publish(self, kind: str, child: StageChild, detail: str, at: float, outage: float = math.nan) -> StageEvent:
        assert child.address is not None
        event = StageEvent(kind, child.index, child.address, at, time.time(), detail, outage)  # type: ignore[arg-type]
        if self.events is not None:
            self.events.publish(event)
        return event

    # -- replacing --------------------------------------------------------------------------------
    async def replace(self, child: StageChild) -> str:
        """A new process for ``child`` on its address: the standby's (when warm) or a fresh start."""
        address = child.address
        assert address is not None
        started = time.monotonic()
        standby = child.standby
        if standby is not None and standby.loaded.is_set() and standby.process is not None \
                and standby.process.returncode is None:
            child.standby = None
            assert standby.process.stdin is not None
            try:
                await standby.process.stdin.send_all(f"activate {address}\n".encode())
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise standby.failure(f"could not be activated: {exc}") from exc
            await self.wait_for(standby, standby.ready, "ready")
            how = "standby"
            self._take_over(child, standby)
        else:
            if standby is not None:  # still loading (or gone): a restart may win; it is dropped
                child.standby = None
                if standby.process is not None and standby.process.returncode is None:
                    standby.process.kill()
            fresh = StageChild(child.index, child.layers, [], child.log_path)
            fresh.tail = child.tail
            await self.spawn(fresh, _listening_on(child.command, address, child.head_shard), progress=False)
            await self.wait_for(fresh, fresh.ready, "ready")
            how = "restarted"
            self._take_over(child, fresh)
        how = f"{how} in {time.monotonic() - started:.2f} s"
        if self.replacement.standby:
            self.nursery.start_soon(self.keep_standby, child)
        return how

    @staticmethod
    def _take_over(child: StageChild, new: StageChild) -> None:
        child.process, child.metrics, child.tail, child.log_path = new.process, new.metrics, new.tail, new.log_path
        if new.address != child.address:
            raise child.failure(f"replacement listens on {new.address}, not {child.address}")
        if child.head_shard is not None and new.head_shard != child.head_shard:  # the shard's host dials the old one
            raise child.failure(f"replacement's head shard port is {new.head_shard}, not {child.head_shard}")

    async def keep_standby(self, child: StageChild) -> None:
        """Start ``child``'s warm standby (loaded, waiting to be activated on the stage's address)."""
        standby = StageChild(child.index, child.layers, [],
                             child.log_path.with_name(f"{child.log_path.stem}-standby{child.restarts}.log"))
        standby.log_path.write_bytes(b"")
        child.standby = standby
        try:
            process = await self.spawn(standby, [*child.command, "--standby", "on"], progress=False)
            await self.wait_for(standby, standby.loaded, "loaded")
        except ChildFailed as exc:
            log.warning("the standby of %s failed: %s", child.name, exc)
            if child.standby is standby:
                child.standby = None
            return
        log.info("%s has a warm standby (pid %d)", child.name, process.pid)


log = logging.getLogger("skippy.deploy")


async def run_chain(model: Path, split: Sequence[tuple[int, int]], *, host: str = "127.0.0.1",
                    stage_options: Sequence[str] = (), log_dir: Path, progress: Progress | None = None,
                    per_stage_options: Callable[[int], Sequence[str]] | None = None,
                    announce: Callable[[StageChild], None] | None = None, ready_timeout: float = 300.0,
                    grace: float = 5.0, metrics: bool = False,
                    on_child_exit: Callable[[ChildFailed], None] | None = None,
                    replacement: Replacement = Replacement(heartbeat_timeout=0.0),
                    events: ChainEvents | None = None,
                    on_replaced: Callable[[StageChild, StageEvent], None] | None = None,
                    head: HeadSplit | None = None,
                    task_status: trio.TaskStatus[list[StageChild]] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the stages of ``split`` until cancelled; reports the children once all are READY.

    Args:
        metrics: every stage serves Prometheus metrics on a free port of ``host``
            (:attr:`StageChild.metrics`).
        on_child_exit: called with the failure when a READY stage is lost for good (no replacement
            left); the other stages keep running (None: the failure is raised and stops them all).
        replacement: how a lost stage is detected and replaced (default: an exit only, never replaced).
        events: where "stage lost" / "stage ready again" are published.
        on_replaced: called once a replacement of a stage is ready, with its "ready" event.
        head: the output head split by vocabulary rows (issue 31): the final stage computes the rows
            ``head.rows:``, stage ``head.host`` the rows ``0:head.rows``, dialling the final stage's
            head shard port (which its log names before READY); a replaced final stage listens on
            the same port (the serving stage dials it again); a warm standby cannot (refused).

    Raises:
        ChildFailed: a stage was lost for good (without ``on_child_exit``), or did not get READY
            within ``ready_timeout``.
    """
    if head is not None and replacement.standby:
        raise ValueError("a warm standby of the final stage cannot hold the head shard port the running one "
                         "listens on: no head split with --standby (--head-split off)")
    log_dir.mkdir(parents=True, exist_ok=True)
    children = [StageChild(index, f"{a}:{b}", [], log_dir / f"stage-{index}-{a}-{b}.log")
                for index, (a, b) in enumerate(split)]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    chain: _Chain | None = None
    try:
        async with trio.open_nursery() as nursery:
            chain = _Chain(children, nursery, env, progress, ready_timeout, replacement, events)
            downstream: Address | None = None
            for child in reversed(children):
                options = [*stage_options, *(per_stage_options(child.index) if per_stage_options else ()),
                           *(["--metrics-listen", f"{host}:0"] if metrics else []),
                           *_head_options(head, child, children)]
                child.log_path.write_bytes(b"")
                await chain.spawn(child, stage_command(model, child.layers, downstream=downstream, host=host,
                                                       options=options))
                await chain.wait_for(child, child.ready, "ready")
                if announce is not None:
                    announce(child)
                downstream = child.address
            for child in children:
                nursery.start_soon(chain.supervise, child, on_child_exit, on_replaced)
                if replacement.standby and replacement.restarts:
                    nursery.start_soon(chain.keep_standby, child)
            task_status.started(children)
            await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await _stop(chain.spawned if chain is not None else children, grace)


def _head_options(head: HeadSplit | None, child: StageChild, children: Sequence[StageChild]) -> list[str]:
    """A split head's flags for ``child``: the final stage's rows, the host's rows and the port to dial."""
    if head is None:
        return []
    if child.index == len(children) - 1:
        return ["--head-split", str(head.rows)]
    if child.index == head.host:
        port = children[-1].head_shard
        if port is None:
            raise ChildFailed(f"{children[-1].name} did not name its head shard port")
        return ["--serve-head-rows", str(head.rows), "--head-shard-dial", str(port)]
    return []


async def cancel_on_signal(received: AsyncIterator[int], scope: trio.CancelScope, got: list[int]) -> None:
    """Cancel ``scope`` at the first signal from ``received`` (a ``trio.open_signal_receiver``)."""
    async for number in received:
        got.append(int(number))
        scope.cancel()
        return
