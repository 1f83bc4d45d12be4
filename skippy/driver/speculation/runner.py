# The I/O half of speculative decoding, which drives a `SpeculativeDecoder` over one `StageClient` lane.
#
# Strategy: pipelined windows on the lane's send/receive halves (not the blocking `verify()`).
# `step()` fills the pipeline with every message the decoder wants in flight (DecodeEmbd for a
# plain step, VerifyWindow with `seq_id = window_id` otherwise), then reads one reply, matches it
# to the oldest window in flight (the decoder's `WindowError` on an unknown / out-of-order id or a
# wrong prediction count) and returns the newly committed tokens; stale windows are drained and
# return nothing, so `step()` reads until something is committed.  Rollback needs no message: the
# next epoch's VerifyWindow / DecodeEmbd carries the authoritative position and every stage that
# is ahead trims itself.  `finish(length)` ends a run: a TrimSession (only when some stage may hold
# KV past `length`) is sent right behind the windows still in flight, their replies are drained,
# then the trim's ACK, so every stage ends with exactly the KV a non-speculative run leaves.
#
# One-row heads (`redo_heads`, set on chains of a recurrent model): a window of several rows that
# keeps only its first row (every draft rejected) would leave each stage to roll back to the
# window's start and replay that row alone (skippy.runtime.rollback); a later stage replays the
# activation its upstream computed inside the window's batch (ggml's n >= 2 kernels, a chunked
# delta net), while one stage replays it through every layer as one row: the chain would differ
# from the unsplit run in the last bits.  So the runner sends that row again at once as a 1-row
# VerifyWindow at the window's start (behind the windows in flight, before the next epoch): every
# stage trims to its checkpoint before the window (a restore, nothing replayed) and computes the
# row from its upstream's 1-row output, which is what the unsplit replay computes.  Its reply is
# drained here, never shown to the decoder; it costs one 1-row traversal per such window,
# pipelined (no round trip is waited for).  `finish(length)` does the same when `length` keeps
# only the first row of the last message that wrote there (a stop string or an end of generation
# right after a window's first row).  A head of two or more rows is replayed exactly (the
# batch kernels give each row the same bits whatever the batch's length).  Done in the driver,
# not in the stages, because only the driver knows the row is the whole head before the next
# message: a stage would have to hold the trim back and rewrite the next message (positions,
# rows, the reply's predictions) on a data plane that relays it hop by hop.
#
# Any reply that does not fit (wrong kind, wrong id) raises `SpeculationProtocolError`, a
# `StageClientError`: the lane cannot be trusted afterwards and the caller closes it.
from __future__ import annotations

import time
from collections import deque
from typing import Final, final

import numpy as np

from skippy.codec.protocol import MessageKind, ReplyKind, StageMessage, StageReply
from skippy.codec.protocol_ext import TimingsFrame
from skippy.driver.client import StageClient, StageClientError
from skippy.driver.speculation.decoder import SpeculativeDecoder, WindowRequest
from skippy.driver.speculation.window import WindowError

__all__ = ["SpeculationProtocolError", "SpeculativeRunner"]

_PREDICTIONS: Final = (ReplyKind.PREDICTED_TOKEN, ReplyKind.PREDICTED_TOKENS)
#: Messages remembered for `finish` (a stop cuts into the last committed window: far fewer back).
_REMEMBERED: Final = 256


class SpeculationProtocolError(StageClientError):
    """A verify-window reply broke the FIFO contract (out of order, unknown id, wrong shape/kind)."""


