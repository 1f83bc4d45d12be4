"""The choices of a chat or completions answer: the checked request, and each choice's text, tool
calls, reasoning and logprobs, whole or as stream deltas.

Strategy: :func:`skippy.api.app._parse` turns a body into a :class:`Parsed`; each choice of the
answer is a :class:`_Choice` over its :class:`~skippy.driver.generator.Generation`, which shapes the
generated text into OpenAI's message or stream deltas (tool calls parsed by
:mod:`skippy.api.tool_calls`, ``<think>`` reasoning split by :mod:`skippy.api.reasoning`, a gpt-oss
Harmony answer's channels by :mod:`skippy.api.harmony`).  The
Messages and Responses APIs reshape these deltas into their own events.  Split out of
``skippy/api/app.py`` (module size).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from skippy.api.harmony import HarmonyStream
from skippy.api.reasoning import ReasoningSplitter
from skippy.api.structured import LogprobsReport
from skippy.api.tool_calls import ToolCall, ToolCallStream, ToolFormat
from skippy.driver.generator import Generation, GenerationRequest

@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses tools: the parser's format, the forced call opening, the markers."""

    format: ToolFormat
    prefix: str
    parallel: bool
    special: frozenset[int]
    #: GBNF forcing one call (``tool_choice`` required / named; None: forced by ``prefix`` alone or not at all).
    grammar: str | None = None



@dataclasses.dataclass(frozen=True, slots=True)
class Parsed:
    """A checked request body: what to generate and how to answer."""

    request: GenerationRequest
    stream: bool
    include_usage: bool
    #: Completions ``echo``: the prompt's text, returned before the completion ('' otherwise).
    echo: str = ""
    #: Chat with tools: how the answer is split into content and tool calls (None: no tools).
    tools: ToolPlan | None = None
    #: Choices (``n``): choice ``i`` samples with seed ``seed + i``.
    n: int = 1
    #: Logprobs asked for: each choice's report starts from this one (skippy/api/structured.py).
    logprobs: LogprobsReport | None = None
    #: Choices generated: ``n``, or completions' ``best_of`` (the ``n`` best by mean token logprob are returned).
    generated: int = 1
    #: Reasoning split off the answer (skippy/api/reasoning.py): None: not; True: the prompt opened it.
    thinking: bool | None = None
    #: A Harmony (gpt-oss) answer: channels split into reasoning, content and calls (skippy/api/harmony.py).
    harmony: bool = False

    def choice_request(self, index: int) -> GenerationRequest:
        """The request of choice ``index`` (its own seed, so seeded choices differ and reproduce)."""
        if index == 0:
            return self.request
        sampling = dataclasses.replace(self.request.sampling,
                                       seed=(self.request.sampling.seed + index) & 0xFFFFFFFF)
        return dataclasses.replace(self.request, sampling=sampling)



def _usage(generations: Sequence[Generation]) -> dict[str, Any]:
    """OpenAI usage for the choices of one request: the prompt once, every choice's completion tokens
    (timings and speculation counters are the first choice's)."""
    completions = [generation.result for generation in generations if generation.result is not None]
    completion = completions[0]
    generated = sum(item.completion_tokens for item in completions)
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": completion.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
        "skippy_timing": completion.timing.as_dict(completion.completion_tokens),
        **({"skippy_resume": completion.resumes} if completion.resumes else {}),
        **({} if completion.speculation is None else {"skippy_speculation": {
            **completion.speculation.as_dict(),
            "acceptance_rate": round(completion.speculation.acceptance_rate, 4)}}),
    }


