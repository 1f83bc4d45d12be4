"""The short fuzz run: mutated, truncated, oversized frames into a live chain while a session decodes.

Hypothesis draws batches of mutated frames (``hostile_frames.mutate`` over a seed frame of every
kind); each batch goes, one frame per lane, into both stages of an in-process null chain; every
lane closes, nothing is held of the buffer budget afterwards, and a session decoding on its own lane
gets the right tokens throughout.  ``bench/fuzz_stage.py`` is the long campaign (stage processes,
slow frames, RSS and descriptors).
"""

from __future__ import annotations

import logging
import random

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy.driver import StageClient

from hostile_frames import dial, mutate, seed_frames
from stage_helpers import inprocess_chain

SEEDS = seed_frames()


async def _scenario(batches: list[list[bytes]]) -> None:
    async with inprocess_chain(["0:2", "2:4"], header_timeout=1, frame_timeout=1) as servers:
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            await client.prefill(1, [1, 2, 3])
            position = 3
            for batch in batches:
                async def attack(index: int, frame: bytes) -> None:
                    address = servers[index % 2].address
                    assert address is not None
                    stream = await dial(address.host, address.port)
                    try:
                        await stream.send_all(frame)
                        with trio.move_on_after(0.05):
                            await stream.receive_some(1 << 16)
                    except trio.BrokenResourceError:
                        pass
                    finally:
                        await trio.aclose_forcefully(stream)

                async with trio.open_nursery() as nursery:
                    for index, frame in enumerate(batch):
                        nursery.start_soon(attack, index, frame)
                assert (await client.decode(1, position, position)).predicted == position + 1
                position += 1
        with trio.fail_after(10):
            while any(server.stats.connections_open or server.budget.used for server in servers):
                await trio.sleep(0.02)


@pytest.mark.slow  # 20 hypothesis chains of real stage servers (the fast suite stays under 90 s)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), batches=st.integers(1, 4), size=st.integers(1, 12))
def test_mutated_frames_never_break_a_stage_or_a_session(seed: int, batches: int, size: int) -> None:
    rng = random.Random(seed)
    frames = [[mutate(rng.choice(SEEDS), rng) for _ in range(size)] for _ in range(batches)]
    logging.disable(logging.ERROR)  # hundreds of refused lanes, each logged
    try:
        trio.run(_scenario, frames)
    finally:
        logging.disable(logging.NOTSET)
