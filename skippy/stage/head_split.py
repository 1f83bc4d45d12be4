"""A stage's part in a head split by vocabulary rows (issue 31; skippy.runtime.head_shard).

The final stage of a split head (``--head-split N``) computes the head's rows ``N:`` beside its
layers and listens on a head shard port for the stage that serves the rows ``0:N``
(``--serve-head-rows N --head-shard-dial HOST:PORT``, usually stage 0 of the same chain, which
starts after the final stage): that stage loads the head alone for those rows beside its layers
and serves them on a thread of its own, dialling the port again whenever the link is lost
(the address in ``--head-shard-dial-file`` at each dial while it exists: a launcher re-wires it).

The link follows the stage links' TLS rule (:mod:`skippy.net.tls`, :func:`head_shard_tls`): TLS
1.3 with the stage's own certificate, key and chain CA, a certificate required of both ends,
when ``--tls on``, or ``auto`` and the link's address (the final stage's ``--head-shard-listen``,
the serving stage's ``--head-shard-dial``) is not a loopback one.  The final stage's port
completes each handshake within ``--header-timeout`` and logs the peer and the TLS reason of a
refusal; the serving stage dials again after a failed handshake, backing off to 5 s, and logs
each new reason once.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from skippy.net.address import Address
from skippy.net.socket_io import set_no_delay
from skippy.net.tls import TlsFiles, client_context, handshake_as_client, link_uses_tls, server_context
from skippy.stage.config import StageConfig

if TYPE_CHECKING:
    from skippy.runtime.head_shard import HeadCompute
    from skippy.stage.scheduler import Scheduler

log = logging.getLogger("skippy.stage")

#: The final stage's shard port: kept for the process's life (its accept thread is a daemon).
_KEPT: list[Any] = []
#: Longest wait between two dials after failed ones (a refused TLS handshake, a closed link).
MAX_RETRY_S = 5.0


def head_shard_tls(config: StageConfig, *, listening: bool) -> ssl.SSLContext | None:
    """The head shard link's TLS context on this stage: the server context on the final stage's
    port (``listening``), the client context on the serving stage's dial; None where the TLS rule
    leaves the link plain (or the stage has no such end).

    Raises:
        ValueError: a certificate, key or CA file that cannot be loaded (named).
    """
    end = (config.head_shard_listen or Address(config.listen.host, 0)) if listening else config.head_shard_dial
    if end is None or not link_uses_tls(config.tls, end.host):
        return None
    assert config.tls_cert is not None and config.tls_key is not None and config.tls_ca is not None  # validated
    files = TlsFiles(config.tls_cert, config.tls_key, config.tls_ca)
    try:
        return server_context(files) if listening else client_context(files)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the stage's TLS files for its head shard link ({files.cert}, {files.key}, "
                         f"{files.ca}): {exc}") from exc


def head_shard_link(config: StageConfig) -> dict[str, Any]:
    """The serving stage's :func:`serve_head_shard` settings from its config (TLS, dial file, timeout)."""
    return {"tls": head_shard_tls(config, listening=False), "dial_file": config.head_shard_dial_file,
            "handshake_timeout": config.header_timeout or 10.0}


def attach_head_port(config: StageConfig, context: Any) -> Address:
    """Give the final stage's split head its shard: the connections of the stage serving the
    other rows to a port of this stage; returns (and logs) the port's address."""
    from skippy.runtime.head_shard import HeadShardPort, RemoteHeadShard

    model = context.model
    listen = config.head_shard_listen or Address(config.listen.host, 0)
    tls = head_shard_tls(config, listening=True)
    port = HeadShardPort(listen.host, listen.port, tls=tls, handshake_timeout=config.header_timeout or 10.0)
    _KEPT.append(port)
    context.attach_shard(RemoteHeadShard.through(port, rows=(0, config.head_split), identity=model.identity,
                                                 n_embd=model.n_embd, timeout=config.connect_timeout))
    address = Address(*port.address)
    log.info("head split: rows %d:%d here, rows 0:%d from the stage that dials; head shard port on %s%s",
             config.head_split, model.n_vocab, config.head_split, address, " (TLS)" if tls is not None else "")
    return address


