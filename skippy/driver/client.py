"""``StageClient``: one lane to a chain's first stage, the minimal client every driver builds on.

Strategy: one TCP stream, one reply decoder, strictly ordered request/reply (the protocol carries
no ids: replies match messages by order).  The driver's messages never carry activations
(``source_stage_index = -1``), so the lane needs no activation width.  Prefill is pipelined: a
non-final chunk is ACKed early by the first stage, so up to ``credit`` chunks are sent ahead of
their ACKs, then the final chunk's PredictedToken ends the prompt.  Every reply wait is bounded
(``reply_timeout``); a closed or reset lane raises :class:`StageLost` naming the first stage,
never a trio exception.  Not safe for concurrent use by several tasks: one lane, one caller.
Frames go through :class:`skippy.net.socket_io.SocketIO` (a non-blocking read or write first,
into one reusable buffer; trio only when the socket would block), as on the stages' hot path.
Every operation (``request``, ``prefill``, ``decode``, ``verify``, runs, return lanes) goes through
the lane's rules, :class:`skippy.lane.driver.DriverLane` (the stages' table, read from the driver's
end): it says on which lane each reply comes and matches every reply to the message it answers;
this class only moves the bytes.  :meth:`StageClient.send` / :meth:`StageClient.receive` move one
frame unchecked (a caller keeping its own order, such as the speculation runner, or a test's
hostile frame): nothing else may be owed a reply meanwhile.

Negotiated extensions (``docs/protocol.md`` §2-§4; ``extensions=False`` speaks plain v11): every
message carries the extension flag and replies are decoded with ``extensions=True``.  A Timings
frame is kept for the reply it precedes: after :meth:`StageClient.receive` returns,
``last_timings`` holds that reply's per-stage records (deepest stage first, stage 0 last; None
when the chain sent none) and :meth:`StageClient.take_timings` hands out every frame received
since the last call.  An Error frame closes the lane and raises :class:`StageLost` (loss codes:
``DOWNSTREAM_LOST``, ``SHUTTING_DOWN``) or its subclass :class:`StageRemoteError` (the others),
with ``ErrorFrame.describe()`` in the text (the failed stage's index and address) and the frame
as ``.frame``.

Direct return (``docs/protocol.md`` §8, off unless asked for): :meth:`StageClient.open_direct_return`
dials the chain's final stage for one configured session and sends ``PredictionReturnOpen`` with the
direct-return flag; once that is ACKed, the session's predicted kinds (final prefill chunk, decodes,
verify windows) carry the flag and their replies are read from that return lane, so they skip every
reverse hop.  A final stage that refuses the open (or never answers it within the timeout: a v11
peer) leaves the session hop by hop.  Waiting on the return lane, its loss fails the request at once
(the chain's own Error frame, read from the first-stage lane within a second, names the stage when
one came; else the final stage's address is named); ``stop`` closes it.  Each session has its own
return lane, so several sessions of the lane may return directly at once (a request's ``n``
choices: the first choice's session stays open while its forks run, each on the same path).

Decode runs (``docs/protocol.md`` §11): :meth:`StageClient.start_run` sends one DecodeEmbd flagged
``DECODE_RUN``; a first stage that runs it says so before its first reply and from then on feeds
each predicted token to the session's next step itself, so :meth:`StageClient.next_run_token`
only reads.  The client follows the run's end by the same rules as the stage (its budget, a stop
token); any other message for the session ends it early, and the predictions of steps the stage
had already started are read and dropped before that message's reply (``run_overshoot`` counts
them).  Those steps wrote KV past the last prediction read: :meth:`StageClient.end_run` ends a
run with a TrimSession that removes it, so the session can go on; a Stop needs nothing more.  A stage that does not say it runs the decode answered it as one step: ``running`` stays
False and the caller goes on one DecodeEmbd per token.
"""

from __future__ import annotations

import collections
import dataclasses
import select
import ssl
from typing import Sequence

import numpy as np
import trio

