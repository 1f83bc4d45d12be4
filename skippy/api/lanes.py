"""A pool of :class:`StageClient` lanes to one first stage: one lane per in-flight request.

Strategy: the protocol matches replies to messages by order, so a lane carries one request at a
time; concurrency comes from several lanes (each its own TCP chain through the stages, batched
together by each stage's scheduler).  A semaphore bounds the lanes (the stages' session limit);
a lane whose request finished cleanly goes back to an idle list, any other lane is closed, since a
reply may still be on its way.  A lost chain empties the idle list so the next request dials
afresh.  Session ids are unique per pool (random 31-bit base plus a counter), so several API
servers can share a chain.

Health: a chain is healthy when a Stop for an unused session travels to the final stage and its
ACK comes back.  When it does not and the stage addresses are known (``skippy up`` passes them),
each stage is dialled to name the one that is not answering.  Under ``skippy up`` the launcher's
events (:class:`skippy.net.liveness.ChainEvents`) say which stage is lost and being replaced: that is
reported as is, without dialling, until the replacement is ready.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import ssl
from typing import Sequence, final

import trio

from skippy.driver.client import StageClient, StageClientError, StageLost
from skippy.net.liveness import ChainEvents
from skippy.net.address import Address


@dataclasses.dataclass(frozen=True, slots=True)
class StageInfo:
    """One stage of the chain, for health reports and the page at ``/``."""

    index: int
    layers: str
    address: Address
    #: Where the stage serves ``GET /metrics`` (``--metrics-listen``), when known.
    metrics: Address | None = None

    def __str__(self) -> str:
        return f"stage {self.index} (layers {self.layers}) at {self.address}"


@final
@dataclasses.dataclass(slots=True)
class Lease:
    """A lane lent to one request; set ``clean`` when the request ended at a message boundary."""

    client: StageClient
    clean: bool = False
    returned: bool = False
    #: time.monotonic() when the lane was handed out (0: not recorded).
    acquired_at: float = 0.0


@final
class LanePool:
    """Lanes to ``address``.

    Args:
        address: the first stage.
        max_lanes: lanes open at once (requests beyond it wait).
        stages: every stage of the chain, when known, to name a lost one.
        reply_timeout: seconds a lane waits for one reply.
    """

    def __init__(self, address: Address, *, max_lanes: int = 8, stages: Sequence[StageInfo] = (),
                 connect_timeout: float = 5.0, reply_timeout: float = 30.0, tls: ssl.SSLContext | None = None) -> None:
        self.address = address
        #: The driver's mutual-TLS context for the stage links (skippy.net.tls; None: plain TCP).
        self.tls = tls
        self.max_lanes = max_lanes
        self.stages = tuple(stages)
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self._slots = trio.Semaphore(max_lanes)
        self._idle: list[StageClient] = []
        self._base = random.getrandbits(30)
        self._counter = itertools.count(1)
        self.open_lanes = 0
        #: Set after a chain failure: requests check the chain (briefly) before taking a lane.
        self.suspect = False
        #: The launcher's loss and recovery events (``skippy up``; None: not known): a stage lost
        #: there is reported without dialling, and a request waits for nothing on it.
        self.events: ChainEvents | None = None

    @property
    def free_lanes(self) -> int:
        """Lanes a request could take now without waiting."""
        return int(self._slots.value)

    def new_session_id(self) -> int:
        return (self._base + next(self._counter)) & 0x7FFFFFFF or 1

    async def acquire(self) -> Lease:
        """A lane (idle or newly dialled); waits while ``max_lanes`` are busy.

        Raises:
            StageLost: the first stage cannot be reached.
        """
        await self._slots.acquire()
        try:
            while self._idle:
                idle = self._idle.pop()
                if not idle.peer_closed():
                    return Lease(idle)
                self.open_lanes -= 1  # the stage closed it meanwhile (its --idle-timeout)
                await idle.aclose()
            client = await StageClient.connect(self.address, connect_timeout=self.connect_timeout,
                                               reply_timeout=self.reply_timeout, tls=self.tls)
            self.open_lanes += 1
            return Lease(client)
        except BaseException:
            self._slots.release()
            raise

    async def release(self, lease: Lease) -> None:
        """Return a lane: kept when clean, closed otherwise.  Safe in a cancelled scope."""
        try:
            if lease.clean:
                self._idle.append(lease.client)
            else:
                self.open_lanes -= 1
                await lease.client.aclose()
        finally:
            self._slots.release()

    async def discard_idle(self) -> None:
        """Close every idle lane (after the chain was lost)."""
        idle, self._idle = self._idle, []
        for client in idle:
            self.open_lanes -= 1
            await client.aclose()

    async def aclose(self) -> None:
        await self.discard_idle()

    async def check(self, timeout: float = 2.0) -> str | None:
        """None when the whole chain answers; otherwise what is wrong, naming the stage if known."""
        events = self.events
        if events is None:
            return await self._check(timeout)
        found: list[str | None] = []
        if not events.lost():  # the launcher knows of no loss: dial, unless it learns of one meanwhile
            async with trio.open_nursery() as nursery:
                async def dial() -> None:
                    found.append(await self._check(timeout))
                    nursery.cancel_scope.cancel()

                async def told() -> None:
                    await events.wait_lost()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(dial)
                nursery.start_soon(told)
        if found:
            return found[0]
        # docs/replacement.md: the launcher says which stage is lost (no need to dial one being replaced)
        self.suspect = True
        await self.discard_idle()
        named = {stage.index: str(stage) for stage in self.stages}  # "stage 1 (layers 1:3) at HOST:PORT"
        return "; ".join(f"{named[index]} lost: {event.detail}" if index in named else str(event)
                         for index, event in sorted(events.lost().items()))

    async def _check(self, timeout: float) -> str | None:
        problem: str | None = None
        try:
            client = await StageClient.connect(self.address, connect_timeout=timeout, reply_timeout=timeout,
                                               tls=self.tls)
        except StageLost as exc:
            problem = str(exc)
        else:
            try:
                await client.stop(self.new_session_id())
            except StageClientError as exc:  # StageLost included: the chain behind the first stage failed
                problem = str(exc)
            finally:
                await client.aclose()
        if problem is None:
            self.suspect = False
            return None
        self.suspect = True
        await self.discard_idle()
        return await self.name_lost_stage(timeout) or problem

    async def name_lost_stage(self, timeout: float = 2.0) -> str | None:
        """Dial every known stage; a message naming those that do not answer (None if all do)."""
        lost: list[str] = []

        async def probe(stage: StageInfo) -> None:
            try:
                client = await StageClient.connect(stage.address, connect_timeout=timeout, tls=self.tls)
            except StageLost:
                lost.append(str(stage))
            else:
                await client.aclose()

        async with trio.open_nursery() as nursery:
            for stage in self.stages:
                nursery.start_soon(probe, stage)
        if not lost:
            return None
        return f"{', '.join(sorted(lost))} {'is' if len(lost) == 1 else 'are'} not answering"
