"""The lane's rules and state, sans-IO: one table of per-kind rules, events in, actions out.

:class:`StageLane` (at the end) is one lane as one machine: the rules' :class:`LaneProtocol`
plus everything else a lane decides with (sessions and quota, decode runs, backlogs, the data
plane's template, identity flags, direct-return timing totals); who performs each step is
:mod:`skippy.lane.placement`'s.

Strategy (h11's shape, for one upstream lane of a stage; no trio, no sockets, no runtime here):
:mod:`skippy.stage.connection` reads frames, runs the scheduler and writes bytes; at every step
it tells a :class:`LaneProtocol` what happened and does what the answer says.  Every message
kind goes through the same steps:

1. ``message_received(message)`` → :class:`Dispatch`, or a typed refusal (:class:`UnsupportedKind`,
   :class:`InvalidMessage`).  A message that is answered gets a :class:`Ticket`, its place in
   the upstream reply order; an early-ACKed kind's ACK is due at once (``Dispatch.early_ack``).
2. The connection runs the kind's :attr:`KindRule.handling` (execute, trim, configure, stop,
   prefix control, retire) and reports ``computed(dispatch, ...)`` → :class:`SendDownstream`
   (with the :class:`Expect`-ation for the downstream reply) or :class:`ReplyUpstream` (what the
   final stage answers) or ``None`` (already answered / nothing to answer).
3. ``frame_forwarding(forward)`` just before a frame leaves: its reply is expected in write
   order; a credited frame takes a reply credit (``take_credit`` says whether one is free).
4. ``downstream_replied(reply)`` → :class:`Relay` (absorb it, or relay it on the frame's ticket,
   releasing a stopped session first), or :class:`DownstreamLost` for a reply out of protocol.
   (``receiving_paused``: ``reply_limit`` replies wait to be written; read nothing more until
   they are.)
5. ``reply_ready(ticket, reply)`` → the tickets whose replies are now due, in message order,
   for the caller to write; ``replies_written(n)`` when it has, → the next ones due.  The
   *writer token* is this: whoever gets a non-empty answer writes, and nobody else gets one
   until it reports back, so the upstream stream has one writer and replies keep message order
   whatever finishes first.  ``claim_reply_write(ticket)`` hands the token to a write made
   elsewhere (the runtime thread's write-through) when that ticket is next in line.

The rules (:data:`RULES`, one row per :class:`~skippy.codec.protocol.MessageKind`; reference behaviour
``../shared/reference/stage-server.md`` §2.1-§2.2):

* **early ACK**: a non-final prefill chunk is ACKed on receipt, before compute, and its forwarded
  frame holds a **reply credit** until the downstream ACK, which is absorbed (its stats are kept
  for the next reply).  At most ``credit_limit`` credited frames are unacknowledged downstream.
* **execute**: prefill, decode and verify kinds run on the runtime; **auto-align** kinds carry
  the authoritative position (``pos_start`` >= 0): the session is trimmed back to it first.
* **forward**: every served kind is forwarded by a stage with a downstream (a prefix-cache
  control message only on a local hit); the downstream reply expected follows from the answer.
* **answer**: ACK, PredictedToken(s) (VerifyWindow: PredictedTokens with the window's stats),
  either (TryRestorePrefillDecode: a prediction on a chain hit, a miss ACK), or none
  (RetireVerifyWindow).  Stop releases the session after the downstream ACK.
* **header**: executable kinds must pass ``StateHeader.matches_kind``; control kinds are not
  checked.  StateImport and StateExport are refused.
* **direct return** (``docs/protocol.md`` §8): a PredictionReturnOpen carrying the direct-return
  flag, as the *first* message of a lane, makes that lane a **return lane** (ACKed; anything sent
  on it afterwards is refused); without the flag, or later on a lane, it is refused as before.
  A message of a kind whose row has ``direct_return`` and that carries the flag takes no ticket
  on any stage: a stage with a downstream forwards it expecting no reply, and the final stage
  answers it on the session's return lane (``ReplyUpstream.direct``); it is in flight on a stage
  until the connection reports ``direct_done`` (forwarded, or written into the return lane).
  Control messages, early ACKs and every unflagged message keep the hop-by-hop path.
* **write-through** columns say which kinds' output the runtime thread may write itself
  (:mod:`skippy.stage.write_through`): the frame of a non-prefill executable kind, and the
  final stage's reply of a plain decode (a PredictedToken and nothing else).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Awaitable, Callable, Final, Mapping, NamedTuple, final

from skippy.codec.decode_run import DecodeRunRequest
from skippy.codec.protocol import EMPTY_REPLY_STATS, MessageKind, ReplyKind, ReplyStats, StageMessage, StageReply
from skippy.codec.protocol_ext import (
    DIRECT_RETURN_FLAG, MODEL_IDENTITY_FLAG, Annotation, ExtensionNegotiation, TimingsFrame, is_identity_query,
)
from skippy.lane.decode_run import DecodeRun
from skippy.lane.errors import DownstreamLost, InvalidMessage, Overloaded, UnsupportedKind
from skippy.lane.timings import DirectTimings

__all__ = [
    "RULES", "Answer", "Dispatch", "Expect", "Forward", "Handling", "KindRule", "LaneProtocol", "Outputs", "Relay",
    "ReplyUpstream", "SendDownstream", "StageLane", "Ticket",
]


class Handling(enum.Enum):
    """What a stage does with a message of a kind (its own part, before any forward)."""

    EXECUTE = "execute"  #: run it on the runtime (a work item)
    STOP = "stop"  #: end the session (released after the downstream ACK)
    TRIM = "trim"  #: trim the session to token_count
    CONFIGURE = "configure"  #: set the session's sampling and cache settings
    PREFIX_CONTROL = "prefix-control"  #: docs/prefix-cache.md §6 (skippy.stage.prefix_control)
    RETIRE = "retire"  #: release verify checkpoints (nothing to do on this runtime); no reply
    RETURN_OPEN = "return-open"  #: docs/protocol.md §8: the lane becomes a session's return lane
    REFUSE = "refuse"  #: not served: the lane is closed with UNSUPPORTED_KIND


class Answer(enum.Enum):
    """What the upstream gets for a message of a kind."""

    NONE = "none"  #: nothing (RetireVerifyWindow)
    ACK = "ack"
    PREDICTION = "prediction"  #: PredictedToken, or PredictedTokens for a verify window
    PREDICTION_OR_ACK = "prediction-or-ack"  #: TryRestorePrefillDecode: a prediction on a hit


class Outputs(enum.Enum):
    """Which rows of an executed item the final stage turns into predicted tokens."""

    NONE = "none"  #: a non-final prefill chunk or a replay step: no logits needed
    LAST = "last"  #: a final prefill chunk or a decode: the last row
    ALL = "all"  #: a verify window: every row


class Expect(enum.Enum):
    """What the relay does with the downstream reply to a forwarded frame."""

    ABSORB_ACK = "absorb"  #: an early-ACKed chunk: keep its stats, return its credit
    RELAY_ACK = "ack"  #: relay an ACK upstream
    STOP_ACK = "stop"  #: release the session, then relay the ACK
    RELAY_PREDICTION = "prediction"  #: relay PredictedToken(s) upstream
    RELAY_EITHER = "either"  #: TryRestorePrefillDecode: PredictedToken on a hit, ACK on a miss


@final
@dataclasses.dataclass(frozen=True, slots=True)
class KindRule:
    """Everything a lane does differently for one message kind (a row of :data:`RULES`)."""

    handling: Handling
    answer: Answer
    #: ACK on receipt, before compute (the reference's early ACK of non-final prefill chunks).
    early_ack: bool = False
    #: The forwarded frame holds a reply credit until its (absorbed) downstream ACK.
    credit: bool = False
    #: pos_start >= 0 is authoritative: the session is trimmed back to it before executing.
    auto_align: bool = False
    #: The state header must match the kind (``StateHeader.matches_kind``).
    checks_header: bool = True
    #: Rows the final stage samples (executable kinds).
    outputs: Outputs = Outputs.LAST
    #: A verify window: PredictedTokens with the window id and the verify-window stats.
    window: bool = False
    #: The runtime thread may write the forwarded frame (:mod:`skippy.stage.write_through`).
    write_through_down: bool = False
    #: The runtime thread may write the final stage's reply (a lone PredictedToken).
    write_through_up: bool = False
    #: docs/protocol.md §8: with the direct-return flag, the final stage sends the prediction
    #: over the session's return lane and no stage answers the message upstream.
    direct_return: bool = False
    #: docs/protocol.md §11: with the decode-run flag, the first stage drives the session's decode
    #: loop itself (:mod:`skippy.lane.decode_run`).
    decode_run: bool = False
    #: A prefill chunk (``MessageKind.is_prefill``: its tokens extend the session's prompt).
    prefill: bool = False
    #: The data plane may carry the steady state of the kind (:mod:`skippy.stage.decode_relay`,
    #: when ``placement()`` puts CARRY_NEXT there): the session's next messages of the same
    #: shape, hop by hop with their replies or with direct return (a decode; a verify window,
    #: its rollbacks trimmed as auto-align trims them).
    relay: bool = False
    #: Why the kind is refused (``Handling.REFUSE``; for RETURN_OPEN: when not a return lane's open).
    refusal: str = ""

    @property
    def answered(self) -> bool:
        """Whether the upstream gets a reply (a ticket is taken on receipt)."""
        return self.answer is not Answer.NONE

    def expect(self, *, local_hit: bool = False) -> Expect | None:
        """What the downstream reply to this kind's forwarded frame means (None: no reply).

        Args:
            local_hit: a TryRestorePrefillDecode that hit on this stage (forwarded as a decode).
        """
        if self.credit:
            return Expect.ABSORB_ACK
        if self.handling is Handling.STOP:
            return Expect.STOP_ACK
        if self.answer is Answer.NONE:
            return None
        if self.answer is Answer.PREDICTION:
            return Expect.RELAY_PREDICTION
        if self.answer is Answer.PREDICTION_OR_ACK and local_hit:
            return Expect.RELAY_EITHER
        return Expect.RELAY_ACK


_DECODE: Final = KindRule(Handling.EXECUTE, Answer.PREDICTION, auto_align=True, write_through_down=True,
                          write_through_up=True, direct_return=True)
_PREFIX: Final = KindRule(Handling.PREFIX_CONTROL, Answer.ACK, checks_header=False)

#: The per-kind rules, one row per kind (see the module header; protocol.md §3 for the kinds).
RULES: Final[Mapping[MessageKind, KindRule]] = {
    MessageKind.PREFILL_EMBD: KindRule(Handling.EXECUTE, Answer.ACK, early_ack=True, credit=True,
                                       outputs=Outputs.NONE, prefill=True),
    MessageKind.PREFILL_FINAL_EMBD: KindRule(Handling.EXECUTE, Answer.PREDICTION, direct_return=True, prefill=True),
    MessageKind.DECODE_EMBD: dataclasses.replace(_DECODE, decode_run=True, relay=True),
    MessageKind.DECODE_READOUT: _DECODE,
    MessageKind.DECODE_LIGHT_CTX: _DECODE,
    MessageKind.DECODE_REPLAY_EMBD: KindRule(Handling.EXECUTE, Answer.ACK, outputs=Outputs.NONE,
                                             write_through_down=True),
    MessageKind.DECODE_REPLAY_FINAL_EMBD: KindRule(Handling.EXECUTE, Answer.PREDICTION, write_through_down=True,
                                                   direct_return=True),
    MessageKind.VERIFY_WINDOW: KindRule(Handling.EXECUTE, Answer.PREDICTION, auto_align=True, outputs=Outputs.ALL,
                                        window=True, write_through_down=True, direct_return=True, relay=True),
    MessageKind.STOP: KindRule(Handling.STOP, Answer.ACK, checks_header=False),
    MessageKind.TRIM_SESSION: KindRule(Handling.TRIM, Answer.ACK, checks_header=False),
    MessageKind.CONFIGURE_GENERATION: KindRule(Handling.CONFIGURE, Answer.ACK, checks_header=False),
    MessageKind.RETIRE_VERIFY_WINDOW: KindRule(Handling.RETIRE, Answer.NONE, checks_header=False),
    MessageKind.PROBE_PREFILL: _PREFIX,
    MessageKind.RESTORE_PREFILL: _PREFIX,
    MessageKind.TRY_RESTORE_PREFILL: _PREFIX,
    MessageKind.TRY_RESTORE_PREFILL_DECODE: KindRule(Handling.PREFIX_CONTROL, Answer.PREDICTION_OR_ACK,
                                                     checks_header=False),
    MessageKind.STATE_IMPORT: KindRule(
        Handling.REFUSE, Answer.NONE, refusal="binary state import is no longer supported by the skippy runtime ABI"),
    MessageKind.STATE_EXPORT: KindRule(
        Handling.REFUSE, Answer.NONE, refusal="binary state export is no longer supported by the skippy runtime ABI"),
    MessageKind.PREDICTION_RETURN_OPEN: KindRule(
        Handling.RETURN_OPEN, Answer.ACK, checks_header=False,
        refusal="a PredictionReturnOpen is served only as the first message of a lane, with the skippy "
                "direct-return flag (docs/protocol.md §8)"),
}

#: (kind, phase, flags) headers already checked and accepted, with their kind and rule, shared by
#: every lane (the per-token path: one dict lookup, plain ints as the key: an IntEnum hashes
#: through Python code).
_ACCEPTED_HEADERS: dict[tuple[int, int, int], tuple[MessageKind, KindRule, bool]] = {}
#: Bound on that cache: a peer could vary the flag bits at will.
_ACCEPTED_HEADERS_LIMIT: Final = 256
#: Session keys: the lane's id above the session id's 64 bits.
_KEY_BITS: Final = 64


@dataclasses.dataclass(slots=True, eq=False)
class Ticket:
    """One upstream reply's place in message order (filled by whichever step produces it)."""

    kind: MessageKind
    reply: StageReply | None = None
    #: The extension Timings frame written just before the reply (negotiated lanes only).
    timings: TimingsFrame | None = None
    #: docs/protocol.md §10: SamplingAccepted / Logprobs frames written before the reply.
    annotations: tuple[Annotation, ...] = ()
    #: docs/protocol.md §11: the decode run this message is a step of (None: not a run's).
    run: DecodeRun | None = None


