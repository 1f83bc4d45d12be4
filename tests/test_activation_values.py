"""Activations with NaN, infinity or absurd magnitudes are refused before they reach the KV cache.

Found by the fuzz campaign (``bench/fuzz_stage.py`` on the tiny llama): a peer that sends a later
stage activations full of NaN gets NaN K/V cells, and a NaN cell poisons every other session whose
attention spans it (the mask is *added* to K.q, and NaN + -inf is NaN), so from then on the
legitimate session's logits were NaN and its greedy token was 0.  Checked here:

* the value check itself (NaN, +-inf, beyond the limit, the limit itself, an empty array);
* on a real 2-stage tiny llama chain in this process: a raw lane to the *second* stage sends a
  prefill whose activations hold NaN (then one with huge finite values) and is refused with an
  Error frame naming the reason (after the early ACK of a non-final chunk) and the close, nothing
  of it stays in the KV, and a legitimate generation through the first stage afterwards gets
  exactly the unsplit greedy tokens.  (Without the check the chunk is computed and ACKed, the lane
  stays open with its NaN cells resident, and the legitimate tokens are wrong.)
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from skippy.codec.protocol import MessageKind
from skippy.driver import StageClient
from skippy.lane.errors import InvalidMessage
from skippy.runtime import Model
from skippy.stage.executor import ACTIVATION_LIMIT, check_activation_values

from hostile_frames import dial, raw_frame, until_closed
from stage_helpers import inprocess_chain, reference_greedy

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]


@pytest.mark.parametrize("value, reason", [(np.nan, "NaN values"), (np.inf, "infinite values .an f16 wire"),
                                           (-np.inf, "wire-dtype f32 or q8"), (ACTIVATION_LIMIT * 10, "beyond"),
                                           (-ACTIVATION_LIMIT * 10, "beyond")])
def test_bad_values_are_refused_naming_why(value: float, reason: str) -> None:
    rows = np.zeros((3, 16), dtype=np.float32)
    rows[2, 7] = value
    with pytest.raises(InvalidMessage, match=reason):
        check_activation_values(rows)


def test_ordinary_and_limit_values_pass() -> None:
    rng = np.random.default_rng(0)
    check_activation_values(rng.standard_normal((8, 64)).astype(np.float32) * 1e4)
    check_activation_values(np.full((1, 4), ACTIVATION_LIMIT, dtype=np.float32))
    check_activation_values(np.zeros((0, 4), dtype=np.float32))


def _poisoned_prefill(width: int, value: float, session: int) -> bytes:
    """A PrefillEmbd from "stage 0" carrying ``len(PROMPT)`` activation rows full of ``value``."""
    rows = len(PROMPT)
    frame = raw_frame(MessageKind.PREFILL_EMBD, token_count=rows, tokens=rows, positions=rows,
                      source_stage_index=0, activation_rows=rows, width=width, session_id=session)
    body = struct.pack(f"<{rows}i", *PROMPT) + struct.pack(f"<{rows}i", *range(rows))
    head = frame[:len(frame) - len(body) - rows * width * 4]
    return head + body + np.full((rows, width), value, dtype=np.float32).tobytes()


async def test_a_later_stage_refuses_poisoned_activations_and_other_sessions_are_exact(tiny_llama: Path) -> None:
    with Model(tiny_llama) as model:
        width = model.n_embd
    reference = reference_greedy(tiny_llama, PROMPT, 12, chunk_size=8)
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama)) as (first, second):
        assert first.address is not None and second.address is not None
        attackers = []
        for session, value in ((901, np.nan), (902, 1e30)):
            attacker = await dial(second.address.host, second.address.port)
            attackers.append(attacker)
            await attacker.send_all(_poisoned_prefill(width, value, session))
            answer = await until_closed(attacker, 10)  # an early ACK, then the Error frame and the close
            assert b"activation refused" in answer, answer
        assert second.stats.sessions_in_use == 0  # nothing of the attack stays in the KV
        async with await StageClient.connect(first.address) as client:
            tokens = await client.generate_greedy(1, PROMPT, 12, chunk_size=8)
        assert tokens == reference
        for attacker in attackers:
            await attacker.aclose()
