"""Mutually authenticated TLS 1.3 on stage links: contexts, and the handshake on both ends.

Strategy: a chain is one trust domain, its certificate authority (``skippy certs`` makes it, see
:mod:`skippy.deploy.certs`).  Every stage and every driver holds a certificate signed by that CA; both
ends of every link present theirs and require the other's (``CERT_REQUIRED`` on the listening side
too), TLS 1.3 only, through the standard :mod:`ssl` module under :class:`trio.SSLStream`.  Peers are
authenticated by the chain CA, not by host name (a chain's addresses are whatever its hosts have):
whoever holds a key certified by the chain's CA is a member, anyone else is refused at the
handshake, which the listening stage logs with the peer and the TLS reason.

The handshake happens before READY: the listening side accepts, completes the handshake within
its ``--header-timeout``, then sends READY inside the encrypted stream, so nothing of the stage
protocol is visible to an unauthenticated peer.

When TLS is on (:func:`link_uses_tls`): ``--tls on`` always; ``--tls auto`` (the default) for a
link whose address is not a loopback one (the listening address, or the downstream's address on
the dialling side); ``--tls off`` never.  A stage that must use TLS and has no certificate
refuses to start, naming the missing setting.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import ssl
from pathlib import Path

import trio

__all__ = ["TlsFiles", "client_context", "handshake_as_client", "handshake_as_server", "is_loopback",
           "link_uses_tls", "server_context"]

log = logging.getLogger("skippy.stage")


@dataclasses.dataclass(frozen=True, slots=True)
class TlsFiles:
    """One party's certificate, its key, and the chain CA that certifies every party (PEM files)."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def in_directory(cls, directory: Path, name: str) -> "TlsFiles":
        """The files ``skippy certs`` writes for ``name`` (``NAME.pem``, ``NAME.key``, ``ca.pem``)."""
        return cls(directory / f"{name}.pem", directory / f"{name}.key", directory / "ca.pem")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, ``localhost``)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: may be anywhere
        return False


def link_uses_tls(mode: str, host: str) -> bool:
    """Whether a link to or on ``host`` uses TLS under ``mode`` (on, off, auto: not loopback)."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    return not is_loopback(host)


def _context(purpose: ssl.Purpose, files: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(purpose, cafile=str(files.ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the chain CA is the trust domain (module header)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The listening side's context: TLS 1.3, its certificate, a client certificate from the CA required.

    Raises:
        OSError / ssl.SSLError: a file is missing or not a matching certificate and key.
    """
    context = _context(ssl.Purpose.CLIENT_AUTH, files)
    context.num_tickets = 0  # no resumption, and an idle lane has nothing unasked to read
    return context


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """The dialling side's context (a stage's downstream link, a driver): TLS 1.3, its certificate,
    the server's certificate checked against the chain CA."""
    return _context(ssl.Purpose.SERVER_AUTH, files)


def _reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__ or exc
    if isinstance(cause, ssl.SSLError):
        return cause.reason or str(cause)
    return str(cause) or type(cause).__name__


async def handshake_as_server(stream: trio.SocketStream, context: ssl.SSLContext, peer: str,
                              timeout: float) -> trio.SSLStream[trio.SocketStream] | None:
    """TLS over an accepted stream; None (the stream closed, the refusal logged) when the peer
    does not complete a handshake with a certificate from the chain CA within ``timeout`` s."""
    secure = trio.SSLStream(stream, context, server_side=True)
    try:
        with trio.fail_after(timeout if timeout > 0 else float("inf")):
            await secure.do_handshake()
        return secure
    except trio.TooSlowError:
        reason = f"no TLS handshake within {timeout:g} s"
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        reason = _reason(exc)
    log.warning("refused a connection from %s at the TLS handshake: %s", peer, reason)
    await trio.aclose_forcefully(stream)
    return None


async def handshake_as_client(stream: trio.SocketStream, context: ssl.SSLContext,
                              host: str) -> trio.SSLStream[trio.SocketStream]:
    """TLS over a dialled stream.

    Raises:
        ConnectionError: the handshake failed (the stream is closed; the TLS reason is named).
    """
    secure = trio.SSLStream(stream, context, server_hostname=host)
    try:
        await secure.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        await trio.aclose_forcefully(stream)
        raise ConnectionError(f"TLS handshake with {host} failed: {_reason(exc)}") from exc
    return secure
