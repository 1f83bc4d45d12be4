"""A llama.cpp context for one stage: sessions as sequence ids, batches, KV operations, state.

Strategy: one context per stage process, shared by all sessions (one unified KV cell pool; a
session is a sequence id).  A batch is described by caller-owned numpy arrays; ``decode`` points a
``llama_batch`` straight at them (activations are never copied on the way in) and releases the GIL
for the native call.  After ``decode``, :meth:`activations` is a zero-copy view of the hidden states
of every row (valid until the next decode) and, on the final stage, :meth:`logits` /
:meth:`sample` read the rows that were flagged as outputs.  Every KV operation is per sequence;
mirroring them on every stage of a chain is the caller's job.  Saved sequence states carry a tag
(model identity, layer range, shape) that is checked on restore, because llama.cpp itself only
checks the layer *count*.  A recurrent or hybrid model's sessions roll back through
checkpoints of their recurrent state (:mod:`skippy.runtime.rollback`): ``trim``, ``remove`` of a
tail and a partial ``copy`` restore one and decode the logged rows again.  A final stage whose
model splits the head (``Model(split_head=...)``, issue 31) runs its layers here, its head rows in
a head-only context beside them and the other rows in an attached head shard
(:mod:`skippy.runtime.head_shard`): its logits rows are full, everything above reads them as before.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
import time
from typing import TYPE_CHECKING, Sequence, final

import numpy as np
import numpy.typing as npt

from skippy.runtime import _callbacks
from skippy.runtime.errors import (
    ClosedError,
    ContextError,
    InvalidBatch,
    RollbackRefused,
    SessionError,
    StateMismatch,
    decode_error,
)
from skippy.runtime.ffi import ffi, lib
from skippy.runtime.model import Model
from skippy.runtime.offload import Offload
from skippy.runtime.rollback import (
    DEFAULT_DEPTH,
    DEFAULT_INTERVAL,
    DEFAULT_ROWS,
    STATE_PARTIAL_ONLY,
    Checkpoint,
    Chunk,
    RollbackStats,
)
from skippy.runtime.sampling import GrammarDeadEnd, Sampler

if TYPE_CHECKING:
    from skippy.runtime.head_shard import HeadShard
    from skippy.runtime.row_batch import RowBatch

#: Tag in front of every saved sequence state.
_STATE_MAGIC = b"SKPYSEQ1"
_STATE_HEADER = struct.Struct("<8sIIIII24s")  # magic, start, end, n_layer, n_embd, n_ctx, identity

# The output rows of a one-row decode (shared, never written).
_ROW_0 = np.zeros(1, dtype=np.intp)
_ROW_0.flags.writeable = False
_NO_ROWS = np.zeros(0, dtype=np.intp)
_NO_ROWS.flags.writeable = False
_SET_0 = frozenset((0,))

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryReport:
    """Memory figures of a stage (bytes)."""

    weights: int
    kv_capacity: int
    kv_cells_used: int
    kv_bytes_used: int
    resident: int
    #: recurrent state of one sequence id in the stage's layers, and of all ``max_sessions`` of them
    state_per_sequence: int = 0
    state_capacity: int = 0


def resident_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def huge_page_bytes() -> int:
    """Bytes of this process's anonymous memory on transparent huge pages (0 where not reported).

    With native/patches/0004 the weights read into memory, the KV cache and the compute buffers
    are advised onto 2 MiB pages; this says how much of that the kernel granted."""
    try:
        with open("/proc/self/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@final
class StageContext:
    """Runs batches of rows for the sessions of one stage.

    Args:
        model: the loaded stage.
        n_ctx: KV cells shared by all sessions (native patch 0016 places each session's cells as it
            would hold them alone, so its answer does not depend on the others: docs/kv-placement.md);
            with ``kv_streams``, the cells of each session.
        max_sessions: sequence ids available to sessions (``0 .. max_sessions-1``).
        n_batch: most rows one ``decode`` may carry; also the micro-batch size (``n_ubatch``)
            unless given, so a prefill chunk is computed in one pass (same partition on every stage).
        threads: compute threads (default: all cores).
        offload: flash attention and KV cache types (:mod:`skippy.runtime.offload`; default: flash
            attention off, f16 caches).
        checkpoint_depth / checkpoint_interval / checkpoint_rows: recurrent and hybrid models
            only: checkpoints kept per session, one-row decodes between two, and most rows logged
            since the oldest (:mod:`skippy.runtime.rollback`).
        kv_streams: give each session its own KV stream of ``n_ctx`` cells (llama.cpp's
            non-unified KV; ``n_ctx x max_sessions`` cells in all) instead of one pool shared by
            all.  A session's cells then always start at cell 0 whatever the other sessions hold
            (as exact as the shared pool's placement, at ``max_sessions`` times the memory).  A
            copy between sessions is a full copy of the source's state, trimmed (refused where a
            sliding window has dropped cells the prefix attends to).
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        max_sessions: int = 8,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        threads: int | None = None,
        threads_batch: int | None = None,
        offload: Offload | None = None,
        checkpoint_depth: int = DEFAULT_DEPTH,
        checkpoint_interval: int = DEFAULT_INTERVAL,
        checkpoint_rows: int = DEFAULT_ROWS,
        kv_streams: bool = False,
    ) -> None:
        if checkpoint_depth < 1 or checkpoint_interval < 1 or checkpoint_rows < 1:
            raise ContextError(f"checkpoint depth, interval and rows must be >= 1 (got {checkpoint_depth}, "
                               f"{checkpoint_interval}, {checkpoint_rows})")
        if n_ctx <= 0 or n_batch <= 0 or not 1 <= max_sessions <= 256:
            raise ContextError(
                f"invalid context sizes: n_ctx={n_ctx}, n_batch={n_batch}, max_sessions={max_sessions} (1..256)"
            )
        self.model = model
        #: The stage's ends and whether its layers read the token ids (fixed with its layers),
        #: kept here: every decode reads them.
        self._first, self._last, self._reads_tokens = model.is_first, model.is_last, model.reads_tokens
        self._lock = threading.Lock()
        #: Candidate array of the checked (grammar) sampling path, allocated at its first use.
        self._candidates: object = None
        threads = threads or os.cpu_count() or 1
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx * max_sessions if kv_streams else n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_ubatch or n_batch
        params.n_seq_max = max_sessions
        params.n_threads = threads
        params.n_threads_batch = threads_batch or threads
        params.kv_unified = not kv_streams
        params.embeddings = not model.is_last
        params.no_perf = True
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if offload is not None:
            params.flash_attn_type = {"off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED, "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                      "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO}[offload.flash_attn]
            types = {"f32": lib.GGML_TYPE_F32, "f16": lib.GGML_TYPE_F16, "q8_0": lib.GGML_TYPE_Q8_0,
                     "q4_0": lib.GGML_TYPE_Q4_0}
            params.type_k = types[offload.cache_type_k]
            params.type_v = types[offload.cache_type_v]
        _callbacks.take_recent_errors()
        pointer = lib.llama_init_from_model(model.pointer, params)
        if pointer == ffi.NULL:
            detail = _callbacks.take_recent_errors() or "see the skippy.llama log"
            raise ContextError(f"cannot create a context (n_ctx={n_ctx}, n_batch={n_batch}): {detail}")
        self._ptr = pointer
        self._memory = lib.llama_get_memory(pointer)
        #: Cells in all (every stream together, with ``kv_streams``).
        self.n_ctx = int(lib.llama_n_ctx(pointer))
        self.kv_streams = kv_streams
        self.n_batch = int(lib.llama_n_batch(pointer))
        self.max_sessions = max_sessions
        #: The threads a batch computes on (the larger of the decode and prefill counts).  Above
        #: one, ggml runs every graph in an OpenMP team led by the calling thread, and libgomp
        #: keeps one pool of helper threads per calling thread: the caller must keep every compute
        #: of the process on one thread (:attr:`skippy.stage.executor.Executor.compute_threads`).
        self.compute_threads = max(threads, threads_batch or threads)
        self.n_embd = model.n_embd
        #: Width of an activation row taken (other stages) and handed on (all but the last): the
        #: hidden state, then any sideband the architecture carries beside it (patch 0012).
        self.input_width = model.n_embd * model.input_rows
        self.output_width = model.n_embd * model.output_rows
        # Reused batch arrays: numbers are copied in, activations are pointed at in place.
        self._tokens = np.zeros(self.n_batch, dtype=np.int32)
        self._positions = np.zeros(self.n_batch, dtype=np.int32)
        self._seq_ids = np.zeros(self.n_batch, dtype=np.int32)
        self._n_seq_id = np.ones(self.n_batch, dtype=np.int32)
        self._outputs = np.zeros(self.n_batch, dtype=np.int8)
        self._seq_ptrs = ffi.new("llama_seq_id *[]", self.n_batch)
        self._batch = ffi.new("struct llama_batch *")
        self._cffi_views = (
            ffi.cast("llama_token *", ffi.from_buffer(self._tokens)),
            ffi.cast("llama_pos *", ffi.from_buffer(self._positions)),
            ffi.cast("llama_seq_id *", ffi.from_buffer(self._seq_ids)),
            ffi.cast("int32_t *", ffi.from_buffer(self._n_seq_id)),
            ffi.cast("int8_t *", ffi.from_buffer(self._outputs)),
        )
        self._free_sessions = list(range(max_sessions - 1, -1, -1))
        self._open_sessions: set[int] = set()
        self._last_rows = 0
        self._last_output_rows: npt.NDArray[np.intp] = np.zeros(0, dtype=np.intp)
        self._last_output_set: frozenset[int] = frozenset()  # the same rows, for O(1) checks
        self._last_activation_rows = 0
        #: A recurrent or hybrid model: sessions roll back through checkpoints, not seq_rm.
        self.recurrent = bool(lib.llama_model_is_recurrent(model.pointer) or lib.llama_model_is_hybrid(model.pointer))
        #: This stage runs some of the model's layers but not all: a rollback that keeps only the
        #: first row of a multi-row chunk would replay it inexactly here (skippy.runtime.rollback).
        self._partial_layers = 0 < model.layers.end - model.layers.start < model.n_layer
        self.checkpoint_depth = checkpoint_depth
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_rows = checkpoint_rows
        self._rollback_stats = RollbackStats()
        self._rings: dict[int, list[Checkpoint]] = {}
        self._replaying = False
        #: A split head (issue 31): the head's local rows in a head-only context, the others from
        #: an attached shard; the head row of each output row of the last decode.
        self._head: StageContext | None = None
        self._shard: HeadShard | None = None
        self._head_index = np.full(self.n_batch, -1, dtype=np.intp)
        if model.head_model is not None:
            try:
                self._head = StageContext(model.head_model, n_ctx=self.n_batch, max_sessions=1, n_batch=self.n_batch,
                                          threads=threads, threads_batch=threads_batch, offload=offload)
            except BaseException:
                lib.llama_free(pointer)
                self._ptr = ffi.NULL
                raise

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self) -> int:
        """Reserve a free sequence id (its KV is empty)."""
        with self._lock:
            if not self._free_sessions:
                raise SessionError(f"all {self.max_sessions} sessions are in use")
            seq = self._free_sessions.pop()
            self._open_sessions.add(seq)
            return seq

    def close_session(self, seq: int) -> None:
        """Drop the session's KV and return its sequence id; unknown ids raise SessionError."""
        with self._lock:
            if seq not in self._open_sessions:
                raise SessionError(f"session {seq} is not open")
            lib.llama_memory_seq_rm(self._memory_ptr(), seq, -1, -1)
            self._rings.pop(seq, None)
            self._open_sessions.discard(seq)
            self._free_sessions.append(seq)
            self._free_sessions.sort(reverse=True)

    @property
    def sessions_in_use(self) -> int:
        return len(self._open_sessions)

    # -- compute -----------------------------------------------------------------------------
    def decode(
        self,
        *,
        positions: Sequence[int] | IntArray,
        seq_ids: Sequence[int] | IntArray,
        tokens: Sequence[int] | IntArray | None = None,
        activations: FloatArray | None = None,
        outputs: Sequence[bool] | npt.NDArray[np.bool_] | None = None,
    ) -> None:
        """Run one batch of rows through the stage's layers.

        Args:
            positions: absolute position of each row in its session.
            seq_ids: session (sequence id) of each row.
            tokens: token ids (the first stage; and, beside the activations, every stage of a
                model with per-layer token embeddings, whose layers read them).
            activations: float32 ``rows x input_width`` hidden states (other stages; where the
                architecture hands on a sideband, each row is the hidden state and then it).
            outputs: rows whose logits are wanted (final stage; default: the last row of each
                session in the batch).  Non-final stages always output every row.

        Raises:
            InvalidBatch: wrong input kind for this stage, shapes, sizes, ids.
            KvSlotUnavailable, DecodeAborted, NativeFatalError: llama_decode failed.
        """
        model = self.model
        if self._reads_tokens and not self._first:
            if tokens is None or activations is None:
                raise InvalidBatch(
                    f"a stage starting at layer {model.layers.start} of {model.architecture} needs the token ids "
                    "beside the activations (its layers read them)"
                )
        elif (tokens is None) == (activations is None):
            raise InvalidBatch("give exactly one of tokens or activations")
        elif tokens is not None and not self._first:
            raise InvalidBatch(
                f"tokens given to a stage starting at layer {model.layers.start}; it takes activations"
            )
        if activations is not None and self._first:
            raise InvalidBatch("activations given to the first stage (layer 0); it takes tokens")
        pos = np.asarray(positions, dtype=np.int32)
        seq = np.asarray(seq_ids, dtype=np.int32)
        n_rows = pos.shape[0] if pos.ndim == 1 else -1
        if n_rows <= 0 or seq.shape != (n_rows,):
            raise InvalidBatch(f"positions and seq_ids must be equal-length 1-D (got {pos.shape} and {seq.shape})")
        if n_rows > self.n_batch:
            raise InvalidBatch(f"{n_rows} rows exceed the context's batch size {self.n_batch}")
        # One row (every decode) is checked with scalars: numpy reductions cost more than the row.
        seq_low, seq_high = (int(seq[0]),) * 2 if n_rows == 1 else (int(seq.min()), int(seq.max()))
        if seq_low < 0 or seq_high >= self.max_sessions:
            raise InvalidBatch(f"sequence ids must be in 0..{self.max_sessions - 1} (got {seq_low}..{seq_high})")
        pos_low = int(pos[0]) if n_rows == 1 else int(pos.min())
        if pos_low < 0:
            raise InvalidBatch(f"positions must be >= 0 (got {pos_low})")
        embd_ptr = ffi.NULL
        token_ptr = ffi.NULL
        keep_alive: object = None
        if tokens is not None:
            tok = np.asarray(tokens, dtype=np.int32)
            if tok.shape != (n_rows,):
                raise InvalidBatch(f"{tok.shape[0] if tok.ndim else 0} tokens for {n_rows} positions")
            tok_low, tok_high = (int(tok[0]),) * 2 if n_rows == 1 else (int(tok.min()), int(tok.max()))
            if tok_low < 0 or tok_high >= model.n_vocab:
                raise InvalidBatch(f"token ids must be in 0..{model.n_vocab - 1} (got {tok_low}..{tok_high})")
            self._tokens[:n_rows] = tok
            token_ptr = self._cffi_views[0]
        if activations is not None:
            act = activations
            if act.ndim != 2 or act.shape[1] != self.input_width:
                raise InvalidBatch(
                    f"activations must be rows x {self.input_width} (the model width"
                    f"{f' x {model.input_rows} parts' if model.input_rows > 1 else ''}); got shape {act.shape}"
                )
            if act.shape[0] != n_rows:
                raise InvalidBatch(f"{act.shape[0]} activation rows for {n_rows} positions")
            if act.dtype != np.float32 or not act.flags.c_contiguous:
                act = np.ascontiguousarray(act, dtype=np.float32)
            keep_alive = act
            embd_ptr = ffi.cast("float *", ffi.from_buffer(act))
        self._positions[:n_rows] = pos
        self._seq_ids[:n_rows] = seq
        out = self._outputs
        if not self._last:
            out[:n_rows] = 1
        elif outputs is None:
            out[:n_rows] = 0
            # last row of each session in the batch
            reversed_seq = seq[::-1]
            _, first_from_end = np.unique(reversed_seq, return_index=True)
            out[n_rows - 1 - first_from_end] = 1
        else:
            flags = np.asarray(outputs, dtype=bool)
            if flags.shape != (n_rows,):
                raise InvalidBatch(f"outputs must have one flag per row ({n_rows}), got {flags.shape}")
            out[:n_rows] = flags
        if self._head is not None and self._shard is None and self._head.model.head_rows[0] > 0:
            raise ContextError("this final stage computes only the head rows "
                               f"{self._head.model.head_rows[0]}:{self._head.model.head_rows[1]}: attach a head shard "
                               "for the others before decoding")
        recurrent_rows = self._before_recurrent_decode(seq, pos) if self.recurrent else None
        with self._lock:
            pointer = self._context_ptr()
            lib.skippy_batch_view(
                self._batch, n_rows, token_ptr, embd_ptr, self._cffi_views[1], self._cffi_views[3],
                self._seq_ptrs, self._cffi_views[2], self._cffi_views[4],
            )
            rc = lib.llama_decode(pointer, self._batch[0])
            del keep_alive
            if rc != 0:
                self._last_rows = 0
                detail = _callbacks.take_recent_errors() or f"{n_rows} rows"
                raise decode_error(rc, detail)
            self._last_rows = n_rows
            if n_rows == 1:  # every decode step: no numpy reductions for one flag
                self._last_output_rows = _ROW_0 if out[0] else _NO_ROWS
                self._last_output_set = _SET_0 if out[0] else frozenset()
            else:
                self._last_output_rows = np.flatnonzero(out[:n_rows])
                self._last_output_set = frozenset(self._last_output_rows.tolist())
            if self._head is not None:
                self._run_head()
        if recurrent_rows is not None:
            self._log_rows(recurrent_rows, pos, tokens, activations)

    def _run_head(self) -> None:
        """The split head's logits of the last decode's output rows: the shard's rows begun first,
        the local ones computed meanwhile, the shard's columns then written into the same rows."""
        assert self._head is not None
        rows = self._last_output_rows
        if len(rows) == 0:
            return
        # the layers (no head) output the hidden state of the output rows only, in order, selected
        # at the last layer as the unsplit final stage selects them (patch 0017)
        pointer = lib.llama_get_embeddings(self._ptr)
        count = len(rows)
        hidden = np.frombuffer(ffi.buffer(pointer, count * self.output_width * 4),
                               dtype=np.float32).reshape(count, self.output_width).copy()
        shard = self._shard
        if shard is not None:
            shard.start(hidden)
        try:
            logits = self._head.decode_head(hidden)
        except BaseException:
            if shard is not None:  # take the shard's answer: the next one must be the next request's
                shard.finish(np.empty((len(rows), shard.rows[1] - shard.rows[0]), dtype=np.float32))
            raise
        if shard is not None:
            shard.finish(logits[:, shard.rows[0]:shard.rows[1]])
        self._head_index[rows] = np.arange(len(rows))

    def decode_head(self, hidden: FloatArray) -> FloatArray:
        """A head-only context: the logits of every row of ``hidden`` (``n x n_vocab``, a view valid
        until the next decode; only the model's head rows written).

        Every count of rows is computed as it comes.  Before patch 0018 an odd count of 3 or more
        was padded with the last row once more (stock tinyBLAS ran odd Q8_0 column counts in two
        passes); with 0018's small-batch kernel the padding costs instead (Gemma 3 270M's Q8_0 head,
        rows 0:35,840 / 35,840:262,144, one thread, CPU ms unpadded against padded: 3 rows 2.20 /
        2.71 and 13.1 / 16.1, 5 rows 3.35 / 3.88 and 20.8 / 24.0, 7 rows 4.56 / 5.12 and 28.6 /
        31.6).  A row's result does not depend on the batch's count from 2 rows up (the prefix
        cache relies on it too)."""
        if not self.model.head_only:
            raise InvalidBatch(f"stage {self.model.layers} is not the head alone")
        count = hidden.shape[0]
        lib.llama_memory_clear(self._memory, False)  # no layers: its cells hold nothing
        self.decode(positions=np.arange(count, dtype=np.int32), seq_ids=np.zeros(count, dtype=np.int32),
                    activations=hidden, outputs=np.ones(count, dtype=bool))
        pointer = lib.llama_get_logits_ith(self._context_ptr(), 0)  # every row an output: rows in order
        n_vocab = self.model.n_vocab
        return np.frombuffer(ffi.buffer(pointer, count * n_vocab * 4), dtype=np.float32).reshape(count, n_vocab)

    def attach_shard(self, shard: "HeadShard | None") -> None:
        """Give a split-head final stage the shard computing the head rows it does not (None: detach)."""
        if self._head is None:
            raise ContextError("this stage does not split the head")
        local = self._head.model.head_rows
        if shard is not None and shard.rows != (0, local[0]):
            raise ContextError(f"a head shard of rows {shard.rows[0]}:{shard.rows[1]} does not complete the local "
                               f"rows {local[0]}:{local[1]} (it needs 0:{local[0]})")
        self._shard = shard

    @property
    def split_head(self) -> bool:
        """The final stage's head is split (its logits come from a head context and a shard)."""
        return self._head is not None

    def _logits_at(self, row: int) -> object:
        """``llama_get_logits_ith`` of batch row ``row`` (of the head context on a split head)."""
        if self._head is None:
            return lib.llama_get_logits_ith(self._context_ptr(), row)
        return lib.llama_get_logits_ith(self._head._context_ptr(), int(self._head_index[row]))

    def row_batch(self, seq: int, sampler: Sampler | None = None, rows: int = 1) -> "RowBatch":
        """A batch of ``rows`` rows of session ``seq`` for the decode relay
        (:mod:`skippy.runtime.row_batch`; a final stage's picks with ``sampler``)."""
        from skippy.runtime.row_batch import RowBatch

        if self.recurrent:
            raise InvalidBatch("a recurrent model's rows are decoded through decode(), which logs them for rollback")
        if self._head is not None:
            raise InvalidBatch("a split head's rows are decoded through decode(), which runs the head beside the layers")
        return RowBatch(self, seq, sampler, rows)

    def note_external_decode(self, rows: int) -> None:
        """A :class:`~skippy.runtime.row_batch.RowBatch` decoded: the last batch was ``rows`` rows,
        each with an output, as after :meth:`decode` of them."""
        if rows == 1:
            self._last_rows = 1
            self._last_output_rows = _ROW_0
            self._last_output_set = _SET_0
        elif rows > 1:
            self._last_rows = rows
            self._last_output_rows = np.arange(rows)
            self._last_output_set = frozenset(range(rows))

    def activations(self) -> FloatArray:
        """Hidden states of every row of the last decode (``rows x output_width`` float32 view).

        The view aliases llama.cpp's output buffer: it is valid until the next decode.
        """
        if self._last:
            raise InvalidBatch("the final stage produces logits, not activations")
        if self._last_rows == 0:
            raise InvalidBatch("no decoded batch to read activations from")
        pointer = lib.llama_get_embeddings(self._context_ptr())
        count = self._last_rows * self.output_width
        view = np.frombuffer(ffi.buffer(pointer, count * 4), dtype=np.float32)
        return view.reshape(self._last_rows, self.output_width)

    def logits(self, row: int) -> FloatArray:
        """Logits of batch row ``row`` of the last decode (a view valid until the next decode)."""
        self._check_output_row(row)
        pointer = self._logits_at(row)
        if pointer == ffi.NULL:
            raise InvalidBatch(f"no logits for row {row}: {_callbacks.take_recent_errors()}")
        return np.frombuffer(ffi.buffer(pointer, self.model.n_vocab * 4), dtype=np.float32)

    @property
    def output_rows(self) -> npt.NDArray[np.intp]:
        """Batch rows of the last decode that have logits (final stage)."""
        return self._last_output_rows

    def sample(self, samplers: Sequence[Sampler], rows: Sequence[int]) -> IntArray:
        """Sample one token per (sampler, row) pair from the last decode's logits."""
        if len(samplers) != len(rows):
            raise InvalidBatch(f"{len(samplers)} samplers for {len(rows)} rows")
        for row in rows:
            self._check_output_row(row)
        count = len(rows)
        result = np.zeros(count, dtype=np.int32)
        if any(sampler.checked for sampler in samplers):
            self._sample_checked(samplers, rows, result)
            return result
        # Greedy with at most a logit bias (Sampler.fast_greedy): the chain's pick taken from the
        # row in place, without its candidate array; the rest (and a row with a NaN) take the chain.
        chained: list[int] = []
        size = self.model.n_vocab * 4
        with self._lock:
            pointer = self._context_ptr()
            for slot, (sampler, row) in enumerate(zip(samplers, rows)):
                if not sampler.fast_greedy or sampler.pointer is None:  # closed: raises
                    chained.append(slot)
                    continue
                logits = self._logits_at(row)
                if logits == ffi.NULL:
                    raise InvalidBatch(f"no logits for row {row}: {_callbacks.take_recent_errors()}")
                token = sampler.pick_greedy(np.frombuffer(ffi.buffer(logits, size), dtype=np.float32))
                if token < 0:
                    chained.append(slot)
                else:
                    result[slot] = token
            if not chained:
                return result
            chain_rows = np.array([rows[slot] for slot in chained], dtype=np.int32)
            if self._head is not None:  # the head context's rows
                pointer = self._head._context_ptr()
                chain_rows = self._head_index[chain_rows].astype(np.int32)
            picked = np.zeros(len(chained), dtype=np.int32)
            pointers = ffi.new("struct llama_sampler *[]", [samplers[slot].pointer for slot in chained])
            lib.skippy_sample_rows(
                pointers, pointer, ffi.cast("int32_t *", ffi.from_buffer(chain_rows)), len(chained),
                ffi.cast("llama_token *", ffi.from_buffer(picked)),
            )
        result[chained] = picked
        return result

    def _sample_checked(self, samplers: Sequence[Sampler], rows: Sequence[int], result: IntArray) -> None:
        """Sample row by row with ``skippy_sample_row_checked`` (a grammar in some chain: see
        :mod:`skippy.runtime.sampling`); the candidate array is kept for the context's life.

        Raises:
            GrammarDeadEnd: a grammar allowed no token of its row (that row's sampler accepted nothing).
        """
        n_vocab = int(self.model.n_vocab)
        with self._lock:
            if self._candidates is None:
                self._candidates = ffi.new("llama_token_data[]", n_vocab)
            pointer = self._context_ptr()
            picked = ffi.new("llama_token *")
            for slot, (sampler, row) in enumerate(zip(samplers, rows)):
                logits = self._logits_at(row)
                if logits == ffi.NULL:
                    raise InvalidBatch(f"no logits for row {row}: {_callbacks.take_recent_errors()}")
                if lib.skippy_sample_row_checked(sampler.pointer, sampler.grammar_pointer, logits, n_vocab,
                                                 self._candidates, picked) != 0:
                    raise GrammarDeadEnd(f"the grammar allows no token of the vocabulary after the text so far "
                                         f"(row {row})")
                result[slot] = picked[0]

    def _check_output_row(self, row: int) -> None:
        if not self.model.is_last:
            raise InvalidBatch(f"stage {self.model.layers} is not the final stage: it has no logits")
        if self._last_rows == 0 or row not in self._last_output_set:
            raise InvalidBatch(f"row {row} was not an output row of the last decode")

    # -- KV memory ---------------------------------------------------------------------------
    def remove(self, seq: int, start: int = -1, end: int = -1) -> bool:
        """Remove positions ``[start, end)`` of a session (-1: open end); False if not possible.

        A recurrent model removes all of a session, or a tail (``end`` -1) by rolling back."""
        if self.recurrent:
            if start <= 0 and end < 0:
                self._rings.pop(seq, None)
            elif end < 0:
                return self._roll_back(seq, start) is None
            else:
                return False  # a hole in a recurrent state cannot exist
        with self._lock:
            return bool(lib.llama_memory_seq_rm(self._memory_ptr(), seq, start, end))

    def trim(self, seq: int, length: int) -> None:
        """Keep only positions ``[0, length)`` of a session (the rollback rule).

        A recurrent session on a stage that runs some but not all of the model's layers refuses
        a ``length`` that keeps only the first row of a chunk of several (:mod:`skippy.runtime.rollback`:
        that row would be replayed as computed inside its chunk, not alone as the unsplit model
        does); every stage of a chain refuses it alike.  One stage running every layer trims it
        exactly.  Nothing is changed by a refusal.

        Raises:
            RollbackRefused: a recurrent session: ``length`` is before its oldest checkpoint, or
                keeps a chunk's first row only on a stage of a chain.
            SessionError: an attention KV that cannot be trimmed.
        """
        if self.recurrent:
            refusal = self._roll_back(seq, length)
            if refusal is not None:
                raise RollbackRefused(seq, length, refusal)
        elif not self.remove(seq, length, -1):
            raise SessionError(f"cannot trim session {seq} to {length} positions")

    def copy(self, source: int, destination: int, start: int = -1, end: int = -1) -> None:
        """Share positions ``[start, end)`` of ``source`` with ``destination`` (no data copied; with
        ``kv_streams`` a prefix ``[0, end)`` only, copied into the destination's stream).

        A recurrent model copies a prefix ``[0, end)`` only: the whole session, then a rollback
        of the copy (through the source's checkpoints, which the copy does not keep).  It refuses
        a prefix that keeps only the first row of a chunk of several (:mod:`skippy.runtime.rollback`:
        a later stage would replay that row as computed inside its chunk, not alone as the
        unsplit model does), on every stage alike: a fork then computes its prompt in full, a
        prefix-cache record is not made.

        Raises:
            SessionError: a recurrent prefix that cannot be made (``destination`` is left empty).
        """
        if not self.recurrent and self.kv_streams:
            self._copy_across_streams(source, destination, start, end)
            return
        if not self.recurrent:
            with self._lock:
                lib.llama_memory_seq_cp(self._memory_ptr(), source, destination, start, end)
            return
        if start > 0:
            raise SessionError(f"a recurrent state has no copy from position {start}: copy a prefix")
        self.remove(destination)
        with self._lock:
            lib.llama_memory_seq_cp(self._memory_ptr(), source, destination, -1, -1)
        if 0 <= end < self.length(source):
            rows = self._head_of_chunk(source, end)
            if rows:
                self.remove(destination)
                raise SessionError(f"cannot copy positions [0, {end}) of session {source}: they keep only the "
                                   f"first row of a {rows}-row chunk (replayed alone it would not be the "
                                   "row the chain computed)")
            # the copy borrows the source's checkpoints for its rollback and keeps none of them
            self._rings[destination] = [dataclasses.replace(c, chunks=list(c.chunks))
                                        for c in self._rings.get(source, [])]
            refusal = self._roll_back(destination, end)
            self._rings.pop(destination, None)
            if refusal is not None:
                self.remove(destination)
                raise SessionError(f"cannot copy positions [0, {end}) of session {source}: {refusal}")

    def _copy_across_streams(self, source: int, destination: int, start: int, end: int) -> None:
        """A prefix copy between two streams: the source's state written into the destination,
        then trimmed to ``end``.  llama.cpp's own cross-stream ``seq_cp`` copies whole streams only,
        and only at the next decode (a state saved before it would read the old cells)."""
        if start > 0:
            raise SessionError(f"sessions in separate KV streams copy a prefix, not positions from {start}")
        if source == destination:
            return
        with self._lock:
            pointer = self._context_ptr()
            lib.llama_memory_seq_rm(self._memory_ptr(), destination, -1, -1)
            if self.position_max(source) < 0:
                return
            size = lib.llama_state_seq_get_size(pointer, source)
            buffer = ffi.new("uint8_t[]", size)
            written = lib.llama_state_seq_get_data(pointer, buffer, size, source)
            if written == 0 or lib.llama_state_seq_set_data(pointer, buffer, written, destination) == 0:
                lib.llama_memory_seq_rm(self._memory_ptr(), destination, -1, -1)
                raise SessionError(f"cannot copy session {source} into session {destination}: "
                                   f"{_callbacks.take_recent_errors() or 'no room in its stream'}")
            # a state leaves out the cells a sliding window has moved past, which a shorter prefix
            # would attend to: then there is no copy (a fork or a cached prefix is computed again)
            memory = self._memory_ptr()
            if lib.llama_memory_seq_pos_min(memory, destination) > lib.llama_memory_seq_pos_min(memory, source):
                lib.llama_memory_seq_rm(memory, destination, -1, -1)
                raise SessionError(f"session {source} no longer holds every cell of its prefix in its "
                                   "sliding-window layers: it cannot be copied into another KV stream")
            if end >= 0:
                lib.llama_memory_seq_rm(self._memory_ptr(), destination, end, -1)

    def keep(self, seq: int) -> None:
        """Drop every sequence but ``seq``."""
        with self._lock:
            if self.kv_streams:  # llama.cpp's seq_keep clears the sequence's own stream only
                for other in range(self.max_sessions):
                    if other != seq:
                        lib.llama_memory_seq_rm(self._memory_ptr(), other, -1, -1)
            else:
                lib.llama_memory_seq_keep(self._memory_ptr(), seq)
        for other in [s for s in self._rings if s != seq]:
            del self._rings[other]

    # -- recurrent rollback (skippy.runtime.rollback) ----------------------------------------
    def _before_recurrent_decode(self, seqs: IntArray, positions: IntArray) -> dict[int, npt.NDArray[np.intp]]:
        """Checkpoint the sessions of a batch that need one; returns each session's rows."""
        if seqs.shape[0] == 1:
            rows = {int(seqs[0]): _ROW_0}
        else:
            rows = {int(s): np.flatnonzero(seqs == s) for s in np.unique(seqs)}
        if self._replaying:
            return rows
        for seq, indices in rows.items():
            ring = self._rings.get(seq)
            if ring and ring[-1].end != int(positions[indices[0]]):
                ring.clear()  # rows this context did not log (cannot happen through decode): start over
            if not ring or indices.shape[0] > 1 or ring[-1].rows >= self.checkpoint_interval:
                self._checkpoint(seq)
        return rows

    def _checkpoint(self, seq: int) -> None:
        started = time.perf_counter_ns()
        position = self.length(seq)
        ring = self._rings.setdefault(seq, [])
        victim: Checkpoint | None = None
        if ring and ring[-1].position == position and not ring[-1].chunks:
            victim = ring.pop()  # nothing was decoded since the last one
        elif len(ring) >= self.checkpoint_depth:
            victim = self._thin(ring)
        # the buffer of the checkpoint this one replaces is reused
        reuse = victim.state if victim is not None else None
        state: bytearray | None = None
        if position > 0:
            with self._lock:
                pointer = self._context_ptr()
                size = lib.llama_state_seq_get_size_ext(pointer, seq, STATE_PARTIAL_ONLY)
                state = reuse if reuse is not None and len(reuse) == size else bytearray(size)
                written = lib.llama_state_seq_get_data_ext(pointer, ffi.from_buffer(state), size, seq,
                                                           STATE_PARTIAL_ONLY)
            if written != size:
                ring.clear()
                raise StateMismatch(f"cannot checkpoint the recurrent state of session {seq} "
                                    f"({written} of {size} bytes)")
        ring.append(Checkpoint(position, state))
        while len(ring) > 1 and sum(c.rows for c in ring) > self.checkpoint_rows:
            del ring[0]  # the rows logged since the oldest checkpoint are bounded too
        stats = self._rollback_stats
        stats.checkpoints += 1
        stats.checkpoint_ns += time.perf_counter_ns() - started

    def _thin(self, ring: list[Checkpoint]) -> Checkpoint:
        """Take one checkpoint out of a full ring (its rows join the one before it): the newest
        ``depth // 2`` stay (the last verify windows), and of the older ones the one whose
        neighbours are closest goes, so the older checkpoints thin out geometrically and a
        session keeps reaching back to its oldest one; with nothing older, the oldest goes."""
        keep = self.checkpoint_depth // 2
        candidates = range(1, len(ring) - keep)
        if not candidates:
            return ring.pop(0)
        index = min(candidates, key=lambda i: (ring[i + 1].position if i + 1 < len(ring) else ring[i].end)
                    - ring[i - 1].position)
        victim = ring.pop(index)
        ring[index - 1].chunks.extend(victim.chunks)
        return victim

    def _log_rows(self, rows: dict[int, npt.NDArray[np.intp]], positions: IntArray,
                  tokens: object, activations: FloatArray | None) -> None:
        tok = None if tokens is None else np.asarray(tokens, dtype=np.int32)
        act = None if activations is None else np.asarray(activations, dtype=np.float32)
        for seq, indices in rows.items():
            ring = self._rings.get(seq)
            if not ring:
                continue
            single = indices.shape[0] == 1
            chunk = Chunk(
                int(positions[indices[0]]),
                None if tok is None else (tok[indices[0]:indices[0] + 1].copy() if single else tok[indices]),
                None if act is None else (act[indices[0]:indices[0] + 1].copy() if single else act[indices]),
            )
            ring[-1].chunks.append(chunk)

    @property
    def rollback_stats(self) -> RollbackStats:
        """What checkpoints cost this context so far; ``checkpoint_bytes``: the states held now
        (a released session's are gone)."""
        stats = self._rollback_stats
        stats.checkpoint_bytes = sum(len(c.state) for r in self._rings.values() for c in r if c.state is not None)
        return stats

    def checkpoint_bytes(self, seq: int) -> int:
        """Bytes the checkpoints of a session hold (states and logged rows; 0 when not recurrent)."""
        return sum(c.nbytes for c in self._rings.get(seq, []))

    def _head_of_chunk(self, seq: int, length: int) -> int:
        """The rows of the logged chunk of which ``[0, length)`` keeps the first row only (0: none)."""
        cut = next((c for r in self._rings.get(seq, []) for c in r.chunks if c.start == length - 1), None)
        return cut.rows if cut is not None and cut.rows > 1 else 0

    def _roll_back(self, seq: int, length: int) -> str | None:
        """Make a recurrent session hold ``[0, length)``; None when done, else why it cannot
        (nothing changed then)."""
        held = self.length(seq)
        if length >= held:
            return None
        if length <= 0:
            self._rings.pop(seq, None)
            with self._lock:
                lib.llama_memory_seq_rm(self._memory_ptr(), seq, -1, -1)
            return None
        started = time.perf_counter_ns()
        ring = self._rings.get(seq, [])
        rows = self._head_of_chunk(seq, length) if self._partial_layers else 0
        if rows:
            self._rollback_stats.refused += 1
            return (f"that keeps only the first row of a {rows}-row chunk, which a stage of a split recurrent "
                    "model would replay as computed inside the chunk, not alone as the unsplit model does; "
                    f"trim to {length - 1} and send that row again as a 1-row message")
        index = next((i for i in range(len(ring) - 1, -1, -1) if ring[i].position <= length), None)
        replay: list[Chunk] = []
        reached = -1
        if index is not None:
            reached = ring[index].position
            for chunk in (c for later in ring[index:] for c in later.chunks):
                if chunk.start >= length or chunk.start != reached:
                    break
                replay.append(chunk if chunk.start + chunk.rows <= length else chunk.head(length - chunk.start))
                reached = min(length, chunk.start + chunk.rows)
        if reached != length:
            self._rollback_stats.refused += 1
            oldest = f"its oldest checkpoint is at {ring[0].position}" if ring else "it has no checkpoint"
            return (f"recurrent state cannot go back from {held} to {length} positions: {oldest} "
                    f"(depth {self.checkpoint_depth}, interval {self.checkpoint_interval})")
        assert index is not None
        base = ring[index]
        with self._lock:
            pointer = self._context_ptr()
            if base.state is None:
                lib.llama_memory_seq_rm(self._memory_ptr(), seq, -1, -1)
            else:
                read = lib.llama_state_seq_set_data_ext(pointer, ffi.from_buffer(base.state), len(base.state), seq,
                                                        STATE_PARTIAL_ONLY)
                if read != len(base.state):
                    raise StateMismatch(f"llama.cpp rejected the checkpoint of session {seq}: "
                                        f"{_callbacks.take_recent_errors()}")
                # the recurrent cell now ends at base.position - 1; this trims the attention KV
                if not lib.llama_memory_seq_rm(self._memory_ptr(), seq, base.position, -1):
                    raise SessionError(f"cannot trim the attention KV of session {seq} to {base.position}")
        restored = time.perf_counter_ns()
        del ring[index + 1:]
        base.chunks = []
        self._replaying = True
        try:
            for chunk in replay:
                self._replay(seq, chunk)
        finally:
            self._replaying = False
        if self.length(seq) != length:
            raise SessionError(f"session {seq} holds {self.length(seq)} positions after a rollback to {length}")
        stats = self._rollback_stats
        stats.rollbacks += 1
        stats.replayed_rows += length - base.position
        stats.rollback_ns += time.perf_counter_ns() - started
        stats.restore_ns += restored - started
        return None

    def _replay(self, seq: int, chunk: Chunk) -> None:
        rows = chunk.rows
        positions = np.arange(chunk.start, chunk.start + rows, dtype=np.int32)
        seqs = np.full(rows, seq, dtype=np.int32)
        for begin in range(0, rows, self.n_batch):
            end = min(rows, begin + self.n_batch)
            outputs = None if not self.model.is_last else np.zeros(end - begin, dtype=bool)
            if outputs is not None:
                outputs[-1] = True
            self.decode(positions=positions[begin:end], seq_ids=seqs[begin:end],
                        tokens=None if chunk.tokens is None else chunk.tokens[begin:end],
                        activations=None if chunk.activations is None else chunk.activations[begin:end],
                        outputs=outputs)

    def position_max(self, seq: int) -> int:
        """Largest position held for ``seq`` (-1 when empty)."""
        return int(lib.llama_memory_seq_pos_max(self._memory_ptr(), seq))

    def length(self, seq: int) -> int:
        """Number of positions the session holds (``pos_max + 1``)."""
        return self.position_max(seq) + 1

    # -- state -------------------------------------------------------------------------------
    def _state_header(self, seq_length: int) -> bytes:
        model = self.model
        return _STATE_HEADER.pack(
            _STATE_MAGIC, model.layers.start, model.layers.end, model.n_layer, model.n_embd,
            seq_length, model.identity.encode()[:24],
        )

    def save_state(self, seq: int) -> bytes:
        """Serialise a session's KV (this stage's layers), tagged with the stage's identity."""
        with self._lock:
            pointer = self._context_ptr()
            size = lib.llama_state_seq_get_size(pointer, seq)
            buffer = ffi.new("uint8_t[]", size)
            written = lib.llama_state_seq_get_data(pointer, buffer, size, seq)
            if written == 0:
                raise StateMismatch(f"cannot save the state of session {seq}")
            length = self.length(seq)
        return self._state_header(length) + ffi.buffer(buffer, written)[:]

    def load_state(self, seq: int, blob: bytes) -> int:
        """Restore a state saved by :meth:`save_state` into ``seq``; returns the positions restored.

        Raises:
            StateMismatch: the blob belongs to another model, layer range or shape, or is corrupt.
        """
        if len(blob) < _STATE_HEADER.size:
            raise StateMismatch(f"state blob of {len(blob)} bytes is too short for its header")
        magic, start, end, n_layer, n_embd, length, identity = _STATE_HEADER.unpack_from(blob)
        model = self.model
        if magic != _STATE_MAGIC:
            raise StateMismatch("not a skippy sequence state (bad magic)")
        if (start, end) != (model.layers.start, model.layers.end):
            raise StateMismatch(f"state is for layers {start}:{end}, this stage runs {model.layers}")
        if (n_layer, n_embd) != (model.n_layer, model.n_embd):
            raise StateMismatch(
                f"state is for a {n_layer}-layer, {n_embd}-wide model; this one is {model.n_layer} x {model.n_embd}"
            )
        if identity.rstrip(b"\0") != model.identity.encode()[:24]:
            raise StateMismatch(f"state was saved from another model file than {model.info.path.name}")
        payload = blob[_STATE_HEADER.size:]
        self._rings.pop(seq, None)
        with self._lock:
            pointer = self._context_ptr()
            lib.llama_memory_seq_rm(self._memory_ptr(), seq, -1, -1)
            read = lib.llama_state_seq_set_data(pointer, ffi.from_buffer(payload), len(payload), seq)
            if read == 0:
                raise StateMismatch(f"llama.cpp rejected the state for session {seq}: {_callbacks.take_recent_errors()}")
        return int(length)

    # -- figures -----------------------------------------------------------------------------
    def kv_cells_used(self) -> int:
        if self.recurrent:  # the recurrent half spans one cell per sequence: count positions held
            return sum(self.length(seq) for seq in range(self.max_sessions))
        return int(lib.skippy_kv_cells_used(self._context_ptr(), self.max_sessions))

    @property
    def kv_bytes_per_cell(self) -> int:
        layers = self.model.layers
        return self.model.info.kv_bytes_per_cell(layers.start, layers.end)

    @property
    def state_bytes_per_sequence(self) -> int:
        """Recurrent-state bytes one sequence id keeps in this stage's layers (0: none)."""
        layers = self.model.layers
        return self.model.info.state_bytes_per_sequence(layers.start, layers.end)

    def memory(self) -> MemoryReport:
        used = self.kv_cells_used()
        return MemoryReport(
            weights=self.model.size_bytes,
            kv_capacity=self.n_ctx * self.kv_bytes_per_cell,
            kv_cells_used=used,
            kv_bytes_used=used * self.kv_bytes_per_cell,
            resident=resident_bytes(),
            state_per_sequence=self.state_bytes_per_sequence,
            state_capacity=self.state_bytes_per_sequence * self.max_sessions,
        )

    # -- lifetime ----------------------------------------------------------------------------
    def _context_ptr(self) -> object:
        if self._ptr == ffi.NULL:
            raise ClosedError("stage context is closed")
        return self._ptr

    def _memory_ptr(self) -> object:
        self._context_ptr()
        return self._memory

    def close(self) -> None:
        """Free the context and its KV cache; idempotent."""
        if getattr(self, "_head", None) is not None:
            self._head.close()
        with self._lock:
            if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
                lib.llama_free(self._ptr)
                self._ptr = ffi.NULL

    def __enter__(self) -> "StageContext":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
