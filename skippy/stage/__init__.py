"""The stage server: ``python -m skippy.stage --model M --layers A:B --listen H:P [--downstream H:P]``.

Modules by job (the lane's rules, sans-IO, are :mod:`skippy.lane`): ``config`` (settings),
``server`` (load, listen, shutdown, the watchdog), ``connection`` (one lane: its lifetime, receive
loop and dispatch), ``upstream`` / ``downstream`` (the lane's two halves: replies and return lanes;
forwarding and the downstream's replies), ``control`` (the stage's own part of control kinds),
``scheduler`` (the runtime's single owner: decode groups, cross-session batching), ``worker`` (the
one thread native calls run on), ``executor`` (runtime calls and the session table),
``decode_relay`` with ``_relay`` (the data plane), ``write_through``, ``direct_return``,
``activation_log`` (what a stage handed downstream, for a resume), ``liveness`` / ``standby``
(heartbeats, a warm standby), ``transport`` (frames over trio streams, downstream dialing, wire
conditions), ``limits``, ``stats`` / ``metrics``, ``threads`` (how the compute threads wait: set
here, before the imports below load the native runtime).
"""

from skippy.stage.threads import apply_wait_default

apply_wait_default()  # only in ``python -m skippy.stage`` (--thread-wait); libgomp reads it as the runtime loads

from skippy.lane.errors import DownstreamLost, StageError  # noqa: E402
from skippy.net.address import Address  # noqa: E402
from skippy.stage.config import StageConfig, parse_config  # noqa: E402
from skippy.stage.server import StageServer, load_runtime, run_stage  # noqa: E402

__all__ = ["Address", "DownstreamLost", "StageConfig", "StageError", "StageServer", "load_runtime",
           "parse_config", "run_stage"]
