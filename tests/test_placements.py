"""A shortcut is a placement: every placement of every step gives the same bytes on every boundary.

``tests/test_stage_lanes.py::test_shortcuts_change_no_byte`` runs every served kind through null
stages under each combination of the lane's switches.  This module does the same on the real
runtime (the tiny generated llama, f32 wire, one thread: bitwise logits) and through the driver,
for each way a request travels: hop by hop one DecodeEmbd per token, a decode run (§11), direct
return (§8, where the data plane carries the steady decodes), speculation (verify windows) and a
grammar (the sampling extension, §10).  Each (switches, path) run records the bytes crossing
every boundary (driver → stage 0 → stage 1 → stage 2, and the return lane) with a tap; messages
must match byte for byte, replies after zeroing the measured durations (stats and Timings
records).  The tokens must equal the one-stage chain's.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import asynccontextmanager
import itertools
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest
import trio

from skippy.codec.protocol import END_OF_STREAM, NEED_DATA, StageReply
from skippy.codec.protocol_ext import TimingsFrame
from skippy.driver import StageClient
from skippy.driver.generator import GenerationRequest, Generator
from skippy.driver.speculation.controller import CostModel
from skippy.net.address import Address
from skippy.runtime.sampling import SamplingParams
from skippy.stage.config import config_from_mapping
from skippy.stage.server import StageServer, close_runtime, load_runtime
from skippy.stage.transport import codec

SPLITS = ["0:1", "1:3", "3:4"]
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=1234)
#: path -> (request fields, generator settings).
PATHS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "hop": ({"sampling": SEEDED, "speculation": False}, {"direct": False, "decode_runs": False}),
    "run": ({"sampling": SEEDED, "speculation": False}, {"direct": False, "decode_runs": True}),
    "direct": ({"sampling": SEEDED, "speculation": False}, {"direct": True, "decode_runs": True}),
    # (a looping prompt: the n-gram proposer drafts from the repeats)
    "speculation": ({"speculation": True, "prompt": " ".join([PROMPT] * 4), "max_tokens": 16},
                    {"direct": False, "decode_runs": False}),
    # (longer: windows of several sizes, plain decodes between them, rejected drafts)
    "speculation-long": ({"speculation": True, "prompt": " ".join([PROMPT] * 4), "max_tokens": 48},
                         {"direct": False, "decode_runs": False}),
    "grammar": ({"sampling": SEEDED, "speculation": False, "grammar": 'root ::= [a-z ]+ "."'},
                {"direct": True, "decode_runs": True}),
    # (hop by hop, every reply with its Logprobs frame)
    "logprobs": ({"sampling": SEEDED, "speculation": False, "logprobs": 2}, {"direct": False, "decode_runs": False}),
}
#: The stages whose data plane carries a path's steady decodes or verify windows (the final stage
#: samples a grammar or logprobs session in Python; a decode run's first stage drives it in Python).
RELAYED_STAGES = {"hop": 3, "direct": 3, "grammar": 2, "logprobs": 2, "run": 2, "speculation": 3,
                  "speculation-long": 3}
SWITCHES = ("write_through", "inline_hand_offs", "decode_relay")
#: Reply-stats fields that hold measured durations (or depend on which one was largest).
_MEASURED = ("verify_window_compute_us", "verify_window_forward_write_us", "verify_window_downstream_wait_us",
             "verify_window_total_us", "prefill_edge_write_us_max", "prefill_edge_wait_us_max",
             "prefill_edge_total_us_max", "prefill_edge_stage_index", "prefill_edge_activation_bytes_max")


class Tap:
    """A TCP relay in front of a stage that records the bytes of each connection, both ways."""

    def __init__(self, target: Address) -> None:
        self.target = target
        #: Per connection, in accept order: (bytes sent to the stage, bytes it answered).
        self.connections: list[tuple[bytearray, bytearray]] = []

    async def serve(self, stream: trio.SocketStream) -> None:
        down, up = bytearray(), bytearray()
        self.connections.append((down, up))
        downstream = await trio.open_tcp_stream(self.target.host, self.target.port)

        async def pump(source: trio.SocketStream, sink: trio.SocketStream, record: bytearray) -> None:
            while data := await source.receive_some(1 << 16):
                record += data
                await sink.send_all(data)
            await sink.send_eof()

        async with downstream, trio.open_nursery() as nursery:
            nursery.start_soon(pump, stream, downstream, down)
            nursery.start_soon(pump, downstream, stream, up)

    def record(self) -> list[tuple[bytes, list[object]]]:
        """Each connection's message bytes and its answers, measured durations zeroed."""
        return [(bytes(down), _replies(bytes(up[4:]))) for down, up in self.connections]  # (after READY)


