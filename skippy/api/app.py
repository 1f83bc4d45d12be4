"""The OpenAI-compatible HTTP app (Starlette, run by hypercorn under trio).

Strategy: the handlers are thin: parse and validate the body (:mod:`skippy.api.errors`), turn it
into a :class:`GenerationRequest`, lease a lane from the :class:`LanePool`, run a
:class:`Generation` on it, and shape the OpenAI response.  For a streaming request the first
exchange with the chain (configure + prefill, up to the first token) runs *before* the response
starts, so a chain that is down still gets a proper 503 status; after that, failures end the
event stream with an ``error`` event (the openai client raises on it).  The lease is returned in
a ``finally`` that also runs when the HTTP client goes away (the lane is then closed, not reused).

Extension: ``usage.skippy_timing`` carries TTFT, decode rate and the stage timings from the
reply stats; ``usage.skippy_speculation`` the speculative-decoding counters (drafts proposed /
accepted, windows, rollbacks, stale windows) of a request that speculated.  The body field
``speculation`` (bool) opts a request in or out (default: on for greedy requests).
Prefix KV cache: on by default; ``prefix_cache: false`` opts a request out; the cache namespace
on every stage is derived from the caller's API key, subdivided by ``prompt_cache_key`` (else
``user``) (:mod:`skippy.api.auth`); ``usage.prompt_tokens_details.cached_tokens`` is the restored
prefix.  ``top_k``, ``min_p`` and ``repeat_penalty`` are accepted as llama.cpp servers do.
Which fields a body may carry, and what each does, is :mod:`skippy.api.fields` (docs/api-fields.md);
``/tokenize`` and ``/detokenize`` answer as llama-server's do.

Around the handlers (:func:`create_app`): CORS only when origins are configured, API keys
(:mod:`skippy.api.auth`), JSON-only bodies under a size limit (:mod:`skippy.api.guard`), and a
catch-all that answers any unexpected exception with OpenAI's error body (500) and logs it.
Bodies over :data:`INLINE_PARSE_BYTES` are parsed and tokenised in a worker thread, one at a time.
Lanes are taken through :mod:`skippy.api.admission` (a bounded queue, 429 when full; a first
exchange the chain refuses as overloaded is retried).  A stream whose client goes away is stopped
between two tokens (each step with the chain is shielded from the cancellation), its session
stopped on every stage and the lane kept (:meth:`Generation.abort`).
``GET /`` serves a page showing the chain live, with a chat, and ``GET /chain`` its JSON
(:mod:`skippy.api.page`); finished generations are kept a few minutes for it (``service.history``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, final

import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from skippy.api import generic_tools, harmony
from skippy.api.admission import Admission, is_overloaded
from skippy.api.auth import PUBLIC_PATHS, ApiKeys, AuthMiddleware, is_authenticated, scope_tenant
from skippy.api.chain_view import History
from skippy.api.errors import (
    ApiError,
    get_bool,
    get_float,
    get_int,
    get_logit_bias,
    get_stop,
    internal_error,
    invalid,
    is_anthropic_path,
    parse_json_object,
)
from skippy.api.choices import Parsed, ToolPlan, _best, _Choice, _run_order, _usage
from skippy.api.fields import check_fields, unsupported
from skippy.api.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard
from skippy.api.lanes import LanePool, Lease
from skippy.api.metrics import Metrics
from skippy.api.page import ASSET_PATHS, page_routes
from skippy.api.reasoning import OPEN as REASONING_OPEN
from skippy.api.reasoning import template_variables, thinks
from skippy.api.samplers import apply_samplers
from skippy.api.structured import (LogprobsReport, check_schema_keywords, grammar_converter, parse_constraints,
                                    schema_grammar)
from skippy.api.tool_calls import (
    ToolFormat,
    ToolsRequest,
    detect_format,
    forcing_grammar,
    marker_tokens,
    parse_tool_choice,
    parse_tools,
    renders_tools,
    template_messages,
)
from skippy.driver.client import StageClientError, StageLost
from skippy.driver.prefix import SamplingExtensionRefused
from skippy.driver.generator import ContextOverflow, Generation, GenerationRequest, Generator
from skippy.runtime.sampling import DEFAULT_SEED, SamplingParams

#: OpenAI's default when a completions request has no max_tokens.
DEFAULT_COMPLETION_TOKENS = 16
#: Bodies up to this size are parsed and tokenised on the event loop; larger ones in a worker thread.
INLINE_PARSE_BYTES = 32 * 1024
#: Seconds a healthy /health answer is reused.
HEALTH_REUSE_S = 1.0
#: Seconds allowed to stop the session of a request whose client went away (else the lane is closed).
ABORT_TIMEOUT = 5.0

log = logging.getLogger("skippy.api")
#: Choices per request (``n``): each is a session on every stage while the request runs.
MAX_CHOICES = 8


@final
class ChainService:
    """What the handlers share: the model's generator, the lane pool, the metrics.

    Args:
        generator: tokenizer + chat template of the served model.
        pool: lanes to the chain's first stage.
        model_id: the name clients use in ``model``.
        aliases: more names a request may use for the same model (``--alias``).
        keys: accepted API keys and the cache salt (default: no keys, one anonymous tenant).
        admission: the queue in front of ``pool`` (default: :class:`Admission` defaults).
        max_body_bytes: the request-body limit (413 above it).
        cors_origins: origins allowed to call from a browser (default none: no CORS headers).
    """

    def __init__(self, generator: Generator, pool: LanePool, model_id: str, *, aliases: tuple[str, ...] = (),
                 keys: ApiKeys | None = None,
                 admission: Admission | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 cors_origins: tuple[str, ...] = ()) -> None:
        self.generator = generator
        self.pool = pool
        self.model_id = model_id
        #: Every name a request may give as ``model``: the id, then the aliases (``--alias``).
        self.model_names = tuple(dict.fromkeys((model_id, *aliases)))
        self.keys = keys or ApiKeys()
        self.admission = admission or Admission(pool)
        self.max_body_bytes = max_body_bytes
        self.cors_origins = cors_origins
        #: ``auto``: a ``<think>`` template's reasoning goes to ``reasoning_content``; ``none``: inline.
        self.reasoning_format = "auto"
        self.metrics = Metrics()
        self.metrics.queue_waiting.set_function(lambda: self.admission.waiting)
        #: Generations of the last minutes, for the page (:mod:`skippy.api.page`).
        self.history = History()
        self.created = int(time.time())
        self._tool_support: tuple[bool, ToolFormat | None] | None = None

    def tool_support(self) -> tuple[bool, ToolFormat | None]:
        """(the chat template renders tools, the call syntax it writes); probed once."""
        if self._tool_support is None:
            generator = self.generator
            renders = renders_tools(lambda messages, tools: generator.apply_chat_template(messages, tools=tools))
            format = detect_format(generator.chat_template)
            if format is None and harmony.is_harmony(generator.chat_template):
                format = harmony.FORMAT  # gpt-oss: calls on the commentary channel (skippy/api/harmony.py)
            self._tool_support = (renders, format if renders else None)
        return self._tool_support


def _sampling(body: dict[str, Any], n_vocab: int) -> SamplingParams:
    temperature = get_float(body, "temperature", minimum=0.0, maximum=2.0)
    top_p = get_float(body, "top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    top_k = get_int(body, "top_k", minimum=0, maximum=n_vocab)
    min_p = get_float(body, "min_p", minimum=0.0, maximum=1.0)
    presence = get_float(body, "presence_penalty", minimum=-2.0, maximum=2.0)
    frequency = get_float(body, "frequency_penalty", minimum=-2.0, maximum=2.0)
    repeat = get_float(body, "repeat_penalty", minimum=0.0, maximum=10.0, exclusive_minimum=True)
    seed = get_int(body, "seed")
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature, top_k=top_k or 0,
        top_p=1.0 if top_p is None else top_p, min_p=min_p or 0.0,
        repeat_penalty=1.0 if repeat is None else repeat, frequency_penalty=frequency or 0.0,
        presence_penalty=presence or 0.0, logit_bias=get_logit_bias(body, n_vocab),
        seed=DEFAULT_SEED if seed is None else seed & 0xFFFFFFFF,
    )


#: Keys a chat message may carry (others are a 400 naming them).
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio",
                           "function_call", "reasoning_content"})
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_content(index: int, content: Any) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, list):  # content parts: text only
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(f"{where}[{number}]", "expected a content part object with a 'type'")
            if part["type"] != "text":
                raise unsupported(f"{where}[{number}]", f"{part['type']!r} content parts are not served "
                                  "(text only: this server runs a text-only model)")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{number}].text", "expected a string")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise invalid(where, "expected a string or a list of text parts")
    return content


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages, checked and normalised for the chat template (``developer`` is ``system``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty list of messages")
    cleaned = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{index}]", "expected an object with a 'role'")
        role = message["role"]
        if role not in _ROLES:
            if role == "function":
                raise unsupported(f"messages[{index}].role", "the deprecated 'function' role is not served; "
                                  "use 'tool' messages")
            raise invalid(f"messages[{index}].role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
        for key, value in message.items():
            if key not in _MESSAGE_KEYS:
                raise unsupported(f"messages[{index}].{key}", "not a chat message field this server reads")
            if key in ("audio", "function_call") and value is not None:
                raise unsupported(f"messages[{index}].{key}", "not served (use content and tool_calls)")
            if key == "reasoning_content" and value is not None:  # an earlier answer's reasoning, sent back
                if role != "assistant":
                    raise invalid(f"messages[{index}].{key}", "only an assistant message carries reasoning")
                if not isinstance(value, str):
                    raise invalid(f"messages[{index}].{key}", "expected a string")
        out = {key: value for key, value in message.items() if value is not None and key not in ("audio",
                                                                                                  "function_call")}
        out["role"] = "system" if role == "developer" else role
        out["content"] = _message_content(index, message.get("content"))
        cleaned.append(out)
    return cleaned


def _tool_plan(service: ChainService, body: dict[str, Any], messages: list[dict[str, Any]]
               ) -> tuple[ToolsRequest, ToolPlan | None, bool]:
    """The request's tools, checked against what the model's chat template can do, and whether
    they take the generic format (a template that renders no tools: skippy/api/generic_tools.py)."""
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"expected a boolean, got {json.dumps(parallel)}")
    request = ToolsRequest(tools, choice, parallel)
    history = next((index for index, message in enumerate(messages)
                    if message.get("tool_calls") or message["role"] == "tool"), None)
    if not request.active and history is None:
        return request, None, False
    renders, format = service.tool_support()
    template = service.generator.chat_template_choice.describe().removeprefix("chat template: ")
    if not renders:  # llama-server's generic format: tools in the system prompt, the answer one JSON object
        if not request.active:
            return request, None, True
        for index, tool in enumerate(tools):  # named at their own path, not the generic schema's
            check_schema_keywords(tool["function"].get("parameters") or {"type": "object"},
                                  f"tools[{index}].function.parameters")
        schema = generic_tools.generic_schema(tools, choice.name, choice.mode == "required", parallel)
        return request, ToolPlan(generic_tools.FORMAT, "", parallel, frozenset(),
                                 schema_grammar(schema, "tools")), True
    if not request.active:
        return request, None, False
    if format is None:
        raise ApiError(400, f"The model's chat template ({template}) renders tools, but the tool-call syntax it "
                       "writes is not one this server parses (hermes <tool_call>, Llama 3 JSON, Mistral "
                       "[TOOL_CALLS], Gemma <|tool_call>).", param="tools", code="tools_not_supported")
    prefix, grammar = "", None
    if choice.mode == "required":
        prefix, grammar = _forcing(format, tools, choice.name)
    generator = service.generator
    special = marker_tokens(format, lambda text: generator.tokenizer.encode(text, add_special=False,
                                                                            parse_special=True))
    return request, ToolPlan(format, prefix, parallel, special, grammar), False


def _forcing(format: ToolFormat, tools: Sequence[dict[str, Any]], name: str | None) -> tuple[str, str | None]:
    """(prompt suffix, grammar) forcing a call: a grammar from the tools' schemas where the format
    allows one and the converter is installed, else the format's call opening alone (docs/tools.md)."""
    if format.grammar_call:  # a keyword of the parameters the grammar would not enforce: a 400 naming it
        for index, tool in enumerate(tools):
            if name is None or tool["function"]["name"] == name:
                check_schema_keywords(tool["function"].get("parameters") or {"type": "object"},
                                      f"tools[{index}].function.parameters")
    try:
        converter, fix = grammar_converter()
        forced = forcing_grammar(format, tools, name, converter)
    except ApiError:  # llama-cpp-python (the converter) is not installed
        forced = None
    except (ValueError, KeyError, TypeError, AssertionError, NotImplementedError, RecursionError):
        forced = None  # a schema the converter cannot turn into a grammar: the call opening still forces
    if forced is None:
        return format.forced_prefix(name), None
    return forced[0], fix(forced[1])


