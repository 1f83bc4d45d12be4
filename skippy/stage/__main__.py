"""``python -m skippy.stage``: parse settings, load the layer range (with progress), serve.

Strategy: everything slow or fallible happens before the listener exists (settings, model load,
context creation), each failure ending the process with one clear line and exit status 2, so a
launcher that sees READY knows the stage is loaded.  Logs go to stderr; the line
``stage layers A:B ready on HOST:PORT`` announces the bound address (useful with port 0).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from typing import Sequence

import trio

from skippy.runtime.errors import NativeError
from skippy.stage import threads
from skippy.stage.config import parse_config
from skippy.stage.server import load_runtime, run_stage, stage_tls

log = logging.getLogger("skippy.stage")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=config.log_level, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[layers " + config.layers + "]: %(message)s",
    )
    started = time.monotonic()
    last_report = [-1.0]

    def progress(fraction: float) -> bool:
        if fraction - last_report[0] >= 0.25 or fraction >= 1.0 > last_report[0]:
            last_report[0] = fraction
            log.info("loading %s layers %s: %3.0f%%", config.model, config.layers, fraction * 100)
        return True

    try:
        stage_tls(config)  # certificate files are checked before the model loads
    except ValueError as exc:
        log.error("cannot start stage: %s", exc)
        return 2
    try:
        executor = load_runtime(config, progress)
    except (ValueError, OSError, ImportError) as exc:  # a bad setting or file, a library of another ABI
        log.error("cannot start stage: %s", exc)
        return 2
    except NativeError as exc:  # the runtime's other typed refusals
        log.error("cannot start stage: %s: %s", type(exc).__name__, exc)
        return 2
    except Exception:  # a bug: say so, with its traceback
        log.exception("cannot start stage: internal error")
        return 2
    log.info("loaded %s layers %s in %.2f s (width %d)", config.model, config.layers,
             time.monotonic() - started, executor.n_embd)
    _log_wait(config.thread_wait, config.threads, config.host_threads)
    # Everything loaded so far lives until exit: keep the collector from rescanning it.  The
    # serving loop allocates short-lived objects only, so full collections would only cost.
    # Young collections are made rarer too: per-message objects die by reference count, so each
    # collection finds almost nothing, and on the decode path it costs ~3% of a stage's CPU.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    trio.run(run_stage, config, executor)
    log.info("stage layers %s stopped", config.layers)
    return 0


def _log_wait(mode: str, count: int, host_threads: int) -> None:
    """Say how the compute threads wait and why (chosen as the package loaded: skippy.stage.threads),
    and warn when the parsed settings would choose otherwise (e.g. abbreviated flags)."""
    applied = threads.applied
    if applied is None:  # main() called in a process that is not ``-m skippy.stage``
        log.info("compute threads wait with %s (as this process's environment says)", ", ".join(
            f"{name}={os.environ[name]}" for name in threads.WAIT_SETTINGS if name in os.environ) or "libgomp defaults")
        return
    log.info("compute threads wait with %s", applied.describe(os.environ))
    if applied.policy != "environment":
        wanted = threads.choose_wait(mode, count, host_threads, threads.host_cores(), {})
        if wanted.policy != applied.policy:
            log.warning("the settings choose %s (%s), but the runtime loaded with %s: give --threads, "
                        "--thread-wait and --host-threads unabbreviated", wanted.policy, wanted.reason, applied.policy)


if __name__ == "__main__":
    sys.exit(main())
