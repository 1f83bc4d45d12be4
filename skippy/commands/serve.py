"""``skippy serve --model M.gguf --first-stage HOST:PORT``: the OpenAI-compatible API for a running chain.

Strategy: the stages run elsewhere (``python -m skippy.stage`` on each host); this process loads
only the model's vocabulary and chat template and serves HTTP with hypercorn under trio until
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import trio

from skippy.commands.api_options import add_api_options, api_settings


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible API for a running chain",
                                   description=__doc__)
    parser.add_argument("--model", type=Path, required=True,
                        help="the chain's GGUF model (only its vocabulary and chat template are read)")
    parser.add_argument("--first-stage", required=True, help="HOST:PORT of the chain's first stage")
    parser.add_argument("--final-stage", help="HOST:PORT of the chain's final stage: its predictions then come "
                        "straight back over a return lane per request (--direct-return; docs/protocol.md §8)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000, 0 = any)")
    parser.add_argument("--model-id", help="model name served in /v1/models (default: file name)")
    parser.add_argument("--ctx-size", type=int, help="context length a request must fit (default: the "
                        "model's, at most 4096; match the stages' --ctx-size)")
    parser.add_argument("--max-lanes", type=int, default=8,
                        help="concurrent requests, one lane each (default 8; <= the stages' --max-sessions)")
    tls = parser.add_argument_group("mutual TLS to the chain (docs/security.md; skippy certs makes the files)")
    tls.add_argument("--tls", choices=["auto", "on", "off"], default="auto",
                     help="TLS to the first stage: on, off, or auto = on when it is not on a loopback address")
    tls.add_argument("--tls-cert", type=Path, help="this driver's certificate (DIR/driver-0.pem)")
    tls.add_argument("--tls-key", type=Path, help="this driver's private key")
    tls.add_argument("--tls-ca", type=Path, help="the chain CA certificate (DIR/ca.pem)")
    add_api_options(parser)
    parser.set_defaults(run=run)


def driver_tls(args: argparse.Namespace, first: Any) -> Any:
    """The driver's TLS context for the chain, or None (plain TCP).

    Raises:
        ValueError: TLS is on and a file is missing or unreadable.
    """
    import ssl

    from skippy.net.tls import TlsFiles, client_context, link_uses_tls

    if not link_uses_tls(args.tls, first.host):
        return None
    if None in (args.tls_cert, args.tls_key, args.tls_ca):
        raise ValueError(f"the first stage {first} is reached with TLS (--tls {args.tls}): give --tls-cert, "
                         "--tls-key and --tls-ca (skippy certs makes them), or --tls off on a trusted network")
    try:
        return client_context(TlsFiles(args.tls_cert, args.tls_key, args.tls_ca))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the driver's TLS files: {exc}") from exc


async def _main(args: argparse.Namespace) -> None:
    from skippy.api.server import serve_api
    from skippy.deploy.launch import cancel_on_signal
    from skippy.net.address import Address

    first = Address.parse(args.first_stage)
    final = Address.parse(args.final_stage) if args.final_stage else None
    stage_tls = driver_tls(args, first)
    settings = api_settings(args)
    await _check_model(first, args.model, stage_tls)
    got: list[int] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_signal, received, nursery.cancel_scope, got)
            url = await nursery.start(lambda task_status: serve_api(
                args.model, first, host=args.host, port=args.port, model_id=args.model_id, n_ctx=args.ctx_size,
                max_lanes=args.max_lanes, task_status=task_status, stage_tls=stage_tls, final_stage=final,
                **settings))
            print(f"skippy API for {args.model.name} on {url} (first stage {first}); Ctrl-C stops it", flush=True)
            print(f"  page {url}/  (the chain live, a chat)", flush=True)


async def _check_model(first: Any, model: Path, tls: Any = None) -> None:
    """docs/protocol.md §9: refuse a first stage that serves another model file (ValueError)."""
    from skippy.identity import check_first_stage

    try:
        problem = await check_first_stage(first, model, tls=tls)
    except OSError as exc:  # not up yet: lanes will retry; the check is the stages' job then
        logging.getLogger("skippy.api").warning("cannot ask first stage %s for its model identity: %s", first, exc)
        return
    if problem is not None:
        raise ValueError(problem)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.model.is_file():
        print(f"error: model file {args.model} does not exist", file=sys.stderr)
        return 2
    try:
        trio.run(_main, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
