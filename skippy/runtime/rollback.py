"""Rollback of recurrent state: per-session checkpoints and the rows decoded since them.

Strategy: a recurrent layer (conv / SSM / WKV / delta-net) keeps one state per sequence, the
result of every row it has seen; llama.cpp cannot trim it to an earlier position the way it
drops KV cells (``llama_memory_seq_rm`` of a partial range fails).  A :class:`StageContext` of a
recurrent or hybrid model therefore keeps, per session, a short ring of :class:`Checkpoint`\\ s:
a copy of the session's recurrent state (only this stage's layers: patch 0005; a hybrid's
attention KV is not copied, it is trimmed as usual) taken *before* a decode, and the input rows
(tokens or activations) decoded after it, one :class:`Chunk` per decode call.  Rolling back to
``length`` restores the newest checkpoint at or before ``length``, trims the attention KV to its
position and decodes the logged chunks again up to ``length``, chunk by chunk, so the state at
every whole chunk is bitwise the one the session had (a chunk cut by ``length`` is decoded as a
shorter chunk, as a session that never saw the rolled-back rows would have decoded it).  The
rollback is local to the stage: each stage replays its own inputs, which are the rows the
previous stage really sent for those positions.

One cut is not bitwise on a chain: a chunk of several rows cut to its first row.  A later stage
replays the row it received, which its upstream computed inside the chunk's batch (ggml's
n >= 2 kernels; Qwen3.5's chunked delta net), while the unsplit model replays it alone through
every layer (vec_dot; the autoregressive delta net); a head of two rows or more gets the same
bits either way.  No stage can make its upstream's one-row bits, so such a cut is never asked
for: the speculation driver sends a window cut to its first row again as a 1-row window instead
of trimming into it (:mod:`skippy.driver.speculation.runner`), and a prefix copy (a fork, a
prefix-cache record) that would make it is refused on every stage alike
(:meth:`StageContext.copy`); a trim to it (another driver's TrimSession, a message's
authoritative position) is refused on every stage that runs some but not all of the layers
(:meth:`StageContext.trim`), and made on one stage running them all (exact there).

When: a checkpoint is taken before every decode that brings a session more than one row (a
prefill chunk, a verify window) and before a one-row decode once ``interval`` rows were logged
since the newest one (decode steps, decode runs).  At most ``depth`` checkpoints are kept: the
newest ``depth // 2`` as they are (the verify windows in flight), the older ones thinned out
geometrically (the one whose neighbours are closest is merged into the one before it), so a
session reaches back to its oldest checkpoint whatever its length -- a decode run that got far
ahead of its driver included -- at the price of decoding more rows again the further back it goes;
the oldest is dropped once more than ``rows`` rows are logged after it.  Memory per session:
``depth`` copies of its recurrent state for this stage's layers, and at most ``rows`` logged rows
(4 bytes each on the first stage, ``n_embd x 4`` on the others).  A rollback past the oldest
checkpoint is refused (``SessionError`` naming it), never approximated.

Why not llama.cpp's own ``n_rs_seq`` snapshots (the tree's MTP rollback): they exist for 11
architectures only (not Mamba/Mamba-2, Jamba, Falcon-H1, Granite 4, Qwen3-Next, RWKV, ...), hold
the states after the last ``n_rs_seq`` rows *of the last decode* only, single use (a decode run's
overshoot, a stale pipelined window, a fork or a prefix cut at a page are out of their reach),
and change how llama.cpp splits a batch into micro-batches.  Checkpoints here are a byte copy of
the state (exact by construction), for every recurrent architecture, on every trimming path;
what they cost is measured by ``bench/recurrent_checkpoint.py`` (bench/RESULTS-recurrent.md).
"""

from __future__ import annotations

import dataclasses
from typing import Final

import numpy as np
import numpy.typing as npt

#: llama.h LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a hybrid's recurrent state without its attention KV.
STATE_PARTIAL_ONLY: Final = 1
#: Checkpoints kept per session (the default covers the driver's 4 pipelined verify windows).
DEFAULT_DEPTH: Final = 6
#: One-row decodes between two checkpoints.
DEFAULT_INTERVAL: Final = 8
#: Most rows logged since a session's oldest checkpoint.
DEFAULT_ROWS: Final = 1024


@dataclasses.dataclass(slots=True)
class Chunk:
    """Rows of one session decoded in one call: positions ``start .. start + rows - 1``."""

    start: int
    tokens: npt.NDArray[np.int32] | None
    activations: npt.NDArray[np.float32] | None

    @property
    def rows(self) -> int:
        data = self.tokens if self.tokens is not None else self.activations
        assert data is not None
        return int(data.shape[0])

    def head(self, rows: int) -> "Chunk":
        """The chunk's first ``rows`` rows."""
        return Chunk(self.start, None if self.tokens is None else self.tokens[:rows],
                     None if self.activations is None else self.activations[:rows])


@dataclasses.dataclass(slots=True)
class Checkpoint:
    """The session's recurrent state when it held ``[0, position)`` (``state`` None: empty), and
    the chunks decoded after it until the next checkpoint."""

    position: int
    state: bytearray | None
    chunks: list[Chunk] = dataclasses.field(default_factory=list)

    @property
    def rows(self) -> int:
        """Rows logged after it (its chunks are contiguous from ``position``)."""
        return self.end - self.position

    @property
    def end(self) -> int:
        """Position after the last logged row."""
        return self.chunks[-1].start + self.chunks[-1].rows if self.chunks else self.position

    @property
    def nbytes(self) -> int:
        logged = sum((c.tokens.nbytes if c.tokens is not None else 0)
                     + (c.activations.nbytes if c.activations is not None else 0) for c in self.chunks)
        return (len(self.state) if self.state is not None else 0) + logged


@dataclasses.dataclass(slots=True)
class RollbackStats:
    """What checkpoints cost a context, summed over its sessions (for bench/ and the stats)."""

    checkpoints: int = 0
    checkpoint_bytes: int = 0  #: the checkpoints' states now held (logged rows apart)
    checkpoint_ns: int = 0
    rollbacks: int = 0
    replayed_rows: int = 0
    rollback_ns: int = 0  #: restore + replay
    restore_ns: int = 0  #: the checkpoint's copy back and the attention KV's trim
    refused: int = 0
