"""What a lane builds from a message: its work item, the frame it forwards, the final stage's prediction.

Strategy: pure conversions (no I/O, no runtime calls), so :mod:`skippy.stage.connection` only
moves bytes and runs tasks, and every refusal of a message's values is raised here as
:class:`~skippy.lane.errors.InvalidMessage` (``STATE_MISMATCH`` on the wire) before anything
runs.  Decoded frames carry int32 / float32 arrays already, so the per-token path converts
nothing (builtin dtypes are singletons: identity is the cheap test); the forwarded message is
built field by field (two ``dataclasses.replace`` calls per message cost more: a fields() walk
each).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import numpy.typing as npt

from skippy.codec.protocol import (
    BOUNDARY_ROWS_BITS, BOUNDARY_ROWS_FLAG, MessageKind, ReplyStats, SamplingConfig, StageMessage, StageReply,
    StateFlag, StateHeader, WireDType, activation_row_multiplier,
)
from skippy.codec.protocol_ext import REPLAY_FLAG, SKIPPY_EXTENSIONS_FLAG
from skippy.lane.errors import InvalidMessage, StageError
from skippy.lane.protocol import Dispatch
from skippy.lane.stats import timing_stats
from skippy.lane.work import WorkItem, WorkResult

__all__ = ["SIDEBAND_BITS", "final_prediction", "forwarded", "outgoing", "rows_from_wire", "rows_to_wire", "sideband_bits",
           "work_item"]

_INT32 = np.dtype(np.int32)
_FLOAT32 = np.dtype(np.float32)
#: One past the largest position an int32 holds.
_POSITION_END = 1 << 31
#: The state flags that size the activation (protocol.md §2.6, and §12's boundary rows).
SIDEBAND_BITS = int(StateFlag.RWKV7_V_FIRST_SIDEBAND | StateFlag.GEMMA3N_ALTUP_SIDEBAND
                     | StateFlag.INKLING_MTP_EMBD_SIDEBAND) | BOUNDARY_ROWS_BITS
_V11_SIDEBAND_BITS = SIDEBAND_BITS & ~BOUNDARY_ROWS_BITS


def sideband_bits(flags: int) -> int:
    """The bits of ``flags`` that size the activation: 6-8, and bit 15 with its field (§12: bits
    16-21 mean nothing without bit 15; v11 carries such an unknown bit through)."""
    return flags & (SIDEBAND_BITS if flags & BOUNDARY_ROWS_FLAG else _V11_SIDEBAND_BITS)


def rows_from_wire(activation: npt.NDArray[np.float32], parts: int) -> npt.NDArray[np.float32]:
    """A wide boundary's wire activation (each part's rows in turn: the hidden state, then the
    sideband; protocol.md §2.6) as one row per token holding every part (what the runtime takes)."""
    if parts == 1:
        return activation
    rows, width = activation.shape
    return np.ascontiguousarray(activation.reshape(parts, rows // parts, width).transpose(1, 0, 2)).reshape(
        rows // parts, parts * width)


def rows_to_wire(activations: npt.NDArray[np.float32], parts: int) -> npt.NDArray[np.float32]:
    """The inverse of :func:`rows_from_wire`: the runtime's wide rows as the wire's part-major rows."""
    if parts == 1:
        return activations
    rows, wide = activations.shape
    return np.ascontiguousarray(activations.reshape(rows, parts, wide // parts).transpose(1, 0, 2)).reshape(
        parts * rows, wide // parts)


def work_item(dispatch: Dispatch, key: int, *, is_first: bool, width: int, max_rows: int = 0,
              reads_tokens: bool = False, sideband_flag: int = 0,
              sampling: Callable[[SamplingConfig], Any] | None = None) -> WorkItem:
    """The runtime's view of an executable message (session ``key``).

    Every count the peer sent is checked against the frame's own contents (the token ids on the
    first stage, the activation elsewhere) and ``max_rows`` *before* any array is made from it,
    so a claimed ``token_count`` never sizes an allocation by itself.

    Args:
        is_first: the stage starts at layer 0 (it takes token ids, not activations).
        width: the activation width the stage takes.
        max_rows: the most rows one message may carry on this stage (its KV cells; 0: no limit).
        reads_tokens: a later stage whose layers read the token ids too (per-layer token
            embeddings): the frame must carry them beside the activation.
        sideband_flag: the state flag of the sideband the stage's architecture carries beside
            the hidden state (a wide boundary, patch 0012; 0: none): a later stage's frame must
            set exactly it, and its activation holds the rows it implies.
        sampling: turns a message's sampling section into the runtime's settings (the stage's
            ``executor.sampling_params``, raising InvalidMessage for values it cannot use); the
            lane rules never load the runtime themselves.

    Raises:
        InvalidMessage: no rows, more rows than the stage holds, no positions, a missing or
            misshapen activation, or token ids that do not match ``token_count``.
    """
    kind, message = dispatch.kind, dispatch.message
    source = message.state.source_stage_index
    if not -1 <= source < _POSITION_END - 1:  # the forwarded frame carries source + 1, an int32 >= 0
        raise InvalidMessage(f"{kind.reference_name} with source_stage_index {source}: not a stage index "
                             "(-1: from the driver)")
    wanted = 0 if is_first else sideband_flag
    got = sideband_bits(message.state.flags)
    if got != wanted:  # the activation's rows would not be this stage's
        if (got | wanted) & BOUNDARY_ROWS_FLAG:  # §12: name both widths
            raise InvalidMessage(
                f"{kind.reference_name} announces {activation_row_multiplier(got)} row(s) of n_embd per token "
                f"(state flags {got:#x}): this stage's first layer takes "
                f"{activation_row_multiplier(wanted)} (its architecture's boundary width)")
        raise InvalidMessage(
            f"{kind.reference_name} with activation sideband flags {got:#x} (Gemma3n / MTP / RWKV rows): "
            + (f"this stage's architecture carries the sideband {wanted:#x} beside the hidden state" if wanted
               else "not served by this runtime"))
    parts = activation_row_multiplier(wanted) if wanted else 1
    count = message.token_count
    if count <= 0:
        raise InvalidMessage(f"{kind.reference_name} with token_count {count}: nothing to execute")
    if 0 < max_rows < count:
        raise InvalidMessage(f"{kind.reference_name} with token_count {count}: more rows than this stage's "
                             f"{max_rows} KV cells (--ctx-size)")
    tokens = message.tokens
    if tokens.dtype is not _INT32:
        tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.shape[0] == 0 and count == 1 and message.state.current_token >= 0:
        tokens = np.asarray([message.state.current_token], dtype=np.int32)
    activations = None
    if not is_first:
        activations = message.activation
        if activations is None:
            raise InvalidMessage(
                f"{kind.reference_name} without an activation (source_stage_index "
                f"{message.state.source_stage_index}) reached a stage that does not start at layer 0"
            )
        if activations.shape != (count * parts, width):
            raise InvalidMessage(
                f"activation of shape {activations.shape} does not match token_count {count}"
                f"{f' x {parts} parts' if parts > 1 else ''} x width {width}"
            )
        if activations.dtype is not _FLOAT32:
            activations = np.asarray(activations, dtype=np.float32)
        activations = rows_from_wire(activations, parts)
        if reads_tokens and tokens.shape[0] != count:
            raise InvalidMessage(
                f"{kind.reference_name} with {tokens.shape[0]} token ids for token_count {count} reached a stage "
                "whose layers read the token ids (per-layer token embeddings)")
    elif tokens.shape[0] != count:
        raise InvalidMessage(f"{kind.reference_name}: {tokens.shape[0]} token ids for token_count {count}")
    # From here on ``count`` is backed by the frame's own rows: arrays sized by it are bounded.
    # A session's positions start at 0 and it holds at most max_rows cells, so a position at or
    # beyond max_rows is a gap no session can fill (and llama.cpp never removes a cell at
    # position 2^31-1 from a released sequence: found by the fuzz campaign).
    end = max_rows if max_rows > 0 else _POSITION_END
    positions = message.positions
    if positions.shape[0] != count:
        if message.pos_start < 0:
            raise InvalidMessage(f"{kind.reference_name} with negative pos_start {message.pos_start}")
        if message.pos_start + count > end:
            raise InvalidMessage(f"{kind.reference_name}: positions {message.pos_start}..{message.pos_start + count - 1} "
                                 f"reach beyond this stage's {end} KV cells (--ctx-size)")
        positions = np.arange(message.pos_start, message.pos_start + count, dtype=np.int32)
    else:
        if positions.dtype is not _INT32:
            positions = np.asarray(positions, dtype=np.int32)
        if count == 1:
            low = high = int(positions[0])
        else:
            low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= end:
            raise InvalidMessage(f"{kind.reference_name}: positions {low}..{high} outside this stage's "
                                 f"0..{end - 1} (--ctx-size)")
    prefill = dispatch.rule.prefill
    item = WorkItem(
        key, positions, tokens if is_first or reads_tokens else None, activations, dispatch.align_to, dispatch.rule.outputs,
        None if message.sampling is None else _sampling(sampling, message.sampling),
        tokens if prefill and tokens.shape[0] == count else None,
        prefill, kind is MessageKind.PREFILL_FINAL_EMBD,
    )
    if message.state.flags & REPLAY_FLAG and kind is MessageKind.PREFILL_EMBD:  # docs/protocol.md §14
        item.replay = True
    return item


def _sampling(convert: Callable[[SamplingConfig], Any] | None, config: SamplingConfig) -> Any:
    if convert is None:
        raise TypeError("work_item: a message with a sampling section needs the sampling converter")
    return convert(config)


def outgoing(message: StageMessage, activations: npt.NDArray[np.float32], wire_dtype: WireDType,
             sideband_flag: int = 0) -> StageMessage:
    """The message to forward: this stage's activation, the source index advanced, flagged (§2);
    with ``sideband_flag`` (a wide boundary) the activation's wide rows go out part by part."""
    state = message.state
    flags = state.flags
    if sideband_flag:
        flags = flags & ~SIDEBAND_BITS | sideband_flag
        activations = rows_to_wire(activations, activation_row_multiplier(sideband_flag))
    return StageMessage(
        kind=message.kind, pos_start=message.pos_start, token_count=message.token_count,
        state=StateHeader(
            version=state.version, seq_id=state.seq_id, phase=state.phase,
            flags=flags | SKIPPY_EXTENSIONS_FLAG, checkpoint_generation=state.checkpoint_generation,
            prompt_token_count=state.prompt_token_count, decode_step=state.decode_step,
            current_token=state.current_token, source_stage_index=state.source_stage_index + 1,
            reserved=int(wire_dtype)),
        request_id=message.request_id, session_id=message.session_id, sampling=message.sampling,
        chat_sampling_metadata=None, tokens=message.tokens, positions=message.positions,
        activation=activations, raw_bytes=message.raw_bytes,
    )