def _prompt_tokens(service: ChainService, body: dict[str, Any], chat: bool
                   ) -> tuple[list[int], ToolPlan | None, bool | str | None]:
    """The prompt's tokens, the request's tool plan, and where its answer's reasoning starts
    (None: not split; True: the prompt opened ``<think>``; False: the answer may open it;
    ``"harmony"``: a Harmony answer, its channels split by skippy/api/harmony.py)."""
    generator = service.generator
    if chat:
        messages = _chat_messages(body)
        tools, plan, generic = _tool_plan(service, body, messages)
        variables = template_variables(body, generator.chat_template)
        rendered = template_messages(messages)
        if harmony.is_harmony(generator.chat_template):  # gpt-oss reads an earlier turn's reasoning as 'thinking'
            rendered = harmony.template_messages(rendered)
        if generic:
            rendered = generic_tools.generic_messages(rendered, tools.tools if plan else (), tools.parallel)
        try:
            text = generator.apply_chat_template(rendered, tools=list(tools.tools) if plan and not generic else None,
                                                 **variables)
        except ValueError as exc:
            raise invalid("messages", str(exc)) from exc
        thinking: bool | str | None = None
        if harmony.is_harmony(generator.chat_template) and (service.reasoning_format == "auto" or plan is not None):
            thinking = "harmony"  # channels split (skippy/api/harmony.py); calls need it whatever the format
        elif service.reasoning_format == "auto" and thinks(generator.chat_template):
            thinking = text.rstrip().endswith(REASONING_OPEN)
        return generator.encode(text + (plan.prefix if plan else "")), plan, thinking
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = generator.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        n_vocab = generator.tokenizer.n_vocab
        if not all(0 <= t < n_vocab for t in prompt):
            raise invalid("prompt", f"token ids must be in 0..{n_vocab - 1}")
        tokens = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise unsupported("prompt", "a batch of prompts is not served; send one prompt per request")
    else:
        raise invalid("prompt", "expected a string, a list of one string, or a list of token ids")
    if not tokens:
        raise invalid("prompt", "the prompt is empty")
    return tokens, None, None


