"""The synchronous half of a stage: the runtime, its session table, and batch execution.

Strategy: everything here runs on one thread at a time (the scheduler's worker thread, or inline
for the null runtime), so the session table needs no lock.  A *session* is keyed by the wire's
``session_id`` (or a per-connection key when that is 0) and owns one llama sequence id plus a
sampler (final stage).  ``run_decode_batch`` runs one single-row item per session as **one**
``decode`` call (continuous batching); ``run_item`` runs prefill chunks and verify windows alone,
split into ``n_batch`` rows so every stage of a chain uses the same micro-batch partition.
Before an item with an authoritative position executes, the session is auto-aligned: if its KV
holds more positions than the item's ``pos_start`` it is trimmed back (the v11 rollback rule); if
it holds fewer, the item is refused (a gap would silently corrupt the sequence).

Activations handed back are copies: the runtime's view is only valid until the next decode, and
the forwarder encodes them later, on the trio thread.

Prefix cache (optional ``cache``, a :class:`~skippy.cache.StageCache` over the same context): the
prefix-control kinds call :meth:`Executor.probe` / :meth:`Executor.restore` / :meth:`Executor.drop`;
after a restore the session holds ``M`` positions and its first prefill chunk starts at ``M``.
:meth:`Executor.fork` does the same from another session of the same lane (``n`` > 1 choices).
:meth:`Executor.restore_decode` (TryRestorePrefillDecode) restores ``M`` and runs the last prompt
token at ``M`` as that 1-token final chunk in the same call.
Each session accumulates the tokens its KV was computed from (restored prefix plus every prefill
chunk's token sideband, cut back at the chunk's position) and records them after the final chunk
unless the request opted out; Stop / release drops the session's probe hold.  A decode that finds
no KV slot asks the cache to give back resident cells and retries once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence, cast

import numpy as np
import numpy.typing as npt

from skippy.codec.protocol import SamplingConfig, StateFlag, activation_row_multiplier, boundary_rows_flags
from skippy.codec.protocol_ext import SamplingRequest, TokenLogprobs
from skippy.lane.errors import InvalidMessage, Overloaded, RuntimeFailure, StageError
from skippy.lane.protocol import Outputs
from skippy.lane.work import FloatArray, IntArray, WorkItem, WorkResult
from skippy.runtime.errors import KvSlotUnavailable, NativeError, RollbackRefused, SessionError
from skippy.runtime.sampling import GREEDY, GrammarDeadEnd, Sampler, SamplingParams
from skippy.stage.activation_log import DEFAULT_LOG_BYTES, ActivationLog, LogStats, ParkedSessions

if TYPE_CHECKING:
    from skippy.cache import StageCache

log = logging.getLogger("skippy.stage")

class RuntimeContext(Protocol):
    """What the executor needs of ``StageContext`` (``NullContext`` provides the same)."""

    model: Any
    n_batch: int
    n_embd: int

    def open_session(self) -> int: ...
    def close_session(self, seq: int) -> None: ...
    def decode(self, *, positions: Any, seq_ids: Any, tokens: Any = None, activations: Any = None,
               outputs: Any = None) -> None: ...
    def activations(self) -> FloatArray: ...
    def sample(self, samplers: Sequence[Sampler], rows: Sequence[int]) -> IntArray: ...
    def trim(self, seq: int, length: int) -> None: ...
    def copy(self, source: int, destination: int, start: int = -1, end: int = -1) -> None: ...
    def length(self, seq: int) -> int: ...
    def kv_cells_used(self) -> int: ...


@dataclasses.dataclass(slots=True)
class _Session:
    seq: int
    params: SamplingParams = GREEDY
    sampler: Sampler | None = None
    #: docs/protocol.md §10: the session's grammar and logprobs request (final stage).
    extension: SamplingRequest | None = None
    #: Prefix cache: tenant namespace, whether to record, and the prompt tokens so far (None:
    #: unknown, e.g. a chunk came without its token sideband: nothing is recorded).
    namespace: str | None = None
    record: bool = True
    prompt: list[int] | None = dataclasses.field(default_factory=list)
    #: docs/protocol.md §14: the driver resumes this session after a lost stage (it is parked,
    #: not released, when its lane closes on a loss).
    resumable: bool = False
    #: Adopted by a resume: a replay frame it cannot answer from the log is a recompute.
    resumed: bool = False
    #: Adopted by a resume: the length it resumed at, and the end of the positions it still
    #: holds as first computed (a recomputed replay frame cuts it back to the frame's start).
    resume_length: int = 0
    replay_valid: int = 0


def sampling_params(config: SamplingConfig | None) -> SamplingParams | None:
    """The runtime sampling settings for a wire sampling section (None when absent).

    A present but disabled section (``flags == 0``) means greedy.

    Raises:
        InvalidMessage: values the sampler cannot use (named in the message).
    """
    if config is None:
        return None
    if not config.enabled:
        return GREEDY
    top_p = config.top_p if 0.0 < config.top_p <= 1.0 else 1.0
    try:
        return SamplingParams(
            temperature=config.temperature, top_k=max(0, config.top_k), top_p=top_p,
            min_p=min(max(config.min_p, 0.0), 1.0), repeat_penalty=config.repeat_penalty,
            frequency_penalty=config.frequency_penalty, presence_penalty=config.presence_penalty,
            penalty_last_n=max(-1, config.penalty_last_n),
            logit_bias=tuple((b.token_id, b.bias) for b in config.logit_bias),
            seed=config.seed & 0xFFFFFFFF,
        )
    except ValueError as exc:  # SamplingParams validates ranges; refuse the message, naming them
        raise InvalidMessage(f"sampling section refused: {exc}") from exc


#: Largest activation magnitude a stage accepts.  Real hidden states stay many orders of magnitude
#: below it; above it the first RMS norm's sum of squares can overflow float32 (n_embd x 1e34 >
#: 3.4e38), which turns the row's K/V into inf/NaN.
ACTIVATION_LIMIT = 1e15


#: The state flag (protocol.md §2.4) that announces an architecture's stage-boundary sideband
#: (patch 0012), whose activation rows per token (§2.6) the stage's boundary rows must match.
SIDEBAND_FLAGS: dict[str, StateFlag] = {
    "rwkv7": StateFlag.RWKV7_V_FIRST_SIDEBAND,
    "arwkv7": StateFlag.RWKV7_V_FIRST_SIDEBAND,
    "gemma3n": StateFlag.GEMMA3N_ALTUP_SIDEBAND,
}


def sideband_flag(architecture: str, rows: int) -> int:
    """The state flags for a boundary of ``rows`` n_embd-wide parts per token (0 for 1 part): the
    v11 flag of an architecture that has one, else the boundary-rows extension (protocol.md §12:
    hyper-connection streams, ``hc_mult`` rows).

    Raises:
        ValueError: the architecture's v11 flag implies other rows, or ``rows`` is beyond what
            the extension announces.
    """
    if rows == 1:
        return 0
    flag = SIDEBAND_FLAGS.get(architecture)
    if flag is None:
        return boundary_rows_flags(rows)
    if activation_row_multiplier(flag) != rows:
        raise ValueError(f"{architecture}: a stage boundary of {rows} rows per token has no state flag")
    return int(flag)


def check_activation_values(activations: FloatArray) -> None:
    """Refuse activations with NaN, infinity or a magnitude above :data:`ACTIVATION_LIMIT`.

    A non-finite value never stays in its own session: the K/V cells it produces hold NaN, and a
    NaN cell poisons every other session whose attention spans it, masked or not (the mask is
    added to K.q, and NaN + -inf is NaN; a freed cell keeps its data until it is overwritten).
    So one peer's frame would corrupt every session of the stage.  ``min``/``max`` propagate
    NaN, so two reductions with no temporary array check all three conditions.

    Raises:
        InvalidMessage: naming what was wrong.
    """
    if activations.size == 0:
        return
    low, high = float(activations.min()), float(activations.max())
    if not (-ACTIVATION_LIMIT <= low and high <= ACTIVATION_LIMIT):  # NaN fails both comparisons
        finite = np.isfinite(activations)
        if finite.all():
            what = f"values beyond +-{ACTIVATION_LIMIT:g} (min {low:g}, max {high:g})"
        elif np.isnan(activations).any():
            what = "NaN values"
        else:  # only infinities: the signature of an activation past f16's range on the wire
            what = ("infinite values (an f16 wire turns values beyond +-65504 into infinities: this model "
                    "needs --wire-dtype f32 or q8 upstream)")
        raise InvalidMessage(f"activation refused: it carries {what}, which would poison the stage's KV cells")


def logprobs_of_row(logits: FloatArray, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability in one logits row (its log-softmax, in float64) and the ``top``
    most likely tokens with theirs (ties: the lower token id first)."""
    values = np.asarray(logits, dtype=np.float64)
    peak = float(values.max())
    total = peak + float(np.log(np.exp(values - peak).sum()))
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        count = min(top, values.shape[0])
        candidates = np.argpartition(-values, count - 1)[:count]
        order = np.lexsort((candidates, -values[candidates]))
        alternatives = tuple((int(candidates[i]), min(0.0, float(values[candidates[i]]) - total)) for i in order)
    return TokenLogprobs(int(token), min(0.0, float(values[token]) - total), alternatives)



