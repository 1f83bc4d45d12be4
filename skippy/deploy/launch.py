"""Start a whole chain on this machine: stage processes final stage first, then the API.

Strategy: every stage is a ``python -m skippy.stage`` child listening on port 0; a reader task per
child copies its stderr into a log file, keeps the last lines, turns the loading lines into
progress and catches ``ready on HOST:PORT``, which gives the bound address.  Stages start from
the last one backwards, each only after the one downstream of it is READY (a stage dials its
downstream when a lane opens, so the order is what makes the first lane work).  The API then runs
in this process (:func:`skippy.api.server.serve_api`).  With ``metrics``, every stage also serves
Prometheus metrics on a port of its own (``--metrics-listen HOST:0``; the log line that names it
comes before READY), which the page at ``/`` reads.

Ownership: everything runs in one nursery.  A watcher per child turns an unexpected exit into
:class:`ChildFailed` (with the child's last log lines), which cancels the nursery (or, given
``on_child_exit``, is handed to it and the rest keeps running: the API then reports the stage
lost); SIGINT and SIGTERM cancel it too.  On the way out, in a shielded scope, every child still running gets
SIGTERM, then SIGKILL after a grace period, and is reaped.  Children run in their own session (a
terminal's Ctrl-C reaches only the launcher, which stops them in order).  No parent-death signal
is used: Linux ties PR_SET_PDEATHSIG to the *thread* that forked, and trio spawns from worker
threads that exit when idle, which would SIGTERM healthy stages about ten seconds after start.
Instead each stage's stdin is a pipe this process never writes, and stages run with
``--exit-on-stdin-eof on``: when the launcher dies, however (SIGKILL included), the kernel
closes the pipe and every stage drains and exits.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

import trio

from skippy.api.lanes import StageInfo
from skippy.net.address import Address

_READY = re.compile(r"ready on (\S+):(\d+)")
_LOADING = re.compile(r"loading .* layers \S+:\s*(\d+)%")
_METRICS = re.compile(r"metrics on http://(\S+)/metrics")

#: progress(stage index, stage count, fraction of that stage loaded)
Progress = Callable[[int, int, float], None]


class ChildFailed(Exception):
    """A stage process exited (or failed to start) while the chain should be running."""


@dataclasses.dataclass
class StageChild:
    """One stage process and what its log told us."""

    index: int
    layers: str
    command: list[str]
    log_path: Path
    process: trio.Process | None = None
    address: Address | None = None
    #: Where it serves ``GET /metrics`` (started with ``--metrics-listen``), once logged.
    metrics: Address | None = None
    ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    tail: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=30))

    @property
    def name(self) -> str:
        return f"stage {self.index} (layers {self.layers})"

    def info(self) -> StageInfo:
        assert self.address is not None
        return StageInfo(self.index, self.layers, self.address, self.metrics)

    def failure(self, what: str) -> ChildFailed:
        lines = "".join(f"    {line}\n" for line in self.tail)
        return ChildFailed(f"{self.name} {what}; its last log lines ({self.log_path}):\n{lines}".rstrip())


def stage_command(model: Path, layers: str, *, downstream: Address | None, host: str,
                  options: Sequence[str]) -> list[str]:
    command = [sys.executable, "-m", "skippy.stage", "--model", str(model), "--layers", layers,
               "--listen", f"{host}:0", "--exit-on-stdin-eof", "on", *options]
    if downstream is not None:
        command += ["--downstream", str(downstream)]
    return command


async def _read_log(child: StageChild, progress: Progress | None, count: int) -> None:
    assert child.process is not None and child.process.stderr is not None
    buffer = b""
    with child.log_path.open("ab") as log:
        async for data in child.process.stderr:
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
                if metrics and child.metrics is None:
                    child.metrics = Address.parse(metrics.group(1))
                ready = _READY.search(line)
                if ready and not child.ready.is_set():
                    child.address = Address(ready.group(1), int(ready.group(2)))
                    child.ready.set()


async def _watch(child: StageChild, stopping: list[bool], on_exit: Callable[[ChildFailed], None] | None) -> None:
    assert child.process is not None
    code = await child.process.wait()
    if not stopping[0]:
        await trio.sleep(0.1)  # let the log reader take the last lines
        failure = child.failure(f"exited with status {code}")
        if on_exit is None or not child.ready.is_set():  # one that never got ready fails the start
            raise failure
        on_exit(failure)


async def _stop(children: Sequence[StageChild], grace: float) -> None:
    running = [c for c in children if c.process is not None and c.process.returncode is None]
    for child in running:
        assert child.process is not None
        child.process.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace):
        for child in running:
            assert child.process is not None
            await child.process.wait()
    for child in running:
        assert child.process is not None
        if child.process.returncode is None:
            child.process.kill()
            await child.process.wait()


async def run_chain(model: Path, split: Sequence[tuple[int, int]], *, host: str = "127.0.0.1",
                    stage_options: Sequence[str] = (), log_dir: Path, progress: Progress | None = None,
                    per_stage_options: Callable[[int], Sequence[str]] | None = None,
                    announce: Callable[[StageChild], None] | None = None, ready_timeout: float = 300.0,
                    grace: float = 5.0, metrics: bool = False,
                    on_child_exit: Callable[[ChildFailed], None] | None = None,
                    task_status: trio.TaskStatus[list[StageChild]] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the stages of ``split`` until cancelled; reports the children once all are READY.

    Args:
        metrics: every stage serves Prometheus metrics on a free port of ``host``
            (:attr:`StageChild.metrics`).
        on_child_exit: called with the failure when a READY stage exits unexpectedly; the other
            stages keep running (None: the failure is raised and stops them all).

    Raises:
        ChildFailed: a stage exited (without ``on_child_exit``), or did not get READY within
            ``ready_timeout``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    children = [StageChild(index, f"{a}:{b}", [], log_dir / f"stage-{index}-{a}-{b}.log")
                for index, (a, b) in enumerate(split)]
    stopping = [False]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        async with trio.open_nursery() as nursery:
            downstream: Address | None = None
            for child in reversed(children):
                options = [*stage_options, *(per_stage_options(child.index) if per_stage_options else ()),
                           *(["--metrics-listen", f"{host}:0"] if metrics else [])]
                child.command = stage_command(model, child.layers, downstream=downstream, host=host,
                                              options=options)
                child.log_path.write_bytes(b"")
                try:
                    child.process = await trio.lowlevel.open_process(
                        child.command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        env=env, start_new_session=True,
                    )
                except OSError as exc:
                    raise ChildFailed(f"cannot start {child.name}: {exc}") from exc
                nursery.start_soon(_read_log, child, progress, len(children))
                nursery.start_soon(_watch, child, stopping, on_child_exit)
                with trio.move_on_after(ready_timeout) as waited:
                    await child.ready.wait()
                if waited.cancelled_caught:
                    raise child.failure(f"did not get ready within {ready_timeout:g} s")
                if announce is not None:
                    announce(child)
                downstream = child.address
            task_status.started(children)
            await trio.sleep_forever()
    finally:
        stopping[0] = True
        with trio.CancelScope(shield=True):
            await _stop(children, grace)


async def cancel_on_signal(received: AsyncIterator[int], scope: trio.CancelScope, got: list[int]) -> None:
    """Cancel ``scope`` at the first signal from ``received`` (a ``trio.open_signal_receiver``)."""
    async for number in received:
        got.append(int(number))
        scope.cancel()
        return
