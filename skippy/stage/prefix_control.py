"""The stage's side of the prefix-cache chain protocol (docs/prefix-cache.md §6).

Strategy: :func:`handle` turns one prefix-control message (ProbePrefill 15, RestorePrefill 16,
TryRestorePrefill 17, TryRestorePrefillDecode 18) into an :class:`Outcome`: either stats to ACK
at once, or a message to forward downstream plus a callback that turns the downstream reply's
stats into this stage's reply stats.  The connection does the I/O; the executor (on the
scheduler's thread) does the cache work.

* Without the ``PREFIX_EXTENT`` state flag (a plain v11 peer), with the cache off, and for
  malformed requests (token sideband and ``token_count`` disagree), the answer is a miss ACK and
  nothing is forwarded: the driver then prefills in full, which is always correct.
* Stage *k* is ``source_stage_index + 1`` (the driver sends -1; each stage forwards with its own
  index).  A hit sets bit *k* of ``kv_hit_stage_mask``.  A stage with a downstream keeps its bit
  only if the downstream reply has bit *k+1*; otherwise it clears it (a restore also empties the
  session), so **bit 0 of the reply means every stage hit** and the driver needs no stage count.
* Probe: ``lookup`` with a hold, report the tokens cut in ``kv_imported_tokens``, forward the
  sideband truncated to the hit.  Restore: ``restore`` all or nothing, report
  ``kv_imported_tokens / pages``, forward unchanged.
* TryRestorePrefillDecode (18): the sideband is the whole prompt (``M + 1`` tokens),
  ``token_count`` 1, ``pos_start`` ``M`` (0 accepted).  :meth:`Executor.restore_decode` restores
  ``M`` all or nothing and runs the last token at ``M`` as a 1-token final prefill chunk (its
  input: the token on the first stage, the 1-row activation elsewhere).  A hit on the last stage
  is :attr:`Outcome.result` (the connection replies PredictedToken); elsewhere the activation is
  forwarded like a DecodeEmbd and the downstream reply (PredictedToken on a chain hit, a miss ACK
  otherwise) is rewritten by the same induction as a restore: no downstream bit, drop the session.
* Fork (``n`` > 1 choices): a ConfigureGeneration whose chat metadata holds ``{"skippy.fork":
  {"session": P, "length": M}}`` makes the new session hold the first ``M`` positions of session
  ``P`` of the same lane (:meth:`Executor.fork`, a KV copy that shares cells); each stage that
  forked adds ``kv_lookup_hits`` 1 and ``kv_imported_tokens`` ``M`` to the ACK, one that could not
  adds ``kv_lookup_misses`` 1, so the driver sees whether every stage did (a v11 peer adds nothing).
* Namespace: the message's chat metadata ``{"skippy.prefix_cache": {"namespace": ...}}``, else
  the one the session got from ConfigureGeneration (:func:`prefix_settings`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Awaitable, Callable

import numpy as np

from skippy.codec.protocol import MessageKind, ReplyStats, StageMessage, WireDType, activation_row_multiplier
from skippy.codec.protocol_ext import PREFIX_EXTENT_FLAG
from skippy.lane.messages import SIDEBAND_BITS, rows_from_wire, rows_to_wire, sideband_bits
from skippy.stage.executor import WorkItem, WorkResult, sampling_params
from skippy.stage.scheduler import Scheduler

#: The chat-metadata key that carries a request's cache settings.
METADATA_KEY = "skippy.prefix_cache"
#: The chat-metadata key of a ConfigureGeneration that forks a session from another one.
FORK_KEY = "skippy.fork"
#: Stage masks stop at bit 62 (protocol.md: bit i = stage i, i < 63).
_MAX_STAGE_BIT = 62

MISS = ReplyStats(kv_lookup_misses=1)
ERROR = ReplyStats(kv_lookup_misses=1, kv_lookup_errors=1)


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What the connection does with a prefix-control message."""

    stats: ReplyStats
    #: Forward this downstream and relay the reply's stats through ``on_reply`` (None: ACK now).
    forward: StageMessage | None = None
    on_reply: Callable[[ReplyStats], Awaitable[ReplyStats]] | None = None
    #: TryRestorePrefillDecode hit: the fused decode's result (on the last stage, its prediction).
    result: WorkResult | None = None


def prefix_settings(metadata: str | None) -> tuple[str | None, bool] | None:
    """(namespace, record) from chat sampling metadata; None when it says nothing about the cache."""
    if not metadata:
        return None
    try:
        data = json.loads(metadata)
    except (ValueError, RecursionError):  # free-form for other uses (or absurdly nested): not ours
        return None
    section = data.get(METADATA_KEY) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        return None
    namespace = section.get("namespace")
    return (str(namespace) if namespace is not None else None, bool(section.get("record", True)))


def fork_settings(metadata: str | None) -> tuple[int, int] | None:
    """(parent session id, length) from ConfigureGeneration's ``{"skippy.fork": {"session", "length"}}``
    (a request's ``n`` > 1 choices); None when absent or malformed (the session is then not forked,
    and the driver, seeing no fork in the ACK's stats, prefills it in full)."""
    if not metadata:
        return None
    try:
        data = json.loads(metadata)
    except ValueError:
        return None
    section = data.get(FORK_KEY) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        return None
    session, length = section.get("session"), section.get("length")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (session, length)):
        return None
    if not (0 < session <= 0xFFFFFFFF and 0 < length <= 1 << 24):
        return None
    return session, length


