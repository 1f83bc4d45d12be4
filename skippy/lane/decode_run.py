"""Decode runs (``docs/protocol.md`` §11): the first stage drives a session's decode loop itself.

Strategy: hop by hop, every decoded token makes a round trip through the driver (reply up, the
driver's next DecodeEmbd down), so each token pays the driver's Python and two socket hops on its
critical path.  A **decode run** starts with one DecodeEmbd flagged ``DECODE_RUN`` (bit 14) whose
chat metadata says how many predictions to make and which tokens end the run; from then on the
first stage, when a step's prediction comes back (from its own sampler on a one-stage chain, from
downstream otherwise), answers it upstream as usual *and* feeds that token to the session's next
step at once.  Downstream stages see plain, unflagged DecodeEmbd messages: only the first stage
needs to know.  The driver reads one PredictedToken per step, streams them, and stops a run early
by sending any message for the session (a Stop or a Trim): the first stage starts no step after
that message arrived, and the steps already started are answered before its reply (message order).

This module is the sans-IO part of the run (its request, which the driver writes too, is
:class:`skippy.codec.decode_run.DecodeRunRequest`): the run's state (:class:`DecodeRun`), which turns each
predicted token into the next step's message or says the run is over.  The connection
(:mod:`skippy.stage.connection`) wires it to its tasks.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from skippy.codec.decode_run import DecodeRunRequest
from skippy.codec.protocol import MessageKind, StageMessage, StateFlag, StateHeader
from skippy.codec.protocol_ext import DECODE_RUN_FLAG

__all__ = ["DecodeRun"]

#: Header bits a run's own steps never carry: the run flag and the optional sections' bits.
_STEP_CLEARED: Final = DECODE_RUN_FLAG | int(StateFlag.CHAT_SAMPLING_METADATA) | int(StateFlag.SAMPLING)


class DecodeRun:
    """One session's run on the first stage: which step comes next, and when it ends.

    Args:
        message: the run's flagged DecodeEmbd (its session, position, step and header).
        request: what the run asks for.
    """

    __slots__ = ("session_id", "request_id", "position", "decode_step", "left", "stop_tokens", "cancelled",
                 "announced", "steps", "_flags", "_template")

    def __init__(self, message: StageMessage, request: DecodeRunRequest) -> None:
        self.session_id = message.session_id
        self.request_id = message.request_id
        #: The position of the step in flight (the next step's is one more).
        self.position = message.pos_start
        self.decode_step = message.state.decode_step
        #: Predictions still to make, the one in flight included.
        self.left = request.max_tokens
        self.stop_tokens = request.stop_tokens
        #: A message for the session arrived after the run started: no further step starts.
        self.cancelled = False
        #: The run's first reply (which says the stage runs it) has been answered.
        self.announced = False
        #: Steps this run started, the flagged message's included.
        self.steps = 1
        self._template = message.state
        self._flags = message.state.flags & ~_STEP_CLEARED

    def first_message(self, message: StageMessage) -> StageMessage:
        """The flagged message as the run's first step: without the run flag and metadata (what
        the stage executes and forwards)."""
        state = self._template
        return StageMessage(
            MessageKind.DECODE_EMBD, pos_start=message.pos_start, token_count=message.token_count,
            state=self._header(state.decode_step, state.current_token), request_id=message.request_id,
            session_id=message.session_id, sampling=message.sampling, tokens=message.tokens,
            positions=message.positions, activation=message.activation)

    def advance(self, token: int) -> StageMessage | None:
        """The step in flight predicted ``token``: the next step's message, or None when the run
        is over (its budget spent, a stop token, or cancelled)."""
        self.left -= 1
        if self.cancelled or self.left <= 0 or token in self.stop_tokens:
            self.left = 0
            return None
        self.position += 1
        if self.decode_step >= 0:
            self.decode_step += 1
        self.steps += 1
        return StageMessage(
            MessageKind.DECODE_EMBD, pos_start=self.position, token_count=1,
            state=self._header(self.decode_step, token), request_id=self.request_id, session_id=self.session_id,
            tokens=np.array((token,), dtype=np.int32))

    def carried(self, steps: int) -> None:
        """The data plane drove ``steps`` more steps after the one in flight (skippy.stage.decode_relay):
        the last of them is now the step in flight, as :meth:`advance` would have left it."""
        self.left -= steps
        self.position += steps
        if self.decode_step >= 0:
            self.decode_step += steps
        self.steps += steps

    @property
    def over(self) -> bool:
        """No step of the run is in flight or to come."""
        return self.left <= 0

    def _header(self, decode_step: int, token: int) -> StateHeader:
        state = self._template
        return StateHeader(version=state.version, seq_id=state.seq_id, phase=state.phase, flags=self._flags,
                           checkpoint_generation=state.checkpoint_generation,
                           prompt_token_count=state.prompt_token_count, decode_step=decode_step,
                           current_token=token, source_stage_index=state.source_stage_index,
                           reserved=state.reserved)
