"""API error bodies, health and metrics; a stage killed during a stream.

Error cases run against one ``skippy up`` (2 stages of the demo model) and each is followed by a
request that must still succeed.  The fault test starts the stages itself and ``skippy serve``
in front of them, kills the final stage while a long stream runs, and expects an error event
within 2 s and ``/health`` to turn 503.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import trio

from skippy.models.cache import ensure_model
from skippy.models.spec import demo

from api_helpers import UpProcess
from stage_helpers import stage_chain

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL_ID = "skippy-demo"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    directory = tmp_path_factory.mktemp("up-errors")
    up = UpProcess(["up", "--generated-model", "--stages", "2", "--port", "0", "--ctx-size", "256", "--threads", "1",
                    "--log-dir", str(directory / "logs")], directory).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture()
def client(server: UpProcess) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        yield api


def still_serving(client: Any) -> None:
    response = client.completions.create(model=MODEL_ID, prompt="ok", max_tokens=2, temperature=0)
    assert response.usage.completion_tokens >= 1


def test_unknown_model_is_404(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-none", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"
    assert "gpt-none" in caught.value.body["message"]
    still_serving(client)


def test_malformed_json_is_400(server: UpProcess, client: Any) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "skippy-demo", "messages": [',
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["code"] == "invalid_json"
    still_serving(client)


@pytest.mark.parametrize("field, value", [("max_tokens", -1), ("max_tokens", "ten"), ("temperature", 3),
                                          ("top_p", 0), ("n", 9), ("stop", 5), ("logit_bias", {"x": 1})])
def test_invalid_fields_are_422_naming_the_field(client: Any, field: str, value: object) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model=MODEL_ID, prompt="hi", extra_body={field: value})
    assert caught.value.body["param"] == field
    assert caught.value.body["type"] == "invalid_request_error"
    still_serving(client)


def test_prompt_longer_than_the_context_is_400(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_ID, prompt="word " * 400, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "256" in caught.value.body["message"]
    still_serving(client)


def test_unknown_route_is_an_openai_style_404(server: UpProcess) -> None:
    response = httpx.get(server.url + "/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_health_and_metrics(server: UpProcess, client: Any) -> None:
    still_serving(client)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("skippy_requests_total", "skippy_completion_tokens_total", "skippy_time_to_first_token_seconds_bucket",
                 "skippy_inter_token_seconds_bucket", "skippy_stage_compute_seconds_bucket"):
        assert name in metrics, name
    assert 'skippy_requests_total{endpoint="completions",status="200"}' in metrics


async def test_killing_a_stage_ends_the_stream_and_health_turns_503(tmp_path: Path) -> None:
    model = str(ensure_model(demo()))
    async with stage_chain(model, ["0:4", "4:8"], tmp_path, ["--ctx-size", "1024"]) as stages:
        # without resume (tests/test_resume.py): nothing restarts these stages, the stream ends at once
        serve = UpProcess(["serve", "--model", model, "--first-stage", str(stages[0].address), "--port", "0",
                           "--ctx-size", "1024", "--model-id", MODEL_ID, "--resume-attempts", "0"], tmp_path)
        await trio.to_thread.run_sync(serve.start)
        try:
            outcome = await trio.to_thread.run_sync(_stream_then_kill, serve.url, stages[1])
            assert outcome["error"], outcome
            assert outcome["seconds_after_kill"] < 2.0, outcome
            health = await trio.to_thread.run_sync(lambda: httpx.get(serve.url + "/health", timeout=10))
            assert health.status_code == 503
            assert health.json()["status"] == "unavailable"
            assert str(stages[0].address) in health.json()["error"]
            async with httpx.AsyncClient(timeout=30) as http:
                response = await http.post(serve.url + "/v1/completions",
                                           json={"model": MODEL_ID, "prompt": "hi", "max_tokens": 2})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "stage_unavailable"
        finally:
            serve.stop()


def _stream_then_kill(url: str, victim: Any) -> dict[str, Any]:
    outcome: dict[str, Any] = {"error": None, "pieces": 0}
    killed_at = 0.0
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "go"}],
                                                max_tokens=900, temperature=0, stream=True)
        try:
            for chunk in stream:
                outcome["pieces"] += 1
                if outcome["pieces"] == 5:
                    victim.process.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
        except openai.APIError as exc:
            outcome["error"] = str(exc)
    outcome["seconds_after_kill"] = time.monotonic() - killed_at if killed_at else None
    return outcome