def _prompt_text(service: ChainService, body: dict[str, Any], tokens: list[int]) -> str:
    """A completions prompt as text (``echo``): the string sent, or the token ids' text."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return service.generator.tokenizer.decode(tokens)


def _llama_fields(body: dict[str, Any], end_of_generation: frozenset[int]) -> dict[str, Any]:
    """``body`` with llama-server's names for served fields turned into OpenAI's: ``n_predict``
    (-1: no limit) as ``max_tokens``, ``cache_prompt`` as ``prefix_cache``, ``json_schema`` as a
    ``json_schema`` response format, ``ignore_eos`` as a -100 logit bias on every end-of-generation
    token.  The OpenAI field wins when both are given, except ``json_schema`` with a
    ``response_format`` (ambiguous: a 400)."""
    out = dict(body)
    predict = get_int(out, "n_predict", minimum=-1)
    if predict == 0:
        raise invalid("n_predict", "expected -1 (no limit) or a positive count")
    if predict is not None and predict > 0:
        out.setdefault("max_tokens", predict)
    if "cache_prompt" in out:
        out.setdefault("prefix_cache", get_bool(out, "cache_prompt"))
    schema = out.get("json_schema")
    if schema is not None:
        if out.get("response_format") is not None:
            raise unsupported("json_schema", "give either json_schema or response_format, not both")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    if get_bool(out, "ignore_eos"):
        bias = out.get("logit_bias")
        if bias is not None and not isinstance(bias, dict):
            raise invalid("logit_bias", "expected an object of token id -> bias")
        out["logit_bias"] = {**{str(token): -100 for token in sorted(end_of_generation)}, **(bias or {})}
    for name in ("n_predict", "cache_prompt", "json_schema", "ignore_eos"):
        out.pop(name, None)
    return out


def _parse(service: ChainService, body: dict[str, Any], chat: bool) -> Parsed:
    """The request of a completions or chat completions body (fields: :mod:`skippy.api.fields`)."""
    model = body.get("model")
    if not isinstance(model, str):
        raise invalid("model", "expected the model name (see GET /v1/models)")
    if model not in service.model_names:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{service.model_id}'.",
                       param="model", code="model_not_found")
    check_fields(body, chat)
    body = _llama_fields(body, service.generator.tokenizer.end_of_generation_tokens())
    n = get_int(body, "n", minimum=1, maximum=MAX_CHOICES)
    if not chat:
        best_of = get_int(body, "best_of", minimum=1, maximum=MAX_CHOICES)
        if best_of is not None and best_of < (n or 1):
            raise invalid("best_of", f"must be at least n ({n or 1})")
        if best_of is not None and best_of > (n or 1) and get_bool(body, "stream"):
            raise unsupported("best_of", "best_of greater than n cannot be streamed (the best are known at the end)")
    max_tokens = get_int(body, "max_tokens", minimum=1)
    if chat and max_tokens is None:
        max_tokens = get_int(body, "max_completion_tokens", minimum=1)
    stop = get_stop(body)
    if chat:  # a chat turn also ends where the template says (a base model's plain transcript: "\nuser:")
        stop = service.generator.chat_stop(stop)
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", "expected an object")
    include_usage = bool(options and options.get("include_usage"))
    sampling = _sampling(body, service.generator.tokenizer.n_vocab)
    if body.get("samplers") is not None:  # llama.cpp's sampler order (skippy/api/samplers.py)
        sampling = apply_samplers(body["samplers"], sampling)
    tokens, plan, thinking = _prompt_tokens(service, body, chat)
    echo = "" if chat or not get_bool(body, "echo") else _prompt_text(service, body, tokens)
    if not chat and max_tokens is None:
        max_tokens = min(DEFAULT_COMPLETION_TOKENS, max(1, service.generator.n_ctx - len(tokens)))
    try:
        limit = service.generator.check_fits(len(tokens), max_tokens)
    except ContextOverflow as exc:
        raise ApiError(400, str(exc), param="messages" if chat else "prompt", code="context_length_exceeded") from exc
    speculation = get_bool(body, "speculation")
    cache_key = body.get("prompt_cache_key", body.get("user"))
    if cache_key is not None and not isinstance(cache_key, str):
        raise invalid("prompt_cache_key" if "prompt_cache_key" in body else "user", "expected a string")
    prefix_cache = get_bool(body, "prefix_cache")
    if (n or 1) > 1:  # choices share one lane and run one after another: no speculation windows between them
        speculation = False
    constraints = parse_constraints(body, chat, service.generator.tokenizer)  # skippy/api/structured.py
    grammar = constraints.grammar
    if plan is not None and plan.grammar is not None:
        if grammar is not None and plan.format is generic_tools.FORMAT:
            raise unsupported("tools", "the generic tool-call format (the model's chat template renders no tools) "
                              "answers under a grammar of its own: it cannot be combined with response_format "
                              "or grammar")
        if grammar is not None:
            raise unsupported("tool_choice", "a forced tool call cannot be combined with response_format or grammar")
        grammar = plan.grammar
    split = thinking == "harmony"
    special = plan.special if plan else frozenset()
    if chat and harmony.is_harmony(service.generator.chat_template):
        # the channel markers are special tokens of gpt-oss's vocabulary: rendered for the parser (or
        # left inline with --reasoning-format none)
        special |= marker_tokens(harmony.FORMAT, lambda text: service.generator.tokenizer.encode(
            text, add_special=False, parse_special=True))
    opened = None if isinstance(thinking, str) else thinking
    request = GenerationRequest(tuple(tokens), limit, sampling, stop,
                                speculation=None if body.get("speculation") is None and (n or 1) == 1
                                else speculation,
                                prefix_cache=None if body.get("prefix_cache") is None else prefix_cache,
                                cache_namespace=cache_key,
                                render_special=special,
                                grammar=grammar, logprobs=constraints.logprobs)
    report = None if constraints.logprobs is None else LogprobsReport(service.generator.tokenizer, chat, len(echo))
    generated = n or 1
    if not chat and best_of is not None and best_of > generated:  # ranking needs each token's logprob
        generated = best_of
        if request.logprobs is None:
            request = dataclasses.replace(request, logprobs=0)
    return Parsed(request, stream, include_usage, echo, plan, n or 1, report, generated, opened, split)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class _LeasedStreamingResponse(StreamingResponse):
    """A streaming response that returns its lane even if its body never started (early disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class _Handlers:
    def __init__(self, service: ChainService) -> None:
        self.service = service
        self._parse_limiter = trio.CapacityLimiter(1)
        self._health_ok_at = -math.inf

    async def chain_error(self, exc: StageClientError) -> ApiError:
        """A 503 naming the stage that is lost, when it can be told."""
        pool = self.service.pool
        pool.suspect = True
        await pool.discard_idle()
        named = await pool.name_lost_stage() if pool.stages else None
        detail = f"{named}: {exc}" if named else str(exc)
        return ApiError(503, f"The model chain is unavailable: {detail}", type="service_unavailable",
                        code="stage_unavailable")

    async def start(self, request: GenerationRequest, raw: Request | None = None) -> tuple[Lease, Generation, str]:
        """Lease a lane and run the first exchange (up to the first token); ``raw``: the HTTP
        request, whose client leaving while it waits for a lane ends the wait."""
        pool = self.service.pool
        if pool.suspect:  # the chain failed recently: answer quickly rather than wait on a dead stage
            problem = await pool.check()
            if problem is not None:
                raise ApiError(503, f"The model chain is unavailable: {problem}", type="service_unavailable",
                               code="stage_unavailable")
        admission = self.service.admission
        deadline = admission.deadline()
        attempt = 0
        while True:
            try:
                lease = await (admission.acquire(deadline) if raw is None
                               else admission.acquire_while_present(deadline, raw.receive))
            except StageLost as exc:
                raise await self.chain_error(exc) from exc
            self.service.metrics.lanes_open.set(pool.open_lanes)
            generation = self.service.generator.start(lease.client, request, pool.new_session_id())
            try:
                first = await generation.__anext__()
            except StopAsyncIteration:
                first = ""
            except SamplingExtensionRefused as exc:  # the chain is up but cannot serve this request's sampling
                await self._release(lease)
                raise ApiError(501, str(exc), type="not_implemented",
                               param="response_format" if request.grammar is not None else "logprobs",
                               code="unsupported_by_chain") from exc
            except StageClientError as exc:
                await self._release(lease)
                if not is_overloaded(exc):
                    raise await self.chain_error(exc) from exc
                self.service.metrics.overload_retries.inc()
                await admission.retry_after_overload(attempt, deadline, exc)  # a session not yet freed
                attempt += 1
                continue
            except BaseException:
                await self._release(lease)
                raise
            self.service.metrics.first_token(generation.timing)
            return lease, generation, first

    async def _release(self, lease: Lease) -> None:
        self.service.admission.released(lease)
        await self.service.pool.release(lease)

    def fork_choices(self, lease: Lease, parent: Generation, parsed: Parsed) -> list["_Choice"]:
        """Choices 1..n-1: each a session forked from the first choice's prompt KV on every stage
        (the prompt is prefilled once). Nothing is sent yet: a fork starts when it is run (see
        :func:`_run_order`), so one request holds at most two sessions of its lane at a time."""
        stages = parent.timing.chain_stages
        return [_Choice(index, self.service.generator.start(lease.client, parsed.choice_request(index),
                                                            self.service.pool.new_session_id(),
                                                            fork=(parent.session_id, stages),
                                                            fork_at=parent.fork_point), "", parsed)
                for index in range(1, max(parsed.n, parsed.generated))]

    async def finish(self, lease: Lease, generations: list[Generation]) -> None:
        """Return the lane and record the runs; idempotent (a stream calls it from two places)."""
        if lease.returned:
            return
        lease.returned = True
        self.service.metrics.in_flight.dec()
        lease.clean = all(generation.result is not None for generation in generations)
        if not lease.clean:  # the client went away: stop the session on every stage, keep the lane
            with trio.CancelScope(shield=True, deadline=trio.current_time() + ABORT_TIMEOUT):
                try:
                    for generation in generations:
                        if not await generation.abort():
                            break
                    else:
                        lease.clean = True
                except StageClientError:
                    lease.clean = False
            counter = self.service.metrics.lanes_kept_after_abort if lease.clean else \
                self.service.metrics.lanes_closed_after_abort
            counter.inc()
        await self._release(lease)
        self.service.metrics.lanes_open.set(self.service.pool.open_lanes)
        for generation in generations:
            if generation.result is not None:
                self.service.metrics.generation_done(generation.timing, generation.result.completion_tokens)
                self.service.history.generation_done(generation.timing, generation.result.completion_tokens)
                if generation.result.speculation is not None:
                    self.service.metrics.speculation_done(generation.result.speculation)
                self.service.metrics.prefix_cache_done(generation.request, generation.result.cached_tokens)

    async def generate(self, raw: Request, chat: bool) -> Response:
        endpoint = "chat_completions" if chat else "completions"
        metrics = self.service.metrics
        data = await raw.body()
        if len(data) <= INLINE_PARSE_BYTES:
            parsed = _parse(self.service, parse_json_object(data), chat)
        else:  # tokenising megabytes takes seconds: not on the event loop, and one body at a time
            parsed = await trio.to_thread.run_sync(lambda: _parse(self.service, parse_json_object(data), chat),
                                                   limiter=self._parse_limiter)
        tenant = scope_tenant(raw.scope, self.service.keys)
        parsed = dataclasses.replace(parsed, request=dataclasses.replace(
            parsed.request, cache_namespace=tenant.cache_namespace(parsed.request.cache_namespace)))
        metrics.in_flight.inc()
        try:
            lease, generation, first = await self.start(parsed.request, raw)
        except BaseException:
            metrics.in_flight.dec()
            raise
        choices = [_Choice(0, generation, first, parsed)] + self.fork_choices(lease, generation, parsed)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        generations = [choice.generation for choice in choices]
        if parsed.stream:
            metrics.request_done(endpoint, 200)
            return _LeasedStreamingResponse(self.stream(lease, choices, ident, chat, parsed),
                                            lambda: self.finish(lease, generations))
        try:
            for choice in _run_order(choices):
                async for piece in choice.generation:
                    choice.text.append(piece)
        except StageClientError as exc:
            raise await self.chain_error(exc) from exc
        finally:
            await self.finish(lease, generations)
        metrics.request_done(endpoint, 200)
        shown = _best(choices, parsed.n) if len(choices) > parsed.n else choices
        return JSONResponse({
            "id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.service.model_id, "system_fingerprint": None,
            "choices": [choice.whole(chat) for choice in shown], "usage": _usage(generations),
        })

    async def stream(self, lease: Lease, choices: list["_Choice"], ident: str, chat: bool,
                     parsed: Parsed) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = self.service.model_id
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> bytes:
            return _sse({"id": ident, "object": kind, "created": created, "model": model,
                         "system_fingerprint": None, "choices": [{"logprobs": None, **choice}]})

        try:
            for choice in _run_order(choices):
                for delta in choice.opening(chat):
                    yield chunk(delta)
                try:
                    while True:
                        with trio.CancelScope(shield=True):  # a client that leaves stops us between steps
                            try:
                                piece = await choice.generation.__anext__()
                            except StopAsyncIteration:
                                break
                        for delta in choice.piece(piece, chat):
                            yield chunk(delta)
                except StageClientError as exc:
                    error = await self.chain_error(exc)
                    yield _sse(error.body())
                    return
                except Exception as exc:  # a bug: the stream still ends with an OpenAI-shaped error event
                    log.exception("stream %s failed", ident)
                    yield _sse(internal_error(exc).body())
                    return
                for delta in choice.closing(chat):
                    yield chunk(delta)
            if parsed.include_usage:
                yield _sse({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                            "usage": _usage([choice.generation for choice in choices])})
            yield _sse("[DONE]")
        finally:
            await self.finish(lease, [choice.generation for choice in choices])

    # -- routes --------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        self.service.metrics.request_done("models", 200)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.service.created, "owned_by": "skippy"}
            for name in self.service.model_names
        ]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.service.model_names:
            raise ApiError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return JSONResponse({"id": name, "object": "model", "created": self.service.created, "owned_by": "skippy"})

    async def tokenize(self, request: Request) -> Response:
        """llama-server's POST /tokenize: ``content``, ``add_special`` (false), ``parse_special`` (true),
        ``with_pieces`` (false: ids; true: ``{"id", "piece"}`` with the piece as a string when it is
        valid UTF-8, else its byte values)."""
        body = parse_json_object(await request.body())
        unknown = sorted(set(body) - {"content", "add_special", "parse_special", "with_pieces"})
        if unknown:
            raise unsupported(unknown[0], "POST /tokenize reads content, add_special, parse_special, with_pieces")
        content = body.get("content")
        if not isinstance(content, str):
            raise invalid("content", "expected the text to tokenize")
        add_special = get_bool(body, "add_special")
        parse_special = body.get("parse_special", True)
        if not isinstance(parse_special, bool):
            raise invalid("parse_special", f"expected a boolean, got {json.dumps(parse_special)}")
        tokenizer = self.service.generator.tokenizer
        if len(content) <= INLINE_PARSE_BYTES:
            tokens = tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
        else:  # as for generation bodies: megabytes are tokenised off the event loop, one at a time
            tokens = await trio.to_thread.run_sync(
                lambda: tokenizer.encode(content, add_special=add_special, parse_special=parse_special),
                limiter=self._parse_limiter)
        out: list[Any] = list(tokens)
        if get_bool(body, "with_pieces"):
            out = []
            for token in tokens:
                raw = tokenizer.piece(token, special=True)
                try:
                    piece: Any = raw.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(raw)
                out.append({"id": token, "piece": piece})
        self.service.metrics.request_done("tokenize", 200)
        return JSONResponse({"tokens": out})

    async def detokenize(self, request: Request) -> Response:
        """llama-server's POST /detokenize: ``tokens`` -> ``{"content": text}`` (special tokens rendered)."""
        body = parse_json_object(await request.body())
        unknown = sorted(set(body) - {"tokens"})
        if unknown:
            raise unsupported(unknown[0], "POST /detokenize reads tokens")
        tokens = body.get("tokens")
        tokenizer = self.service.generator.tokenizer
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise invalid("tokens", "expected a list of token ids")
        if not all(0 <= t < tokenizer.n_vocab for t in tokens):
            raise invalid("tokens", f"token ids must be in 0..{tokenizer.n_vocab - 1}")
        text = b"".join(tokenizer.piece(t, special=True) for t in tokens).decode("utf-8", "replace")
        self.service.metrics.request_done("detokenize", 200)
        return JSONResponse({"content": text})

    async def health(self, request: Request) -> Response:
        """200 when the whole chain answers, else 503.  Served without a key; then (when keys are
        configured) only the status is told, not the model, the stage addresses or the error."""
        pool = self.service.pool
        now = trio.current_time()
        lost = pool.events is not None and bool(pool.events.lost())  # docs/replacement.md: said at once
        if not pool.suspect and not lost and now - self._health_ok_at < HEALTH_REUSE_S:
            problem = None  # a healthy answer a moment ago: a flood of probes does not dial the chain
        else:
            problem = await pool.check()
            if problem is None:
                self._health_ok_at = trio.current_time()
        status = 200 if problem is None else 503
        self.service.metrics.request_done("health", status)
        body: dict[str, Any] = {"status": "ok" if problem is None else "unavailable"}
        if not self.service.keys.required or is_authenticated(request.scope):
            body.update(model=self.service.model_id, first_stage=str(pool.address))
            if problem is not None:
                body["error"] = problem
        return JSONResponse(body, status_code=status)

    async def metrics(self, request: Request) -> Response:
        return Response(self.service.metrics.render(), media_type=self.service.metrics.content_type)


