r"""Built-in chat templates for GGUF files that carry no ``tokenizer.chat_template``.

Strategy: a model file's own template always wins.  When it has none, the family is detected the
way llama.cpp's ``llm_chat_detect_template`` tells its built-in formats apart, but from the
vocabulary instead of a template text: the turn markers a family was trained with are special
tokens of its vocabulary (``<start_of_turn>`` for Gemma, ``<|im_start|>`` for ChatML, ...), so a
marker that encodes to exactly one token whose special piece is the marker itself (and that
plain-text tokenization does not produce) is evidence of the family.  Markers are checked most
specific first; without any, ``general.architecture`` decides (``gemma3`` -> gemma, ``qwen3`` ->
chatml, ``llama`` -> llama-2's ``[INST]``, ...).  Each built-in is written here as Jinja producing the same text as llama.cpp's C++ formatter for that
family, without a BOS (the driver's ``encode`` adds it), so the prompt ends in the family's
assistant header and the model ends its turn with the family's end-of-turn token, which
llama.cpp's vocabulary marks as end of generation (``llama_vocab_is_eog``; e.g. Gemma's
``<end_of_turn>``).

A family's turn format is what its *instruction-tuned* models learnt; a pretrained base model
(the file names no fine-tune: ``general.finetune`` absent and no "-it"/"instruct"/"chat" in its
name) was not taught it.  Measured on the public Gemma 3 270M base GGUF: with the gemma turns it
echoes the question and never emits ``<end_of_turn>``, while the plain transcript
("user: ...\nassistant:") gives "The capital of France is Paris." and then writes the next
"\nuser:" line.  So a base model gets the plain transcript plus the stop strings that end its
turn there (:attr:`ChatTemplateChoice.stop`, merged into chat requests by the driver), and the
built-in family template only when asked for by name.  Unknown families get the plain transcript
too.  :meth:`ChatTemplateChoice.describe` is the log line saying which and why.

The templates are rendered by :class:`skippy.driver.chat_render.ChatRenderer` (``trim_blocks`` and
``lstrip_blocks`` on), so every piece of output below is an explicit ``{{- ... -}}`` expression
and newlines come only from string literals.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Final, Literal, Mapping, Protocol, final

__all__ = [
    "BUILTIN_CHAT_TEMPLATES",
    "FALLBACK_CHAT_TEMPLATE",
    "PLAIN_TRANSCRIPT_STOP",
    "ChatTemplateChoice",
    "choose_chat_template",
    "detect_family",
    "looks_instruction_tuned",
    "special_token_probe",
]

#: Used when a model has no ``tokenizer.chat_template`` and its family is unknown: "role: content" lines.
FALLBACK_CHAT_TEMPLATE: Final = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

#: Where a turn of the plain transcript ends: the model starting the next one.
PLAIN_TRANSCRIPT_STOP: Final = ("\nuser:", "\nassistant:")

# Gemma (1, 2, 3): no system role (a system message is prefixed to the next user turn), the
# assistant is "model", contents trimmed.
_GEMMA: Final = r"""
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- set ns.system = ns.system + (message['content'] | trim) -%}
  {%- else -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' + role + '\n' -}}
    {%- if ns.system and role != 'model' -%}
      {{- ns.system + '\n\n' -}}
      {%- set ns.system = '' -%}
    {%- endif -%}
    {{- (message['content'] | trim) + '<end_of_turn>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

_CHATML: Final = r"""
{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

_LLAMA3: Final = r"""
{%- for message in messages -%}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim)
      + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# Llama 2 chat with a <<SYS>> block (llama.cpp's "llama2-sys"); the turn opener is written
# before the first message, so the generation prompt is already in place after a user turn.
_LLAMA2: Final = r"""
{%- set ns = namespace(inside=true) -%}
{{- '[INST] ' -}}
{%- for message in messages -%}
  {%- if not ns.inside -%}{{- '[INST] ' -}}{%- set ns.inside = true -%}{%- endif -%}
  {%- if message['role'] == 'system' -%}
    {{- '<<SYS>>\n' + message['content'] + '\n<</SYS>>\n\n' -}}
  {%- elif message['role'] == 'user' -%}
    {{- message['content'] + ' [/INST]' -}}
  {%- else -%}
    {{- message['content'] + '</s>' -}}
    {%- set ns.inside = false -%}
  {%- endif -%}
{%- endfor -%}
"""

# Mistral v7 with the Tekken tokenizer (Mistral Small 3.x, ``mistral3``): system prompts tokens.
_MISTRAL_V7: Final = r"""
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' -}}
  {%- elif message['role'] == 'user' -%}
    {{- '[INST]' + message['content'] + '[/INST]' -}}
  {%- else -%}
    {{- message['content'] + '</s>' -}}
  {%- endif -%}
{%- endfor -%}
"""

# Mistral v3 (``[INST]`` tokens, no system-prompt tokens): a system message opens the user turn.
_MISTRAL_V3: Final = r"""
{%- set ns = namespace(inside=false) -%}
{%- for message in messages -%}
  {%- if not ns.inside -%}{{- '[INST] ' -}}{%- set ns.inside = true -%}{%- endif -%}
  {%- if message['role'] == 'system' -%}
    {{- message['content'] + '\n\n' -}}
  {%- elif message['role'] == 'user' -%}
    {{- message['content'] + '[/INST]' -}}
  {%- else -%}
    {{- ' ' + (message['content'] | trim) + '</s>' -}}
    {%- set ns.inside = false -%}
  {%- endif -%}
{%- endfor -%}
"""

_PHI3: Final = r"""
{%- for message in messages -%}
  {{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}
"""

# IBM Granite 3.x.
_GRANITE: Final = r"""
{%- for message in messages -%}
  {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}
"""

# GLM-4 / GLM-4.5 (llama.cpp's "chatglm4").
_GLM4: Final = r"""
{{- '[gMASK]<sop>' -}}
{%- for message in messages -%}
  {{- '<|' + message['role'] + '|>\n' + message['content'] -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}
"""

# gpt-oss (Harmony): an assistant turn ends in <|return|>, every other one in <|end|>.
_GPT_OSS: Final = r"""
{%- for message in messages -%}
  {{- '<|start|>' + message['role'] + '<|message|>' + message['content'] -}}
  {{- '<|return|>' if message['role'] == 'assistant' else '<|end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

#: Built-in templates by family name (llama.cpp's names where it has one).
BUILTIN_CHAT_TEMPLATES: Final[Mapping[str, str]] = {
    "gemma": _GEMMA.strip(),
    "chatml": _CHATML.strip(),
    "llama3": _LLAMA3.strip(),
    "llama2": _LLAMA2.strip(),
    "mistral-v7-tekken": _MISTRAL_V7.strip(),
    "mistral-v3": _MISTRAL_V3.strip(),
    "phi3": _PHI3.strip(),
    "granite": _GRANITE.strip(),
    "glm4": _GLM4.strip(),
    "gpt-oss": _GPT_OSS.strip(),
}

# Vocabulary evidence, most specific first: (family, markers that must all be special tokens).
_MARKERS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("gemma", ("<start_of_turn>", "<end_of_turn>")),
    ("gpt-oss", ("<|start|>", "<|channel|>", "<|message|>")),
    ("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    ("granite", ("<|start_of_role|>", "<|end_of_role|>")),
    ("glm4", ("[gMASK]", "<sop>", "<|assistant|>")),
    ("chatml", ("<|im_start|>", "<|im_end|>")),
    ("phi3", ("<|assistant|>", "<|end|>")),
    ("mistral-v7-tekken", ("[INST]", "[/INST]", "[SYSTEM_PROMPT]")),
    ("mistral-v3", ("[INST]", "[/INST]")),
)

# ``general.architecture`` -> family, when the vocabulary has no marker.
_ARCHITECTURES: Final[Mapping[str, str]] = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma", "gemma-embedding": "gemma",
    "qwen": "chatml", "qwen2": "chatml", "qwen3": "chatml", "qwen2moe": "chatml", "qwen3moe": "chatml",
    "olmo2": "chatml",
    "llama": "llama2",
    "phi3": "phi3",
    "mistral3": "mistral-v7-tekken",
    "granite": "granite", "granitemoe": "granite",
    "glm4": "glm4", "glm4moe": "glm4",
    "gpt-oss": "gpt-oss",
}

#: "given": a template file the operator named (``--chat-template FILE``).
Origin = Literal["file", "built-in", "fallback", "given"]


@final
@dataclasses.dataclass(frozen=True, slots=True)
class ChatTemplateChoice:
    """Which chat template a model is served with, and why."""

    #: "file" for the GGUF's own, else a key of :data:`BUILTIN_CHAT_TEMPLATES`, else "plain".
    name: str
    #: The Jinja source.
    source: str
    origin: Origin
    #: What the choice rests on ("vocabulary has <start_of_turn>", "architecture gemma3", ...).
    reason: str = ""
    #: Stop strings that end an assistant turn in this format (chat requests only).
    stop: tuple[str, ...] = ()

    def describe(self) -> str:
        """One log line, e.g. ``chat template: built-in gemma (file has none; ...)``."""
        if self.origin == "file":
            return "chat template: the file's own (tokenizer.chat_template)"
        if self.origin == "given":
            return f"chat template: {self.reason}"
        if self.origin == "built-in":
            return f"chat template: built-in {self.name} (file has none; {self.reason})"
        stops = ", ".join(repr(stop) for stop in self.stop)
        return f"chat template: plain 'role: content' lines, turns end at {stops} (file has none; {self.reason})"


def detect_family(architecture: str | None, has_special_token: Callable[[str], bool]) -> tuple[str, str] | None:
    """The built-in family for a model without a template: (name, reason), or None when unknown.

    Args:
        architecture: ``general.architecture`` (None when absent).
        has_special_token: whether the vocabulary has this text as one special token.
    """
    for family, markers in _MARKERS:
        if all(has_special_token(marker) for marker in markers):
            return family, f"vocabulary has {markers[0]}"
    if architecture is not None and architecture in _ARCHITECTURES:
        return _ARCHITECTURES[architecture], f"architecture {architecture}"
    return None


class _Vocabulary(Protocol):
    """What :func:`choose_chat_template` needs of a tokenizer (skippy.runtime.Tokenizer fits)."""

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...

    def piece(self, token: int, *, special: bool = False) -> bytes: ...


def special_token_probe(tokenizer: _Vocabulary) -> Callable[[str], bool]:
    """A ``has_special_token`` for :func:`detect_family` over a tokenizer."""

    def has_special_token(text: str) -> bool:
        tokens = tokenizer.encode(text, add_special=False, parse_special=True)
        if len(tokens) != 1 or tokenizer.piece(tokens[0], special=True) != text.encode("utf-8"):
            return False
        # ordinary text that happens to be one token (a word, a letter) is no marker
        return tokenizer.encode(text, add_special=False, parse_special=False) != tokens

    return has_special_token


_TUNED = re.compile(r"(?:^|[^a-z0-9])(?:it|instruct|instruction|chat|sft|dpo|rlhf|assistant)(?:[^a-z0-9]|$)",
                    re.IGNORECASE)


def looks_instruction_tuned(metadata: Mapping[str, object]) -> bool:
    """Whether the GGUF names an instruction/chat fine-tune (``general.finetune``, else its name)."""
    finetune = metadata.get("general.finetune")
    if isinstance(finetune, str) and finetune.strip():
        return bool(_TUNED.search(finetune))
    names = [metadata.get(key) for key in ("general.name", "general.basename")]
    return any(isinstance(name, str) and bool(_TUNED.search(name)) for name in names)


def choose_chat_template(metadata: Mapping[str, object], tokenizer: _Vocabulary,
                         name: str | None = None) -> ChatTemplateChoice:
    """The template to serve a model with: the file's own, its family's built-in, or the plain transcript.

    Args:
        metadata: the GGUF's scalar metadata (``skippy.runtime.gguf_header.read_header``).
        tokenizer: the model's vocabulary.
        name: a key of :data:`BUILTIN_CHAT_TEMPLATES` (or "plain") to use whatever the file says;
            None chooses as the module header describes.

    Raises:
        ValueError: ``name`` is not a built-in template.
    """
    if name is not None:
        if name == "plain":
            return ChatTemplateChoice("plain", FALLBACK_CHAT_TEMPLATE, "fallback", "asked for by name",
                                      PLAIN_TRANSCRIPT_STOP)
        if name not in BUILTIN_CHAT_TEMPLATES:
            raise ValueError(f"unknown chat template {name!r} (built-in: {', '.join(BUILTIN_CHAT_TEMPLATES)}, plain)")
        return ChatTemplateChoice(name, BUILTIN_CHAT_TEMPLATES[name], "built-in", "asked for by name")
    own = metadata.get("tokenizer.chat_template")
    if isinstance(own, str) and own.strip():
        return ChatTemplateChoice("file", own, "file")
    architecture = metadata.get("general.architecture")
    arch = architecture if isinstance(architecture, str) else None
    found = detect_family(arch, special_token_probe(tokenizer))
    if found is None:
        return ChatTemplateChoice("plain", FALLBACK_CHAT_TEMPLATE, "fallback",
                                  f"no built-in for architecture {arch}", PLAIN_TRANSCRIPT_STOP)
    family, reason = found
    if not looks_instruction_tuned(metadata):
        return ChatTemplateChoice(
            "plain", FALLBACK_CHAT_TEMPLATE, "fallback",
            f"a {arch} base model: no fine-tune named; its family's {family} turns are for tuned models",
            PLAIN_TRANSCRIPT_STOP)
    return ChatTemplateChoice(family, BUILTIN_CHAT_TEMPLATES[family], "built-in", reason)
