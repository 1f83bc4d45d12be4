"""Chat templates render in skippy's sandbox exactly as llama-cpp-python renders them.

skippy renders chat templates itself (skippy/driver/chat_render.py, Jinja2 only); llama-cpp-python's
``Jinja2ChatFormatter`` (the test extra) is the reference.  The set: skippy's built-in templates and
plain transcript, the template of every vocab-only GGUF of the pinned llama.cpp tree (through
``Generator.from_model``, the driver's own path, with each vocabulary's BOS/EOS), every template
that tree collects under ``models/templates`` (Llama 3.x, Qwen, Mistral, DeepSeek, Gemma, gpt-oss,
Hermes/Functionary tool-use, ...), the real Gemma 3 model, and small templates for each feature
(``raise_exception``, ``strftime_now``, ``tojson``, the ``generation`` tag, loop controls).
Conversations include tools and an assistant tool call; where a template refuses a conversation
(roles not alternating, a template that raises) both must refuse it with the same message.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from skippy.driver.chat_render import ChatRenderer, ChatTemplateError
from skippy.driver.chat_templates import BUILTIN_CHAT_TEMPLATES, FALLBACK_CHAT_TEMPLATE

ROOT = Path(__file__).resolve().parent.parent
SOURCE_MODELS = [ROOT / "build" / "llama-src" / "models",
                 ROOT / "build" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "models"]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                       "required": ["city"]},
    },
}]

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "one-turn": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    "system-multi-turn": {"messages": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": " Bonjour ! "},
        {"role": "user", "content": "And the capital of Italy? «Roma»"},
    ]},
    "tools": {"tools": TOOLS, "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp_c\": 21}"},
    ]},
    "not-alternating": {"messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]},
}

FEATURES = {
    "raises": "{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be system') }}"
              "{% endif %}{{ messages[0]['content'] }}",
    "strftime": "Today is {{ strftime_now('%d %B %Y') }}.\n{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "tojson": "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ messages | tojson(separators=(',', ':')) }}",
    "generation-tag": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                      "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}",
    "loop-controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['role'] }};{% endfor %}",
    "tokens": "{{ bos_token }}{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}>{% endif %}",
    "trim-blocks": "{% for m in messages %}\n    {% if true %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}",
}


@functools.lru_cache(maxsize=None)
def _reference_formatter(source: str, bos: str, eos: str) -> Any:
    from skippy.reference import import_llama_cpp

    import_llama_cpp()
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    return Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos)


@functools.lru_cache(maxsize=None)
def _renderer(source: str, bos: str, eos: str) -> ChatRenderer:
    return ChatRenderer(source, bos_token=bos, eos_token=eos)


def outcome(render: Callable[[], str]) -> tuple[str, str]:
    try:
        return "text", render()
    except Exception as exc:  # noqa: BLE001 - the reference raises whatever the template raised
        return "error", str(exc)


def assert_same(source: str, bos: str, eos: str, conversation: dict[str, Any],
                ours: Callable[[], str] | None = None) -> tuple[str, str]:
    """Our rendering equals the reference's, or both refuse with the same message."""
    if ours is None:
        renderer = _renderer(source, bos, eos)
        ours = lambda: renderer.render(**json.loads(json.dumps(conversation)))  # noqa: E731
    formatter = _reference_formatter(source, bos, eos)
    for _ in range(3):  # strftime_now may tick between the two renderings: then render again
        mine = outcome(ours)
        theirs = outcome(lambda: str(formatter(**json.loads(json.dumps(conversation))).prompt))
        if mine == theirs or "strftime_now" not in source:
            break
    assert mine[0] == theirs[0], f"skippy: {mine}\nllama-cpp-python: {theirs}"
    if mine[0] == "text":
        assert mine == theirs, f"skippy:\n{mine[1]!r}\nllama-cpp-python:\n{theirs[1]!r}"
    else:
        assert theirs[1] in mine[1], f"skippy: {mine[1]}\nllama-cpp-python: {theirs[1]}"
    return mine


