"""Head shards: the output head's vocabulary rows computed away from the final stage (issue 31).

Strategy: the final stage of a split head runs its layers without the head, its own rows
``[r0, V)`` of the head in a head-only context and asks a shard for the rows ``[0, r0)`` of the
same hidden rows (after the output norm, the head and the architecture's steps after it, all in
the shard's head-only model: patch 0017).  The stage hands the shard the hidden rows first
(:meth:`HeadShard.start`), computes its own rows, then takes the shard's columns
(:meth:`HeadShard.finish`) straight into its logits buffer, so the two halves run at once and
everything that reads the final stage's logits sees full rows.

:class:`HeadCompute` is a head-only model's context; :class:`LocalHeadShard` runs one in process
(tests, one host); :class:`HeadShardServer` serves one over TCP (beside another stage's layers)
and :class:`RemoteHeadShard` is its client.  Either end may dial: a chain starts its final stage
first, so there the final stage listens (:class:`HeadShardPort`) and the shard's host dials it
(:meth:`HeadShardServer.dial`, again after a loss); the messages are the same either way.
A request is stateless, so the client sends one again, once, on the next connection when a
connection that has answered before ends before any byte of its reply (the shard's host restarted
while this end idled); where the shard's host dials, a connection it made since the last request
replaces the old one before the request is sent.  The wire (docs/protocol.md, "Head shard"): every
message is a 20-byte header ``<4sIIII`` (magic ``SKH1``, then four counts) and a body.
A request is ``SKH1, rows, n_embd, 0, 0`` and ``rows x n_embd`` float32 (little-endian); rows 0 is
the handshake.  A reply is ``SKH1, status, rows, r0, r1``: status 0 with ``rows x (r1 - r0)``
float32 (the handshake: the model identity, 24 bytes), status 1 with a UTF-8 message of ``rows``
bytes.  Both ends check every count against what they sent or serve and refuse the rest; the
client refuses a reply with a non-finite logit.

TLS: every class takes the stage links' contexts (:mod:`skippy.net.tls`: TLS 1.3, a certificate
from the chain CA required of both ends; the listening end gets the server context, the dialling
end the client context) and runs the same messages inside it.  A listening end completes each
handshake on a thread of its own within ``handshake_timeout`` and logs and counts a refusal
(:meth:`HeadShardPort.take` names the last one when no shard came); a plain end facing a TLS end
sees a TLS record where a header should be and names the mismatch.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
from typing import Callable, Final, Protocol, final

import numpy as np
import numpy.typing as npt

from skippy.runtime.errors import InvalidBatch, NativeError

log = logging.getLogger("skippy.head_shard")

FloatArray = npt.NDArray[np.float32]

MAGIC: Final = b"SKH1"
HEADER: Final = struct.Struct("<4sIIII")
IDENTITY_BYTES: Final = 24
#: Longest error message a reply may carry.
MAX_MESSAGE: Final = 4096
#: Seconds a TLS handshake may take before the connection is dropped (the stages' --header-timeout).
HANDSHAKE_TIMEOUT: Final = 10.0
_TLS_MISMATCH: Final = ("a TLS record on a plain head shard link: the other end uses TLS and this one does not "
                        "(give both stages the same --tls)")


class HeadShardError(NativeError):
    """A head shard failed, died or answered something it should not have."""


class HeadShardLost(HeadShardError):
    """The shard's connection ended before any byte of a reply: the request may be sent again."""


def is_tls_record(data: bytes) -> bool:
    """Whether ``data`` starts like a TLS record (a handshake or an alert): a TLS peer on a plain link."""
    return len(data) >= 2 and data[0] in (0x15, 0x16) and data[1] == 0x03


def tls_reason(exc: BaseException) -> str:
    """What a failed TLS handshake or TLS read says (the TLS reason where there is one)."""
    for cause in (exc, exc.__cause__, exc.__context__):
        if isinstance(cause, ssl.SSLError):
            return cause.reason or str(cause)
    return str(exc) or type(exc).__name__


