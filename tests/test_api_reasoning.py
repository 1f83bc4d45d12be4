"""Reasoning models: ``<think>`` split into ``reasoning_content``, template variables, the inline format.

The splitter is checked on its own (any split of the text into pieces gives the same fields), then
on a real 2-stage chain of the tiny llama served with a ``<think>`` chat template, the answer
forced by a grammar (random weights would not write tags): non-streamed and streamed fields agree
and together are the raw answer the inline format (``none``) returns; ``chat_template_kwargs``
(``enable_thinking``) reaches the template; a template that opens ``<think>`` in its generation
prompt starts the split inside; variables a template does not read are 400s naming them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from skippy.api.errors import ApiError
from skippy.api.reasoning import ReasoningSplitter, template_variables

from stage_helpers import inprocess_chain

MODEL = "tiny"
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{%- endif %}"
)
ANSWER = '"<think>" [a-z]{3,12} "</think>" "\\n\\n" [a-z]{3,12}'


def split_all(text: str, pieces: list[int], inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(inside)
    reasoning, content = [], []
    start = 0
    for end in [*pieces, len(text)]:
        r, c = splitter.push(text[start:end])
        reasoning.append(r)
        content.append(c)
        start = end
    r, c = splitter.flush()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize(("text", "inside", "expected"), [
    ("<think>plan it</think>\n\nThe answer.", False, ("plan it", "The answer.")),
    ("  <think>a</think>b <think>c</think>", False, ("a", "b <think>c</think>")),  # only the opening thinks
    ("No reasoning here </think>", False, ("", "No reasoning here </think>")),
    ("still thinking</think> done", True, ("still thinking", "done")),
    ("<think>never closed", False, ("never closed", "")),
    ("<thi", False, ("", "<thi")),
    ("", False, ("", "")),
])
def test_any_split_into_pieces_gives_the_same_fields(text: str, inside: bool, expected: tuple[str, str]) -> None:
    assert split_all(text, [], inside) == expected
    assert split_all(text, list(range(1, len(text))), inside) == expected  # one character at a time
    for cut in range(len(text) + 1):
        assert split_all(text, [cut], inside) == expected, cut


def test_template_variables_must_be_read_by_the_template() -> None:
    template = THINK_TEMPLATE + "{{ reasoning_effort }}"
    assert template_variables({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"},
                              template) == {"enable_thinking": False, "reasoning_effort": "low"}
    for body, param, status in (({"chat_template_kwargs": {"nothing_reads_me": 1}}, "chat_template_kwargs.nothing_reads_me", 400),
                                ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", 422),
                                ({"chat_template_kwargs": [1]}, "chat_template_kwargs", 422),
                                ({"reasoning_effort": "enormous"}, "reasoning_effort", 422)):
        with pytest.raises(ApiError) as raised:
            template_variables(body, template)
        assert (raised.value.param, raised.value.status) == (param, status)
    with pytest.raises(ApiError) as raised:
        template_variables({"reasoning_effort": "low"}, THINK_TEMPLATE)
    assert raised.value.param == "reasoning_effort" and raised.value.status == 400


@pytest.mark.slow
async def test_think_answers_are_split_streamed_or_not_and_inline_with_none(tiny_llama: Path) -> None:
    from skippy.api.app import ChainService, create_app
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.runtime.tokenizer import Tokenizer

    generator = Generator(Tokenizer(tiny_llama), chat_template=THINK_TEMPLATE, n_ctx=512, chunk_size=8)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Think first."}], "max_tokens": 60,
           "temperature": 1.0, "seed": 11, "grammar": f"root ::= {ANSWER}"}
    try:
        async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), ctx_size=512) as servers:
            pool = LanePool(servers[0].address, max_lanes=1)
            service = ChainService(generator, pool, MODEL)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                         base_url="http://skippy", timeout=60) as http:
                whole = (await http.post("/v1/chat/completions", json=ask)).json()
                streamed = await http.post("/v1/chat/completions", json={**ask, "stream": True})
                off = (await http.post("/v1/chat/completions", json={
                    **ask, "chat_template_kwargs": {"enable_thinking": False}})).json()
                opened = (await http.post("/v1/chat/completions", json={
                    **ask, "chat_template_kwargs": {"open_think": True},
                    "grammar": 'root ::= [a-z]{3,12} "</think>" [a-z]{3,12}'})).json()
                unread = await http.post("/v1/chat/completions", json={**ask, "chat_template_kwargs": {"nope": 1}})
                # the same answer in the other two APIs: a thinking block, a reasoning item
                other = {key: ask[key] for key in ("model", "messages", "max_tokens", "temperature", "seed", "grammar")}
                claude = (await http.post("/v1/messages", json=other)).json()
                claude_streamed = await http.post("/v1/messages", json={**other, "stream": True})
                claude_off = (await http.post("/v1/messages", json={**other, "thinking": {"type": "disabled"}})).json()
                responses = {"model": MODEL, "input": "Think first.", "max_output_tokens": 60, "temperature": 1.0,
                             "seed": 11, "grammar": ask["grammar"]}
                reasoned = await http.post("/v1/responses", json=responses)
                reasoned_streamed = await http.post("/v1/responses", json={**responses, "stream": True})
                service.reasoning_format = "none"
                inline = (await http.post("/v1/chat/completions", json=ask)).json()
            await pool.aclose()
    finally:
        generator.close()
    message = whole["choices"][0]["message"]
    assert re.fullmatch("[a-z]{3,12}", message["reasoning_content"]) and re.fullmatch("[a-z]{3,12}", message["content"])
    raw = inline["choices"][0]["message"]
    assert "reasoning_content" not in raw
    assert raw["content"] == f"<think>{message['reasoning_content']}</think>\n\n{message['content']}"
    reasoning = content = ""
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    # enable_thinking false: the template closes an empty reasoning in the prompt (a longer prompt)
    assert off["usage"]["prompt_tokens"] > whole["usage"]["prompt_tokens"]
    # the prompt opened <think>: the answer starts inside the reasoning
    opened_message = opened["choices"][0]["message"]
    assert re.fullmatch("[a-z]{3,12}", opened_message["reasoning_content"])
    assert re.fullmatch("[a-z]{3,12}", opened_message["content"])
    assert unread.status_code == 400 and unread.json()["error"]["param"] == "chat_template_kwargs.nope"
    thought, said = message["reasoning_content"], message["content"]
    assert claude["content"] == [{"type": "thinking", "thinking": thought, "signature": ""}, {"type": "text", "text": said}]
    assert claude_off["usage"]["input_tokens"] == off["usage"]["prompt_tokens"]  # thinking disabled: enable_thinking
    events = [json.loads(line[6:]) for line in claude_streamed.text.splitlines() if line.startswith("data: ")]
    deltas = [event["delta"] for event in events if event["type"] == "content_block_delta"]
    assert "".join(delta.get("thinking", "") for delta in deltas) == thought
    assert "".join(delta.get("text", "") for delta in deltas) == said
    starts = [event["content_block"]["type"] for event in events if event["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert reasoned.status_code == 200, reasoned.text
    output = reasoned.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == thought and output[1]["content"][0]["text"] == said
    events = [json.loads(line[6:]) for line in reasoned_streamed.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == said