def _collected_templates() -> list[Path]:
    for models in SOURCE_MODELS:
        found = sorted((models / "templates").glob("*.jinja"))
        if found:
            return found
    return []


def _template_vocabs() -> list[Path]:
    from skippy.runtime.gguf_header import read_header

    for models in SOURCE_MODELS:
        found = [path for path in sorted(models.glob("ggml-vocab-*.gguf"))
                 if isinstance(read_header(path)[0].get("tokenizer.chat_template"), str)]
        if found:
            return found
    return []


TEMPLATE_FILES = _collected_templates()
TEMPLATE_VOCABS = _template_vocabs()
#: The collected templates in the fast suite (each compiles in tens of milliseconds, twice): one of each
#: family's style (tool calls in JSON, XML, Hermes and Functionary forms, thinking, harmony, refusals of
#: roles that do not alternate); every template runs in the full suite.
FAST_TEMPLATES = frozenset({
    "meta-llama-Llama-3.1-8B-Instruct", "Qwen-Qwen3-0.6B", "Qwen3-Coder", "Mistral-Small-3.2-24B-Instruct-2506",
    "deepseek-ai-DeepSeek-V3.1", "google-gemma-2-2b-it", "google-gemma-4-31B-it", "openai-gpt-oss-120b",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "meetkai-functionary-medium-v3.2",
    "CohereForAI-c4ai-command-r-plus-tool_use", "ibm-granite-granite-4.0", "microsoft-Phi-3.5-mini-instruct",
    "moonshotai-Kimi-K2", "GLM-4.6", "MiniMax-M2", "HuggingFaceTB-SmolLM3-3B", "LFM2-8B-A1B"})


def _collected(path: Path) -> Any:
    return pytest.param(path, id=path.stem, marks=() if path.stem in FAST_TEMPLATES else (pytest.mark.slow,))
#: Vocabularies whose load takes seconds (262k / 256k tokens).
LARGE_VOCABS = ("ggml-vocab-gemma-4.gguf", "ggml-vocab-command-r.gguf")


def test_the_set_is_there() -> None:
    """The pinned tree's collections are found (an empty glob would make the tests below vacuous)."""
    assert len(TEMPLATE_FILES) >= 50, SOURCE_MODELS
    assert FAST_TEMPLATES <= {path.stem for path in TEMPLATE_FILES}
    assert {path.name for path in TEMPLATE_VOCABS} >= {"ggml-vocab-qwen2.gguf", "ggml-vocab-phi-3.gguf",
                                                        "ggml-vocab-command-r.gguf", "ggml-vocab-gemma-4.gguf"}


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", [*sorted(BUILTIN_CHAT_TEMPLATES), "plain"])
def test_builtin_templates(name: str, conversation: str) -> None:
    source = FALLBACK_CHAT_TEMPLATE if name == "plain" else BUILTIN_CHAT_TEMPLATES[name]
    assert_same(source, "<s>", "</s>", CONVERSATIONS[conversation])


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("path", [_collected(path) for path in TEMPLATE_FILES])
def test_collected_templates(path: Path, conversation: str) -> None:
    assert_same(path.read_text(), "<s>", "</s>", CONVERSATIONS[conversation])


@pytest.mark.parametrize(("fast", "tools", "refusals"),
                         [(True, 12, 4), pytest.param(False, 20, 3, marks=pytest.mark.slow)], ids=["fast-templates", "all"])
def test_the_collected_templates_use_tools_and_refuse(fast: bool, tools: int, refusals: int) -> None:
    """The collection really exercises tools and refusals (not every template erroring the same way)."""
    tool_aware = refusing = 0
    for path in TEMPLATE_FILES:
        if fast and path.stem not in FAST_TEMPLATES:
            continue
        renderer = _renderer(path.read_text(), "<s>", "</s>")
        kind, text = outcome(lambda: renderer.render(**CONVERSATIONS["tools"]))
        tool_aware += kind == "text" and "get_weather" in text and "Paris" in text
        kind, _ = outcome(lambda: renderer.render(**CONVERSATIONS["not-alternating"]))
        refusing += kind == "error"
    assert tool_aware >= tools and refusing >= refusals, (tool_aware, refusing)


