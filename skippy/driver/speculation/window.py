# Bookkeeping of verify windows in flight for one session (driver side, sans-IO).
#
# Strategy: the committed sequence ends with a "pending" token: committed, but not yet fed to the
# chain (its KV does not exist yet).  Every window's first input x_0 is a token the driver will
# know to be committed by the time the reply is processed; the rest are drafts.
#
# * An epoch-start window sends [pending, d_1..d_K] at the pending token's position.
# * While it is in flight, continuation windows (pipelining) send only drafts [e_1..e_m] at the
#   next absolute position; e_1 is the guess of the previous window's last prediction (its
#   "boundary" token), checked when that previous reply is processed.
#
# A reply for window [x_0..x_{m-1}] with predictions t_0..t_{m-1} commits x_1..x_a and t_a
# (`acceptance.accept_tokens`, or any `Verdict`).  If a < m - 1, or the next window in flight does
# not start with t_a, the epoch diverges: every later window becomes stale (drained and counted,
# never emitted) and the next message is sent at the authoritative position base + a + 1, which
# makes every stage that is ahead trim its KV (no repair message).  Windows never overlap.
#
# Replies must arrive in FIFO order with the ids that were sent: an unknown id or an id that is
# not the oldest in flight is a `WindowOrderError` (the connection cannot be trusted after that).
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Final, NewType, Sequence, final

from skippy.driver.speculation.acceptance import Verdict, accept_tokens

__all__ = [
    "MAX_WINDOWS_IN_FLIGHT",
    "SpeculationUsage",
    "UnknownWindowError",
    "Window",
    "WindowError",
    "WindowId",
    "WindowOrderError",
    "WindowOutcome",
    "WindowShapeError",
    "WindowTracker",
]

WindowId = NewType("WindowId", int)

#: protocol.md §5.2: at most 64 verify windows unresolved at once.
MAX_WINDOWS_IN_FLIGHT: Final = 64

#: Window ids travel in ``state.seq_id`` (i32); they wrap within the positive range.
_MAX_WINDOW_ID: Final = 0x7FFFFFFF


class WindowError(Exception):
    """A verify-window reply or request that breaks the bookkeeping."""


class UnknownWindowError(WindowError):
    """A reply names a window id that is not in flight."""


class WindowOrderError(WindowError):
    """A reply arrived out of FIFO order ("verify window reply out of order")."""


class WindowShapeError(WindowError):
    """A reply's prediction count does not match the window, or a window request is invalid."""


@dataclass(frozen=True, slots=True)
class Window:
    """One window sent down the chain.

    Attributes:
        id: echoed by the final stage in the reply.
        epoch: windows of an older epoch than the tracker's are stale.
        base_position: absolute position of ``inputs[0]``.
        inputs: the tokens sent; ``inputs[0]`` is committed (or the guess of a boundary token).
        continuation: True when ``inputs[0]`` is itself a draft (a pipelined window).
        match_length: the proposer's confidence hint for the drafts (for the controller).
    """

    id: WindowId
    epoch: int
    base_position: int
    inputs: tuple[int, ...]
    continuation: bool
    match_length: int = 0

    @property
    def drafts(self) -> tuple[int, ...]:
        """The drafted tokens the window proposes."""
        return self.inputs if self.continuation else self.inputs[1:]

    @property
    def end_position(self) -> int:
        return self.base_position + len(self.inputs)


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """What one reply changed.

    Attributes:
        window: the window the reply answered.
        stale: the window belonged to an abandoned epoch; nothing was committed.
        tokens: newly committed tokens, in order (empty when stale).
        accepted: drafts of this window that were accepted (including a continuation's boundary).
        proposed: drafts of this window that were judged (0 when stale).
        next_position: the authoritative position of the next epoch-start message.
        diverged: this reply ended the epoch; later windows in flight are now stale.
        rollback: stages hold KV past ``next_position`` (rejected rows or stale windows) that the
            next message's position will trim.
    """

    window: Window
    stale: bool
    tokens: tuple[int, ...]
    accepted: int
    proposed: int
    next_position: int
    diverged: bool
    rollback: bool


@dataclass(slots=True)
class SpeculationUsage:
    """Counters for ``usage`` and ``/metrics``."""

    proposed: int = 0  #: draft tokens sent in windows
    accepted: int = 0  #: draft tokens the target kept
    windows: int = 0  #: verify windows sent
    rollbacks: int = 0  #: divergences that left stage KV ahead of the committed sequence
    stale_windows: int = 0  #: windows drained without being used

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def as_dict(self) -> dict[str, int]:
        return {"proposed": self.proposed, "accepted": self.accepted, "windows": self.windows,
                "rollbacks": self.rollbacks, "stale_windows": self.stale_windows}