@dataclasses.dataclass(slots=True, eq=False)
class Forward:
    """A frame on its way downstream, what its reply means, and the timings the relay reports."""

    message: StageMessage
    expect: Expect | None
    ticket: Ticket | None
    session: int
    received_us: int
    enqueued_at: float
    compute_us: int = 0
    queue_us: int = 0
    batch_size: int = 0
    sent_us: int = 0
    write_us: int = 0
    frame_bytes: int = 0
    #: docs/protocol.md §8: a direct-return message (in flight until this frame is written).
    direct: bool = False
    #: Turns the downstream reply's stats into this stage's reply stats (prefix-cache control).
    on_reply: Callable[[ReplyStats], Awaitable[ReplyStats]] | None = None


# The two per-message actions are NamedTuples rather than frozen dataclasses: as immutable, but a
# frozen dataclass's __init__ costs ~1.7 us (one object.__setattr__ per field) against ~0.4 us,
# and every stage builds one of each per message on the decode path.
@final
class Dispatch(NamedTuple):
    """Action for a received message: handle it by ``rule``; ``ticket`` is its reply's place."""

    message: StageMessage
    kind: MessageKind
    rule: KindRule
    ticket: Ticket | None
    #: The early ACK is due now (reply it on ``ticket`` before handling the message).
    early_ack: bool
    #: The authoritative position to auto-align the session to (None: no alignment).
    align_to: int | None
    #: docs/protocol.md §8: the prediction goes over the session's return lane (no ticket).
    direct: bool = False
    #: The session's stage-wide key: the lane's id above the session id's 64 bits (a lane's
    #: close releases only its own sessions).
    key: int = 0


