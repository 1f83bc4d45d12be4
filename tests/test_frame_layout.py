"""The frame offsets' one module (skippy.codec._frame_layout): current in the Cython include, and true of
what both codecs write."""

from __future__ import annotations

import importlib
import struct
from types import ModuleType

import numpy as np
import pytest

from skippy.codec import _frame_layout as layout
from skippy.codec.protocol import MessageKind, StageMessage, StageReply, WireDType
from skippy.codec.protocol_ext import TimingRecord, TimingsFrame

IMPLEMENTATIONS = {"py": "skippy.codec._wire_py", "c": "skippy.codec._wire"}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def wire(request: pytest.FixtureRequest) -> ModuleType:
    if request.param == "c":
        return pytest.importorskip(IMPLEMENTATIONS["c"], reason="Cython extension not built")
    return importlib.import_module(IMPLEMENTATIONS[request.param])


def test_the_cython_include_is_generated_from_the_layout() -> None:
    assert layout.PXI.read_text() == layout.pxi_text(), "run `python -m skippy.codec._frame_layout`"


def test_every_message_offset_reads_back_the_field_the_codec_wrote(wire: ModuleType) -> None:
    message = StageMessage.create(
        MessageKind.DECODE_EMBD, pos_start=41, token_count=1, request_id=0x1122334455, session_id=0x66778899AA,
        tokens=np.asarray([7], dtype=np.int32), activation=np.ones((1, 8), dtype=np.float32),
        state_changes={"seq_id": 3, "decode_step": 5, "current_token": 7, "source_stage_index": 2})
    frame = wire.encode_message(message, WireDType.F16, 8)
    i32 = lambda offset: struct.unpack_from("<i", frame, offset)[0]  # noqa: E731
    u64 = lambda offset: struct.unpack_from("<Q", frame, offset)[0]  # noqa: E731
    state = message.state
    assert i32(layout.KIND) == MessageKind.DECODE_EMBD and i32(layout.POS_START) == 41
    assert (i32(layout.TOKEN_COUNT), i32(layout.TOKEN_N), i32(layout.POSITION_N)) == (1, 1, 0)
    assert [i32(layout.STATE + 4 * index) for index in range(layout.STATE_FIELDS)] == [
        state.version, state.seq_id, state.phase, state.flags, state.checkpoint_generation,
        state.prompt_token_count, state.decode_step, state.current_token, state.source_stage_index,
        int(WireDType.F16)]
    assert (i32(layout.VERSION), i32(layout.FLAGS), i32(layout.DECODE_STEP)) == (state.version, state.flags, 5)
    assert (i32(layout.CURRENT_TOKEN), i32(layout.SOURCE_STAGE), i32(layout.WIRE_DTYPE)) == (7, 2, WireDType.F16)
    assert (u64(layout.REQUEST_ID), u64(layout.SESSION_ID)) == (0x1122334455, 0x66778899AA)
    assert i32(layout.FIXED_HEADER) == 7 and len(frame) == layout.FIXED_HEADER + 4 + 8 * 2


def test_the_reply_offsets_read_back_a_predicted_token_after_its_timings(wire: ModuleType) -> None:
    timings = TimingsFrame((TimingRecord(1, 2, 4, 1, 123, 0, 0, 0),))
    frame = wire.encode_timings(timings) + wire.encode_reply(StageReply.predicted_token(99))
    assert len(frame) == layout.TIMINGS_BYTES + layout.REPLY_BYTES
    assert struct.unpack_from("<ii", frame, 0) == (layout.TIMINGS_MAGIC, 1)
    assert struct.unpack_from("<q", frame, layout.TIMINGS_COMPUTE)[0] == 123
    reply = frame[layout.TIMINGS_BYTES:]
    assert struct.unpack_from("<i", reply, layout.REPLY_TOKEN)[0] == 99
    assert struct.unpack_from("<i", reply, layout.REPLY_VECTOR_ENTRY)[0] == 99
    assert struct.unpack_from("<i", reply, layout.REPLY_DRAFT)[0] == 0


def test_the_logprobs_offsets_read_back_a_logprobs_frame(wire: ModuleType) -> None:
    from skippy.codec.protocol_ext import LogprobsFrame, TokenLogprobs

    frame = wire.encode_logprobs(LogprobsFrame(2, (TokenLogprobs(5, -0.25, ((5, -0.25), (9, -1.5))),)))
    assert len(frame) == layout.LOGPROBS_HEAD + 3 * layout.LOGPROBS_PAIR
    assert struct.unpack_from("<iii", frame, 0) == (layout.LOGPROBS_MAGIC, 1, 2)
    assert struct.unpack_from("<if", frame, layout.LOGPROBS_HEAD + 2 * layout.LOGPROBS_PAIR) == (9, -1.5)
