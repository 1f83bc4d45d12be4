"""``Generator``: text in, text out, over one :class:`StageClient` lane.

Strategy: the driver holds only the model's vocabulary (a vocab-only load) and its chat template,
read from the GGUF header; the weights live in the stages.  One request is one session on the
chain: ConfigureGeneration carries the request's sampling (the final stage samples), the prompt
goes down as prefill chunks pipelined under the lane's reply credits, then one DecodeEmbd per
token until ``max_tokens``, an end-of-generation token or a stop string; Stop releases the
session's KV on every stage.

A run is a :class:`Generation`, an async *iterator object* (not an async generator function), so
no cancel scope ever spans a ``yield`` and an abandoned run leaves no frame to finalize: each
``__anext__`` performs one exchange with the chain and returns the text that exchange completed.
Text is detokenized incrementally (a multi-byte UTF-8 character split across tokens is held back
until complete) and any tail that could still become a stop string is held back too, so streamed
text never contains a stop string or a partial character and always concatenates to the final
text.

Speculative decoding (opt in/out per request, ``GenerationRequest.speculation``; the default is
``Generator.speculation``, applied to greedy requests only): after the prefill a
:class:`SpeculativeDecoder` drafts from the request's own context and a :class:`SpeculativeRunner`
keeps verify windows in flight on the lane; one exchange may then commit several tokens, which go
through the same EOG / stop-string / ``max_tokens`` checks one by one.  At the end the runner
trims every stage to the KV length the plain loop would leave.  Requests with repetition /
frequency / presence penalties never speculate (the stage's sampler history is not rolled back).
The Generator counts the requests running (:class:`SessionLoad`); a window's controller weighs
what its drafts cost the others in the stages' batches, so under load speculation stays off
(docs/throughput.md): a request that finds the chain busy ends its speculation between windows
and decodes on as a plain request (a decode run, direct return).  So does a request alone on the
chain whose proposer offered no draft for ``IDLE_STEPS`` steps in a row; its decoder follows the
plain path's tokens and, once it would start an epoch worth it, the decode run is ended (a
TrimSession) and the request speculates again (docs/throughput.md).  Timings come from the clock
here (TTFT, inter-token gaps) and from the reply stats the stages fill in on the way back (compute /
forward-write / downstream-wait microseconds summed over the stages, with the stage count).
"""

from __future__ import annotations

import dataclasses
import math
import logging
import time
from pathlib import Path

import trio
from typing import Any, Callable, Iterable, Mapping, Sequence, final

from skippy.codec.protocol import LogitBias, SamplingConfig, StageReply
from skippy.codec.protocol_ext import (
    SAMPLING_EXTENSION_FLAG, SamplingRequest, TimingRecord, TimingsFrame, TokenLogprobs,
)
from skippy.driver import prefix
from skippy.driver.chat_render import ChatRenderer, ChatTemplateError
from skippy.driver.chat_templates import FALLBACK_CHAT_TEMPLATE as FALLBACK_CHAT_TEMPLATE  # re-exported
from skippy.driver.chat_templates import PLAIN_TRANSCRIPT_STOP, ChatTemplateChoice, choose_chat_template
from skippy.driver.client import StageClient, StageClientError, StageLost, StageRemoteError
from skippy.driver.prefill_chunking import PrefillChunker, observation_from
from skippy.driver.speculation.controller import ControllerConfig, SessionLoad, speculation_pays
from skippy.driver.speculation.decoder import (
    IDLE_STEPS, RUN_CHUNK_MAX, RUN_CHUNK_MIN, SpeculationConfig, SpeculativeDecoder,
)
from skippy.driver.speculation.runner import SpeculativeRunner
from skippy.driver.speculation.window import SpeculationUsage
from skippy.net.address import Address
from skippy.runtime.gguf_header import read_header
from skippy.runtime.layer_kinds import rolls_back
from skippy.runtime.sampling import GREEDY, SamplingParams
from skippy.runtime.tokenizer import TextStream, Tokenizer

log = logging.getLogger(__name__)


#: Speculation default for greedy requests (see docs/speculation.md for the benchmark behind it).
DEFAULT_SPECULATION = True


class ContextOverflow(ValueError):
    """The prompt (plus the tokens asked for) does not fit the chain's context."""


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One completion: prompt tokens and when to stop.

    ``max_tokens`` counts sampled tokens (an end-of-generation token ends the run and is not
    counted); ``stop`` strings end it as soon as one appears in the text (the stop string itself
    is not returned).
    """

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    #: Speculative decoding: True / False, or None for the generator's default (greedy only).
    speculation: bool | None = None
    #: Prefix KV cache: False opts out (no lookup, no record); None: the generator's default.
    prefix_cache: bool | None = None
    #: Cache tenant (``prompt_cache_key``, else ``user``); None: the shared default namespace.
    cache_namespace: str | None = None
    #: Tokens whose special text appears in the output (e.g. a tool-call marker that is a control token).
    render_special: frozenset[int] = frozenset()
    #: GBNF grammar every sampled token follows (structured output; None: unconstrained).
    grammar: str | None = None
    #: Log-probabilities per sampled token with this many alternatives (None: not reported).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("the prompt has no tokens")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {self.max_tokens})")

    @property
    def sampling_extension(self) -> SamplingRequest | None:
        """What the final stage must install for this request (docs/protocol.md §10), if anything."""
        if self.grammar is None and self.logprobs is None:
            return None
        return SamplingRequest(grammar=self.grammar, logprobs=self.logprobs)


@dataclasses.dataclass(slots=True)
class StageTiming:
    """One stage's share of a request: sums over the replies that passed through it."""

    stage_index: int
    layer_start: int
    layer_end: int
    replies: int = 0
    compute_us: int = 0
    forward_write_us: int = 0
    downstream_wait_us: int = 0
    queue_wait_us: int = 0
    max_batch_size: int = 0

    def add(self, record: TimingRecord) -> None:
        self.replies += 1
        self.compute_us += record.compute_us
        self.forward_write_us += record.forward_write_us
        self.downstream_wait_us += record.downstream_wait_us
        self.queue_wait_us += record.queue_wait_us
        self.max_batch_size = max(self.max_batch_size, record.batch_size)

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage_index,
            "layers": f"{self.layer_start}:{self.layer_end}",
            "compute_ms": round(self.compute_us / 1000, 3),
            "forward_write_ms": round(self.forward_write_us / 1000, 3),
            "downstream_wait_ms": round(self.downstream_wait_us / 1000, 3),
            "queue_wait_ms": round(self.queue_wait_us / 1000, 3),
            "max_batch_size": self.max_batch_size,
        }