def _replies(data: bytes) -> list[object]:
    decoder = codec.ReplyDecoder(extensions=True)
    decoder.receive_data(data)
    frames: list[object] = []
    while (frame := decoder.next_reply()) is not NEED_DATA and frame is not END_OF_STREAM:
        if isinstance(frame, StageReply):
            frame = dataclasses.replace(frame, stats=dataclasses.replace(frame.stats, **dict.fromkeys(_MEASURED, 0)))
        elif isinstance(frame, TimingsFrame):
            frame = TimingsFrame(tuple(dataclasses.replace(record, compute_us=0, forward_write_us=0,
                                                           downstream_wait_us=0, queue_wait_us=0)
                                       for record in frame.records))
        frames.append(frame)
    return frames


@dataclasses.dataclass
class Chain:
    servers: list[StageServer]
    #: taps[i]: stage i's upstream boundary (taps[0]: the driver's lane to stage 0).
    taps: list[Tap]
    #: The tap in front of the final stage that return lanes go through, and the addresses to dial.
    returns: Tap
    entry: Address
    return_address: Address


@asynccontextmanager
async def tapped_chain(model: Path, splits: list[str] = SPLITS, **switches: bool) -> AsyncIterator[Chain]:
    """Stages ``splits`` of ``model``, each behind a tap, and a tap for return lanes."""
    servers: list[StageServer] = []
    try:
        async with _tapped_chain(model, splits, servers, **switches) as chain:
            yield chain
    finally:  # the servers have returned (cancelled): their weights and KV go now
        for server in servers:
            close_runtime(server.executor)


@asynccontextmanager
async def _tapped_chain(model: Path, splits: list[str], servers: list[StageServer], **switches: bool
                        ) -> AsyncIterator[Chain]:
    async with trio.open_nursery() as nursery:

        async def tap_in_front(address: Address) -> tuple[Tap, Address]:
            tap = Tap(address)
            listeners = await nursery.start(functools.partial(trio.serve_tcp, tap.serve, 0, host="127.0.0.1"))
            return tap, Address("127.0.0.1", listeners[0].socket.getsockname()[1])

        taps: list[Tap] = []
        downstream: Address | None = None
        for layers in reversed(splits):
            config = config_from_mapping({"model": str(model), "layers": layers, "downstream": downstream,
                                          "ctx_size": 512, "batch_size": 64, "connect_timeout": 2, "threads": 1,
                                          **switches})
            server = StageServer(config, load_runtime(config))
            servers.insert(0, server)
            address = await nursery.start(server.serve)
            tap, downstream = await tap_in_front(address)
            taps.insert(0, tap)
        returns, return_address = await tap_in_front(servers[-1].address)  # type: ignore[arg-type]
        assert downstream is not None
        try:
            yield Chain(servers, taps, returns, downstream, return_address)
        finally:
            for server in servers:
                server.shutdown()
            nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def generator(tiny_llama: Path) -> Iterator[Generator]:
    gen = Generator.from_model(tiny_llama, n_ctx=512, chunk_size=5)  # a fixed chunking: bitwise comparable
    gen.prefix_cache = False
    yield gen
    gen.close()