def forwarded(message: StageMessage, result: WorkResult, wire_dtype: WireDType, sideband_flag: int = 0
              ) -> StageMessage:
    """The message a stage with a downstream forwards for ``result`` (:func:`outgoing`).

    Raises:
        StageError: the runtime produced no activation (a broken invariant: INTERNAL).
    """
    if result.activations is None:
        raise StageError("stage has a downstream but produced no activation")
    return outgoing(message, result.activations, wire_dtype, sideband_flag)


def final_prediction(dispatch: Dispatch, result: WorkResult, stats: ReplyStats, *, window: bool,
                     total_us: int) -> StageReply:
    """The final stage's predicted reply: PredictedToken, or for a verify window PredictedTokens
    with the window id and the reference's verify-window stats (``total_us``: receipt to now).

    Raises:
        StageError: the runtime produced no prediction (a broken invariant: INTERNAL).
    """
    if window:
        return window_prediction(result, stats, window_id=dispatch.message.state.seq_id, total_us=total_us)
    if not result.tokens:
        raise StageError(f"{dispatch.kind.reference_name} produced no prediction")
    return StageReply.predicted_token(result.tokens[-1], stats=stats)


def window_prediction(result: WorkResult, stats: ReplyStats, *, window_id: int, total_us: int) -> StageReply:
    """The final stage's PredictedTokens for a verify window (one token per row) with the
    reference's verify-window stats: this stage's share of ``result`` and ``total_us``
    (receipt to now), one request, its tokens."""
    stats = timing_stats(stats, compute_us=result.compute_us, write_us=0, wait_us=0, total_us=total_us,
                         batch_size=result.batch_size)
    stats = dataclasses.replace(
        stats, verify_window_request_count=stats.verify_window_request_count + 1,
        verify_window_token_count=stats.verify_window_token_count + len(result.tokens),
        verify_window_max_tokens=max(stats.verify_window_max_tokens, len(result.tokens)),
    )
    return StageReply.predicted_token_vector(tuple(result.tokens), window_id=window_id, stats=stats)
