"""Run the API app with hypercorn inside the caller's trio run.

Strategy: :func:`serve_api` builds the service (vocab-only tokenizer, chat template, lane pool),
binds with hypercorn's trio worker and reports the bound URL through ``task_status`` (port 0 picks
a free port), so a launcher can start it with ``nursery.start`` like any other ready-signalling
task.  Cancelling the task stops the server; the lanes are closed on the way out.
"""

from __future__ import annotations

import functools
import logging
import ssl
from pathlib import Path
from typing import Callable, Sequence

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from skippy.api.admission import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT, Admission
from skippy.api.app import ChainService, create_app
from skippy.api.auth import ApiKeys
from skippy.api.guard import DEFAULT_MAX_BODY_BYTES
from skippy.api.lanes import LanePool, StageInfo
from skippy.api.reasoning import FORMATS as REASONING_FORMATS
from skippy.driver.generator import Generator
from skippy.net.address import Address

log = logging.getLogger("skippy.api")


def model_id_for(path: Path) -> str:
    """The name the API serves a model file under: its file name without ``.gguf``."""
    return path.name.removesuffix(".gguf")


#: Chains of at least this many stages use direct return under ``auto``.  With the decode relay
#: (``skippy.stage.decode_relay``, which only carries direct-return decodes) it pays from two
#: stages on: on the development host 2 stages decoded at 99.8-101.0% of stock llama.cpp with it
#: against 97.8-99.4% hop by hop, 4 stages at 96.9-97.1% against 91.3-96.5%
#: (bench/RESULTS-stage.md, "Session 9"; before the relay, 2 stages were level).
DIRECT_RETURN_MIN_STAGES = 2


def direct_return_source(mode: str, pool: LanePool,
                         final_stage: Address | None) -> Callable[[], Address | None] | None:
    """Where the API's requests get their predictions from (docs/protocol.md §8), or None (hop by hop).

    ``off``: never.  ``auto``: when ``final_stage`` is given, or the pool knows the chain's stages
    and there are at least :data:`DIRECT_RETURN_MIN_STAGES`.  ``on``: whenever a final stage is
    known.  The address is read per request from the pool's stages (a launcher that restarts a
    stage updates them), else ``final_stage``.

    Raises:
        ValueError: ``on`` with no final stage known, or an unknown mode.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"direct return must be auto, on or off (got {mode!r})")
    if mode == "off":
        return None
    known = len(pool.stages)
    if final_stage is None and not known:
        if mode == "on":
            raise ValueError("direct return is on but the chain's final stage is not known: give --final-stage "
                             "HOST:PORT")
        return None
    if mode == "auto" and final_stage is None and known < DIRECT_RETURN_MIN_STAGES:
        return None

    def current() -> Address | None:
        return pool.stages[-1].address if pool.stages else final_stage

    return current


async def serve_api(model: Path, first_stage: Address, *, host: str = "127.0.0.1", port: int = 8000,
                    model_id: str | None = None, n_ctx: int | None = None, max_lanes: int = 8,
                    stages: Sequence[StageInfo] = (), reply_timeout: float = 30.0,
                    keys: ApiKeys | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                    max_queue: int = DEFAULT_MAX_QUEUE, queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
                    cors_origins: Sequence[str] = (), stage_tls: ssl.SSLContext | None = None,
                    on_pool: Callable[[LanePool], None] | None = None, decode_runs: bool = True,
                    resume_attempts: int = 0, resume_wait_s: float = 30.0,
                    direct_return: str = "auto", final_stage: Address | None = None,
                    reasoning_format: str = "auto", chat_template: str | None = None,
                    aliases: Sequence[str] = (),
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the OpenAI-compatible API for the chain at ``first_stage`` until cancelled.

    Args:
        model: the GGUF file (only its vocabulary and chat template are read).
        first_stage: the chain's first stage.
        host, port: where to listen (port 0: any free port).
        model_id: the model name clients use (default: the file name without ``.gguf``).
        n_ctx: context length requests must fit (default: min(trained context, 4096)).
        max_lanes: concurrent requests (lanes); keep it <= the stages' ``--max-sessions``.
        stages: every stage, when known, so errors can name a lost one.
        keys: accepted API keys and cache salt (None: no keys).
        max_body_bytes: request-body limit (413 above it).
        max_queue, queue_timeout: requests that may wait for a lane, and for how long (429 beyond).
        cors_origins: origins allowed to call from browsers (none: CORS off).
        stage_tls: the driver's mutual-TLS context for the chain's links (None: plain TCP).
        on_pool: called with the lane pool once made (a launcher that moves stages re-points it).
        decode_runs: requests that do not speculate decode as runs driven by the first stage
            (docs/protocol.md §11).
        resume_attempts, resume_wait_s: a request that loses a stage resumes on its replacement
            (docs/protocol.md §14) after waiting up to ``resume_wait_s`` for its address, at most
            ``resume_attempts`` failed tries (0: it fails at once).
        direct_return: ``auto``, ``on`` or ``off``: see :func:`direct_return_source`.
        final_stage: the chain's final stage when ``stages`` is not given (direct return).
        chat_template: a built-in template's name or a Jinja file to serve instead of the model's
            (``Generator.from_model``).
        aliases: more names clients may give as ``model`` (listed by ``/v1/models`` too).
        reasoning_format: ``auto``: a ``<think>`` template's reasoning is split into
            ``reasoning_content``; ``none``: left inline (skippy.api.reasoning).
        task_status: receives the base URL once listening.

    Raises:
        ValueError: direct return is on but no final stage is known; an unknown reasoning format.
    """
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning format must be one of {', '.join(REASONING_FORMATS)} (got {reasoning_format!r})")
    # off the loop: it may be shared with heartbeats due within ~1 s (``skippy up``), and a big
    # vocabulary on a busy host loads for longer (every stage then looked lost at once)
    generator = await trio.to_thread.run_sync(functools.partial(
        Generator.from_model, model, n_ctx=n_ctx, decode_runs=decode_runs, chat_template=chat_template))
    generator.resume_attempts, generator.resume_wait_s = resume_attempts, resume_wait_s
    generator.first_stage = lambda: pool.address  # a launcher that moves the first stage re-points the pool
    pool = LanePool(first_stage, max_lanes=max_lanes, stages=stages, reply_timeout=reply_timeout, tls=stage_tls)
    try:
        generator.direct_return = direct_return_source(direct_return, pool, final_stage)
    except ValueError:
        generator.close()
        raise
    if on_pool is not None:
        on_pool(pool)
    service = ChainService(generator, pool, model_id or model_id_for(model), keys=keys, aliases=tuple(aliases),
                           admission=Admission(pool, max_queue=max_queue, timeout=queue_timeout),
                           max_body_bytes=max_body_bytes, cors_origins=tuple(cors_origins))
    service.reasoning_format = reasoning_format
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = log
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 30.0
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, create_app(service), config)
            url = binds[0] if binds else f"http://{host}:{port}"
            log.info("serving %s on %s (first stage %s; %s)", service.model_id, url, first_stage,
                     f"{len(service.keys)} API keys" if service.keys.required else "no API key: open to anyone "
                     "who can reach it")
            task_status.started(url)
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()
        generator.close()
