"""The output head split by vocabulary rows (issue 31): bitwise the unsplit logits and tokens.

A final stage ``[k, n)`` with ``split_head=r0`` runs its layers without the head, its head
rows in a head-only context and the rows ``[0, r0)`` in a head shard (in process, and over TCP
as another stage's process would serve them: dialled by the final stage, or dialling it; plain
or mutual TLS); with f32 activations every output row's logits, greedy tokens, a seeded sampling
chain's tokens, a grammar's tokens and the log-probabilities are bitwise those of the unsplit
model.  Hostile shard replies (plain and TLS) and a shard that dies are refused; over TLS a
certificate of another CA or none is refused at the handshake, and a plain end facing a TLS end
fails with an error that says so, within the handshake timeout.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import PROMPT
from skippy.deploy.certs import make_chain_certificates
from skippy.models import ensure_model, tiny
from skippy.net.tls import TlsFiles, client_context, server_context
from skippy.runtime import LayerRange, Model, Sampler, SamplingParams, StageContext
from skippy.runtime.errors import ContextError, LayerRangeError
from skippy.runtime.head_shard import (
    HEADER,
    MAGIC,
    HeadCompute,
    HeadShardError,
    HeadShardPort,
    HeadShardServer,
    LocalHeadShard,
    RemoteHeadShard,
)

LONG_PROMPT = [*PROMPT, 3681, 338, 263, 1243, 310, 278, 7934, 29889]
KW = dict(n_ctx=256, max_sessions=2, n_batch=64, threads=1)
STEPS = 12


def _split_rows(n_vocab: int) -> int:
    return (n_vocab // 3) // 32 * 32 + 32  # not a power of two: whole Q8_0 blocks only


Tls = tuple[ssl.SSLContext, ssl.SSLContext]


def _contexts(certs: Path, name: str) -> Tls:
    """The server and client contexts of the chain member ``name`` (as a stage's head shard link makes them)."""
    files = TlsFiles.in_directory(certs, name)
    return server_context(files), client_context(files)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chain's CA with stage-0 and stage-1; ``other/``: another CA's stage-0."""
    directory = tmp_path_factory.mktemp("certs")
    make_chain_certificates(directory, ["stage-0", "stage-1"])
    make_chain_certificates(directory / "other", ["stage-0"], chain_name="another chain")
    return directory


class Chain:
    """Stage 0 ``[0, k)`` and a final stage ``[k, n)``, the head whole or split (``shard``: "local" /
    "tcp" / "dial"; with ``tls``, the final stage's and the shard's contexts, both ends use TLS)."""

    def __init__(self, path: Path, cut: int, shard: str | None, tls: tuple[Tls, Tls] | None = None,
                 timeout: float = 10.0) -> None:
        final_tls, shard_tls = tls or ((None, None), (None, None))
        info_model = Model(path, LayerRange(0, cut))
        self.first = info_model
        n = info_model.info.n_layer
        self.server: HeadShardServer | None = None
        self.remote: RemoteHeadShard | None = None
        self.port: HeadShardPort | None = None
        self.compute: HeadCompute | None = None
        if shard is None:
            self.last = Model(path, LayerRange(cut, n))
        else:
            r0 = _split_rows(info_model.n_vocab)
            self.last = Model(path, LayerRange(cut, n), split_head=r0)
            self.head = Model(path, LayerRange(n, n), head_rows=(0, r0))
            self.compute = HeadCompute(self.head, n_batch=64, threads=1)
        self.c0 = StageContext(self.first, **KW)  # type: ignore[arg-type]
        self.c1 = StageContext(self.last, **KW)  # type: ignore[arg-type]
        if shard == "local":
            assert self.compute is not None
            self.c1.attach_shard(LocalHeadShard(self.compute))
        elif shard == "tcp":
            assert self.compute is not None
            self.server = HeadShardServer(self.compute, tls=shard_tls[0])
            host, port = self.server.address
            self.remote = RemoteHeadShard.dial(host, port, rows=self.compute.rows, identity=self.head.identity,
                                               n_embd=self.head.n_embd, tls=final_tls[1])
            self.c1.attach_shard(self.remote)
        elif shard == "dial":  # the shard's host dials the final stage (a chain's start order)
            assert self.compute is not None
            self.port = HeadShardPort(tls=final_tls[0])
            self.server = HeadShardServer(self.compute, host=None)
            self.server.dial(*self.port.address, tls=shard_tls[1])
            self.remote = RemoteHeadShard.through(self.port, rows=self.compute.rows, identity=self.head.identity,
                                                  n_embd=self.head.n_embd, timeout=timeout)
            self.c1.attach_shard(self.remote)

    def decode(self, tokens: list[int], pos: int, outputs: np.ndarray | None = None) -> None:
        positions = np.arange(pos, pos + len(tokens), dtype=np.int32)
        seqs = np.zeros(len(tokens), dtype=np.int32)
        self.c0.decode(positions=positions, seq_ids=seqs, tokens=tokens)
        self.c1.decode(positions=positions, seq_ids=seqs, activations=self.c0.activations(), outputs=outputs)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.server is not None:
            self.server.close()
        if self.port is not None:
            self.port.close()
        self.c0.close()
        self.c1.close()
        if self.compute is not None:
            self.compute.close()
            self.head.close()
        self.first.close()
        self.last.close()


def _run(chain: Chain, params: SamplingParams | None) -> tuple[list[np.ndarray], list[int], list[float]]:
    """The prompt's logits (every row of a first part, then only the last row of the rest), then
    ``STEPS`` sampled steps: the logits of each, the tokens and each pick's log-probability."""
    rows: list[np.ndarray] = []
    chain.decode(LONG_PROMPT[:12], 0, outputs=np.ones(12, dtype=bool))
    rows += [chain.c1.logits(i).copy() for i in range(12)]
    chain.decode(LONG_PROMPT[12:], 12)  # only the last row an output: selected at the last layer
    rows.append(chain.c1.logits(len(LONG_PROMPT) - 13).copy())
    sampler = Sampler(params or SamplingParams(), chain.last.n_vocab, chain.last.vocab_pointer)
    tokens: list[int] = []
    logprobs: list[float] = []
    row = len(LONG_PROMPT) - 13
    pos = len(LONG_PROMPT)
    for _ in range(STEPS):
        token = int(chain.c1.sample([sampler], [row])[0])
        logits = chain.c1.logits(row).astype(np.float64)
        logprobs.append(float(logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()))
        tokens.append(token)
        chain.decode([token], pos)
        rows.append(chain.c1.logits(0).copy())
        row, pos = 0, pos + 1
    sampler.close()
    return rows, tokens, logprobs


@pytest.fixture(scope="module")
def llama_path() -> Path:
    return ensure_model(tiny("llama", dtype="F32"))


_SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)
_GRAMMAR = SamplingParams(grammar='root ::= [a-z ]+')
_SLOW = pytest.mark.slow  # the fast suite: every sampling kind in process, greedy over each transport


