"""One model everywhere (docs/protocol.md §9): stages answer identity queries, a stage refuses a
downstream that serves another file, a range that does not meet or other context settings (the
refusal names both files), the driver checks the first stage, and a plain v11 peer never sees it."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from skippy.codec.protocol import READY_BYTES
from skippy.codec.protocol_ext import ErrorCode
from skippy.driver.client import StageClient, StageRemoteError
from skippy.identity import check_first_stage, file_identity, query_identity
from skippy.net.address import Address
from skippy.runtime.gguf_header import header_digest
from skippy.stage.config import config_from_mapping
from skippy.stage.identity_check import DownstreamIdentities
from skippy.stage.server import StageServer, close_runtime, load_runtime

from conftest import PROMPT, model_path
from stage_helpers import inprocess_chain, stage_chain


async def test_stage_answers_its_identity(tiny_llama: Path, tmp_path: Path) -> None:
    async with stage_chain(str(tiny_llama), ["0:2", "2:4"], tmp_path, ["--ctx-size", "256"]) as stages:
        first = await query_identity(stages[0].address)  # type: ignore[arg-type]
        last = await query_identity(stages[1].address)  # type: ignore[arg-type]
        assert first is not None and last is not None
        assert (first.layer_start, first.layer_end, last.layer_start, last.layer_end, last.layer_count) == (0, 2, 2, 4, 4)
        assert first.digest.hex() == header_digest(tiny_llama) == last.digest.hex()
        assert first.model_name == tiny_llama.name and first.ctx_size == 256
        # the chain serves normally: matching identities pass the downstream check
        async with await StageClient.connect(stages[0].address) as client:  # type: ignore[arg-type]
            assert len(await client.generate_greedy(1, PROMPT, 4)) == 4
        assert await check_first_stage(stages[0].address, tiny_llama) is None  # type: ignore[arg-type]
        problem = await check_first_stage(stages[1].address, tiny_llama)  # type: ignore[arg-type]
        assert problem is not None and "not a first stage" in problem


@pytest.mark.parametrize("case", ["other_file", "gap", "ctx"])
async def test_mismatched_downstream_refused_at_connect(case: str, tiny_llama: Path) -> None:
    """Stage servers in this process (the stage processes' server; the first test runs processes)."""
    other = model_path("llama", tied=True)  # same shapes, another file
    final_model, final_layers, final_ctx = str(tiny_llama), "2:4", 256
    if case == "other_file":
        final_model = str(other)
    elif case == "gap":
        final_layers = "3:4"
    else:
        final_ctx = 512
    servers: list[StageServer] = []
    try:
        async with trio.open_nursery() as nursery:
            downstream: Address | None = None
            for model, layers, ctx in ((final_model, final_layers, final_ctx), (str(tiny_llama), "0:2", 256)):
                config = config_from_mapping({"model": model, "layers": layers, "downstream": downstream,
                                              "ctx_size": ctx, "connect_timeout": 5, "threads": 1})
                servers.append(StageServer(config, load_runtime(config)))
                downstream = await nursery.start(servers[-1].serve)
            try:
                with trio.fail_after(20):
                    async with await StageClient.connect(downstream) as client:  # type: ignore[arg-type]
                        with pytest.raises(StageRemoteError) as caught:
                            await client.generate_greedy(1, PROMPT, 4)
            finally:
                for server in servers:
                    server.shutdown()
    finally:
        for server in servers:
            close_runtime(server.executor)
    text = str(caught.value)
    assert caught.value.frame is not None and caught.value.frame.code is ErrorCode.MODEL_MISMATCH
    assert "model mismatch with downstream stage" in text
    if case == "other_file":
        assert tiny_llama.name in text and other.name in text and "model files differ" in text
    elif case == "gap":
        assert "start at 3, not at 2" in text
    else:
        assert "context settings" in text


async def test_driver_refuses_a_first_stage_of_another_file(tiny_llama: Path, tmp_path: Path) -> None:
    async with stage_chain(str(tiny_llama), ["0:4"], tmp_path) as stages:
        other = model_path("llama", tied=True)
        problem = await check_first_stage(stages[0].address, other)  # type: ignore[arg-type]
        assert problem is not None and other.name in problem and tiny_llama.name in problem


async def test_plain_v11_peer_is_unverified_not_refused() -> None:
    """A listener that speaks READY and then never answers (a v11 stage parks the query): None
    within the timeout, remembered, and no mismatch raised."""
    async def parked(stream: trio.SocketStream) -> None:
        await stream.send_all(READY_BYTES)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, parked, 0)
        port = listeners[0].socket.getsockname()[1]
        address = Address("127.0.0.1", port)
        with trio.fail_after(3):
            assert await query_identity(address, timeout=0.3) is None
        checker = DownstreamIdentities(file_identity("null:n_embd=8,n_layer=4", 0, 2, 4, 64, 64), timeout=0.3)
        with trio.fail_after(3):
            assert await checker.verify(address) is None
        with trio.fail_after(0.1):  # remembered: no second wait
            assert await checker.verify(address) is None
        nursery.cancel_scope.cancel()


async def test_inprocess_chain_with_null_runtime_checks_too() -> None:
    async with inprocess_chain(["0:2", "2:4"]) as servers:
        identity = await query_identity(servers[1].address)  # type: ignore[arg-type]
        assert identity is not None and identity.model_name.startswith("null:")
        async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
            assert len(await client.generate_greedy(1, [1, 2, 3], 3)) == 3
