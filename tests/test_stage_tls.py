"""Mutual TLS on stage links: same tokens as plain TCP, and every unauthenticated peer refused.

Certificates come from ``skippy certs`` (the chain CA and its members) and, for the wrongly
certified peer, from a second CA.  Stages are real processes listening on loopback with ``--tls on``
(``auto`` would leave loopback plain) and the tiny model or the null runtime.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trio

from skippy.codec.protocol import MessageKind
from skippy.deploy.certs import make_chain_certificates
from skippy.driver import StageClient, StageLost
from skippy.net.address import Address
from skippy.net.tls import TlsFiles, client_context, is_loopback, link_uses_tls
from skippy.stage.config import config_from_mapping

from hostile_frames import raw_frame
from stage_helpers import StageProcess, stage_chain

NULL = "null:n_embd=8,n_layer=4,n_vocab=1000"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    make_chain_certificates(directory, ["stage-0", "stage-1", "driver-0"])
    make_chain_certificates(directory / "other", ["driver-0"], chain_name="another chain")
    return directory


def _tls_flags(certs: Path, name: str) -> list[str]:
    return ["--tls", "on", "--tls-cert", str(certs / f"{name}.pem"), "--tls-key", str(certs / f"{name}.key"),
            "--tls-ca", str(certs / "ca.pem")]


def test_tls_is_on_by_default_off_loopback_and_needs_its_files() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("stage.example")
    assert link_uses_tls("auto", "0.0.0.0") and not link_uses_tls("auto", "127.0.0.1")
    assert link_uses_tls("on", "127.0.0.1") and not link_uses_tls("off", "0.0.0.0")
    with pytest.raises(ValueError, match=r"listens on 0.0.0.0:9000, not a loopback address: TLS is on"):
        config_from_mapping({"model": NULL, "layers": "0:4", "listen": "0.0.0.0:9000"})
    with pytest.raises(ValueError, match=r"downstream 10.0.0.2:9000 is not a loopback address"):
        config_from_mapping({"model": NULL, "layers": "0:2", "downstream": "10.0.0.2:9000"})
    assert config_from_mapping({"model": NULL, "layers": "0:4", "listen": "0.0.0.0:9000", "tls": "off"})


@pytest.mark.slow
async def test_a_tls_chain_gives_the_same_tokens_and_refuses_every_other_peer(
        tmp_path: Path, certs: Path, tiny_llama: Path) -> None:
    """The tiny model split in two with mutual TLS on both links gives the tokens of the plain
    chain; a plain-TCP client, a client without a certificate and one certified by another CA are
    refused at the handshake, and the stage logs each refusal."""
    prompt, steps = [1, 5, 9, 13, 17, 21, 25], 8
    (tmp_path / "plain").mkdir()
    async with stage_chain(str(tiny_llama), ["0:2", "2:4"], tmp_path / "plain") as stages:
        async with await StageClient.connect(stages[0].address) as client:  # type: ignore[arg-type]
            plain = await client.generate_greedy(1, prompt, steps, chunk_size=4)
    (tmp_path / "tls").mkdir()
    final = StageProcess(str(tiny_llama), "2:4", tmp_path / "tls" / "s1.log", extra=_tls_flags(certs, "stage-1"))
    first = StageProcess(str(tiny_llama), "0:2", tmp_path / "tls" / "s0.log", downstream=await final.start(),
                         extra=_tls_flags(certs, "stage-0"))
    try:
        address = await first.start()
        driver = client_context(TlsFiles.in_directory(certs, "driver-0"))
        async with await StageClient.connect(address, tls=driver) as client:
            assert await client.generate_greedy(1, prompt, steps, chunk_size=4) == plain
        # a plain-TCP client: no READY ever comes; its first frame is not a TLS handshake
        stream = await trio.open_tcp_stream(address.host, address.port)
        await stream.send_all(raw_frame(MessageKind.PREFILL_FINAL_EMBD, token_count=1, tokens=1))
        with trio.fail_after(5):
            assert await stream.receive_some(100) == b""  # closed, not a byte of the protocol
        await stream.aclose()
        with pytest.raises(StageLost):
            await StageClient.connect(address, connect_timeout=1)
        # TLS without a client certificate
        bare = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs / "ca.pem"))
        bare.check_hostname = False
        with pytest.raises(StageLost):
            async with await StageClient.connect(address, tls=bare, connect_timeout=3) as client:
                await client.prefill(2, [1, 2])
        # a certificate from another chain's CA (and that CA trusted by the client)
        other = client_context(TlsFiles(certs / "other" / "driver-0.pem", certs / "other" / "driver-0.key",
                                        certs / "other" / "ca.pem"))
        with pytest.raises(StageLost, match="TLS handshake"):
            await StageClient.connect(address, tls=other, connect_timeout=3)
        # another chain's client certificate, our CA trusted: the stage refuses it
        mixed = client_context(TlsFiles(certs / "other" / "driver-0.pem", certs / "other" / "driver-0.key",
                                        certs / "ca.pem"))
        with pytest.raises(StageLost):
            async with await StageClient.connect(address, tls=mixed, connect_timeout=3) as client:
                await client.prefill(3, [1, 2])
        await trio.sleep(0.2)
        log = first.log()
        assert log.count("refused a connection from") >= 4, log
        assert "certificate" in log.lower()
        # the chain still serves its driver
        async with await StageClient.connect(address, tls=driver) as client:
            assert await client.generate_greedy(4, prompt, 3, chunk_size=4) == plain[:3]
    finally:
        first.kill()
        final.kill()


async def test_a_stage_without_its_certificate_does_not_start(tmp_path: Path, certs: Path) -> None:
    stage = StageProcess(NULL, "0:4", tmp_path / "s.log", extra=["--tls", "on", "--tls-cert", str(certs / "nope.pem"),
                                                                  "--tls-key", str(certs / "stage-0.key"),
                                                                  "--tls-ca", str(certs / "ca.pem")])
    with pytest.raises(RuntimeError, match="cannot load the stage's TLS files"):
        await stage.start(timeout=30)
    stage.kill()


@pytest.mark.slow
def test_skippy_up_tls_provisions_a_local_chain(tiny_llama: Path, tmp_path: Path) -> None:
    """``skippy up --tls``: certificates made in the log directory, every link under mutual TLS, the
    API serving through it, and a plain client refused by the first stage."""
    import re
    import socket

    import httpx

    from api_helpers import UpProcess

    logs = tmp_path / "logs"
    up = UpProcess(["up", "--model", str(tiny_llama), "--layers", "0:2,2:4", "--port", "0", "--ctx-size", "256",
                    "--threads", "1", "--tls", "--log-dir", str(logs)], tmp_path)
    up.start()
    try:
        assert sorted(p.name for p in (logs / "certs").glob("*.pem")) == ["ca.pem", "driver-0.pem", "stage-0.pem",
                                                                          "stage-1.pem"]
        model = httpx.get(up.url + "/v1/models").json()["data"][0]["id"]
        response = httpx.post(up.url + "/v1/chat/completions", timeout=30,
                              json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert response.status_code == 200, response.text
        host, port = re.search(r"stage 0 \(layers [^)]*\) pid \d+ ready on (\S+):(\d+)", up.stderr()).groups()  # type: ignore[union-attr]
        with socket.create_connection((host, int(port)), timeout=5) as plain:
            plain.sendall(b"\x00" * 80)
            assert plain.recv(10) == b""  # closed at the handshake: not even READY
    finally:
        up.stop()
