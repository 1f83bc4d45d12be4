"""Hyper-connection stage boundaries (patch 0013, protocol.md §12): DeepSeek V4 hands on its
hc_mult residual streams, hc_mult x n_embd per token, announced by the boundary-rows extension.

The unit tests pin the stage's check of the announced width (refused naming both widths), the
loaded ranges' widths and the cut points of a DeepSeek-V4-shaped model; the chain test runs the
three-stage split through real stage processes (two wide boundaries on the wire) against the
unsplit model.  The bitwise per-split exactness is tests/test_arch_exactness.py's (deepseek4).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import trio

from skippy.codec.protocol import MessageKind, StageMessage, StateFlag, WireDType, boundary_rows_flags
from skippy.codec.protocol_ext import ErrorCode
from skippy.deploy.plan import HostSpec, ModelShape, PlanSettings, plan_chain, stage_memory
from skippy.driver import GenerationRequest, Generator, StageClient
from skippy.lane.errors import InvalidMessage
from skippy.lane.messages import outgoing, work_item
from skippy.lane.protocol import LaneProtocol
from skippy.models import ensure_model, tiny
from skippy.models.spec import ModelSpec
from skippy.runtime import LayerRangeError, Model
from skippy.runtime.cuts import KvGroup, kv_groups, legal_cuts
from skippy.stage.executor import sideband_flag

from chain_helpers import InProcessChain, greedy_run
from stage_helpers import StageProcess, inprocess_chain, reference_greedy, stage_chain
from conftest import PROMPT

MIB = 1 << 20
HC = 4
WIDE = boundary_rows_flags(HC)
#: test_arch_exactness's prompt: 20 tokens, past the indexer's top-k of 8.
LONG_PROMPT = [*PROMPT, 3681, 338, 263, 1243, 310, 278, 7934, 29889]


def _dispatch(kind: MessageKind, **changes: object):  # type: ignore[no-untyped-def]
    return LaneProtocol(1).message_received(StageMessage.create(kind, session_id=1, **changes))


def test_a_hyper_connection_stage_takes_and_forwards_k_rows_per_token() -> None:
    streams = np.arange(2 * HC * 4, dtype=np.float32).reshape(2, HC * 4)  # the runtime: one row per token
    wire = np.concatenate([streams[:, part * 4:(part + 1) * 4] for part in range(HC)])  # part by part
    dispatch = _dispatch(MessageKind.PREFILL_EMBD, token_count=2, activation=wire, state_changes={"flags": WIDE})
    item = work_item(dispatch, 7, is_first=False, width=4, sideband_flag=sideband_flag("deepseek4", HC))
    assert item.activations is not None and np.array_equal(item.activations, streams)
    forwarded = outgoing(dispatch.message, item.activations, WireDType.F32, WIDE)
    assert forwarded.state.activation_row_multiplier == HC and np.array_equal(forwarded.activation, wire)


@pytest.mark.parametrize(
    ("flags", "rows", "reason"),
    [
        (0, 2, r"announces 1 row\(s\) of n_embd per token \(state flags 0x0\): this stage's first layer takes 4"),
        (boundary_rows_flags(3), 6, r"announces 3 row\(s\) .* takes 4"),
        (int(StateFlag.GEMMA3N_ALTUP_SIDEBAND), 8, r"announces 4 row\(s\) .*flags 0x80\).* takes 4"),
        (boundary_rows_flags(5), 10, r"announces 5 row\(s\) .* takes 4"),
    ],
)
def test_a_frame_whose_width_is_not_the_first_layers_is_refused_naming_both(flags: int, rows: int,
                                                                            reason: str) -> None:
    dispatch = _dispatch(MessageKind.PREFILL_EMBD, token_count=2, activation=np.zeros((rows, 4), np.float32),
                         state_changes={"flags": flags})
    with pytest.raises(InvalidMessage, match=reason) as raised:
        work_item(dispatch, 7, is_first=False, width=4, sideband_flag=WIDE)
    assert raised.value.code is ErrorCode.STATE_MISMATCH


def test_a_wide_frame_at_a_plain_stage_is_refused() -> None:
    dispatch = _dispatch(MessageKind.PREFILL_EMBD, token_count=1, activation=np.zeros((HC, 4), np.float32),
                         state_changes={"flags": WIDE})
    with pytest.raises(InvalidMessage, match=r"announces 4 row\(s\) .* takes 1"):
        work_item(dispatch, 7, is_first=False, width=4, sideband_flag=0)


def test_deepseek4_ranges_take_and_give_hc_mult_streams() -> None:
    path = ensure_model(tiny("deepseek4"))
    with Model(path, "0:1") as head, Model(path, "1:3") as middle, Model(path, "3:4") as tail:
        assert (head.input_rows, head.output_rows) == (1, HC)
        assert (middle.input_rows, middle.output_rows) == (HC, HC)
        assert (tail.input_rows, tail.output_rows) == (HC, 1)
        assert middle.reads_tokens and tail.reads_tokens  # the hash-routed layer 1 reads the token ids


def test_deepseek4_cut_points() -> None:
    """DeepSeek V4 as llama.cpp builds it reuses no layer's KV in another (create_memory wires no
    reuse; every layer has its own raw, compressed and indexer cells), so every cut between layers
    is legal: the legal ones are 1..n_layer-1, and a range past them is refused naming the model's."""
    spec = tiny("deepseek4")
    assert kv_groups("deepseek4", spec.n_layer, {}) == ()
    assert legal_cuts(spec.n_layer, ()) == [1, 2, 3]
    path = ensure_model(spec)
    with pytest.raises(LayerRangeError, match="out of bounds: .* has 4 layers"):
        Model(path, "2:5")
    with pytest.raises(LayerRangeError, match="empty or negative"):
        Model(path, "2:2")


