"""``skippy certs DIR --stages N [--drivers M]``: a chain CA and its stages' and drivers' certificates.

Writes ``ca.pem`` / ``ca.key`` (reused when already there), ``stage-0.pem`` / ``stage-0.key`` ... and
``driver-0.pem`` / ``driver-0.key`` ... (or the ``--name`` members given) into DIR, for stage links
with mutual TLS (``python -m skippy.stage --tls on --tls-cert DIR/stage-0.pem --tls-key
DIR/stage-0.key --tls-ca DIR/ca.pem``; docs/security.md).  Keep ``ca.key`` away from the stages:
only this command needs it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("certs", help="make a chain CA and certificates for stage links (mutual TLS)",
                                   description=__doc__)
    parser.add_argument("directory", type=Path, help="where the files go (created if missing)")
    parser.add_argument("--stages", type=int, default=0, help="certificates stage-0 .. stage-(N-1)")
    parser.add_argument("--drivers", type=int, default=1, help="certificates driver-0 .. driver-(M-1) (default 1)")
    parser.add_argument("--name", action="append", default=[], help="another member's certificate (repeatable)")
    parser.add_argument("--host", action="append", default=[],
                        help="DNS name or IP address added to every certificate (repeatable; informational)")
    parser.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from skippy.deploy.certs import make_chain_certificates

    names = [f"stage-{i}" for i in range(max(0, args.stages))] + [f"driver-{i}" for i in range(max(0, args.drivers))]
    names += args.name
    if not names:
        print("skippy certs: nothing to make (give --stages, --drivers or --name)")
        return 2
    try:
        written = make_chain_certificates(args.directory, names, hosts=args.host, days=args.days)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"skippy certs: {exc}")
        return 2
    for path in written:
        print(path)
    return 0
