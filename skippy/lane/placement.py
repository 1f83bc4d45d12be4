"""Who performs each step of a lane's message: a shortcut is a placement, not a path.

Strategy: every step a message may take has one performer, chosen by :func:`placement` from the
step, the kind's rule and a :class:`Facts` snapshot (the stage's switches, its streams, the
lane's backlogs).  The lane's state lives in :class:`skippy.lane.protocol.StageLane`; the
connection (:mod:`skippy.stage.connection`) gathers the facts and does what the answer says.

==============  ==========================================================================
step            performers
==============  ==========================================================================
HANDLE          RECEIVING_TASK (inline hand-off: nothing queued to compute), COMPUTE_TASK
WRITE_DOWN      RUNTIME_THREAD (write-through, chosen before compute), HANDLING_TASK
                (inline: the forwarder is idle), FORWARD_TASK
WRITE_UP        RUNTIME_THREAD (write-through of a lone PredictedToken), HANDLING_TASK
                (whichever task holds the writer token; a direct reply: into the return lane)
CARRY_NEXT      DATA_PLANE (the ``nogil`` decode relay carries the session's next messages
                of a kind whose rule has ``relay``, decodes or verify windows of the same
                rows, rollbacks trimmed: hop by hop with their replies, or with direct
                return), NOBODY (the lane reads on)
==============  ==========================================================================

Each placement produces the same bytes on every boundary as the plain one (all switches off:
COMPUTE_TASK, FORWARD_TASK, HANDLING_TASK, NOBODY): ``tests/test_placements.py`` runs every
combination on every path and compares the bytes of every boundary, and
``tests/test_lane_rules.py`` enumerates every (step, rule, facts) and checks the invariants below.

Invariants :func:`placement` keeps (one writer per stream, frame order, credits):

* a stream is written by a shortcut only when nothing is queued for it (``forward_idle``; the
  writer token for upstream replies);
* a credited frame (an early-ACKed prefill chunk) is always written by the forwarder, which
  waits for its credit;
* an early-ACKed message is never handled on the receiving task (receiving must run ahead);
* the runtime thread and the data plane write only plain sockets with no simulated delay;
* the data plane starts only on a quiet lane, or hop by hop on one whose messages in flight it
  takes over (``adoptable``: forwarded, their predictions expected in order, nothing else queued,
  nobody writing replies; a pipelining upstream always has one in flight), so it is the one
  reader and writer of both streams while it runs and answers every reply in message order.
"""

from __future__ import annotations

import enum
from typing import Final, NamedTuple, final

from skippy.lane.protocol import KindRule

__all__ = ["FACTS_READ", "Facts", "Performer", "Step", "placement"]


class Step(enum.Enum):
    """A step of a message whose performer :func:`placement` chooses."""

    HANDLE = "handle a received message"
    WRITE_DOWN = "write a forwarded frame downstream"
    WRITE_UP = "write the final stage's reply"
    CARRY_NEXT = "carry the session's next decodes or verify windows"


class Performer(enum.Enum):
    """Who performs a step."""

    RECEIVING_TASK = "receiving task"  #: the task that read the message (inline hand-off)
    COMPUTE_TASK = "compute task"  #: the lane's compute task (queued to it)
    HANDLING_TASK = "handling task"  #: the task handling the message (receiving or compute)
    FORWARD_TASK = "forward task"  #: the lane's forwarder (queued to it)
    RUNTIME_THREAD = "runtime thread"  #: write-through: written where it was computed
    DATA_PLANE = "data plane"  #: the ``nogil`` decode relay (skippy.stage._relay)
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
    #: return lane, or hop by hop the upstream) is a plain socket, open and free (no other
    #: writer holds it).
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
    #: Not quiet, but only for messages the data plane may take over (hop by hop: forwarded,
    #: their predictions expected in order, nothing else queued: ``StageLane.adoptable``).
    adoptable: bool = False
    #: The message: ACKed on receipt; its frame holds a reply credit; its prediction goes over
    #: a return lane (§8); asked before its work runs (its output may still be written where
    #: it is computed); its reply is next in line with the writer token free; the message just
    #: handled left a template the data plane can carry the next ones from (hop by hop: with
    #: its reply as relayed upstream; a decode's or a verify window's: ``StageLane.take_template``).
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
    Step.CARRY_NEXT: ("decode_relay", "template", "quiet", "adoptable", "wire_delay", "reply_delay", "upstream_socket",
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
    if (facts.decode_relay and facts.template and (facts.quiet or facts.adoptable) and not facts.wire_delay
            and not facts.reply_delay
            and facts.upstream_socket and facts.downstream_socket):
        return Performer.DATA_PLANE
    return Performer.NOBODY
