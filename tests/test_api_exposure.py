"""``skippy up --api-key FILE`` as real processes: what an exposed API must withstand.

One chain (2 stages of the generated demo model, 2 lanes, a queue of 3) serves every test: keys
over real HTTP, a 50 MB body refused 413 before it is read (time and the API process's RSS
measured), hostile bodies answered 4xx JSON, tenants that cannot see each other's prefix cache,
more clients than lanes queued (not refused) up to the queue's size and 429 + Retry-After past
it, and streams abandoned by their clients leaving no session behind on any stage.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from api_helpers import UpProcess

pytestmark = pytest.mark.slow

MODEL_ID = "skippy-demo"
KEY_A, KEY_B = "sk-exposure-tenant-a-01234567", "sk-exposure-tenant-b-76543210"
LANES, QUEUE = 2, 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    directory = tmp_path_factory.mktemp("up-exposure")
    keys = directory / "keys"
    keys.write_text(f"# two tenants\n{KEY_A}\n{KEY_B}\n")
    up = UpProcess(["up", "--generated-model", "--stages", "2", "--port", "0", "--ctx-size", "512", "--threads", "1",
                    "--max-sessions", str(LANES), "--max-queue", str(QUEUE), "--api-key", str(keys),
                    "--log-dir", str(directory / "logs")], directory).start()
    try:
        yield up
    finally:
        up.stop()


def headers(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(url: str, key: str = KEY_A, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL_ID, "prompt": "ok", "max_tokens": 2,
                                                     "temperature": 0, **body}, headers=headers(key), timeout=120)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_every_endpoint_but_health_needs_a_key(server: UpProcess) -> None:
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/v1/missing")]:
        response = httpx.request(method, server.url + path, json={"model": MODEL_ID} if method == "POST" else None)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert response.headers["www-authenticate"] == "Bearer"
        wrong = httpx.request(method, server.url + path, headers=headers("sk-wrong"))
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=headers(KEY_B)).status_code == 200
    assert completion(server.url).status_code == 200


def test_a_50_mb_body_is_refused_413_unread(server: UpProcess) -> None:
    assert server.process is not None
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    size = 50 * 1024 * 1024
    before = rss_kib(server.process.pid)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {KEY_A}\r\nContent-Length: {size}\r\n\r\n").encode())
        stop = threading.Event()

        def pour() -> None:  # keep sending body bytes, as a real client would, until the server hangs up
            chunk = b" " * 65536
            sent = 0
            try:
                while sent < size and not stop.is_set():
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass

        pourer = threading.Thread(target=pour)
        pourer.start()
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except ConnectionResetError:  # the server hung up on the unread body (after answering)
            pass
        elapsed = time.monotonic() - started
        stop.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        pourer.join(30)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert elapsed < 5.0, elapsed  # answered from the headers (typically milliseconds)
    growth_mib = (rss_kib(server.process.pid) - before) / 1024
    assert growth_mib < 10, growth_mib
    plain = httpx.post(server.url + "/v1/completions", content=b'{"model": "skippy-demo", "prompt": "hi"}',
                       headers=headers() | {"Content-Type": "text/plain"})
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
    assert completion(server.url).status_code == 200


@pytest.mark.parametrize("body, status", [
    (b'{"model": "skippy-demo", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    (b'{"model": "skippy-demo", "prompt": "hi", "top_k": 1099511627776}', 422),
    (b'{"model": "skippy-demo", "prompt": "lone \\ud800 surrogate"}', 400),
    (b'{"model": "skippy-demo", "messages": [{"role": "user", "content": "\\udc00"}]}', 400),
    (b'{"model": "skippy-demo", "prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", 422),
], ids=["100k-deep", "top_k-2^40", "surrogate-prompt", "surrogate-message", "huge-int-temperature"])
def test_hostile_bodies_are_4xx_json(server: UpProcess, body: bytes, status: int) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(server.url + path, content=body,
                              headers=headers() | {"Content-Type": "application/json"}, timeout=60)
        assert 400 <= response.status_code < 500, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.status_code == status or path.endswith("chat/completions")
    assert completion(server.url).status_code == 200


def test_claiming_another_tenants_user_reveals_nothing(server: UpProcess) -> None:
    prompt = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 12  # several 64-token pages

    def cached(key: str, user: str) -> int:
        response = completion(server.url, key, prompt=prompt, user=user)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(KEY_A, "alice") == 0
    assert cached(KEY_A, "alice") > 0  # the tenant's own namespace hits
    assert cached(KEY_B, "alice") == 0  # same claimed user, other key: nothing
    assert cached(KEY_B, "alice") > 0  # ... and its own entry from now on
    assert cached(KEY_A, "bob") == 0  # a tenant may subdivide its own namespace
    assert cached(KEY_A, "alice") > 0


def _stream(url: str, max_tokens: int, abandon: bool = False) -> tuple[int, str]:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "logit_bias": {"2": -100}}
    with httpx.Client(timeout=180) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers()) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, response.text + f" retry-after={response.headers.get('retry-after')}"
            text = ""
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return 500, json.dumps(event)
                    text += event["choices"][0]["delta"].get("content") or ""
                    if abandon and text:
                        return 200, "abandoned"
            return 200, text


def test_more_clients_than_lanes_wait_then_429_past_the_queue(server: UpProcess) -> None:
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda _: _stream(server.url, 24), range(LANES + QUEUE)))
    assert [status for status, _ in outcomes] == [200] * (LANES + QUEUE), outcomes
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        burst = list(pool.map(lambda _: _stream(server.url, 48), range(LANES + QUEUE + 4)))
    statuses = sorted(status for status, _ in burst)
    assert set(statuses) <= {200, 429}, burst
    assert statuses.count(429) >= 1 and statuses.count(200) >= LANES + QUEUE - 1, burst
    for status, text in burst:
        if status == 429:
            assert "queue_full" in text and "retry-after=None" not in text, text


def test_abandoned_streams_leave_no_session_behind(server: UpProcess) -> None:
    def abandon_then_ask() -> list[tuple[int, str]]:  # the next request comes the moment the client left
        return [_stream(server.url, 200, abandon=True), _stream(server.url, 4)]

    with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
        outcomes = [outcome for pair in pool.map(lambda _: abandon_then_ask(), range(4 * LANES)) for outcome in pair]
    assert [status for status, _ in outcomes] == [200] * len(outcomes), outcomes
    metrics = httpx.get(server.url + "/metrics", headers=headers()).text

    def counter(name: str) -> float:
        return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))

    # Each left stream was stopped between two tokens: its session stopped on every stage, its lane kept.
    assert counter("skippy_lanes_kept_after_abort_total") >= 1, metrics
    assert counter("skippy_lanes_closed_after_abort_total") == 0, metrics
    assert 'status="503"' not in metrics and 'status="500"' not in metrics
