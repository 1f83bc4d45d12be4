"""``skippy`` / ``python -m skippy``: the user-facing commands.

Each subcommand lives in its own module under :mod:`skippy.commands` and registers itself with
``add_parser(subparsers)``; this module only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

#: Subcommand name -> module under skippy.commands.
COMMANDS = {
    "generate": "skippy.commands.generate",
    "serve": "skippy.commands.serve",
    "up": "skippy.commands.up",
    "demo": "skippy.commands.demo",
    "plan": "skippy.commands.plan",
    "certs": "skippy.commands.certs",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skippy", description=__doc__.splitlines()[0] if __doc__ else None)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
