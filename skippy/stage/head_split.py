"""A stage's part in a head split by vocabulary rows (issue 31; skippy.runtime.head_shard).

The final stage of a split head (``--head-split N``) computes the head's rows ``N:`` beside its
layers and listens on a head shard port for the stage that serves the rows ``0:N``
(``--serve-head-rows N --head-shard-dial HOST:PORT``, usually stage 0 of the same chain, which
starts after the final stage): that stage loads the head alone for those rows beside its layers
and serves them on a thread of its own, dialling the port again whenever the link is lost.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from skippy.net.address import Address
from skippy.net.socket_io import set_no_delay
from skippy.stage.config import StageConfig

if TYPE_CHECKING:
    from skippy.runtime.head_shard import HeadCompute
    from skippy.stage.scheduler import Scheduler

log = logging.getLogger("skippy.stage")

#: The final stage's shard port: kept for the process's life (its accept thread is a daemon).
_KEPT: list[Any] = []


def attach_head_port(config: StageConfig, context: Any) -> Address:
    """Give the final stage's split head its shard: the connections of the stage serving the
    other rows to a port of this stage; returns (and logs) the port's address."""
    from skippy.runtime.head_shard import HeadShardPort, RemoteHeadShard

    model = context.model
    listen = config.head_shard_listen or Address(config.listen.host, 0)
    port = HeadShardPort(listen.host, listen.port)
    _KEPT.append(port)
    context.attach_shard(RemoteHeadShard.through(port, rows=(0, config.head_split), identity=model.identity,
                                                 n_embd=model.n_embd, timeout=config.connect_timeout))
    address = Address(*port.address)
    log.info("head split: rows %d:%d here, rows 0:%d from the stage that dials; head shard port on %s",
             config.head_split, model.n_vocab, config.head_split, address)
    return address


def serve_head_rows(config: StageConfig) -> "HeadCompute":
    """Load the head alone for the rows ``0:serve_head_rows`` (the stage serves them once its
    scheduler runs: :func:`serve_head_shard`)."""
    from skippy.runtime import LayerRange, Model, read_gguf_info
    from skippy.runtime.head_shard import HeadCompute
    from skippy.runtime.offload import devices

    n_layer = read_gguf_info(config.model).n_layer
    offload = config.offload.resolve(devices(), n_layer, n_layer, n_layer)
    head = Model(config.model, LayerRange(n_layer, n_layer), head_rows=(0, config.serve_head_rows),
                 offload=offload, use_mmap=config.mmap)
    try:
        compute = HeadCompute(head, n_batch=config.batch_size, threads=config.threads or None)
    except BaseException:
        head.close()
        raise
    log.info("head split: serving head rows 0:%d (%.0f MiB) to %s", config.serve_head_rows,
             head.size_bytes / (1 << 20), config.head_shard_dial)
    return compute


async def serve_head_shard(scheduler: "Scheduler", compute: "HeadCompute", dial: Address, *,
                           retry_s: float = 0.2) -> None:
    """Serve ``compute``'s rows to the final stage's head shard port at ``dial`` until cancelled:
    dialled until it answers, and again whenever the link is lost (docs/protocol.md §15)."""
    while True:
        try:
            stream = await trio.open_tcp_stream(dial.host, dial.port)
        except OSError:
            await trio.sleep(retry_s)
            continue
        set_no_delay(stream)
        log.info("head shard: serving head rows %d:%d to %s", *compute.rows, dial)
        try:
            async with stream:
                await _serve_link(stream, scheduler, compute)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, OSError) as exc:
            log.info("head shard: the link to %s is gone (%s); dialling again", dial, exc)
        await trio.sleep(retry_s)


async def _receive_exactly(stream: trio.SocketStream, size: int) -> bytearray:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise ConnectionError(f"the link closed after {len(data)} of {size} bytes")
        data += chunk
    return data


async def _serve_link(stream: trio.SocketStream, scheduler: "Scheduler", compute: "HeadCompute") -> None:
    """One link's requests, one at a time (the final stage waits on each reply)."""
    from skippy.runtime.errors import InvalidBatch, NativeError
    from skippy.runtime.head_shard import HEADER, check_request, handshake_reply, refusal_reply, rows_reply_header

    while True:
        rows, refusal = check_request(bytes(await _receive_exactly(stream, HEADER.size)), compute)
        if refusal:
            log.warning("head shard: %s", refusal)
            await stream.send_all(refusal_reply(refusal))
            return
        if rows == 0:
            await stream.send_all(handshake_reply(compute))
            continue
        body = await _receive_exactly(stream, rows * compute.n_embd * 4)
        hidden = np.frombuffer(body, dtype="<f4").reshape(rows, compute.n_embd)

        def run() -> memoryview:  # on the runtime thread: the reply, header and columns, in one buffer
            r0, r1 = compute.rows
            reply = np.empty(HEADER.size + rows * (r1 - r0) * 4, dtype=np.uint8)  # not zeroed first
            reply[:HEADER.size] = np.frombuffer(rows_reply_header(compute, rows), dtype=np.uint8)
            reply[HEADER.size:].view("<f4").reshape(rows, r1 - r0)[...] = compute.compute(hidden)
            return memoryview(reply)
        try:
            reply = await scheduler.head_rows(run)
        except (NativeError, InvalidBatch) as exc:
            message = f"the head shard failed: {exc}"
            log.warning("head shard: %s", message)
            await stream.send_all(refusal_reply(message))
            return
        await stream.send_all(reply)
