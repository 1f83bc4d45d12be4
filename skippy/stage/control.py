"""The stage's own part of each control kind, as plain functions (Stop, Retire, Trim, Configure,
prefix control), and the session release they share with the lane's relay of a Stop.

Strategy: a lane (:mod:`skippy.stage.connection`) that received a non-executable message calls
``OWN_PARTS[rule.handling](stage, dispatch, key, forward)`` and then asks its
:class:`~skippy.lane.protocol.StageLane` what comes next (``computed``).  These functions do
the stage's side (the runtime calls through the scheduler, the session table, the statistics);
they move no bytes.  :class:`StageParts` is what they work on: the stage's scheduler, settings
and counters, and the calling lane's state.  A return lane's open (§8) is the lane's upstream
half's own (:meth:`~skippy.stage.upstream.UpstreamLink.return_open`): it changes what the lane's
streams are.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Awaitable, Callable, Final

from skippy.codec.protocol import EMPTY_REPLY_STATS, ReplyStats, StageMessage
from skippy.codec.protocol_ext import SAMPLING_EXTENSION_FLAG, SAMPLING_METADATA_KEY, Annotation, SamplingRequest
from skippy.lane.errors import InvalidMessage, StageError
from skippy.lane.protocol import Dispatch, Forward, Handling, StageLane
from skippy.lane.work import WorkResult
from skippy.stage import activation_log, extensions, prefix_control
from skippy.stage.executor import sampling_params
from skippy.stage.lane import LaneSettings
from skippy.stage.scheduler import Scheduler
from skippy.stage.stats import StageStats

log = logging.getLogger("skippy.stage")

__all__ = ["OWN_PARTS", "OwnPart", "StageParts", "note_recorded", "release", "release_orphans"]


@dataclasses.dataclass(frozen=True, slots=True)
class OwnPart:
    """What a non-executable handling's own part leaves for the next step."""

    stats: ReplyStats = EMPTY_REPLY_STATS  #: merged into this stage's reply, if it answers
    result: WorkResult | None = None  #: a TryRestorePrefillDecode hit: the fused decode's result
    forwarded: bool = True  #: False: nothing to forward (a prefix-control miss)
    #: docs/protocol.md §10: frames written before this stage's own ACK (SamplingAccepted).
    annotations: tuple[Annotation, ...] = ()


NOTHING_MORE: Final = OwnPart()


@dataclasses.dataclass(frozen=True, slots=True)
class StageParts:
    """What the control functions work on: the stage's runtime queue, settings and counters, and
    the calling lane (``forwarding``: the lane has a downstream open)."""

    scheduler: Scheduler
    settings: LaneSettings
    stats: StageStats
    lane: StageLane


async def release(stage: StageParts, key: int) -> None:
    """Release session ``key`` (the lane no longer holds it)."""
    stage.lane.sessions.discard(key)
    stage.scheduler.forget(key)
    executor = stage.scheduler.executor
    if await stage.scheduler.call(lambda: executor.release(key)):
        stage.stats.sessions_released += 1
        stage.stats.touch()


async def release_orphans(stage: StageParts, lane_id: int, *, lost: bool = False) -> int:
    """The lane closes: release every session it still holds (one failing does not stop the
    others); returns how many it held.  ``lost``: the chain lost a stage, so a session whose
    driver resumes (docs/protocol.md §14) is parked for its resume instead."""
    orphans = sorted(stage.lane.sessions)
    stage.lane.sessions.clear()
    executor = stage.scheduler.executor
    for key in orphans:
        stage.scheduler.forget(key)
        try:
            if lost:
                outcome = await stage.scheduler.call(functools.partial(executor.park_or_release, key))
                released = outcome == "released"
                if outcome == "parked":
                    log.info("lane %d: session %d parked for its resume (%g s)", lane_id, key & ((1 << 64) - 1),
                             executor.parked.hold_s)
            else:
                released = await stage.scheduler.call(functools.partial(executor.release, key))
        except StageError as exc:
            log.warning("lane %d: releasing session %d failed: %s", lane_id, key & ((1 << 64) - 1), exc)
            continue
        if released:
            stage.stats.orphan_sessions_released += 1
    return len(orphans)


def note_recorded(stage: StageParts, result: WorkResult, message: StageMessage) -> None:
    """The prefix cache recorded this prompt: the next reply upstream says so."""
    if result.recorded_tokens:
        executor = stage.scheduler.executor
        page_size = executor.cache.page_size if executor.cache else 1
        index = min(max(0, message.state.source_stage_index + 1), 62)
        stage.lane.stash_stats(ReplyStats(
            kv_recorded_pages=result.recorded_tokens // page_size,
            kv_recorded_bytes=result.recorded_tokens * executor.kv_bytes_per_cell,
            kv_record_stage_mask=1 << index))


async def stop(stage: StageParts, dispatch: Dispatch, key: int, forward: Forward, *, forwarding: bool) -> OwnPart:
    if not forwarding:  # the final stage releases now; others after the downstream ACK
        await release(stage, key)
    return NOTHING_MORE


async def retire(stage: StageParts, dispatch: Dispatch, key: int, forward: Forward, *, forwarding: bool) -> OwnPart:
    message = dispatch.message
    if message.pos_start < 0 or message.token_count < 0:
        raise InvalidMessage(
            f"RetireVerifyWindow with negative position/count ({message.pos_start}, {message.token_count})")
    return NOTHING_MORE  # no checkpoints to release on this runtime; forwarded, never answered


