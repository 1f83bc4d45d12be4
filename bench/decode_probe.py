"""Run a stage process with its runtime calls timed: ``python bench/decode_probe.py OUT STAGE-ARGS...``.

Strategy: a profiling launcher for ``bench/boundary_compute.py``, not part of skippy.  Before it
starts ``skippy.stage`` it wraps, on the classes, ``StageContext.decode`` (the native call and its
argument checks), the executor's ``run_decode_batch`` / ``run_item`` (the job around it) and the
scheduler's ``_run_jobs`` (everything the runtime thread runs for a batch, the write-through
included).  Each call appends one line ``name thread_cpu_ns wall_ns`` to ``OUT`` with an
unbuffered ``os.write`` (a few microseconds against a decode of milliseconds).  Nothing else in
the stage changes.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _timed(name: str, function: Callable[..., Any], fd: int) -> Callable[..., Any]:
    label = name.encode()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            os.write(fd, b"%s %d %d\n" % (label, time.thread_time_ns() - cpu, time.perf_counter_ns() - wall))

    return wrapper


def main() -> None:
    out, *stage_args = sys.argv[1:]
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    from skippy.runtime.context import StageContext
    from skippy.stage.executor import Executor
    from skippy.stage.scheduler import Scheduler

    StageContext.decode = _timed("decode", StageContext.decode, fd)  # type: ignore[method-assign]
    Executor.run_decode_batch = _timed("job", Executor.run_decode_batch, fd)  # type: ignore[method-assign]
    Executor.run_item = _timed("item", Executor.run_item, fd)  # type: ignore[method-assign]
    Scheduler._run_jobs = _timed("thread", Scheduler._run_jobs, fd)  # type: ignore[method-assign]
    sys.argv = ["skippy.stage", *stage_args]
    runpy.run_module("skippy.stage", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
