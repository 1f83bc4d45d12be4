"""One stage lane as one machine: all of its state, and who performs each of its steps.

Strategy (h11's shape; no trio, no sockets, no runtime here): :class:`StageLane` is the lane's
:class:`~skippy.lane.protocol.LaneProtocol` (the per-kind rules, tickets, credits, the writer
token) plus everything else a lane decides with: the sessions it holds and its quota, its
decode runs (``docs/protocol.md`` §11) and their pending steps, whether it is a return lane or a
chain lane, the identity flags of §9, the backlogs of its compute and forward tasks, the decode
relay's template, and the direct-return timing totals (§8).  The connection
(:mod:`skippy.stage.connection`) moves bytes and runs tasks; at each event it calls the lane.

**A shortcut is a placement, not a path.**  Every step a message may take has one performer,
chosen by :func:`placement` from the step, the kind's rule and a :class:`Facts` snapshot (the
stage's switches, its streams, the lane's backlogs):

==============  ==========================================================================
step            performers
==============  ==========================================================================
HANDLE          RECEIVING_TASK (inline hand-off: nothing queued to compute), COMPUTE_TASK
WRITE_DOWN      RUNTIME_THREAD (write-through, chosen before compute), HANDLING_TASK
                (inline: the forwarder is idle), FORWARD_TASK
WRITE_UP        RUNTIME_THREAD (write-through of a lone PredictedToken), HANDLING_TASK
                (whichever task holds the writer token; a direct reply: into the return lane)
CARRY_NEXT      DATA_PLANE (the ``nogil`` decode relay carries the session's next decodes),
                NOBODY (the lane reads on)
==============  ==========================================================================

Each placement produces the same bytes on every boundary as the plain one (all switches off:
COMPUTE_TASK, FORWARD_TASK, HANDLING_TASK, NOBODY); ``tests/test_stage_lanes.py``
(``test_shortcuts_change_no_byte``) runs a script under every combination and compares bytes, and
``tests/test_lane_rules.py`` enumerates every (step, rule, facts) and checks the invariants below.

Invariants :func:`placement` keeps (one writer per stream, frame order, credits):

* a stream is written by a shortcut only when nothing is queued for it (``forward_idle``; the
  writer token for upstream replies);
* a credited frame (an early-ACKed prefill chunk) is always written by the forwarder, which
  waits for its credit;
* an early-ACKed message is never handled on the receiving task (receiving must run ahead);
* the runtime thread and the data plane write only plain sockets with no simulated delay.
"""

from __future__ import annotations

import collections
import enum
from typing import Final, NamedTuple, final

from skippy.lane.decode_run import DecodeRun, DecodeRunRequest
from skippy.lane.errors import InvalidMessage, Overloaded
from skippy.lane.protocol import Dispatch, KindRule, LaneProtocol, Ticket
from skippy.lane.timings import DirectTimings
from skippy.protocol import StageMessage
from skippy.protocol_ext import MODEL_IDENTITY_FLAG, is_identity_query

__all__ = ["FACTS_READ", "Facts", "Performer", "StageLane", "Step", "placement"]


class Step(enum.Enum):
    """A step of a message whose performer :func:`placement` chooses."""

    HANDLE = "handle a received message"
    WRITE_DOWN = "write a forwarded frame downstream"
    WRITE_UP = "write the final stage's reply"
    CARRY_NEXT = "carry the session's next decodes"


class Performer(enum.Enum):
    """Who performs a step."""

    RECEIVING_TASK = "receiving task"  #: the task that read the message (inline hand-off)
    COMPUTE_TASK = "compute task"  #: the lane's compute task (queued to it)
    HANDLING_TASK = "handling task"  #: the task handling the message (receiving or compute)
    FORWARD_TASK = "forward task"  #: the lane's forwarder (queued to it)
    RUNTIME_THREAD = "runtime thread"  #: write-through: written where it was computed
    DATA_PLANE = "data plane"  #: the ``nogil`` decode relay (skippy._relay)
    NOBODY = "nobody"  #: the step does not happen (CARRY_NEXT: the lane reads on)


@final
class Facts(NamedTuple):
    """What :func:`placement` decides from (a snapshot; every field a plain bool)."""

    #: The stage's switches (``LaneSettings``).
    inline_hand_offs: bool = True
    write_through: bool = True
    decode_relay: bool = True
    #: The streams: plain sockets (not TLS or memory streams), and simulated delays (benchmarks).
    upstream_socket: bool = True
    #: The stream the step writes downstream (on the final stage, for CARRY_NEXT: the session's
    #: return lane) is a plain socket, open and free (no other writer holds it).
    downstream_socket: bool = True
    wire_delay: bool = False
    reply_delay: bool = False
    #: The lane: its downstream is open (or it is the final stage), nothing is queued to its
    #: compute task, nothing to its forwarder.
    downstream_ready: bool = True
    compute_idle: bool = True
    forward_idle: bool = True
    #: Nothing queued, in flight, expected from downstream, buffered or running on the lane.
    quiet: bool = True
    #: The message: ACKed on receipt; its frame holds a reply credit; its prediction goes over
    #: a return lane (§8); asked before its work runs (its output may still be written where
    #: it is computed); its reply is next in line with the writer token free; the message just
    #: handled left a template the data plane can carry the next ones from.
    early_ack: bool = False
    credited: bool = False
    direct: bool = False
    before_compute: bool = False
    reply_next: bool = False
    template: bool = False