def serve_head_rows(config: StageConfig) -> "HeadCompute":
    """Load the head alone for the rows ``0:serve_head_rows`` (the stage serves them once its
    scheduler runs: :func:`serve_head_shard`)."""
    from skippy.runtime import LayerRange, Model, read_gguf_info
    from skippy.runtime.head_shard import HeadCompute
    from skippy.runtime.offload import devices

    head_shard_tls(config, listening=False)  # its TLS files are checked before the head loads
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
                           tls: ssl.SSLContext | None = None, dial_file: Path | None = None,
                           handshake_timeout: float = 10.0, retry_s: float = 0.2) -> None:
    """Serve ``compute``'s rows to the final stage's head shard port at ``dial`` (or the address
    in ``dial_file`` while it names one) until cancelled: dialled until it answers, and again
    whenever the link is lost (docs/protocol.md §15); over TLS with ``tls`` (a client context)."""
    wait, said = retry_s, ""
    while True:
        target = _dial_target(dial, dial_file)
        try:
            stream = await trio.open_tcp_stream(target.host, target.port)
        except OSError:
            await trio.sleep(retry_s)
            continue
        set_no_delay(stream)
        served = [False]  # a request came: the link worked, whatever ends it
        try:
            async with stream:
                link: trio.abc.Stream = stream
                if tls is not None:
                    with trio.move_on_after(handshake_timeout if handshake_timeout > 0 else float("inf")):
                        link = await handshake_as_client(stream, tls, target.host)
                    if link is stream:
                        raise ConnectionError(f"no TLS handshake within {handshake_timeout:g} s (is the final "
                                              "stage's head shard port plain TCP? give both stages the same --tls)")
                log.info("head shard: serving head rows %d:%d to %s%s", *compute.rows, target,
                         " (TLS)" if tls is not None else "")
                await _serve_link(link, scheduler, compute, served)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, OSError) as exc:
            reason = _link_reason(exc, tls is not None, served[0])
            if served[0]:
                log.info("head shard: the link to %s is gone (%s); dialling again", target, reason)
            elif reason != said:  # a refusal repeats at every dial: said once, the dials backing off
                log.warning("head shard: the link to %s failed before a request (%s); dialling again", target, reason)
            said = "" if served[0] else reason
        wait = retry_s if served[0] else min(MAX_RETRY_S, max(wait * 2, retry_s))
        await trio.sleep(wait)


def _dial_target(dial: Address, dial_file: Path | None) -> Address:
    """The address in ``dial_file`` (``HOST:PORT``, rewritten by a launcher) while it names one, else ``dial``."""
    if dial_file is None:
        return dial
    try:
        text = dial_file.read_text().strip()
        return Address.parse(text) if text else dial
    except (OSError, ValueError) as exc:  # not written yet / half written: keep the configured one
        log.warning("head shard dial file %s unreadable (%s); using %s", dial_file, exc, dial)
        return dial


def _link_reason(exc: BaseException, tls: bool, served: bool) -> str:
    """What ended a head shard link, the TLS reason or a likely TLS mismatch named."""
    from skippy.runtime.head_shard import tls_reason

    reason = tls_reason(exc)
    if isinstance(exc, ssl.SSLError) or isinstance(exc.__cause__, ssl.SSLError):
        return f"TLS: {reason}" + ("" if served else " (did the final stage refuse this stage's certificate?)")
    if not tls and not served and isinstance(exc, ConnectionError) and "closed after 0 of" in reason:
        return (reason + "; a final stage whose head shard port uses TLS closes a plain link after its handshake "
                "timeout: give both stages the same --tls")
    return reason


async def _receive_exactly(stream: trio.abc.Stream, size: int) -> bytearray:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise ConnectionError(f"the link closed after {len(data)} of {size} bytes")
        data += chunk
    return data


async def _serve_link(stream: trio.abc.Stream, scheduler: "Scheduler", compute: "HeadCompute",
                      served: list[bool]) -> None:
    """One link's requests, one at a time (the final stage waits on each reply); ``served[0]``
    is set once a request was well formed."""
    from skippy.runtime.errors import InvalidBatch, NativeError
    from skippy.runtime.head_shard import HEADER, check_request, handshake_reply, refusal_reply, rows_reply_header

    while True:
        rows, refusal = check_request(bytes(await _receive_exactly(stream, HEADER.size)), compute)
        if refusal:
            log.warning("head shard: %s", refusal)
            await stream.send_all(refusal_reply(refusal))
            return
        served[0] = True
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
