"""How a stage process's compute threads wait, set before the native runtime loads.

skippy's llama.cpp is built with OpenMP: a graph runs on ``--threads`` threads that meet at a
barrier after every node, and between two graphs the helpers wait in libgomp's pool.  libgomp's
default is to spin for a while (``GOMP_SPINCOUNT``, 300,000 rounds) before it sleeps.  A thread
that spins while the thread it waits for is descheduled, or while the stage's own Python (the
batch, the wire, the sampling) needs the core, costs whole time slices: on the 2-core
development host, shared with other work, one Gemma 3 270M row took 460-700 ms with two spinning
threads against 33-60 ms with ``OMP_WAIT_POLICY=PASSIVE`` (the helpers sleep at once), and a
stage's tokens/s at one stream rose 1.6-2.4x (docs/throughput.md, "A stage uses its cores").

So a stage process (``python -m skippy.stage``: what ``skippy up`` and the Ray launcher start)
sets ``OMP_WAIT_POLICY=PASSIVE`` unless its environment already says how to wait
(``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``: ``OMP_WAIT_POLICY=ACTIVE`` spins, e.g. on a host whose
cores the stage has to itself).  libgomp reads these once, when it is loaded, so
:func:`apply_wait_default` runs from ``skippy/stage/__init__.py`` before the runtime is imported;
in any other process that imports the package nothing changes.  One compute thread never enters
OpenMP, so ``--threads 1`` is unaffected either way.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping, Sequence

#: The variables that choose how libgomp waits; when one is set, the stage leaves them all alone.
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: The stage's default.
DEFAULT_WAIT_POLICY = "PASSIVE"


def is_stage_process(argv: Sequence[str]) -> bool:
    """Whether an interpreter command line (``sys.orig_argv``) runs ``-m skippy.stage``."""
    index = 1
    while index < len(argv):
        argument = argv[index]
        if argument in ("-m", "-mskippy.stage"):
            return argument != "-m" or argv[index + 1:index + 2] == ["skippy.stage"]
        if not argument.startswith("-") or argument in ("-", "-c") or argument.startswith("-c"):
            return False  # a script or a command runs, not the stage's entry point
        index += 2 if argument in ("-X", "-W", "--check-hash-based-pycs") else 1
    return False


def apply_wait_default(environ: MutableMapping[str, str] | None = None,
                       argv: Sequence[str] | None = None) -> str | None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in a stage process whose environment chooses no waiting;
    returns the value set (None: nothing set)."""
    environ = os.environ if environ is None else environ
    argv = getattr(sys, "orig_argv", sys.argv) if argv is None else argv
    if not is_stage_process(argv) or any(name in environ for name in WAIT_SETTINGS):
        return None
    environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    return DEFAULT_WAIT_POLICY
