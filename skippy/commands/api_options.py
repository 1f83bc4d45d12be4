"""The API's exposure options shared by ``skippy up`` and ``skippy serve``: keys, limits, queue, CORS.

Strategy: :func:`add_api_options` declares the flags once; :func:`api_settings` turns the parsed
arguments into the keyword arguments of :func:`skippy.api.server.serve_api` (reading a key file
here, so a bad one is reported before anything starts).  A namespace without these attributes
(``skippy demo``) gets the defaults: no keys, the default limits.
"""

from __future__ import annotations

import argparse
from typing import Any

from skippy.api.admission import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT
from skippy.api.auth import API_KEY_ENV, CACHE_SALT_ENV, ApiKeys
from skippy.api.guard import DEFAULT_MAX_BODY_BYTES


def add_api_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("API exposure")
    group.add_argument("--api-key", metavar="KEY|FILE",
                       help="require 'Authorization: Bearer KEY': one key, or a file of keys (one a line, each its "
                            f"own tenant); default ${API_KEY_ENV}, else no key (one anonymous tenant). A file keeps "
                            "keys out of the process list")
    group.add_argument("--cache-salt", help="secret mixed into every tenant's prefix-cache namespace "
                                            f"(default ${CACHE_SALT_ENV}, else none)")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"largest request body; larger ones get 413 unread (default {DEFAULT_MAX_BODY_BYTES})")
    group.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                       help="requests that may wait for a lane; beyond it 429 + Retry-After "
                            f"(default {DEFAULT_MAX_QUEUE})")
    group.add_argument("--queue-timeout", type=float, default=DEFAULT_QUEUE_TIMEOUT,
                       help=f"seconds a request may wait for a lane before 429 (default {DEFAULT_QUEUE_TIMEOUT:g})")
    group.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="allow browser calls from ORIGIN (repeatable; '*' for any); default: no CORS")
    generation = parser.add_argument_group("generation")
    generation.add_argument("--chat-template", metavar="NAME|FILE",
                            help="serve this chat template instead of the model's own: a built-in one's name "
                                 "(e.g. chatml, llama3, gemma; 'plain' for role: content lines) or a Jinja file")
    generation.add_argument("--alias", action="append", default=[], metavar="NAME",
                            help="another name clients may give as 'model' (repeatable; listed by /v1/models)")
    generation.add_argument("--reasoning-format", choices=["auto", "none"], default="auto",
                            help="auto (default): a chat template that writes <think> reasoning gets it split off "
                                 "the answer into message.reasoning_content (Anthropic thinking blocks, Responses "
                                 "reasoning items); none: the reasoning stays inline in the content"),
    generation.add_argument("--decode-runs", choices=["on", "off"], default="on",
                            help="on (default): a request that does not speculate decodes as one run driven by the "
                                 "first stage (docs/protocol.md §11); off: one DecodeEmbd per token from the driver")
    generation.add_argument("--resume-attempts", type=int, default=3, metavar="N",
                            help="a request that loses a stage waits for its replacement (same address) and "
                                 "resumes where it was (docs/protocol.md §14); after N failed tries it fails with "
                                 "503 naming the stage (0: no resume, fail at once)")
    generation.add_argument("--resume-wait", type=float, default=30.0, metavar="SECONDS",
                            help="how long each resume try waits for the lost stage's address to accept again")
    generation.add_argument("--direct-return", choices=["auto", "on", "off"], default="auto",
                            help="a request that does not speculate gets its predictions straight from the final "
                                 "stage over a return lane instead of back through every stage (docs/protocol.md "
                                 "§8; decoded one DecodeEmbd per token, without decode runs, which the stages before "
                                 "the final one relay outside Python). auto (default): on for chains of two or more "
                                 "stages whose addresses are known (skippy up), or when --final-stage is given; on: "
                                 "the same, and an error when no final stage is known")


def api_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``serve_api`` keyword arguments from the parsed options.

    Raises:
        ValueError: a key file that cannot be read or holds no key; a bad limit.
    """
    max_body = getattr(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    max_queue = getattr(args, "max_queue", DEFAULT_MAX_QUEUE)
    timeout = getattr(args, "queue_timeout", DEFAULT_QUEUE_TIMEOUT)
    if max_body < 1:
        raise ValueError(f"--max-body-bytes must be positive (got {max_body})")
    if max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0 (got {max_queue})")
    if not timeout > 0:
        raise ValueError(f"--queue-timeout must be > 0 (got {timeout})")
    return {
        "keys": ApiKeys.from_option(getattr(args, "api_key", None), salt=getattr(args, "cache_salt", None)),
        "max_body_bytes": max_body, "max_queue": max_queue, "queue_timeout": timeout,
        "cors_origins": tuple(getattr(args, "cors_origin", ()) or ()),
        "decode_runs": getattr(args, "decode_runs", "on") == "on",
        "resume_attempts": max(0, getattr(args, "resume_attempts", 3)),
        "resume_wait_s": getattr(args, "resume_wait", 30.0),
        "direct_return": getattr(args, "direct_return", "auto"),
        "reasoning_format": getattr(args, "reasoning_format", "auto"),
        "chat_template": getattr(args, "chat_template", None),
        "aliases": tuple(getattr(args, "alias", ()) or ()),
    }