@pytest.mark.slow
async def test_stage_processes_match_the_unsplit_model(tmp_path: Path) -> None:
    """The wire path: three stage processes (the streams cross two boundaries, f32, §12's bits)."""
    path = ensure_model(tiny("deepseek4"))
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354]
    expected = reference_greedy(path, prompt, 12, chunk_size=5)
    flags = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "4", "--threads", "1"]
    async with stage_chain(str(path), ["0:1", "1:3", "3:4"], tmp_path, flags) as chain:
        async with await StageClient.connect(chain[0].address) as client:  # type: ignore[arg-type]
            tokens = await client.generate_greedy(1, prompt, 12, chunk_size=5)
    assert tokens == expected


# --- HY V4: shared indexer layers -----------------------------------------------------------


def _shared_indexer_model() -> Path:
    """HY V4 with the shared-indexer layout: layers 1 and 3 reuse the top-k of layers 0 and 2."""
    return ensure_model(dataclasses.replace(tiny("hy_v4"), indexer_types=(1, 0, 1, 0)))


def test_hy_v4_shared_indexer_layers_stay_with_their_full_layer() -> None:
    meta = {"hy_v4.attention.indexer.top_k": 8, "hy_v4.attention.indexer.types": (1, 0, 1, 0)}
    groups = kv_groups("hy_v4", 4, meta)
    assert groups == (KvGroup(0, 2, 1, "the indexer top-k"), KvGroup(2, 4, 3, "the indexer top-k"))
    assert legal_cuts(4, groups) == [2]
    assert kv_groups("hy_v4", 4, {**meta, "hy_v4.attention.indexer.types": 1}) == ()
    assert kv_groups("hy_v4", 4, {"hy_v4.attention.indexer.top_k": 0}) == ()  # no indexer
    with pytest.raises(ValueError, match="first attention layer's indexer must be full"):
        kv_groups("hy_v4", 4, {**meta, "hy_v4.attention.indexer.types": (0, 1, 1, 1)})
    with pytest.raises(ValueError, match="first attention layer's indexer must be full"):
        kv_groups("hy_v4", 4, {"hy_v4.attention.indexer.top_k": 8})  # llama.cpp's default: shared


def test_glm5_next_shared_indexer_groups_skip_its_kda_layers() -> None:
    """GLM-5 Next's indexer lives on its attention layers only (KV heads 0: KDA); a shared one
    reuses the top-k of the last full attention layer, KDA layers between them or not."""
    meta = {"glm5-next.attention.indexer.top_k": 8, "glm5-next.attention.head_count_kv": (0, 1, 0, 1, 0, 1)}
    assert kv_groups("glm5-next", 6, meta) == ()  # llama.cpp's default: every indexer full
    groups = kv_groups("glm5-next", 6, {**meta, "glm5-next.attention.indexer.types": (1, 1, 0, 0, 1, 1)})
    assert groups == (KvGroup(1, 4, 3, "the indexer top-k"),)
    assert legal_cuts(6, groups) == [1, 4, 5]


@pytest.mark.parametrize("layers", ["0:1", "1:4", "0:3", "3:4"])
def test_hy_v4_refuses_a_cut_before_a_shared_layer_naming_the_legal_one(layers: str) -> None:
    with pytest.raises(LayerRangeError, match=r"share indexer top-k .*nearest legal cuts? (are|is) .*2"):
        Model(_shared_indexer_model(), layers)


def test_hy_v4_splits_exactly_at_its_legal_cut() -> None:
    path = _shared_indexer_model()
    with InProcessChain(path, [(0, 4)], threads=1) as whole:
        expected = greedy_run(whole, LONG_PROMPT, steps=16)
    with InProcessChain(path, [(0, 2), (2, 4)], threads=1) as split:
        got = greedy_run(split, LONG_PROMPT, steps=16)
    assert got[1] == expected[1]
    assert all(np.array_equal(a, b) for a, b in zip(got[0], expected[0], strict=True))


