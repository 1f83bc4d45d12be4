"""The stage server: ``python -m skippy.stage --model M --layers A:B --listen H:P [--downstream H:P]``.

Modules by job: ``config`` (settings), ``server`` (load, listen, shutdown), ``lane_protocol``
(a lane's rules, sans-IO: the per-kind table, events in, actions out), ``connection`` (one lane's
I/O: its nursery of receive / compute / forward / relay tasks), ``errors`` (the typed refusals and
their wire codes), ``scheduler`` (the runtime's single
owner, cross-session decode batching), ``worker`` (the one thread native calls run on),
``executor`` (runtime calls and the session table), ``transport`` (frames over trio streams,
downstream dialing, wire conditions), ``stats``, ``threads`` (how the compute threads wait: set
here, before the imports below load the native runtime).
"""

from skippy.stage.threads import apply_wait_default

apply_wait_default()  # only in ``python -m skippy.stage``; libgomp reads it when the runtime loads

from skippy.lane.errors import DownstreamLost, StageError  # noqa: E402
from skippy.net.address import Address  # noqa: E402
from skippy.stage.config import StageConfig, parse_config  # noqa: E402
from skippy.stage.server import StageServer, load_runtime, run_stage  # noqa: E402

__all__ = ["Address", "DownstreamLost", "StageConfig", "StageError", "StageServer", "load_runtime",
           "parse_config", "run_stage"]