async def run_path(generator: Generator, model: Path, path: str, splits: list[str] = SPLITS, **switches: bool
                   ) -> tuple[list[int], list[list[tuple[bytes, list[object]]]], dict[str, Any]]:
    """One request on ``path`` through the tapped chain of ``splits``: its tokens, each boundary's
    (message bytes, normalized replies), and the chain's shortcut counters."""
    fields, settings = PATHS[path]
    request = _request(generator, fields)
    async with tapped_chain(model, splits, **switches) as chain:
        generator.direct_return = (lambda: chain.return_address) if settings["direct"] else None
        generator.decode_runs = settings["decode_runs"]
        try:
            async with await StageClient.connect(chain.entry) as client:
                completion = await generator.generate(client, request, 1)
        finally:
            generator.direct_return, generator.decode_runs = None, True
        await trio.sleep(0.05)  # the taps pass on the last bytes
        stats = [server.stats for server in chain.servers]
        counters = {"write_throughs": sum(s.write_throughs for s in stats),
                    "relay_steps": sum(s.decode_relay_steps + s.decode_relay_windows for s in stats),
                    "relay_stages": sum(s.decode_relay_steps + s.decode_relay_windows > 0 for s in stats),
                    "direct_replies": stats[-1].direct_replies, "decode_runs": stats[0].decode_runs,
                    "verify_windows": stats[-1].verify_windows,
                    # per stage: the windows computed, those the data plane carried, the rollbacks trimmed
                    "windows": [s.verify_windows for s in stats],
                    "relay_windows": [s.decode_relay_windows for s in stats],
                    "trims": [s.trimmed_tokens for s in stats],
                    # per stage: the decodes and windows computed, those the data plane carried
                    "messages": [s.decode_items + s.verify_windows for s in stats],
                    "carried": [s.decode_relay_steps + s.decode_relay_windows for s in stats],
                    # per stage: the KV cells its sessions hold (the finished request's: nothing)
                    "cells": [server.scheduler.executor.context.kv_cells_used() for server in chain.servers]}
        boundaries = [tap.record() for tap in (*chain.taps, chain.returns)]
    return completion.tokens, boundaries, counters


def _request(generator: Generator, fields: dict[str, Any]) -> GenerationRequest:
    fields = dict(fields)
    prompt = tuple(generator.encode(fields.pop("prompt", PROMPT)))
    return GenerationRequest(prompt, fields.pop("max_tokens", 10), **fields)


_UNSPLIT: dict[str, list[int]] = {}


async def unsplit(generator: Generator, model: Path, path: str) -> list[int]:
    """The one-stage chain's tokens for ``path``'s request."""
    if path not in _UNSPLIT:
        from stage_helpers import inprocess_chain

        fields, _ = PATHS[path]
        request = _request(generator, fields)
        async with inprocess_chain(["0:4"], model=str(model), ctx_size=512) as servers:
            async with await StageClient.connect(servers[0].address) as client:
                _UNSPLIT[path] = (await generator.generate(client, request, 1)).tokens
    return _UNSPLIT[path]


def settings_direct(path: str) -> bool:
    return bool(PATHS[path][1]["direct"])


_COMBINATIONS = [dict(zip(SWITCHES, values)) for values in itertools.product((True, False), repeat=len(SWITCHES))]


#: The default path (direct return, where the data plane carries the steady decodes) in the fast suite;
#: the rest in the full one.  Hop by hop stays covered there by
#: test_decode_relay.py::test_hop_by_hop_the_relay_sends_the_lanes_bytes_while_other_lanes_interrupt_it
#: (the relay on and off: the same frames on every boundary, the unsplit tokens) and by
#: test_stage_lanes.py::test_shortcuts_change_no_byte (every switch combination on null stages).
@pytest.mark.parametrize("path", [pytest.param(path, marks=() if path == "direct" else pytest.mark.slow)
                                  for path in sorted(PATHS)])
