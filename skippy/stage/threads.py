"""How a stage process's compute threads wait, chosen before the native runtime loads.

skippy's llama.cpp is built with OpenMP: a graph runs on ``--threads`` threads that meet at a
barrier after every node, and between two graphs the helpers wait in libgomp's pool.  libgomp
spins for a while (``GOMP_SPINCOUNT``, 300,000 rounds by default) before it sleeps
(``OMP_WAIT_POLICY=PASSIVE``: it sleeps at once).  Which is faster depends on the host
(docs/throughput.md, "A stage uses its cores"):

* cores the stages have to themselves: spinning wins (a quiet 2-core host, Gemma 3 270M, one
  stage of 2 threads: 51.5 against 38.6 tokens/s at one stream);
* more compute threads than cores: a spinning thread burns the slice the thread it waits for
  needs, and a row took 460-700 ms against 33-60 ms passive.

So ``--thread-wait`` (:data:`THREAD_WAITS`) is ``spin``, ``passive``, or ``auto`` (the default):
spin when the compute threads of the skippy stages on this host fit its cores, else passive.
The host's total is ``--host-threads`` (``skippy up`` and the Ray launcher pass the sum over the
stages they place on the host; a stage started from a plan file counts the plan's stages on its
host), else this stage's own ``--threads``; the cores are the CPUs this process may run on
(``os.sched_getaffinity``); ``--threads 0`` is a thread per CPU of the host.  Other load is not
known here: on a host shared with other work, say ``--thread-wait passive``.  The environment
overrides all of it: with ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set, nothing is changed.

libgomp reads these variables once, when it is loaded, so :func:`apply_wait_default` runs from
``skippy/stage/__init__.py`` before the runtime is imported, only in ``python -m skippy.stage``
(in any other process that imports the package nothing changes).  It reads the three settings
from the command line (and a ``--config`` file) with a scan of its own that never fails (the
full parse comes later and reports errors); the stage then logs the choice and its reason, and
warns if its parsed settings would have chosen otherwise.  One compute thread never enters
OpenMP, so ``--threads 1`` is unaffected either way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any, Final, Mapping, MutableMapping, Sequence

#: The variables that choose how libgomp waits; when one is set, the stage leaves them all alone.
WAIT_SETTINGS: Final = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: The values of ``--thread-wait``.
THREAD_WAITS: Final = ("auto", "spin", "passive")
#: The spin of ``spin``: libgomp's own default, set explicitly so the stage's environment shows it.
SPIN_COUNT: Final = 300_000
#: What each policy sets.
POLICY_SETTINGS: Final[Mapping[str, Mapping[str, str]]] = {
    "spin": {"GOMP_SPINCOUNT": str(SPIN_COUNT)},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


@dataclasses.dataclass(frozen=True, slots=True)
class WaitChoice:
    """How the compute threads wait: ``policy`` (spin, passive, or environment: set from outside),
    the variables it sets, and why."""

    policy: str
    settings: Mapping[str, str]
    reason: str

    def describe(self, environ: Mapping[str, str]) -> str:
        """The log line's text: the variables in force and the reason."""
        values = ", ".join(f"{name}={environ[name]}" for name in WAIT_SETTINGS if name in environ)
        return f"{values or 'libgomp defaults'} ({self.policy}: {self.reason})"