async def trim(stage: StageParts, dispatch: Dispatch, key: int, forward: Forward, *, forwarding: bool) -> OwnPart:
    executor, length = stage.scheduler.executor, dispatch.message.token_count
    stage.stats.trimmed_tokens += await stage.scheduler.call(lambda: executor.trim(key, length))
    return NOTHING_MORE


async def configure(stage: StageParts, dispatch: Dispatch, key: int, forward: Forward, *,
                    forwarding: bool) -> OwnPart:
    scheduler, executor, message = stage.scheduler, stage.scheduler.executor, dispatch.message
    params = sampling_params(message.sampling)
    stage.lane.claim(key)
    try:
        resume = activation_log.resume_request(message.chat_sampling_metadata)
    except ValueError as exc:
        raise InvalidMessage(f"ConfigureGeneration's resume section is refused: {exc}") from exc
    if resume is not None:  # docs/protocol.md §14: adopt the parked session, or start it fresh
        held = await scheduler.call(lambda: executor.adopt(message.session_id, key, resume.length))
        log.info("resume: session %d %s", message.session_id,
                 f"adopted, holding {held} positions" if held else "not held here: the replay fills it")
    elif executor.parked and message.session_id:  # a new request with a parked session's id
        await scheduler.call(lambda: executor.release_parked(message.session_id))
    await scheduler.call(lambda: executor.configure(key, params))
    if activation_log.holds_for_resume(message.chat_sampling_metadata):
        await scheduler.call(lambda: executor.hold_for_resume(key))
    cache_settings = prefix_control.prefix_settings(message.chat_sampling_metadata)
    if cache_settings is not None and executor.cache is not None:
        await scheduler.call(lambda: executor.configure_prefix(key, *cache_settings))
    annotations: tuple[Annotation, ...] = ()
    if stage.settings.downstream is None:  # docs/protocol.md §10: the final stage's part
        flagged = bool(message.state.flags & SAMPLING_EXTENSION_FLAG)
        extension = _sampling_request(message.chat_sampling_metadata) if flagged else None
        features = await scheduler.call(lambda: executor.configure_extension(key, extension))
        if flagged:
            annotations = extensions.sampling_accepted(features)
        if resume is not None:
            await scheduler.call(lambda: executor.restore_sampler(key, resume.tokens))
    fork = prefix_control.fork_settings(message.chat_sampling_metadata)
    if fork is None:
        return OwnPart(annotations=annotations) if annotations else NOTHING_MORE
    parent = stage.lane.key_of(fork[0])
    forked = await scheduler.call(lambda: executor.fork(parent, key, fork[1]))
    own = ReplyStats(kv_lookup_hits=1, kv_imported_tokens=forked) if forked else ReplyStats(kv_lookup_misses=1)
    if forked:
        stage.stats.forked_sessions += 1
        stage.stats.forked_tokens += forked
        stage.stats.touch()

    async def add_own(stats: ReplyStats) -> ReplyStats:
        return stats.merge(own)

    forward.on_reply = add_own
    return OwnPart(own, annotations=annotations)


async def prefix(stage: StageParts, dispatch: Dispatch, key: int, forward: Forward, *, forwarding: bool) -> OwnPart:
    """docs/prefix-cache.md §6 (:mod:`skippy.stage.prefix_control`): a local miss is answered
    here; a hit is forwarded with ``on_reply`` (a TryRestorePrefillDecode hit carries its result)."""
    message = dispatch.message
    stage.lane.claim(key)
    outcome = await prefix_control.handle(stage.scheduler, message, key, has_downstream=forwarding,
                                          wire_dtype=stage.settings.wire_dtype)
    stage.stats.touch()
    result = outcome.result
    if result is not None:
        stage.stats.restore_decodes += 1
        note_recorded(stage, result, message)
        forward.compute_us, forward.batch_size = result.compute_us, result.batch_size
    if outcome.forward is not None:
        forward.message, forward.on_reply = outcome.forward, outcome.on_reply
    return OwnPart(outcome.stats, result, forwarded=outcome.forward is not None)


OwnPartFunction = Callable[..., Awaitable[OwnPart]]
#: The stage's own part of each control handling (RETURN_OPEN is the upstream half's: see the header).
OWN_PARTS: Final[dict[Handling, OwnPartFunction]] = {
    Handling.STOP: stop, Handling.RETIRE: retire, Handling.TRIM: trim, Handling.CONFIGURE: configure,
    Handling.PREFIX_CONTROL: prefix,
}


def _sampling_request(metadata: str | None) -> SamplingRequest:
    """docs/protocol.md §10: the sampling extension in a flagged ConfigureGeneration's metadata.

    Raises:
        InvalidMessage: no such section, or a malformed one (named).
    """
    try:
        data = json.loads(metadata or "")
        return SamplingRequest.from_section(data.get(SAMPLING_METADATA_KEY) if isinstance(data, dict) else None)
    except ValueError as exc:  # JSON errors and the section's own checks: refuse the configure
        raise InvalidMessage(f"ConfigureGeneration carries the sampling-extension flag but its "
                             f"{SAMPLING_METADATA_KEY} metadata is refused: {exc}") from exc