def secure(conn: socket.socket, tls: ssl.SSLContext, *, server_side: bool, host: str = "",
           timeout: float = HANDSHAKE_TIMEOUT) -> ssl.SSLSocket:
    """``conn`` with a completed TLS handshake (blocking; ``conn`` is closed when it fails).

    Raises:
        HeadShardError: the handshake failed or took longer than ``timeout`` s (the TLS reason named).
    """
    wrapped: ssl.SSLSocket | None = None
    try:
        conn.settimeout(timeout if timeout > 0 else None)
        wrapped = tls.wrap_socket(conn, server_side=server_side, do_handshake_on_connect=False,
                                  server_hostname=None if server_side else (host or None))
        wrapped.do_handshake()
        wrapped.settimeout(None)
        return wrapped
    except (OSError, ValueError) as exc:  # ssl.SSLError, a timeout and a reset are OSErrors
        (wrapped or conn).close()  # (wrapping detaches conn: the wrapped socket owns it then)
        reason = f"no TLS handshake within {timeout:g} s" if isinstance(exc, TimeoutError) else tls_reason(exc)
        raise HeadShardError(f"TLS handshake failed: {reason}") from exc


class HeadShard(Protocol):
    """The head's rows ``rows`` computed elsewhere from the final stage's hidden rows."""

    rows: tuple[int, int]

    def start(self, hidden: FloatArray) -> None:
        """Begin computing the shard's rows of the head for ``hidden`` (``n x n_embd`` float32)."""

    def finish(self, out: FloatArray) -> None:
        """Write the shard's columns of the last :meth:`start` into ``out`` (``n x (r1 - r0)``)."""


@final
class HeadCompute:
    """A head-only model's context: hidden rows in, the model's head rows out (``n x (r1 - r0)``)."""

    def __init__(self, model: object, *, n_batch: int = 512, threads: int | None = None) -> None:
        from skippy.runtime.context import StageContext
        from skippy.runtime.model import Model

        if not isinstance(model, Model) or not model.head_only:
            raise InvalidBatch("a head shard needs a head-only model (layers n_layer:n_layer)")
        self.model = model
        self.rows: tuple[int, int] = model.head_rows
        self.n_embd = model.n_embd
        self.context = StageContext(model, n_ctx=n_batch, max_sessions=1, n_batch=n_batch, threads=threads)
        self.n_batch = self.context.n_batch

    def compute(self, hidden: FloatArray) -> FloatArray:
        """The head rows' logits of ``hidden`` (a view into the context's logits, valid until the next call)."""
        logits = self.context.decode_head(hidden)
        return logits[:, self.rows[0]:self.rows[1]]

    def close(self) -> None:
        self.context.close()


# -- the serving end's messages (sans-IO: HeadShardServer's threads and a stage's scheduled
# service, skippy.stage.head_split, both use them) --------------------------------------------
def check_request(header: bytes, compute: HeadCompute) -> tuple[int, str]:
    """A request header's rows (0: the handshake) and the refusal it earns ("" when none)."""
    magic, rows, width, zero_a, zero_b = HEADER.unpack(header)
    if is_tls_record(header):
        return 0, _TLS_MISMATCH
    if magic != MAGIC or zero_a or zero_b:
        return 0, "not a head shard request"
    if width != compute.n_embd or rows > compute.n_batch:
        return 0, (f"a request of {rows} rows x {width} (this shard: rows of {compute.n_embd}, "
                   f"at most {compute.n_batch})")
    return rows, ""


def handshake_reply(compute: HeadCompute) -> bytes:
    """The handshake's reply: the shard's rows and its model's identity."""
    r0, r1 = compute.rows
    identity = compute.model.identity.encode()[:IDENTITY_BYTES].ljust(IDENTITY_BYTES, b" ")
    return HEADER.pack(MAGIC, 0, 0, r0, r1) + identity


def rows_reply_header(compute: HeadCompute, rows: int) -> bytes:
    """The header of a reply carrying ``rows`` rows of the shard's columns (float32 after it)."""
    return HEADER.pack(MAGIC, 0, rows, *compute.rows)