@dataclasses.dataclass(slots=True)
class Timing:
    """Where one request's time went.  Stage sums cover every stage of the chain."""

    prompt_tokens: int = 0
    #: Seconds from the first message to the first sampled token.
    time_to_first_token: float = 0.0
    #: Seconds from the first token to the last one.
    decode_seconds: float = 0.0
    #: Seconds between consecutive tokens (one entry per decode step).
    inter_token: list[float] = dataclasses.field(default_factory=list)
    #: Replies that carried per-stage timings, and the most stages one of them covered.
    replies: int = 0
    stage_count: int = 0
    #: The chain's stages as far as the replies show: the deepest stage index seen, plus one.  It
    #: differs from :attr:`stage_count` under direct return (docs/protocol.md §8), where a
    #: prediction's Timings frame holds the final stage's record only, but that record's index
    #: still counts the chain.
    chain_stages: int = 0
    compute_us: int = 0
    forward_write_us: int = 0
    downstream_wait_us: int = 0
    #: Totals per stage index (from the chain's Timings frames, docs/protocol.md §4).
    stages: dict[int, StageTiming] = dataclasses.field(default_factory=dict)

    def add_frames(self, frames: Iterable[TimingsFrame], *, totals: bool = False) -> None:
        """Account the per-stage records of replies (``StageClient.take_timings()``).

        ``totals``: the frames came with a Stop's ACK; under direct return (docs/protocol.md §8)
        they hold the upstream stages' totals over the session's flagged messages, which no
        reply carried.  They add to the stage sums but count no reply.
        """
        for frame in frames:
            if not totals:
                self.replies += 1
                self.stage_count = max(self.stage_count, len(frame.records))
            for record in frame.records:
                self.chain_stages = max(self.chain_stages, record.stage_index + 1)
                self.compute_us += record.compute_us
                self.forward_write_us += record.forward_write_us
                self.downstream_wait_us += record.downstream_wait_us
                stage = self.stages.get(record.stage_index)
                if stage is None:
                    stage = self.stages[record.stage_index] = StageTiming(
                        record.stage_index, record.layer_start, record.layer_end)
                stage.add(record)
        if totals:
            self.stage_count = max(self.stage_count, len(self.stages))

    def decode_tokens_per_second(self, completion_tokens: int) -> float:
        steps = completion_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    def mean_stage_compute_ms(self) -> float:
        """Mean compute of one stage for one reply (milliseconds)."""
        if not self.replies or not self.stage_count:
            return 0.0
        return self.compute_us / self.replies / self.stage_count / 1000.0

    def as_dict(self, completion_tokens: int) -> dict[str, Any]:
        """The JSON form (the API's ``usage.skippy_timing`` extension)."""
        return {
            "time_to_first_token_ms": round(self.time_to_first_token * 1000, 3),
            "decode_ms": round(self.decode_seconds * 1000, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second(completion_tokens), 3),
            "stage_count": self.stage_count,
            "stage_compute_ms": round(self.compute_us / 1000, 3),
            "stage_forward_write_ms": round(self.forward_write_us / 1000, 3),
            "stage_downstream_wait_ms": round(self.downstream_wait_us / 1000, 3),
            "mean_stage_compute_ms_per_token": round(self.mean_stage_compute_ms(), 3),
            "stages": [self.stages[index].as_dict() for index in sorted(self.stages)],
        }

    def summary(self, completion_tokens: int) -> str:
        """One line for a terminal."""
        return (f"prompt {self.prompt_tokens} tokens, TTFT {self.time_to_first_token * 1000:.1f} ms; "
                f"{completion_tokens} tokens at {self.decode_tokens_per_second(completion_tokens):.1f} tok/s; "
                f"stage compute {self.compute_us / 1000:.1f} ms over {self.stage_count} stages "
                f"({self.mean_stage_compute_ms():.2f} ms per stage per token)")


@dataclasses.dataclass(slots=True)
class Completion:
    """The outcome of a finished :class:`Generation`."""

    text: str
    tokens: list[int]
    #: "stop" (end-of-generation token or stop string) or "length" (max_tokens reached).
    finish_reason: str
    prompt_tokens: int
    timing: Timing
    #: Speculation counters (None: the request did not speculate).
    speculation: SpeculationUsage | None = None
    #: Prompt tokens restored from the prefix cache (``usage.prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0
    #: One entry per token of ``tokens`` when the request asked for logprobs (else None).
    logprobs: list[TokenLogprobs] | None = None
    #: The stop string that ended the text (None: an end-of-generation token, max_tokens, or none).
    stop_string: str | None = None
    #: docs/protocol.md §14: one entry per stage lost and resumed during the run
    #: (``usage.skippy_resume``): the stage, how the chain resumed, and how long it took.
    resumes: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


def sampling_config(params: SamplingParams) -> SamplingConfig:
    """The wire sampling section for ``params`` (always enabled; temperature 0 means greedy)."""
    return SamplingConfig(
        flags=1, seed=params.seed, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repeat_penalty=params.repeat_penalty,
        penalty_last_n=params.penalty_last_n,
        logit_bias=tuple(LogitBias(token, bias) for token, bias in params.logit_bias),
    )