@pytest.mark.parametrize("shard,params", [
    pytest.param("local", None, id="local-greedy"), pytest.param("local", _SEEDED, id="local-seeded"),
    pytest.param("local", _GRAMMAR, id="local-grammar"), pytest.param("tcp", None, id="tcp-greedy"),
    pytest.param("dial", None, id="dial-greedy"),
    pytest.param("tcp", _SEEDED, id="tcp-seeded", marks=_SLOW), pytest.param("tcp", _GRAMMAR, id="tcp-grammar", marks=_SLOW),
    pytest.param("dial", _SEEDED, id="dial-seeded", marks=_SLOW),
    pytest.param("dial", _GRAMMAR, id="dial-grammar", marks=_SLOW),
])
def test_split_head_is_bitwise_unsplit(llama_path: Path, shard: str, params: SamplingParams | None) -> None:
    whole = Chain(llama_path, 2, None)
    split = Chain(llama_path, 2, shard)
    try:
        ref_rows, ref_tokens, ref_logprobs = _run(whole, params)
        rows, tokens, logprobs = _run(split, params)
    finally:
        whole.close()
        split.close()
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs
    assert len(rows) == len(ref_rows)
    for got, want in zip(rows, ref_rows):
        assert np.array_equal(got, want)
    assert np.std(ref_rows[-1]) > 0.02


