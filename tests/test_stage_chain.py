"""Real stage processes on a generated model: exactness, batching, rollback, faults, shutdown.

Every test starts ``python -m skippy.stage`` processes (final stage first) on the tiny 4-layer
llama and drives them with :class:`StageClient`.  The unsplit reference is the whole model in
this process with the same chunking and batch size, so f32 chains must match it token for token.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import numpy as np
import pytest
import trio

from skippy.codec.protocol import WireDType
from skippy.codec.protocol_ext import ErrorCode
from skippy.driver import StageClient, StageLost
from skippy.runtime import Model, StageContext
from skippy.stage.executor import Executor, WorkItem
from skippy.stage.transport import codec

from stage_helpers import StageProcess, reference_greedy, stage_chain, wait_for_stats

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354],
    [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889, 306],
    [1, 13, 4013, 338, 263, 1243],
]
STEPS = 32
CHUNK = 5
FLAGS = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "8"]
SPLITS = {1: ["0:4"], 2: ["0:2", "2:4"], 3: ["0:1", "1:2", "2:4"], 4: ["0:1", "1:2", "2:3", "3:4"]}


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    return [reference_greedy(tiny_llama, prompt, STEPS, chunk_size=CHUNK) for prompt in PROMPTS]


async def _generate(address: object, prompts: list[list[int]]) -> list[list[int]]:
    async with await StageClient.connect(address) as client:  # type: ignore[arg-type]
        return [await client.generate_greedy(index + 1, prompt, STEPS, chunk_size=CHUNK, credit=2)
                for index, prompt in enumerate(prompts)]


@pytest.mark.parametrize(("stages", "inline_decode"), [(1, "on"), (2, "on"), (3, "on"), (4, "on"), (2, "off"), (4, "off")])
async def test_f32_chain_matches_the_unsplit_model(stages: int, inline_decode: str, tiny_llama: Path, tmp_path: Path,
                                                   reference: list[list[int]]) -> None:
    flags = [*FLAGS, "--inline-decode", inline_decode]  # decodes on the trio thread, or all on the runtime thread
    async with stage_chain(str(tiny_llama), SPLITS[stages], tmp_path, flags) as chain:
        tokens = await _generate(chain[0].address, PROMPTS)
    assert tokens == reference


@pytest.mark.parametrize("dtype", ["f16", "q8"])
async def test_lossy_wires_report_agreement_and_logit_error(dtype: str, tiny_llama: Path, tmp_path: Path,
                                                           reference: list[list[int]]) -> None:
    async with stage_chain(str(tiny_llama), SPLITS[2], tmp_path, [*FLAGS, "--wire-dtype", dtype]) as chain:
        tokens = await _generate(chain[0].address, PROMPTS)
    agree = sum(a == b for got, want in zip(tokens, reference) for a, b in zip(got, want))
    # Logit error of one hop through the lossy wire, in process (the wire returns tokens only).
    wire = WireDType[dtype.upper()]
    with Model(tiny_llama, "0:2") as head, Model(tiny_llama, "2:4") as tail, \
            StageContext(head, n_ctx=512, n_batch=64, threads=1) as first, \
            StageContext(tail, n_ctx=512, n_batch=64, threads=1) as last:
        prompt = PROMPTS[0]
        positions = list(range(len(prompt)))
        first.decode(tokens=prompt, positions=positions, seq_ids=[0] * len(prompt))
        hidden = first.activations().copy()
        rows = hidden.shape[0]
        errors = []
        for variant in (hidden, codec.decode_activation(codec.encode_activation(hidden, wire), wire, rows, hidden.shape[1])):
            last.remove(0)
            last.decode(activations=np.ascontiguousarray(variant, dtype=np.float32), positions=positions,
                        seq_ids=[0] * rows, outputs=[True] * rows)
            errors.append(np.stack([last.logits(r).copy() for r in range(rows)]))
        max_error = float(np.max(np.abs(errors[0] - errors[1])))
    print(f"\n{dtype} wire: token agreement {agree}/{len(PROMPTS) * STEPS}, max logit error {max_error:.3g}")
    assert agree >= 1 and np.isfinite(max_error)


async def test_concurrent_sessions_match_sequential_and_batch(tiny_llama: Path, tmp_path: Path) -> None:
    prompts = [PROMPTS[i % 3][: 4 + i] for i in range(8)]
    async with stage_chain(str(tiny_llama), SPLITS[2], tmp_path, FLAGS) as chain:
        address = chain[0].address
        sequential = []
        async with await StageClient.connect(address) as client:  # type: ignore[arg-type]
            for index, prompt in enumerate(prompts):
                sequential.append(await client.generate_greedy(100 + index, prompt, 12, chunk_size=CHUNK))
        concurrent: dict[int, list[int]] = {}

        async def run(client: StageClient, index: int) -> None:
            concurrent[index] = await client.generate_greedy(index + 1, prompts[index], 12, chunk_size=CHUNK)

        # every lane connected before any generates: on a loaded host (a CI run) lanes that
        # connected one by one ran one after another, and no rows met (69 batches, all of 1 row)
        async with contextlib.AsyncExitStack() as lanes:
            clients = [await lanes.enter_async_context(await StageClient.connect(address))  # type: ignore[arg-type]
                       for _ in range(8)]
            async with trio.open_nursery() as nursery:
                for index, client in enumerate(clients):
                    nursery.start_soon(run, client, index)
        stats = [await wait_for_stats(stage, lambda s: s["sessions_in_use"] == 0) for stage in chain]
    assert [concurrent[i] for i in range(8)] == sequential
    print(f"\ndecode batch sizes per stage: {[each['decode_batch_sizes'] for each in stats]}")
    # Rows batch where they meet: the first stage takes the 8 lanes' rows together; the final
    # stage only when rows reach it while it computes, which on a tiny model depends on timing.
    assert max(int(each["max_decode_batch"]) for each in stats) > 1  # type: ignore[call-overload]


def test_decode_behind_the_kv_gives_the_logits_of_a_session_that_never_went_ahead(tiny_llama: Path) -> None:
    prompt = [int(t) for t in PROMPTS[0]]
    n = len(prompt)

    def run(executor: Executor, tokens: list[int], start: int, align: int | None) -> np.ndarray:
        executor.run_item(WorkItem(1, np.arange(start, start + len(tokens), dtype=np.int32),
                                   np.asarray(tokens, dtype=np.int32), align_to=align))
        context = executor.context
        return context.logits(int(context.output_rows[-1])).copy()  # type: ignore[attr-defined]

    results = []
    with Model(tiny_llama) as model:
        for ahead in ([5, 6, 7], []):  # a session that went ahead speculatively, and one that did not
            with StageContext(model, n_ctx=256, max_sessions=2, n_batch=64, threads=1) as ctx:
                executor = Executor(ctx)
                run(executor, prompt, 0, None)
                for step, token in enumerate(ahead):
                    run(executor, [token], n + step, n + step)
                results.append(run(executor, [42], n, n))  # authoritative position n: trims first
                assert ctx.length(executor._sessions[1].seq) == n + 1
                executor.close()
    assert np.array_equal(results[0], results[1])


async def test_rollback_through_a_chain(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = PROMPTS[1]
    async with stage_chain(str(tiny_llama), SPLITS[2], tmp_path, FLAGS) as chain:
        async with await StageClient.connect(chain[0].address) as client:  # type: ignore[arg-type]
            first = (await client.prefill(1, prompt, chunk_size=CHUNK)).token
            for step in range(4):
                await client.decode(1, 100 + step, len(prompt) + step)
            rolled = await client.decode(1, first, len(prompt))
            await client.prefill(2, prompt, chunk_size=CHUNK)
            fresh = await client.decode(2, first, len(prompt))
            assert rolled.predicted == fresh.predicted
            window = await client.verify(2, [fresh.predicted, 7, 8], len(prompt) + 1, window_id=5)
            assert len(window.predicted_tokens) == 3 and window.predicted_tokens[0] == (
                await client.decode(1, fresh.predicted, len(prompt) + 1)).predicted
        stats = await wait_for_stats(chain[1], lambda s: s["auto_aligns"] >= 1)
        assert stats["trimmed_tokens"] == 4


async def test_killed_downstream_fails_fast_and_a_restart_serves_new_sessions(tiny_llama: Path, tmp_path: Path) -> None:
    async with stage_chain(str(tiny_llama), SPLITS[3], tmp_path, FLAGS) as chain:
        survivor = await StageClient.connect(chain[0].address)  # type: ignore[arg-type]
        victim = await StageClient.connect(chain[0].address)  # type: ignore[arg-type]
        try:
            await victim.prefill(1, PROMPTS[0], chunk_size=CHUNK)
            lost = chain[2]
            lost_address = lost.address
            lost.kill()
            started = trio.current_time()
            with pytest.raises(StageLost, match="first stage") as raised:
                await victim.decode(1, 5, len(PROMPTS[0]))
            assert trio.current_time() - started < 2.0
            # the extension Error frame, written by stage 1 and relayed by stage 0, names the lost stage
            error = raised.value.frame
            assert error is not None and error.code == ErrorCode.DOWNSTREAM_LOST
            assert (error.origin_stage_index, error.reporter_stage_index) == (2, 1)
            assert f"stage 2 ({lost_address})" in str(raised.value)
            await trio.sleep(0.2)
            assert f"downstream stage {lost_address}" in chain[1].log()
            restarted = StageProcess(str(tiny_llama), "2:4", tmp_path / "stage2b.log", listen=str(lost_address),
                                     extra=FLAGS)
            try:
                await restarted.start()
                tokens = await survivor.generate_greedy(2, PROMPTS[2], 4, chunk_size=CHUNK)
                assert tokens == reference_greedy(tiny_llama, PROMPTS[2], 4, chunk_size=CHUNK)
            finally:
                restarted.kill()
        finally:
            await survivor.aclose()
            await victim.aclose()


async def test_sessions_return_to_idle_and_sigterm_exits_cleanly(tiny_llama: Path, tmp_path: Path) -> None:
    # one lane leaves up to five sessions to its disconnect: more than the default per-lane quota
    # (half of --max-sessions), which this test is not about
    async with stage_chain(str(tiny_llama), SPLITS[2], tmp_path, FLAGS + ["--session-quota", "0"]) as chain:
        idle_sockets = [stage.socket_count() for stage in chain]
        for batch in range(10):
            async with await StageClient.connect(chain[0].address) as client:  # type: ignore[arg-type]
                for session in range(20):
                    await client.configure(session + 1)
                    await client.prefill(session + 1, PROMPTS[2][:3])
                    await client.decode(session + 1, 5, 3)
                    if session % 4 != 3:
                        await client.stop(session + 1)  # every fourth session is left to the disconnect
        for stage in chain:
            stats = await wait_for_stats(stage, lambda s: s["connections_open"] == 0 and s["sessions_in_use"] == 0)
            assert stats["kv_cells_used"] == 0 and stats["connection_errors"] == 0
            assert stats["sessions_released"] + stats["orphan_sessions_released"] == 200
        with trio.fail_after(5):
            while [stage.socket_count() for stage in chain] != idle_sockets:
                await trio.sleep(0.05)
        # SIGTERM with a lane open: it drains and exits 0
        async with await StageClient.connect(chain[0].address) as client:  # type: ignore[arg-type]
            await client.prefill(1, PROMPTS[0][:4])
            assert chain[0].process is not None
            chain[0].process.send_signal(signal.SIGTERM)
            assert await trio.to_thread.run_sync(chain[0].process.wait, 10) == 0
        assert "stopped" in chain[0].log()


async def test_client_sees_each_stages_timings_and_batch_sizes(tiny_llama: Path, tmp_path: Path) -> None:
    async with stage_chain(str(tiny_llama), SPLITS[3], tmp_path, FLAGS) as chain:
        async with await StageClient.connect(chain[0].address) as one, \
                await StageClient.connect(chain[0].address) as two:  # type: ignore[arg-type]
            for session, client in ((1, one), (2, two)):
                await client.prefill(session, PROMPTS[0], chunk_size=CHUNK)
                prefill = client.last_timings
                assert prefill is not None and [r.stage_index for r in prefill.records] == [2, 1, 0]
            client_timings: list[object] = []
            async with trio.open_nursery() as nursery:
                async def decode(session: int, client: StageClient) -> None:
                    for step in range(8):
                        await client.decode(session, 5, len(PROMPTS[0]) + step)
                        client_timings.append(client.last_timings)
                nursery.start_soon(decode, 1, one)
                nursery.start_soon(decode, 2, two)
    assert len(client_timings) == 16
    layers = [(2, 4), (1, 2), (0, 1)]
    batches = []
    for timings in client_timings:
        records = timings.records  # type: ignore[attr-defined]
        assert [r.stage_index for r in records] == [2, 1, 0]
        assert [(r.layer_start, r.layer_end) for r in records] == layers
        assert all(1 <= r.batch_size <= 2 and 0 < r.compute_us < 5_000_000 for r in records)
        assert records[0].forward_write_us == 0 and records[0].downstream_wait_us == 0
        # from its downstream write to the reply, a stage waits at least as long as the stage below
        # computed (the split between write and wait depends on when the writer task resumes)
        for upper, lower in ((records[1], records[0]), (records[2], records[1])):
            assert upper.forward_write_us + upper.downstream_wait_us >= lower.compute_us
        assert all(r.queue_wait_us < 5_000_000 and r.forward_write_us < 1_000_000 for r in records)
        batches += [r.batch_size for r in records]
    print(f"\nbatch sizes seen: {sorted(set(batches))}; last: {client_timings[-1]}")
