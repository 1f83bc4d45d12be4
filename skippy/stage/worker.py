"""One long-lived thread per stage for native calls, fed through a queue.

Strategy: ``trio.to_thread.run_sync`` finds or starts a cached thread, hands it the call through
a lock and a trio token, and wakes the caller through trio's thread-safe queue.  Measured on the
2-core bench host (5000 round trips of a no-op call, three runs, under other load): 87-123 us per
call for ``to_thread``, 44-56 us for one dedicated thread blocked on a ``queue.SimpleQueue`` that
reschedules the waiting task with ``TrioToken.run_sync_soon``.  A decode crosses it once per stage
per token.  The stage's runtime is single-threaded anyway (the scheduler runs one batch at a
time), so one thread loses nothing.

Semantics match ``to_thread.run_sync`` without ``abandon_on_cancel``: a caller cancelled while its
call runs is woken only when the call has finished (the runtime must never be left mid-call),
then sees ``Cancelled`` at its next checkpoint.  The thread is a daemon, started on first use and
stopped by :meth:`RuntimeThread.close`; a later call starts a fresh one.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, TypeVar

import outcome
import trio

T = TypeVar("T")

_STOP = object()


class RuntimeThread:
    """Runs blocking calls on one dedicated thread, one at a time, in submission order."""

    def __init__(self, name: str = "skippy-runtime") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def run_sync(self, function: Callable[[], T]) -> T:
        """Run ``function()`` on the thread and return (or raise) its outcome."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        task = trio.lowlevel.current_task()
        self._queue.put((function, task, trio.lowlevel.current_trio_token()))

        def abort(_: object) -> trio.lowlevel.Abort:
            return trio.lowlevel.Abort.FAILED  # the call must finish: wait for its outcome

        result: T = await trio.lowlevel.wait_task_rescheduled(abort)  # unwraps the outcome
        return result

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread after the calls already queued and wait for it (idempotent).

        Waiting matters: the caller frees the native context next, and a call still running on
        the thread would use it after the free.
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _serve(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is _STOP:
                return
            function, task, token = entry
            result = outcome.capture(function)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the trio run ended under us: nobody waits any more
                pass