from skippy.codec.decode_run import DecodeRunRequest
from skippy.codec.protocol import (
    MessageKind,
    ReplyKind,
    SamplingConfig,
    StageMessage,
    StageReply,
    StateHeader,
    WireDType,
    WireError,
    check_ready,
)
from skippy.codec.protocol_ext import (
    DECODE_RUN_FLAG,
    DIRECT_RETURN_FLAG,
    MODEL_IDENTITY_FLAG,
    REPLAY_FLAG,
    SKIPPY_EXTENSIONS_FLAG,
    ErrorCode,
    ErrorFrame,
    LogprobsFrame,
    SamplingAcceptedFrame,
    TimingsFrame,
    with_direct_return_flag,
    with_extensions_flag,
)
from skippy.lane.driver import DriverLane, LaneMismatch, Owed, expected_replies
from skippy.net.address import Address
from skippy.net.socket_io import SocketIO, set_no_delay
from skippy.net.tls import handshake_as_client

from skippy.codec import wire as codec

from skippy.codec.protocol import END_OF_STREAM, NEED_DATA


class StageClientError(Exception):
    """The chain refused a request or answered out of protocol."""


class StageLost(StageClientError):
    """The lane closed: the first stage, or a stage behind it, failed or went away.

    ``frame`` is the chain's extension Error frame when one said why (None otherwise).
    """

    def __init__(self, text: str, frame: ErrorFrame | None = None) -> None:
        super().__init__(text)
        self.frame = frame

    @property
    def code(self) -> ErrorCode | None:
        """The chain's error code (from the Error frame), None when no stage said why."""
        return None if self.frame is None else ErrorCode(self.frame.code)


class StageRemoteError(StageLost):
    """A stage closed the lane for a reason it named other than a loss (malformed frame,
    runtime error, refused kind, state mismatch, overload, internal error)."""


#: Error codes that mean "a stage went away" rather than "a stage refused".
_LOSS_CODES = frozenset({ErrorCode.DOWNSTREAM_LOST, ErrorCode.SHUTTING_DOWN})
#: Timings frames kept for take_timings() when nobody takes them.
_TIMINGS_KEPT = 4096
#: The reference's default DecodeEmbd header (``StateHeader.for_kind``), the per-token template.
_DECODE_HEADER = StateHeader.for_kind(MessageKind.DECODE_EMBD)
#: Flags an extension-aware driver sets on every message: extension frames (§2) and model identity (§9).
_AWARE_FLAGS = SKIPPY_EXTENSIONS_FLAG | MODEL_IDENTITY_FLAG



#: Seconds to wait, after a return lane closed, for the first-stage lane's Error frame naming why.
_LOSS_DIAGNOSIS_S = 1.0


class _ReturnLane:
    """The driver's end of one session's return lane (docs/protocol.md §8)."""

    __slots__ = ("stream", "io", "decoder", "address", "session_id", "request_id")

    def __init__(self, stream: trio.SocketStream, address: Address, session_id: int, request_id: int,
                 extensions: bool) -> None:
        self.stream = stream
        self.io = SocketIO(stream, 1 << 16)
        self.decoder = codec.ReplyDecoder(extensions=extensions)
        self.address = address
        self.session_id = session_id
        self.request_id = request_id


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillResult:
    """The reply to the final prefill chunk plus the ACKs of the others."""

    reply: StageReply
    acks: tuple[StageReply, ...]

    @property
    def token(self) -> int:
        return self.reply.predicted