# --- Kimi-K3: banked layer inputs, a width that grows with the cut ---------------------------


def test_kimi_k3_boundaries_widen_with_the_cut() -> None:
    """A bank every 2 layers: a cut at 1 or 2 hands on one banked row beside the hidden state, a
    cut at 3 two, so the middle stage of [0:1)+[1:3)+[3:4) takes 2 rows per token and gives 3."""
    path = ensure_model(tiny("kimi-k3"))
    with Model(path, "0:1") as head, Model(path, "1:3") as middle, Model(path, "3:4") as tail:
        assert (head.input_rows, head.output_rows) == (1, 2)
        assert (middle.input_rows, middle.output_rows) == (2, 3)
        assert (tail.input_rows, tail.output_rows) == (3, 1)
    assert (sideband_flag("kimi-k3", 2), sideband_flag("kimi-k3", 3)) == (boundary_rows_flags(2), boundary_rows_flags(3))


@pytest.mark.slow
async def test_kimi_k3_stage_processes_match_the_unsplit_model(tmp_path: Path) -> None:
    """The wire path with boundaries of 2 and 3 rows per token (§12's k differs per hop)."""
    path = ensure_model(tiny("kimi-k3"))
    prompt = [1, 15043, 3186, 29892, 920, 526, 366, 2599, 13, 450, 4996, 17354]
    expected = reference_greedy(path, prompt, 12, chunk_size=5)
    flags = ["--batch-size", "64", "--ctx-size", "512", "--max-sessions", "4", "--threads", "1"]
    async with stage_chain(str(path), ["0:1", "1:3", "3:4"], tmp_path, flags) as chain:
        async with await StageClient.connect(chain[0].address) as client:  # type: ignore[arg-type]
            tokens = await client.generate_greedy(1, prompt, 12, chunk_size=5)
    assert tokens == expected


@pytest.mark.slow
async def test_a_prefix_cache_hit_over_widening_boundaries_equals_the_uncached_answer() -> None:
    """Kimi-K3 over three stages (tests/test_wide_boundary.py's case): a restoring stage's
    TryRestorePrefillDecode activation goes out with the boundary-rows bits of its own output width
    (2, then 3 rows per token).  (DeepSeek V4 stages run without the prefix cache:
    tests/test_prefix_cache_exact.py.)"""
    path = ensure_model(tiny("kimi-k3"))
    page = 8
    first = (1, 15043, 3186, 29892, 920, 526, 366, 2599, 3681, 338, 263, 1243, 310, 278, 7934, 29889, 450)
    generator = Generator.from_model(path, n_ctx=512, chunk_size=8, credit=2)
    generator.cache_page_size = page
    try:
        async with inprocess_chain(["0:1", "1:3", "3:4"], model=str(path), ctx_size=512, cache_page_size=page,
                                   threads=1) as servers:
            async with await StageClient.connect(servers[0].address) as client:  # type: ignore[arg-type]
                session = iter(range(1, 100))

                async def run(prompt: tuple[int, ...], cache: bool) -> tuple[list[int], int]:
                    request = GenerationRequest(prompt, 6, speculation=False, prefix_cache=cache)
                    done = await generator.generate(client, request, next(session))
                    return list(done.tokens), done.cached_tokens

                await run(first, True)
                for prompt in ((*first[:2 * page], 13, 450, 4996), first[:2 * page + 1]):
                    cached, hit = await run(prompt, True)
                    plain, _ = await run(prompt, False)
                    assert hit == 2 * page and cached == plain
            for server in servers:
                assert server.executor.cache is not None and server.executor.cache.stats.errors == 0
    finally:
        generator.close()


# --- memory at a real DeepSeek V4 shape ----------------------------------------------------------


def deepseek4_flash_shape() -> ModelSpec:
    """DeepSeek-V4-Flash's block shape (n_embd 4096, 64 query heads of 512 over one KV head, q_lora
    1024, 8 output groups of rank 1024, a 64-head indexer of 128 keeping 512, a window of 128, four
    streams, experts of width 2048 with a shared one) with 6 of its 43 layers and 8 of its 256
    experts (2 used), a 32000-token vocab: about 2.6 GB in Q8_0, 6 layers hash-routed 3 and
    compressed 0, 0, 4, 128, 4, 128."""
    return dataclasses.replace(
        tiny("deepseek4", dtype="Q8_0"), n_layer=6, n_embd=4096, n_ff=4096, n_head=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, sliding_window=128, n_expert=8, n_expert_used=2, n_ff_exp=2048, indexer_n_head=64,
        indexer_head_size=128, indexer_top_k=512, hash_layer_count=3, compress_ratios=(0, 0, 4, 128, 4, 128),
        o_group_count=8, o_lora_rank=1024, context_length=65536, name="skippy-deepseek4-flash-6l-8e-shape")


