"""Built-in chat templates (skippy/driver/chat_templates.py): each family's Jinja renders exactly
what llama.cpp's own C++ formatter writes for that family (``llama_chat_apply_template`` with
the built-in's name, through llama-cpp-python on our libllama); family detection from vocabulary
markers and ``general.architecture``; the choice rules (file first, base models get the plain
transcript and its stop strings, names override); end of generation at each family's
end-of-turn token in the real vocabularies we ship; the log line.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, Iterator

import pytest

from skippy.driver.chat_templates import (
    BUILTIN_CHAT_TEMPLATES,
    FALLBACK_CHAT_TEMPLATE,
    PLAIN_TRANSCRIPT_STOP,
    choose_chat_template,
    detect_family,
    looks_instruction_tuned,
    special_token_probe,
)

#: Our family name -> llama.cpp's built-in template name (src/llama-chat.cpp LLM_CHAT_TEMPLATES).
LLAMA_CPP_NAMES = {
    "gemma": "gemma", "chatml": "chatml", "llama3": "llama3", "llama2": "llama2-sys",
    "mistral-v7-tekken": "mistral-v7-tekken", "mistral-v3": "mistral-v3", "phi3": "phi3",
    "granite": "granite", "glm4": "chatglm4", "gpt-oss": "gpt-oss",
}

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi there\n"}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": " Bonjour ! "},
     {"role": "user", "content": "And the capital of Italy?"}],
]


def render(source: str, messages: list[dict[str, str]]) -> str:
    """The prompt the driver builds (skippy.driver.chat_render, as Generator uses it)."""
    from skippy.driver.chat_render import ChatRenderer

    return ChatRenderer(source, eos_token="</s>", bos_token="<s>").render(messages)


def llama_cpp_format(name: str, messages: list[dict[str, str]]) -> str:
    """llama.cpp's own C++ formatting of ``messages`` with its built-in template ``name``."""
    from skippy.reference import import_llama_cpp

    low = import_llama_cpp().llama_cpp
    chat = (low.llama_chat_message * len(messages))(
        *(low.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages))
    size = 4096
    buffer = ctypes.create_string_buffer(size)
    written = low.llama_chat_apply_template(name.encode(), chat, len(messages), True, buffer, size)
    assert 0 <= written < size, f"llama_chat_apply_template({name!r}) returned {written}"
    return buffer.raw[:written].decode()


def test_every_family_has_a_llama_cpp_counterpart() -> None:
    assert set(BUILTIN_CHAT_TEMPLATES) == set(LLAMA_CPP_NAMES)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("family", sorted(BUILTIN_CHAT_TEMPLATES))
def test_builtin_renders_what_llama_cpp_writes(family: str, conversation: int) -> None:
    messages = CONVERSATIONS[conversation]
    assert render(BUILTIN_CHAT_TEMPLATES[family], messages) == llama_cpp_format(LLAMA_CPP_NAMES[family], messages)


def test_gemma_prompt_ends_in_the_model_turn() -> None:
    text = render(BUILTIN_CHAT_TEMPLATES["gemma"], CONVERSATIONS[1])
    assert text == "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"


def test_the_plain_transcript() -> None:
    assert render(FALLBACK_CHAT_TEMPLATE, CONVERSATIONS[0]) == "user: What is the capital of France?\nassistant:"


