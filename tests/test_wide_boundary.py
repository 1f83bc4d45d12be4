"""Wide stage boundaries (patch 0010): RWKV-7 hands on its first layer's values beside the hidden
state, Gemma 3n its four AltUp streams.

The unit tests pin the wire layout (protocol.md §2.6: the activation holds the hidden-state rows,
then the v_first rows, flagged RWKV7_V_FIRST_SIDEBAND; or the four streams' rows in turn, flagged
GEMMA3N_ALTUP_SIDEBAND) against the runtime's wide rows and the refusals of frames whose flags or
rows do not fit the stage.  The chain tests run real stage processes on the tiny models (three
stages, f32 wire) and must give the unsplit model's tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skippy.codec.protocol import MessageKind, StageMessage, StateFlag, WireDType, boundary_rows_flags
from skippy.codec.protocol_ext import ErrorCode
from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.lane.errors import InvalidMessage
from skippy.lane.messages import outgoing, rows_from_wire, rows_to_wire, work_item
from skippy.lane.protocol import LaneProtocol
from skippy.models import ensure_model, tiny
from skippy.runtime import Model, StageContext
from skippy.stage.executor import sideband_flag

from stage_helpers import inprocess_chain, reference_greedy, stage_chain

V_FIRST = int(StateFlag.RWKV7_V_FIRST_SIDEBAND)


def _dispatch(kind: MessageKind, **changes: object):  # type: ignore[no-untyped-def]
    return LaneProtocol(1).message_received(StageMessage.create(kind, session_id=1, **changes))


def test_wide_rows_go_out_part_by_part_and_come_back() -> None:
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    v_first = -hidden - 1
    wide = np.concatenate([hidden, v_first], axis=1)  # the runtime: one row per token
    wire = rows_to_wire(wide, 2)
    assert np.array_equal(wire, np.concatenate([hidden, v_first]))  # every hidden row, then every v_first row
    assert np.array_equal(rows_from_wire(wire, 2), wide)
    assert rows_to_wire(hidden, 1) is hidden


def test_a_wide_stage_takes_and_forwards_the_flagged_rows() -> None:
    activation = np.arange(16, dtype=np.float32).reshape(4, 4)  # 2 tokens x (hidden, v_first)
    dispatch = _dispatch(MessageKind.PREFILL_EMBD, token_count=2, activation=activation,
                         state_changes={"flags": V_FIRST})
    item = work_item(dispatch, 7, is_first=False, width=4, sideband_flag=V_FIRST)
    assert item.activations is not None and item.activations.shape == (2, 8)
    assert np.array_equal(item.activations[:, :4], activation[:2]) and np.array_equal(item.activations[:, 4:], activation[2:])
    forwarded = outgoing(dispatch.message, item.activations, WireDType.F32, V_FIRST)
    assert forwarded.state.flags & V_FIRST and forwarded.state.activation_row_multiplier == 2
    assert forwarded.activation is not None and np.array_equal(forwarded.activation, activation)


@pytest.mark.parametrize(
    ("flags", "rows", "stage_flag", "reason"),
    [
        (0, 2, V_FIRST, "flags 0x0 .*carries the sideband 0x40"),  # the hidden state without v_first
        (int(StateFlag.GEMMA3N_ALTUP_SIDEBAND), 8, V_FIRST, "flags 0x80 .*carries the sideband 0x40"),
        (int(StateFlag.INKLING_MTP_EMBD_SIDEBAND), 4, V_FIRST, "flags 0x100 .*carries the sideband 0x40"),
        (V_FIRST, 2, V_FIRST, r"shape \(2, 4\) does not match token_count 2 x 2 parts x width 4"),
        (V_FIRST, 4, 0, "flags 0x40 .*not served by this runtime"),  # an RWKV-7 frame at another model
    ],
)
def test_a_frame_whose_sideband_does_not_fit_the_stage_is_refused(flags: int, rows: int, stage_flag: int,
                                                                  reason: str) -> None:
    dispatch = _dispatch(MessageKind.PREFILL_EMBD, token_count=2, activation=np.zeros((rows, 4), np.float32),
                         state_changes={"flags": flags})
    with pytest.raises(InvalidMessage, match=reason) as raised:
        work_item(dispatch, 7, is_first=False, width=4, sideband_flag=stage_flag)
    assert raised.value.code is ErrorCode.STATE_MISMATCH


def test_a_v11_flag_or_the_boundary_rows_extension_announces_a_wide_boundary() -> None:
    assert sideband_flag("rwkv7", 2) == sideband_flag("arwkv7", 2) == V_FIRST and sideband_flag("llama", 1) == 0
    assert sideband_flag("gemma3n", 4) == int(StateFlag.GEMMA3N_ALTUP_SIDEBAND)
    assert sideband_flag("deepseek4", 4) == boundary_rows_flags(4)  # protocol.md §12
    with pytest.raises(ValueError, match="no state flag"):
        sideband_flag("rwkv7", 3)


def test_a_later_rwkv7_stage_takes_and_gives_rows_twice_as_wide() -> None:
    path = ensure_model(tiny("rwkv7"))
    with Model(path, "0:2") as head, Model(path, "2:3") as middle, Model(path, "3:4") as tail:
        assert (head.input_rows, head.output_rows) == (1, 2)
        assert (middle.input_rows, middle.output_rows) == (2, 2)
        assert (tail.input_rows, tail.output_rows) == (2, 1)
        with StageContext(middle, n_ctx=64, n_batch=16, threads=1) as context:
            seq = context.open_session()
            with pytest.raises(Exception, match=r"activations must be rows x 128 \(the model width x 2 parts\)"):
                context.decode(activations=np.zeros((1, 64), np.float32), positions=[0], seq_ids=[seq])


def test_a_later_gemma3n_stage_takes_four_streams_and_the_token_ids() -> None:
    path = ensure_model(tiny("gemma3n"))
    with Model(path, "1:3") as middle:
        assert (middle.input_rows, middle.output_rows) == (4, 4) and middle.reads_tokens


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["rwkv7", "gemma3n"])
async def test_stage_processes_match_the_unsplit_model(arch: str, tmp_path: Path) -> None:
    """The wire path: three stage processes (the sideband crosses two boundaries, f32)."""
    path = ensure_model(tiny(arch))  # type: ignore[arg-type]
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354]
    expected = reference_greedy(path, prompt, 12, chunk_size=5)
    flags = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "4", "--threads", "1"]
    async with stage_chain(str(path), ["0:1", "1:3", "3:4"], tmp_path, flags) as chain:
        async with await StageClient.connect(chain[0].address) as client:  # type: ignore[arg-type]
            tokens = await client.generate_greedy(1, prompt, 12, chunk_size=5)
    assert tokens == expected


@pytest.mark.parametrize("arch", ["rwkv7", "gemma3n"])
async def test_a_prefix_cache_hit_over_a_wide_boundary_equals_the_uncached_answer(arch: str) -> None:
    """Restores across two stages: a follow-up prompt (restore, then the suffix prefilled) and a
    prompt one token past a cached one (TryRestorePrefillDecode: its activation, with the
    sideband, goes from the restoring stage straight to the next)."""
    path = ensure_model(tiny(arch))  # type: ignore[arg-type]
    page = 8
    first = (1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243, 310, 278, 7934, 29889, 450)
    generator = Generator.from_model(path, n_ctx=512, chunk_size=8, credit=2)
    generator.cache_page_size = page
    try:
        async with inprocess_chain(["0:2", "2:4"], model=str(path), ctx_size=512, cache_page_size=page,
                                   threads=1) as servers:
            async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
                session = iter(range(1, 100))

                async def run(prompt: tuple[int, ...], cache: bool) -> tuple[list[int], int]:
                    request = GenerationRequest(prompt, 6, speculation=False, prefix_cache=cache)
                    done = await generator.generate(client, request, next(session))
                    return list(done.tokens), done.cached_tokens

                await run(first, True)
                for prompt in ((*first[:2 * page], 13, 450, 4996), first[:2 * page + 1]):
                    cached, hit = await run(prompt, True)
                    plain, _ = await run(prompt, False)
                    assert hit == 2 * page and cached == plain
            for server in servers:
                assert server.executor.cache is not None and server.executor.cache.stats.errors == 0
    finally:
        generator.close()
