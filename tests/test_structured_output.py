"""Structured output and logprobs through the official ``openai`` SDK against ``skippy up``.

A 2-stage chain of the generated tiny llama (random weights, a real 32k vocabulary): the grammar
constrains whatever the weights say, so every json_schema answer must validate (100 seeded
samples at temperature 1.0), ``client.beta.chat.completions.parse`` must give the Pydantic model,
``json_object`` must give a JSON object and llama-server's ``grammar`` its language.  Logprobs
must equal the unsplit llama-cpp-python reference's log-softmax within 1e-4 over 32 positions,
streamed or not.  Bad input is a 400 naming the field and the server keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import pytest

from skippy.driver.generator import Generator
from skippy.models.cache import ensure_model
from skippy.models.spec import tiny

from api_helpers import UpProcess

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer"},
        "name": {"type": "string", "maxLength": 4},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "ok", "count", "name"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return ensure_model(tiny("llama"))


@pytest.fixture(scope="module")
def model_id(model_path: Path) -> str:
    return model_path.stem


@pytest.fixture(scope="module")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    directory = tmp_path_factory.mktemp("structured")
    up = UpProcess(["up", "--model", str(model_path), "--stages", "2", "--port", "0", "--ctx-size", "512",
                    "--threads", "1", "--log-dir", str(directory / "logs")], directory).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture()
def client(server: UpProcess) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as api:
        yield api


def test_100_seeded_json_schema_samples_all_validate(client: Any, model_id: str) -> None:
    def sample(seed: int) -> tuple[str, str]:
        response = client.chat.completions.create(
            model=model_id, messages=MESSAGES, max_tokens=96, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
        return response.choices[0].message.content, response.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(sample, range(100)))
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in answers}) > 50  # the samples are drawn, not one answer repeated
    assert sample(7) == answers[7]  # seeded: reproducible


def test_parse_with_a_pydantic_model(client: Any, model_id: str) -> None:
    class Thing(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        count: int
        ok: bool
        color: Literal["red", "green"]

    response = client.beta.chat.completions.parse(model=model_id, messages=MESSAGES, max_tokens=96,
                                                   temperature=1.0, seed=1, response_format=Thing)
    thing = response.choices[0].message.parsed
    assert isinstance(thing, Thing) and thing.color in ("red", "green") and len(thing.name) <= 6


def test_json_object_and_a_gbnf_grammar(client: Any, model_id: str) -> None:
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=200, temperature=0.7,
                                              seed=3, response_format={"type": "json_object"})
    text = response.choices[0].message.content
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert text.lstrip().startswith("{")
    grammar = 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'
    for seed in range(5):
        response = client.completions.create(model=model_id, prompt="Answer:", max_tokens=16, temperature=1.0,
                                             seed=seed, extra_body={"grammar": grammar})
        text = response.choices[0].text
        head, _, digits = text.partition(", ")
        assert head in ("yes", "no") and digits.isdigit() and len(digits) <= 2, text


def test_json_object_with_a_schema_follows_the_schema(client: Any, model_id: str) -> None:
    """llama-server's ``{"type": "json_object", "schema": ...}``: the schema is honoured, not dropped."""
    for seed in range(10):
        response = client.chat.completions.create(
            model=model_id, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_object", "schema": SCHEMA})  # type: ignore[typeddict-unknown-key]
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_grammar_request_does_not_speculate(client: Any, model_id: str) -> None:
    response = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
        extra_body={"speculation": True})
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
    assert "skippy_speculation" not in response.usage.model_extra