class StageClient:
    """One lane to a first stage.

    Args:
        stream: a connected stream whose READY was already read (see :meth:`connect`).
        address: the first stage, for error messages.
        reply_timeout: seconds to wait for any one reply.
        extensions: negotiate skippy's extension frames (Error, Timings); False: plain v11.
    """

    def __init__(self, stream: trio.SocketStream, address: Address, *, reply_timeout: float = 30.0,
                 extensions: bool = True) -> None:
        self.stream = stream
        self.address = address
        self.reply_timeout = reply_timeout
        self.extensions = extensions
        self._decoder = codec.ReplyDecoder(extensions=extensions)
        #: Per-stage timings of the last reply :meth:`receive` returned (None: none came).
        self.last_timings: TimingsFrame | None = None
        self._pending_timings: TimingsFrame | None = None
        #: docs/protocol.md §10: the SamplingAccepted / Logprobs frames that preceded the last reply
        #: :meth:`receive` returned (None: none came).
        self.last_accepted: SamplingAcceptedFrame | None = None
        self.last_logprobs: LogprobsFrame | None = None
        self._pending_accepted: SamplingAcceptedFrame | None = None
        self._pending_logprobs: LogprobsFrame | None = None
        self._timings: collections.deque[TimingsFrame] = collections.deque(maxlen=_TIMINGS_KEPT)
        self._io = SocketIO(stream, 1 << 16)
        self._closed = False
        #: docs/protocol.md §8: the open return lanes, by session id.
        self._returns: dict[int, _ReturnLane] = {}
        #: The TLS context this lane was opened with (a return lane uses it too).
        self.tls: ssl.SSLContext | None = None
        #: The lane's rules from the driver's end: what each message is owed, on which lane,
        #: the decode run in progress (§11) and the sessions that return directly (§8).
        self._lane = DriverLane()

    @classmethod
    async def connect(cls, address: Address | str, *, connect_timeout: float = 10.0,
                      reply_timeout: float = 30.0, extensions: bool = True,
                      tls: ssl.SSLContext | None = None) -> "StageClient":
        """Dial a first stage and read its READY.

        Args:
            tls: the driver's mutual-TLS context (``skippy.net.tls.client_context``); READY
                then comes after the handshake.  None: plain TCP.

        Raises:
            StageLost: no connection, a failed TLS handshake, or no READY within ``connect_timeout``.
        """
        target = Address.parse(address) if isinstance(address, str) else address
        try:
            with trio.fail_after(connect_timeout):
                stream = await trio.open_tcp_stream(target.host, target.port)
                set_no_delay(stream)
                if tls is not None:
                    stream = await handshake_as_client(stream, tls, target.host)  # type: ignore[assignment]
                try:
                    data = b""
                    while len(data) < 4:
                        chunk = await stream.receive_some(4 - len(data))
                        if not chunk:
                            break
                        data += chunk
                    check_ready(data)
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except (OSError, trio.TooSlowError, WireError, trio.BrokenResourceError) as exc:  # all mean "no lane"
            raise StageLost(f"cannot open a lane to first stage {target}: {exc or type(exc).__name__}") from exc
        client = cls(stream, target, reply_timeout=reply_timeout, extensions=extensions)
        client.tls = tls
        return client

    def peer_closed(self) -> bool:
        """Whether the stage closed this idle lane, or wrote on it unasked (an Error frame): it
        cannot carry a request (a pool checks before reusing a lane; stages close idle ones)."""
        if self._closed:
            return True
        stream = getattr(self.stream, "transport_stream", self.stream)
        sock = getattr(stream, "socket", None)
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))

    async def aclose(self) -> None:
        await self.close_direct_return()
        if not self._closed:
            self._closed = True
            await trio.aclose_forcefully(self.stream)

    # -- direct return -----------------------------------------------------------------------
    @property
    def direct_sessions(self) -> frozenset[int]:
        """The sessions whose predictions come over a return lane (empty: all go hop by hop)."""
        return frozenset(self._returns)

    def returns_directly(self, session_id: int) -> bool:
        """Whether ``session_id``'s predictions come over a return lane."""
        return session_id in self._lane.direct_sessions

    async def open_direct_return(self, address: Address | str, session_id: int, *, request_id: int = 0,
                                 timeout: float = 2.0) -> bool:
        """Open a return lane to the chain's final stage for ``session_id`` (configure it first).

        Returns:
            True once the final stage ACKed the open; False when it refused the kind or did not
            answer within ``timeout`` (a plain v11 or older stage): the session stays hop by hop.

        Raises:
            StageLost: the final stage cannot be reached; StageRemoteError: it refused the open
            for another reason (an unknown session id).
        """
        await self.close_direct_return(session_id)
        target = Address.parse(address) if isinstance(address, str) else address
        try:
            opener = await StageClient.connect(target, connect_timeout=timeout, reply_timeout=timeout,
                                               extensions=self.extensions, tls=self.tls)
        except StageLost as exc:  # connect names a "first stage": this one is the final stage
            raise StageLost(f"cannot open a return lane to final stage {target}: {exc.__cause__ or exc}") from exc
        message = with_direct_return_flag(StageMessage.create(MessageKind.PREDICTION_RETURN_OPEN,
                                                              request_id=request_id, session_id=session_id))
        self._lane.return_lane_opening(message)
        try:
            await opener.send(message)
            reply = await opener.receive()
            self._lane.replied(reply, session_id)  # its ACK: the session's flagged messages go there
        except StageRemoteError as exc:
            await self._refused(opener, session_id)
            if exc.code is ErrorCode.UNSUPPORTED_KIND:
                return False
            raise
        except StageClientError:  # no answer (a v11 stage parks the stream) or a close: not served
            await self._refused(opener, session_id)
            return False
        except LaneMismatch:
            await self._refused(opener, session_id)
            raise StageClientError(f"final stage {target} answered {ReplyKind(reply.kind).reference_name} "
                                   "to PredictionReturnOpen") from None
        lane = _ReturnLane(opener.stream, target, session_id, request_id, self.extensions)
        lane.decoder = opener._decoder  # anything the final stage sent after the ACK is already in it
        lane.io = opener._io
        self._returns[session_id] = lane
        return True

    async def _refused(self, opener: "StageClient", session_id: int) -> None:
        self._lane.return_lane_closed(session_id)
        await opener.aclose()

    async def close_direct_return(self, session_id: int | None = None) -> None:
        """Close the return lane of ``session_id`` (None: every one); its replies go hop by hop again."""
        if session_id is None:
            lanes, self._returns = list(self._returns.values()), {}
        else:
            lane = self._returns.pop(session_id, None)
            lanes = [] if lane is None else [lane]
        for lane in lanes:
            self._lane.return_lane_closed(lane.session_id)
            await trio.aclose_forcefully(lane.stream)

    async def _receive_direct(self, session_id: int) -> StageReply:
        """The next reply on the return lane of ``session_id``; its loss fails at once, naming the stage."""
        lane = self._returns[session_id]
        try:
            return await self._receive_on(lane.decoder, lane.io, f"return lane to final stage {lane.address}")
        except StageLost as exc:
            if exc.frame is not None:  # the final stage said why
                await self.close_direct_return(session_id)
                raise
            lost = exc
        await self.close_direct_return(session_id)
        # The return lane closed without a word: the chain's Error frame (a lost stage named by
        # its upstream) may be on its way on the first-stage lane.
        with trio.move_on_after(_LOSS_DIAGNOSIS_S):
            try:
                reply = await self.receive()
            except StageLost as exc:
                if exc.frame is not None:
                    raise
            else:
                raise StageClientError(f"first stage {self.address} answered {ReplyKind(reply.kind).reference_name} "
                                       "while a direct-return reply was awaited")
        raise StageLost(f"{lost}: the final stage {lane.address} failed or was lost") from lost

    async def __aenter__(self) -> "StageClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- frames ------------------------------------------------------------------------------
    async def send(self, message: StageMessage) -> None:
        """Send one message (with the extension flag set when negotiating).

        Raises:
            StageLost: the lane is closed.
        """
        if self.extensions:
            message = with_extensions_flag(message)
            if not message.state.flags & MODEL_IDENTITY_FLAG:  # docs/protocol.md §9: it knows MODEL_MISMATCH
                message = dataclasses.replace(message, state=dataclasses.replace(
                    message.state, flags=message.state.flags | MODEL_IDENTITY_FLAG))
        frame = codec.encode_message(message, WireDType(message.state.reserved), 0)
        await self.send_raw(frame)

    async def send_raw(self, frame: bytes) -> None:
        """Send bytes on the lane (tests use it for malformed frames)."""
        try:
            await self._io.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StageLost(self._lost_text("while sending")) from exc

    async def receive(self) -> StageReply:
        """The next reply.

        Raises:
            StageLost: the lane closed; StageClientError: timeout or a malformed reply.
        """
        return await self._receive_on(self._decoder, self._io, f"lane to first stage {self.address}")

    async def _receive_on(self, decoder: codec.ReplyDecoder, io: SocketIO, where: str) -> StageReply:
        try:
            with trio.fail_after(self.reply_timeout):
                while True:
                    try:
                        result = decoder.next_reply()
                    except WireError as exc:
                        raise StageClientError(f"malformed reply on {where}: {exc}") from exc
                    if result is NEED_DATA:
                        decoder.receive_data(await io.receive())  # a reset reads as b""
                    elif type(result) is StageReply:
                        self.last_timings, self._pending_timings = self._pending_timings, None
                        if self.last_timings is not None:
                            self._timings.append(self.last_timings)
                        self.last_logprobs, self._pending_logprobs = self._pending_logprobs, None
                        self.last_accepted, self._pending_accepted = self._pending_accepted, None
                        return result
                    elif type(result) is TimingsFrame:  # annotates the next reply
                        self._pending_timings = result
                    elif type(result) is LogprobsFrame:  # docs/protocol.md §10: the next reply's
                        self._pending_logprobs = result
                    elif type(result) is SamplingAcceptedFrame:
                        self._pending_accepted = result
                    elif isinstance(result, ErrorFrame):
                        if io is self._io:
                            await self.aclose()  # nothing follows an Error frame
                        error = StageLost if ErrorCode(result.code) in _LOSS_CODES else StageRemoteError
                        raise error(f"{where} closed: {result.describe()}", result)
                    else:
                        assert result is END_OF_STREAM
                        if io is self._io:
                            raise StageLost(self._lost_text("before replying"))
                        raise StageLost(f"{where} closed before replying")
        except trio.TooSlowError as exc:
            raise StageClientError(f"no reply on {where} within {self.reply_timeout:g} s") from exc

    def take_timings(self) -> list[TimingsFrame]:
        """The Timings frames of the replies received since the last call (oldest first)."""
        frames = list(self._timings)
        self._timings.clear()
        return frames

    def _lost_text(self, when: str) -> str:
        return (f"lane to first stage {self.address} closed {when}: a stage of the chain failed or was lost "
                "(the stage logs name it)")

    async def request(self, message: StageMessage, expect: ReplyKind | tuple[ReplyKind, ...] | None = None
                      ) -> StageReply:
        """Send ``message`` and return its reply, checking the reply kind (``expect``; None: the
        kinds the stages' rules answer it with, :func:`skippy.lane.driver.expected_replies`).  A
        message for the session of a decode run ends the run: its remaining predictions are
        dropped first."""
        kinds = expected_replies(message) if expect is None else expect if isinstance(expect, tuple) else (expect,)
        if not kinds:
            raise ValueError(f"{message.kind.reference_name} is never answered: send it, do not request it")
        owed = self._owe(message)
        await self.send(message)
        reply = await self._answer(owed)
        if reply.kind not in kinds:
            raise StageClientError(
                f"first stage {self.address} answered {ReplyKind(reply.kind).reference_name} to "
                f"{message.kind.reference_name}"
            )
        return reply

    # -- the lane's rules (skippy.lane.driver) -------------------------------------------------
    def _owe(self, message: StageMessage) -> Owed | None:
        """Record ``message`` as sent (before its bytes go): what it is owed, and on which lane.

        Raises:
            StageClientError: the rules do not let it be sent now (a decode run in the way, a
                direct-return flag without a return lane).
        """
        try:
            return self._lane.sent(message)
        except LaneMismatch as exc:
            raise StageClientError(f"lane to first stage {self.address}: {exc}") from None

    async def _answer(self, owed: Owed | None) -> StageReply:
        """The next reply on ``owed``'s lane (the chain lane or its session's return lane), matched
        to the message it answers by the rules; a decode run's overshoot is dropped first."""
        lane = None if owed is None else owed.lane
        while True:
            reply = await (self.receive() if lane is None else self._receive_direct(lane))
            accepted = self.last_accepted
            try:
                matched = self._lane.replied(reply, lane, features=0 if accepted is None else accepted.features)
            except LaneMismatch as exc:
                where = (f"first stage {self.address}" if lane is None
                         else f"final stage {self._returns[lane].address}" if lane in self._returns else "final stage")
                raise StageClientError(f"{where}: {exc}") from None
            if not matched.overshoot:
                return reply

    # -- operations --------------------------------------------------------------------------
    async def configure(self, session_id: int, *, sampling: SamplingConfig | None = None,
                        prompt_token_count: int = 0, request_id: int = 0,
                        metadata: str | None = None, flags: int = 0) -> StageReply:
        """ConfigureGeneration: the session's sampling (absent: greedy); returns the ACK.

        ``flags``: extension state flags to set (the sampling extension's, docs/protocol.md §10).
        """
        changes: dict[str, int] = {"prompt_token_count": prompt_token_count}
        if flags:
            changes["flags"] = StateHeader.for_kind(MessageKind.CONFIGURE_GENERATION).flags | flags
        message = StageMessage.create(
            MessageKind.CONFIGURE_GENERATION, request_id=request_id, session_id=session_id,
            sampling=sampling, chat_sampling_metadata=metadata, state_changes=changes,
        )
        return await self.request(message)

    async def prefill(self, session_id: int, tokens: Sequence[int], *, pos_start: int = 0,
                      chunk_size: int = 256, credit: int = 2, request_id: int = 0,
                      sampling: SamplingConfig | None = None) -> PrefillResult:
        """Send ``tokens`` as prefill chunks (pipelined under ``credit`` early ACKs).

        Returns:
            The final chunk's PredictedToken and the ACKs of the other chunks.
        """
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if chunk_size <= 0 or credit < 0:
            raise ValueError(f"chunk_size must be > 0 and credit >= 0 (got {chunk_size}, {credit})")
        values = np.asarray(tokens, dtype=np.int32)
        total = len(values)
        acks: list[StageReply] = []
        outstanding = 0
        for begin in range(0, total, chunk_size):
            end = min(total, begin + chunk_size)
            final = end == total
            kind = MessageKind.PREFILL_FINAL_EMBD if final else MessageKind.PREFILL_EMBD
            message = StageMessage.create(
                kind, pos_start=pos_start + begin, token_count=end - begin, request_id=request_id,
                session_id=session_id, tokens=values[begin:end], sampling=sampling if final else None,
                state_changes={"seq_id": begin // chunk_size, "prompt_token_count": pos_start + total,
                               "current_token": int(values[end - 1])},
            )
            if final and self._lane.direct(kind, session_id):
                message = with_direct_return_flag(message)
            owed = self._owe(message)
            await self.send(message)
            if final:
                break
            outstanding += 1
            while outstanding > credit:  # (the rules check each is an ACK)
                acks.append(await self._answer(None))
                outstanding -= 1
        while outstanding:
            acks.append(await self._answer(None))
            outstanding -= 1
        return PrefillResult(await self._answer(owed), tuple(acks))

    async def replay(self, session_id: int, tokens: Sequence[int],
                     frames: Sequence[tuple[int, int] | tuple[int, int, Sequence[int]]], *,
                     credit: int = 2, request_id: int = 0) -> int:
        """docs/protocol.md §14: after a resume, send positions ``[0, len(tokens))`` of a session
        again as PrefillEmbd frames flagged ``REPLAY`` with the partition they were first
        computed in (``frames``: (start, count), each starting where the previous one's count
        ends, from 0): a stage that holds them answers from its activation log, a replacement
        computes them.  A frame ``(start, kept, rows)`` is a verify window as it was computed:
        ``rows`` (the pending token and its drafts, rejected ones included) at ``start``, of which
        ``kept`` positions stayed; the next frame, at ``start + kept``, trims the rest, as it did
        then.  Returns the frames sent.
        """
        values = np.asarray(tokens, dtype=np.int32)
        outstanding = sent = 0
        for frame in frames:
            start, count = frame[0], frame[1]
            if count <= 0 or start + count > len(values):
                raise ValueError(f"replay frame ({start}, {count}) outside the {len(values)} positions")
            rows = values[start:start + count]
            if len(frame) == 3:
                rows = np.asarray(frame[2], dtype=np.int32)  # type: ignore[misc]
                if rows.shape[0] < count or not np.array_equal(rows[:count], values[start:start + count]):
                    raise ValueError(f"replay window at {start}: its first {count} rows are not the session's")
            message = StageMessage.create(
                MessageKind.PREFILL_EMBD, pos_start=start, token_count=len(rows), request_id=request_id,
                session_id=session_id, tokens=rows,
                state_changes={"prompt_token_count": len(values), "current_token": int(rows[-1])})
            message = dataclasses.replace(message, state=dataclasses.replace(
                message.state, flags=message.state.flags | REPLAY_FLAG))
            self._owe(message)
            await self.send(message)
            sent += 1
            outstanding += 1
            while outstanding > credit:  # (the rules check each is an ACK)
                await self._answer(None)
                outstanding -= 1
        while outstanding:
            await self._answer(None)
            outstanding -= 1
        return sent

    # -- decode runs (docs/protocol.md §11) ---------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether a decode run is in progress (:meth:`next_run_token` reads its next prediction)."""
        return self._lane.run is not None

    @property
    def run_overshoot(self) -> int:
        """Predictions of a run read and dropped because a message ended it early."""
        return self._lane.run_overshoot

    async def start_run(self, session_id: int, token: int, position: int, *, max_tokens: int,
                        stop_tokens: frozenset[int] = frozenset(), decode_step: int = -1,
                        request_id: int = 0) -> StageReply:
        """Start a decode run: DecodeEmbd of ``token`` at ``position``, flagged ``DECODE_RUN``, for
        at most ``max_tokens`` predictions (this one included), ending after one in
        ``stop_tokens``; returns the first PredictedToken.

        Afterwards :attr:`running` says whether the first stage runs it (then
        :meth:`next_run_token` returns each following prediction) or answered a plain decode.

        Raises:
            ValueError: the lane does not negotiate extensions, a run is already in progress, or
                a bad ``max_tokens`` / ``stop_tokens``.
        """
        if not self.extensions:
            raise ValueError("a decode run needs skippy's extensions (StageClient(extensions=True))")
        if self._lane.run is not None:
            raise ValueError(f"a decode run of session {self._lane.run.session_id} is in progress on this lane")
        if self.returns_directly(session_id):
            raise ValueError(f"session {session_id} returns over a direct-return lane; a decode run cannot")
        request = DecodeRunRequest(max_tokens, frozenset(stop_tokens))
        template = _DECODE_HEADER
        state = StateHeader(
            version=template.version, phase=template.phase, flags=template.flags | _AWARE_FLAGS | DECODE_RUN_FLAG,
            decode_step=decode_step, current_token=token, reserved=template.reserved)
        message = StageMessage(
            MessageKind.DECODE_EMBD, pos_start=position, token_count=1, state=state, request_id=request_id,
            session_id=session_id, chat_sampling_metadata=request.metadata(),
            tokens=np.array((token,), dtype=np.int32))
        owed = self._owe(message)
        await self.send_raw(codec.encode_message(message, WireDType.F32, 0))
        return await self._answer(owed)  # (the lane holds the run when the stage said it runs it)

    async def end_run(self, session_id: int, *, request_id: int = 0) -> int:
        """End the decode run of ``session_id`` early and leave every stage's KV as the per-token
        loop would after the predictions read so far: a TrimSession to the position of the next
        token (steps the stage had already started wrote past it); returns that position, where
        the session goes on (:meth:`decode` or a new run).

        Raises:
            StageClientError: no run of that session is in progress.
        """
        run = self._lane.run
        if run is None or run.session_id != session_id:
            raise StageClientError(f"no decode run of session {session_id} is in progress on this lane")
        position = run.position
        await self.trim(session_id, position, request_id=request_id)
        return position

    async def next_run_token(self, session_id: int) -> StageReply:
        """The next prediction of the decode run of ``session_id``.

        Raises:
            StageClientError: no run of that session is in progress, or a reply out of protocol.
        """
        run = self._lane.run
        if run is None or run.session_id != session_id:
            raise StageClientError(f"no decode run of session {session_id} is in progress on this lane")
        return await self._answer(None)

    async def decode(self, session_id: int, token: int, position: int, *, decode_step: int = -1,
                     request_id: int = 0) -> StageReply:
        """DecodeEmbd of ``token`` at the authoritative ``position``; returns PredictedToken."""
        # The per-token path: the header built directly with the extension flag already set
        # (what ``StageMessage.create`` and ``send``'s ``with_extensions_flag`` give, without
        # the copies), encoded and sent without ``send``'s checks.
        template = _DECODE_HEADER
        flags = template.flags | _AWARE_FLAGS if self.extensions else template.flags
        if self._lane.direct(MessageKind.DECODE_EMBD, session_id):
            flags |= DIRECT_RETURN_FLAG
        state = StateHeader(
            version=template.version, phase=template.phase, flags=flags,
            decode_step=decode_step, current_token=token, reserved=template.reserved)
        message = StageMessage(
            MessageKind.DECODE_EMBD, pos_start=position, token_count=1, state=state, request_id=request_id,
            session_id=session_id, tokens=np.array((token,), dtype=np.int32))
        owed = self._owe(message)  # (a run in progress refuses it)
        await self.send_raw(codec.encode_message(message, WireDType.F32, 0))
        return await self._answer(owed)

    async def verify(self, session_id: int, tokens: Sequence[int], position: int, *, window_id: int,
                     request_id: int = 0) -> StageReply:
        """VerifyWindow of ``tokens`` from ``position``; returns PredictedTokens (one per token)."""
        values = np.asarray(tokens, dtype=np.int32)
        message = StageMessage.create(
            MessageKind.VERIFY_WINDOW, pos_start=position, token_count=len(values), request_id=request_id,
            session_id=session_id, tokens=values,
            state_changes={"seq_id": window_id, "current_token": int(values[0]) if len(values) else -1},
        )
        if self._lane.direct(MessageKind.VERIFY_WINDOW, session_id):
            message = with_direct_return_flag(message)
        reply = await self.request(message)  # (on the return lane when flagged)
        if reply.window_id != window_id:
            raise StageClientError(f"verify window reply out of order: id {reply.window_id}, expected {window_id}")
        return reply

    async def retire(self, session_id: int, position: int, count: int, *, request_id: int = 0) -> None:
        """RetireVerifyWindow (no reply)."""
        await self.send(StageMessage.create(
            MessageKind.RETIRE_VERIFY_WINDOW, pos_start=position, token_count=count,
            request_id=request_id, session_id=session_id,
        ))

    async def trim(self, session_id: int, length: int, *, request_id: int = 0) -> StageReply:
        """TrimSession to ``length`` positions on every stage; returns the ACK."""
        message = StageMessage.create(MessageKind.TRIM_SESSION, token_count=length, request_id=request_id,
                                      session_id=session_id)
        return await self.request(message)

    async def stop(self, session_id: int, *, request_id: int = 0) -> StageReply:
        """Stop: end the session on every stage; returns the ACK (sent after the chain's)."""
        reply = await self.request(StageMessage.stop(request_id=request_id, session_id=session_id))
        if self.returns_directly(session_id):
            await self.close_direct_return(session_id)
        return reply

    async def generate_greedy(self, session_id: int, prompt: Sequence[int], steps: int, *,
                              chunk_size: int = 256, credit: int = 2,
                              direct_return: Address | str | None = None, run: bool = False) -> list[int]:
        """Configure, prefill ``prompt``, decode ``steps - 1`` more tokens, stop; the tokens.

        ``direct_return``: the final stage's address, to have its predictions sent straight back
        (docs/protocol.md §8; hop by hop when it refuses).  ``run``: decode as one decode run
        (docs/protocol.md §11; one DecodeEmbd per token when the first stage does not run it).
        """
        await self.configure(session_id, prompt_token_count=len(prompt))
        if direct_return is not None:
            await self.open_direct_return(direct_return, session_id)
        result = await self.prefill(session_id, prompt, chunk_size=chunk_size, credit=credit)
        tokens = [result.token]
        position = len(prompt)
        if run and steps > 1:
            reply = await self.start_run(session_id, tokens[-1], position, max_tokens=steps - 1, decode_step=0)
            tokens.append(reply.predicted)
            position += 1
            while self.running:
                tokens.append((await self.next_run_token(session_id)).predicted)
                position += 1
        while len(tokens) < steps:
            reply = await self.decode(session_id, tokens[-1], position, decode_step=len(tokens) - 1)
            tokens.append(reply.predicted)
            position += 1
        await self.stop(session_id)
        return tokens
