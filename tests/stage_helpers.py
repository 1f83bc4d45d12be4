"""Start real ``python -m skippy.stage`` processes (and in-process servers) for stage tests.

Stages listen on port 0 and announce the bound address in their log; the helper reads it from
the log file, so no port is guessed.  A chain is started final stage first.  Every process is
terminated (then killed) when the context exits, whatever happened in the test.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Sequence

import numpy as np
import trio

from skippy.net.address import Address
from skippy.runtime import Model, StageContext
from skippy.stage.config import config_from_mapping
from skippy.stage.server import StageServer, close_runtime, load_runtime

ROOT = Path(__file__).resolve().parent.parent
_READY = re.compile(r"ready on (\S+):(\d+)")


class StageProcess:
    """One stage process; ``address`` is known once it is ready."""

    def __init__(self, model: str, layers: str, log_path: Path, *, downstream: Address | None = None,
                 listen: str = "127.0.0.1:0", extra: Sequence[str] = ()) -> None:
        self.model = model
        self.layers = layers
        self.log_path = log_path
        self.downstream = downstream
        self.listen = listen
        self.extra = list(extra)
        self.stats_path = log_path.with_suffix(".stats.json")
        self.process: subprocess.Popen[bytes] | None = None
        self.address: Address | None = None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "skippy.stage", "--model", self.model, "--layers", self.layers,
                   "--listen", self.listen, "--stats-file", str(self.stats_path), "--threads", "1",
                   "--connect-timeout", "5", *self.extra]
        if self.downstream is not None:
            command += ["--downstream", str(self.downstream)]
        return command

    async def start(self, timeout: float = 60.0) -> Address:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log_path.write_bytes(b"")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=log, env=env, cwd=ROOT)
        with trio.fail_after(timeout):
            while True:
                match = _READY.search(self.log())
                if match:
                    self.address = Address(match.group(1), int(match.group(2)))
                    return self.address
                if self.process.poll() is not None:
                    raise RuntimeError(f"stage {self.layers} exited with {self.process.returncode}:\n{self.log()}")
                await trio.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self) -> dict[str, object]:
        data: dict[str, object] = json.loads(self.stats_path.read_text())
        return data

    def socket_count(self) -> int:
        """Open sockets of the process (from /proc)."""
        assert self.process is not None
        fd_dir = Path(f"/proc/{self.process.pid}/fd")
        count = 0
        for entry in fd_dir.iterdir():
            try:
                if os.readlink(entry).startswith("socket:"):
                    count += 1
            except OSError:  # the fd closed while we looked
                continue
        return count

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def terminate(self, timeout: float = 10.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


async def wait_for_stats(stage: StageProcess, predicate: object, timeout: float = 10.0) -> dict[str, object]:
    """Poll the stats file until ``predicate(stats)`` holds; returns the stats."""
    with trio.fail_after(timeout):
        while True:
            try:
                stats = stage.stats()
            except (OSError, ValueError):  # not written yet / being replaced
                stats = None
            if stats is not None and predicate(stats):  # type: ignore[operator]
                return stats
            await trio.sleep(0.05)


@asynccontextmanager
async def stage_chain(model: str, splits: Sequence[str], directory: Path,
                      extra: Sequence[str] = ()) -> AsyncIterator[list[StageProcess]]:
    """Start a chain (final stage first) and stop it afterwards; yields stages in chain order."""
    stages: list[StageProcess] = []
    try:
        downstream = None
        for index in reversed(range(len(splits))):
            stage = StageProcess(model, splits[index], directory / f"stage{index}.log",
                                 downstream=downstream, extra=extra)
            stages.insert(0, stage)
            downstream = await stage.start()
        yield stages
    finally:
        for stage in stages:
            stage.kill()


@asynccontextmanager
async def inprocess_chain(splits: Sequence[str], *, model: str = "null:n_embd=8,n_layer=4,n_vocab=1000",
                          **settings: object) -> AsyncIterator[list[StageServer]]:
    """Stage servers in this trio run (null runtime by default); yields them in chain order.

    One compute thread unless ``threads`` is given (as the stage processes of `StageProcess`)."""
    servers: list[StageServer] = []
    try:
        async with trio.open_nursery() as nursery:
            downstream: Address | None = None
            for layers in reversed(splits):
                config = config_from_mapping({"model": model, "layers": layers, "downstream": downstream,
                                              "batch_size": 64, "connect_timeout": 2, "threads": 1, **settings})
                server = StageServer(config, load_runtime(config))
                servers.insert(0, server)
                downstream = await nursery.start(server.serve)
            try:
                yield servers
            finally:
                for server in servers:
                    server.shutdown()
    finally:  # the servers have returned: their weights and KV go now, not with the test session
        for server in servers:
            close_runtime(server.executor)


def reference_greedy(path: Path, prompt: Sequence[int], steps: int, *, chunk_size: int,
                     n_batch: int = 64) -> list[int]:
    """The unsplit model in this process, same chunking: prefill then greedy decode (computed once per
    file, prompt and settings in a test session: many tests compare chains against the same run)."""
    stat = Path(path).stat()
    return list(_reference_greedy(str(path), stat.st_size, stat.st_mtime_ns, tuple(prompt), steps, chunk_size,
                                  n_batch))


@functools.lru_cache(maxsize=None)
def _reference_greedy(path: str, _size: int, _mtime_ns: int, prompt: tuple[int, ...], steps: int, chunk_size: int,
                      n_batch: int) -> tuple[int, ...]:
    return tuple(_greedy(Path(path), list(prompt), steps, chunk_size=chunk_size, n_batch=n_batch))


def _greedy(path: Path, prompt: Sequence[int], steps: int, *, chunk_size: int, n_batch: int) -> list[int]:
    with Model(path) as model, StageContext(model, n_ctx=512, max_sessions=8, n_batch=n_batch, threads=1) as ctx:
        seq = ctx.open_session()
        for begin in range(0, len(prompt), chunk_size):
            end = min(len(prompt), begin + chunk_size)
            flags = [False] * (end - begin)
            if end == len(prompt):
                flags[-1] = True
            ctx.decode(tokens=prompt[begin:end], positions=list(range(begin, end)), seq_ids=[seq] * (end - begin),
                       outputs=flags)
        tokens = [int(np.argmax(ctx.logits(int(ctx.output_rows[-1]))))]
        position = len(prompt)
        while len(tokens) < steps:
            ctx.decode(tokens=[tokens[-1]], positions=[position], seq_ids=[seq])
            tokens.append(int(np.argmax(ctx.logits(int(ctx.output_rows[-1])))))
            position += 1
        return tokens
