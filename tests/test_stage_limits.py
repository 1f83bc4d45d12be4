"""A stage under a hostile peer: claimed counts never size work, and per-peer and total limits hold.

Real stage processes (null runtime) where memory or time is measured; in-process servers where the
test is about which frames are refused.  Frames are hand-packed (``hostile_frames``) so they can
claim counts their bytes do not back.
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy.driver import StageClient, StageLost
from skippy.protocol import MessageKind, StageMessage, StateHeader
from skippy.stage.errors import InvalidMessage
from skippy.stage.lane_messages import work_item
from skippy.stage.lane_protocol import RULES, Handling, LaneProtocol

from hostile_frames import dial, raw_frame, rss_bytes, until_closed
from stage_helpers import StageProcess, inprocess_chain

NULL = "null:n_embd=8,n_layer=4,n_vocab=1000"
EXTREME_COUNTS = (-(1 << 31), -1, 0, 1, 2, 4096, 4097, 1 << 20, 1 << 28, (1 << 31) - 1)
EXECUTABLE = [kind for kind, rule in RULES.items() if rule.handling is Handling.EXECUTE]


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


# -- item 1: validate before allocating ------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(EXECUTABLE), count=st.sampled_from(EXTREME_COUNTS) | st.integers(-(1 << 31), (1 << 31) - 1),
       pos_start=st.sampled_from((-(1 << 31), -1, 0, 5, (1 << 31) - 2, (1 << 31) - 1)),
       tokens=st.integers(0, 6), positions=st.integers(0, 6), rows=st.integers(0, 6),
       is_first=st.booleans(), current=st.sampled_from((-1, 3)))
def test_work_item_never_sizes_an_array_by_a_claimed_count(kind: MessageKind, count: int, pos_start: int,
                                                           tokens: int, positions: int, rows: int,
                                                           is_first: bool, current: int) -> None:
    """Whatever a message claims, the work item is refused or its arrays are no bigger than the
    frame's own contents (and a stage's row limit)."""
    state = StateHeader.for_kind(kind)
    state = StateHeader(state.version, 0, state.phase, state.flags, 0, 0, -1, current,
                        -1 if is_first else 0, 0)
    message = StageMessage(kind, pos_start, count, state, 1, 1, None, None,
                           np.arange(tokens, dtype=np.int32), np.arange(positions, dtype=np.int32),
                           None if is_first or rows == 0 else np.zeros((rows, 8), dtype=np.float32), b"")
    dispatch = LaneProtocol(3).message_received(message)
    try:
        item = work_item(dispatch, 1, is_first=is_first, width=8, max_rows=4096)
    except InvalidMessage:
        return
    carried = max(tokens, 1 if current >= 0 else 0) if is_first else rows
    assert 0 < item.rows <= carried
    assert item.positions.shape[0] == item.rows
    assert int(item.positions.max()) < (1 << 31)


async def test_every_kind_with_extreme_counts_is_refused_or_served_and_the_stage_lives_on() -> None:
    """A frame of every kind with each extreme count (with and without an activation), each on its
    own lane, all at once into both stages of a chain while a session decodes: no frame makes the
    stage allocate more than a few MB, the session is served throughout and every lane closes."""
    tracemalloc.start()
    try:
        async with inprocess_chain(["0:2", "2:4"], max_connections=1000) as servers:
            async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
                await client.prefill(1, [1, 2, 3])
                baseline = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()

                async def hostile(host: str, port: int, frame: bytes) -> None:
                    stream = await dial(host, port)
                    await stream.send_all(frame)
                    with trio.move_on_after(1.0):
                        await stream.receive_some(1 << 16)
                    await trio.aclose_forcefully(stream)

                async with trio.open_nursery() as nursery:
                    for server in servers:
                        assert server.address is not None
                        for kind in MessageKind:
                            for count in EXTREME_COUNTS:
                                for source in (-1, 0):
                                    frame = raw_frame(kind, token_count=count, tokens=1, source_stage_index=source,
                                                      session_id=900 + count % 7)
                                    nursery.start_soon(hostile, server.address.host, server.address.port, frame)
                    for position in range(3, 40):
                        assert (await client.decode(1, position, position)).predicted == position + 1
                        await trio.sleep(0.01)
                peak = tracemalloc.get_traced_memory()[1] - baseline
                assert peak < 32 << 20, f"peak traced allocation {peak >> 20} MiB"
                assert (await client.decode(1, 40, 40)).predicted == 41
            await trio.sleep(0.1)
            for server in servers:
                assert server.stats.connections_open == 0
    finally:
        tracemalloc.stop()


@pytest.mark.slow
async def test_amplification_frames_are_refused_at_once_without_memory(tmp_path: Path) -> None:
    """The issue's two frames: a PrefillFinalEmbd claiming 2^31-1 rows with one token (first stage)
    and one claiming 2^28 rows with no activation (second stage): refused fast, no RSS growth, and
    a session decoding on another lane barely notices."""
    final = StageProcess(NULL, "2:4", tmp_path / "s1.log")
    first = StageProcess(NULL, "0:2", tmp_path / "s0.log", downstream=await final.start())
    try:
        first_address = await first.start()
        assert first.process is not None and final.process is not None and final.address is not None
        async with await StageClient.connect(first_address) as client:
            await client.prefill(1, [1, 2, 3])
            await client.decode(1, 3, 3)
            peaks = [_peak_rss(first.process.pid), _peak_rss(final.process.pid)]
            rss = [rss_bytes(first.process.pid), rss_bytes(final.process.pid)]
            delays: list[float] = []
            refusals: list[float] = []
            done = trio.Event()

            async def decode_loop() -> None:
                position = 4
                while not done.is_set():
                    started = time.perf_counter()
                    assert (await client.decode(1, position, position)).predicted == position + 1
                    delays.append(time.perf_counter() - started)
                    position += 1
                    await trio.sleep(0.002)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(decode_loop)
                await trio.sleep(0.2)
                for address, frame in (
                    (first_address, raw_frame(MessageKind.PREFILL_FINAL_EMBD, token_count=(1 << 31) - 1, tokens=1)),
                    (final.address, raw_frame(MessageKind.PREFILL_FINAL_EMBD, token_count=1 << 28, tokens=0)),
                ):
                    stream = await dial(address.host, address.port)
                    started = time.perf_counter()
                    await stream.send_all(frame)
                    error = await until_closed(stream, 30)
                    refusals.append(time.perf_counter() - started)
                    await stream.aclose()
                    assert b"token_count" in error or b"activation" in error
                await trio.sleep(0.2)
                done.set()
            grown = [_peak_rss(first.process.pid) - peaks[0], _peak_rss(final.process.pid) - peaks[1]]
            now = [rss_bytes(first.process.pid) - rss[0], rss_bytes(final.process.pid) - rss[1]]
            print(f"refused in {[f'{s * 1000:.1f} ms' for s in refusals]}, peak RSS growth "
                  f"{[g >> 10 for g in grown]} KiB, RSS growth {[g >> 10 for g in now]} KiB, "
                  f"legitimate decode max {max(delays) * 1000:.1f} ms over {len(delays)} steps")
            assert max(refusals) < 0.5  # 10 ms on a quiet host; generous for a loaded one
            assert max(grown) < 10 << 20
            assert max(delays) < 0.5  # 100 ms on a quiet host
    finally:
        first.kill()
        final.kill()