@final
@dataclasses.dataclass(frozen=True, slots=True)
class SendDownstream:
    """Action after a stage's own part: forward the message; its reply means ``expect``."""

    expect: Expect | None


@final
@dataclasses.dataclass(frozen=True, slots=True)
class ReplyUpstream:
    """Action after the final stage's part: answer the ticket (``answer``: ACK or PREDICTION), or
    with ``direct``, send the prediction over the session's return lane (there is no ticket)."""

    answer: Answer
    window: bool = False
    direct: bool = False


@final
class Relay(NamedTuple):
    """Action for a downstream reply: ``absorb`` it (credit returned, stats kept), or relay it on
    ``forward.ticket`` (``release`` the session first; ``prediction``: relay the predicted reply
    itself with this stage's timings, else an ACK)."""

    forward: Forward
    absorb: bool = False
    release: bool = False
    prediction: bool = False


_SEND_BY_EXPECT: Final = {expect: SendDownstream(expect) for expect in (*Expect, None)}
_REPLY_ACK: Final = ReplyUpstream(Answer.ACK)
_REPLY_PREDICTION: Final = ReplyUpstream(Answer.PREDICTION)
_REPLY_WINDOW: Final = ReplyUpstream(Answer.PREDICTION, window=True)
_REPLY_DIRECT: Final = ReplyUpstream(Answer.PREDICTION, direct=True)
_REPLY_DIRECT_WINDOW: Final = ReplyUpstream(Answer.PREDICTION, window=True, direct=True)