def test_deepseek4_plan_counts_compressed_caches_per_sequence_and_no_cache_slots() -> None:
    """Tiny DeepSeek V4 (ratios 4, 0, 128, 4): the compressed caches are per sequence, in the
    compressed layers only, and the stages keep no prefix-cache slots or spill tier."""
    shape = ModelShape.from_gguf(ensure_model(tiny("deepseek4")))
    assert shape.compress_ratios == (4, 0, 128, 4) and shape.head_dim > 0 and shape.indexer_head_size > 0
    one, two = (PlanSettings(ctx_size=512, max_sessions=n, batch_size=32) for n in (1, 2))
    plain = stage_memory(shape, 1, 2, one)
    assert plain.kv == stage_memory(shape, 1, 2, two).kv == 512 * shape.kv_bytes_per_cell(1, 2)
    for start, end in ((0, 1), (2, 4)):
        base = 512 * shape.kv_bytes_per_cell(start, end)
        single, double = stage_memory(shape, start, end, one), stage_memory(shape, start, end, two)
        assert double.kv - base == 2 * (single.kv - base) > 0
        assert single.spill == 0 and double.compute > single.compute > plain.compute


@pytest.mark.slow
async def test_deepseek4_stages_resident_near_the_plan(tmp_path: Path) -> None:
    """Each stage of a planned three-way split, started from the plan file, serves a request and
    is resident near the plan's figure (tests/test_plan.py's check, at DeepSeek V4's shape).

    The plan counts DeepSeek V4's compute reserve (its 64 query heads of 512, the scores over the
    compressed cells, which grow with the sequences) and compressed caches (``skippy.deploy.plan``'s
    _dsv4_memory), and no prefix-cache slots: its stages run without the cache."""
    path = ensure_model(deepseek4_flash_shape())
    shape = ModelShape.from_gguf(path)
    settings = PlanSettings(ctx_size=2048, max_sessions=2, batch_size=64, cache_spill_mib=64)
    total = stage_memory(shape, 0, shape.n_layer, settings).peak
    hosts = [HostSpec("a", total * 45 // 100), HostSpec("b", total * 45 // 100), HostSpec("c", total * 45 // 100)]
    plan = plan_chain(shape, hosts, settings)
    file = tmp_path / "plan.toml"
    file.write_text(plan.to_toml())
    processes: list[StageProcess] = []
    try:
        downstream = None
        for stage in reversed(plan.stages):
            extra = ["--config", str(file), "--plan-stage", str(stage.index), "--threads", "1"]
            if downstream is not None:
                extra += ["--downstream", str(downstream)]
            process = StageProcess(str(path), stage.layers, tmp_path / f"stage{stage.index}.log", extra=extra)
            processes.insert(0, process)
            downstream = await process.start(timeout=300)
        async with await StageClient.connect(processes[0].address) as client:  # type: ignore[arg-type]
            tokens = await client.generate_greedy(1, [(7 * i) % 1000 + 10 for i in range(120)], 8, chunk_size=64)
            assert len(tokens) == 8
        await trio.sleep(0.2)
        print(f"\ndeepseek4 (Flash shape, 6 layers, 8 experts, Q8_0): {plan.describe()}")
        rows: list[tuple[str, int, int]] = []
        for stage, process in zip(plan.stages, processes, strict=True):
            assert process.process is not None
            resident, expected = _rss(process.process.pid), stage.memory.resident
            print(f"  stage {stage.index} {stage.layers}: measured {resident / MIB:.0f} MiB, planned "
                  f"{expected / MIB:.0f} MiB ({resident / expected - 1:+.1%})")
            rows.append((stage.layers, resident, expected))
        for layers, resident, expected in rows:
            assert abs(resident - expected) <= 0.07 * expected, (layers, resident, expected)
    finally:
        for process in processes:
            process.kill()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_bits_16_to_21_without_bit_15_size_nothing_at_a_stage() -> None:
    """v11 carries unknown flag bits through (the golden frame with bit 20): without bit 15 they
    are no boundary-rows field, so a plain stage still takes the frame, and a wide one refuses it
    for the missing width, not for bit 20."""
    flags = 1 << 20
    dispatch = _dispatch(MessageKind.PREFILL_EMBD, token_count=1, activation=np.zeros((1, 4), np.float32),
                         state_changes={"flags": flags})
    item = work_item(dispatch, 7, is_first=False, width=4, sideband_flag=0)
    assert item.activations is not None and item.activations.shape == (1, 4)
    with pytest.raises(InvalidMessage, match=r"announces 1 row\(s\) .*flags 0x0\).* takes 4"):
        work_item(dispatch, 7, is_first=False, width=4, sideband_flag=WIDE)