def host_cores() -> int:
    """The CPUs this process may run on (its affinity mask; all of the host's without one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def choose_wait(mode: str, threads: int, host_threads: int, cores: int,
                environ: Mapping[str, str]) -> WaitChoice:
    """The wait for a stage of ``threads`` compute threads (0: all cores) on a host with
    ``cores`` cores whose stages run ``host_threads`` in all (0: unknown, this stage's own)."""
    given = [f"{name}={environ[name]}" for name in WAIT_SETTINGS if name in environ]
    if given:
        return WaitChoice("environment", {}, f"the environment sets {', '.join(given)}")
    if mode in ("spin", "passive"):
        return WaitChoice(mode, POLICY_SETTINGS[mode], f"--thread-wait {mode}")
    own = threads if threads > 0 else os.cpu_count() or 1
    total = max(host_threads, own)
    policy = "passive" if total > cores else "spin"
    reason = (f"{total} compute thread{'s' if total > 1 else ''} of "
              f"{'the stages on this host' if host_threads > 0 else 'this stage'} "
              f"on {cores} cores: " + ("more threads than cores" if total > cores else "each has a core"))
    if own == 1:
        reason += "; one compute thread never enters OpenMP"
    return WaitChoice(policy, POLICY_SETTINGS[policy], reason)


# -- the stage's own command line, read before the runtime loads --------------------------------

#: The settings the choice needs.
_WANTED: Final = frozenset({"threads", "thread_wait", "host_threads"})


def stage_arguments(argv: Sequence[str]) -> list[str] | None:
    """The arguments after ``-m skippy.stage`` of an interpreter command line (``sys.orig_argv``);
    None when it does not run the stage's entry point."""
    index = 1
    while index < len(argv):
        argument = argv[index]
        if argument == "-mskippy.stage":
            return list(argv[index + 1:])
        if argument == "-m":
            return list(argv[index + 2:]) if argv[index + 1:index + 2] == ["skippy.stage"] else None
        if not argument.startswith("-") or argument in ("-", "-c") or argument.startswith(("-c", "-m")):
            return None  # a script, a command or another module runs, not the stage's entry point
        index += 2 if argument in ("-X", "-W", "--check-hash-based-pycs") else 1
    return None


def is_stage_process(argv: Sequence[str]) -> bool:
    """Whether an interpreter command line (``sys.orig_argv``) runs ``-m skippy.stage``."""
    return stage_arguments(argv) is not None


def _flags(arguments: Sequence[str]) -> dict[str, str]:
    """``--name value`` and ``--name=value`` of the stage's flags (the last one given wins; a flag
    followed by another, as ``--help``, has the value "")."""
    found: dict[str, str] = {}
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        if argument.startswith("--"):
            name, equals, value = argument[2:].partition("=")
            if not equals and index + 1 < len(arguments) and not arguments[index + 1].startswith("--"):
                value = arguments[index + 1]
                index += 1
            found[name.replace("-", "_")] = value
        index += 1
    return found


def plan_host_threads(chain: Mapping[str, Any], stages: Sequence[Any], index: int, cores: int) -> int:
    """The compute threads of a plan's stages on stage ``index``'s host, this one (``cores``:
    its cores, what ``threads = 0`` means); 0 when the plan names no host for the stage."""
    host = stages[index].get("host") if isinstance(stages[index], Mapping) else None
    if not host:
        return 0
    total = 0
    for stage in stages:
        if isinstance(stage, Mapping) and stage.get("host") == host:
            threads = int(stage.get("threads", chain.get("threads", 0)))
            total += threads if threads > 0 else cores
    return total


def _from_config(path: str, plan_stage: str | None, cores: int) -> dict[str, Any]:
    """The wanted settings of a ``--config`` file (see :func:`skippy.stage.config.load_config_file`)."""
    text = Path(path).read_bytes()
    data = tomllib.loads(text.decode()) if path.endswith(".toml") else json.loads(text)
    if not isinstance(data, dict):
        return {}
    stages = data.get("stage")
    if isinstance(stages, list):  # a plan: the chain's settings, then the stage's
        chain = data.get("chain", {}) if isinstance(data.get("chain"), dict) else {}
        index = int(plan_stage) if plan_stage is not None else -1
        if not 0 <= index < len(stages) or not isinstance(stages[index], dict):
            return {}
        data = {**chain, **stages[index]}
        data.setdefault("host_threads", plan_host_threads(chain, stages, index, cores))
    elif isinstance(stages, dict):
        data = stages
    return {key.replace("-", "_"): value for key, value in data.items() if key.replace("-", "_") in _WANTED}


def wait_settings(arguments: Sequence[str], cores: int) -> tuple[str, int, int]:
    """``(thread_wait, threads, host_threads)`` as the stage's flags and ``--config`` give them;
    a value that cannot be read keeps its default (the stage's own parse reports it)."""
    flags = _flags(arguments)
    raw: dict[str, Any] = {}
    if "config" in flags:
        try:
            raw.update(_from_config(flags["config"], flags.get("plan_stage"), cores))
        except (OSError, ValueError, TypeError, AttributeError):  # unreadable: the stage's parse says so
            pass
    raw.update({name: value for name, value in flags.items() if name in _WANTED})
    wait = str(raw.get("thread_wait", "auto")).strip().lower()
    counts = []
    for name in ("threads", "host_threads"):
        try:
            counts.append(int(raw.get(name, 0)))
        except (TypeError, ValueError):
            counts.append(0)
    return wait if wait in THREAD_WAITS else "auto", counts[0], counts[1]


#: The choice :func:`apply_wait_default` made in this process (None: not a stage process).
applied: WaitChoice | None = None


def apply_wait_default(environ: MutableMapping[str, str] | None = None,
                       argv: Sequence[str] | None = None, cores: int | None = None) -> WaitChoice | None:
    """In a stage process, choose how its compute threads wait and set the variables into
    ``environ`` (default ``os.environ``); returns the choice (None: not a stage process)."""
    global applied
    environ = os.environ if environ is None else environ
    argv = getattr(sys, "orig_argv", sys.argv) if argv is None else argv
    arguments = stage_arguments(argv)
    if arguments is None:
        return None
    cores = host_cores() if cores is None else cores
    wait, threads, host_threads = wait_settings(arguments, cores)
    choice = choose_wait(wait, threads, host_threads, cores, environ)
    environ.update(choice.settings)
    applied = choice
    return choice
