"""A runtime that computes nothing: the surface of ``Model`` + ``StageContext`` without llama.cpp.

Strategy: tests that are about the stage server (framing, ordering, credits, failures) and the
per-boundary overhead benchmark need a stage that answers instantly and predictably.  ``NullModel``
and ``NullContext`` mirror the attributes and methods the stage server uses, with a deterministic
"model": the first stage writes each row's token id into column 0 of an otherwise zero
activation, middle stages pass their input activations through unchanged, and the final stage
predicts ``(column 0 + 1) % n_vocab`` (or ``token + 1`` when it is also the first stage).  So a chain of null stages of any length answers
token ``t`` with ``t + 1``, and a test can check plumbing end to end without a model file.
Per-session KV is modelled as a set of held positions per sequence id, so trims, rollbacks,
session reuse and leaks are observable through ``length`` and ``kv_cells_used``; each sequence's
length is kept next to its set, so ``length`` (asked before every decode) is O(1), not a scan.
``copy`` / ``save_state`` / ``load_state`` give it the KV surface the prefix cache needs
(:class:`skippy.cache.KvBackend`), so lane tests can run a stage with its cache on; a copied
position counts once per sequence in ``kv_cells_used`` (llama.cpp would share the cell).

A model spec string selects it from the command line: ``null:n_embd=64,n_layer=4,n_vocab=32000``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, final

import numpy as np
import numpy.typing as npt

from skippy.runtime.errors import ContextError, InvalidBatch, SessionError, StateMismatch
from skippy.runtime.model import LayerRange
from skippy.runtime.sampling import Sampler

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]

NULL_PREFIX = "null:"
#: Magic of a null sequence state (``save_state``), then u32 count and i32 positions.
_STATE_MAGIC = b"SKNULKV1"
#: Placeholder for the per-row values a middle stage never reads.
_NO_VALUES = np.zeros(0, dtype=np.int32)


@dataclasses.dataclass(frozen=True, slots=True)
class NullSpec:
    """Shape of a null model."""

    n_embd: int = 64
    n_layer: int = 4
    n_vocab: int = 32000

    @classmethod
    def parse(cls, text: str) -> "NullSpec":
        """Parse ``null:key=value,...`` (keys: n_embd, n_layer, n_vocab).

        Raises:
            ValueError: not a null spec, unknown key or non-positive value.
        """
        if not text.startswith(NULL_PREFIX):
            raise ValueError(f"{text!r} is not a null model spec (null:n_embd=..,n_layer=..)")
        values: dict[str, int] = {}
        body = text[len(NULL_PREFIX):]
        for part in filter(None, body.split(",")):
            key, _, value = part.partition("=")
            if key not in {"n_embd", "n_layer", "n_vocab"}:
                raise ValueError(f"unknown null model key {key!r} in {text!r}")
            values[key] = int(value)
            if values[key] <= 0:
                raise ValueError(f"null model {key} must be > 0 (got {value})")
        return cls(**values)


def is_null_spec(text: str) -> bool:
    return text.startswith(NULL_PREFIX)


@final
class NullModel:
    """Layers ``[start, end)`` of a model that does not exist."""

    def __init__(self, spec: NullSpec | str, layers: LayerRange | str | None = None) -> None:
        self.spec = NullSpec.parse(spec) if isinstance(spec, str) else spec
        if layers is None:
            layers = LayerRange(0, self.spec.n_layer)
        elif isinstance(layers, str):
            layers = LayerRange.parse(layers)
        if not 0 <= layers.start < layers.end <= self.spec.n_layer:
            raise ValueError(f"layer range {layers} is out of bounds for {self.spec.n_layer} layers")
        self.layers = layers
        self.n_layer = self.spec.n_layer
        self.n_embd = self.spec.n_embd
        self.n_vocab = self.spec.n_vocab
        self.identity = f"null-{self.n_layer}x{self.n_embd}"
        self.architecture = "null"

    @property
    def is_first(self) -> bool:
        return self.layers.start == 0

    @property
    def is_last(self) -> bool:
        return self.layers.end == self.n_layer

    def is_end_of_generation(self, token: int) -> bool:
        return False

    def close(self) -> None:
        """Nothing to free."""

    def __enter__(self) -> "NullModel":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@final
class NullContext:
    """``StageContext`` without compute; see the module header for its arithmetic."""

    #: The stage scheduler runs a null context inline (no worker thread): it never blocks.
    blocking = False
    #: No compute, so no compute threads beside the caller (``StageContext.compute_threads``).
    compute_threads = 1

    def __init__(self, model: NullModel, *, n_ctx: int = 4096, max_sessions: int = 8,
                 n_batch: int = 512, n_ubatch: int | None = None, threads: int | None = None) -> None:
        if n_ctx <= 0 or n_batch <= 0 or not 1 <= max_sessions <= 256:
            raise ContextError(f"invalid context sizes: n_ctx={n_ctx}, n_batch={n_batch}, max_sessions={max_sessions}")
        self.model = model
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.max_sessions = max_sessions
        self.n_embd = model.n_embd
        self._free = list(range(max_sessions - 1, -1, -1))
        self._open: set[int] = set()
        self._held: dict[int, set[int]] = {}
        #: max(held) + 1 per sequence (0 when empty).
        self._length: dict[int, int] = {}
        self._rows = 0
        self._output_rows: npt.NDArray[np.intp] = np.zeros(0, dtype=np.intp)
        self._activations: FloatArray = np.zeros((0, model.n_embd), dtype=np.float32)
        self._predicted: IntArray = np.zeros(0, dtype=np.int32)

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self) -> int:
        if not self._free:
            raise SessionError(f"all {self.max_sessions} sessions are in use")
        seq = self._free.pop()
        self._open.add(seq)
        self._held[seq] = set()
        self._length[seq] = 0
        return seq

    def close_session(self, seq: int) -> None:
        if seq not in self._open:
            raise SessionError(f"session {seq} is not open")
        self._open.discard(seq)
        self._held.pop(seq, None)
        self._length.pop(seq, None)
        self._free.append(seq)
        self._free.sort(reverse=True)

    @property
    def sessions_in_use(self) -> int:
        return len(self._open)

    # -- compute -----------------------------------------------------------------------------
    def decode(self, *, positions: Sequence[int] | IntArray, seq_ids: Sequence[int] | IntArray,
               tokens: Sequence[int] | IntArray | None = None, activations: FloatArray | None = None,
               outputs: Sequence[bool] | npt.NDArray[np.bool_] | None = None) -> None:
        model = self.model
        if (tokens is None) == (activations is None):
            raise InvalidBatch("give exactly one of tokens or activations")
        if tokens is not None and not model.is_first:
            raise InvalidBatch(f"tokens given to a stage starting at layer {model.layers.start}; it takes activations")
        if activations is not None and model.is_first:
            raise InvalidBatch("activations given to the first stage (layer 0); it takes tokens")
        pos = np.asarray(positions, dtype=np.int32)
        seq = np.asarray(seq_ids, dtype=np.int32)
        rows = int(pos.shape[0])
        if rows <= 0 or seq.shape != (rows,):
            raise InvalidBatch("positions and seq_ids must be equal-length 1-D")
        if rows > self.n_batch:
            raise InvalidBatch(f"{rows} rows exceed the context's batch size {self.n_batch}")
        if tokens is not None:
            values = np.asarray(tokens, dtype=np.int32)
            if values.shape != (rows,):
                raise InvalidBatch(f"{values.shape} tokens for {rows} positions")
            low, high = (int(values[0]),) * 2 if rows == 1 else (int(values.min()), int(values.max()))
            if low < 0 or high >= model.n_vocab:
                raise InvalidBatch(f"token ids must be in 0..{model.n_vocab - 1}")
        else:
            assert activations is not None
            if activations.ndim != 2 or activations.shape != (rows, self.n_embd):
                raise InvalidBatch(f"activations must be {rows} x {self.n_embd}; got {activations.shape}")
            values = activations[:, 0].astype(np.int32) if model.is_last else _NO_VALUES
        pairs = ((int(seq[0]), int(pos[0])),) if rows == 1 else zip(seq.tolist(), pos.tolist())
        for s, p in pairs:
            if s not in self._open:
                raise InvalidBatch(f"sequence id {s} is not open")
            held = self._held[s]
            if len(held) >= self.n_ctx:
                raise InvalidBatch(f"session {s} is full ({self.n_ctx} positions)")
            held.add(p)
            if p >= self._length[s]:
                self._length[s] = p + 1
        self._rows = rows
        if model.is_last:
            if outputs is None:
                flags = np.zeros(rows, dtype=bool)
                _, first_from_end = np.unique(seq[::-1], return_index=True)
                flags[rows - 1 - first_from_end] = True
            else:
                flags = np.asarray(outputs, dtype=bool)
            self._output_rows = np.flatnonzero(flags)
            self._predicted = ((values.astype(np.int64) + 1) % model.n_vocab).astype(np.int32)
        elif activations is not None:  # a middle stage passes its input through unchanged
            self._activations = activations
            self._output_rows = np.arange(rows)
        else:
            out = np.zeros((rows, self.n_embd), dtype=np.float32)
            out[:, 0] = values
            self._activations = out
            self._output_rows = np.arange(rows)

    def activations(self) -> FloatArray:
        if self.model.is_last:
            raise InvalidBatch("the final stage produces logits, not activations")
        return self._activations

    def logits(self, row: int) -> FloatArray:
        if row not in self._output_rows:
            raise InvalidBatch(f"row {row} was not an output row of the last decode")
        result = np.zeros(self.model.n_vocab, dtype=np.float32)
        result[int(self._predicted[row])] = 1.0
        return result

    @property
    def output_rows(self) -> npt.NDArray[np.intp]:
        return self._output_rows

    def sample(self, samplers: Sequence[Sampler], rows: Sequence[int]) -> IntArray:
        for row in rows:
            if row not in self._output_rows:
                raise InvalidBatch(f"row {row} was not an output row of the last decode")
        return np.asarray([int(self._predicted[row]) for row in rows], dtype=np.int32)

    # -- KV ----------------------------------------------------------------------------------
    def remove(self, seq: int, start: int = -1, end: int = -1) -> bool:
        held = self._held.get(seq)
        if held is None:
            return True
        low = 0 if start < 0 else start
        high = None if end < 0 else end
        kept = {p for p in held if p < low or (high is not None and p >= high)}
        self._held[seq] = kept
        self._length[seq] = (max(kept) + 1) if kept else 0
        return True

    def trim(self, seq: int, length: int) -> None:
        self.remove(seq, length, -1)

    def copy(self, source: int, destination: int, start: int = -1, end: int = -1) -> None:
        """Add ``source``'s positions in ``[start, end)`` to ``destination`` (both open)."""
        for seq in (source, destination):
            if seq not in self._open:
                raise SessionError(f"sequence id {seq} is not open")
        low = 0 if start < 0 else start
        copied = {p for p in self._held[source] if p >= low and (end < 0 or p < end)}
        held = self._held[destination]
        held |= copied
        self._length[destination] = (max(held) + 1) if held else 0

    def save_state(self, seq: int) -> bytes:
        """The sequence's positions as a blob (:meth:`load_state` reads it back)."""
        if seq not in self._open:
            raise StateMismatch(f"cannot save the state of session {seq}: not open")
        positions = sorted(self._held[seq])
        return _STATE_MAGIC + np.asarray([len(positions)], dtype="<u4").tobytes() + np.asarray(
            positions, dtype="<i4").tobytes()

    def load_state(self, seq: int, blob: bytes) -> int:
        """Replace the sequence's positions with a saved blob's; returns the positions loaded.

        Raises:
            StateMismatch: not a null state, or a truncated / padded one.
        """
        if seq not in self._open:
            raise StateMismatch(f"cannot load a state into session {seq}: not open")
        if len(blob) < 12 or blob[:8] != _STATE_MAGIC:
            raise StateMismatch("not a null sequence state (bad magic)")
        count = int(np.frombuffer(blob, dtype="<u4", count=1, offset=8)[0])
        if len(blob) != 12 + 4 * count:
            raise StateMismatch(f"null state of {len(blob)} bytes does not hold {count} positions")
        held = set(int(p) for p in np.frombuffer(blob, dtype="<i4", count=count, offset=12))
        self._held[seq] = held
        self._length[seq] = (max(held) + 1) if held else 0
        return count

    @property
    def kv_bytes_per_cell(self) -> int:
        """What a KV cell would hold in f16 K and V (for cache byte budgets)."""
        return 4 * self.n_embd * self.model.layers.n_layers

    def length(self, seq: int) -> int:
        return self._length.get(seq, 0)

    def kv_cells_used(self) -> int:
        return sum(len(held) for held in self._held.values())

    def close(self) -> None:
        """Nothing to free."""

    def __enter__(self) -> "NullContext":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