def rule_for(message: StageMessage) -> tuple[MessageKind, KindRule, bool]:
    """The kind and rule of ``message``, its header checked against the kind, and whether it takes
    the direct-return path (docs/protocol.md §8: a ``direct_return`` row and the flag).

    Raises:
        UnsupportedKind: a kind this stage does not serve.
        InvalidMessage: the state header does not match the kind.
    """
    state = message.state
    header = (int(message.kind), int(state.phase), int(state.flags))
    accepted = _ACCEPTED_HEADERS.get(header)
    if accepted is not None:  # the per-token path
        return accepted
    kind = MessageKind(message.kind)
    rule = RULES[kind]
    if rule.handling is Handling.REFUSE:
        raise UnsupportedKind(f"{kind.reference_name} refused: {rule.refusal}")
    if rule.checks_header and not state.matches_kind(kind):
        raise InvalidMessage(
            f"binary stage state does not match message kind {kind.reference_name} "
            f"(phase {state.phase}, flags {state.flags:#x})"
        )
    accepted = kind, rule, rule.direct_return and bool(state.flags & DIRECT_RETURN_FLAG)
    # a return lane's open is never cached: the lane's own state decides it (LaneProtocol._lane_rule)
    if len(_ACCEPTED_HEADERS) < _ACCEPTED_HEADERS_LIMIT and rule.handling is not Handling.RETURN_OPEN:
        _ACCEPTED_HEADERS[header] = accepted
    return accepted


