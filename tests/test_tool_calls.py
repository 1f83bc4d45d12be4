"""Tool-call parsing (skippy/api/tool_calls.py) on each family's documented output, streamed and not,
and round trips through the families' real chat templates.

The round trip renders an assistant turn holding a tool call with the family's own template (the
llama.cpp source tree's copies of the published templates, and the Gemma 4 vocabulary GGUF's),
cuts out the text the template wrote for the call, and parses it back: the parser must read
exactly what the family's models are trained to write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from skippy.api.tool_calls import (
    FORMATS,
    forcing_grammar,
    ToolCallStream,
    ToolFormat,
    detect_format,
    parse_tool_choice,
    parse_tools,
    renders_tools,
    template_messages,
)
from skippy.api.errors import ApiError

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "build" / "llama-src" / "models" / "templates"
VOCABS = ROOT / "build" / "llama-src" / "models"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}

#: (format, model output as the family documents it, content before the calls, calls)
DOCUMENTED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]),
    ("hermes", 'A<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone.', "A\nDone.", [("f", {})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3", '  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "",
     [("a", {}), ("b", {"x": 1})]),
    ("mistral-v3", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]', "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "Sure.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("gemma", '<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,metric:true,tags:[<|"|>a<|"|>,2]}'
              '<tool_call|>', "", [("get_weather", {"city": "Paris, FR", "days": 3, "metric": True, "tags": ["a", 2]})]),
    ("gemma", 'Checking.<start_function_call>call:get_weather{city:<|"|>Oslo<|"|>}<end_function_call>', "Checking.",
     [("get_weather", {"city": "Oslo"})]),
]

#: Outputs that are not calls: all of it must come back as content.
NOT_CALLS = [
    ("hermes", "The weather is fine, no <tool_call> needed... {oops"),
    ("hermes", "Plain answer with a < sign and <tool"),
    ("llama3", "Paris is sunny today. {\"name\": \"x\"} is JSON."),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("mistral", "[TOOL_CALLS]not a call"),
    ("gemma", "<|tool_call>call:get_weather{city:<|\"|>Paris"),
]


def calls_of(calls: Any) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def run_stream(format: ToolFormat, text: str, step: int, prefix: str = "") -> tuple[str, list[Any]]:
    stream = ToolCallStream(format, prefix)
    shown, calls = "", []
    for at in range(0, len(text), step):
        shown += stream.push(text[at:at + step])
        calls += stream.take_calls()
    rest, last = stream.finish()
    return shown + rest, calls + last


@pytest.mark.parametrize("name, text, content, expected", DOCUMENTED)
def test_documented_outputs_parse(name: str, text: str, content: str, expected: list[Any]) -> None:
    format = FORMATS[name]
    for step in (1, 3, len(text)):  # a character at a time, small pieces, whole
        shown, calls = run_stream(format, text, step)
        assert shown == content, step
        assert calls_of(calls) == expected, step
    ids = [call.id for call in run_stream(format, text, len(text))[1]]
    assert len(set(ids)) == len(ids) and all(ids)
    if name.startswith("mistral"):
        assert all(len(i) == 9 and i.isalnum() for i in ids)


@pytest.mark.parametrize("name, text", NOT_CALLS)
def test_text_that_is_not_a_call_comes_back_whole(name: str, text: str) -> None:
    for step in (1, 4, len(text)):
        shown, calls = run_stream(FORMATS[name], text, step)
        assert (shown, calls) == (text, [])


def test_content_streams_before_a_call_and_holds_a_partial_marker() -> None:
    stream = ToolCallStream(FORMATS["hermes"])
    assert stream.push("Hello <tool") == "Hello "
    assert stream.push("s> are fun") == "<tools> are fun"  # not a marker after all: released
    assert stream.push(" <tool_call>\n{\"name\": \"f\", ") == " "
    assert stream.push('"arguments": {}}\n</tool_call>') == ""
    assert calls_of(stream.finish()[1]) == [("f", {})]
    llama = ToolCallStream(FORMATS["llama3"])
    assert llama.push("  ") == "" and llama.push("It is {") == "  It is {"  # not at the start: content


def test_a_closed_call_is_handed_over_before_the_generation_ends() -> None:
    stream = ToolCallStream(FORMATS["hermes"])
    assert stream.push('<tool_call>\n{"name": "a", "arguments": {}}\n</tool') == ""
    assert stream.take_calls() == []
    assert stream.push("_call>\n") == ""
    assert calls_of(stream.take_calls()) == [("a", {})]
    assert stream.push("Then <tool_call>\n{\"name\": \"b\", ") == "\nThen "
    assert stream.push('"arguments": {"x": 1}}</tool_call>') == ""
    assert calls_of(stream.take_calls()) == [("b", {"x": 1})]
    assert stream.finish() == ("", [])
    gemma = ToolCallStream(FORMATS["gemma"])
    gemma.push('<|tool_call>call:f{a:1}<tool_call|>')
    assert calls_of(gemma.take_calls()) == [("f", {"a": 1})]


def test_parallel_false_keeps_the_first_call() -> None:
    text = DOCUMENTED[1][1]
    stream = ToolCallStream(FORMATS["hermes"], parallel=False)
    stream.push(text)
    assert calls_of(stream.finish()[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_forced_prefix_opens_the_call(name: str) -> None:
    format = FORMATS[name]
    documented = {"hermes": '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                  "llama3": '{"city": "Paris"}}', "mistral": '{"city": "Paris"}',
                  "mistral-v3": '{"city": "Paris"}}]', "gemma": 'city:<|"|>Paris<|"|>}<tool_call|>'}
    named = format.forced_prefix("get_weather")
    continuation = documented[name]
    if name == "hermes":
        continuation = '{"city": "Paris"}}\n</tool_call>'
    shown, calls = run_stream(format, continuation, 2, prefix=named)
    assert (shown, calls_of(calls)) == ("", [("get_weather", {"city": "Paris"})])


def test_tool_definitions_and_choice_are_checked() -> None:
    assert parse_tools({"tools": [WEATHER]})[0]["function"]["name"] == "get_weather"
    bad = [({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}},
            "tools[0].function.parameters"),
           ({"type": "function", "function": {"name": "f", "parameters": "{}"}}, "tools[0].function.parameters"),
           ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}},
            "tools[0].function.parameters.required"),
           ({"type": "function", "function": {"name": "bad name"}}, "tools[0].function.name"),
           ({"type": "custom", "custom": {"name": "f"}}, "tools[0].type"),
           ({"type": "function", "function": {"name": "f", "parameters": {
               "type": "object", "properties": {"x": {"type": "strnig"}}}}}, "tools[0].function.parameters")]
    for tool, param in bad:
        with pytest.raises(ApiError) as caught:
            parse_tools({"tools": [tool]})
        assert caught.value.status == 400 and caught.value.param == param, tool
    tools = parse_tools({"tools": [WEATHER]})
    assert parse_tool_choice({}, tools).mode == "auto"
    assert parse_tool_choice({}, ()).mode == "none"
    named = parse_tool_choice({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, tools)
    assert (named.mode, named.name) == ("required", "get_weather")
    for choice in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(ApiError) as caught:
            parse_tool_choice({"tool_choice": choice}, tools)
        assert caught.value.param == "tool_choice"
    with pytest.raises(ApiError) as caught:
        parse_tool_choice({"tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, tools)
    assert caught.value.status == 400


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral-v3"])
def test_forcing_grammars_parse_and_name_every_allowed_call(name: str) -> None:
    from skippy.api.structured import grammar_converter
    from skippy.models.cache import ensure_model
    from skippy.models.spec import demo
    from skippy.runtime.sampling import Sampler, SamplingParams
    from skippy.runtime.tokenizer import Tokenizer

    converter, fix = grammar_converter()
    tools = parse_tools({"tools": [WEATHER, {"type": "function", "function": {"name": "get_time"}}]})
    opener, grammar = forcing_grammar(FORMATS[name], tools, None, converter)
    assert opener == FORMATS[name].grammar_opener
    assert '\\"get_weather\\"' in grammar and '\\"get_time\\"' in grammar
    named = forcing_grammar(FORMATS[name], tools, "get_time", converter)
    assert named is not None and "get_weather" not in named[1]
    with Tokenizer(ensure_model(demo())) as tokenizer:  # llama.cpp parses each against a vocabulary
        for text in (grammar, named[1]):
            Sampler(SamplingParams(grammar=fix(text)), tokenizer.n_vocab, tokenizer.vocab_pointer).close()
    assert forcing_grammar(FORMATS["gemma"], tools, None, converter) is None
    assert forcing_grammar(FORMATS["mistral"], tools, None, converter) is None


# -- the families' real templates ----------------------------------------------------------------

def _template(name: str) -> str:
    if name.endswith(".gguf"):
        from skippy.runtime.gguf_header import read_header

        path = VOCABS / name
        if not path.is_file():
            pytest.skip(f"{path} not built")
        metadata, _ = read_header(path)
        return str(metadata["tokenizer.chat_template"])
    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(f"{path} not built (llama.cpp source tree)")
    return path.read_text()


def _render(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            generation_prompt: bool) -> str:
    from skippy.driver.chat_render import ChatRenderer

    return ChatRenderer(template, bos_token="<s>", eos_token="</s>").render(
        template_messages(messages), tools=tools, add_generation_prompt=generation_prompt)


FAMILIES = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-v3"),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"),
    ("ggml-vocab-gemma-4.gguf", "gemma"),
]


@pytest.mark.parametrize("template_name, format_name", FAMILIES)
def test_real_templates_render_tools_and_their_calls_parse_back(template_name: str, format_name: str) -> None:
    template = _template(template_name)
    format = detect_format(template)
    assert format is not None and format.name == format_name
    assert renders_tools(lambda messages, tools: _render(template, messages, tools, True))
    user = {"role": "user", "content": "Weather in Paris?"}
    call = {"id": "a1b2c3d4e", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    asked = _render(template, [user], [WEATHER], True)
    answered = _render(template, [user, assistant], [WEATHER], False)
    assert "get_weather" in asked
    # What the model writes: the assistant turn after the part both renderings share, up to the
    # end-of-turn token (an end-of-generation token: it ends the run and never reaches the text).
    common = len(os.path.commonprefix([asked, answered]))
    if common < len(asked):  # the generation prompt differs (Gemma 4 opens an empty thought): back to a line start
        common = asked.rfind("\n", 0, common) + 1
    assert common >= len(asked) - 40, "the assistant turn does not follow the generation prompt"
    written = answered[common:]
    for end_of_turn in ("<|eot_id|>", "<|eom_id|>", "</s>", "<|im_end|>", "<turn|>"):
        written = written.split(end_of_turn)[0]
    shown, calls = run_stream(format, written, 5)
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "days": 2})], written
    result = {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "sunny, 21 C"}
    follow_up = _render(template, [user, assistant, result], [WEATHER], True)
    assert "sunny, 21 C" in follow_up and follow_up.startswith(answered.rstrip()[: len(asked)])


def test_a_template_without_tools_is_detected() -> None:
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert not renders_tools(lambda messages, tools: _render(chatml, messages, tools, True))
    assert detect_format(chatml) is None