class _Choice:
    """One choice of a response: its generation, and the text / tool calls it turns into."""

    def __init__(self, index: int, generation: Generation, first: str, parsed: Parsed) -> None:
        self.index = index
        self.generation = generation
        self.text = [first]
        self.echo = parsed.echo
        plan = parsed.tools
        self.calls: list[ToolCall] = []
        self.parser = None if plan is None else ToolCallStream(plan.format, plan.prefix, parallel=plan.parallel)
        self.logprobs = None if parsed.logprobs is None else dataclasses.replace(parsed.logprobs)
        self.reasoning = None if parsed.thinking is None else ReasoningSplitter(parsed.thinking)
        #: The reasoning text of a whole (non-streamed) answer ('' when none).
        self.reasoning_text = ""
        self.harmony: HarmonyStream | None = None
        if parsed.harmony:  # one parser for reasoning and calls
            self.harmony = HarmonyStream("" if plan is None else plan.prefix,
                                         parallel=True if plan is None else plan.parallel)
            self.parser = self.reasoning = None

    def _finish_reason(self) -> str:
        result = self.generation.result
        assert result is not None
        return "tool_calls" if self.calls else result.finish_reason

    def whole(self, chat: bool) -> dict[str, Any]:
        """The non-streamed choice (the generation has finished)."""
        text = "".join(self.text)
        if not chat:
            return {"index": self.index, "text": self.echo + text, "finish_reason": self._finish_reason(),
                    "logprobs": self._logprobs(fresh=False)}
        if self.harmony is not None:
            reasoning, text, self.calls = self.harmony.push(text)
            more = self.harmony.finish()
            self.reasoning_text, text = reasoning + more[0], text + more[1]
            self.calls += more[2]
        if self.reasoning is not None:
            reasoning, text = self.reasoning.push(text)
            rest = self.reasoning.flush()
            self.reasoning_text, text = reasoning + rest[0], text + rest[1]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.harmony is not None and self.calls:
            message["content"] = text if text.strip() else None
            message["tool_calls"] = [call.as_dict() for call in self.calls]
        if self.reasoning_text:
            message["reasoning_content"] = self.reasoning_text
        if self.parser is not None:
            content = self.parser.push(text)
            self.calls = self.parser.take_calls()
            rest, calls = self.parser.finish()
            self.calls += calls
            content += rest
            message["content"] = content if content.strip() or not self.calls else None
            if self.calls:
                message["tool_calls"] = [call.as_dict() for call in self.calls]
        return {"index": self.index, "message": message, "finish_reason": self._finish_reason(),
                "logprobs": self._logprobs(fresh=False)}

    def _logprobs(self, *, fresh: bool) -> dict[str, Any] | None:
        """This choice's logprobs: all of them, or (streaming) the tokens' since the last chunk."""
        if self.logprobs is None:
            return None
        rows = self.generation.logprobs
        return self.logprobs.fresh(rows) if fresh else self.logprobs.whole(rows)

    def opening(self, chat: bool) -> list[dict[str, Any]]:
        """The first stream deltas: the role (chat), the echo, the first exchange's text."""
        out = [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}] \
            if chat else []
        if self.echo:
            out.append({"index": self.index, "text": self.echo, "finish_reason": None})
        return out + self.piece(self.text[0], chat)

    def piece(self, text: str, chat: bool) -> list[dict[str, Any]]:
        """The stream deltas for one piece of generated text."""
        if chat and self.harmony is not None:
            reasoning, text, calls = self.harmony.push(text)
            return self._reasoning_delta(reasoning) + self._deltas(text, calls)
        if chat and self.reasoning is not None:
            reasoning, text = self.reasoning.push(text)
            return self._reasoning_delta(reasoning) + self._content_deltas(text)
        return self._content_deltas(text) if chat else self._text_deltas(text)

    def _reasoning_delta(self, reasoning: str) -> list[dict[str, Any]]:
        return [{"index": self.index, "delta": {"reasoning_content": reasoning}, "finish_reason": None}] \
            if reasoning else []

    def _text_deltas(self, text: str) -> list[dict[str, Any]]:
        return [{"index": self.index, "text": text, "finish_reason": None,
                 "logprobs": self._logprobs(fresh=True)}] if text else []

    def _content_deltas(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"index": self.index, "delta": {"content": text}, "finish_reason": None,
                     "logprobs": self._logprobs(fresh=True)}] if text else []
        return self._deltas(self.parser.push(text), self.parser.take_calls())

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if content:
            out.append({"index": self.index, "delta": {"content": content}, "finish_reason": None,
                        "logprobs": self._logprobs(fresh=True)})
        for call in calls:
            out.append({"index": self.index, "delta": {"tool_calls": [call.as_dict(len(self.calls))]},
                        "finish_reason": None})
            self.calls.append(call)
        return out

    def closing(self, chat: bool) -> list[dict[str, Any]]:
        """The last stream deltas: held-back content, the tool calls not yet sent, the finish reason."""
        if not chat:
            return [{"index": self.index, "text": "", "finish_reason": self._finish_reason(),
                     "logprobs": self._logprobs(fresh=True)}]
        out: list[dict[str, Any]] = []
        if self.harmony is not None:
            reasoning, text, calls = self.harmony.finish()
            out += self._reasoning_delta(reasoning) + self._deltas(text, calls)
        if self.reasoning is not None:
            reasoning, text = self.reasoning.flush()
            out += self._reasoning_delta(reasoning) + self._content_deltas(text)
        if self.parser is not None:
            out += self._deltas(*self.parser.finish())
        out.append({"index": self.index, "delta": {}, "finish_reason": self._finish_reason(),
                    "logprobs": self._logprobs(fresh=True)})
        return out


def _mean_logprob(choice: "_Choice") -> float:
    rows = choice.generation.logprobs or []
    return sum(row.logprob for row in rows) / len(rows) if rows else float("-inf")


def _run_order(choices: list["_Choice"]) -> list["_Choice"]:
    """The order a request's choices run in: the forks first, one at a time (each is forked from
    the first choice's session, started and run to its end, which frees its session), and the
    first choice last, since its session must outlive every fork. A request with ``n`` choices
    thus holds two sessions of its lane at most, whatever ``n`` (a stage's per-lane session quota
    is 4 by default). Streamed chunks carry each choice's ``index``, so clients reassemble them."""
    return choices[1:] + choices[:1]


def _best(choices: list["_Choice"], n: int) -> list["_Choice"]:
    """Completions ``best_of``: the ``n`` choices with the highest mean token log-probability, best
    first, re-indexed (every generated choice still counts in ``usage``)."""
    ranked = sorted(choices, key=_mean_logprob, reverse=True)[:n]
    for index, choice in enumerate(ranked):
        choice.index = index
    return ranked