class LaneProtocol:
    """The rules of one upstream lane (see the module header for the events and actions).

    Args:
        credit_limit: credited frames allowed unacknowledged downstream (>= 1).
        reply_limit: replies that may wait to be written before receiving pauses (>= 1).
    """

    __slots__ = ("credit_limit", "reply_limit", "credits_in_use", "extensions", "_expected", "_tickets", "_writing",
                 "pending_stats", "inflight", "_chain_lane", "return_lane", "lane_id")

    def __init__(self, credit_limit: int, reply_limit: int = 16, *, lane_id: int = 0) -> None:
        if credit_limit < 1:
            raise ValueError(f"credit_limit must be >= 1 (got {credit_limit})")
        if reply_limit < 1:
            raise ValueError(f"reply_limit must be >= 1 (got {reply_limit})")
        self.credit_limit = credit_limit
        self.reply_limit = reply_limit
        self.credits_in_use = 0
        #: docs/protocol.md §2: whether this upstream flagged its messages (Error / Timings allowed).
        self.extensions = ExtensionNegotiation()
        #: Forwarded frames whose downstream reply has not been read, in write order.
        self._expected: collections.deque[Forward] = collections.deque()
        #: Tickets not yet written, in message order.
        self._tickets: collections.deque[Ticket] = collections.deque()
        #: Someone holds the writer token (a write of due replies is under way).
        self._writing = False
        #: Stats of absorbed ACKs and of this stage's own notes, for the next reply upstream.
        self.pending_stats: ReplyStats = EMPTY_REPLY_STATS
        #: Messages received whose reply has not been written yet (0: the lane is idle).
        self.inflight = 0
        #: A message other than a return lane's open arrived: this lane is a chain lane.
        self._chain_lane = False
        #: docs/protocol.md §8: the lane opened as a return lane (nothing more may arrive on it).
        self.return_lane = False
        #: The stage's number for the lane: the upper bits of its sessions' keys.
        self.lane_id = lane_id

    # -- upstream: messages in ------------------------------------------------------------------
    @property
    def receiving_paused(self) -> bool:
        """Too many replies wait to be written: read no further message until some are (the
        upstream that does not read its replies is held back, not buffered for)."""
        return self.inflight >= self.reply_limit

    def message_received(self, message: StageMessage) -> Dispatch:
        """A decoded message arrived from upstream.

        Raises:
            UnsupportedKind / InvalidMessage: the message is refused (the lane closes).
        """
        extensions = self.extensions
        if not extensions.enabled:
            extensions.observe(message)
        state = message.state
        accepted = _ACCEPTED_HEADERS.get((int(message.kind), int(state.phase), int(state.flags)))
        if accepted is None or not self._chain_lane:  # the per-token path skips this
            accepted = self._lane_rule(message)
        kind, rule, direct = accepted
        ticket = None
        if rule.answer is not Answer.NONE:
            self.inflight += 1  # a direct message until direct_done(), any other until its reply is written
            if not direct:
                ticket = Ticket(kind)
                self._tickets.append(ticket)
        position = message.pos_start
        return Dispatch(message, kind, rule, ticket, rule.early_ack,
                        position if rule.auto_align and position >= 0 else None, direct,
                        (self.lane_id << _KEY_BITS) | (message.session_id or 0))

    def _lane_rule(self, message: StageMessage) -> tuple[MessageKind, KindRule, bool]:
        """``rule_for`` plus the lane's own rule (docs/protocol.md §8): a return lane is opened by
        its first message, with the direct-return flag, and carries nothing else."""
        kind, rule, direct = accepted = rule_for(message)
        if self.return_lane:
            raise InvalidMessage(f"{kind.reference_name} on a return lane: a return lane carries nothing "
                                 "after its PredictionReturnOpen")
        if rule.handling is Handling.RETURN_OPEN:
            if self._chain_lane or not message.state.flags & DIRECT_RETURN_FLAG:
                raise UnsupportedKind(f"{kind.reference_name} refused: {rule.refusal}")
            self.return_lane = True
        else:
            self._chain_lane = True
        return accepted

    def computed(self, dispatch: Dispatch, *, has_downstream: bool, local_hit: bool = False,
                 forwarded: bool = True) -> SendDownstream | ReplyUpstream | None:
        """The stage's own part of ``dispatch`` is done: what comes next.

        Args:
            has_downstream: the stage forwards (not the final stage).
            local_hit: a prefix-control message hit on this stage (TryRestorePrefillDecode: the
                reply is a prediction; on the final stage, its own).
            forwarded: False when the stage's part decided not to forward (a prefix-control miss).

        Returns:
            SendDownstream, ReplyUpstream, or None when nothing is left to do (early-ACKed on
            the final stage, or a message that is not answered).
        """
        rule = dispatch.rule
        if dispatch.direct:  # docs/protocol.md §8: the final stage answers on the return lane
            if has_downstream:
                return _SEND_BY_EXPECT[None]
            return _REPLY_DIRECT_WINDOW if rule.window else _REPLY_DIRECT
        if has_downstream and forwarded:
            return _SEND_BY_EXPECT[rule.expect(local_hit=local_hit)]
        if dispatch.early_ack or dispatch.ticket is None:
            return None
        if rule.answer is Answer.PREDICTION or (rule.answer is Answer.PREDICTION_OR_ACK and local_hit):
            return _REPLY_WINDOW if rule.window else _REPLY_PREDICTION
        return _REPLY_ACK

    # -- upstream: replies out ------------------------------------------------------------------
    def reply_ready(self, ticket: Ticket, reply: StageReply, timings: TimingsFrame | None = None,
                    annotations: tuple[Annotation, ...] = ()) -> list[Ticket]:
        """``ticket``'s reply exists; returns the tickets now due, to be written in this order by
        the caller (then :meth:`replies_written`), or [] when someone else writes them."""
        if ticket.reply is not None:
            raise RuntimeError(f"{ticket.kind.reference_name} answered twice")
        ticket.reply = reply
        ticket.timings = timings
        if annotations:
            ticket.annotations = annotations
        return self._due()

    def replies_written(self, count: int) -> list[Ticket]:
        """The caller wrote the ``count`` replies it was given; returns the next ones due."""
        if not self._writing:
            raise RuntimeError("replies written without the writer token")
        self._writing = False
        self.inflight -= count
        return self._due()

    def claim_reply_write(self, ticket: Ticket) -> bool:
        """Hand the writer token to a write of ``ticket``'s reply made elsewhere (write-through).

        True when ``ticket`` is next in line and nobody is writing: the ticket leaves the queue and
        the claimer must call ``replies_written(1)`` once its reply is out (or the lane fails).
        """
        if self._writing or not self._tickets or self._tickets[0] is not ticket:
            return False
        self._tickets.popleft()
        self._writing = True
        return True

    def _due(self) -> list[Ticket]:
        tickets = self._tickets
        if self._writing or not tickets or tickets[0].reply is None:
            return []
        due = [tickets.popleft()]
        while tickets and tickets[0].reply is not None:
            due.append(tickets.popleft())
        self._writing = True
        return due

    def direct_done(self) -> None:
        """A direct-return message left this stage (forwarded, or its prediction written into the
        return lane): it is no longer in flight here (docs/protocol.md §8)."""
        self.inflight -= 1

    def stash_stats(self, stats: ReplyStats) -> None:
        """Keep ``stats`` for the next reply upstream (this stage's notes, absorbed ACKs)."""
        self.pending_stats = self.pending_stats.merge(stats)

    def take_stats(self) -> ReplyStats:
        """The stats kept for the next reply upstream (and forget them)."""
        stats, self.pending_stats = self.pending_stats, EMPTY_REPLY_STATS
        return stats

    def absorbed(self, forward: Forward, reply: StageReply, wait_us: int) -> None:
        """An early-ACKed chunk's downstream ACK (``Relay.absorb``): its stats, and this edge's
        transport (the frame's write, ``wait_us`` for the ACK, its size), are kept for the next
        reply upstream; its credit is back already (:meth:`downstream_replied` counted it)."""
        self.pending_stats = self.pending_stats.merge(reply.stats).observe_prefill_edge_transport(
            forward.message.state.source_stage_index, forward.write_us, wait_us, forward.frame_bytes)

    # -- downstream -----------------------------------------------------------------------------
    @property
    def expecting(self) -> bool:
        """Whether a forwarded frame's reply is still to be read."""
        return bool(self._expected)

    def take_credit(self) -> bool:
        """Take a reply credit for a credited frame; False when all are in use (wait for a
        downstream ACK, then ask again)."""
        if self.credits_in_use >= self.credit_limit:
            return False
        self.credits_in_use += 1
        return True

    def frame_forwarding(self, forward: Forward) -> None:
        """``forward``'s frame is about to be written: its reply must find it (write order)."""
        if forward.expect is not None:
            self._expected.append(forward)

    def downstream_replied(self, reply: StageReply, downstream: str) -> Relay:
        """A reply arrived from the downstream stage (named ``downstream`` in errors).

        Raises:
            DownstreamLost: a reply with no frame outstanding, or of the wrong kind.
        """
        if not self._expected:
            raise DownstreamLost(
                f"downstream stage {downstream} sent {ReplyKind(reply.kind).reference_name} with no frame outstanding"
            )
        forward = self._expected.popleft()
        expect = forward.expect
        kind = reply.kind
        if expect is Expect.RELAY_PREDICTION:
            if kind != ReplyKind.PREDICTED_TOKEN and kind != ReplyKind.PREDICTED_TOKENS:
                raise DownstreamLost(
                    f"downstream stage {downstream} answered {ReplyKind(kind).reference_name} to "
                    f"{MessageKind(forward.message.kind).reference_name}; expected a prediction"
                )
            return Relay(forward, prediction=True)
        if kind != ReplyKind.ACK and not (expect is Expect.RELAY_EITHER and kind == ReplyKind.PREDICTED_TOKEN):
            raise DownstreamLost(
                f"downstream stage {downstream} answered {ReplyKind(kind).reference_name} to "
                f"{MessageKind(forward.message.kind).reference_name}; expected downstream ACK"
            )
        if expect is Expect.ABSORB_ACK:
            self.credits_in_use -= 1
            return Relay(forward, absorb=True)
        return Relay(forward, release=expect is Expect.STOP_ACK, prediction=kind == ReplyKind.PREDICTED_TOKEN)


