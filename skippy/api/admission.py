"""Admission under load: a bounded, timed queue in front of the lane pool; 429 only when it is full.

Strategy: a request takes a lane at once when one is free; otherwise it waits, first come first
served (the pool's semaphore is FIFO), while fewer than ``max_queue`` requests are waiting, and
leaves the queue if its client disconnects meanwhile (:meth:`Admission.acquire_while_present`).  The
``max_queue + 1``-th is answered 429 at once, and one that waits ``timeout`` seconds is answered
429 too; both carry ``Retry-After``: the expected wait, from a moving average of how long a
request holds its lane, times the queue ahead of it, over the lanes (1 to 60 s).

A stage that refuses a new session as overloaded (its Error frame ``OVERLOADED``: every session
in use) has not yet freed a session a closed lane held, or is shared with another client; the
request is then retried on a fresh lane after a short back-off, inside the same deadline, rather
than failed (:meth:`Admission.retry_after_overload`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Awaitable, Callable, final

import trio

from skippy.api.errors import ApiError
from skippy.api.lanes import LanePool, Lease
from skippy.codec.protocol_ext import ErrorCode
from skippy.driver.client import StageClientError, StageRemoteError

#: Default seconds a request may wait for a lane.
DEFAULT_QUEUE_TIMEOUT = 60.0
#: Default number of requests that may wait for a lane at once.
DEFAULT_MAX_QUEUE = 64
#: Back-off after an OVERLOADED refusal: first wait and cap (seconds).
_BACKOFF_FIRST = 0.01
_BACKOFF_CAP = 0.25
#: Weight of the newest sample in the lane-hold-time average.
_EWMA = 0.2


def is_overloaded(exc: StageClientError) -> bool:
    """Whether the chain refused for want of a session (or KV) rather than failing."""
    return isinstance(exc, StageRemoteError) and exc.code is ErrorCode.OVERLOADED


@final
class Admission:
    """The queue in front of ``pool``.

    Args:
        pool: the lanes.
        max_queue: requests that may wait at once (0: none, refuse when every lane is busy).
        timeout: seconds a request may wait, counted from its arrival.
    """

    def __init__(self, pool: LanePool, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 timeout: float = DEFAULT_QUEUE_TIMEOUT) -> None:
        if max_queue < 0 or not timeout > 0:
            raise ValueError(f"max_queue must be >= 0 and timeout > 0 (got {max_queue}, {timeout})")
        self.pool = pool
        self.max_queue = max_queue
        self.timeout = timeout
        #: Requests waiting for a lane now.
        self.waiting = 0
        #: Requests refused 429 so far (queue full, waited too long).
        self.refused = 0
        #: Requests whose client left while they waited.
        self.gone = 0
        #: Moving average of the seconds a request holds its lane.
        self.hold_seconds = 1.0

    def deadline(self) -> float:
        """The trio time by which a request arriving now must have its lane."""
        return trio.current_time() + self.timeout

    def retry_after(self) -> int:
        """Seconds a client should wait before retrying (1..60)."""
        ahead = self.waiting + 1
        return max(1, min(60, math.ceil(self.hold_seconds * ahead / max(1, self.pool.max_lanes))))

    def _busy(self, message: str, code: str) -> ApiError:
        self.refused += 1
        return ApiError(429, message, type="rate_limit_error", code=code,
                        headers={"Retry-After": str(self.retry_after())})

    async def acquire(self, deadline: float) -> Lease:
        """A lane, waiting in the queue until ``deadline`` if none is free.

        Raises:
            ApiError: 429 when the queue is full or the deadline passes.
            StageLost: the first stage cannot be reached.
        """
        if self.pool.free_lanes > 0:  # taken before the first checkpoint: nobody can get it first
            lease = await self.pool.acquire()
            lease.acquired_at = time.monotonic()
            return lease
        if self.waiting >= self.max_queue:
            raise self._busy(f"The server is busy: all {self.pool.max_lanes} lanes are in use and "
                             f"{self.waiting} requests are already waiting. Retry later.", "queue_full")
        self.waiting += 1
        try:
            with trio.move_on_at(deadline):
                lease = await self.pool.acquire()
                lease.acquired_at = time.monotonic()
                return lease
        finally:
            self.waiting -= 1
        raise self._busy(f"The server is busy: no lane came free within {self.timeout:g} s. Retry later.",
                         "queue_timeout")

    async def acquire_while_present(self, deadline: float, receive: Callable[[], Awaitable[dict[str, Any]]]
                                    ) -> Lease:
        """:meth:`acquire`, giving up if the HTTP client disconnects while it waits in the queue
        (``receive`` is the request's ASGI receive; its body must already have been read).

        Raises:
            ApiError: 429 as :meth:`acquire`; 499 ``client_gone`` when the client left first.
            StageLost: the first stage cannot be reached.
        """
        if self.pool.free_lanes > 0:
            return await self.acquire(deadline)
        outcome: list[Lease | BaseException] = []

        async def wait(cancel: trio.CancelScope) -> None:
            try:
                outcome.append(await self.acquire(deadline))
            except (ApiError, StageClientError) as exc:
                outcome.append(exc)
            cancel.cancel()

        async def watch(cancel: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait, nursery.cancel_scope)
                nursery.start_soon(watch, nursery.cancel_scope)
        except BaseException:  # cancelled from outside: a lane already taken goes back
            for item in outcome:
                if isinstance(item, Lease):
                    await self.pool.release(item)
            raise
        if not outcome:
            self.gone += 1
            raise ApiError(499, "The client closed the request while it waited for a lane.", code="client_gone")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    async def retry_after_overload(self, attempt: int, deadline: float, exc: StageClientError) -> None:
        """Sleep before retrying a request the chain refused as overloaded (attempt 0, 1, ...).

        Raises:
            ApiError: 429 when the back-off would pass ``deadline``.
        """
        delay = min(_BACKOFF_CAP, _BACKOFF_FIRST * 2 ** attempt)
        if trio.current_time() + delay > deadline:
            raise self._busy(f"The server is busy: the model chain had no free session within "
                             f"{self.timeout:g} s ({exc}). Retry later.", "queue_timeout") from exc
        await trio.sleep(delay)

    def released(self, lease: Lease) -> None:
        """Record how long ``lease`` was held (for ``Retry-After``)."""
        if lease.acquired_at:
            held = time.monotonic() - lease.acquired_at
            self.hold_seconds += _EWMA * (held - self.hold_seconds)