@pytest.mark.parametrize("shard,params", [
    pytest.param("dial", None, id="dial-greedy"), pytest.param("tcp", None, id="tcp-greedy"),
    pytest.param("dial", _SEEDED, id="dial-seeded", marks=_SLOW),
])
def test_split_head_over_tls_is_bitwise_unsplit(llama_path: Path, certs: Path, shard: str,
                                                params: SamplingParams | None) -> None:
    """The same bits with the head shard link on mutual TLS (each end its own chain certificate)."""
    whole = Chain(llama_path, 2, None)
    split = Chain(llama_path, 2, shard, tls=(_contexts(certs, "stage-1"), _contexts(certs, "stage-0")))
    try:
        ref_rows, ref_tokens, ref_logprobs = _run(whole, params)
        assert split.remote is not None
        rows, tokens, logprobs = _run(split, params)
        assert isinstance(split.remote.connection(), ssl.SSLSocket)
    finally:
        whole.close()
        split.close()
    assert (tokens, logprobs) == (ref_tokens, ref_logprobs)
    assert len(rows) == len(ref_rows) and all(np.array_equal(got, want) for got, want in zip(rows, ref_rows))


@pytest.mark.parametrize("arch,dtype", [("gemma3", "Q8_0"), ("llama", "F16")])
def test_split_head_other_families(arch: str, dtype: str) -> None:
    """gemma3's final logit softcap runs on both halves; quantized rows are whole blocks."""
    path = ensure_model(tiny(arch, dtype=dtype))  # type: ignore[arg-type]
    whole = Chain(path, 3, None)
    split = Chain(path, 3, "local")
    try:
        ref_rows, ref_tokens, _ = _run(whole, None)
        rows, tokens, _ = _run(split, None)
    finally:
        whole.close()
        split.close()
    assert tokens == ref_tokens
    assert all(np.array_equal(a, b) for a, b in zip(rows, ref_rows))


@pytest.mark.parametrize("arch,dtype", [("llama", "F32"), ("llama", "F16"), ("gemma3", "Q8_0")])
def test_odd_output_rows_are_bitwise_unsplit(arch: str, dtype: str) -> None:
    """A head-only context computes an odd count of rows as it comes (no padding: patch 0018's
    small-batch kernel makes an odd count cheaper than one more): the rows are bitwise the
    unsplit ones, and bitwise the same rows of a batch of one more."""
    path = ensure_model(tiny(arch, dtype=dtype))  # type: ignore[arg-type]
    whole = Chain(path, 3, None)
    split = Chain(path, 3, "local")
    try:
        for chain in (whole, split):
            chain.decode(LONG_PROMPT[:7], 0, outputs=np.array([1, 0, 1, 1, 0, 0, 1], dtype=bool))  # 4 rows
            chain.decode(LONG_PROMPT[7:12], 7, outputs=np.array([1, 1, 0, 1, 0], dtype=bool))  # 3 rows
        assert all(np.array_equal(split.c1.logits(i), whole.c1.logits(i)) for i in (0, 1, 3))
        for chain in (whole, split):
            chain.decode(LONG_PROMPT[12:17], 12, outputs=np.ones(5, dtype=bool))  # 5 rows
        assert all(np.array_equal(split.c1.logits(i), whole.c1.logits(i)) for i in range(5))
        assert split.compute is not None
        hidden = np.random.default_rng(1).standard_normal((6, split.compute.n_embd)).astype(np.float32)
        context, rows = split.compute.context, []
        decode = context.decode
        context.decode = lambda **kw: (rows.append(len(kw["positions"])), decode(**kw))[1]  # type: ignore[method-assign]
        split.compute.compute(hidden[:2])
        for count in (3, 5):
            odd = split.compute.compute(hidden[:count]).copy()
            assert odd.shape == (count, split.compute.rows[1])
            assert np.array_equal(odd, split.compute.compute(hidden[:count + 1])[:count])
        assert rows == [2, 3, 4, 5, 6]  # each batch as it came
    finally:
        whole.close()
        split.close()


