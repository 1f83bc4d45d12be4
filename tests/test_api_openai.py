"""The official ``openai`` client against ``skippy up`` on the generated demo model (2 and 3 stages).

With greedy sampling the text must equal the unsplit reference's (llama-cpp-python on the same
library, whole model, same prompt tokens), streamed or not; ``stop``, ``max_tokens`` and ``usage``
are checked against it, and four concurrent streams must each get their own right answer.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from skippy.driver.generator import Generator
from skippy.models.cache import ensure_model
from skippy.models.spec import demo

from api_helpers import UpProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL_ID = "skippy-demo"
PROMPTS = ["Hello there, how are you?", "The capital of France is", "Tell me a story about a cat.", "1, 2, 3,"]


@pytest.fixture(scope="module")
def demo_path() -> Path:
    return ensure_model(demo())


@pytest.fixture(scope="module")
def generator(demo_path: Path) -> Iterator[Generator]:
    gen = Generator.from_model(demo_path)
    yield gen
    gen.close()


class Reference:
    """Greedy tokens of the unsplit model (llama-cpp-python), cached per prompt."""

    def __init__(self, path: Path, generator: Generator) -> None:
        from skippy.reference import load_reference

        self.llm: Any = load_reference(path, n_ctx=512, threads=1)
        self.generator = generator
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        if key not in self.cache or len(self.cache[key]) < max_tokens:
            llm = self.llm
            llm.reset()
            llm.eval(prompt)
            out: list[int] = []
            while len(out) < max_tokens:
                token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                if self.generator.tokenizer.is_end_of_generation(token):
                    break
                out.append(token)
                llm.eval([token])
            self.cache[key] = out
        return self.cache[key][:max_tokens]

    def text(self, prompt: list[int], max_tokens: int) -> str:
        return self.generator.tokenizer.decode(self.tokens(prompt, max_tokens))


@pytest.fixture(scope="module")
def reference(demo_path: Path, generator: Generator) -> Iterator[Reference]:
    ref = Reference(demo_path, generator)
    yield ref
    ref.llm.close()


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    directory = tmp_path_factory.mktemp(f"up{request.param}")
    up = UpProcess(["up", "--generated-model", "--stages", str(request.param), "--port", "0", "--ctx-size", "512",
                    "--threads", "1", "--log-dir", str(directory / "logs")], directory).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture()
def client(server: UpProcess) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        yield api


def chat_prompt(generator: Generator, text: str) -> list[int]:
    return generator.encode(generator.apply_chat_template([{"role": "user", "content": text}]))


def test_models_lists_the_served_model(client: Any) -> None:
    assert [model.id for model in client.models.list()] == [MODEL_ID]


def test_chat_completion_equals_the_unsplit_reference(client: Any, generator: Generator,
                                                      reference: Reference) -> None:
    response = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[0]}],
                                              max_tokens=12, temperature=0)
    prompt = chat_prompt(generator, PROMPTS[0])
    expected = reference.tokens(prompt, 12)
    assert response.choices[0].message.content == generator.tokenizer.decode(expected)
    assert response.choices[0].finish_reason == ("length" if len(expected) == 12 else "stop")
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(expected)
    assert response.usage.total_tokens == len(prompt) + len(expected)
    timing = response.usage.model_extra["skippy_timing"]
    assert timing["stage_count"] >= 2


def test_streaming_chat_completion_equals_the_reference(client: Any, generator: Generator,
                                                        reference: Reference) -> None:
    stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[1]}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    prompt = chat_prompt(generator, PROMPTS[1])
    expected = reference.tokens(prompt, 12)
    assert "".join(pieces) == generator.tokenizer.decode(expected)
    assert finish in ("length", "stop")
    assert usage is not None and usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(expected)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_honours_max_tokens(client: Any, generator: Generator, reference: Reference,
                                       stream: bool) -> None:
    prompt = generator.encode(PROMPTS[2])
    expected = reference.tokens(prompt, 7)
    if stream:
        chunks = list(client.completions.create(model=MODEL_ID, prompt=PROMPTS[2], max_tokens=7, temperature=0,
                                                stream=True))
        text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
        finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    else:
        response = client.completions.create(model=MODEL_ID, prompt=PROMPTS[2], max_tokens=7, temperature=0)
        text, finish = response.choices[0].text, [response.choices[0].finish_reason]
        assert response.usage.prompt_tokens == len(prompt)
        assert response.usage.completion_tokens == len(expected)
    assert text == generator.tokenizer.decode(expected)
    assert finish == ["length" if len(expected) == 7 else "stop"]


def test_completion_honours_stop(client: Any, generator: Generator, reference: Reference) -> None:
    prompt = generator.encode(PROMPTS[3])
    full = reference.text(prompt, 16)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {full!r}"
    response = client.completions.create(model=MODEL_ID, prompt=PROMPTS[3], max_tokens=16, temperature=0, stop=[stop])
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_ID, prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == full[: full.index(stop)]


def test_four_concurrent_streams_get_their_own_answers(client: Any, generator: Generator,
                                                       reference: Reference) -> None:
    def run(text: str) -> str:
        stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": text}],
                                                max_tokens=10, temperature=0, stream=True)
        return "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, PROMPTS))
    expected = [generator.tokenizer.decode(reference.tokens(chat_prompt(generator, text), 10)) for text in PROMPTS]
    assert results == expected


def test_sampling_with_a_seed_is_reproducible(client: Any) -> None:
    def sample() -> str:
        response = client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=8, temperature=0.9,
                                             top_p=0.9, seed=1234, logit_bias={"100": 5})
        return str(response.choices[0].text)

    assert sample() == sample()
