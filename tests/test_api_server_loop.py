"""``serve_api`` loads the vocabulary off the trio loop it shares with ``skippy up``'s heartbeats.

Loading Gemma 3's 262,144-token vocabulary took ~1.5 s on a loaded host: on the loop, the
launcher's heartbeats (a READY or an Ack due within 1.2 s) all expired at once, every stage was
declared lost and replaced, and the first request got a 503.  A slow load must leave the loop
ticking.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import trio

from skippy.api import server
from skippy.driver.generator import Generator
from skippy.net.address import Address

SLOW_S = 0.8


def test_a_slow_vocabulary_load_does_not_stall_the_loop(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = Generator.from_model

    def slow(*args: object, **kwargs: object) -> Generator:
        time.sleep(SLOW_S)  # as a big vocabulary on a busy host
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(server.Generator, "from_model", staticmethod(slow))
    gaps: list[float] = []

    async def tick(until: trio.Event) -> None:
        last = time.monotonic()
        while not until.is_set():
            await trio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def main() -> None:
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick, started)
            url = await nursery.start(functools.partial(server.serve_api, tiny_llama, Address.parse("127.0.0.1:9"),
                                                        port=0, n_ctx=256, max_lanes=1, direct_return="off"))
            assert url.startswith("http://127.0.0.1:")
            started.set()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert gaps and max(gaps) < SLOW_S / 2, f"the loop stalled {max(gaps):.2f} s while the vocabulary loaded"
