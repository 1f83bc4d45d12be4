"""``skippy plan``: split a model over hosts by memory (and speed), print it, write a plan file.

Strategy: the work is :mod:`skippy.plan` (header-only shape, memory model, split search); this
module parses the command line, optionally measures decode time here (``--measure``), prints the
plan and writes its TOML file.  An impossible plan exits with status 1 and the planner's message
(each short host and by how much); bad arguments exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan", help="split a model's layers over hosts by memory and speed; write a plan file",
        description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="the GGUF model (only its header is read)")
    parser.add_argument("--hosts", nargs="+", required=True, metavar="HOST",
                        help="one per stage, in chain order: NAME=MEMORY[,gpu=MEMORY][,speed=X][,port=N], "
                             "e.g. 10.0.0.1=16GiB 10.0.0.2=8GiB,gpu=24GiB (NAME is the address the previous "
                             "stage dials; port default 7000)")
    parser.add_argument("--ctx-size", type=int, default=4096, help="KV cells per stage, shared by its sessions "
                        "(default 4096)")
    parser.add_argument("--max-sessions", type=int, default=8, help="concurrent sessions (default 8)")
    parser.add_argument("--batch-size", type=int, default=512, help="rows per llama.cpp batch (default 512)")
    parser.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "q8"],
                        help="activation dtype between stages (default f32)")
    parser.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                        help="whether the stages keep a prefix cache (its spill tier counts against memory)")
    parser.add_argument("--cache-spill-mib", type=float, default=256.0,
                        help="host memory each stage may spill cached prefixes to (default 256)")
    parser.add_argument("--bandwidth-gbs", type=float, default=20.0,
                        help="memory bandwidth assumed for decode-time estimates without --measure (default 20)")
    parser.add_argument("--measure", action="store_true",
                        help="time a whole-model decode on this machine (loads the model) and share it out by "
                             "layer bytes, instead of estimating from bandwidth")
    parser.add_argument("--output", "-o", type=Path, help="write the TOML plan here (default: print it)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from skippy.plan import HostSpec, ModelShape, PlanError, PlanSettings, measure_layer_times, plan_chain
    from skippy.runtime.errors import NativeError

    try:
        hosts = [HostSpec.parse(text) for text in args.hosts]
        settings = PlanSettings(ctx_size=args.ctx_size, max_sessions=args.max_sessions,
                                batch_size=args.batch_size, cache_spill_mib=args.cache_spill_mib,
                                prefix_cache=args.prefix_cache == "on", wire_dtype=args.wire_dtype,
                                bandwidth_gbs=args.bandwidth_gbs)
        shape = ModelShape.from_gguf(args.model.resolve())
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    layer_ms = head_ms = None
    if args.measure:
        try:
            layer_ms, head_ms = measure_layer_times(shape)
        except NativeError as exc:  # the model does not load here: nothing to measure with
            print(f"error: cannot measure {shape.path.name} here: {exc}", file=sys.stderr)
            return 2
    try:
        plan = plan_chain(shape, hosts, settings, layer_ms=layer_ms, head_ms=head_ms)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(plan.describe())
    text = plan.to_toml()
    if args.output is None:
        print()
        print(text, end="")
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}; on each host: python -m skippy.stage --config {args.output} --plan-stage N "
              f"(N = 0..{len(plan.stages) - 1}); on one machine: skippy up --plan {args.output}")
    return 0
