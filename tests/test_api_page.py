"""The page at ``GET /`` and its JSON, ``GET /chain``, in process: files, CSP, keys, CORS, figures.

The chain is a few in-process stage servers on the null runtime with their metrics endpoints on
(``tests/stage_helpers.inprocess_chain``), so identity, health and the metrics scrape are real;
the browser test against ``skippy up`` is ``tests/test_page_browser.py``.
"""

from __future__ import annotations

import re
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
import trio

from skippy.api.app import ChainService, create_app
from skippy.api.auth import PUBLIC_PATHS, ApiKeys
from skippy.api.chain_view import ChainView, History, stage_figures
from skippy.api.lanes import LanePool, StageInfo
from skippy.api.page import ASSET_PATHS, CONTENT_SECURITY_POLICY
from skippy.driver.generator import StageTiming, Timing
from skippy.driver.generator import Generator
from skippy.models.cache import ensure_model
from skippy.models.spec import demo
from skippy.net.address import Address
from skippy.stage.server import StageServer

from stage_helpers import inprocess_chain

MODEL_ID = "skippy-demo"
KEY = "sk-page-test-0123456789"
SPLITS = ["0:1", "1:3", "3:4"]


@pytest.fixture(scope="module")
def generator() -> Iterator[Generator]:
    gen = Generator.from_model(ensure_model(demo()), n_ctx=256)
    yield gen
    gen.close()


@pytest.fixture()
async def chain() -> AsyncIterator[list[StageServer]]:
    async with inprocess_chain(SPLITS, metrics_listen=Address("127.0.0.1", 0)) as servers:
        yield servers


def infos(servers: list[StageServer]) -> list[StageInfo]:
    out = []
    for index, (server, layers) in enumerate(zip(servers, SPLITS)):
        assert server.address is not None
        out.append(StageInfo(index, layers, server.address, server.metrics_address))
    return out


def client(generator: Generator, pool: LanePool, **options: Any) -> httpx.AsyncClient:
    app = create_app(ChainService(generator, pool, MODEL_ID, **options))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")


# -- the files ---------------------------------------------------------------------------------------
async def test_the_page_is_static_files_under_a_strict_policy(generator: Generator) -> None:
    async with client(generator, LanePool(Address("127.0.0.1", 9))) as http:
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        html = page.text
        for path in sorted(ASSET_PATHS):
            answer = await http.get(path)
            assert answer.status_code == 200 and answer.content, path
            assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert answer.headers["x-content-type-options"] == "nosniff"
        script = (await http.get("/static/app.js")).text
        assert (await http.get("/static/app.js")).headers["content-type"].startswith("text/javascript")
        assert (await http.get("/static/style.css")).headers["content-type"].startswith("text/css")
        assert (await http.get("/static/other.js")).status_code == 404
    # no inline script or style, nothing from another origin, every reference one of the served files
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert re.findall(r"<script[^>]*>([^<]*)</script>", html) == [""]
    assert not re.search(r"\sstyle=|\son[a-z]+=|<style", html)
    assert not re.search(r"(src|href)=\"(https?:)?//", html)
    references = set(re.findall(r"(?:src|href)=\"([^\"]+)\"", html))
    assert {"/" + reference for reference in references} <= ASSET_PATHS
    # the script writes text, never markup, and evaluates nothing
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", script)


def test_the_page_files_are_package_data() -> None:
    import importlib.resources
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["skippy"]
    static = importlib.resources.files("skippy.api") / "static"
    names = {entry.name for entry in static.iterdir()}
    assert {"index.html", "app.js", "style.css", "favicon.svg"} <= names
    for name in names:
        assert any(fnmatch(f"api/static/{name}", pattern) for pattern in patterns), name
    assert "graft skippy/api/static" in (root / "MANIFEST.in").read_text()