def _reference_greedy(path: Path, prompt: list[int], steps: int, banned: int) -> list[tuple[int, np.ndarray]]:
    """The unsplit model (llama-cpp-python): ``steps`` greedy tokens (``banned`` never picked, as the
    request's logit bias does) with the log-softmax row each was picked from."""
    from skippy.reference import load_reference

    llm: Any = load_reference(path, n_ctx=512, threads=1)
    out = []
    try:
        llm.reset()
        llm.eval(prompt)
        for _ in range(steps):
            scores = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            peak = scores.max()
            row = scores - (peak + math.log(np.exp(scores - peak).sum()))
            biased = scores.copy()
            biased[banned] = -np.inf
            token = int(np.argmax(biased))
            out.append((token, row))
            llm.eval([token])
    finally:
        llm.close()
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_equal_the_unsplit_reference_over_32_positions(client: Any, model_id: str, model_path: Path,
                                                                 stream: bool) -> None:
    generator = Generator.from_model(model_path)
    try:
        prompt = generator.encode(generator.apply_chat_template(MESSAGES))
        eos = generator.tokenizer.eos
        kwargs: dict[str, Any] = dict(model=model_id, messages=MESSAGES, max_tokens=32, temperature=0, logprobs=True,
                                      top_logprobs=5, logit_bias={str(eos): -100})
        if stream:
            entries = []
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    if choice.logprobs is not None:
                        entries += choice.logprobs.content
        else:
            entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
        assert len(entries) == 32
        reference = _reference_greedy(model_path, prompt, 32, eos)
        piece = generator.tokenizer.piece
        for entry, (token, row) in zip(entries, reference):
            assert bytes(entry.bytes) == piece(token)  # the same greedy token as the unsplit model
            assert entry.logprob == pytest.approx(row[token], abs=1e-4)
            top = np.argsort(-row, kind="stable")[:5]
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(list(row[top]), abs=1e-4)
            assert [bytes(t.bytes) for t in entry.top_logprobs] == [piece(int(t)) for t in top]
            if token == int(top[0]):  # greedy picked the top token (unless the bias ruled it out)
                assert entry.logprob == entry.top_logprobs[0].logprob
    finally:
        generator.close()


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {"type": "nonsense"}}}, "response_format.schema"),
    ({"response_format": {"type": "json_object", "shema": SCHEMA}}, "response_format.shema"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": 'start ::= "a"'}, "grammar"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
], ids=["invalid-schema", "remote-ref", "unknown-type", "object-invalid-schema", "object-unknown-key", "grammar-syntax", "grammar-no-root", "top-logprobs-21",
        "top-logprobs-alone"])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(client: Any, model_id: str,
                                                                          body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, extra_body=body)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param and param.split(".")[0] in raised.value.body["message"]
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_completions_logprobs_are_the_legacy_shape(client: Any, model_id: str) -> None:
    response = client.completions.create(model=model_id, prompt="Hello", max_tokens=6, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0 and all(-math.inf < lp <= 0 for lp in logprobs.token_logprobs)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="Hello", max_tokens=2, logprobs=21)


BOUNDED = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": -12, "maximum": 37},
        "m": {"type": "integer", "exclusiveMinimum": 1000, "exclusiveMaximum": 1010},
        "w": {"type": "number", "minimum": 0},
    },
    "required": ["n", "m", "w"],
    "additionalProperties": False,
}


def test_integer_bounds_hold_in_50_seeded_answers(client: Any, model_id: str) -> None:
    def sample(seed: int) -> tuple[str, str]:
        response = client.chat.completions.create(
            model=model_id, messages=MESSAGES, max_tokens=64, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "bounded", "schema": BOUNDED}})
        return response.choices[0].message.content, response.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(sample, range(50)))
    values = set()
    for text, finish in answers:
        assert finish == "stop", text
        answer = json.loads(text)
        jsonschema.validate(answer, BOUNDED)  # the bounds included
        values.add(answer["n"])
    assert len(values) > 5  # drawn across the range, not one value repeated


UNSUPPORTED = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                         "uniqueItems": True}}}


def test_an_unsupported_keyword_is_a_400_naming_it_in_each_api(client: Any, model_id: str,
                                                              server: UpProcess) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED}})
    param = "response_format.json_schema.schema.properties.tags.uniqueItems"
    assert raised.value.body["param"] == param and f"'{param}' is not supported" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model_id, input="Describe a thing.", max_output_tokens=16, text={
            "format": {"type": "json_schema", "name": "x", "schema": UNSUPPORTED}})
    param = "text.format.schema.properties.tags.uniqueItems"
    assert raised.value.body["param"] == param and f"'{param}' is not supported" in raised.value.body["message"]
    import httpx

    reply = httpx.post(server.url + "/v1/messages", timeout=60, headers={"x-api-key": "unused"}, json={
        "model": model_id, "max_tokens": 16, "messages": MESSAGES,
        "output_config": {"format": {"type": "json_schema", "schema": UNSUPPORTED}}})
    body = reply.json()
    assert reply.status_code == 400 and body["type"] == "error", body
    assert "'output_config.format.schema.properties.tags.uniqueItems' is not supported" in body["error"]["message"]
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")
