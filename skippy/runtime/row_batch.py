"""A batch of fixed rows whose inputs live in fixed arrays: the decode relay's view of a context.

Strategy: the decode relay (:mod:`skippy.stage._relay`) runs one session's rows without Python, so it
needs what ``StageContext.decode`` builds per call, built once: a ``llama_batch`` pointed at
arrays of ``rows`` tokens, positions and sequence ids and ``rows`` ``n_embd`` rows of
activations (the most rows one message may have: a decode's one, a verify window's up to the
batch), every row flagged as an output.  The relay writes the tokens (first stage) or the
activations and the positions of a message's rows into those arrays and its row count into the
batch's ``n_tokens`` (:meth:`RowBatch.set_rows`; the Cython loop through its address), then calls ``skippy_decode_view`` and ``llama_get_embeddings``
(a final stage: ``llama_get_logits_ith`` and, for a sampler chain, ``llama_sampler_sample``, row
by row; ``skippy_trim_view`` first for a rollback, as the executor's auto-align trims) through
the typed table ``skippy_relay_calls()`` returns (native/cdef/skippy_relay_calls.h: the
C compiler checks its entries against llama.h) at the raw addresses :meth:`RowBatch.addresses`
gives; the pure-Python twin calls :meth:`RowBatch.trim`, :meth:`RowBatch.decode`,
:meth:`RowBatch.hidden` and :meth:`RowBatch.sample`, the same functions through cffi.  A final stage's pick is the context's own: the first maximum of the row for a
plain greedy sampler (``StageContext.sample``'s shortcut), else the session's sampler chain.

The batch is only valid while its context is open and nothing else decodes on it: the caller
(the stage's scheduler, which holds the runtime for the relay) keeps both true.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import numpy as np
import numpy.typing as npt

from skippy.runtime.errors import InvalidBatch
from skippy.runtime.ffi import ffi, lib

if TYPE_CHECKING:
    from skippy.runtime.context import StageContext
    from skippy.runtime.sampling import Sampler

__all__ = ["RowBatch"]


@final
class RowBatch:
    """``rows`` rows of session ``seq`` on ``context``; on a final stage ``sampler`` picks their tokens.

    Raises:
        InvalidBatch: ``seq`` out of range, a final stage without a sampler or with one the
            relay cannot run (a grammar's checked sampler), or
            ``rows`` outside 1..``n_batch`` (the executor splits a larger item into micro-batches).
    """

    def __init__(self, context: "StageContext", seq: int, sampler: "Sampler | None" = None, rows: int = 1) -> None:
        self.final = bool(context.model.is_last)
        if self.final and (sampler is None or sampler.checked or sampler.pointer is None):
            raise InvalidBatch("a final stage's relay batch needs a plain sampler")
        self._sampler = sampler
        self._greedy = sampler is not None and sampler.plain_greedy
        if not 0 <= seq < context.max_sessions:
            raise InvalidBatch(f"sequence id {seq} outside 0..{context.max_sessions - 1}")
        if not 1 <= rows <= context.n_batch:
            raise InvalidBatch(f"a relay batch of {rows} rows (1..{context.n_batch})")
        self._context = context
        self.width = context.n_embd
        #: The most rows one decode may have, and the sequence id they go to.
        self.rows, self.seq = rows, seq
        #: The rows of the next (or last) decode.
        self.active = rows
        self.token: npt.NDArray[np.int32] = np.zeros(rows, dtype=np.int32)
        self.position: npt.NDArray[np.int32] = np.zeros(rows, dtype=np.int32)
        self.embd: npt.NDArray[np.float32] = np.zeros(rows * self.width, dtype=np.float32)
        self._seq = np.full(rows, seq, dtype=np.int32)
        self._n_seq = np.ones(rows, dtype=np.int32)
        self._outputs = np.ones(rows, dtype=np.int8)
        self._seq_ptrs = ffi.new("llama_seq_id *[]", rows)
        self._batch = ffi.new("struct llama_batch *")
        first = context.model.is_first
        lib.skippy_batch_view(
            self._batch, rows,
            ffi.cast("llama_token *", ffi.from_buffer(self.token)) if first else ffi.NULL,
            ffi.NULL if first else ffi.cast("float *", ffi.from_buffer(self.embd)),
            ffi.cast("llama_pos *", ffi.from_buffer(self.position)),
            ffi.cast("int32_t *", ffi.from_buffer(self._n_seq)), self._seq_ptrs,
            ffi.cast("llama_seq_id *", ffi.from_buffer(self._seq)),
            ffi.cast("int8_t *", ffi.from_buffer(self._outputs)),
        )

    def addresses(self) -> dict[str, int]:
        """Raw addresses for the Cython relay: the context, the batch, the table of llama.cpp calls
        and the three input slots (a final stage: its sampler chain, 0 for the greedy pick)."""
        def address(pointer: object) -> int:
            return int(ffi.cast("uintptr_t", pointer))

        addresses = {
            "context": address(self._context._context_ptr()),
            "batch": address(self._batch),
            "calls": address(lib.skippy_relay_calls()),
            "token": address(ffi.from_buffer(self.token)),
            "position": address(ffi.from_buffer(self.position)),
            "embd": address(ffi.from_buffer(self.embd)),
            "n_tokens": address(ffi.addressof(self._batch[0], "n_tokens")),
        }
        if self.final:
            assert self._sampler is not None
            addresses["sampler"] = 0 if self._greedy else address(self._sampler.pointer)
        return addresses

    def set_rows(self, rows: int) -> None:
        """Decode the first ``rows`` rows (1..``rows`` of the batch) next (the twin's call)."""
        if not 1 <= rows <= self.rows:
            raise InvalidBatch(f"{rows} rows in a relay batch of {self.rows}")
        self._batch.n_tokens = self.active = rows

    def decode(self) -> int:
        """Run the row (the twin's call); llama_decode's return code."""
        return int(lib.skippy_decode_view(self._context._context_ptr(), self._batch))

    def hidden(self) -> npt.NDArray[np.float32]:
        """The last decode's output activations, ``active * width`` floats (a view valid until the next decode)."""
        pointer = lib.llama_get_embeddings(self._context._context_ptr())
        return np.frombuffer(ffi.buffer(pointer, self.active * self.width * 4), dtype=np.float32)

    def trim(self, length: int) -> bool:
        """Keep positions ``[0, length)`` of the sequence (the twin's call); False: not trimmed."""
        return int(lib.skippy_trim_view(self._context._context_ptr(), self.seq, length)) == 0

    def sample(self, row: int = 0) -> int:
        """The final stage's token for decoded row ``row`` (the twin's call; -1: no logits)."""
        pointer = self._context._context_ptr()
        if not self._greedy:
            assert self._sampler is not None
            return int(lib.llama_sampler_sample(self._sampler.pointer, pointer, row))
        logits = lib.llama_get_logits_ith(pointer, row)
        if logits == ffi.NULL:
            return -1
        return int(np.frombuffer(ffi.buffer(logits, self._context.model.n_vocab * 4), dtype=np.float32).argmax())

    def finished(self, steps: int, rows: int | None = None) -> None:
        """Tell the context a relay decoded on it (its last batch was one of ours of ``rows`` rows,
        the batch's by default, ``steps`` > 0)."""
        self._context.note_external_decode((self.rows if rows is None else rows) if steps > 0 else 0)