def refusal_reply(message: str) -> bytes:
    """A refusal: status 1 and the (cut) UTF-8 message."""
    data = message.encode()[:MAX_MESSAGE]
    return HEADER.pack(MAGIC, 1, len(data), 0, 0) + data


@final
class LocalHeadShard:
    """A shard computed in this process when its columns are asked for (tests, one host)."""

    def __init__(self, compute: HeadCompute) -> None:
        self._compute = compute
        self.rows = compute.rows
        self._hidden: FloatArray | None = None

    def start(self, hidden: FloatArray) -> None:
        self._hidden = hidden

    def finish(self, out: FloatArray) -> None:
        if self._hidden is None:
            raise HeadShardError("finish() without start()")
        hidden, self._hidden = self._hidden, None
        out[...] = self._compute.compute(hidden)


def _read_into(sock: socket.socket, memory: memoryview) -> None:
    size = len(memory)
    got = 0
    while got < size:
        count = sock.recv_into(memory[got:], size - got)
        if count == 0:
            raise ConnectionError(f"connection closed after {got} of {size} bytes")
        got += count


def _read_exact(sock: socket.socket, size: int) -> bytes:
    view = bytearray(size)
    _read_into(sock, memoryview(view))
    return bytes(view)


@final
class HeadShardServer:
    """Serves a head-only model's rows over TCP; one thread per connection, the computations one
    at a time under ``lock`` (give the stage's runtime lock to share its compute thread)."""

    def __init__(self, compute: HeadCompute, host: str | None = "127.0.0.1", port: int = 0, *,
                 lock: threading.Lock | None = None, tls: ssl.SSLContext | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        """Serve ``compute``; listen on ``host:port`` (None: only :meth:`dial`), with ``tls`` (a
        server context) on every accepted connection."""
        self._compute = compute
        self._tls = tls
        self._handshake_timeout = handshake_timeout
        self._lock = lock or threading.Lock()
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._serving: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self.address: tuple[str, int] = ("", 0)
        self._thread: threading.Thread | None = None
        if host is not None:
            self._listener = socket.create_server((host, port))
            self.address = self._listener.getsockname()[:2]
            self._thread = threading.Thread(target=self._accept, name="head-shard-accept", daemon=True)
            self._thread.start()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._start(conn, self._tls)

    def _start(self, conn: socket.socket, tls: ssl.SSLContext | None = None, host: str = "") -> threading.Thread:
        """Serve ``conn`` on a thread of its own (after a TLS handshake there with ``tls``: as the
        server when listening, as the client, to ``host``, when dialling)."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._connections.add(conn)
        thread = threading.Thread(target=self._serve, args=(conn, tls, host), name="head-shard", daemon=True)
        self._serving.add(thread)
        thread.start()
        return thread

    def dial(self, host: str, port: int, *, retry_s: float = 0.2, tls: ssl.SSLContext | None = None) -> None:
        """Serve the final stage listening on ``host:port`` (:class:`HeadShardPort`) from a thread
        of its own: dialled until it answers, and again whenever the connection is lost (over
        TLS with ``tls``, a client context)."""
        def run() -> None:
            while not self._closed.is_set():
                try:
                    conn = socket.create_connection((host, port), timeout=5.0)
                except OSError:
                    self._closed.wait(retry_s)
                    continue
                conn.settimeout(None)
                log.info("head shard: serving head rows %d:%d to %s:%d", *self._compute.rows, host, port)
                self._start(conn, tls, host).join()
                self._closed.wait(retry_s)
        threading.Thread(target=run, name="head-shard-dial", daemon=True).start()

    def _serve(self, conn: socket.socket, tls: ssl.SSLContext | None, host: str) -> None:
        compute = self._compute
        try:
            if tls is not None:
                plain = conn
                try:
                    conn = secure(plain, tls, server_side=not host, host=host, timeout=self._handshake_timeout)
                except HeadShardError as exc:
                    log.warning("head shard: %s: %s", f"dialled {host}" if host else "accepted a connection", exc)
                    return
                finally:
                    self._connections.discard(plain)
                self._connections.add(conn)
                if self._closed.is_set():  # closed during the handshake: close() may have missed it
                    return
            while True:
                rows, refusal = check_request(_read_exact(conn, HEADER.size), compute)
                if refusal:
                    self._refuse(conn, refusal)
                    return
                if rows == 0:
                    conn.sendall(handshake_reply(compute))
                    continue
                hidden = np.frombuffer(_read_exact(conn, rows * compute.n_embd * 4), dtype="<f4").reshape(rows, -1)
                try:
                    with self._lock:
                        if self._closed.is_set():  # (the compute's owner may free it once close returns)
                            return
                        logits = np.ascontiguousarray(compute.compute(hidden))
                except (NativeError, InvalidBatch) as exc:
                    self._refuse(conn, f"the head shard failed: {exc}")
                    return
                conn.sendall(rows_reply_header(compute, rows) + logits.astype("<f4", copy=False).tobytes())
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, ssl.SSLError):
                log.warning("head shard: the link failed: %s", tls_reason(exc))
        finally:
            self._connections.discard(conn)
            self._serving.discard(threading.current_thread())
            conn.close()

    @staticmethod
    def _refuse(conn: socket.socket, message: str) -> None:
        log.warning("head shard: %s", message)
        try:
            conn.sendall(refusal_reply(message))
        except OSError:
            pass

    def close(self) -> None:
        """Stop serving; on return no computation runs (the caller may close the compute)."""
        self._closed.set()
        if self._listener is not None:
            try:  # (wakes the accepting thread: closing alone leaves accept() blocked)
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for conn in list(self._connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2)
        for thread in list(self._serving):
            if thread is not threading.current_thread():
                thread.join(timeout=10)


@final
class HeadShardPort:
    """The final stage's end when the shard's host dials: listens, keeps the newest connection
    (with ``tls``, a server context: the newest that completed its handshake)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, tls: ssl.SSLContext | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self._listener = socket.create_server((host, port))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._tls = tls
        self._handshake_timeout = handshake_timeout
        self._ready = threading.Condition()
        self._newest: socket.socket | None = None
        self._closed = False
        #: Connections refused at the TLS handshake, and the last refusal (peer and reason).
        self.refused = 0
        self.last_refusal = ""
        threading.Thread(target=self._accept, name="head-shard-port", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is None:
                self._keep(conn)
            else:  # a peer that never completes its handshake holds only its own thread
                threading.Thread(target=self._handshake, args=(conn, peer), name="head-shard-tls",
                                 daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        assert self._tls is not None
        try:
            self._keep(secure(conn, self._tls, server_side=True, timeout=self._handshake_timeout))
        except HeadShardError as exc:
            with self._ready:
                self.refused += 1
                self.last_refusal = f"{peer[0]}:{peer[1]} ({exc})"
            log.warning("head shard port: refused a connection from %s:%s: %s", peer[0], peer[1], exc)

    def _keep(self, conn: socket.socket) -> None:
        with self._ready:
            if self._closed:
                conn.close()
                return
            if self._newest is not None:
                self._newest.close()
            self._newest = conn
            self._ready.notify_all()

    def newer(self) -> socket.socket | None:
        """A connection made since the last :meth:`take` (the shard's host came back), else None."""
        with self._ready:
            conn, self._newest = self._newest, None
            return conn

    def take(self, timeout: float) -> socket.socket:
        """The newest connection from the shard's host, waiting up to ``timeout`` seconds for one."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._newest is not None, timeout):
                refused = (f"; {self.refused} connection(s) refused at the TLS handshake, the last from "
                           + self.last_refusal if self.refused else "")
                raise HeadShardError(f"no head shard has connected to {self.address[0]}:{self.address[1]} "
                                     f"in {timeout:.0f} s (the stage serving the other head rows){refused}")
            conn, self._newest = self._newest, None
            assert conn is not None
            return conn

    def close(self) -> None:
        try:  # (wakes the accepting thread)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._ready:
            self._closed = True
            if self._newest is not None:
                self._newest.close()
                self._newest = None


@final
class RemoteHeadShard:
    """The client of a :class:`HeadShardServer`: checks the shard's rows and model on connect."""

    def __init__(self, connect: Callable[[], socket.socket], *, address: str, rows: tuple[int, int],
                 identity: str | None = None, n_embd: int,
                 newer: Callable[[], socket.socket | None] | None = None) -> None:
        """A client that gets its connection from ``connect`` when it needs one (first use, after a
        loss), and from ``newer`` (where the shard's host dials) one made since, when there is one."""
        self.rows = rows
        self._newer = newer
        self._request = b""
        #: Whether the connection has answered a request (then a loss before this request's reply
        #: is the shard's host having gone while this end was idle: the request is sent again).
        self._served = False
        self._reused = False
        self._n_embd = n_embd
        self._identity = identity
        self._address = address
        self._connect = connect
        self._pending = 0
        self._sock: socket.socket | None = None

    @classmethod
    def dial(cls, host: str, port: int, *, rows: tuple[int, int], identity: str | None = None, n_embd: int,
             timeout: float = 30.0, tls: ssl.SSLContext | None = None) -> "RemoteHeadShard":
        """A client dialling the shard at ``host:port`` (connected and checked now; over TLS with
        ``tls``, a client context)."""
        def connect() -> socket.socket:
            try:
                conn = socket.create_connection((host, port), timeout=timeout)
            except OSError as exc:
                raise HeadShardError(f"cannot reach the head shard at {host}:{port}: {exc}") from exc
            if tls is None:
                return conn
            try:
                return secure(conn, tls, server_side=False, host=host, timeout=timeout)
            except HeadShardError as exc:
                raise HeadShardError(f"the head shard at {host}:{port}: {exc}") from exc.__cause__
        shard = cls(connect, address=f"{host}:{port}", rows=rows, identity=identity, n_embd=n_embd)
        shard.connection()
        return shard

    @classmethod
    def through(cls, port: HeadShardPort, *, rows: tuple[int, int], identity: str | None = None, n_embd: int,
                timeout: float = 60.0) -> "RemoteHeadShard":
        """A client over the connections the shard's host makes to ``port``."""
        return cls(lambda: port.take(timeout), address=f"{port.address[0]}:{port.address[1]}", rows=rows,
                   identity=identity, n_embd=n_embd, newer=port.newer)

    def connection(self) -> socket.socket:
        """The connection, made and checked (handshake: the shard's rows and model) if there is none."""
        if self._sock is None:
            self._adopt(self._connect())
        assert self._sock is not None
        return self._sock

    def _adopt(self, sock: socket.socket) -> None:
        """Take ``sock`` as the connection, checked by the handshake (the shard's rows and model,
        answered within :data:`HANDSHAKE_TIMEOUT`)."""
        sock.settimeout(HANDSHAKE_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._served = False
        try:
            self._send(HEADER.pack(MAGIC, 0, self._n_embd, 0, 0))
            body = self._reply(0, IDENTITY_BYTES)
            sock.settimeout(None)
        except HeadShardError as exc:  # TLS 1.3: a peer refusing this end's certificate says so only now
            if isinstance(sock, ssl.SSLSocket) and "is gone" in str(exc):
                raise HeadShardError(f"{exc} (right after the TLS handshake: did the shard refuse this end's "
                                     "certificate?)") from exc
            raise
        if self._identity is not None and body.decode(errors="replace").strip() != self._identity[:IDENTITY_BYTES]:
            self.close()
            raise HeadShardError(f"the head shard at {self._address} serves another model file")

    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self.close()
            raise HeadShardError(f"the head shard at {self._address} is gone: {exc}") from exc

    def _reply(self, rows: int, body_bytes: int, into: FloatArray | None = None) -> bytes:
        """Read a reply's header (checked) and its body (into ``into`` when given: then b"")."""
        sock = self._sock
        if sock is None:
            raise HeadShardError(f"the head shard at {self._address} is gone")
        try:
            try:
                header = _read_exact(sock, HEADER.size)
            except (ConnectionError, OSError) as exc:
                if "after 0 of" not in str(exc) and not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                    raise  # a reply cut after its first bytes: not sent again
                self.close()
                raise HeadShardLost(f"the head shard at {self._address} is gone: {exc}") from exc
            magic, status, count, r0, r1 = HEADER.unpack(header)
            if is_tls_record(header):
                raise HeadShardError(f"the head shard at {self._address} sent {_TLS_MISMATCH}")
            if magic != MAGIC:
                raise HeadShardError(f"the head shard at {self._address} answered something else")
            if status == 1:
                message = _read_exact(sock, min(count, MAX_MESSAGE)).decode(errors="replace")
                raise HeadShardError(f"the head shard at {self._address} refused: {message}")
            if status != 0 or count != rows or (r0, r1) != self.rows:
                raise HeadShardError(f"the head shard at {self._address} answered {count} rows of head rows "
                                     f"{r0}:{r1} (status {status}); wanted {rows} of {self.rows[0]}:{self.rows[1]}")
            if into is not None:
                for row in into:  # a row of a wider logits array is contiguous; the array may not be
                    _read_into(sock, memoryview(row).cast("B"))
                return b""
            return _read_exact(sock, body_bytes)
        except (ConnectionError, OSError) as exc:
            self.close()
            reason = tls_reason(exc) if isinstance(exc, ssl.SSLError) else exc
            raise HeadShardError(f"the head shard at {self._address} is gone: {reason}") from exc
        except HeadShardError:
            self.close()
            raise

    def start(self, hidden: FloatArray) -> None:
        rows, width = hidden.shape
        if width != self._n_embd or rows == 0:
            raise InvalidBatch(f"{rows} hidden rows x {width} for a head shard of rows of {self._n_embd}")
        fresher = self._newer() if self._newer is not None else None
        if fresher is not None:  # the shard's host came back (restarted): its new connection, not the old one
            self.close()
            self._adopt(fresher)
        self._reused = self._sock is not None and self._served
        self.connection()
        self._request = HEADER.pack(MAGIC, rows, width, 0, 0) + np.ascontiguousarray(hidden, dtype="<f4").tobytes()
        try:
            self._send(self._request)
        except HeadShardError:
            if not self._reused:
                raise
            self._reused = False  # a connection that died while idle: once more on a new one
            self.connection()
            self._send(self._request)
        self._pending = rows

    def finish(self, out: FloatArray) -> None:
        """Write the columns straight into ``out``'s rows (each a contiguous run of a logits row:
        no copy beside the socket's); ``out`` is left partly written when this raises."""
        rows, self._pending = self._pending, 0
        cols = self.rows[1] - self.rows[0]
        if rows == 0 or out.shape != (rows, cols):
            raise InvalidBatch(f"a head shard's columns for {rows} rows into {out.shape}")
        values = out if out.dtype == np.float32 and out.strides[1] == 4 else np.empty((rows, cols), dtype="<f4")
        try:
            self._reply(rows, rows * cols * 4, into=values)
        except HeadShardLost as exc:
            if not self._reused:
                raise
            # the connection predates this request and ended before answering it (the shard's host
            # restarted while this end was idle): the request is stateless, send it once more on
            # the next connection (where the shard's host dials: waiting for it to dial again)
            self._reused = False
            try:
                self.connection()
            except HeadShardError as again:
                raise HeadShardError(f"{exc}; {again}") from again
            self._send(self._request)
            self._reply(rows, rows * cols * 4, into=values)
        finally:
            self._request = b""
        self._served = True
        # NaN survives min and max, infinities are their own bounds: two passes, no temporary
        if not (np.isfinite(values.min()) and np.isfinite(values.max())):
            self.close()
            raise HeadShardError(f"the head shard at {self._address} answered a non-finite logit")
        if values is not out:
            out[...] = values

    def close(self) -> None:
        """Drop the connection (the next use makes a new one)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