async def handle(scheduler: Scheduler, message: StageMessage, key: int, *, has_downstream: bool,
                 wire_dtype: WireDType) -> Outcome:
    """Serve one prefix-control message (see the module header)."""
    kind = MessageKind(message.kind)
    executor = scheduler.executor
    if not message.state.flags & PREFIX_EXTENT_FLAG or executor.cache is None:
        return Outcome(MISS)
    tokens = np.asarray(message.tokens, dtype=np.int32)
    fused = kind is MessageKind.TRY_RESTORE_PREFILL_DECODE
    if fused:
        if message.token_count != 1 or tokens.shape[0] < 2 or message.pos_start not in (0, tokens.shape[0] - 1):
            return Outcome(ERROR)
    elif tokens.shape[0] != message.token_count or tokens.shape[0] == 0 or message.pos_start > 0:
        return Outcome(ERROR)
    index = min(max(0, message.state.source_stage_index + 1), _MAX_STAGE_BIT)
    bit = 1 << index
    settings = prefix_settings(message.chat_sampling_metadata)
    namespace = settings[0] if settings is not None else None

    def outgoing(sent: np.ndarray) -> StageMessage:
        state = dataclasses.replace(message.state, source_stage_index=index, reserved=int(wire_dtype))
        return dataclasses.replace(message, state=state, tokens=sent, token_count=int(sent.shape[0]))

    if fused:
        return await _restore_decode(scheduler, message, key, tokens, bit, namespace, has_downstream, outgoing)

    if kind is MessageKind.PROBE_PREFILL:
        length = await scheduler.call(lambda: executor.probe(key, tokens, namespace))
        if length == 0:
            return Outcome(MISS)
        mine = ReplyStats(kv_lookup_hits=1, kv_imported_tokens=int(tokens.shape[0]) - length,
                          kv_hit_stage_mask=bit)
        if not has_downstream:
            return Outcome(mine)

        async def probed(reply: ReplyStats) -> ReplyStats:
            if reply.kv_hit_stage_mask & (bit << 1):
                return mine.merge(reply)
            return reply  # a stage behind missed: this stage's bit stays clear (a chain miss)

        return Outcome(mine, outgoing(tokens[:length]), probed)

    length = int(tokens.shape[0])
    restored = await scheduler.call(lambda: executor.restore(key, tokens, length, namespace))
    if restored != length:
        return Outcome(MISS)
    page_size = executor.cache.page_size
    mine = ReplyStats(kv_lookup_hits=1, kv_imported_tokens=length, kv_imported_pages=length // page_size,
                      kv_hit_stage_mask=bit)
    if not has_downstream:
        return Outcome(mine)

    return Outcome(mine, outgoing(tokens), _chain_reply(scheduler, key, bit, mine))


def _chain_reply(scheduler: Scheduler, key: int, bit: int,
                 mine: ReplyStats) -> Callable[[ReplyStats], Awaitable[ReplyStats]]:
    """A restore's ``on_reply``: keep this stage's hit only if the next stage hit, else drop it."""
    async def restored_reply(reply: ReplyStats) -> ReplyStats:
        if reply.kv_hit_stage_mask & (bit << 1):
            return mine.merge(reply)
        await scheduler.call(lambda: scheduler.executor.drop(key))  # no stage is left half-restored
        return reply.merge(MISS)

    return restored_reply


async def _restore_decode(scheduler: Scheduler, message: StageMessage, key: int, tokens: np.ndarray, bit: int,
                          namespace: str | None, has_downstream: bool,
                          outgoing: Callable[[np.ndarray], StageMessage]) -> Outcome:
    """TryRestorePrefillDecode (18) on this stage (see the module header)."""
    executor = scheduler.executor
    length = int(tokens.shape[0]) - 1
    activations = None
    if not executor.is_first:
        if message.activation is None:
            return Outcome(ERROR)
        activations = np.asarray(message.activation, dtype=np.float32)
        # a wide boundary (patch 0012): the frame's sideband flag and rows are the stage's own
        parts = activation_row_multiplier(executor.sideband_flag)
        if sideband_bits(message.state.flags) != executor.sideband_flag or activations.shape != (parts, executor.n_embd):
            return Outcome(ERROR)
        activations = rows_from_wire(activations, parts)
    item = WorkItem(session=key, positions=np.asarray([length], dtype=np.int32),
                    tokens=tokens[length:] if executor.is_first or executor.reads_tokens else None,
                    activations=activations,
                    sampling=sampling_params(message.sampling))
    result = await scheduler.call(lambda: executor.restore_decode(key, tokens, item, namespace))
    if result is None:
        return Outcome(MISS)
    page_size = executor.cache.page_size if executor.cache is not None else 1
    mine = ReplyStats(kv_lookup_hits=1, kv_imported_tokens=length, kv_imported_pages=length // page_size,
                      kv_hit_stage_mask=bit)
    if not has_downstream:
        return Outcome(mine, result=result)
    if result.activations is None:
        return Outcome(ERROR)  # unreachable: a stage with a downstream always produces activations
    forward = dataclasses.replace(outgoing(tokens), token_count=1, activation=result.activations)
    if executor.output_flag:  # a wide boundary: the sideband rows go out flagged, part by part
        state = dataclasses.replace(forward.state, flags=forward.state.flags & ~SIDEBAND_BITS | executor.output_flag)
        forward = dataclasses.replace(forward, state=state, activation=rows_to_wire(
            result.activations, activation_row_multiplier(executor.output_flag)))
    return Outcome(mine, forward, _chain_reply(scheduler, key, bit, mine), result)