# -- keys and CORS -----------------------------------------------------------------------------------
async def test_with_a_key_the_page_is_served_but_nothing_of_the_chain(generator: Generator,
                                                                      chain: list[StageServer]) -> None:
    stages = infos(chain)
    pool = LanePool(stages[0].address, stages=stages)
    async with client(generator, pool, keys=ApiKeys([KEY])) as http:
        for path in sorted(ASSET_PATHS):  # the files hold nothing of the chain
            answer = await http.get(path)
            assert answer.status_code == 200
            for stage in stages:
                assert not re.search(rf"\b{stage.address.port}\b", answer.text)
            assert MODEL_ID not in answer.text
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"}):
            refused = await http.get("/chain", headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert set(refused.json()) == {"error"}
            assert MODEL_ID not in refused.text and not re.search(rf"\b{stages[0].address.port}\b", refused.text)
        opened = await http.get("/chain", headers={"Authorization": f"Bearer {KEY}"})
        assert opened.status_code == 200 and opened.json()["model"] == MODEL_ID
        assert opened.headers["cache-control"] == "no-store"
    assert PUBLIC_PATHS == {"/health"}  # the page's files are public through the app, not globally


async def test_chain_follows_the_cors_setting(generator: Generator) -> None:
    origin = {"Origin": "https://dashboard.example"}
    for origins, allowed in (((), False), (("https://dashboard.example",), True)):
        async with client(generator, LanePool(Address("127.0.0.1", 9), connect_timeout=0.5),
                          cors_origins=origins) as http:
            answer = await http.get("/chain", headers=origin)
            preflight = await http.options("/chain", headers={**origin, "Access-Control-Request-Method": "GET",
                                                              "Access-Control-Request-Headers": "authorization"})
        assert answer.status_code == 200
        assert (answer.headers.get("access-control-allow-origin") == "https://dashboard.example") is allowed
        assert (preflight.status_code == 200) is allowed


# -- the snapshot ------------------------------------------------------------------------------------
async def test_the_snapshot_shows_each_stage_then_the_one_that_went_down(generator: Generator,
                                                                         chain: list[StageServer]) -> None:
    stages = infos(chain)
    pool = LanePool(stages[0].address, stages=stages)
    async with client(generator, pool) as http:
        snapshot = (await http.get("/chain")).json()
    assert snapshot["status"] == "ok" and snapshot["error"] is None and snapshot["stages_known"]
    assert snapshot["one_model"] is True and snapshot["model"] == MODEL_ID
    assert [stage["layers"] for stage in snapshot["stages"]] == SPLITS
    for stage, info in zip(snapshot["stages"], stages):
        assert stage["status"] == "up" and stage["address"] == str(info.address)
        identity = stage["identity"]
        assert identity["model"].startswith("null:") and identity["layers"] == info.layers
        assert identity["layer_count"] == 4 and len(identity["digest"]) == 64
        metrics = stage["metrics"]
        assert metrics["kv_cells_capacity"] > 0 and metrics["sessions_in_use"] == 0
        assert metrics["resident_bytes"] > 1 << 20  # this process's: the stages run in it
        assert stage["time_per_token"] is None  # nothing generated yet
    assert snapshot["history"]["requests"] == 0 and len(snapshot["history"]["throughput"]) == 60

    view = ChainView(pool, refresh_s=0.0)
    chain[1].shutdown()
    with trio.fail_after(10):
        while True:
            snapshot = await view.snapshot()
            if snapshot["stages"][1]["status"] == "down":
                break
            await trio.sleep(0.05)
    assert [stage["status"] for stage in snapshot["stages"]] == ["up", "down", "up"]
    assert str(stages[1].address) in snapshot["stages"][1]["error"]
    assert snapshot["stages"][1]["identity"] is None and snapshot["stages"][1]["metrics"] is None
    assert snapshot["status"] == "unavailable" and "stage 1 (layers 1:3)" in snapshot["error"]


async def test_the_snapshot_is_shared_for_refresh_s(chain: list[StageServer]) -> None:
    stages = infos(chain)
    view = ChainView(LanePool(stages[0].address, stages=stages), refresh_s=60.0)
    first = await view.snapshot()
    chain[2].shutdown()
    await trio.sleep(0.2)
    assert await view.snapshot() is first  # still the round of a moment ago


async def test_without_the_stage_list_the_first_stage_is_shown_alone(chain: list[StageServer]) -> None:
    first = chain[0].address
    assert first is not None
    snapshot = await ChainView(LanePool(first)).snapshot()
    assert snapshot["stages_known"] is False and snapshot["status"] == "ok"
    (stage,) = snapshot["stages"]
    assert stage["status"] == "up" and stage["layers"] == "0:1" and stage["metrics"] is None


def test_stage_figures_read_the_metrics_text() -> None:
    text = ("# TYPE skippy_stage_kv_cells_used gauge\nskippy_stage_kv_cells_used{layers=\"0:2\"} 17\n"
            "# TYPE skippy_stage_prefix_cache_hits counter\n"
            "skippy_stage_prefix_cache_hits_total{layers=\"0:2\"} 3\n"
            "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 1.5e+08\n"
            "# TYPE other gauge\nother 1\n")
    assert stage_figures(text) == {"kv_cells_used": 17.0, "prefix_cache_hits": 3.0, "resident_bytes": 1.5e8}
    with pytest.raises(ValueError):
        stage_figures("not {prometheus text")


# -- the history -------------------------------------------------------------------------------------
def timing(ttft: float, decode: float, stages: dict[int, tuple[int, int, int, int, int]]) -> Timing:
    out = Timing(prompt_tokens=4, time_to_first_token=ttft, decode_seconds=decode)
    for index, (replies, compute, write, wait, queue) in stages.items():
        out.stages[index] = StageTiming(index, index, index + 1, replies, compute, write, wait, queue)
    return out


def test_history_spreads_tokens_over_decode_time_and_forgets_old_ones() -> None:
    now = [1000.0]
    history = History(window_s=60.0, bucket_s=10.0, clock=lambda: now[0])
    history.generation_done(timing(0.05, 20.0, {}), 41)  # 41 tokens over [980, 1000]: ~2 per second
    points = history.throughput(now[0])
    assert [point[0] for point in points] == [50.0, 40.0, 30.0, 20.0, 10.0, 0.0]
    assert [point[1] for point in points] == [0.0, 0.0, 0.0, 0.0, 2.05, 2.05]
    history.generation_done(timing(0.2, 0.0, {}), 1)  # one token: counted where it ended
    assert history.throughput(now[0])[-1][1] == pytest.approx(2.15)
    snapshot = history.as_dict()
    assert snapshot["ttft_ms"] == [[0.0, 50.0], [0.0, 200.0]]
    assert snapshot["requests"] == 2 and snapshot["completion_tokens"] == 42
    now[0] += 61.0
    snapshot = history.as_dict()
    assert snapshot["ttft_ms"] == [] and all(point[1] == 0 for point in snapshot["throughput"])
    assert snapshot["requests"] == 2  # totals stay
    assert history.stage_shares() == {}


def test_stage_shares_split_a_token_into_compute_wire_and_queue() -> None:
    history = History()
    # per reply (us): stage 0 computes 1000, writes 100 and waits 5000 for stage 1, which queues 200,
    # computes 3000, writes 300 and waits 0 (final); so 5000 - 3500 = 1500 of stage 0's wait is wire.
    history.generation_done(timing(0.1, 1.0, {0: (2, 2000, 200, 10000, 0), 1: (2, 6000, 600, 0, 400)}), 3)
    assert history.stage_shares() == {0: {"compute_ms": 1.0, "wire_ms": 1.6, "queue_ms": 0.0},
                                      1: {"compute_ms": 3.0, "wire_ms": 0.3, "queue_ms": 0.2}}


def test_history_refuses_a_bad_window() -> None:
    with pytest.raises(ValueError):
        History(window_s=10.0, bucket_s=20.0)
