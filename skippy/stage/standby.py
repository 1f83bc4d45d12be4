"""A warm standby stage (``--standby on``): loaded, not listening, until its launcher activates it.

Strategy: the stage loads its range as any stage does, logs ``standby layers A:B loaded, waiting
for activation`` and reads its standard input (the launcher's pipe) for one line ``activate
HOST:PORT``; it then listens on that address, which is the lost stage's (its upstream and the
driver re-dial the same address), and serves as a stage started there would (its READY line
included).  Only the socket is bound at activation, so taking over costs a bind, not a model load.
End of input or SIGTERM/SIGINT before activation end the process (nothing was ever served).
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import trio

from skippy.net.address import Address
from skippy.stage.config import StageConfig

log = logging.getLogger("skippy.stage")

#: The activation line's prefix.
ACTIVATE = b"activate "


async def wait_for_activation(stdin: trio.abc.ReceiveStream, config: StageConfig,
                              signals: AsyncIterator[int]) -> Address | None:
    """The address to listen on, from the first ``activate HOST:PORT`` line (None: end of input or a signal)."""
    log.info("standby layers %s loaded, waiting for activation", config.layers)
    found: list[Address] = []
    async with trio.open_nursery() as nursery:
        async def stop_on_signal() -> None:
            async for _ in signals:
                log.info("standby stopped before activation")
                nursery.cancel_scope.cancel()
                return

        async def read() -> None:
            buffer = b""
            while True:
                data = await stdin.receive_some(4096)
                if not data:
                    log.info("standard input closed before activation: exiting")
                    break
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                line = next((line for line in lines if line.startswith(ACTIVATE)), None)
                if line is not None:
                    try:
                        found.append(Address.parse(line[len(ACTIVATE):].decode("ascii").strip()))
                    except (ValueError, UnicodeDecodeError) as exc:
                        log.error("bad activation line %r: %s", line, exc)
                        continue
                    break
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_on_signal)
        nursery.start_soon(read)
    if found:
        log.info("activated: listening on %s", found[0])
    return found[0] if found else None
