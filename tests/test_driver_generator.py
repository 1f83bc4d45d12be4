"""``Generator``: stop strings, UTF-8-safe streaming, sampling sections, context checks, chat
templates; and whole runs over stage servers in this trio run on the tiny llama.

The chain runs with the real runtime in-process (``inprocess_chain``), prefill in chunks of 5
under 2 credits, and must give the unsplit model's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from skippy.driver import ContextOverflow, GenerationRequest, Generator, StageClient
from skippy.driver.generator import _StopMatcher, sampling_config
from skippy.runtime import GREEDY, SamplingParams

from conftest import PROMPT
from stage_helpers import inprocess_chain, reference_greedy


@pytest.fixture(scope="module")
def generator(tiny_llama: Path) -> Iterator[Generator]:
    gen = Generator.from_model(tiny_llama, n_ctx=256, chunk_size=5, credit=2)
    yield gen
    gen.close()


@pytest.mark.parametrize("pieces, stops, emitted, stopped", [
    (["Hel", "lo wor", "ld"], ["lo w"], ["He", "l"], True),
    (["ab", "c", "d"], ["cx"], ["ab", "", "cd"], False),
    (["a", "b"], [], ["a", "b"], False),
    (["xx</", "s>yy"], ["</s>"], ["xx", ""], True),
])
def test_stop_matcher_holds_back_possible_stop_prefixes(pieces: list[str], stops: list[str],
                                                        emitted: list[str], stopped: bool) -> None:
    matcher = _StopMatcher(stops)
    out, found = [], False
    for piece in pieces:
        text, found = matcher.push(piece)
        out.append(text)
        if found:
            break
    if not found:
        out[-1] += matcher.flush()
    assert (out, found) == (emitted, stopped)


def test_sampling_config_is_always_enabled_and_greedy_at_temperature_zero() -> None:
    config = sampling_config(GREEDY)
    assert config.enabled and config.temperature == 0.0
    biased = sampling_config(SamplingParams(temperature=0.7, top_k=40, logit_bias=((5, -2.0),), seed=9))
    assert (biased.top_k, biased.seed, biased.logit_bias[0].token_id, biased.logit_bias[0].bias) == (40, 9, 5, -2.0)


def test_context_check(generator: Generator) -> None:
    assert generator.check_fits(10, None) == 246
    assert generator.check_fits(10, 5) == 5
    with pytest.raises(ContextOverflow, match="maximum context length is 256"):
        generator.check_fits(250, 10)
    with pytest.raises(ContextOverflow):
        generator.check_fits(256, None)


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationRequest((1, 2), 0)
    with pytest.raises(ValueError, match="no tokens"):
        GenerationRequest((), 4)


def test_a_model_without_a_chat_template_gets_the_fallback(generator: Generator) -> None:
    text = generator.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "user: hi\nassistant:"


def test_the_demo_models_chat_template_is_used() -> None:
    from skippy.models.cache import ensure_model
    from skippy.models.spec import demo

    with_template = Generator.from_model(ensure_model(demo()))
    try:
        text = with_template.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        with_template.close()
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_streamed_pieces_never_split_a_character(generator: Generator) -> None:
    tokens = generator.tokenizer.encode("héllo wörld ☃ 日本", add_special=False)
    stream = generator.tokenizer.stream()
    pieces = [stream.push(token) for token in tokens] + [stream.flush()]
    assert "".join(pieces) == generator.tokenizer.decode(tokens)
    assert "".join(pieces).strip() == "héllo wörld ☃ 日本"  # SPM adds a leading space
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.slow
async def test_greedy_run_over_a_chain_matches_the_unsplit_model(tiny_llama: Path, generator: Generator) -> None:
    expected = reference_greedy(tiny_llama, PROMPT, 10, chunk_size=5)
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama)) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            request = GenerationRequest(tuple(PROMPT), 10)
            run = generator.start(client, request, 7)
            pieces = [piece async for piece in run]
            again = await generator.generate(client, request, 8)
    assert run.result is not None
    assert run.result.tokens == expected[: len(run.result.tokens)]
    assert "".join(pieces) == run.result.text == generator.tokenizer.decode(run.result.tokens)
    assert run.result.finish_reason == ("length" if len(run.result.tokens) == 10 else "stop")
    assert again.tokens == run.result.tokens
    timing = run.result.timing
    assert timing.stage_count == 2 and timing.replies >= len(run.result.tokens)
    assert len(timing.inter_token) == len(run.result.tokens) - 1


@pytest.mark.slow
async def test_stop_string_ends_the_run(tiny_llama: Path, generator: Generator) -> None:
    async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama)) as servers:
        async with await StageClient.connect(servers[0].address) as client:
            full = await generator.generate(client, GenerationRequest(tuple(PROMPT), 12), 1)
            stop = full.text[len(full.text) // 2:][:2]
            cut = await generator.generate(client, GenerationRequest(tuple(PROMPT), 12, stop=(stop,)), 2)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.tokens) < len(full.tokens) or stop == ""
