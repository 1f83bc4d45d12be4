"""``skippy plan``: split a model over hosts by memory and compute cost, print it, write a plan file.

Strategy: the work is :mod:`skippy.deploy.plan` (header-only shape, memory model, split search); this
module parses the command line, takes the hosts from ``--hosts`` or from a Ray cluster's alive
nodes (``--ray [ADDRESS]``, :mod:`skippy.deploy.ray_plan`), estimates each layer's and the output head's
decode time from the model's shapes (:mod:`skippy.deploy.cost`) or measures it
(``--measure``: on each Ray node a host is, else on this machine, and a host that is neither
keeps this machine's figure, said on its line), prints the plan and writes its TOML file.  An
impossible plan exits with status 1 and the planner's message
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
    parser.add_argument("--hosts", nargs="+", metavar="HOST",
                        help="one per stage, in chain order: NAME=MEMORY[,gpu=MEMORY][,speed=X][,port=N], "
                             "e.g. 10.0.0.1=16GiB 10.0.0.2=8GiB,gpu=24GiB (NAME is the address the previous "
                             "stage dials; port default 7000); without it, --ray's nodes")
    parser.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                        help="a Ray cluster (ADDRESS, default: RAY_ADDRESS or a local one): without --hosts, one "
                             "stage per alive node with a CPU (memory from its Ray memory resource, GPU memory from "
                             "its gpu_memory resource or nvidia-smi), written as ray_node for skippy up --ray --plan; "
                             "with --measure, every host that is a node is measured on it (needs skippy-llm[ray])")
    parser.add_argument("--ctx-size", type=int, default=4096, help="KV cells per stage, shared by its sessions "
                        "(default 4096)")
    parser.add_argument("--max-sessions", type=int, default=8,
                        help="concurrent sessions (default 8); the cut is priced for each stage's batch under them "
                             "and for one row")
    parser.add_argument("--kv-streams", action="store_true",
                        help="plan for stages run with --kv-streams on: ctx-size KV cells per session and cache "
                             "slot instead of shared")
    parser.add_argument("--batch-size", type=int, default=512, help="rows per llama.cpp batch (default 512)")
    parser.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "q8"],
                        help="activation dtype between stages (default f32)")
    parser.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                        help="whether the stages keep a prefix cache (its spill tier counts against memory)")
    parser.add_argument("--cache-spill-mib", type=float, default=256.0,
                        help="host memory each stage may spill cached prefixes to (default 256)")
    parser.add_argument("--bandwidth-gbs", type=float, default=20.0,
                        help="memory bandwidth assumed for decode-time estimates without --measure (default 20)")
    parser.add_argument("--compute-gmacs", type=float, default=8.0,
                        help="compute assumed per stage for decode-time estimates without --measure, in billions "
                             "of multiply-adds a second (default 8: one core of a recent x86 on quantized weights)")
    parser.add_argument("--measure", action="store_true",
                        help="time each layer and the output head with the runtime in each stage's batch under "
                             "--max-sessions and at one row (loads each layer once) instead of estimating from the "
                             "shapes: on each Ray node with --ray, else on "
                             "this machine; a host that is neither is given this machine's figure and the plan says so")
    parser.add_argument("--output", "-o", type=Path, help="write the TOML plan here (default: print it)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from skippy.deploy.plan import HostSpec, ModelShape, PlanError, PlanSettings, plan_chain
    from skippy.runtime.errors import NativeError

    if not args.hosts and not args.ray:
        print("error: give --hosts, or --ray for a Ray cluster's nodes", file=sys.stderr)
        return 2
    try:
        hosts = [HostSpec.parse(text) for text in args.hosts or ()]
        settings = PlanSettings(ctx_size=args.ctx_size, max_sessions=args.max_sessions,
                                batch_size=args.batch_size, cache_spill_mib=args.cache_spill_mib,
                                prefix_cache=args.prefix_cache == "on", wire_dtype=args.wire_dtype,
                                bandwidth_gbs=args.bandwidth_gbs, compute_gmacs=args.compute_gmacs,
                                kv_streams=args.kv_streams)
        shape = ModelShape.from_gguf(args.model.resolve())
        host_times = None
        if args.ray:
            hosts, host_times = _from_ray(args, shape, hosts, settings.max_sessions)
        elif args.measure:
            host_times = _measured_here(shape, hosts, {}, settings.max_sessions)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NativeError as exc:  # the model does not load here: nothing to measure with
        print(f"error: cannot measure {shape.path.name} here: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # --ray without the optional extra
        print(f"error: --ray needs Ray: pip install 'skippy-llm[ray]' ({exc})", file=sys.stderr)
        return 2
    try:
        plan = plan_chain(shape, hosts, settings, host_times=host_times)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    plan, note = _head_split(plan, shape, settings, host_times)
    print(plan.describe())
    if note:
        print(note)
    text = plan.to_toml()
    if args.output is None:
        print()
        print(text, end="")
    else:
        args.output.write_text(text)
        ray_hint = f"; on a Ray cluster: skippy up --ray --plan {args.output}" if args.ray else ""
        print(f"wrote {args.output}; on each host: python -m skippy.stage --config {args.output} --plan-stage N "
              f"(N = 0..{len(plan.stages) - 1}); on one machine: skippy up --plan {args.output}{ray_hint}")
    return 0


def _head_split(plan: Any, shape: Any, settings: Any, host_times: list[Any] | None) -> tuple[Any, str]:
    """The plan with the head split (issue 31) that brings the final stage to the others' time
    (:meth:`Plan.with_head_split`) and a line on it; the plan as it is and why where none fits."""
    from skippy.deploy.cost import load_rows
    from skippy.deploy.plan import PlanError, estimated_times, plan_head_split

    rows = load_rows(settings.max_sessions, len(plan.stages))  # the stages' batch the plan is priced at
    head_ms = (host_times[-1] if host_times else estimated_times(shape, settings, rows=rows)).head_ms
    head, fractions = plan_head_split(plan, shape, head_ms)
    if head is None:
        return plan, ""
    try:
        plan = plan.with_head_split(head, head_ms, shape.n_vocab)
    except PlanError as exc:
        return plan, (f"  head split not planned: {exc}. With the head's rows 0:{head.rows} on stage {head.host} "
                      "the shares would be " + ", ".join(f"{share:.0%}" for share in fractions))
    final, serving = plan.stages[-1].host.name, plan.stages[head.host].host.name
    link = "on loopback" if final == serving else f"dialled from {serving}, mutual TLS"
    return plan, (f"  head split: rows 0:{head.rows} on stage {head.host}, {head.rows}:{shape.n_vocab} on the final "
                  f"stage (its head shard port {plan.head_port}, {link})")


def _from_ray(args: argparse.Namespace, shape: Any, named: list[Any],
              sessions: int) -> tuple[list[Any], list[Any] | None]:
    """The hosts (named, else the cluster's nodes) and, with ``--measure``, each host's times:
    measured on its node where it is one, else :func:`_measured_here`'s."""
    from skippy.deploy import ray_plan

    from skippy.deploy.cost import load_rows

    with ray_plan.connect(None if args.ray == "auto" else args.ray):
        hosts = named or ray_plan.cluster_hosts()
        if not args.measure:
            return hosts, None
        node_ids = ray_plan.match_nodes(hosts)
        on_nodes = ray_plan.measure_on_nodes(shape, [node for node in node_ids if node],
                                             rows=load_rows(sessions, len(hosts)))
    return hosts, _measured_here(shape, hosts, {index: on_nodes[node] for index, node in enumerate(node_ids) if node},
                                 sessions)


def _measured_here(shape: Any, hosts: list[Any], known: dict[int, Any], sessions: int = 8) -> list[Any]:
    """Each host's :class:`LayerTimes`: ``known`` ones as they are; the rest from one measurement
    on this machine (at each stage's batch under ``sessions`` sessions and at one row), labelled
    as this machine's where the host is, and as a stand-in elsewhere.

    Raises:
        skippy.runtime.NativeError: the model cannot be loaded here.
    """
    import dataclasses

    from skippy.deploy.cost import load_rows
    from skippy.deploy.plan import measure_times

    if len(known) == len(hosts):
        return [known[index] for index in range(len(hosts))]
    here = measure_times(shape, rows=load_rows(sessions, len(hosts)))
    local = _local_names()
    times = []
    for index, host in enumerate(hosts):
        if index in known:
            times.append(known[index])
        elif host.name in local:
            times.append(here)
        else:
            times.append(dataclasses.replace(here, source=f"this machine's figure: {host.name} was not measured"))
    return times


def _local_names() -> set[str]:
    """Names and addresses of this machine (a host so named is measured by measuring here)."""
    import socket

    names = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    try:
        names.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:  # the host name does not resolve: the literal names still count
        pass
    return names