@final
@dataclass(slots=True)
class WindowTracker:
    """FIFO of a session's windows in flight, and the committed position.

    Attributes:
        pending_token: the last committed token (not yet fed to the chain).
        pending_position: its position, i.e. the authoritative position of the next epoch start.
        usage: the speculation counters.
    """

    pending_token: int
    pending_position: int
    usage: SpeculationUsage = field(default_factory=SpeculationUsage)
    _in_flight: deque[Window] = field(default_factory=deque)
    _epoch: int = 0
    _next_id: int = 1

    @property
    def epoch(self) -> int:
        """The current epoch; a divergence starts a new one and makes older windows stale."""
        return self._epoch

    @property
    def in_flight(self) -> int:
        """Windows sent and not yet answered (stale ones included: their replies must be read)."""
        return len(self._in_flight)

    @property
    def live(self) -> tuple[Window, ...]:
        """Windows in flight whose epoch is current, oldest first."""
        return tuple(w for w in self._in_flight if w.epoch == self._epoch)

    @property
    def optimistic_tail(self) -> tuple[int, ...]:
        """The drafts in flight in the current epoch, in order: the optimistic continuation.

        When the oldest live window is a continuation, the window before it was committed and its
        boundary guess (``inputs[0]``) with it: that token is the pending one, already history.
        """
        tail: list[int] = []
        for index, window in enumerate(self.live):
            tail.extend(window.drafts[1:] if index == 0 and window.continuation else window.drafts)
        return tuple(tail)

    def reserve_id(self) -> WindowId:
        """An id no window of this tracker uses (a message the runner answers itself)."""
        return self._allocate_id()

    def _allocate_id(self) -> WindowId:
        value = self._next_id
        self._next_id = value + 1 if value < _MAX_WINDOW_ID else 1
        return WindowId(value)

    def _push(self, window: Window) -> Window:
        if len(self._in_flight) >= MAX_WINDOWS_IN_FLIGHT:
            raise WindowShapeError(f"more than {MAX_WINDOWS_IN_FLIGHT} verify windows in flight")
        self._in_flight.append(window)
        if window.drafts:
            self.usage.windows += 1
            self.usage.proposed += len(window.drafts)
        return window

    def open_epoch(self, drafts: Sequence[int], *, match_length: int = 0) -> Window:
        """Open an epoch-start window [pending, *drafts] (no drafts: a plain decode step).

        Raises:
            WindowShapeError: a live window is still in flight (send a continuation instead).
        """
        if self.live:
            raise WindowShapeError("an epoch-start window needs no live window in flight")
        return self._push(Window(self._allocate_id(), self._epoch, self.pending_position,
                                 (self.pending_token, *(int(t) for t in drafts)), False, match_length))

    def open_continuation(self, drafts: Sequence[int], *, match_length: int = 0) -> Window:
        """Open a pipelined window of drafts right after the last live window.

        Raises:
            WindowShapeError: no live window to continue, or no drafts.
        """
        live = self.live
        if not live:
            raise WindowShapeError("a continuation window needs a live window in flight")
        if not drafts:
            raise WindowShapeError("a continuation window needs at least one draft")
        return self._push(Window(self._allocate_id(), self._epoch, live[-1].end_position,
                                 tuple(int(t) for t in drafts), True, match_length))

    def take_reply(self, window_id: int, count: int) -> Window:
        """Check a reply against the FIFO and remove its window.

        Args:
            window_id: the id the reply echoes.
            count: how many predictions it carries.

        Returns:
            The answered window.

        Raises:
            UnknownWindowError: no window with that id is in flight.
            WindowOrderError: the id is in flight but not the oldest.
            WindowShapeError: ``count`` differs from the window's input count.
        """
        if not self._in_flight:
            raise UnknownWindowError(f"verify window reply for id {window_id} with no window in flight")
        head = self._in_flight[0]
        if window_id != head.id:
            if any(w.id == window_id for w in self._in_flight):
                raise WindowOrderError(f"verify window reply out of order: id {window_id}, expected {head.id}")
            raise UnknownWindowError(f"verify window reply for unknown id {window_id} (expected {head.id})")
        if count != len(head.inputs):
            raise WindowShapeError(f"verify window {window_id} sent {len(head.inputs)} tokens "
                                   f"but the reply has {count} predictions")
        self._in_flight.popleft()
        return head

    def commit(self, window: Window, verdict: Verdict) -> WindowOutcome:
        """Apply a verdict on a window returned by :meth:`take_reply`."""
        if window.epoch != self._epoch:
            self.usage.stale_windows += 1
            return WindowOutcome(window, True, (), 0, 0, self.pending_position, False, False)
        drafts_judged = len(window.inputs) - 1
        if not 0 <= verdict.accepted <= drafts_judged or len(verdict.tokens) != verdict.accepted + 1:
            raise WindowShapeError(f"verdict {verdict} does not fit window {window.id}")
        accepted = verdict.accepted + (1 if window.continuation else 0)
        proposed = drafts_judged + (1 if window.continuation else 0)
        self.usage.accepted += accepted
        self.pending_token = verdict.next_token
        self.pending_position = window.base_position + verdict.accepted + 1
        rows_ahead = verdict.accepted < drafts_judged
        following = self.live
        diverged = False
        if following and (rows_ahead or following[0].inputs[0] != self.pending_token):
            diverged = True
            self._epoch += 1
        elif rows_ahead:
            diverged = True
        if diverged:
            self.usage.rollbacks += 1
        # A continuation's boundary guess (its inputs[0]) is credited when its own reply is
        # committed; a stale window's drafts stay proposed-but-not-accepted.
        return WindowOutcome(window, False, verdict.tokens, accepted, proposed,
                             self.pending_position, diverged, diverged)

    def on_reply(self, window_id: int, predicted: Sequence[int],
                 accept: Callable[[Sequence[int], Sequence[int]], Verdict] = accept_tokens) -> WindowOutcome:
        """Match a PredictedTokens reply to its window and commit what the target kept.

        Args:
            window_id: the reply's window id.
            predicted: one target token per window input.
            accept: the acceptance rule over (drafts judged, predictions).

        Returns:
            The outcome.

        Raises:
            WindowError: see :meth:`take_reply`.
        """
        window = self.take_reply(window_id, len(predicted))
        if window.epoch != self._epoch:
            return self.commit(window, Verdict(0, (int(predicted[0]),)))
        return self.commit(window, accept(window.inputs[1:], predicted))