class StageLane(LaneProtocol):
    """All of one upstream lane's state: the rules above (tickets, credits, the writer token) plus
    the sessions it holds and its quota, its decode runs (§11) and their pending steps, the
    backlogs of its compute and forward tasks, the data plane's template, the identity flags of
    §9 and the direct-return timing totals (§8).  Who performs each step is
    :func:`skippy.lane.placement.placement`'s to say.

    Args:
        lane_id: the stage's number for the lane (session keys are namespaced by it).
        credit_limit / reply_limit: as :class:`~skippy.lane.protocol.LaneProtocol`.
        session_quota: sessions the lane may hold (0: no quota).
        peer: the upstream's address, for refusals.
    """

    __slots__ = ("session_quota", "peer", "sessions", "compute_backlog", "forward_backlog", "runs",
                 "run_steps", "relay_frame", "relay_lane", "relay_kinds", "lane_used", "identity_aware",
                 "direct_timings", "forwarding_done")

    def __init__(self, lane_id: int, credit_limit: int, reply_limit: int = 16, *, session_quota: int = 0,
                 peer: str = "") -> None:
        super().__init__(credit_limit, reply_limit, lane_id=lane_id)
        self.session_quota = session_quota
        self.peer = peer
        #: Session keys this lane opened (released when it closes).
        self.sessions: set[int] = set()
        #: Messages handed to the compute task and not finished; frames handed to the forwarder
        #: and not yet written (0: the task is idle, nothing queued).
        self.compute_backlog = 0
        self.forward_backlog = 0
        #: §11: the decode runs this lane drives, by session id, and their next steps waiting
        #: for the compute task (taken before its channel): (dispatch, received_us, held bytes).
        self.runs: dict[int, DecodeRun] = {}
        self.run_steps: collections.deque[tuple[Dispatch, int, int]] = collections.deque()
        #: The data plane's template: the frame (or, on the final stage, the reply) the last
        #: direct-return decode went out as, and the return lane it went into (final stage).
        self.relay_frame: bytes | None = None
        self.relay_lane: object | None = None
        #: The data plane's last plan of each kind (a decode's, a verify window's: False / True),
        #: for one session: a run carries both kinds interleaved (skippy.stage.decode_relay).
        self.relay_kinds: dict[bool, object] = {}
        #: §9: a message came (an identity query is only a lane's first), and the upstream
        #: flags bit 12 (it is sent MODEL_MISMATCH rather than STATE_MISMATCH).
        self.lane_used = False
        self.identity_aware = False
        #: §8: the direct-return messages' timing totals, per session (the Stop ACK's Timings).
        self.direct_timings = DirectTimings()
        #: The forwarder ended (no frame will be written downstream any more).
        self.forwarding_done = False

    # -- sessions -------------------------------------------------------------------------------
    def key_of(self, session_id: int) -> int:
        """The stage-wide key of this lane's ``session_id`` (a lane's close releases only its own)."""
        return (self.lane_id << _KEY_BITS) | (session_id or 0)

    def claim(self, key: int) -> None:
        """Count session ``key`` as this lane's.

        Raises:
            Overloaded: a new session beyond the lane's quota.
        """
        sessions = self.sessions
        if key not in sessions:
            quota = self.session_quota
            if quota and len(sessions) >= quota:
                raise Overloaded(f"lane from {self.peer} already holds {len(sessions)} sessions, its quota "
                                 f"(--session-quota {quota}); session {key & ((1 << _KEY_BITS) - 1)} refused")
            sessions.add(key)

    def has_session(self, session_id: int) -> bool:
        """Whether ``session_id`` is open on this chain lane (a return lane holds none)."""
        return not self.return_lane and self.key_of(session_id) in self.sessions

    # -- upstream: messages in (the lane's events) ------------------------------------------------
    def received(self, message: StageMessage, *, run_flagged: bool, is_first: bool
                 ) -> tuple[Dispatch | None, DecodeRun | None]:
        """A decoded message arrived: its dispatch, and the decode run it starts if it is a run's
        flagged first step; (None, None) for an identity query arriving as the lane's first
        message (§9: the lane answers the Identity frame and closes).  Any message for a session
        ends that session's run.

        Raises:
            UnsupportedKind / InvalidMessage: the message is refused (the lane closes).
        """
        if message.state.flags & MODEL_IDENTITY_FLAG:
            self.identity_aware = True  # §9: it understands MODEL_MISMATCH
            if not self.lane_used and is_identity_query(message):
                return None, None
        self.lane_used = True
        dispatch = self.message_received(message)
        if self.runs:
            run = self.runs.pop(message.session_id, None)
            if run is not None:
                run.cancelled = True
        if not run_flagged:
            return dispatch, None
        return self._start_run(dispatch, is_first=is_first)

    def _start_run(self, dispatch: Dispatch, *, is_first: bool) -> tuple[Dispatch, DecodeRun]:
        """§11: register the run a flagged DecodeEmbd starts; its first step is the message
        without the flag and its metadata.

        Raises:
            InvalidMessage: the flag on another kind, on a lane that did not negotiate the
                extensions, with direct return, on a stage that is not first, or a bad run section.
        """
        message = dispatch.message
        where = f"{dispatch.kind.reference_name} with the decode-run flag (docs/protocol.md §11)"
        if not dispatch.rule.decode_run:
            raise InvalidMessage(f"{where}: a decode run starts with a DecodeEmbd only")
        if not self.extensions.enabled:
            raise InvalidMessage(f"{where}: the lane did not negotiate skippy's extensions (state flag bit 10)")
        if dispatch.direct:
            raise InvalidMessage(f"{where}: a decode run cannot also ask for direct return")
        if not is_first:
            raise InvalidMessage(f"{where}: only the chain's first stage runs a decode loop")
        try:
            request = DecodeRunRequest.from_metadata(message.chat_sampling_metadata)
        except ValueError as exc:
            raise InvalidMessage(f"{where} refused: {exc}") from None
        assert dispatch.ticket is not None
        run = DecodeRun(message, request)
        self.runs[message.session_id] = run
        dispatch.ticket.run = run
        return dispatch._replace(message=run.first_message(message)), run

    def run_predicted(self, ticket: Ticket, token: int, received_us: int) -> tuple[bool, Dispatch | None]:
        """§11: a run's step predicted ``token`` (its reply is about to be answered).  Returns
        whether this is the run's first reply (it announces the run) and the next step's
        dispatch, queued in :attr:`run_steps` for the compute task (None: the run is over)."""
        run = ticket.run
        assert run is not None
        message = run.advance(token)
        step = None
        if message is None:
            if self.runs.get(run.session_id) is run:
                del self.runs[run.session_id]
        else:
            step = self.message_received(message)
            assert step.ticket is not None
            step.ticket.run = run
            self.compute_backlog += 1
            self.run_steps.append((step, received_us, 0))
        first = not run.announced
        run.announced = True
        return first, step

    def run_handover(self, ticket: Ticket, token: int) -> StageMessage | None:
        """§11, the data plane drives the run (a one-stage chain): ``ticket``'s step predicted
        ``token`` and its reply is out; the next step's message, which the lane does not queue
        (:meth:`run_carried` says what the data plane did with it), or None when the run is over."""
        run = ticket.run
        assert run is not None
        run.announced = True
        message = run.advance(token)
        if message is None and self.runs.get(run.session_id) is run:
            del self.runs[run.session_id]
        return message

    def run_alone(self, run: DecodeRun) -> bool:
        """Nothing on the lane but ``run`` (its step being handled, counted in the compute
        backlog, the caller's): nothing else queued, in flight or being written, no other run, no
        stats pending for the next reply (the data plane's replies carry none)."""
        return (self.compute_backlog == 1 and not self.run_steps
                and not (self.forward_backlog or self.inflight or self.expecting or self._writing
                         or self.credits_in_use)
                and len(self.runs) == 1 and self.runs.get(run.session_id) is run
                and self.pending_stats == EMPTY_REPLY_STATS)

    def run_carried(self, run: DecodeRun, message: StageMessage, steps: int, token: int, over: bool
                    ) -> StageMessage | None:
        """The data plane computed and answered ``steps`` of the run's steps from ``message`` (the
        one :meth:`run_handover` gave) on, the last predicting ``token`` (``over``: the run's last
        prediction); the step the lane's path takes next (None: the run is over or cancelled)."""
        if steps <= 0:
            return None if run.cancelled else message
        run.carried(steps - 1)
        if over:
            run.left = 0
            if self.runs.get(run.session_id) is run:
                del self.runs[run.session_id]
            return None
        message_next = run.advance(token)
        if message_next is None and self.runs.get(run.session_id) is run:
            del self.runs[run.session_id]
        return message_next

    def run_resume(self, run: DecodeRun, message: StageMessage, received_us: int) -> Dispatch:
        """The lane's path takes the run's step ``message`` (queued in :attr:`run_steps` for the
        compute task), as :meth:`run_predicted` queues one."""
        step = self.message_received(message)
        assert step.ticket is not None
        step.ticket.run = run
        self.compute_backlog += 1
        self.run_steps.append((step, received_us, 0))
        return step

    def end_runs(self) -> None:
        """The upstream ended: no run starts another step."""
        for run in self.runs.values():
            run.cancelled = True
        self.runs.clear()

    # -- direct return (§8) -------------------------------------------------------------------------
    def direct_written(self, forward: Forward, template: bytes | None = None) -> None:
        """A direct-return frame is written downstream: it is out of this stage (no longer in
        flight), its timings count toward the session's Stop ACK, and ``template`` (the frame as
        written, when the data plane may carry the session's next decodes) is the relay's."""
        self.direct_timings.add(forward.session, compute_us=forward.compute_us, write_us=forward.write_us,
                                queue_us=forward.queue_us, batch_size=forward.batch_size)
        if template is not None:
            self.relay_frame = template
        self.direct_done()

    def take_template(self, message: StageMessage) -> tuple[bytes | None, object | None]:
        """The data plane's template and its return lane (final stage), taken (set again by the
        next message the lane handles itself), after ``message`` (a run then carries messages of
        its kind, a verify window's of any rows, and of the kind of :attr:`relay_kinds`' other
        plan: the driver's windows change size and alternate with decodes)."""
        frame, lane = self.relay_frame, self.relay_lane
        self.relay_frame = self.relay_lane = None
        return frame, lane

    # -- placement ------------------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """Nothing queued, in flight, expected from downstream or running on the lane."""
        return not (self.compute_backlog or self.forward_backlog or self.runs or self.inflight or self.expecting)

    def adoptable(self, key: int) -> bool:
        """Whether a data-plane run of session ``key`` may take over what is in flight on the lane
        (hop by hop, a pipelining upstream always has something in flight): nothing queued to
        compute or forward, no decode run, nobody writing replies, no credit taken, no stats
        pending for the next reply, and every message in flight one of ``key``'s forwarded
        downstream, of a kind whose rule has ``relay``, its prediction expected back in order on
        its ticket, which is next in line (so the run answers them first, in order)."""
        expected, tickets = self._expected, self._tickets
        if (self.compute_backlog or self.forward_backlog or self.runs or self._writing or self.credits_in_use
                or not expected or len(expected) != len(tickets) or self.inflight != len(tickets)
                or self.pending_stats != EMPTY_REPLY_STATS):
            return False
        for forward, ticket in zip(expected, tickets):
            if (forward.ticket is not ticket or forward.expect is not Expect.RELAY_PREDICTION or forward.direct
                    or forward.session != key or forward.on_reply is not None or ticket.reply is not None
                    or ticket.run is not None or not RULES[ticket.kind].relay):
                return False
        return True

    def hand_over(self, key: int) -> tuple[Forward, ...] | None:
        """A data-plane run of session ``key`` starts: the messages in flight it takes over (oldest
        first; () on a quiet lane), which leave the lane's reply order until :meth:`adopted_answered`
        and :meth:`take_back` say what became of them; None when it may take nothing over (the run
        does not start)."""
        if self.quiet:
            return ()
        if not self.adoptable(key):
            return None
        forwards = tuple(self._expected)
        self._expected.clear()
        self._tickets.clear()
        return forwards

    def adopted_answered(self, count: int) -> None:
        """The run answered the oldest ``count`` messages it took over (their replies are written)."""
        self.inflight -= count

    def take_back(self, forwards: tuple[Forward, ...]) -> None:
        """The run ended with ``forwards`` (taken over, not answered: the oldest in flight) still
        in flight: their replies come back to the lane, in order, before anything else."""
        if self._expected or self._tickets:
            raise RuntimeError("messages taken back behind others: the run's hand-back is out of order")
        for forward in forwards:
            self._expected.append(forward)
            self._tickets.append(forward.ticket)  # type: ignore[arg-type]

    def reply_next(self, ticket: Ticket | None) -> bool:
        """Whether ``ticket``'s reply is next in line with the writer token free (a write made
        elsewhere may then claim it: :meth:`claim_reply_write`)."""
        return ticket is not None and not self._writing and bool(self._tickets) and self._tickets[0] is ticket