class Executor:
    """Owns the runtime context and the session table of one stage.

    Args:
        context: a ``StageContext`` or ``NullContext``.
    """

    def __init__(self, context: RuntimeContext, cache: "StageCache | None" = None) -> None:
        self.context = context
        self.cache = cache
        self.model = context.model
        self.is_first: bool = bool(self.model.is_first)
        self.is_last: bool = bool(self.model.is_last)
        #: Per-layer token embeddings: this stage reads the token ids beside the activations.
        self.reads_tokens: bool = bool(getattr(self.model, "reads_tokens", False)) and not self.is_first
        self.n_embd: int = int(context.n_embd)
        #: n_embd-wide parts per activation row taken and handed on: more than one where the
        #: architecture carries a sideband beside the hidden state (patch 0012: RWKV-7's v_first).
        self.input_rows: int = int(getattr(self.model, "input_rows", 1))
        self.output_rows: int = int(getattr(self.model, "output_rows", 1))
        #: The state flags announcing the rows this stage takes (protocol.md §2.4 / §12; 0: none)
        #: and those it hands on: they differ where the boundary widens with depth (Kimi-K3's
        #: banked layer inputs); a first / last stage's one boundary gives both.
        architecture = str(getattr(self.model, "architecture", ""))
        rows_in = self.output_rows if self.is_first else self.input_rows
        rows_out = self.input_rows if self.is_last else self.output_rows
        self.sideband_flag: int = sideband_flag(architecture, rows_in)
        self.output_flag: int = sideband_flag(architecture, rows_out)
        self.n_batch: int = int(context.n_batch)
        self.n_vocab: int = int(getattr(self.model, "n_vocab", 1 << 31))
        #: KV bytes per cell (the recorded-bytes reply stat); 0 when the runtime does not say.
        self.kv_bytes_per_cell: int = int(getattr(context, "kv_bytes_per_cell", 0))
        #: The null runtime never blocks; the scheduler runs it inline.
        self.blocking: bool = bool(getattr(context, "blocking", True))
        #: The runtime's compute threads: above one, every native compute of the stage must run on
        #: one thread (the scheduler's runtime thread), since libgomp keeps a pool of helper
        #: threads per calling thread, and two pools on a host's cores throttle every wait to a
        #: sleep (``StageContext.compute_threads``).
        self.compute_threads: int = int(getattr(context, "compute_threads", 1))
        self._sessions: dict[int, _Session] = {}
        #: docs/protocol.md §14: what this stage sent downstream per session, the sessions parked
        #: after a lost stage, and their counters (:mod:`skippy.stage.activation_log`).
        self.resume_stats = LogStats()
        self.activation_log = ActivationLog(0 if self.is_last else DEFAULT_LOG_BYTES, self.resume_stats)
        self.parked = ParkedSessions(stats=self.resume_stats)
        #: Issue 31: the head-only context of the head rows this stage serves to the final stage
        #: (``--serve-head-rows``; skippy.stage.head_split), computed through the scheduler; closed here.
        self.head_shard: Any = None
        #: The native decode calls of decode batches (``run_decode_batch``): wall and this
        #: thread's CPU nanoseconds, summed (the scheduler's trace reads them per turn).
        self.native_wall_ns = 0
        self.native_cpu_ns = 0

    # -- sessions ----------------------------------------------------------------------------
    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def _session(self, key: int) -> _Session:
        session = self._sessions.get(key)
        if session is None:
            try:
                seq = self.context.open_session()
            except NativeError as exc:  # all sequence ids taken: refuse this session only
                raise Overloaded(f"cannot open session {key}: {exc}") from exc
            session = self._sessions[key] = _Session(seq)
        return session

    def session_seq(self, key: int) -> int | None:
        """The sequence id session ``key`` holds, or None when it holds none."""
        session = self._sessions.get(key)
        return None if session is None else session.seq

    def relay_sampler(self, key: int) -> Sampler | None:
        """The final stage's sampler of session ``key`` when a decode relay may pick its tokens
        as :meth:`run_decode_batch` would (no grammar, no logprobs), else None."""
        session = self._sessions.get(key)
        if session is None or not self.is_last:
            return None
        if session.extension is not None and session.extension.logprobs is not None:
            return None
        sampler = self._sampler(session)
        return None if sampler.checked or sampler.pointer is None else sampler

    def configure(self, key: int, params: SamplingParams | None) -> None:
        """Set a session's sampling (opening the session); None keeps the current settings."""
        session = self._session(key)
        if params is not None and params != session.params:
            self._set_params(session, params)

    def _set_params(self, session: _Session, params: SamplingParams) -> None:
        if session.sampler is not None:
            session.sampler.close()
            session.sampler = None
        session.params = params

    def _sampler(self, session: _Session) -> Sampler:
        if session.sampler is None:
            params, extension = session.params, session.extension
            n_ctx = int(getattr(self.context, "n_ctx", 0))
            if params.uses_penalties and 0 < n_ctx < params.penalty_last_n:
                # llama.cpp sizes the penalty window's ring buffer by penalty_last_n: a peer's
                # 2^31 would be an 8 GiB allocation.  No session holds more than n_ctx tokens,
                # so a longer window means the same thing as n_ctx.
                params = dataclasses.replace(params, penalty_last_n=n_ctx)
            if extension is not None and extension.grammar is not None:
                params = dataclasses.replace(params, grammar=extension.grammar, grammar_root=extension.grammar_root)
            session.sampler = Sampler(params, int(self.model.n_vocab), getattr(self.model, "vocab_pointer", None))
        return session.sampler

    def configure_extension(self, key: int, extension: SamplingRequest | None) -> int:
        """Install a session's sampling extension (docs/protocol.md §10; the final stage only;
        None: a configure without one, which removes an earlier one).

        The sampler is built at once, so a grammar that does not parse refuses the
        ConfigureGeneration rather than a later message.  Returns the feature bits installed.

        Raises:
            InvalidMessage: the grammar is refused (too large, too deep, does not parse).
        """
        session = self._session(key)
        if extension is None and session.extension is None:
            return 0
        self._set_params(session, session.params)  # a new grammar starts from its first rule
        session.extension = extension
        if extension is None:
            return 0
        try:
            self._sampler(session)
        except ValueError as exc:  # Sampler / SamplingParams name what is wrong with the grammar
            session.extension = None
            raise InvalidMessage(f"sampling extension refused: {exc}") from exc
        return extension.features

    def _sample(self, session: _Session, rows: list[int]) -> tuple[list[int], list[TokenLogprobs] | None]:
        """Sample ``rows`` of the last decode with the session's sampler; with their logprobs when
        the session asked for them (computed from the same logits rows).

        Raises:
            RuntimeFailure: the session's grammar allows no token here.
        """
        sampler = self._sampler(session)
        try:
            tokens = [int(t) for t in self.context.sample([sampler] * len(rows), rows)]
        except GrammarDeadEnd as exc:  # the grammar cannot go on with this vocabulary
            raise RuntimeFailure(f"sampling refused: {exc}") from exc
        extension = session.extension
        if extension is None or extension.logprobs is None:
            return tokens, None
        return tokens, [logprobs_of_row(self.context.logits(row), token, extension.logprobs)
                        for row, token in zip(rows, tokens)]

    def trim(self, key: int, length: int) -> int:
        """Trim a session to ``length`` positions; returns the positions removed."""
        if length < 0:
            raise InvalidMessage(f"TrimSession to a negative length ({length})")
        session = self._sessions.get(key)
        if session is None:
            return 0
        held = self.context.length(session.seq)
        if held > length:  # a refusal first: nothing changed
            self._trim_context(session.seq, length, "TrimSession refused")
        self.activation_log.trim(key, length)
        return max(0, held - length)

    def _trim_context(self, seq: int, length: int, what: str) -> None:
        """``context.trim``; a rollback it refuses (out of reach, or inexact on a stage of a chain:
        :mod:`skippy.runtime.rollback`) refuses the message, naming why."""
        try:
            self.context.trim(seq, length)
        except RollbackRefused as exc:
            raise InvalidMessage(f"{what}: the session cannot go back to {length} positions: {exc.reason}") from exc
        except SessionError as exc:
            raise InvalidMessage(f"{what}: {exc}") from exc

    def release(self, key: int) -> bool:
        """Drop a session's KV, sequence id and sampler; False when it was not open."""
        session = self._sessions.pop(key, None)
        if session is None:
            return False
        if self.cache is not None:
            self.cache.release(session.seq)
        if session.sampler is not None:
            session.sampler.close()
        self.activation_log.drop(key)
        self.context.close_session(session.seq)
        return True

    # -- resume after a lost stage (docs/protocol.md §14) ----------------------------------------
    def configure_resume(self, log_bytes: int, hold_s: float) -> None:
        """The activation log's budget (bytes; the final stage keeps none) and the parking time."""
        self.activation_log.budget_bytes = 0 if self.is_last else max(0, log_bytes)
        self.resume_stats.log_budget_bytes = self.activation_log.budget_bytes
        self.parked.hold_s = hold_s

    def hold_for_resume(self, key: int) -> None:
        """Session ``key``'s driver resumes it after a lost stage (its configure said so)."""
        self._session(key).resumable = True

    def park_or_release(self, key: int) -> str:
        """A lane closed on a lost stage holding session ``key``: park it when resumable, else
        release it; "parked", "released" or "" (not open)."""
        session = self._sessions.get(key)
        session_id = key & 0xFFFFFFFFFFFFFFFF
        if session is None:
            return ""
        if not session.resumable or not session_id:
            self.release(key)
            return "released"
        stale = self.parked.take(session_id)  # an older park of the same id goes now
        if stale is not None and stale != key:
            self.release(stale)
        self.parked.park(session_id, key)
        return "parked"

    def release_parked(self, session_id: int) -> bool:
        """Release the parked session ``session_id`` (a new request reuses the id)."""
        key = self.parked.take(session_id)
        return key is not None and self.release(key)

    def expire_parked(self) -> int:
        """Release the parked sessions whose resume did not come in time; how many."""
        keys = self.parked.expired()
        for key in keys:
            log.info("resume: session %d was not resumed within %g s: released",
                     key & 0xFFFFFFFFFFFFFFFF, self.parked.hold_s)
            self.release(key)
        return len(keys)

    def release_all_parked(self) -> int:
        keys = self.parked.all()
        for key in keys:
            self.release(key)
        return len(keys)

    def adopt(self, session_id: int, key: int, length: int) -> int:
        """Adopt parked session ``session_id`` as ``key`` (the resuming lane's), trimmed to
        ``length`` positions; returns the positions it holds (0: not parked here, a fresh
        session the replay fills)."""
        old = self.parked.take(session_id)
        if old is not None and old in self._sessions and getattr(self.context, "recurrent", False):
            # a recurrent state cannot be cut back to ``length`` exactly in general: this stage
            # computes the replay as a replacement would, from its upstream's logged rows
            log.info("resume: session %d holds recurrent state here: recomputed from the replay",
                     session_id & 0xFFFFFFFFFFFFFFFF)
            self.release(old)
            old = None
        if old is None or old not in self._sessions:
            if key in self._sessions:  # the resuming lane configured it before: start again
                self.release(key)
            self._session(key).resumable = True
            return 0
        if old != key:
            if key in self._sessions:
                self.release(key)
            self._sessions[key] = self._sessions.pop(old)
            self.activation_log.rekey(old, key)
        self.resume_stats.adopted += 1
        session = self._sessions[key]
        session.resumed = True
        self.trim(key, length)
        held = min(length, self.context.length(session.seq))
        session.resume_length, session.replay_valid = length, held
        return held

    def restore_sampler(self, key: int, tokens: Sequence[int]) -> None:
        """The final stage: rebuild session ``key``'s sampler where sampling ``tokens`` left it
        (:meth:`skippy.runtime.sampling.Sampler.restore`)."""
        if not self.is_last:
            return
        session = self._session(key)
        if session.sampler is not None:
            session.sampler.close()
            session.sampler = None
        try:
            self._sampler(session).restore(tokens)
        except ValueError as exc:  # a token outside the vocabulary or the grammar: refuse the resume
            session.sampler.close()  # type: ignore[union-attr]
            session.sampler = None
            raise InvalidMessage(f"resume refused: {exc}") from exc
        self.resume_stats.sampler_restores += 1

    def _replayed(self, session: _Session | None, item: WorkItem) -> WorkResult | None:
        """A replay frame this stage already holds: its logged rows (nothing computed); None:
        compute it (a fresh session, or the log does not cover it: those positions are trimmed
        and computed again, logged)."""
        start, count = int(item.positions[0]), item.rows
        if session is None:
            return None
        end = start + count
        valid = min(session.replay_valid, self.context.length(session.seq)) if session.resumed else 0
        # a verify window replayed as computed (docs/protocol.md §14) may reach past the resume
        # length with its rejected drafts: a stage holding every position up to that length hands
        # on its rows for them and, for the rejected rows, copies of the last one (a row never
        # changes the rows before it; the next frame trims them on the stage that computes them)
        held = end if end <= valid else (session.resume_length if start < session.resume_length <= valid else 0)
        if held == 0:
            if session.resumed:  # the positions this stage held were trimmed for an earlier frame
                self.resume_stats.replay_recomputed_tokens += count
                session.replay_valid = min(session.replay_valid, start)
            return None
        if self.is_last:  # the final stage hands nothing on: its KV is all it needs
            self.resume_stats.replayed_tokens += held - start
            return WorkResult()
        rows = self.activation_log.rows(item.session, start, held - start)
        if rows is not None:
            self.resume_stats.replayed_tokens += held - start
            if held < end:
                per = rows.shape[0] // (held - start)
                rows = np.concatenate([rows, np.tile(rows[-per:], (end - held, 1))])
            return WorkResult(rows)
        session.replay_valid = min(session.replay_valid, start)
        log.info("resume: session %d's activation log does not cover positions %d..%d%s: recomputing them "
                 "on this stage", item.session & 0xFFFFFFFF, start, start + count - 1,
                 " (evicted)" if self.activation_log.evicted(item.session) else "")
        self.resume_stats.replay_recomputed_tokens += count
        self.trim(item.session, start)
        return None

    def snapshot(self) -> dict[str, Any]:
        """Session, KV and prefix-cache figures for the stats file."""
        figures: dict[str, Any] = {"sessions_in_use": len(self._sessions),
                                   "kv_cells_used": int(self.context.kv_cells_used()),
                                   "kv_bytes_per_cell": self.kv_bytes_per_cell,
                                   "state_bytes_per_sequence": int(getattr(self.context, "state_bytes_per_sequence", 0))}
        if self.cache is not None:
            figures["prefix_cache"] = {**dataclasses.asdict(self.cache.stats), "holds": self.cache.holds}
        figures["resume"] = {**dataclasses.asdict(self.resume_stats), "parked_now": len(self.parked)}
        if getattr(self.context, "recurrent", False):  # skippy.runtime.rollback: what checkpoints cost
            figures["recurrent_rollback"] = dataclasses.asdict(self.context.rollback_stats)  # type: ignore[attr-defined]
        return figures

    # -- prefix cache ------------------------------------------------------------------------
    def configure_prefix(self, key: int, namespace: str | None, record: bool) -> None:
        """Set a session's cache namespace and whether its prompt is recorded (opens it)."""
        session = self._session(key)
        session.namespace = namespace
        session.record = record

    def probe(self, key: int, tokens: IntArray, namespace: str | None) -> int:
        """Longest cached page-aligned prefix of ``tokens``, held for the session (0: miss)."""
        if self.cache is None or tokens.shape[0] == 0:
            return 0
        session = self._session(key)
        return self.cache.lookup(tokens, namespace=self._namespace(session, namespace), hold=session.seq)

    def restore(self, key: int, tokens: IntArray, length: int, namespace: str | None) -> int:
        """Make the session hold exactly ``tokens[:length]``'s KV, or nothing; ``length`` or 0."""
        if self.cache is None:
            return 0
        if not 0 < length <= tokens.shape[0]:
            raise InvalidMessage(f"restore of {length} tokens from a {tokens.shape[0]}-token prefix")
        session = self._session(key)
        try:
            restored = self.cache.restore(session.seq, tokens, length, namespace=self._namespace(session, namespace))
        except NativeError:  # no room to load a spilled state: a miss, the session left empty
            self.context.trim(session.seq, 0)
            restored = 0
        session.prompt = [int(t) for t in tokens[:restored]]
        return restored

    def restore_decode(self, key: int, tokens: IntArray, item: WorkItem, namespace: str | None) -> WorkResult | None:
        """TryRestorePrefillDecode: restore ``tokens[:-1]`` (``M`` positions, all or nothing), then
        run ``item`` (the last token at position ``M``) as a 1-token final prefill chunk, exactly what
        the unfused path runs; None on a miss (the session is left empty)."""
        length = int(tokens.shape[0]) - 1
        if self.restore(key, tokens, length, namespace) != length:
            return None
        item.prefill = item.final_prefill = True
        item.prompt_tokens = tokens[length:]
        item.align_to = length
        try:
            return self.run_item(item)
        except StageError:  # e.g. no KV room for the decode: a miss, nothing left half-done
            self.drop(key)
            return None

    def fork(self, parent: int, key: int, length: int) -> int:
        """Make session ``key`` (opened if needed, emptied first) hold the first ``length`` positions of
        session ``parent``'s KV, shared cell by cell (``n`` > 1 choices: the prompt is prefilled once);
        ``length``, or 0 when the parent is not open here or holds fewer positions."""
        source = self._sessions.get(parent)
        if source is None or parent == key or length < 1 or self.context.length(source.seq) < length:
            return 0
        session = self._session(key)
        self.context.trim(session.seq, 0)
        try:
            self.context.copy(source.seq, session.seq, 0, length)
        except NativeError:  # SessionError included: a copy the KV layout cannot make
            self.context.trim(session.seq, 0)
            return 0
        if self.context.length(session.seq) != length:  # e.g. a sliding window the parent moved past
            self.context.trim(session.seq, 0)
            return 0
        session.prompt = None if source.prompt is None or len(source.prompt) < length else source.prompt[:length]
        return length

    def drop(self, key: int) -> None:
        """Empty a session's KV (a restore that another stage missed); keeps its settings."""
        session = self._sessions.get(key)
        if session is None:
            return
        if self.cache is not None:
            self.cache.release(session.seq)
        self.context.trim(session.seq, 0)
        session.prompt = []

    @staticmethod
    def _namespace(session: _Session, namespace: str | None) -> str | None:
        return session.namespace if namespace is None else namespace

    def _track_prompt(self, session: _Session, item: WorkItem) -> None:
        start = int(item.positions[0])
        prompt = session.prompt
        if self.cache is not None and self.cache.holds:
            self.cache.release(session.seq)  # a prefill after a probe: the hold is no longer needed
        if prompt is None or item.prompt_tokens is None or item.prompt_tokens.shape[0] != item.rows \
                or start > len(prompt):
            session.prompt = None  # positions without tokens: this prompt cannot be recorded
            return
        del prompt[start:]
        prompt.extend(int(t) for t in item.prompt_tokens)

    def _record(self, session: _Session) -> int:
        assert self.cache is not None
        prompt = session.prompt
        if not session.record or not prompt:
            return 0
        try:
            return self.cache.record(session.seq, np.asarray(prompt, dtype=np.int32), namespace=session.namespace)
        except NativeError:  # the copy found no room: not cached, the request is unaffected
            return 0

    # -- compute -----------------------------------------------------------------------------
    def _align(self, session: _Session, item: WorkItem) -> int:
        """Auto-align (see the module header); returns the positions trimmed."""
        held = self.context.length(session.seq)
        start = int(item.positions[0])
        if item.align_to is not None:
            if held > item.align_to:
                self._trim_context(session.seq, item.align_to, f"a message at position {item.align_to} refused")
                return held - item.align_to
            if held < item.align_to:
                raise InvalidMessage(
                    f"session {item.session} holds {held} positions but the message starts at the "
                    f"authoritative position {item.align_to} (missing prefill?)"
                )
        elif start < held:
            raise InvalidMessage(
                f"session {item.session} already holds {held} positions; a chunk at position {start} "
                "would overwrite them (trim the session first)"
            )
        return 0

    def _check_input(self, item: WorkItem) -> None:
        if self.is_first:
            tokens = item.tokens
            if tokens is None or tokens.shape != (item.rows,):
                raise InvalidMessage(f"first stage needs {item.rows} token ids, got "
                                 f"{None if tokens is None else tokens.shape[0]}")
            # checked per item, so a bad id fails its own message, not a batch shared with others
            low, high = (int(tokens[0]),) * 2 if item.rows == 1 else (int(tokens.min()), int(tokens.max()))
            if low < 0 or high >= self.n_vocab:
                raise InvalidMessage(f"token ids must be in 0..{self.n_vocab - 1} (got {low}..{high})")
        elif item.activations is None or item.activations.shape != (item.rows, self.n_embd * self.input_rows):
            shape = None if item.activations is None else item.activations.shape
            raise InvalidMessage(f"activation of shape {shape} does not match {item.rows} rows x width "
                                 f"{self.n_embd * self.input_rows}")
        else:
            check_activation_values(item.activations)
            if self.reads_tokens and (item.tokens is None or item.tokens.shape != (item.rows,)):
                raise InvalidMessage(
                    f"this stage's layers read the token ids (per-layer token embeddings): {item.rows} rows "
                    f"came with {0 if item.tokens is None else item.tokens.shape[0]} token ids")

    def _decode(self, positions: IntArray, seqs: IntArray, item_tokens: IntArray | None,
                item_activations: FloatArray | None, outputs: npt.NDArray[np.bool_] | None) -> None:
        try:
            try:
                self._decode_once(positions, seqs, item_tokens, item_activations, outputs)
            except KvSlotUnavailable:
                # a session's own KV stream (kv_streams) gains nothing from the cache's streams
                if (self.cache is None or getattr(self.context, "kv_streams", False)
                        or not self.cache.reclaim(int(positions.shape[0]))):
                    raise
                first: dict[int, int] = {}
                for seq, position in zip(seqs.tolist(), positions.tolist()):
                    first[seq] = min(position, first.get(seq, position))
                for seq, position in first.items():  # undo what a partial batch may have written
                    if self.context.length(seq) > position:
                        self.context.trim(seq, position)
                self._decode_once(positions, seqs, item_tokens, item_activations, outputs)
        except KvSlotUnavailable as exc:  # no KV room even after the cache gave some back
            raise Overloaded(f"no KV cells free for {int(positions.shape[0])} rows: {exc}") from exc
        except NativeError as exc:  # the runtime refused or failed the batch: fail the message
            raise RuntimeFailure(f"runtime error: {exc}") from exc

    def _decode_once(self, positions: IntArray, seqs: IntArray, item_tokens: IntArray | None,
                     item_activations: FloatArray | None, outputs: npt.NDArray[np.bool_] | None) -> None:
        if self.is_first:
            self.context.decode(positions=positions, seq_ids=seqs, tokens=item_tokens, outputs=outputs)
        else:
            self.context.decode(positions=positions, seq_ids=seqs, activations=item_activations,
                                outputs=outputs, tokens=item_tokens if self.reads_tokens else None)

    def run_item(self, item: WorkItem) -> WorkResult:
        """Run one prefill chunk, verify window or decode on its own."""
        self._check_input(item)
        if item.replay:
            replayed = self._replayed(self._sessions.get(item.session), item)
            if replayed is not None:
                return replayed
        session = self._session(item.session)
        if item.sampling is not None and item.sampling != session.params:
            self._set_params(session, cast(SamplingParams, item.sampling))
        trimmed = self._align(session, item)
        if item.prefill and self.cache is not None:
            self._track_prompt(session, item)
        started = time.perf_counter_ns()
        rows = item.rows
        pieces: list[FloatArray] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprobs] | None = None
        for begin in range(0, rows, self.n_batch):
            end = min(rows, begin + self.n_batch)
            count = end - begin
            seqs = np.empty(count, dtype=np.int32)
            seqs.fill(session.seq)
            outputs: npt.NDArray[np.bool_] | None = None
            if self.is_last:
                if item.outputs is Outputs.ALL:
                    outputs = np.ones(count, dtype=bool)
                else:
                    outputs = np.zeros(count, dtype=bool)
                    if item.outputs is Outputs.LAST and end == rows:
                        outputs[-1] = True
            if count == rows:  # one micro-batch (every decode): the item's arrays as they are
                self._decode(item.positions, seqs, item.tokens, item.activations, outputs)
            else:
                self._decode(
                    item.positions[begin:end],
                    seqs,
                    None if item.tokens is None else item.tokens[begin:end],
                    None if item.activations is None else item.activations[begin:end],
                    outputs,
                )
            if not self.is_last:
                pieces.append(np.array(self.context.activations(), dtype=np.float32, copy=True))
            elif outputs is not None and outputs.any():
                out_rows = [int(r) for r in np.flatnonzero(outputs)]
                sampled, sampled_logprobs = self._sample(session, out_rows)
                tokens += sampled
                if sampled_logprobs is not None:
                    logprobs = (logprobs or []) + sampled_logprobs
        activations = None
        if pieces:
            activations = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
            self.activation_log.record(item.session, int(item.positions[0]), rows, activations)
        self.resume_stats.computed_positions += rows
        compute_us = (time.perf_counter_ns() - started) // 1000
        recorded = self._record(session) if item.final_prefill and self.cache is not None else 0
        return WorkResult(activations, tokens, 1, compute_us, trimmed, recorded, logprobs)

    def run_decode_batch(self, items: Sequence[WorkItem]) -> list[WorkResult | StageError]:
        """Run single-row items of distinct sessions as one native batch.

        An item that fails its own checks (alignment, input shape) gets a StageError in its slot
        and is left out of the batch; a runtime failure of the batch fails every item in it.
        """
        results: list[WorkResult | StageError] = []
        ready: list[tuple[int, WorkItem, _Session, int]] = []
        for index, item in enumerate(items):
            try:
                self._check_input(item)
                session = self._session(item.session)
                if item.sampling is not None and item.sampling != session.params:
                    self._set_params(session, cast(SamplingParams, item.sampling))
                trimmed = self._align(session, item)
            except StageError as exc:
                results.append(exc)
                continue
            results.append(WorkResult())
            ready.append((index, item, session, trimmed))
        if not ready:
            return results
        count = len(ready)
        positions = np.fromiter((int(i.positions[0]) for _, i, _, _ in ready), dtype=np.int32, count=count)
        seqs = np.fromiter((s.seq for _, _, s, _ in ready), dtype=np.int32, count=count)
        tokens = activations = None
        if self.is_first or self.reads_tokens:
            tokens = np.concatenate([i.tokens for _, i, _, _ in ready if i.tokens is not None])
        if not self.is_first:
            activations = np.concatenate([i.activations for _, i, _, _ in ready if i.activations is not None])
        outputs = np.ones(count, dtype=bool) if self.is_last else None
        started = time.perf_counter_ns()
        cpu = time.thread_time_ns()
        try:
            self._decode(positions, seqs, tokens, activations, outputs)
            self.native_cpu_ns += time.thread_time_ns() - cpu
            self.native_wall_ns += time.perf_counter_ns() - started
            if self.is_last:
                samplers = [self._sampler(s) for _, _, s, _ in ready]
                try:
                    sampled = [int(t) for t in self.context.sample(samplers, list(range(count)))]
                except GrammarDeadEnd as exc:  # a session's grammar cannot go on: the batch fails
                    raise RuntimeFailure(f"sampling refused: {exc}") from exc
                batch_logprobs: list[TokenLogprobs | None] = [
                    None if s.extension is None or s.extension.logprobs is None
                    else logprobs_of_row(self.context.logits(row), sampled[row], s.extension.logprobs)
                    for row, (_, _, s, _) in enumerate(ready)]
            else:
                hidden = np.array(self.context.activations(), dtype=np.float32, copy=True)
        except StageError as exc:
            for index, *_ in ready:
                results[index] = exc
            return results
        compute_us = (time.perf_counter_ns() - started) // 1000
        for row, (index, _, _, trimmed) in enumerate(ready):
            if self.is_last:
                entry = batch_logprobs[row]
                results[index] = WorkResult(None, [sampled[row]], count, compute_us, trimmed,
                                            logprobs=None if entry is None else [entry])
            else:
                self.activation_log.record(ready[row][1].session, int(positions[row]), 1, hidden[row:row + 1])
                results[index] = WorkResult(hidden[row:row + 1], [], count, compute_us, trimmed)
        self.resume_stats.computed_positions += count
        return results

    def close(self) -> None:
        """Release every session (samplers included) and the prefix cache."""
        for key in list(self._sessions):
            self.release(key)
        if self.cache is not None:
            self.cache.close()
        head, self.head_shard = self.head_shard, None
        if head is not None:
            head.close()
            head.model.close()
