"""The API's front door in process: keys (401), JSON-only bodies (415), the body limit (413), CORS,
hostile bodies answered 4xx JSON (never a plain-text 500), tenants' cache namespaces, admission.

The app runs with the demo model's real vocabulary and a lane pool pointing at a port nothing
listens on: every request here is answered before a lane is needed (the chain is not the
subject; ``tests/test_api_exposure.py`` runs the same checks against real processes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
import trio

from skippy.api.admission import Admission, is_overloaded
from skippy.api.app import ChainService, create_app
from skippy.api.auth import ApiKeys, Tenant
from skippy.api.errors import ApiError
from skippy.api.guard import RequestGuard
from skippy.api.lanes import LanePool, Lease
from skippy.driver.generator import Generator
from skippy.models.cache import ensure_model
from skippy.models.spec import demo
from skippy.net.address import Address

MODEL_ID = "skippy-demo"
KEY_A, KEY_B = "sk-test-tenant-a-0123456789", "sk-test-tenant-b-9876543210"


@pytest.fixture(scope="module")
def generator() -> Iterator[Generator]:
    gen = Generator.from_model(ensure_model(demo()), n_ctx=256)
    yield gen
    gen.close()


def make_app(generator: Generator, **options: Any) -> Any:
    pool = LanePool(Address("127.0.0.1", 9), max_lanes=1, connect_timeout=0.5)
    keys = options.pop("keys", ApiKeys([KEY_A, KEY_B]))
    return create_app(ChainService(generator, pool, MODEL_ID, keys=keys, **options))


@pytest.fixture()
async def http(generator: Generator) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(generator), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        yield client


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


# -- keys ------------------------------------------------------------------------------------------
ENDPOINTS = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_ID}"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/v1/nothing"), ("POST", "/health/x")]


@pytest.mark.parametrize("method, path", ENDPOINTS)
async def test_no_key_is_401_everywhere(http: httpx.AsyncClient, method: str, path: str) -> None:
    body = {"model": MODEL_ID, "prompt": "hi"} if method == "POST" else None
    response = await http.request(method, path, json=body)
    error = assert_openai_error(response, 401)
    assert "API key" in error["message"]
    assert response.headers["www-authenticate"] == "Bearer"
    wrong = await http.request(method, path, json=body, headers=auth("sk-not-a-key"))
    assert_openai_error(wrong, 401, "invalid_api_key")
    basic = await http.request(method, path, json=body, headers={"Authorization": f"Basic {KEY_A}"})
    assert_openai_error(basic, 401, "invalid_api_key")


async def test_health_needs_no_key_and_a_key_opens_the_rest(http: httpx.AsyncClient) -> None:
    health = await http.get("/health")  # nothing listens behind the pool: unhealthy, but not refused
    assert health.status_code == 503 and health.json() == {"status": "unavailable"}  # no addresses for strangers
    wrong = await http.get("/health", headers=auth("sk-wrong"))
    assert wrong.status_code == 503 and wrong.json() == {"status": "unavailable"}
    told = (await http.get("/health", headers=auth())).json()
    assert told["model"] == MODEL_ID and "127.0.0.1:9" in told["first_stage"] and told["error"]
    for key in (KEY_A, KEY_B):
        models = await http.get("/v1/models", headers=auth(key))
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_ID


def test_keys_from_a_file_or_one_value(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# tenants\n{KEY_A}\n\n  {KEY_B}  \n")
    keys = ApiKeys.from_option(str(path), environ={})
    assert len(keys) == 2 and keys.required
    a, b = keys.tenant(KEY_A), keys.tenant(KEY_B)
    assert a is not None and b is not None and a != b
    assert KEY_A not in a.id and a.id.startswith("key-")
    assert keys.tenant("sk-other") is None
    assert len(ApiKeys.from_option(KEY_A, environ={})) == 1
    assert len(ApiKeys.from_option(None, environ={"SKIPPY_API_KEY": KEY_B})) == 1
    assert not ApiKeys.from_option(None, environ={}).required
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(ValueError, match="holds no API key"):
        ApiKeys.from_option(str(tmp_path / "empty"), environ={})
    with pytest.raises(ValueError, match="whitespace"):
        ApiKeys(["two words"])
    with pytest.raises(ValueError, match="does not exist"):  # a mistyped path is not taken as the key
        ApiKeys.from_option(str(tmp_path / "kyes"), environ={})


# -- tenants -----------------------------------------------------------------------------------------
def test_cache_namespace_comes_from_the_key_not_the_claim() -> None:
    keys = ApiKeys([KEY_A, KEY_B])
    a, b = keys.tenant(KEY_A), keys.tenant(KEY_B)
    assert a is not None and b is not None
    # Whatever B claims, it never lands in one of A's namespaces.
    claims = [None, "", "alice", a.id, a.cache_namespace(None), a.cache_namespace("alice")]
    a_spaces = {a.cache_namespace(claim) for claim in claims}
    assert len(a_spaces) == len(claims)  # None and "" differ too
    assert not a_spaces & {b.cache_namespace(claim) for claim in claims}
    assert a.cache_namespace("alice") == keys.tenant(KEY_A).cache_namespace("alice")  # type: ignore[union-attr]
    salted = ApiKeys([KEY_A], salt="pepper").tenant(KEY_A)
    assert salted is not None and salted.cache_namespace("alice") != a.cache_namespace("alice")
    assert keys.anonymous.cache_namespace(None) not in a_spaces
    assert "alice" not in a.cache_namespace("alice") and KEY_A not in a.cache_namespace(None)


# -- bodies ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None, "application/jsonx"])
async def test_non_json_bodies_are_415(http: httpx.AsyncClient, content_type: str | None) -> None:
    headers = auth() | ({"Content-Type": content_type} if content_type else {})
    body = json.dumps({"model": MODEL_ID, "prompt": "hi"}).encode()
    response = await http.post("/v1/completions", content=body, headers=headers)
    assert_openai_error(response, 415, "unsupported_media_type")


async def test_json_with_a_charset_is_served(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/completions", content=b'{"model": "other", "prompt": "hi"}',
                               headers=auth() | {"Content-Type": "Application/JSON; charset=utf-8"})
    assert_openai_error(response, 404, "model_not_found")  # past the guard, refused by the handler


async def test_a_declared_oversize_body_is_413_unread(generator: Generator) -> None:
    app = make_app(generator, max_body_bytes=1000)
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("api", 80), "client": ("c", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"52428800"),
                         (b"authorization", f"Bearer {KEY_A}".encode())]}
    await app(scope, receive, send)
    assert reads == 0
    assert sent[0]["status"] == 413
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_too_large" and "52428800" in error["message"]


async def test_a_chunked_oversize_body_is_413_after_the_limit() -> None:
    served: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        served.append((await receive())["body"])

    guard = RequestGuard(app, max_body_bytes=10_000)
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 4096, "more_body": reads < 1000}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]}
    await guard(scope, receive, send)
    assert reads == 3 and not served and sent[0]["status"] == 413
    reads = 998  # a small chunked body (two chunks) is replayed whole
    sent.clear()
    await guard(scope, receive, send)
    assert served == [b"x" * 4096 * 2] and not sent


# -- hostile bodies -------------------------------------------------------------------------------------
DEEP = b'{"model": "skippy-demo", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = [
    ("deep-json", DEEP, 400, "invalid_json"),
    ("deep-but-parsable", b'{"model": "skippy-demo", "prompt": ' + b"[" * 500 + b"]" * 500 + b"}", 400, "invalid_json"),
    ("top_k-2^40", b'{"model": "skippy-demo", "prompt": "hi", "top_k": 1099511627776}', 422, "invalid_value"),
    ("surrogate-prompt", b'{"model": "skippy-demo", "prompt": "a\\ud800b"}', 400, "invalid_json"),
    ("surrogate-message", b'{"model": "skippy-demo", "messages": [{"role": "user", "content": "\\udfff"}]}',
     400, "invalid_json"),
    ("surrogate-model", b'{"model": "\\ud83d", "prompt": "hi"}', 400, "invalid_json"),
    ("surrogate-key", b'{"model": "skippy-demo", "prompt": "hi", "\\ud800": 1}', 400, "invalid_json"),
    ("surrogate-stop", b'{"model": "skippy-demo", "prompt": "hi", "stop": ["\\udc00"]}', 400, "invalid_json"),
    ("huge-int-temperature", b'{"model": "skippy-demo", "prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
     422, "invalid_value"),
    ("huge-int-min_p", b'{"model": "skippy-demo", "prompt": "hi", "min_p": -1' + b"0" * 400 + b"}", 422,
     "invalid_value"),
    ("huge-int-max_tokens", b'{"model": "skippy-demo", "prompt": "hi", "max_tokens": 1' + b"0" * 4000 + b"}",
     400, "context_length_exceeded"),
    ("int-too-long-to-parse", b'{"model": "skippy-demo", "prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400,
     "invalid_json"),
    ("nan-temperature", b'{"model": "skippy-demo", "prompt": "hi", "temperature": NaN}', 422, "invalid_value"),
    ("infinite-logit-bias", b'{"model": "skippy-demo", "prompt": "hi", "logit_bias": {"5": Infinity}}', 422,
     "invalid_value"),
    ("huge-logit-bias-key", b'{"model": "skippy-demo", "prompt": "hi", "logit_bias": {"' + b"9" * 5000
     + b'": 1}}', 422, "invalid_value"),
    ("token-id-2^40", b'{"model": "skippy-demo", "prompt": [1099511627776]}', 422, "invalid_value"),
    ("not-an-object", b"[1, 2]", 400, "invalid_json"),
    ("not-utf8", b'{"model": "\xff\xfe"}', 400, "invalid_json"),
]


@pytest.mark.parametrize("body, status, code", [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE])
async def test_hostile_bodies_are_4xx_json(http: httpx.AsyncClient, body: bytes, status: int, code: str) -> None:
    headers = auth() | {"Content-Type": "application/json"}
    assert_openai_error(await http.post("/v1/completions", content=body, headers=headers), status, code)
    chat = await http.post("/v1/chat/completions", content=body, headers=headers)  # no 'messages': 4xx too
    assert_openai_error(chat, chat.status_code)
    assert 400 <= chat.status_code < 500


async def test_an_unexpected_exception_is_a_json_500(generator: Generator) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            return getattr(generator, name)

        def encode(self, text: str) -> list[int]:
            raise RuntimeError("boom")

    pool = LanePool(Address("127.0.0.1", 9), max_lanes=1)
    app = create_app(ChainService(Broken(), pool, MODEL_ID))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        response = await client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "hi"})
    error = assert_openai_error(response, 500, "internal_error")
    assert error["type"] == "server_error" and "RuntimeError" in error["message"] and "boom" not in error["message"]


# -- CORS ----------------------------------------------------------------------------------------------
async def test_cors_is_off_unless_configured(generator: Generator) -> None:
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    for origins, allowed in (((), False), (("https://app.example",), False), (("https://evil.example",), True)):
        transport = httpx.ASGITransport(app=make_app(generator, cors_origins=origins))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            answer = await client.options("/v1/chat/completions", headers=preflight)
            plain = await client.get("/v1/models", headers=auth() | {"Origin": "https://evil.example"})
        assert (answer.headers.get("access-control-allow-origin") == "https://evil.example") is allowed
        assert (answer.status_code == 200) is allowed
        assert ("access-control-allow-origin" in plain.headers) is allowed


# -- admission -----------------------------------------------------------------------------------------
class FakePool:
    """The part of LanePool admission uses: lanes as a FIFO semaphore."""

    def __init__(self, lanes: int) -> None:
        self.max_lanes = lanes
        self.slots = trio.Semaphore(lanes)

    @property
    def free_lanes(self) -> int:
        return int(self.slots.value)

    async def acquire(self) -> Lease:
        await self.slots.acquire()
        return Lease(client=None)  # type: ignore[arg-type]

    def release(self) -> None:
        self.slots.release()


async def test_admission_queues_then_refuses_with_retry_after(autojump_clock: Any) -> None:
    pool = FakePool(2)
    admission = Admission(pool, max_queue=2, timeout=10)  # type: ignore[arg-type]
    order: list[int] = []
    refusals: list[ApiError] = []

    async def request(index: int) -> None:
        try:
            await admission.acquire(admission.deadline())
        except ApiError as exc:
            refusals.append(exc)
            return
        order.append(index)
        await trio.sleep(3)
        pool.release()

    async with trio.open_nursery() as nursery:
        for index in range(5):
            nursery.start_soon(request, index)
            await trio.sleep(0.01)
    assert order == [0, 1, 2, 3]  # two at once, two queued in arrival order
    assert len(refusals) == 1 and refusals[0].status == 429 and refusals[0].code == "queue_full"
    assert 1 <= int(refusals[0].headers["Retry-After"]) <= 60

    await pool.acquire()
    await pool.acquire()
    started = trio.current_time()
    with pytest.raises(ApiError) as caught:
        await admission.acquire(admission.deadline())
    assert caught.value.status == 429 and caught.value.code == "queue_timeout"
    assert trio.current_time() - started == pytest.approx(10)
    assert admission.waiting == 0


async def test_an_overloaded_chain_is_retried_until_the_deadline(autojump_clock: Any) -> None:
    from skippy.driver.client import StageLost, StageRemoteError
    from skippy.codec.protocol_ext import ErrorCode, ErrorFrame

    admission = Admission(FakePool(1), timeout=1.0)  # type: ignore[arg-type]
    overloaded = StageRemoteError("all sessions are in use", ErrorFrame(ErrorCode.OVERLOADED, 0, 0))
    assert is_overloaded(overloaded)
    assert not is_overloaded(StageLost("gone")) and not is_overloaded(
        StageRemoteError("bad", ErrorFrame(ErrorCode.MALFORMED_FRAME, 0, 0)))
    deadline = admission.deadline()
    attempts = 0
    with pytest.raises(ApiError) as caught:
        while True:
            await admission.retry_after_overload(attempts, deadline, overloaded)
            attempts += 1
    assert caught.value.status == 429 and "no free session" in caught.value.message
    assert 5 <= attempts <= 10 and trio.current_time() <= deadline


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
async def test_a_large_prompt_is_tokenised_off_the_event_loop(http: httpx.AsyncClient, path: str) -> None:
    prompt = ("The quick brown fox jumps over the lazy dog. " * 25_000)[:1_000_000]  # ~0.5 s to tokenise
    finished: list[str] = []

    async def big() -> None:
        if path == "/tokenize":
            response = await http.post(path, json={"content": prompt}, headers=auth())
            assert response.status_code == 200 and len(response.json()["tokens"]) > 100_000
        else:
            response = await http.post(path, json={"model": MODEL_ID, "prompt": prompt}, headers=auth())
            assert_openai_error(response, 400, "context_length_exceeded")
        finished.append("big")

    async def small() -> None:
        await trio.sleep(0.05)
        for _ in range(5):
            assert (await http.get("/v1/models", headers=auth())).status_code == 200
        finished.append("small")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(big)
        nursery.start_soon(small)
    assert finished == ["small", "big"]


async def test_metrics_labels_never_carry_a_client_chosen_path(http: httpx.AsyncClient) -> None:
    for index in range(3):
        await http.get(f"/v1/models/no-such-model-{index}", headers=auth())
        await http.get(f"/random/path/{index}")
    metrics = (await http.get("/metrics", headers=auth())).text
    assert "no-such-model" not in metrics and "random" not in metrics
    assert 'skippy_requests_total{endpoint="model",status="404"} 3.0' in metrics
    assert 'skippy_requests_total{endpoint="other",status="401"} 3.0' in metrics
    assert "skippy_queue_waiting 0.0" in metrics


async def test_a_client_that_leaves_the_queue_frees_its_place(generator: Generator) -> None:
    lanes = FakePool(1)
    await lanes.acquire()  # the only lane is busy
    admission = Admission(lanes, timeout=60)  # type: ignore[arg-type]
    service = ChainService(generator, LanePool(Address("127.0.0.1", 9), max_lanes=1), MODEL_ID, admission=admission)
    app = create_app(service)
    body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}).encode()
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep(0.2)  # then the client hangs up
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("api", 80), "client": ("c", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    started = trio.current_time()
    await app(scope, receive, send)
    assert trio.current_time() - started < 10  # not the 60 s queue timeout
    assert sent[0]["status"] == 499 and json.loads(sent[1]["body"])["error"]["code"] == "client_gone"
    assert admission.waiting == 0 and admission.gone == 1 and lanes.free_lanes == 0