@pytest.mark.parametrize("path", [pytest.param(path, marks=[pytest.mark.slow] if path.name in LARGE_VOCABS else [])
                                  for path in TEMPLATE_VOCABS], ids=lambda path: path.name)
def test_vocab_gguf_templates_through_the_generator(path: Path) -> None:
    from skippy.driver.generator import Generator

    generator = Generator.from_model(path)
    try:
        assert generator.chat_template_choice.origin == "file"
        tokenizer = generator.tokenizer
        bos = tokenizer.piece(tokenizer.bos, special=True).decode() if tokenizer.bos >= 0 else ""
        eos = tokenizer.piece(tokenizer.eos, special=True).decode() if tokenizer.eos >= 0 else ""
        for conversation in CONVERSATIONS.values():
            def ours(conversation: dict[str, Any] = conversation) -> str:
                try:
                    return generator.apply_chat_template(conversation["messages"], tools=conversation.get("tools"))
                except ValueError as exc:
                    raise ChatTemplateError(str(exc)) from exc

            assert_same(generator.chat_template, bos, eos, conversation, ours)
    finally:
        generator.close()


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features(feature: str, conversation: str) -> None:
    assert_same(FEATURES[feature], "<bos>", "<eos>", CONVERSATIONS[conversation])


def test_a_template_that_raises_names_its_message() -> None:
    renderer = ChatRenderer(FEATURES["raises"])
    with pytest.raises(ChatTemplateError, match="^the first message must be system$"):
        renderer.render(CONVERSATIONS["one-turn"]["messages"])
    assert renderer.render([{"role": "system", "content": "ok"}]) == "ok"


def test_tojson_writes_unicode_and_no_html_escapes() -> None:
    text = ChatRenderer("{{ x | tojson }}").render([], x={"city": "Zürich <&>"})
    assert text == '{"city": "Zürich <&>"}'


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ messages.append(1) }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{{ c }}{% endfor %}",
])
def test_the_sandbox_refuses_internals_and_mutation(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatRenderer(source).render([{"role": "user", "content": "x"}])


def test_the_sandbox_hides_function_internals() -> None:
    assert ChatRenderer("{{ raise_exception.__globals__ }}{{ strftime_now.__code__ }}").render([]) == ""


def test_a_template_that_does_not_compile() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatRenderer("{% for m in messages %}")


def test_the_driver_needs_no_llama_cpp_python() -> None:
    """Rendering imports nothing of llama-cpp-python (a fresh interpreter, a built-in template)."""
    import subprocess
    import sys

    code = ("import sys; from skippy.driver.chat_render import ChatRenderer; "
            "from skippy.driver.chat_templates import BUILTIN_CHAT_TEMPLATES as B; "
            "print(ChatRenderer(B['chatml']).render([{'role': 'user', 'content': 'hi'}]), end=''); "
            "assert 'llama_cpp' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.real_model
def test_the_real_gemma3_model(real_model: Path) -> None:
    from skippy.driver.generator import Generator

    for name in (None, "gemma"):
        generator = Generator.from_model(real_model, chat_template=name)
        try:
            tokenizer = generator.tokenizer
            bos = tokenizer.piece(tokenizer.bos, special=True).decode()
            eos = tokenizer.piece(tokenizer.eos, special=True).decode()
            for conversation in CONVERSATIONS.values():
                assert_same(generator.chat_template, bos, eos, conversation,
                            lambda c=conversation: generator.apply_chat_template(c["messages"], tools=c.get("tools")))
        finally:
            generator.close()