def test_split_head_needs_its_shard(llama_path: Path) -> None:
    model = Model(llama_path, LayerRange(2, 4), split_head=_split_rows(32000))
    try:
        assert model.is_last and not model.has_head and model.head_model is not None
        with StageContext(model, **KW) as context:  # type: ignore[arg-type]
            with pytest.raises(ContextError, match="attach a head shard"):
                context.decode(positions=[0], seq_ids=[0], activations=np.zeros((1, model.n_embd), np.float32))
            with pytest.raises(ContextError, match="does not complete"):
                context.attach_shard(type("S", (), {"rows": (0, 5)})())  # type: ignore[arg-type]
    finally:
        model.close()
    with pytest.raises(LayerRangeError):
        Model(llama_path, LayerRange(0, 2), split_head=10)
    with pytest.raises(LayerRangeError):
        Model(llama_path, LayerRange(4, 4), head_rows=(20, 10))


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:  # (a TLS socket takes no MSG_WAITALL)
        chunk = conn.recv(size - len(data))
        assert chunk, "the client closed"
        data += chunk
    return data


class _FakeShard:
    """A TCP peer (over TLS with ``tls``, a server context) that answers the handshake as a shard of
    ``rows`` and then ``reply(rows, width)``."""

    def __init__(self, rows: tuple[int, int], reply, tls: ssl.SSLContext | None = None) -> None:  # type: ignore[no-untyped-def]
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.rows = rows
        self.reply = reply
        self.tls = tls
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True)
        with conn:
            _exactly(conn, HEADER.size)
            conn.sendall(HEADER.pack(MAGIC, 0, 0, *self.rows) + b"x" * 24)
            _, n, width, _, _ = HEADER.unpack(_exactly(conn, HEADER.size))
            _exactly(conn, n * width * 4)
            data = self.reply(n, width)
            if data is not None:
                conn.sendall(data)

    def close(self) -> None:
        self.listener.close()


def _cols(rows: tuple[int, int]) -> int:
    return rows[1] - rows[0]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("case", ["count", "rows", "nan", "inf", "status", "dies"])
def test_hostile_shard_replies_are_refused(case: str, tls: bool, certs: Path) -> None:
    rows = (0, 64)
    replies = {
        "count": lambda n, w: HEADER.pack(MAGIC, 0, n + 1, *rows) + b"\0" * ((n + 1) * 64 * 4),
        "rows": lambda n, w: HEADER.pack(MAGIC, 0, n, 0, 32) + b"\0" * (n * 32 * 4),
        "nan": lambda n, w: HEADER.pack(MAGIC, 0, n, *rows) + np.full(n * 64, np.nan, "<f4").tobytes(),
        "inf": lambda n, w: HEADER.pack(MAGIC, 0, n, *rows) + np.full(n * 64, -np.inf, "<f4").tobytes(),
        "status": lambda n, w: HEADER.pack(MAGIC, 1, 4, 0, 0) + b"oops",
        "dies": lambda n, w: None,
    }
    server_tls, client_tls = _contexts(certs, "stage-0") if tls else (None, None)
    peer = _FakeShard(rows, replies[case], tls=server_tls)
    client = RemoteHeadShard.dial(*peer.address, rows=rows, n_embd=8, tls=client_tls)
    try:
        client.start(np.ones((2, 8), np.float32))
        with pytest.raises(HeadShardError, match={"count": "answered 3 rows", "rows": "head rows 0:32",
                                                   "nan": "non-finite", "inf": "non-finite", "status": "refused: oops",
                                                   "dies": "is gone"}[case]):
            client.finish(np.zeros((2, 64), np.float32))
    finally:
        client.close()
        peer.close()


def test_server_refuses_a_wrong_width(llama_path: Path) -> None:
    head = Model(llama_path, LayerRange(4, 4), head_rows=(0, 64))
    compute = HeadCompute(head, n_batch=8, threads=1)
    server = HeadShardServer(compute)
    try:
        with socket.create_connection(server.address) as conn:
            conn.sendall(HEADER.pack(MAGIC, 2, head.n_embd + 1, 0, 0))
            magic, status, length, _, _ = HEADER.unpack(conn.recv(HEADER.size, socket.MSG_WAITALL))
            assert (magic, status) == (MAGIC, 1)
            assert b"rows of 64" in conn.recv(length, socket.MSG_WAITALL)
        with socket.create_connection(server.address) as conn:
            conn.sendall(HEADER.pack(MAGIC, 9, head.n_embd, 0, 0))  # more rows than its batch
            assert HEADER.unpack(conn.recv(HEADER.size, socket.MSG_WAITALL))[1] == 1
        with pytest.raises(HeadShardError, match="another model"):
            RemoteHeadShard.dial(*server.address, rows=(0, 64), identity="not-this-one", n_embd=head.n_embd)
    finally:
        server.close()
        compute.close()
        head.close()
    assert struct.calcsize("<4sIIII") == HEADER.size