class _StopMatcher:
    """Holds back text that could still turn into a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.pending = ""
        #: The stop string found (the earliest in the text; None until one is).
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        found = [(index, stop) for index, stop in ((self.pending.find(stop), stop) for stop in self.stops)
                 if index >= 0]
        if found:
            index, self.matched = min(found, key=lambda item: item[0])
            out = self.pending[:index]
            self.pending = ""
            return out, True
        hold = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:length]):
                    hold = length
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@final
class Generation:
    """One request running on one lane; iterate it for text pieces, then read :attr:`result`.

    Not reusable.  If iteration stops early between pieces (a client that went away), :meth:`abort`
    stops the session and keeps the lane usable; after an error or a step that was cancelled the
    lane is in an unknown state: close it rather than reuse it.
    """

    def __init__(self, generator: "Generator", client: StageClient, request: GenerationRequest,
                 session_id: int, fork: tuple[int, int] | None = None,
                 fork_at: tuple[int, int] | None = None) -> None:
        self._generator = generator
        self._client = client
        self.request = request
        self.session_id = session_id
        self.tokens: list[int] = []
        self.timing = Timing(prompt_tokens=len(request.prompt))
        self.result: Completion | None = None
        self._text: list[str] = []
        self._stream: TextStream = generator.tokenizer.stream(request.render_special)
        self._stops = _StopMatcher(request.stop)
        self._started = 0.0
        self._last = 0.0
        self._position = len(request.prompt)
        self._runner: SpeculativeRunner | None = None
        #: Whether this request speculates, decided at its first step (the load then): a request
        #: that starts on a chain too busy for any window to pay takes the plain path throughout.
        self._speculates: bool | None = None
        self.cached_tokens = 0
        self._exchanging = False  # inside a step (or interrupted in one)
        self._touched = False  # a message was sent for the session
        #: (parent session id, stage count): the prompt's KV is forked from a session of this lane.
        self._fork = fork
        self._fork_at = fork_at
        #: (start, size) of this run's last prefill chunk once its first token is in: where its
        #: forks copy up to and what they compute (:meth:`Generator.start`'s ``fork_at``).
        self.fork_point: tuple[int, int] | None = None
        #: One entry per token of :attr:`tokens` (a request that asked for logprobs).
        self.logprobs: list[TokenLogprobs] | None = None if request.logprobs is None else []
        #: docs/protocol.md §14: the partition the session's positions were first computed in
        #: ((start, count) frames: the prefill chunks, then one per decoded token; a verify
        #: window as (start, positions kept, the rows it sent)), the resumes so far, failed
        #: resume tries, and the lanes this run opened itself (closed at its end).
        self._frames: list[tuple[int, int] | tuple[int, int, tuple[int, ...]]] = []
        self.resumes: list[dict[str, Any]] = []
        self._failed_resumes = 0
        self._own_lanes: list[StageClient] = []
        #: A speculative run's counters once a resume ended its speculation.
        self._spec_usage: SpeculationUsage | None = None
        #: The decoder of a lone request that stopped speculating because its drafts did not come
        #: (:meth:`_step`): it follows the plain path's tokens and says when a window would go.
        self._dormant: SpeculativeDecoder | None = None
        #: The next decode run's length while dormant (doubling from RUN_CHUNK_MIN).
        self._run_chunk = RUN_CHUNK_MIN
        #: When the loss being resumed was noticed (0: none in progress).
        self._resume_started = 0.0
        self._finishing = False

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> str:
        """The text the next token completed ('' while a character or stop string is pending).

        Raises:
            StopAsyncIteration: the run finished (:attr:`result` is set, the session stopped).
            StageLost, StageClientError: the chain failed.
        """
        if self.result is not None:
            raise StopAsyncIteration
        self._exchanging = True  # stays set if the step fails or is cancelled: the lane is mid-exchange
        self._generator.load.enter(self)
        try:
            while True:
                try:
                    piece = await self._step()
                    break
                except StageLost as exc:
                    if not self._resumable(exc):
                        raise
                    await self._resume(exc)
            if self._resume_started:  # the first token after a resume: the resume is over
                self.resumes[-1]["resume_ms"] = round((time.perf_counter() - self._resume_started) * 1e3, 3)
                self._resume_started = 0.0
        except BaseException:
            self._generator.load.leave(self)
            await self._close_own_lanes()
            raise
        if self.result is not None:
            self._generator.load.leave(self)
        self._exchanging = False
        return piece

    async def abort(self) -> bool:
        """End a run that stopped early between pieces, leaving the lane reusable.

        Drains what a speculative run still has in flight, then stops the session, whose ACK
        comes back only once every stage has released it.

        Returns:
            True when the lane is clean again; False when the run was interrupted inside an
            exchange (a reply may still be on its way): close the lane instead.

        Raises:
            StageClientError: the chain failed while draining or stopping.
        """
        self._generator.load.leave(self)
        if self.result is not None or not self._touched:
            return True
        if self._exchanging:
            return False
        self._exchanging = True
        if self._runner is not None:
            await self._runner.finish(self._runner.kv_high_water)
            self._runner.replies.clear()
        await self._client.stop(self.session_id)
        self._exchanging = False
        return True

    async def _step(self) -> str:
        client, request = self._client, self.request
        self._touched = True
        if self._speculates is None:
            self._speculates = self._generator.speculates(request, load_aware=True)
        elif self._runner is not None and request.speculation is None and self._runner.decoder.tracker.in_flight == 0:
            if not speculation_pays(self._generator.load, self._generator.controller):
                await self._stop_speculating()  # the chain got busy: the plain path from here on
            elif self._runner.decoder.idle >= IDLE_STEPS and self._plain_path_differs():
                decoder = self._runner.decoder
                await self._stop_speculating()  # drafts do not come: the plain path until they do
                self._dormant, self._run_chunk = decoder, RUN_CHUNK_MIN
        elif self._dormant is not None:
            decoder = self._dormant
            decoder.follow(self.tokens[len(decoder.generated):])
            # free between decode runs (and with direct return); mid-run, only once a loop shows
            if decoder.wants_window(mid_run=self._client.running) \
                    and speculation_pays(self._generator.load, self._generator.controller):
                await self._resume_speculating()
        if not self.tokens:
            self._started = time.perf_counter()
            if self._fork is not None:
                cached = await prefix.fork_prefill(client, self.session_id, request.prompt, parent=self._fork[0],
                                                   stages=self._fork[1], at=self._fork_at,
                                                   sampling=sampling_config(request.sampling),
                                                   cache=self._generator.cache_request(request),
                                                   chunk_size=self._generator.prefill_chunk_size,
                                                   credit=self._generator.credit,
                                                   extension=request.sampling_extension,
                                                   direct_return=self._generator.direct_return_for(
                                                       request, self._speculates))
            else:
                cached = await prefix.prefill(client, self.session_id, request.prompt,
                                              sampling=sampling_config(request.sampling),
                                              cache=self._generator.cache_request(request),
                                              chunk_size=self._generator.prefill_chunk_size,
                                              credit=self._generator.credit,
                                              extension=request.sampling_extension,
                                              direct_return=self._generator.direct_return_for(
                                                  request, self._speculates),
                                              resumable=self._generator.resume_attempts > 0)
            self._frames = _prefill_frames(len(request.prompt), cached.cached_tokens, cached.chunk_size)
            self.cached_tokens, prefill = cached.cached_tokens, cached.result
            self.fork_point = cached.last_chunk(len(request.prompt))
            reply = prefill.reply
            self._last = time.perf_counter()
            self.timing.time_to_first_token = self._last - self._started
            if self._fork is None:
                self._generator.observe_prefill(len(request.prompt) - cached.cached_tokens, cached.chunk_size, reply,
                                                client.last_timings)
            self.timing.add_frames(client.take_timings())
            tokens: tuple[int, ...] = (int(reply.predicted),)
            if request.max_tokens > 1 and self._speculates:
                self._start_speculation(tokens[0], self.timing.chain_stages)
        elif self._runner is not None:
            runner = self._runner
            try:
                tokens = await runner.step()
            except StageClientError:
                await client.aclose()  # windows in flight or a broken FIFO: the lane is unusable
                raise
            now = time.perf_counter()
            for _ in tokens:
                self.timing.inter_token.append((now - self._last) / len(tokens))
            self.timing.decode_seconds += now - self._last
            self._last = now
            self.timing.add_frames(client.take_timings())
            runner.replies.clear()
            for start, kept, rows in runner.committed:
                self._frames.append((start, kept) if kept == len(rows) else (start, kept, rows))
            runner.committed.clear()
        else:
            if client.running:  # docs/protocol.md §11: the first stage feeds each token to the next step
                reply = await client.next_run_token(self.session_id)
            elif self._generator.decode_runs and client.extensions and not client.returns_directly(self.session_id):
                budget = request.max_tokens - len(self.tokens)
                if self._dormant is not None:  # runs of a few tokens: speculation may come back at each end
                    budget, self._run_chunk = min(budget, self._run_chunk), min(2 * self._run_chunk, RUN_CHUNK_MAX)
                reply = await client.start_run(self.session_id, self.tokens[-1], self._position,
                                               max_tokens=budget,
                                               stop_tokens=self._generator.tokenizer.end_of_generation_tokens(),
                                               decode_step=len(self.tokens) - 1)
            else:
                reply = await client.decode(self.session_id, self.tokens[-1], self._position,
                                            decode_step=len(self.tokens) - 1)
            self._frames.append((self._position, 1))
            self._position += 1
            now = time.perf_counter()
            self.timing.inter_token.append(now - self._last)
            self.timing.decode_seconds += now - self._last
            self._last = now
            self.timing.add_frames(client.take_timings())
            tokens = (int(reply.predicted),)
        rows = self._reply_logprobs(len(tokens))
        emitted: list[str] = []
        for index, token in enumerate(tokens):
            if self._generator.tokenizer.is_end_of_generation(token):
                return await self._finish("stop", "".join(emitted) + self._stream.flush(), eog=True)
            self.tokens.append(token)
            if self.logprobs is not None:
                self.logprobs.append(rows[index])
            piece, stopped = self._stops.push(self._stream.push(token))
            if stopped:
                return await self._finish("stop", "".join(emitted) + piece, flushed=True)
            if len(self.tokens) >= request.max_tokens:
                return await self._finish("length", "".join(emitted) + piece + self._stream.flush())
            emitted.append(piece)
        text = "".join(emitted)
        self._text.append(text)
        return text

    def _reply_logprobs(self, count: int) -> tuple[TokenLogprobs, ...]:
        """The last reply's logprobs (docs/protocol.md §10), one per predicted token; () when the
        request did not ask.

        Raises:
            StageClientError: they were asked for and did not come (or not one per token).
        """
        if self.logprobs is None:
            return ()
        frame = self._client.last_logprobs
        if frame is None or len(frame.rows) != count:
            raise StageClientError(f"the chain sent {0 if frame is None else len(frame.rows)} logprob entries "
                                   f"for a reply of {count} token(s)")
        return frame.rows

    def _start_speculation(self, first_token: int, stages: int) -> None:
        generator, request = self._generator, self.request
        config = SpeculationConfig(controller=dataclasses.replace(generator.controller, stages=max(1, stages)))
        decoder = SpeculativeDecoder(request.prompt, first_token, config=config, max_tokens=request.max_tokens,
                                     load=generator.load)
        self._runner = SpeculativeRunner(self._client, self.session_id, decoder, redo_heads=self._redo_heads(stages))

    def _plain_path_differs(self) -> bool:
        """Whether the plain path is cheaper per token than a speculating request's plain steps:
        a decode run (docs/protocol.md §11) or direct return (§8) is open to it."""
        client = self._client
        if self._generator.decode_runs and client.extensions:
            return True
        return self._generator.direct_return_for(self.request, False) is not None

    async def _resume_speculating(self) -> None:
        """Speculate again after :meth:`_stop_speculating` left a dormant decoder: end the decode
        run (a TrimSession removes what the steps the first stage had started wrote) and start a
        runner at the next position with the same decoder (its drafts, estimates and counters)."""
        decoder, client = self._dormant, self._client
        assert decoder is not None and decoder.generated == self.tokens
        if client.running:
            try:
                position = await client.end_run(self.session_id)
            except StageClientError:
                await client.aclose()
                raise
            if position != self._position:
                raise StageClientError(f"the decode run of session {self.session_id} ended at position {position}, "
                                       f"expected {self._position}")
            self.timing.add_frames(client.take_timings())
        # (a return lane, if one was opened, stays: the runner's messages are not flagged, so they
        # and their replies go hop by hop)
        decoder.restart(self._position)
        self._dormant, self._spec_usage = None, None
        self._runner = SpeculativeRunner(client, self.session_id, decoder,
                                         redo_heads=self._redo_heads(self.timing.chain_stages))

    def _redo_heads(self, stages: int) -> bool:
        # on one stage a row cut from a window is replayed from its token, as the unsplit run does;
        # on a chain (or an unknown stage count: 0) of a recurrent model it is sent again
        return self._generator.recurrent is not False and stages != 1

    async def _stop_speculating(self) -> None:
        """End the speculative run between windows, leaving the KV the plain loop would (every
        token received but the last), and decode on as a plain request (a decode run)."""
        runner = self._runner
        assert runner is not None
        length = len(self.request.prompt) + len(self.tokens) - 1
        try:
            await runner.finish(length)
        except StageClientError:
            await self._client.aclose()
            raise
        self.timing.add_frames(self._client.take_timings())
        runner.replies.clear()
        self._spec_usage, self._runner = runner.decoder.usage, None
        self._position = length
        address = self._generator.direct_return_for(self.request, False)
        if address is not None and not self._client.returns_directly(self.session_id):
            await self._client.open_direct_return(address, self.session_id)  # §8: as the plain path has it

    async def _finish(self, reason: str, text: str, *, flushed: bool = False, eog: bool = False) -> str:
        if self._runner is not None:
            # The plain loop leaves every received token but the last in the KV (the EOG included).
            length = len(self.request.prompt) + len(self.tokens) - (0 if eog else 1)
            try:
                await self._runner.finish(length)
            except StageClientError:
                await self._client.aclose()
                raise
            self.timing.add_frames(self._client.take_timings())
            self._runner.replies.clear()
        if not flushed:
            text, stopped = self._stops.push(text)
            if stopped:
                reason = "stop"
            else:
                text += self._stops.flush()
        self._text.append(text)
        self._finishing = True  # every token is in: a loss from here on is not resumed
        try:
            await self._client.stop(self.session_id)
        except StageLost as exc:
            if self._generator.resume_attempts <= 0:
                raise
            # the text is complete: the stages release the session (or their parked copy at its deadline)
            log.warning("session %d: the chain was lost while stopping (%s); the completion stands",
                        self.session_id, exc)
        self.timing.add_frames(self._client.take_timings(), totals=True)  # §8: the upstream stages' totals
        usage = self._spec_usage if self._runner is None else self._runner.decoder.usage
        self.result = Completion("".join(self._text), self.tokens, reason, len(self.request.prompt), self.timing,
                                 usage, self.cached_tokens, self.logprobs, self._stops.matched, self.resumes)
        await self._close_own_lanes()
        return text

    # -- resume after a lost stage (docs/protocol.md §14) ---------------------------------------
    def _resumable(self, exc: StageLost) -> bool:
        """Whether a lost lane is resumed: the generator resumes, the loss is a loss (not a
        refusal), tries are left, and the run is not a fork nor finishing."""
        if self._generator.resume_attempts <= 0 or isinstance(exc, StageRemoteError):
            return False
        if self._fork is not None or self._finishing:
            return False
        if self._failed_resumes >= self._generator.resume_attempts:
            return False
        return True

    async def _close_own_lanes(self) -> None:
        lanes, self._own_lanes = self._own_lanes, []
        for lane in lanes:
            await lane.aclose()

    async def _resume(self, exc: StageLost) -> None:
        """Re-open the lane once the lost stage's address accepts again, then resume the session:
        a ConfigureGeneration with the resume section (every stage keeps what it holds up to the
        committed length; the final stage restores its sampler), and a replay of the committed
        positions in their original frames (docs/protocol.md §14).  Before the first token the
        request simply starts again (a full prefill).

        Raises:
            StageLost: the resume failed ``resume_attempts`` times (the last loss, naming the stage).
        """
        generator, old = self._generator, self._client
        frame = exc.frame
        lost_index = frame.origin_stage_index if frame is not None else 0
        lost_address = frame.origin_address if frame is not None and frame.origin_address else str(old.address)
        # a loss before the first token after a resume is the same loss going on
        started = self._resume_started or time.perf_counter()
        log.warning("session %d lost stage %d (%s) after %d tokens: resuming (try %d of %d)", self.session_id,
                    lost_index, lost_address, len(self.tokens), self._failed_resumes + 1, generator.resume_attempts)
        await old.aclose()
        last: StageLost = exc
        while self._failed_resumes < generator.resume_attempts:
            # one try: up to resume_wait_s for a replacement, at its old address (probed) or
            # elsewhere (a launcher that re-wires the chain: the resume is tried every second)
            deadline = trio.current_time() + generator.resume_wait_s
            while True:
                remaining = deadline - trio.current_time()
                try:
                    await _wait_accepting(lost_address, max(0.05, min(1.0, remaining)))
                except StageLost:
                    pass  # not back there (yet): try anyway, the stage may have moved
                try:
                    # bounded: a first stage still dialing a replacement that never listens
                    # (killed again) would otherwise hold the lane for the whole reply timeout
                    with trio.fail_after(generator.resume_wait_s):
                        mode = await self._reopen(old)
                except trio.TooSlowError:
                    if trio.current_time() >= deadline:
                        break
                    continue
                except StageLost as failure:
                    last = failure
                    if failure.frame is not None and failure.frame.origin_address:  # the chain names the lost stage
                        lost_index, lost_address = failure.frame.origin_stage_index, failure.frame.origin_address
                    if trio.current_time() >= deadline:
                        break
                    await trio.sleep(0.1)
                    continue
                seconds = time.perf_counter() - started
                # resume_ms (loss noticed to the next token) is set once that token is in
                entry = {"lost_stage": lost_index, "address": lost_address, "mode": mode,
                         "tokens": len(self.tokens), "reopened_ms": round(seconds * 1e3, 3), "resume_ms": None}
                if self._resume_started:
                    self.resumes[-1] = entry
                else:
                    self.resumes.append(entry)
                self._resume_started = started
                log.warning("session %d: lane re-opened after losing stage %d (%s) in %.1f ms (%s)",
                            self.session_id, lost_index, lost_address, seconds * 1e3, mode)
                return
            self._failed_resumes += 1
            log.warning("session %d: resume try %d of %d failed: %s", self.session_id, self._failed_resumes,
                        generator.resume_attempts, last)
        raise StageLost(f"{last} (resume failed {self._failed_resumes} times)", last.frame) from last

    async def _reopen(self, old: StageClient) -> str:
        """A new lane to the first stage (where the generator says it is now), the session
        resumed on it (:meth:`_resume_on`); the lane is this run's from then on.

        Raises:
            StageLost: no lane, or the chain failed again (the lane is closed).
        """
        first = self._generator.first_stage() if self._generator.first_stage is not None else None
        client = await StageClient.connect(first or old.address, reply_timeout=old.reply_timeout,
                                           extensions=old.extensions, tls=old.tls)
        try:
            mode = await self._resume_on(client)
        except BaseException:
            await client.aclose()
            raise
        self._own_lanes.append(client)
        self._client = client
        return mode

    async def _resume_on(self, client: StageClient) -> str:
        """Resume the session on the new lane ``client``; "replay" or "restart" (before the first token)."""
        request = self.request
        if not self.tokens:
            return "restart"  # the next step configures and prefills again (stages release what they parked)
        length = len(request.prompt) + len(self.tokens) - 1
        positions = [*request.prompt, *self.tokens[:-1]]
        section = {"length": length, "tokens": list(self.tokens)}
        text = prefix.configure_metadata(None, request.sampling_extension, section)
        flags = SAMPLING_EXTENSION_FLAG if request.sampling_extension is not None else 0
        await client.configure(self.session_id, sampling=sampling_config(request.sampling),
                               prompt_token_count=len(request.prompt), metadata=text, flags=flags)
        frames = [f for f in self._frames if f[0] + f[1] <= length]
        covered = frames[-1][0] + frames[-1][1] if frames else 0
        if sum(f[1] for f in frames) != covered:
            frames, covered = [], 0
        frames += [(position, 1) for position in range(covered, length)]  # (none when the record is whole)
        await client.replay(self.session_id, positions, frames, credit=self._generator.credit)
        self._frames = frames
        self._position = length
        if self._runner is not None and self._runner.decoder.generated != self.tokens:
            self._spec_usage, self._runner = self._runner.decoder.usage, None  # (not expected) token by token
        if self._runner is not None:
            # the windows in flight are gone with the lane; the run speculates on from the
            # committed tokens with the same decoder (its drafts come from them, its controller
            # keeps what it learned); the replayed windows' rejected rows past ``length`` are
            # trimmed by the next window, or by finish()
            decoder = self._runner.decoder
            decoder.restart(length)
            runner = SpeculativeRunner(client, self.session_id, decoder, redo_heads=self._runner.redo_heads)
            runner.kv_high_water = max([length, *(f[0] + len(f[2]) for f in frames if len(f) == 3)])
            self._runner = runner
        return "replay"

    async def run(self) -> Completion:
        """Run to the end; the completion."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


