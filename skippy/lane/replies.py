"""What a lane answers upstream (pure): every reply a stage builds, in one place.

* :func:`prediction` — the final stage's predicted reply of a computed message and what precedes
  it on a negotiated lane (its Timings frame, docs/protocol.md §4: the producing stage starts it;
  its Logprobs frame, §10), whichever way it leaves (hop by hop, written through by the runtime
  thread, into a return lane); :func:`prediction_template` is the same reply as the data plane's
  template (its token and record patched per step).
* :func:`relayed` — a downstream reply answered on the forwarded message's ticket, with this
  stage's share added (its Timings record, the reference's verify-window stats; a Stop's ACK
  carries the session's direct-return totals, §8).
* :func:`own_record` — this stage's Timings record for one reply, every value clamped >= 0.

``identity`` is anything with the stage's ``index``, ``layer_start`` and ``layer_end``
(:class:`skippy.stage.extensions.StageIdentity`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from skippy.codec.protocol import EMPTY_REPLY_STATS, ReplyStats, StageReply
from skippy.codec.protocol_ext import (
    DECODE_RUN_FEATURE, Annotation, LogprobsFrame, SamplingAcceptedFrame, TimingRecord, TimingsFrame, append_timing,
)
from skippy.lane.messages import final_prediction, window_prediction
from skippy.lane.protocol import RULES, Dispatch, Relay, StageLane
from skippy.lane.stats import timing_stats
from skippy.lane.work import WorkResult

__all__ = ["RUN_ACCEPTED", "Identity", "Reply", "logprobs_annotation", "own_record", "prediction",
           "prediction_frames", "prediction_template", "relayed"]

#: docs/protocol.md §11: the frame before a decode run's first reply (the first stage runs it).
RUN_ACCEPTED: tuple[Annotation, ...] = (SamplingAcceptedFrame(DECODE_RUN_FEATURE),)

#: One upstream reply: the reply, its Timings frame (None: none), its §10 frames.
Reply = tuple[StageReply, TimingsFrame | None, tuple[Annotation, ...]]


class Identity(Protocol):
    index: int
    layer_start: int
    layer_end: int


def own_record(identity: Identity, *, batch_size: int, compute_us: int, write_us: int = 0,
               wait_us: int = 0, queue_us: int = 0) -> TimingRecord:
    """This stage's timing record for one reply (ext §4), every value clamped to >= 0."""
    return TimingRecord(
        max(identity.index, 0), identity.layer_start, identity.layer_end, max(batch_size, 0),
        max(compute_us, 0), max(write_us, 0), max(wait_us, 0), max(queue_us, 0),
    )


def logprobs_annotation(result_logprobs: object, top: int | None = None) -> tuple[Annotation, ...]:
    """The Logprobs annotation of a final-stage result (``WorkResult.logprobs``; () when none)."""
    if not result_logprobs:
        return ()
    rows = tuple(result_logprobs)  # type: ignore[call-overload]
    return (LogprobsFrame(len(rows[0].top) if top is None else top, rows),)


def prediction_frames(identity: Identity, result: WorkResult, queue_us: int, *, negotiated: bool
                      ) -> tuple[TimingsFrame | None, tuple[Annotation, ...]]:
    """What precedes the final stage's prediction of ``result`` on a lane that negotiated the
    extensions: its Timings frame and its Logprobs frame (when the session asked); (None, ())
    on a v11 lane."""
    if not negotiated:
        return None, ()
    record = own_record(identity, batch_size=result.batch_size, compute_us=result.compute_us, queue_us=queue_us)
    return TimingsFrame((record,)), logprobs_annotation(result.logprobs)


def prediction(dispatch: Dispatch, result: WorkResult, stats: ReplyStats, *, identity: Identity, queue_us: int,
               negotiated: bool, window: bool = False, total_us: int = 0) -> Reply:
    """The final stage's predicted reply of ``result`` with its frames (``total_us``: receipt to
    now, for a verify window's stats).

    Raises:
        StageError: the runtime produced no prediction (a broken invariant: INTERNAL).
    """
    reply = final_prediction(dispatch, result, stats, window=window, total_us=total_us)
    timings, annotations = prediction_frames(identity, result, queue_us, negotiated=negotiated)
    return reply, timings, annotations


def prediction_template(identity: Identity, *, negotiated: bool, rows: int = 1,
                        window: bool = False) -> tuple[StageReply, TimingsFrame | None]:
    """A plain decode's prediction (``window``: a verify window's of ``rows`` rows, nothing
    pending) as the data plane patches it (tokens 0, window id 0, zero timings)."""
    result = WorkResult(tokens=[0] * rows)
    reply = (window_prediction(result, EMPTY_REPLY_STATS, window_id=0, total_us=0) if window
             else StageReply.predicted_token(0, stats=EMPTY_REPLY_STATS))
    return reply, prediction_frames(identity, result, 0, negotiated=negotiated)[0]


def relayed(lane: StageLane, relay: Relay, reply: StageReply, stats: ReplyStats, timings: TimingsFrame | None,
            annotations: tuple[Annotation, ...], *, identity: Identity, wait_us: int, now_us: int) -> Reply:
    """The answer to ``relay``'s ticket: the downstream's ``reply`` with ``stats`` (the lane's
    pending stats merged in), this stage's share added; ``annotations`` (the downstream's §10
    frames) relayed to a negotiated upstream only (a v11 one cannot have asked for them)."""
    item = relay.forward
    negotiated = lane.extensions.enabled
    if annotations and not negotiated:
        annotations = ()
    if not relay.prediction:
        summary = None
        if relay.release:  # §8: a Stop's ACK carries the session's direct-return totals
            record = lane.direct_timings.take(item.session, stage_index=identity.index,
                                              layer_start=identity.layer_start, layer_end=identity.layer_end)
            if record is not None and negotiated:
                summary = append_timing(timings, record)
        return StageReply.ack(stats), summary, annotations
    assert item.ticket is not None
    if RULES[item.ticket.kind].window:  # the reference's verify-window stats
        stats = timing_stats(stats, compute_us=item.compute_us, write_us=item.write_us, wait_us=wait_us,
                             total_us=now_us - item.received_us, batch_size=item.batch_size)
    if negotiated:  # docs/protocol.md §4: append this stage's record
        timings = append_timing(timings, own_record(identity, batch_size=item.batch_size, compute_us=item.compute_us,
                                                    write_us=item.write_us, wait_us=wait_us, queue_us=item.queue_us))
    else:
        timings = None
    if stats is not reply.stats:  # the hot path merges nothing: keep the decoded reply
        reply = dataclasses.replace(reply, stats=stats)
    return reply, timings, annotations