def test_a_shard_that_dies_is_a_clear_error_and_a_new_one_is_taken(llama_path: Path) -> None:
    """A shard's host gone for good: the request waits the port's timeout for it to dial again,
    then fails naming both; a replacement that dials later is taken."""
    chain = Chain(llama_path, 2, "dial", timeout=1.0)
    whole = Chain(llama_path, 2, None)
    try:
        chain.decode(LONG_PROMPT[:4], 0)
        assert chain.server is not None
        chain.server.close()  # the shard's host is gone
        with pytest.raises(HeadShardError, match="is gone.*no head shard has connected"):
            chain.decode([5], 4)
        assert chain.compute is not None and chain.port is not None
        chain.server = HeadShardServer(chain.compute, host=None)  # its replacement dials again
        chain.server.dial(*chain.port.address)
        chain.c0.remove(0, 4)
        chain.c1.remove(0, 4)
        chain.decode([5], 4)
        whole.decode(LONG_PROMPT[:4], 0)
        whole.decode([5], 4)
        assert np.array_equal(chain.c1.logits(0), whole.c1.logits(0))
    finally:
        chain.close()
        whole.close()


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_restarted_shard_serves_the_next_request_without_an_error(llama_path: Path, when: str) -> None:
    """The shard's host restarted while the final stage was idle (a launcher's restart of the stage
    serving the head rows): the next request is answered, bitwise, on the new connection, whether
    it dialled before the request came ("before": taken in place of the old one) or only while the
    request was waiting ("during": the request, lost on the old one, is sent again)."""
    chain = Chain(llama_path, 2, "dial", timeout=10.0)
    whole = Chain(llama_path, 2, None)
    try:
        chain.decode(LONG_PROMPT[:4], 0)
        whole.decode(LONG_PROMPT[:4], 0)
        assert chain.server is not None and chain.compute is not None and chain.port is not None
        chain.server.close()
        replacement = HeadShardServer(chain.compute, host=None)
        if when == "before":
            replacement.dial(*chain.port.address)
            deadline = time.monotonic() + 10
            while chain.port._newest is None and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            timer = threading.Timer(0.3, replacement.dial, args=chain.port.address)
            timer.start()
        chain.server = replacement
        chain.decode([5], 4)
        whole.decode([5], 4)
        assert np.array_equal(chain.c1.logits(0), whole.c1.logits(0))
    finally:
        chain.close()
        whole.close()


# -- TLS: a certificate of another CA, or none, is refused; a plain end facing a TLS end fails clearly --

def _no_certificate_client(certs: Path) -> ssl.SSLContext:
    """A client that trusts the chain CA but presents no certificate of its own."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs / "ca.pem"))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    return context


def _impostor_client(certs: Path) -> ssl.SSLContext:
    """A client that trusts the chain CA and presents another CA's certificate."""
    context = _no_certificate_client(certs)
    context.load_cert_chain(str(certs / "other" / "stage-0.pem"), str(certs / "other" / "stage-0.key"))
    return context


@pytest.mark.parametrize("who", ["other-ca", pytest.param("no-certificate", marks=pytest.mark.slow)])  # each waits out a timeout
def test_the_final_stages_tls_port_refuses_a_shard_without_the_chains_certificate(
        llama_path: Path, certs: Path, who: str) -> None:
    """A shard dialling with another CA's certificate or none is refused at the handshake: the
    port counts and names it, and the final stage's wait for a shard says why none came."""
    head = Model(llama_path, LayerRange(4, 4), head_rows=(0, 64))
    compute = HeadCompute(head, n_batch=8, threads=1)
    port = HeadShardPort(tls=_contexts(certs, "stage-1")[0], handshake_timeout=2.0)
    server = HeadShardServer(compute, host=None)
    dialler = _impostor_client(certs) if who == "other-ca" else _no_certificate_client(certs)
    server.dial(*port.address, retry_s=0.1, tls=dialler)
    client = RemoteHeadShard.through(port, rows=(0, 64), identity=head.identity, n_embd=head.n_embd, timeout=3.0)
    try:
        started = time.monotonic()
        reason = "CERTIFICATE_VERIFY_FAILED" if who == "other-ca" else "PEER_DID_NOT_RETURN_A_CERTIFICATE"
        with pytest.raises(HeadShardError, match=rf"no head shard has connected .* refused at the TLS handshake, "
                                                 rf"the last from 127.0.0.1:\d+ \(TLS handshake failed: ({reason})"):
            client.connection()
        assert time.monotonic() - started < 6 and port.refused >= 1
    finally:
        client.close()
        server.close()
        port.close()
        compute.close()
        head.close()