_ENDPOINTS = {"/v1/models": "models", "/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
              "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens",
              "/v1/responses": "responses", "/v1/responses/input_tokens": "responses_input_tokens",
              "/tokenize": "tokenize", "/detokenize": "detokenize", "/health": "health", "/metrics": "metrics",
              "/chain": "chain", **{path: "page" for path in ASSET_PATHS}}


def endpoint_label(path: str) -> str:
    """The metrics label of a request path: one of the served endpoints, ``model``, or ``other``
    (never the path itself, which a client chooses: labels must stay a small fixed set)."""
    if path.startswith(("/v1/models/", "/models/")):
        return "model"
    return _ENDPOINTS.get(path, _ENDPOINTS.get("/v1" + path, "other"))


def create_app(service: ChainService) -> Starlette:
    """The ASGI app serving ``service``."""
    from skippy.api.messages import MessagesHandlers  # they build on this module's handlers
    from skippy.api.responses import ResponsesHandlers

    handlers = _Handlers(service)
    messages = MessagesHandlers(handlers)
    responses = ResponsesHandlers(handlers)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        path = request.url.path
        # Anthropic answers every malformed request 400 (invalid_request_error); OpenAI's field checks are 422
        status = 400 if exc.status == 422 and is_anthropic_path(path) else exc.status
        service.metrics.request_done(endpoint_label(path), status)
        return JSONResponse(exc.body_for(path), status_code=status, headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        error = internal_error(exc)
        return JSONResponse(error.body_for(request.url.path), status_code=error.status)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        error = ApiError(status, f"{request.method} {request.url.path} is not served here",
                         code="not_found" if status == 404 else "method_not_allowed")
        return JSONResponse(error.body_for(request.url.path), status_code=status)

    routes = [
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{model:path}", handlers.model, methods=["GET"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/input_tokens", responses.input_tokens, methods=["POST"]),
    ]
    # the same routes without /v1: clients whose base_url lacks it (llama-server serves both)
    routes += [Route(route.path.removeprefix("/v1"), route.endpoint, methods=sorted(route.methods or ()))
               for route in routes]
    routes += [
        Route("/tokenize", handlers.tokenize, methods=["POST"]),
        Route("/detokenize", handlers.detokenize, methods=["POST"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/metrics", handlers.metrics, methods=["GET"]),
        *page_routes(service),
    ]
    handlers_map: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: api_error, 404: not_found, 405: not_found, Exception: unexpected,
    }

    def refused(path: str) -> None:
        service.metrics.request_done(endpoint_label(path), 401)

    # Outermost first: CORS answers preflights before keys are asked for; the guard runs after auth.
    middleware = [Middleware(AuthMiddleware, keys=service.keys, public_paths=PUBLIC_PATHS | ASSET_PATHS,
                             on_refused=refused),
                  Middleware(RequestGuard, max_body_bytes=service.max_body_bytes)]
    if service.cors_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(service.cors_origins),
                                        allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type", "x-api-key",
                                                                       "anthropic-version", "anthropic-beta"],
                                        max_age=600))
    return Starlette(routes=routes, exception_handlers=handlers_map, middleware=middleware)
