"""Real separate hosts: a 3-stage chain whose stages live in three Linux network namespaces.

Topology (each link a veth pair with its own /30; no routing, no loopback between stages):

    test process (root ns) --- ns0: stage 0:1 --- ns1: stage 1:3 --- ns2: stage 3:4 (final)

Each stage listens on its namespace's non-loopback address and dials the next over the veth
link, so the multi-host path runs as between hosts: addresses, the TLS default (a non-loopback
stage refuses to start without certificates, so the chain runs on ``skippy certs``-made mutual
TLS; a plain-TCP run is refused), the lazy downstream dial with its connect retries and the
model-identity check (over TLS).  The stages start first-to-last, the reverse of
what a launcher does, so the first lane's dials wait on nothing.  Needs root and iproute2
(``ip netns``); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import trio

from skippy.codec.protocol_ext import ErrorCode
from skippy.deploy.certs import make_chain_certificates
from skippy.driver.client import StageClient, StageRemoteError
from skippy.net.address import Address
from skippy.net.tls import TlsFiles, client_context

from conftest import PROMPT, model_path
from stage_helpers import StageProcess, reference_greedy

FLAGS = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "4", "--connect-timeout", "20"]
CHUNK = 8
STEPS = 6
PORT = 7000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"skippy-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"cannot create a network namespace here: {detail}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture(scope="module")
def namespaces() -> Iterator[tuple[list[str], list[str], str]]:
    """Three namespaces in a line; yields (names, each stage's address, the root's peer address)."""
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    tag = os.getpid() % 100000
    net = 64 + os.getpid() % 128  # a private 10.N.0.0/16 per test run, so parallel runs do not clash
    names = [f"skp{tag}n{i}" for i in range(3)]
    created: list[str] = []
    links: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        # root <-> ns0 on 10.N.0.0/30; ns(i) <-> ns(i+1) on 10.N.(i+1).0/30
        ends = [(None, names[0]), (names[0], names[1]), (names[1], names[2])]
        for index, (left, right) in enumerate(ends):
            a, b = f"skp{tag}a{index}", f"skp{tag}b{index}"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            links.append(a)
            if left is not None:
                _ip("link", "set", a, "netns", left)
            _ip("link", "set", b, "netns", right)
            prefix = ["-n", left] if left is not None else []
            _ip(*prefix, "addr", "add", f"10.{net}.{index}.1/30", "dev", a)
            _ip(*prefix, "link", "set", a, "up")
            _ip("-n", right, "addr", "add", f"10.{net}.{index}.2/30", "dev", b)
            _ip("-n", right, "link", "set", b, "up")
        addresses = [f"10.{net}.{index}.2" for index in range(3)]
        yield names, addresses, f"10.{net}.0.1"
    finally:
        for link in links:  # deleting one end of a veth removes its peer; ends in a namespace go with it
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=20)
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


class NamespacedStage(StageProcess):
    """A stage process run inside network namespace ``namespace``."""

    def __init__(self, namespace: str, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.namespace = namespace

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *super().command()]


def _tls_flags(certs: Path, index: int) -> list[str]:
    files = TlsFiles.in_directory(certs, f"stage-{index}")
    return ["--tls", "on", "--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


def _start_chain(names: list[str], addresses: list[str], model: Path, tmp_path: Path, certs: Path | None,
                 final_model: Path | None = None) -> list[NamespacedStage]:
    splits = ["0:1", "1:3", "3:4"]
    stages = []
    for index, (name, host) in enumerate(zip(names, addresses)):
        downstream = Address(addresses[index + 1], PORT) if index + 1 < len(names) else None
        path = final_model if (final_model is not None and index == 2) else model
        extra = [*FLAGS, *(_tls_flags(certs, index) if certs is not None else [])]
        stages.append(NamespacedStage(name, str(path), splits[index], tmp_path / f"ns-stage{index}.log",
                                      downstream=downstream, listen=f"{host}:{PORT}", extra=extra))
    return stages


@pytest.mark.slow
async def test_three_namespaces_equal_unsplit_and_refuse_a_mismatch(
        namespaces: tuple[list[str], list[str], str], tiny_llama: Path, tmp_path: Path) -> None:
    names, addresses, _ = namespaces
    plain = _start_chain(names, addresses, tiny_llama, tmp_path, None)[2]
    with pytest.raises(RuntimeError, match="not a loopback address"):  # the TLS default on a real link
        await plain.start()
    certs = tmp_path / "certs"
    make_chain_certificates(certs, ["stage-0", "stage-1", "stage-2", "driver-0"])
    tls = client_context(TlsFiles.in_directory(certs, "driver-0"))
    stages = _start_chain(names, addresses, tiny_llama, tmp_path, certs)
    try:
        for stage in stages:  # first to last: nothing dials downstream before a lane opens
            address = await stage.start()
            assert address.host == addresses[stages.index(stage)] and not address.host.startswith("127.")
        with trio.fail_after(60):
            async with await StageClient.connect(stages[0].address, tls=tls) as client:  # type: ignore[arg-type]
                tokens = await client.generate_greedy(1, PROMPT, STEPS, chunk_size=CHUNK, credit=2)
        assert tokens == reference_greedy(tiny_llama, PROMPT, STEPS, chunk_size=CHUNK)
        assert "ready on " + addresses[1] in stages[1].log()

        # the final host now serves another file: the next lane is refused at connect, naming both
        stages[2].kill()
        other = model_path("llama", tied=True)
        mismatched = _start_chain(names, addresses, tiny_llama, tmp_path, certs, final_model=other)[2]
        stages[2] = mismatched
        await mismatched.start()
        with trio.fail_after(60):
            async with await StageClient.connect(stages[0].address, tls=tls) as client:  # type: ignore[arg-type]
                with pytest.raises(StageRemoteError) as caught:
                    await client.generate_greedy(2, PROMPT, STEPS, chunk_size=CHUNK, credit=2)
        assert caught.value.frame is not None and caught.value.frame.code is ErrorCode.MODEL_MISMATCH
        text = str(caught.value)
        assert tiny_llama.name in text and other.name in text and f"{addresses[2]}:{PORT}" in text
    finally:
        for stage in stages:
            stage.kill()