# Vocabulary markers of each family as its tokenizer has them (subsets of the real special tokens).
VOCABULARIES: dict[str, set[str]] = {
    "gemma": {"<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>"},
    "gpt-oss": {"<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|endoftext|>"},
    "llama3": {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"},
    "granite": {"<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"},
    "glm4": {"[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"},
    "chatml": {"<|im_start|>", "<|im_end|>", "<|endoftext|>"},
    "phi3": {"<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|endoftext|>"},
    "mistral-v7-tekken": {"[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "</s>"},
    "mistral-v3": {"[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "</s>"},
}


@pytest.mark.parametrize("family", sorted(VOCABULARIES))
def test_family_detected_from_vocabulary_markers(family: str) -> None:
    found = detect_family("some-new-arch", VOCABULARIES[family].__contains__)
    assert found is not None and found[0] == family


@pytest.mark.parametrize("architecture, family", [
    ("gemma3", "gemma"), ("gemma2", "gemma"), ("qwen2", "chatml"), ("qwen3", "chatml"), ("qwen3moe", "chatml"),
    ("qwen2moe", "chatml"), ("llama", "llama2"), ("phi3", "phi3"), ("mistral3", "mistral-v7-tekken"),
    ("granite", "granite"), ("glm4", "glm4"), ("glm4moe", "glm4"), ("gpt-oss", "gpt-oss"),
])
def test_family_from_architecture_when_the_vocabulary_has_no_marker(architecture: str, family: str) -> None:
    assert detect_family(architecture, lambda text: False) == (family, f"architecture {architecture}")


def test_markers_win_over_the_architecture() -> None:
    # a llama-architecture file with the llama-3 tokenizer is llama-3 chat, not llama-2
    assert detect_family("llama", VOCABULARIES["llama3"].__contains__) == ("llama3", "vocabulary has <|start_header_id|>")
    assert detect_family("unknown-arch", lambda text: False) is None
    assert detect_family(None, lambda text: False) is None


class FakeVocabulary:
    """Special tokens as whole ids; any other text as one id per character."""

    def __init__(self, specials: set[str]) -> None:
        self.specials = sorted(specials)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if parse_special and text in self.specials:
            return [100_000 + self.specials.index(text)]
        return [ord(character) for character in text]

    def piece(self, token: int, *, special: bool = False) -> bytes:
        if token >= 100_000:
            return self.specials[token - 100_000].encode() if special else b""
        return chr(token).encode()


def test_special_token_probe() -> None:
    probe = special_token_probe(FakeVocabulary({"<start_of_turn>"}))
    assert probe("<start_of_turn>") and not probe("<end_of_turn>") and not probe("a")


@pytest.mark.parametrize("metadata, tuned", [
    ({"general.finetune": "it"}, True),
    ({"general.finetune": "Instruct"}, True),
    ({"general.finetune": "chat-v2"}, True),
    ({"general.finetune": "base"}, False),
    ({"general.name": "Qwen2.5 0.5B Instruct"}, True),
    ({"general.name": "gemma-3-270m-it"}, True),
    ({"general.name": "Gemma 3 270m", "general.basename": "gemma-3"}, False),
    ({"general.name": "Italian Llama"}, False),
    ({}, False),
])
def test_looks_instruction_tuned(metadata: dict[str, object], tuned: bool) -> None:
    assert looks_instruction_tuned(metadata) is tuned


def test_the_files_own_template_wins() -> None:
    choice = choose_chat_template({"tokenizer.chat_template": "{{ x }}", "general.architecture": "gemma3"},
                                  FakeVocabulary(VOCABULARIES["gemma"]))
    assert (choice.origin, choice.source, choice.stop) == ("file", "{{ x }}", ())
    assert choice.describe() == "chat template: the file's own (tokenizer.chat_template)"


def test_a_tuned_model_without_a_template_gets_its_familys() -> None:
    metadata = {"general.architecture": "gemma3", "general.finetune": "it"}
    choice = choose_chat_template(metadata, FakeVocabulary(VOCABULARIES["gemma"]))
    assert (choice.name, choice.origin, choice.stop) == ("gemma", "built-in", ())
    assert choice.source == BUILTIN_CHAT_TEMPLATES["gemma"]
    assert choice.describe() == "chat template: built-in gemma (file has none; vocabulary has <start_of_turn>)"


def test_a_base_model_gets_the_plain_transcript_and_its_stops() -> None:
    metadata = {"general.architecture": "gemma3", "general.name": "Gemma 3 270m"}
    choice = choose_chat_template(metadata, FakeVocabulary(VOCABULARIES["gemma"]))
    assert (choice.name, choice.origin, choice.stop) == ("plain", "fallback", PLAIN_TRANSCRIPT_STOP)
    assert "gemma3 base model" in choice.describe() and "'\\nuser:'" in choice.describe()


def test_an_unknown_family_gets_the_plain_transcript() -> None:
    choice = choose_chat_template({"general.architecture": "mamba", "general.finetune": "it"}, FakeVocabulary(set()))
    assert (choice.name, choice.stop) == ("plain", PLAIN_TRANSCRIPT_STOP)
    assert "no built-in for architecture mamba" in choice.describe()


def test_a_template_named_is_used_whatever_the_file_says() -> None:
    metadata = {"tokenizer.chat_template": "{{ x }}", "general.architecture": "gemma3"}
    assert choose_chat_template(metadata, FakeVocabulary(set()), "chatml").source == BUILTIN_CHAT_TEMPLATES["chatml"]
    assert choose_chat_template(metadata, FakeVocabulary(set()), "plain").stop == PLAIN_TRANSCRIPT_STOP
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        choose_chat_template(metadata, FakeVocabulary(set()), "nope")


# --- the real vocabularies (vocab-only GGUFs of the native build, and the real model) -------------

def _vocab(name: str) -> Path:
    from skippy.models.vocab_files import vocab_path

    return vocab_path(name)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tokenizers() -> Iterator[dict[str, Any]]:
    from skippy.runtime.tokenizer import Tokenizer

    opened = {name: Tokenizer(_vocab(name)) for name in ("llama-spm", "llama-bpe", "qwen2")}
    yield opened
    for tokenizer in opened.values():
        tokenizer.close()


@pytest.mark.parametrize("vocab, family, end_of_turn", [
    ("llama-bpe", "llama3", "<|eot_id|>"),
    ("qwen2", "chatml", "<|im_end|>"),
])
def test_real_vocabularies_detect_their_family_and_end_at_its_turn_end(
        tokenizers: dict[str, Any], vocab: str, family: str, end_of_turn: str) -> None:
    tokenizer = tokenizers[vocab]
    found = detect_family("llama", special_token_probe(tokenizer))
    assert found is not None and found[0] == family
    (token,) = tokenizer.encode(end_of_turn, add_special=False, parse_special=True)
    assert tokenizer.is_end_of_generation(token)


def test_the_spm_vocabulary_has_no_marker(tokenizers: dict[str, Any]) -> None:
    assert detect_family("llama", special_token_probe(tokenizers["llama-spm"])) == ("llama2", "architecture llama")


def test_generator_logs_its_choice_and_merges_the_stops(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    from skippy.driver.generator import Generator

    with caplog.at_level(logging.INFO, logger="skippy.driver.generator"):
        generator = Generator.from_model(tiny_llama)
    try:
        assert generator.chat_template_choice.stop == PLAIN_TRANSCRIPT_STOP
        assert generator.chat_stop(("STOP", "\nuser:")) == ("STOP", "\nuser:", "\nassistant:")
        assert any("chat template: plain 'role: content' lines" in record.getMessage() for record in caplog.records)
    finally:
        generator.close()
    named = Generator.from_model(tiny_llama, chat_template="llama2")
    try:
        assert named.apply_chat_template([{"role": "user", "content": "hi"}]) == "[INST] hi [/INST]"
        assert named.chat_stop() == ()
    finally:
        named.close()


@pytest.mark.real_model
def test_gemmas_end_of_turn_ends_generation_in_the_real_vocabulary(real_model: Path) -> None:
    from skippy.runtime.tokenizer import Tokenizer

    with Tokenizer(real_model) as tokenizer:
        (token,) = tokenizer.encode("<end_of_turn>", add_special=False, parse_special=True)
        assert tokenizer.is_end_of_generation(token)
        found = detect_family("gemma3", special_token_probe(tokenizer))
    assert found == ("gemma", "vocabulary has <start_of_turn>")
