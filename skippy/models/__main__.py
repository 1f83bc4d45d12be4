# Command line for synthetic models: `python -m skippy.models [PRESET] [options]`; a real model's
# name instead (`python -m skippy.models real-gemma3-270m`) prints its assembled, verified file.
#
# Strategy: start from a preset (or, without one, from the tiny shape of --arch, which carries
# the family's constants: experts, window, multipliers), apply every option given explicitly as
# a field override, validate through `ModelSpec`, then either write to
# --out or go through the cache. The only thing printed on stdout is the resulting path, so shell
# scripts can do `MODEL=$(python -m skippy.models demo)`; progress goes to stderr.
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from skippy.models.cache import ensure_model
from skippy.models.families import family
from skippy.models.real import REAL_MODELS, RealModelError, ensure_real_model
from skippy.models.spec import PRESETS, Architecture, ModelSpec, VocabName, WeightDtype, preset, tiny
from skippy.models.synthetic import write_model
from skippy.models.vocab_files import VocabNotFoundError

# Command-line option -> ModelSpec field, for the shape options.
_FIELD_OPTIONS: dict[str, str] = {
    "arch": "arch",
    "layers": "n_layer",
    "embd": "n_embd",
    "ff": "n_ff",
    "heads": "n_head",
    "kv_heads": "n_head_kv",
    "head_dim": "head_dim",
    "vocab": "vocab",
    "dtype": "dtype",
    "tied": "tied",
    "ctx": "context_length",
    "rope_theta": "rope_theta",
    "rms_eps": "rms_eps",
    "seed": "seed",
    "name": "name",
    "experts": "n_expert",
    "experts_used": "n_expert_used",
    "ff_exp": "n_ff_exp",
    "sliding_window": "sliding_window",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m skippy.models",
        description="Generate a seeded random-weight GGUF model and print its path.",
    )
    parser.add_argument(
        "preset", nargs="?", choices=sorted(PRESETS) + sorted(REAL_MODELS),
        help="start from a named shape, or name a real model (assembled from its installed package)",
    )
    parser.add_argument("--list", action="store_true", help="list the presets and exit")
    parser.add_argument("--arch", choices=get_args(Architecture))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--embd", type=int)
    parser.add_argument("--ff", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--vocab", choices=get_args(VocabName))
    parser.add_argument("--dtype", choices=get_args(WeightDtype))
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--ctx", type=int, help="context_length hparam")
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--rms-eps", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--name")
    parser.add_argument("--experts", type=int, help="experts per MoE block (MoE families)")
    parser.add_argument("--experts-used", type=int, help="experts each token uses")
    parser.add_argument("--ff-exp", type=int, help="hidden width of one expert")
    parser.add_argument("--sliding-window", type=int, help="window of the sliding-window layers")
    parser.add_argument(
        "--out", type=Path, help="write here instead of the cache (overwrites an existing file)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def build_spec(args: argparse.Namespace) -> ModelSpec:
    """Turn parsed arguments into a validated spec (preset or tiny shape, plus overrides)."""
    overrides: dict[str, Any] = {
        field: getattr(args, option)
        for option, field in _FIELD_OPTIONS.items()
        if getattr(args, option) is not None
    }
    if args.preset is not None:
        return preset(args.preset, **overrides)
    # Without a preset, derive n_ff and the qwen3 head width from the requested width first,
    # so `--arch qwen3 --embd 128` is a consistent tiny shape rather than a 64-wide one stretched.
    base = tiny(
        overrides.get("arch", "llama"),
        n_layer=overrides.get("n_layer", 4),
        n_embd=overrides.get("n_embd", 64),
    )
    return dataclasses.replace(base, **overrides)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for name, factory in PRESETS.items():
            spec = factory()
            print(f"{name:20} {spec.short_name():44} {family(spec.arch).summary}")
        for name, model in REAL_MODELS.items():
            print(f"{name:20} {model.file_name:44} real weights, from the {model.distribution} package")
        return 0
    if args.preset in REAL_MODELS:
        return _real_model(args.preset, quiet=args.quiet)
    try:
        spec = build_spec(args)
    except (ValueError, TypeError) as exc:
        # An invalid combination of options: report it the way argparse reports bad options.
        parser.error(str(exc))

    started = time.monotonic()
    last_report = [started]
    live = not args.quiet and sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if live and (now - last_report[0] >= 0.5 or done == total):
            last_report[0] = now
            print(f"\r{spec.short_name()}: {done / 2**20:.0f}/{total / 2**20:.0f} MiB",
                  end="", file=sys.stderr, flush=True)

    try:
        if args.out is not None:
            path = write_model(spec, args.out, progress=report)
        else:
            path = ensure_model(spec, progress=report)
    except VocabNotFoundError as exc:
        # The message already lists the places searched; no traceback needed.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        clear = "\r\033[K" if live else ""
        print(f"{clear}{spec.short_name()}: {path.stat().st_size / 2**20:.1f} MiB, "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr)
    print(path)
    return 0


def _real_model(name: str, *, quiet: bool) -> int:
    """Print the path of a real model's verified file (assembling it on first use)."""
    started = time.monotonic()
    try:
        path = ensure_real_model(name)
    except RealModelError as exc:  # package missing or damaged: the message says what to install
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not quiet:
        print(f"{name}: {path.stat().st_size / 2**20:.1f} MiB, {time.monotonic() - started:.1f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