@final
class SpeculativeRunner:
    """Sends a decoder's windows on a lane and feeds the replies back.

    Args:
        client: the lane (one caller at a time).
        session_id: the request's session.
        decoder: the per-request decoder (created after the prefill).
        request_id: stamped on every message.
        redo_heads: send a window cut to its first row again as a 1-row window (module header):
            a chain of a recurrent model.
    """

    def __init__(self, client: StageClient, session_id: int, decoder: SpeculativeDecoder, *,
                 request_id: int = 0, redo_heads: bool = False) -> None:
        self.client = client
        self.session_id = session_id
        self.decoder = decoder
        self.request_id = request_id
        self.redo_heads = redo_heads
        #: Ids of the 1-row windows sent again (their replies are drained, not decoded).
        self._redos: set[int] = set()
        #: 1-row windows sent again (for the stats and the tests).
        self.redone = 0
        #: The last messages sent: (position, tokens), oldest first.
        self._written: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=_REMEMBERED)
        #: Send time of every message in flight, by window id (FIFO order).
        self._sent: dict[int, float] = {}
        #: When the last reply was read (the wait for the next one starts there or at its send).
        self._last_reply: float | None = None
        #: The furthest position any message sent so far wrote KV to (exclusive).
        self.kv_high_water = decoder.kv_length
        #: Replies read (for timing), most recent last; the caller may clear it.
        self.replies: list[StageReply] = []
        #: docs/protocol.md §14: every window that committed something, as computed: (start,
        #: positions kept, the rows sent), in order; the caller takes them (a resume replays them).
        self.committed: list[tuple[int, int, tuple[int, ...]]] = []

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def _message(self, request: WindowRequest) -> StageMessage:
        tokens = np.asarray(request.tokens, dtype=np.int32)
        if request.is_decode:
            step = len(self.decoder.generated) - 1
            return StageMessage.create(
                MessageKind.DECODE_EMBD, pos_start=request.base_position, token_count=1,
                request_id=self.request_id, session_id=self.session_id, tokens=tokens,
                state_changes={"decode_step": step, "current_token": int(tokens[0])},
            )
        return StageMessage.create(
            MessageKind.VERIFY_WINDOW, pos_start=request.base_position, token_count=len(tokens),
            request_id=self.request_id, session_id=self.session_id, tokens=tokens,
            state_changes={"seq_id": int(request.window_id), "current_token": int(tokens[0])},
        )

    async def _fill(self) -> None:
        while (request := self.decoder.next_window()) is not None:
            await self.client.send(self._message(request))
            self._sent[int(request.window_id)] = time.perf_counter()
            self._written.append((request.base_position, tuple(request.tokens)))
            self.kv_high_water = max(self.kv_high_water, request.base_position + len(request.tokens))

    async def _receive(self) -> tuple[int, StageReply]:
        """The next reply and the window id it answers (checked against the FIFO by the caller)."""
        reply = await self.client.receive()
        if reply.kind not in _PREDICTIONS:
            raise SpeculationProtocolError(
                f"first stage {self.client.address} answered {ReplyKind(reply.kind).reference_name} "
                "to a decode step / verify window; expected a prediction"
            )
        if not self._sent:
            raise SpeculationProtocolError(f"verify window reply with no window in flight (id {reply.window_id})")
        head = next(iter(self._sent))
        if reply.kind == ReplyKind.PREDICTED_TOKENS:
            return reply.window_id, reply
        return head, reply  # PredictedToken carries no id: it answers the oldest (a plain step)

    async def step(self) -> tuple[int, ...]:
        """Fill the pipeline, then read replies until at least one token is committed.

        Returns:
            The newly committed tokens, in order (the decoder's ``generated`` grew by them).

        Raises:
            SpeculationProtocolError: a reply out of order, for an unknown window, or misshapen.
            StageLost, StageClientError: the lane failed.
        """
        while True:
            await self._fill()
            window_id, reply = await self._receive()
            if self._drained_redo(window_id, reply):
                self._last_reply = time.perf_counter()
                continue
            self.replies.append(reply)
            sent = self._sent.get(window_id)
            now = time.perf_counter()
            waited = None if sent is None else now - max(sent, self._last_reply or sent)
            self._last_reply = now
            predicted = reply.predicted_tokens if reply.kind == ReplyKind.PREDICTED_TOKENS else (reply.predicted,)
            try:
                outcome = self.decoder.on_reply(
                    window_id, predicted,
                    wall_seconds=None if sent is None else now - sent,
                    compute_seconds=_compute_seconds(self.client.last_timings),
                    interval_seconds=waited,
                )
            except WindowError as exc:
                raise SpeculationProtocolError(f"first stage {self.client.address}: {exc}") from exc
            del self._sent[window_id]
            if not outcome.stale:
                window = outcome.window
                kept = outcome.next_position - window.base_position
                if self.redo_heads and kept == 1 and len(window.inputs) > 1:
                    await self._redo(window.base_position, window.inputs[0])
                    self.committed.append((window.base_position, 1, window.inputs[:1]))
                else:
                    self.committed.append((window.base_position, kept, window.inputs))
            if outcome.tokens:
                return outcome.tokens

    async def _redo(self, position: int, token: int) -> None:
        """Send ``token`` at ``position`` again as a 1-row window (module header)."""
        window_id = int(self.decoder.tracker.reserve_id())
        await self.client.send(StageMessage.create(
            MessageKind.VERIFY_WINDOW, pos_start=position, token_count=1, request_id=self.request_id,
            session_id=self.session_id, tokens=np.asarray([token], dtype=np.int32),
            state_changes={"seq_id": window_id, "current_token": int(token)},
        ))
        self._sent[window_id] = time.perf_counter()
        self._written.append((position, (int(token),)))
        self._redos.add(window_id)
        self.redone += 1

    def _head_of(self, length: int) -> int | None:
        """The token at ``length - 1`` when the last message that wrote that position started
        there with more rows (a trim to ``length`` would cut it to a 1-row head); else None."""
        for position, tokens in reversed(self._written):
            if position <= length - 1 < position + len(tokens):
                return tokens[0] if position == length - 1 and len(tokens) > 1 else None
        return None

    def _drained_redo(self, window_id: int, reply: StageReply) -> bool:
        """Whether ``reply`` answers a 1-row window sent again (then it is taken off the FIFO)."""
        if window_id not in self._redos:
            return False
        if next(iter(self._sent)) != window_id or reply.kind != ReplyKind.PREDICTED_TOKENS \
                or len(reply.predicted_tokens) != 1:
            raise SpeculationProtocolError(f"first stage {self.client.address}: the reply to the 1-row window "
                                           f"{window_id} is out of order or misshapen")
        self._redos.discard(window_id)
        del self._sent[window_id]
        return True

    async def finish(self, length: int) -> None:
        """End the run with every stage's KV exactly ``length`` positions long.

        Sends TrimSession(``length``) behind the windows in flight when any message wrote past
        ``length`` (a 1-row window instead when ``length`` keeps only the first row of a message,
        with ``redo_heads``: module header), then drains the in-flight replies (checking their
        FIFO order) and the ACK.
        """
        head = self._head_of(length) if self.redo_heads else None
        if head is not None:
            await self._redo(length - 1, head)
        trim = self.kv_high_water > length and head is None
        if trim:
            await self.client.send(StageMessage.create(
                MessageKind.TRIM_SESSION, token_count=length, request_id=self.request_id,
                session_id=self.session_id,
            ))
        tracker = self.decoder.tracker
        while self._sent:
            window_id, reply = await self._receive()
            if self._drained_redo(window_id, reply):
                continue
            count = len(reply.predicted_tokens) if reply.kind == ReplyKind.PREDICTED_TOKENS else 1
            try:
                tracker.take_reply(window_id, count)
            except WindowError as exc:
                raise SpeculationProtocolError(f"first stage {self.client.address}: {exc}") from exc
            del self._sent[window_id]
        if trim:
            ack = await self.client.receive()
            if ack.kind != ReplyKind.ACK:
                raise SpeculationProtocolError(
                    f"first stage {self.client.address} answered {ReplyKind(ack.kind).reference_name} "
                    "to TrimSession; expected ACK"
                )
        if trim or head is not None:
            self.kv_high_water = length


def _compute_seconds(timings: TimingsFrame | None) -> float:
    """Compute summed over the stages that reported timings for a reply (0 when none did: a
    plain v11 chain, where the cost model then sees all of a round trip as transport)."""
    if timings is None:
        return 0.0
    return sum(record.compute_us for record in timings.records) / 1e6