def _prefill_frames(total: int, cached: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """The (start, count) frames a prefill of ``total`` positions was computed in: the restored
    prefix (its partition unknown here: chunks of ``chunk_size``), then the chunks from ``cached``."""
    size = chunk_size if chunk_size and chunk_size > 0 else max(1, total)
    frames = [(start, min(size, cached - start)) for start in range(0, cached, size)]
    frames += [(start, min(size, total - start)) for start in range(cached, total, size)]
    return frames


async def _wait_accepting(address: str, timeout: float) -> None:
    """Wait until ``address`` accepts a TCP connection (a replacement stage listens there), at
    most ``timeout`` seconds.

    Raises:
        StageLost: it did not within ``timeout``.
    """
    try:
        target = Address.parse(address)
    except ValueError as exc:
        raise StageLost(f"cannot wait for lost stage at {address!r}: {exc}") from exc
    deadline = trio.current_time() + timeout
    while True:
        try:
            with trio.fail_after(max(0.05, deadline - trio.current_time())):
                stream = await trio.open_tcp_stream(target.host, target.port)
            await trio.aclose_forcefully(stream)
            return
        except (OSError, trio.TooSlowError) as exc:
            if trio.current_time() >= deadline:
                raise StageLost(f"lost stage {address} did not accept connections within {timeout:g} s") from exc
            await trio.sleep(0.05)


@final
class Generator:
    """Tokenizer, chat template and generation settings of one served model.

    Args:
        tokenizer: the model's vocabulary.
        chat_template: Jinja chat template (``None``: :data:`FALLBACK_CHAT_TEMPLATE`).
        chat_template_choice: how ``chat_template`` was chosen (``from_model`` fills it in).
        n_ctx: context length requests must fit (prompt + max_tokens).
        chunk_size: prefill chunk size (tokens per PrefillEmbd); None (the default): chosen per
            request by :attr:`chunking`, a :class:`~skippy.driver.prefill_chunking.PrefillChunker`
            fed with the chain's prefill timings.
        credit: prefill chunks sent ahead of their ACKs.
        speculation: speculate on greedy requests that do not say (``GenerationRequest.speculation``).
        controller: window / depth control (``stages`` is filled in from the prefill reply).
        decode_runs: a request that does not speculate decodes as one run driven by the first
            stage (docs/protocol.md §11); False: one DecodeEmbd per token.

    :attr:`direct_return` (None by default): a function giving the chain's final stage now (a
    launcher that restarts stages moves it).  When set, a request that does not speculate opens a
    return lane to it for its session (docs/protocol.md §8): every prediction comes straight back
    instead of crossing each stage in reverse.  Such a request is decoded one DecodeEmbd per token
    (a decode run needs its predictions at the first stage).
    """

    def __init__(self, tokenizer: Tokenizer, *, chat_template: str | None = None, n_ctx: int = 4096,
                 chunk_size: int | None = None, credit: int = 2, speculation: bool = DEFAULT_SPECULATION,
                 controller: ControllerConfig = ControllerConfig(),
                 chat_template_choice: ChatTemplateChoice | None = None, decode_runs: bool = True,
                 resume_attempts: int = 0, resume_wait_s: float = 30.0) -> None:
        self.tokenizer = tokenizer
        self.speculation = speculation
        #: docs/protocol.md §11: requests that do not speculate decode as one run driven by the
        #: first stage (a stage that does not run it is driven one DecodeEmbd per token).
        self.decode_runs = decode_runs
        #: The final stage's address for direct return, read per request (None: hop by hop).
        self.direct_return: Callable[[], Address | None] | None = None
        #: docs/protocol.md §14: where the first stage is now, read when a resume re-opens a lane
        #: (None: where the lost lane went; a launcher that moves stages points it at its pool).
        self.first_stage: Callable[[], Address | None] | None = None
        self.controller = controller
        #: Whether the model's stages roll back through checkpoints, as recurrent and hybrid
        #: architectures' do (None: not known, taken as yes): speculation on a
        #: chain of such a model sends a window cut to its first row again as a 1-row window
        #: (:mod:`skippy.driver.speculation.runner`: the split stays bitwise the unsplit run).
        #: :meth:`from_model` reads it from the GGUF.
        self.recurrent: bool | None = None
        #: The requests running now (from their first step to their end): speculation weighs a
        #: window's cost to the others by it (docs/throughput.md).
        self.load = SessionLoad()
        self.chat_template = chat_template or FALLBACK_CHAT_TEMPLATE
        self.chat_template_choice = chat_template_choice or (
            ChatTemplateChoice("given", chat_template, "file") if chat_template
            else ChatTemplateChoice("plain", FALLBACK_CHAT_TEMPLATE, "fallback", "none given", PLAIN_TRANSCRIPT_STOP))
        self.n_ctx = n_ctx
        self.chunk_size = chunk_size
        #: The adaptive prefill chunk controller (None: ``chunk_size`` is fixed).
        self.chunking: PrefillChunker | None = PrefillChunker() if chunk_size is None else None
        self.credit = credit
        self._formatter: ChatRenderer | None = None
        #: docs/protocol.md §14: failed resume tries a request may make after losing a stage
        #: (0: a lost stage fails the request, and the stages park nothing for it), and how long
        #: each waits for the lost stage's address to accept again.
        self.resume_attempts = resume_attempts
        self.resume_wait_s = resume_wait_s
        #: Prefix KV cache default for requests that do not say, and the stages' page size.
        self.prefix_cache = True
        self.cache_page_size = prefix.DEFAULT_PAGE_SIZE

    def prefill_chunk_size(self, tokens: int) -> int:
        """The chunk size for a prefill of ``tokens`` tokens: the fixed size, or the controller's plan."""
        if self.chunking is None:
            assert self.chunk_size is not None
            return self.chunk_size
        return self.chunking.plan(tokens)

    def observe_prefill(self, tokens: int, chunk_size: int, reply: StageReply, timings: TimingsFrame | None) -> None:
        """Feed a finished prefill of ``tokens`` tokens in ``chunk_size`` chunks to the controller
        (``reply``: the final chunk's, ``timings``: its Timings frame)."""
        if self.chunking is None or tokens <= 0 or chunk_size <= 0:
            return
        last = tokens - (math.ceil(tokens / chunk_size) - 1) * chunk_size
        self.chunking.observe(observation_from(chunk_size, last, timings, reply.stats))

    def cache_request(self, request: GenerationRequest) -> prefix.CacheRequest:
        """What ``request`` asks of the chain's prefix cache (opted out: no lookup, no record)."""
        enabled = self.prefix_cache if request.prefix_cache is None else request.prefix_cache
        return prefix.CacheRequest(enabled=enabled, namespace=request.cache_namespace, page_size=self.cache_page_size)

    def direct_return_for(self, request: GenerationRequest, speculates: bool | None = None) -> Address | None:
        """The final stage ``request``'s predictions return from directly (None: hop by hop).

        Only for requests that do not speculate (``speculates``: as decided for the run; None:
        :meth:`speculates`) and need more than the first token (a single token gains nothing from
        a second connection)."""
        if speculates is None:
            speculates = self.speculates(request)
        if self.direct_return is None or request.max_tokens <= 1 or speculates:
            return None
        return self.direct_return()

    def speculates(self, request: GenerationRequest, *, load_aware: bool = False) -> bool:
        """Whether ``request`` runs speculatively.

        Penalised sampling never does (the final stage's sampler history would keep rejected rows),
        nor does a request with a grammar (the grammar's state would advance over rejected drafts
        and verify rows would be sampled under the wrong state) or with logprobs (reported per
        committed token only); otherwise the request's own choice wins, and by default only greedy
        requests speculate, and (``load_aware``: as a run decides at its start) only while the
        chain is not so busy that no window could pay (:func:`speculation_pays`: then the plain
        path, a decode run or direct return, is the cheaper one).
        """
        if request.sampling.uses_penalties or request.grammar is not None or request.logprobs is not None:
            return False
        if request.speculation is not None:
            return request.speculation
        if not (self.speculation and request.sampling.greedy):
            return False
        return not load_aware or speculation_pays(self.load, self.controller)

    @classmethod
    def from_model(cls, path: str | Path, *, n_ctx: int | None = None, chunk_size: int | None = None,
                   credit: int = 2, speculation: bool = DEFAULT_SPECULATION,
                   controller: ControllerConfig = ControllerConfig(), chat_template: str | None = None,
                   decode_runs: bool = True) -> "Generator":
        """Load the vocabulary and chat template of the GGUF at ``path`` (no weights).

        A file without ``tokenizer.chat_template`` gets a built-in one chosen for its family
        (:func:`skippy.driver.chat_templates.choose_chat_template`; ``chat_template`` names one to
        use instead, or a Jinja file: an existing path, or one with ``/`` or a ``.jinja`` suffix);
        the choice is logged.  ``n_ctx`` defaults to the smaller of the model's
        trained context and 4096 (the stage default).

        Raises:
            ValueError: ``chat_template`` is neither a built-in template's name nor a readable file.
        """
        metadata, _ = read_header(Path(path))
        trained = next((int(v) for k, v in metadata.items() if k.endswith(".context_length")
                        and isinstance(v, int)), 4096)
        tokenizer = Tokenizer(path)
        try:
            given = None if chat_template is None else Path(chat_template)
            if given is not None and (given.is_file() or "/" in str(chat_template)
                                      or given.suffix in (".jinja", ".j2")):
                try:
                    source = given.read_text()
                except (OSError, UnicodeDecodeError) as exc:
                    raise ValueError(f"cannot read chat template file {given}: {exc}") from exc
                choice = ChatTemplateChoice("given", source, "given", f"read from {given}")
            else:
                choice = choose_chat_template(metadata, tokenizer, chat_template)
        except ValueError:
            tokenizer.close()  # a bad name or file: do not leak the vocabulary load
            raise
        log.info("%s: %s", Path(path).name, choice.describe())
        generator = cls(tokenizer, chat_template=choice.source, n_ctx=n_ctx or min(trained, 4096),
                        chunk_size=chunk_size, credit=credit, speculation=speculation, controller=controller,
                        chat_template_choice=choice, decode_runs=decode_runs)
        arch = metadata.get("general.architecture")
        if isinstance(arch, str):
            generator.recurrent = rolls_back(arch)
        return generator

    def close(self) -> None:
        self.tokenizer.close()

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for chat ``messages`` (``add_generation_prompt`` on), rendered in a
        sandbox (:class:`skippy.driver.chat_render.ChatRenderer`); ``tools`` and ``extra`` are
        passed to the template.

        Raises:
            ValueError: the template refused the messages (:class:`ChatTemplateError`).
        """
        if self._formatter is None:
            tokenizer = self.tokenizer
            eos = tokenizer.piece(tokenizer.eos, special=True).decode("utf-8", "replace") if tokenizer.eos >= 0 else ""
            bos = tokenizer.piece(tokenizer.bos, special=True).decode("utf-8", "replace") if tokenizer.bos >= 0 else ""
            self._formatter = ChatRenderer(self.chat_template, bos_token=bos, eos_token=eos)
        try:
            return self._formatter.render(list(messages), tools=tools, **extra)
        except ChatTemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from exc

    def chat_stop(self, stop: Sequence[str] = ()) -> tuple[str, ...]:
        """The stop strings of a chat request: the request's own plus the template's turn ends."""
        return tuple(dict.fromkeys((*stop, *self.chat_template_choice.stop)))

    def encode(self, text: str) -> list[int]:
        """Prompt tokens of ``text`` (BOS added when the vocabulary wants it; special tokens parsed)."""
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    def check_fits(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The max_tokens to use for a prompt, defaulting to what the context leaves.

        Raises:
            ContextOverflow: the prompt, or prompt + max_tokens, exceeds :attr:`n_ctx`.
        """
        room = self.n_ctx - prompt_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = prompt_tokens + (max_tokens or 0)
            raise ContextOverflow(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{asked} tokens ({prompt_tokens} in the prompt, {max_tokens or 0} for the completion). "
                "Please reduce the prompt or the completion length."
            )
        return room if max_tokens is None else max_tokens

    def start(self, client: StageClient, request: GenerationRequest, session_id: int,
              fork: tuple[int, int] | None = None, fork_at: tuple[int, int] | None = None) -> Generation:
        """A run of ``request`` as session ``session_id`` on ``client`` (nothing is sent yet).

        ``fork`` (parent session id, stage count): another choice of the same prompt; the parent
        session, on the same lane, must hold the prompt's KV (its first exchange done, not stopped).
        The fork's KV prefix is copied on every stage and the rest of the prompt computed:
        ``fork_at`` (the parent's :attr:`Generation.fork_point`: its last prefill chunk's start and
        size) makes that rest the parent's last chunk, computed as the parent computed it, so the
        fork's first token is the one an ``n = 1`` run makes; without it only the last prompt token
        is computed (alone, which rounds differently on quantized models).
        """
        return Generation(self, client, request, session_id, fork, fork_at)

    async def generate(self, client: StageClient, request: GenerationRequest, session_id: int) -> Completion:
        """Run ``request`` to the end."""
        return await self.start(client, request, session_id).run()
