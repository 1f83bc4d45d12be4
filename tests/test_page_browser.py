"""The page at ``/`` in a real browser: headless Chromium (Debian's) against a 3-stage ``skippy up``.

The page shows the three stages with their ranges; a question typed in its chat box streams an
answer equal to the API's; a killed stage is marked down within 2 s (``--keep-serving`` keeps the
API up without it); with ``--api-key`` nothing of the chain is on the page until the key is
entered.  The browser reaches 127.0.0.1 only, the page loads nothing from another origin and the
console stays free of errors (a CSP violation would be one).  Screenshots go to the test's tmp
dir.  Skipped only when Chromium or ChromeDriver is not installed (``make test`` installs them
where it can: ``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from api_helpers import UpProcess
from webdriver import Browser, browser_paths

pytestmark = pytest.mark.slow

PATHS = browser_paths()
if PATHS is None:
    pytest.skip("needs Chromium and ChromeDriver (Debian: apt-get install chromium chromium-driver; make test "
                "installs them when it runs as root)", allow_module_level=True)

LAYERS = ["0:1", "1:3", "3:4"]
KEY = "sk-browser-test-0123456789"
QUESTION = "What is a layer range?"


@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[Browser]:
    assert PATHS is not None
    session = Browser(*PATHS, tmp_path / "profile", tmp_path / "chromedriver.log")
    try:
        yield session
    finally:
        session.close()


def start_up(tiny_llama: Path, tmp_path: Path, *extra: str) -> UpProcess:
    process = UpProcess(["up", "--model", str(tiny_llama), "--layers", ",".join(LAYERS), "--port", "0",
                         "--ctx-size", "256", "--threads", "1", "--keep-serving", "--restarts", "0", "--log-dir", str(tmp_path / "logs"),
                         *extra], tmp_path)
    return process.start()


def stage_states(browser: Browser) -> list[dict[str, Any]]:
    return list(browser.script(
        "return [...document.querySelectorAll('#stages .stage')].map((card) => ({index: card.dataset.index, "
        "status: card.dataset.status, range: card.querySelector('.range').textContent, "
        "text: card.textContent}))"))


def assert_clean(browser: Browser, url: str) -> None:
    """No console errors (CSP violations included) and nothing loaded from another origin."""
    errors = [entry for entry in browser.console() if entry.get("level") == "SEVERE"]
    assert errors == [], errors
    resources = browser.script("return performance.getEntriesByType('resource').map((entry) => entry.name)")
    assert resources and all(name.startswith(url + "/") for name in resources), resources


def test_the_page_draws_the_chain_chats_and_marks_a_killed_stage_down(tiny_llama: Path, tmp_path: Path,
                                                                     browser: Browser) -> None:
    up = start_up(tiny_llama, tmp_path)
    try:
        assert f"page {up.url}/" in up.stdout()
        browser.get(up.url + "/")
        browser.wait(lambda: [s["status"] for s in stage_states(browser)] == ["up"] * 3, 60, "three stages up")
        stages = stage_states(browser)
        assert [stage["range"] for stage in stages] == LAYERS
        assert [stage["index"] for stage in stages] == ["0", "1", "2"]
        assert all("KV cells" in stage["text"] and "MiB" in stage["text"] for stage in stages)
        assert browser.script("return document.getElementById('chain-status').dataset.status") == "ok"
        browser.screenshot(tmp_path / "1-chain.png")

        browser.type("#max-tokens", "12")
        browser.type("#temperature", "0")
        browser.type("#chat-input", QUESTION)
        browser.click("#chat-send")
        seen_streaming = browser.wait(lambda: browser.script(
            "const box = document.querySelector('.message.assistant'); return box && box.dataset.state"), 30,
            "the answer to start")
        state = browser.wait(lambda: browser.script(
            "const box = document.querySelector('.message.assistant'); "
            "return box.dataset.state !== 'streaming' && box.dataset.state"), 60, "the answer to finish")
        assert seen_streaming in ("streaming", "done") and state == "done"
        shown = browser.script("return document.querySelector('.message.assistant .text').textContent")
        usage = browser.script("return document.querySelector('.message.assistant .usage').textContent")
        model = httpx.get(up.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(up.url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert shown == reply.json()["choices"][0]["message"]["content"] and shown
        assert "12 tokens" in usage and "tok/s" in usage and "TTFT" in usage and "cached" in usage
        assert "speculation" in usage and "compute ms" in usage  # per-stage times of this answer
        browser.wait(lambda: browser.script(
            "return document.querySelectorAll('#plot-throughput polyline').length === 1 && "
            "document.querySelectorAll('#plot-ttft circle').length >= 1 && "
            "document.querySelectorAll('#stages .share').length === 3"), 10, "the plots and shares to fill")
        browser.screenshot(tmp_path / "2-answer.png")
        assert_clean(browser, up.url)

        os.kill(up.stage_pids[1], signal.SIGKILL)
        killed = time.monotonic()
        browser.wait(lambda: any(s["status"] == "down" for s in stage_states(browser)), 2.0,
                     "the killed stage to be marked down", interval=0.02)
        took = time.monotonic() - killed
        assert [s["status"] for s in stage_states(browser)] == ["up", "down", "up"], took
        browser.screenshot(tmp_path / "3-stage-down.png")
        assert browser.script("return document.getElementById('chain-status').dataset.status") == "unavailable"
        lost = httpx.post(up.url + "/v1/chat/completions", timeout=60, json={  # --keep-serving: the API answers
            "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2})
        assert lost.status_code == 503 and "stage 1 (layers 1:3)" in lost.json()["error"]["message"]
    finally:
        up.stop()
    assert up.process is not None and up.process.returncode == 1  # a stage had exited
    assert "error: stage 1 (layers 1:3) exited with status -9" in up.stderr()


def test_with_a_key_nothing_of_the_chain_shows_until_it_is_entered(tiny_llama: Path, tmp_path: Path,
                                                                   browser: Browser) -> None:
    up = start_up(tiny_llama, tmp_path, "--api-key", KEY)
    try:
        assert "it asks for the API key" in up.stdout()
        browser.get(up.url + "/")
        browser.wait(lambda: browser.script("return !document.getElementById('key-panel').hidden"), 20,
                     "the key panel")
        time.sleep(1.5)  # a poll or two later: still nothing
        text = browser.script("return document.body.textContent")
        ports = [stage.split(":")[-1] for stage in _stage_addresses(up)]
        assert ports and not any(re.search(rf"\b{port}\b", text) for port in ports), text
        assert "0:1" not in text and "llama" not in text and stage_states(browser) == []
        assert browser.script("return document.getElementById('dashboard').hidden") is True
        browser.screenshot(tmp_path / "1-locked.png")

        browser.type("#key-input", "sk-wrong-key")
        browser.click("#key-submit")
        browser.wait(lambda: browser.script("return !document.getElementById('key-error').hidden"), 10,
                     "the refusal")
        assert stage_states(browser) == []

        browser.type("#key-input", KEY)
        browser.click("#key-submit")
        browser.wait(lambda: [s["status"] for s in stage_states(browser)] == ["up"] * 3, 60, "three stages up")
        assert [stage["range"] for stage in stage_states(browser)] == LAYERS
        browser.screenshot(tmp_path / "2-unlocked.png")
        errors = [entry for entry in browser.console()
                  if entry.get("level") == "SEVERE" and "401" not in entry.get("message", "")]
        assert errors == [], errors  # the refused polls are the only errors
    finally:
        up.stop()


def _stage_addresses(up: UpProcess) -> list[str]:
    return re.findall(r"ready on (\S+:\d+)", up.stderr())
