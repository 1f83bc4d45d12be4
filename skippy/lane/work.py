"""What the runtime is asked to do for one message, and what it gives back (plain data).

A :class:`WorkItem` is built from a message by :func:`skippy.lane.messages.work_item` (every
count checked against the frame first); the stage's executor runs it and returns a
:class:`WorkResult`.  Nothing here imports the runtime: the sampling settings are opaque.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy.codec.protocol_ext import TokenLogprobs
from skippy.lane.protocol import Outputs

__all__ = ["FloatArray", "IntArray", "WorkItem", "WorkResult"]

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]


@dataclasses.dataclass(slots=True)
class WorkItem:
    """One executable message, reduced to what the runtime needs."""

    session: int
    positions: IntArray
    tokens: IntArray | None = None
    activations: FloatArray | None = None
    align_to: int | None = None
    outputs: Outputs = Outputs.LAST
    #: The runtime's ``SamplingParams`` (opaque here: the lane never names the runtime).
    sampling: Any = None
    #: The message's token sideband (every stage gets it; the cache records from it).
    prompt_tokens: IntArray | None = None
    #: A prefill chunk (its tokens extend the session's prompt); the final one records it.
    prefill: bool = False
    final_prefill: bool = False
    #: docs/protocol.md §14: a replay frame of a resumed session (a stage holding its positions
    #: answers it from its activation log).
    replay: bool = False
    #: Rows (one per position), and whether it is a single-row decode that may share a native
    #: batch with other sessions' decodes: plain fields, set once (an item is never reshaped).
    rows: int = dataclasses.field(init=False)
    batchable: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.rows = rows = int(self.positions.shape[0])
        self.batchable = rows == 1 and self.outputs is not Outputs.ALL


@dataclasses.dataclass(slots=True)
class WorkResult:
    """What one item produced."""

    activations: FloatArray | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    batch_size: int = 1
    compute_us: int = 0
    trimmed_tokens: int = 0
    #: Tokens the prefix cache newly cached after this item (a final prefill chunk).
    recorded_tokens: int = 0
    #: One entry per predicted token, for a session that asked for logprobs (final stage).
    logprobs: list[TokenLogprobs] | None = None