def test_a_listening_tls_shard_refuses_and_is_refused_by_another_ca(llama_path: Path, certs: Path) -> None:
    """The final stage dialling a TLS shard: a shard certified by another CA fails its handshake
    (the final stage names the reason), and so does a final stage of another CA at the shard."""
    head = Model(llama_path, LayerRange(4, 4), head_rows=(0, 64))
    compute = HeadCompute(head, n_batch=8, threads=1)
    server = HeadShardServer(compute, tls=_contexts(certs / "other", "stage-0")[0])
    try:
        with pytest.raises(HeadShardError, match="TLS handshake failed: CERTIFICATE_VERIFY_FAILED"):
            RemoteHeadShard.dial(*server.address, rows=(0, 64), n_embd=head.n_embd,
                                 tls=_contexts(certs, "stage-1")[1], timeout=5.0)
    finally:
        server.close()
    server = HeadShardServer(compute, tls=_contexts(certs, "stage-0")[0])
    impostor = _impostor_client(certs)
    try:  # TLS 1.3: the client's handshake ends before the server checks its certificate; the alert comes next
        with pytest.raises(HeadShardError, match=r"is gone: .*\(right after the TLS handshake: did the shard refuse"):
            RemoteHeadShard.dial(*server.address, rows=(0, 64), n_embd=head.n_embd, tls=impostor, timeout=5.0)
    finally:
        server.close()
        compute.close()
        head.close()


@pytest.mark.parametrize("final,shard", [pytest.param("tls", "plain", marks=pytest.mark.slow),  # waits out a timeout
                                         ("plain", "tls")])
def test_a_plain_end_facing_a_tls_end_fails_clearly(llama_path: Path, certs: Path, final: str, shard: str) -> None:
    """Either end plain, the other TLS, either end listening: an error naming the mismatch (or the
    handshake that never came) within the handshake timeout, never a hang."""
    head = Model(llama_path, LayerRange(4, 4), head_rows=(0, 64))
    compute = HeadCompute(head, n_batch=8, threads=1)
    final_tls = _contexts(certs, "stage-1") if final == "tls" else (None, None)
    shard_tls = _contexts(certs, "stage-0") if shard == "tls" else (None, None)
    try:
        # the final stage listens (a chain's order): its port, the shard dialling it
        port = HeadShardPort(tls=final_tls[0], handshake_timeout=1.0)
        server = HeadShardServer(compute, host=None, handshake_timeout=1.0)
        server.dial(*port.address, retry_s=0.1, tls=shard_tls[1])
        client = RemoteHeadShard.through(port, rows=(0, 64), identity=head.identity, n_embd=head.n_embd, timeout=3.0)
        started = time.monotonic()
        want = ("no TLS handshake within 1 s" if final == "tls" else "sent a TLS record on a plain head shard link")
        try:
            with pytest.raises(HeadShardError, match=want):
                client.connection()
        finally:
            client.close()
            server.close()
            port.close()
        assert time.monotonic() - started < 6
        # the shard listens, the final stage dials it
        server = HeadShardServer(compute, tls=shard_tls[0], handshake_timeout=1.0)
        started = time.monotonic()
        want = ("is gone|TLS record" if final == "plain" else "TLS handshake failed: (WRONG_VERSION_NUMBER|RECORD_LAYER)")
        try:
            with pytest.raises(HeadShardError, match=want):
                RemoteHeadShard.dial(*server.address, rows=(0, 64), n_embd=head.n_embd, tls=final_tls[1], timeout=5.0)
        finally:
            server.close()
        assert time.monotonic() - started < 6
    finally:
        compute.close()
        head.close()