#: The facts each step's placement reads (the others never change its answer: tests check both).
FACTS_READ: Final[dict[Step, tuple[str, ...]]] = {
    Step.HANDLE: ("inline_hand_offs", "compute_idle", "early_ack", "downstream_ready"),
    Step.WRITE_DOWN: ("inline_hand_offs", "write_through", "before_compute", "forward_idle", "credited", "wire_delay",
                      "downstream_socket"),
    Step.WRITE_UP: ("write_through", "before_compute", "direct", "reply_next", "upstream_socket", "reply_delay"),
    Step.CARRY_NEXT: ("decode_relay", "template", "quiet", "wire_delay", "reply_delay", "upstream_socket",
                      "downstream_socket"),
}


def placement(step: Step, rule: KindRule | None, facts: Facts) -> Performer:
    """Who performs ``step`` of a message of ``rule`` (None: no kind, e.g. CARRY_NEXT) now.

    WRITE_DOWN and WRITE_UP are asked twice by an executable message: before compute
    (``before_compute``: only then may the runtime thread take the write) and, when the answer
    was not RUNTIME_THREAD, once the result exists.
    """
    if step is Step.HANDLE:
        if facts.inline_hand_offs and facts.compute_idle and not facts.early_ack and facts.downstream_ready:
            return Performer.RECEIVING_TASK
        return Performer.COMPUTE_TASK
    if step is Step.WRITE_DOWN:
        plain = not facts.wire_delay
        if (facts.before_compute and facts.write_through and rule is not None and rule.write_through_down
                and facts.forward_idle and plain and facts.downstream_socket and not facts.credited):
            return Performer.RUNTIME_THREAD
        if facts.forward_idle and not facts.credited and facts.inline_hand_offs and plain:
            return Performer.HANDLING_TASK
        return Performer.FORWARD_TASK
    if step is Step.WRITE_UP:
        if (facts.before_compute and facts.write_through and rule is not None and rule.write_through_up
                and not facts.direct and facts.reply_next and facts.upstream_socket and not facts.reply_delay):
            return Performer.RUNTIME_THREAD
        return Performer.HANDLING_TASK
    if (facts.decode_relay and facts.template and facts.quiet and not facts.wire_delay and not facts.reply_delay
            and facts.upstream_socket and facts.downstream_socket):
        return Performer.DATA_PLANE
    return Performer.NOBODY


#: Session keys: the lane's id above the session id's 64 bits.
_KEY_BITS: Final = 64


class StageLane(LaneProtocol):
    """All of one upstream lane's state (see the module header).

    Args:
        lane_id: the stage's number for the lane (session keys are namespaced by it).
        credit_limit / reply_limit: as :class:`~skippy.lane.protocol.LaneProtocol`.
        session_quota: sessions the lane may hold (0: no quota).
        peer: the upstream's address, for refusals.
    """

    __slots__ = ("lane_id", "session_quota", "peer", "sessions", "compute_backlog", "forward_backlog", "runs",
                 "run_steps", "relay_frame", "relay_lane", "lane_used", "identity_aware", "direct_timings",
                 "forwarding_done")

    def __init__(self, lane_id: int, credit_limit: int, reply_limit: int = 16, *, session_quota: int = 0,
                 peer: str = "") -> None:
        super().__init__(credit_limit, reply_limit)
        self.lane_id = lane_id
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

    # -- upstream: messages in ------------------------------------------------------------------
    def identity_query(self, message: StageMessage) -> bool:
        """§9: note the identity flag; True when ``message`` is an identity query arriving as the
        lane's first message (the lane answers it with the Identity frame and closes)."""
        if message.state.flags & MODEL_IDENTITY_FLAG:
            self.identity_aware = True
            if not self.lane_used and is_identity_query(message):
                return True
        self.lane_used = True
        return False

    def received(self, message: StageMessage, *, run_flagged: bool, is_first: bool) -> tuple[Dispatch, DecodeRun | None]:
        """A decoded message arrived: its dispatch (and the decode run it starts, if it is a
        run's flagged first step).  Any message for a session ends that session's run.

        Raises:
            UnsupportedKind / InvalidMessage: the message is refused (the lane closes).
        """
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

    def end_runs(self) -> None:
        """The upstream ended: no run starts another step."""
        for run in self.runs.values():
            run.cancelled = True
        self.runs.clear()

    # -- placement ------------------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """Nothing queued, in flight, expected from downstream or running on the lane."""
        return not (self.compute_backlog or self.forward_backlog or self.runs or self.inflight or self.expecting)

    def reply_next(self, ticket: Ticket | None) -> bool:
        """Whether ``ticket``'s reply is next in line with the writer token free (a write made
        elsewhere may then claim it: :meth:`claim_reply_write`)."""
        return ticket is not None and not self._writing and bool(self._tickets) and self._tickets[0] is ticket
