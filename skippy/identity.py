"""One model everywhere: a stage's identity, asking a peer for it, and checking a chain's links.

Strategy (the wire side is ``docs/protocol.md`` §9; the frame is
:class:`skippy.codec.protocol_ext.IdentityFrame`):

* **What identifies a stage**: the sha256 of its GGUF file's header (metadata and tensor index:
  shapes, types, tokenizer, layout; no weights are read, so hashing a 100 GB file takes
  milliseconds), the file name (for messages), its layer range and the model's layer count, and
  the settings every stage of a chain must share (``ctx_size``, ``batch_size``: the same
  micro-batch partition is what keeps a split exact).
* **Asking** (:func:`query_identity`): a probe connection of its own.  Dial, read READY, send the
  identity query (a PredictionReturnOpen flagged ``SKIPPY_EXTENSIONS | MODEL_IDENTITY``) and read
  one reply.  A skippy stage answers the Identity frame and closes.  A plain v11 stage parks such
  an open as a return lane and never answers, and an older skippy stage refuses it with an Error
  frame: both read as "no identity" (None) after at most ``timeout`` seconds, so a v11 peer never
  sees the extension on a lane it serves and is only reported as unverified.
* **Checking** (the stage's half, :mod:`skippy.stage.identity_check`): a stage checks its
  downstream each time a lane dials it (a restarted downstream may serve another file),
  remembering peers that gave no identity so a v11 peer costs the timeout once per address.  A
  mismatch raises ``ModelMismatch`` naming both files and both ranges; the lane then closes with
  an Error frame (``MODEL_MISMATCH`` to an upstream that flags bit 12, ``STATE_MISMATCH``
  otherwise), so the refusal reaches the driver, which reports it with the text.  The driver
  checks the first stage against its own model file (:func:`check_first_stage`).
"""

from __future__ import annotations

import hashlib
import logging
import ssl
from pathlib import Path

import trio

from skippy.codec import wire as codec
from skippy.codec.protocol import END_OF_STREAM, NEED_DATA, WireDType, WireError, check_ready
from skippy.codec.protocol_ext import IdentityFrame, identity_query
from skippy.net.address import Address
from skippy.net.tls import handshake_as_client
from skippy.runtime.gguf_header import GGUFHeaderError, header_digest

__all__ = ["check_first_stage", "file_identity", "query_identity"]

log = logging.getLogger("skippy.identity")

#: Seconds a probe waits for the Identity frame (a plain v11 stage never answers).
QUERY_TIMEOUT = 2.0


def file_digest(model: str) -> bytes:
    """The 32-byte identity digest of a model: its GGUF header's sha256, or, for a ``null:`` spec
    of the no-compute runtime, the sha256 of the spec text.

    Raises:
        OSError / ValueError: the file cannot be read as GGUF.
    """
    if model.startswith("null:"):
        return hashlib.sha256(model.encode()).digest()
    try:
        return bytes.fromhex(header_digest(Path(model)))
    except GGUFHeaderError as exc:
        raise ValueError(str(exc)) from exc


def file_identity(model: str, layer_start: int, layer_end: int, layer_count: int, ctx_size: int,
                  batch_size: int) -> IdentityFrame:
    """The Identity frame of a stage serving ``model`` layers ``layer_start:layer_end``."""
    name = model if model.startswith("null:") else Path(model).name
    encoded = name.encode("utf-8", "replace")[:256].decode("utf-8", "ignore")
    return IdentityFrame(layer_start, layer_end, layer_count, ctx_size, batch_size, file_digest(model), encoded)


async def query_identity(address: Address, *, timeout: float = QUERY_TIMEOUT,
                         tls: ssl.SSLContext | None = None) -> IdentityFrame | None:
    """Ask the stage at ``address`` for its Identity frame (module notes; ``tls``: the asker's
    mutual-TLS context when the link uses TLS, :mod:`skippy.net.tls`).

    Returns:
        The frame, or None when the peer answers none (a plain v11 or an older skippy stage).

    Raises:
        OSError: the peer cannot be reached at all (connect refused, READY missing).
    """
    with trio.move_on_after(timeout):
        stream: trio.abc.Stream = await trio.open_tcp_stream(address.host, address.port)
        if tls is not None:
            stream = await handshake_as_client(stream, tls, address.host)  # type: ignore[arg-type]
        async with stream:
            ready = b""
            while len(ready) < 4:
                chunk = await stream.receive_some(4 - len(ready))
                if not chunk:
                    raise OSError(f"stage {address} closed the connection before READY")
                ready += chunk
            try:
                check_ready(ready)
            except WireError as exc:  # not a stage: say so like any unreachable peer
                raise OSError(f"{address} is not a skippy stage: {exc}") from exc
            await stream.send_all(codec.encode_message(identity_query(), WireDType.F32, 0))
            decoder = codec.ReplyDecoder(extensions=True)
            while True:
                try:
                    data = await stream.receive_some(4096)
                except (trio.BrokenResourceError, trio.ClosedResourceError):  # reset: no answer
                    data = b""
                decoder.receive_data(data)
                try:
                    frame = decoder.next_reply()
                except WireError as exc:  # garbage instead of an answer: treat as no identity
                    log.warning("stage %s answered the identity query with an invalid frame: %s", address, exc)
                    return None
                if frame is NEED_DATA:
                    continue
                if frame is END_OF_STREAM or not isinstance(frame, IdentityFrame):
                    return None  # refused (an older skippy) or closed: no identity to compare
                return frame
    return None  # no answer within the timeout: a plain v11 stage parks the query


async def check_first_stage(address: Address, model: str | Path, *, timeout: float = QUERY_TIMEOUT,
                            tls: ssl.SSLContext | None = None) -> str | None:
    """The driver's check: the stage at ``address`` starts at layer 0 of the same model file.

    Returns:
        None when it matches or reports no identity (a plain v11 stage); otherwise the refusal,
        naming both files.

    Raises:
        OSError: the first stage cannot be reached.
    """
    frame = await query_identity(address, timeout=timeout, tls=tls)
    if frame is None:
        return None
    path = Path(model)
    digest = file_digest(str(path))
    if frame.digest != digest:
        return (f"model mismatch with first stage {address}: the model files differ: the driver reads "
                f"{path.name} (header sha256 {digest.hex()[:12]}); the first stage serves {frame.describe()}")
    if frame.layer_start != 0:
        return f"stage {address} is not a first stage: it serves {frame.describe()}"
    return None
