"""A stage's Prometheus endpoint (``--metrics-listen``): real stage processes serve a chain, and
``/metrics`` parsed with prometheus_client's own parser shows the counters move."""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.net.address import Address

from stage_helpers import stage_chain

_METRICS = re.compile(r"metrics on http://(\S+):(\d+)/metrics")


def _http_get(address: Address, path: str) -> tuple[int, str]:
    with socket.create_connection((address.host, address.port), timeout=10) as connection:
        connection.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def scrape(address: Address) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (sample name, sorted labels minus ``layers``)."""
    status, body = _http_get(address, "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "layers"))
            samples[(sample.name, labels)] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.mark.slow
async def test_metrics_move_as_the_chain_serves(tiny_llama: Path, tmp_path: Path) -> None:
    flags = ["--cache-page-size", "16", "--ctx-size", "1024", "--batch-size", "64", "--metrics-listen", "127.0.0.1:0"]
    async with stage_chain(str(tiny_llama), ["0:2", "2:4"], tmp_path, flags) as stages:
        addresses = []
        for stage in stages:
            match = _METRICS.search(stage.log())
            assert match, stage.log()
            addresses.append(Address(match.group(1), int(match.group(2))))
        before = [scrape(address) for address in addresses]
        assert value(before[0], "skippy_stage_decode_tokens_total") == 0
        assert value(before[0], "skippy_stage_kv_cells_capacity") == 1024

        generator = Generator.from_model(tiny_llama, n_ctx=1024, chunk_size=32, credit=2)
        generator.cache_page_size = 16  # as the stages' --cache-page-size
        rng = random.Random(3)
        prompt = tuple(rng.randrange(3, 30000) for _ in range(3 * 16 + 5))
        assert stages[0].address is not None
        async with await StageClient.connect(stages[0].address, reply_timeout=60) as client:
            for session in (1, 2):  # the same prompt twice: the second restores from the cache
                request = GenerationRequest(prompt, 6, speculation=False, prefix_cache=True)
                await generator.generate(client, request, session)
            # direct return: both stages relay the decode after the first token outside Python
            generator.direct_return = lambda: stages[-1].address
            await generator.generate(client, GenerationRequest(prompt, 8, speculation=False), 3)
            during = [scrape(address) for address in addresses]
            assert value(during[0], "skippy_stage_connections_open") == 1
        generator.close()
        await trio.sleep(0.3)
        after = [scrape(address) for address in addresses]
        for index, (old, new) in enumerate(zip(before, after)):
            moved = {name: value(new, name) - value(old, name) for name in (
                "skippy_stage_decode_tokens_total", "skippy_stage_prefill_chunks_total",
                "skippy_stage_messages_total", "skippy_stage_prefix_cache_hits_total",
                "skippy_stage_prefix_cache_records_total", "skippy_stage_compute_seconds_count",
                "skippy_stage_queue_wait_seconds_count", "skippy_stage_decode_batch_size_count",
                "skippy_stage_connections_total")}
            assert all(delta > 0 for delta in moved.values()), (index, moved)
            assert value(new, "skippy_stage_compute_seconds_sum") > 0
            assert value(new, "skippy_stage_lane_bytes_total", lane="upstream", direction="in") > 0
            assert value(new, "skippy_stage_lane_bytes_total", lane="upstream", direction="out") > 0
            assert value(new, "skippy_stage_connections_open") == 0
        # the first stage forwards: its downstream lane carried activations and waited for replies
        assert value(after[0], "skippy_stage_lane_bytes_total", lane="downstream", direction="out") > \
            value(after[0], "skippy_stage_lane_bytes_total", lane="upstream", direction="in")
        assert value(after[0], "skippy_stage_downstream_wait_seconds_count") > 0
        assert value(after[0], "skippy_stage_decode_relay_tokens_total") >= 5  # 8 tokens: the first 2 are not
        assert value(after[0], "skippy_stage_decode_relay_runs_total") >= 1
        assert value(after[1], "skippy_stage_decode_relay_tokens_total") >= 5  # greedy: the final stage's too
        assert value(during[0], "skippy_stage_sessions_in_use") >= 0
        # docs/protocol.md §14: the activation log's budget (none on the final stage), empty once sessions end
        assert value(after[0], "skippy_stage_resume_log_budget_bytes") == 64 << 20
        assert value(after[1], "skippy_stage_resume_log_budget_bytes") == 0
        assert value(after[0], "skippy_stage_resume_log_bytes") == 0
        assert _http_get(addresses[0], "/other")[0] == 404


@pytest.mark.slow
async def test_errors_are_counted_by_code(tiny_llama: Path, tmp_path: Path) -> None:
    flags = ["--metrics-listen", "127.0.0.1:0", "--ctx-size", "256"]
    async with stage_chain(str(tiny_llama), ["0:4"], tmp_path, flags) as stages:
        match = _METRICS.search(stages[0].log())
        assert match
        address = Address(match.group(1), int(match.group(2)))
        assert stages[0].address is not None
        stream = await trio.open_tcp_stream(stages[0].address.host, stages[0].address.port)
        async with stream:
            assert await stream.receive_some(4)  # READY
            await stream.send_all(b"\xff" * 200)  # not a frame
            with trio.fail_after(10):
                while await stream.receive_some(4096):
                    pass
        with trio.fail_after(10):
            while ("skippy_stage_errors_total", (("code", "malformed_frame"),)) not in scrape(address):
                await trio.sleep(0.05)