async def test_shortcuts_change_no_byte_on_any_path(generator: Generator, tiny_llama: Path,
                                                                      path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The speculation controller sizes its windows from measured times: give it fixed ones, so
    # the driver sends the same windows whatever the placements (it measures them, not us).
    observe = CostModel.observe

    def steady(self: CostModel, rows: int, wall_seconds: float, compute_seconds: float, *, alone: bool = True,
               shared: bool = False) -> None:
        observe(self, rows, 0.002 + 0.0002 * rows, 0.001 + 0.0002 * rows, alone=alone, shared=shared)

    monkeypatch.setattr(CostModel, "observe", steady)
    _no_wall_clock_decisions(monkeypatch)
    reference = await unsplit(generator, tiny_llama, path)
    tokens, boundaries, counters = await run_path(generator, tiny_llama, path, **_COMBINATIONS[0])
    assert tokens == reference
    assert all(any(down for down, _ in boundary) for boundary in boundaries[:-1])  # every boundary carried messages
    assert bool(boundaries[-1]) == settings_direct(path)
    settings = PATHS[path][1]
    assert (counters["direct_replies"] > 0) == settings["direct"]
    assert (counters["decode_runs"] > 0) == (settings["decode_runs"] and not settings["direct"])
    assert (counters["verify_windows"] > 0) == path.startswith("speculation")
    assert counters["relay_stages"] == RELAYED_STAGES[path], counters  # the data plane carried the steady decodes
    for switches in _COMBINATIONS[1:]:
        other_tokens, other_boundaries, other_counters = await run_path(generator, tiny_llama, path, **switches)
        assert other_tokens == reference, switches
        assert len(other_boundaries) == len(boundaries)
        for index, (mine, theirs) in enumerate(zip(boundaries, other_boundaries)):
            assert len(theirs) == len(mine), (switches, f"connections across boundary {index}")
            for (down, up), (other_down, other_up) in zip(mine, theirs):
                assert other_down == down, (switches, f"messages across boundary {index}")
                assert other_up == up, (switches, f"replies across boundary {index}")
        assert (other_counters["write_throughs"] > 0) == switches["write_through"], switches
        if not switches["decode_relay"]:
            assert other_counters["relay_steps"] == 0


def _no_wall_clock_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nor may the realized speedups (wall-clock waits) or a cost model adopted from the previous
    request change the windows from one run to the next."""
    monkeypatch.setattr(CostModel, "observe_wait", lambda *args, **kwargs: None)
    monkeypatch.setattr(CostModel, "adopt", lambda self, other: None)


#: Speculation at 1 (one stage, first and final), 2, 3 and 4 stages (the tiny llama's 4 layers).
SPECULATION_SPLITS = {1: ["0:4"], 2: ["0:2", "2:4"], 3: SPLITS, 4: ["0:1", "1:2", "2:3", "3:4"]}
#: How the driver speculates: one window at a time (max depth 1), its default (pipelined once its
#: estimates say so), or pipelined from its first window (a high prior acceptance: the first
#: epoch's windows are all in flight before the first reply, and the lane never goes quiet).
DRIVERS = {"serial": {"max_depth": 1}, "pipelined": {}, "eager": {"prior_acceptance": 0.9, "prior_weight": 50.0}}


@pytest.mark.parametrize("implementation", ["cython", "python"])
@pytest.mark.parametrize("driver", list(DRIVERS))
@pytest.mark.parametrize("stages", [2, 3, 4])
async def test_the_drivers_speculation_gives_the_lanes_bytes_with_the_data_plane_on(
        generator: Generator, tiny_llama: Path, stages: int, driver: str, implementation: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's speculation (hop by hop: it never asks for direct return when it speculates)
    with the data plane on (``--decode-relay on``, either implementation) and off: the same bytes
    on every boundary and the unsplit tokens, at 2, 3 and 4 stages, with drafts rejected on the
    way (rollbacks trimmed).  A run carries windows of every size and decodes interleaved, and
    pipelines hop by hop: after the first message of each kind (the lane's, which leaves the
    templates), at least 80% of the messages on every stage, whether the driver sends one window
    at a time, keeps several in flight once it pays, or from its first window on (``eager``: no
    stage is ever quiet then, the first least of all; a run starts with the lane's messages in
    flight and answers them first).  Every stage ends with the KV cells of the relay-off run."""
    from skippy.stage import _relay_py, decode_relay

    if implementation == "python":
        monkeypatch.setattr(decode_relay, "_implementation", _relay_py)
    elif decode_relay.IMPLEMENTATION != "cython":
        pytest.skip("skippy.stage._relay not built")
    monkeypatch.setattr(generator, "controller", dataclasses.replace(generator.controller, **DRIVERS[driver]))
    observe = CostModel.observe

    def steady(self: CostModel, rows: int, wall_seconds: float, compute_seconds: float, *, alone: bool = True,
               shared: bool = False) -> None:
        observe(self, rows, 0.002 + 0.0002 * rows, 0.001 + 0.0002 * rows, alone=alone, shared=shared)

    monkeypatch.setattr(CostModel, "observe", steady)
    _no_wall_clock_decisions(monkeypatch)
    reference = await unsplit(generator, tiny_llama, "speculation-long")
    runs = {relay: await run_path(generator, tiny_llama, "speculation-long", SPECULATION_SPLITS[stages],
                                  write_through=True, inline_hand_offs=True, decode_relay=relay)
            for relay in (True, False)}
    (tokens, boundaries, on), (other_tokens, other_boundaries, off) = runs[True], runs[False]
    assert tokens == other_tokens == reference
    _same_boundaries(boundaries, other_boundaries, stages)
    assert on["windows"] == off["windows"] and min(on["windows"]) > 0
    assert on["trims"] == off["trims"] and min(on["trims"]) > 0  # drafts were rejected: rollbacks trimmed
    assert off["relay_steps"] == 0 and on["relay_stages"] == stages, on  # the data plane ran on every stage
    assert on["messages"] == off["messages"] and on["cells"] == off["cells"]  # (no KV cell leaked)
    shares = [carried / (messages - 2) for carried, messages in zip(on["carried"], on["messages"])]
    assert min(shares) >= 0.8, (shares, on)


def _same_boundaries(mine: list[list[tuple[bytes, list[object]]]], theirs: list[list[tuple[bytes, list[object]]]],
                     stages: int) -> None:
    assert len(mine) == len(theirs) == stages + 1
    for index, (ours, others) in enumerate(zip(mine, theirs)):
        assert len(ours) == len(others), f"connections across boundary {index}"
        for (down, up), (other_down, other_up) in zip(ours, others):
            assert down == other_down, f"messages across boundary {index}"
            assert up == other_up, f"replies across boundary {index}"


#: A one-stage chain (its stage first and final): the paths whose steady decodes or windows its
#: data plane carries (1: a decode run's steps too, each made from the last one's pick), and those
#: its lane keeps (0: a grammar or logprobs session samples in Python).
ONE_STAGE_RELAYED = {"hop": 1, "direct": 1, "grammar": 0, "logprobs": 0, "run": 1, "speculation": 1,
                     "speculation-long": 1}


@pytest.mark.parametrize("implementation", ["cython", "python"])
@pytest.mark.parametrize("path", sorted(ONE_STAGE_RELAYED))
async def test_a_one_stage_chain_relays_its_steady_decodes_with_the_lanes_bytes(
        generator: Generator, tiny_llama: Path, path: str, implementation: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-stage chain (token ids in, the stage's own sampling and reply out) with the data plane
    on (either implementation) and off: the same bytes both ways on its boundary and its return
    lane, the unsplit tokens, the same KV cells; hop by hop, with direct return and speculating,
    the data plane carries every decode or window after the first of each kind, and a decode
    run's steps after its first one or two; a grammar or logprobs
    session stays on the lane's path."""
    from skippy.stage import _relay_py, decode_relay

    if implementation == "python":
        monkeypatch.setattr(decode_relay, "_implementation", _relay_py)
    elif decode_relay.IMPLEMENTATION != "cython":
        pytest.skip("skippy.stage._relay not built")
    observe = CostModel.observe

    def steady(self: CostModel, rows: int, wall_seconds: float, compute_seconds: float, *, alone: bool = True,
               shared: bool = False) -> None:
        observe(self, rows, 0.002 + 0.0002 * rows, 0.001 + 0.0002 * rows, alone=alone, shared=shared)

    monkeypatch.setattr(CostModel, "observe", steady)
    _no_wall_clock_decisions(monkeypatch)
    reference = await unsplit(generator, tiny_llama, path)
    runs = {relay: await run_path(generator, tiny_llama, path, ["0:4"], write_through=True, inline_hand_offs=True,
                                  decode_relay=relay) for relay in (True, False)}
    (tokens, boundaries, on), (other_tokens, other_boundaries, off) = runs[True], runs[False]
    assert tokens == other_tokens == reference
    _same_boundaries(boundaries, other_boundaries, 1)
    assert bool(boundaries[-1]) == settings_direct(path)
    assert off["relay_steps"] == 0 and on["relay_stages"] == ONE_STAGE_RELAYED[path], on
    assert on["messages"] == off["messages"] and on["cells"] == off["cells"] and on["trims"] == off["trims"]
    if ONE_STAGE_RELAYED[path]:  # all but the first of each kind (a decode's, a window's)
        assert on["carried"][0] >= on["messages"][0] - 2 > 0, on


#: The prompt of the client-driven windows (token ids of the tiny llama's vocabulary).
WINDOW_PROMPT = [1, 15043, 3186, 29892, 920, 526, 366, 2599]


async def _speculate(client: StageClient, reference: list[int], return_address: Address | None,
                     windows: int) -> tuple[list[int], int]:
    """A greedy speculating session driven window by window, as the driver's runner does: 3
    drafts per window, taken from ``reference`` (the unsplit greedy tokens) but every other
    window with its second draft wrong (rejected: the next window's position trims every stage
    back); returns the committed tokens and the drafts rejected."""
    session = 1
    await client.configure(session, prompt_token_count=len(WINDOW_PROMPT))
    if return_address is not None:
        assert await client.open_direct_return(return_address, session)
    committed = [(await client.prefill(session, WINDOW_PROMPT, chunk_size=5)).token]
    position, rejected = len(WINDOW_PROMPT), 0
    for index in range(windows):
        done = len(committed)
        drafts = list(reference[done:done + 3])
        if index % 2:
            drafts[1] += 1  # a wrong draft
        reply = await client.verify(session, [committed[-1], *drafts], position, window_id=index + 1)
        predicted = list(reply.predicted_tokens)
        accepted = 0
        while accepted < len(drafts) and predicted[accepted] == drafts[accepted]:
            accepted += 1
        committed += drafts[:accepted] + [predicted[accepted]]
        rejected += len(drafts) - accepted
        position += accepted + 1
    await client.trim(session, position)
    await client.stop(session)
    return committed, rejected


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("direct", [False, True], ids=["hop", "direct"])
async def test_client_driven_windows_ride_the_data_plane_hop_by_hop_and_with_direct_return(
        tiny_llama: Path, stages: int, direct: bool) -> None:
    """Verify windows sent one at a time by a client (as a serial speculating driver sends them),
    hop by hop and with direct return (the final stage answers into the return lane): relay on and
    off give the same bytes on every boundary (the return lane's too), the committed tokens are the
    unsplit greedy tokens (drafts rejected on the way), and the data plane carried windows on
    every stage (``tests/test_decode_relay.py`` counts the KV cells a rejection leaves)."""
    from stage_helpers import reference_greedy

    reference = reference_greedy(tiny_llama, WINDOW_PROMPT, 40, chunk_size=5)
    runs = {}
    for relay in (True, False):
        async with tapped_chain(tiny_llama, SPECULATION_SPLITS[stages], write_through=True, inline_hand_offs=True,
                                decode_relay=relay) as chain:
            async with await StageClient.connect(chain.entry) as client:
                committed, rejected = await _speculate(client, reference, chain.return_address if direct else None, 8)
            await trio.sleep(0.05)  # the taps pass on the last bytes
            stats = [server.stats for server in chain.servers]
            runs[relay] = (committed, rejected, [tap.record() for tap in (*chain.taps, chain.returns)],
                           [s.decode_relay_windows for s in stats], [s.verify_windows for s in stats])
    committed, rejected, boundaries, relayed, windows = runs[True]
    assert committed == reference[:len(committed)] and rejected > 0
    assert runs[False][0] == committed and runs[False][4] == windows == [8] * stages
    assert bool(boundaries[-1]) == direct  # the return lane carried the predictions
    _same_boundaries(boundaries[:-1], runs[False][2][:-1], stages - 1)
    assert boundaries[-1] == runs[False][2][-1]
    assert runs[False][3] == [0] * stages and min(relayed) > 0, relayed  # the data plane carried windows
