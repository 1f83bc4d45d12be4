#!/usr/bin/env python3
"""Re-lay the ``skippy`` package out (issue 27, item 3): a replayable, idempotent ``git mv`` + rewrite.

Usage::

    python scripts/relayout.py            # apply: git mv, extract, rewrite every reference
    python scripts/relayout.py --check    # change nothing; list what applying would do (exit 1 if any)

Strategy
--------
The layout change is data (the tables below), so it can be replayed on a tree that others edited
meanwhile; run it again after a merge and it moves what is new and rewrites what still names an old
place.  A second run changes nothing.  Steps, in order:

1. **Moves** (:data:`MOVES`): ``git mv`` whole files (a missing source whose target exists is done;
   one marked optional may be absent altogether).
2. **Extractions** (:data:`EXTRACTS`): top-level definitions (classes, functions, constants, with
   their decorators and ``#:`` comments) cut out of a module that stays, into a new module.  The
   new module gets the source's imports that the moved code uses; the source imports back the
   moved names it still uses, drops imports only the moved code used and the moved names from its
   ``__all__``.  A moved definition that uses a definition left behind is refused.
3. **Rewrites** over every text file git knows (tracked or not ignored), this script excepted:
   ``from P import n`` statements whose names moved (a module, or a name extracted in step 2) are
   split per new home; dotted names (``skippy.wire`` -> ``skippy.codec.wire``, also inside
   ``skippy.wire.X`` and in strings and prose); file paths (``skippy/_wire.pyx`` and its build
   outputs ``.c``/``.so``/``.html``).  Basenames never change, so a bare ``_wire_py.py`` in prose
   stays right.
4. **Fixups** (:data:`FIXUPS`): the few edits no rule derives (``setup.py``'s include directory,
   a ``__file__`` path one level deeper, globs, the README's layout).  Each names the text it
   expects and the text that says it is done; a fixup that finds neither is reported, not fatal.
5. Untracked build outputs of moved Cython modules at their old place are deleted (a stale
   ``skippy/_wire.*.so`` would be importable under its old name).

After applying, rebuild the extensions (``python setup.py build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()

# ------------------------------------------------------------------------------------------------
# The layout (edit these tables to change it; the rest is mechanism)
# ------------------------------------------------------------------------------------------------

#: Whole-file moves: (old path, new directory).  The basename never changes.
_MOVE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the codec: vocabulary, codec API, Cython module + its pure-Python twins, headers, CLI
    ("skippy/codec", (
        "skippy/protocol.py", "skippy/protocol_ext.py", "skippy/wire.py", "skippy/wire_cli.py",
        "skippy/_wire.pyx", "skippy/_wire.pxd", "skippy/_wire_activation.pxi", "skippy/_wire_ext.pxi",
        "skippy/_wire_py.py", "skippy/_wire_ext_py.py", "skippy/_activation_py.py",
        "skippy/_activation.h", "skippy/_activation_x86.h", "skippy/_byteorder.h",
        # the frame offsets of the codec and the decode relay (its include found through include_dirs)
        "skippy/_frame_layout.py", "skippy/_frame_layout.pxi",
    )),
    # the network layer shared by the stage, the driver and the API (Address, SocketIO: EXTRACTS)
    ("skippy/net", ("skippy/stage/tls.py",)),
    # deployment: planning, launching here or on Ray, certificates
    ("skippy/deploy", (
        "skippy/plan.py", "skippy/ray_plan.py", "skippy/launch.py", "skippy/ray_launch.py", "skippy/certs.py",
    )),
    # where a stage computes (GPU settings) and the split without the network: runtime, not deployment
    ("skippy/runtime", ("skippy/offload.py", "skippy/local.py")),
    # the prefix cache's page hash, next to the cache that is its only user
    ("skippy/cache", ("skippy/radix.py", "skippy/_radix.pyx", "skippy/_radix_py.py")),
    # the stage's decode relay (its glue is skippy/stage/decode_relay.py)
    ("skippy/stage", ("skippy/_relay.pyx", "skippy/_relay_py.py", "skippy/_relay_pick.h")),
)

#: Moves applied only when the source exists (modules other branches add to the package root).
_OPTIONAL_MOVE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("skippy/deploy", ("skippy/cost.py",)),  # the planner's cost model (branch thru)
)


@dataclasses.dataclass(frozen=True)
class Move:
    old: str
    new: str
    optional: bool = False


MOVES: tuple[Move, ...] = tuple(
    Move(old, f"{directory}/{Path(old).name}", optional)
    for groups, optional in ((_MOVE_GROUPS, False), (_OPTIONAL_MOVE_GROUPS, True))
    for directory, olds in groups for old in olds
)


@dataclasses.dataclass(frozen=True)
class Extract:
    source: str  #: the module the definitions leave (it stays)
    target: str  #: the new module
    names: tuple[str, ...]  #: top-level names to move (they keep their source order)
    doc: str  #: the new module's docstring (without quotes)
    shared: tuple[str, ...] = ()  #: top-level names copied, not moved (a module's logger)
    #: moved code may use names that stay: the target imports them from the source (else refused)
    import_from_source: bool = False
    #: other places the source may be by then (another branch moves it): the first that defines
    #: the names is used
    alternatives: tuple[str, ...] = ()


EXTRACTS: tuple[Extract, ...] = (
    Extract("skippy/stage/config.py", "skippy/net/address.py", ("Address",), '''\
``HOST:PORT`` addresses of stages: listening, downstream, and the driver's first stage.

One frozen value, parsed from what the command line, a config file or a plan writes
(``tcp://`` prefix allowed, IPv6 as ``[::1]:PORT``) and printed back the same way.'''),
    Extract("skippy/stage/transport.py", "skippy/net/socket_io.py",
            ("RECEIVE_CHUNK", "FIRST_CHUNK", "SocketIO", "set_no_delay"), '''\
Non-blocking socket I/O on trio streams, for the stage's lanes and the driver's client alike.

Strategy: :class:`SocketIO` tries the non-blocking ``readv`` / ``write`` on the socket's descriptor
first, into one reusable receive buffer, and parks in trio (``wait_readable`` /
``wait_writable``) only when the socket would block; the stream keeps owning the descriptor.
Streams that are not sockets (memory streams in tests) fall back to ``receive_some`` /
``send_all``.  Why (measured): :mod:`skippy.stage.transport`, which frames stage traffic over it.'''),
    Extract("skippy/stage/decode_run.py", "skippy/codec/decode_run.py",
            ("MAX_RUN_TOKENS", "MAX_RUN_STOP_TOKENS", "_TOKEN_END", "DecodeRunRequest"), '''\
A decode run's request (``docs/protocol.md`` §11): the chat metadata of a run's flagged DecodeEmbd.

Strategy: one frozen value, written by the driver (:meth:`DecodeRunRequest.metadata`) and parsed
by the first stage from hostile metadata with every field checked
(:meth:`DecodeRunRequest.from_metadata`).  It lives with the codec because both ends speak it; the
run itself, on the first stage, is :mod:`skippy.stage.decode_run`.''',
            alternatives=("skippy/lane/decode_run.py",)),  # branch lane moves the run there
    # the stage's half of model identities: skippy.identity is then shared code the driver and
    # the API use without importing the stage (ModelMismatch is a StageError)
    Extract("skippy/identity.py", "skippy/stage/identity_check.py",
            ("ModelMismatch", "_describe_pair", "DownstreamIdentities"), '''\
A stage's check of its downstream's model identity (``docs/protocol.md`` §9), and its refusal.

Strategy: :class:`DownstreamIdentities` asks the downstream for its Identity frame each time a
lane dials it (:func:`skippy.identity.query_identity`), remembers peers that gave none (a plain
v11 peer costs the timeout once per address), and raises :class:`ModelMismatch` (a
:class:`~skippy.stage.errors.StageError`, so the lane closes with an Error frame) when the two
stages cannot form a chain.  What identifies a stage, and asking a peer: :mod:`skippy.identity`.''',
            shared=("log",), import_from_source=True),
)


@dataclasses.dataclass(frozen=True)
class Fixup:
    path: str
    pattern: str  #: a regex (MULTILINE) of the text to change
    replacement: str
    done: str  #: a regex that matches once the fixup is in ("": done when the pattern is gone)
    count: int = 1  #: how many matches the pattern must have (0: any number, at least one)
    optional: bool = False  #: a missing file is fine (another branch moves it)


FIXUPS: tuple[Fixup, ...] = (
    # setup.py: the headers (_byteorder.h, _activation*.h) live with the codec; _relay.pyx
    # includes them from skippy/stage/ (a module's own directory is searched first anyway)
    Fixup("setup.py", r'include_dirs=\[numpy\.get_include\(\), "skippy"\]',
          'include_dirs=[numpy.get_include(), "skippy/codec"]',
          r'include_dirs=\[numpy\.get_include\(\), "skippy/codec"\]'),
    # launch.py puts the package's root on the stages' PYTHONPATH: one directory deeper now
    Fixup("skippy/deploy/launch.py", r"Path\(__file__\)\.resolve\(\)\.parent\.parent\)",
          "Path(__file__).resolve().parents[2])", r"Path\(__file__\)\.resolve\(\)\.parents\[2\]\)"),
    # build outputs of the Cython modules now sit in subpackages
    Fixup(".gitignore", r"^/skippy/\*\.html$", "/skippy/**/*.html", r"^/skippy/\*\*/\*\.html$"),
    Fixup("Makefile", r"skippy/\*\.so skippy/_native_stamp\.py ", "skippy/*.so skippy/*/*.so skippy/_native_stamp.py \\\n\t\t",
          r"skippy/\*/\*\.so"),
    # the sdist test lists the Cython sources and headers wherever they are under skippy/
    Fixup("tests/test_wheel.py", r'"skippy/\*\.(pyx|pxd|pxi|h)"', r'"skippy/**/*.\1"', r'"skippy/\*\*/\*\.pyx"',
          count=4),
    # a benchmark reads local.py's source as a prompt
    Fixup("bench/speculation_sim.py", r'\.joinpath\("skippy", "local\.py"\)',
          '.joinpath("skippy", "runtime", "local.py")', r'\.joinpath\("skippy", "runtime", "local\.py"\)'),
    # the lane rules' sans-IO import lists: the decode run's request moved to the codec
    Fixup("tests/test_lane_protocol.py",
          r'("decode_run\.py": \{[^}]*"skippy\.codec\.protocol_ext")\}',
          r'\1, "skippy.codec.decode_run"}', r'"decode_run\.py": \{[^}]*"skippy\.codec\.decode_run"'),
    # the decode run's header named the request as its own (in the stage, or where branch lane puts it)
    *(Fixup(path,
            r"This module is the sans-IO part: the run request \(:class:`DecodeRunRequest`, parsed from hostile\n"
            r"metadata with every field checked\) and the run's state",
            "This module is the sans-IO part of the run (its request, which the driver writes too, is\n"
            ":class:`skippy.codec.decode_run.DecodeRunRequest`): the run's state",
            r"its request, which the driver writes too", optional=True)
      for path in ("skippy/stage/decode_run.py", "skippy/lane/decode_run.py")),
    # identity.py's header names the checker that moved to the stage
    Fixup("skippy/identity.py", r"^\* \*\*Checking\*\* \(:class:`DownstreamIdentities`\): .*?"
          r"\(:func:`check_first_stage`\)\.\n", """\
* **Checking** (the stage's half, :mod:`skippy.stage.identity_check`): a stage checks its
  downstream each time a lane dials it (a restarted downstream may serve another file),
  remembering peers that gave no identity so a v11 peer costs the timeout once per address.  A
  mismatch raises ``ModelMismatch`` naming both files and both ranges; the lane then closes with
  an Error frame (``MODEL_MISMATCH`` to an upstream that flags bit 12, ``STATE_MISMATCH``
  otherwise), so the refusal reaches the driver, which reports it with the text.  The driver
  checks the first stage against its own model file (:func:`check_first_stage`).
""", r"the stage's half, :mod:`skippy\.stage\.identity_check`"),
    # the stage imported identity lazily because identity imported the stage; it no longer does
    Fixup("skippy/stage/server.py", r"  # see skippy\.identity: imports skippy\.stage$", "", "", count=0),
    # the stage package's header: its socket I/O moved to skippy.net
    Fixup("skippy/stage/__init__.py", r"``transport`` \(frames over trio streams and\s+non-blocking socket I/O, ",
          "``transport`` (frames over trio streams,\n", r"``transport`` \(frames over trio streams,\n"),
    # the README's layout
    Fixup("README.md", r"^skippy/        runtime/ \(cffi binding.*?\n(?=docs/)", """\
skippy/        __main__.py (the skippy command), identity.py (a chain's model identity), reference.py
               (the tests' unsplit reference); codec/ (wire protocol: protocol.py + protocol_ext.py
               vocabulary, wire.py codec API over _wire.pyx and its pure-Python twin, decode_run.py,
               wire_cli.py), net/ (address.py, socket_io.py, tls.py: what stages and the driver share),
               runtime/ (cffi binding, Model, StageContext, Sampler, tokenizer, offload.py GPU settings,
               local.py in-process chain), cache/ (prefix KV cache; radix.py + _radix.pyx page hash),
               stage/ (stage server; _relay.pyx decode relay), driver/ (StageClient, Generator, prefix
               restore, speculation/), api/ (OpenAI-compatible app; static/: the page at GET /), deploy/
               (plan.py planner, launch.py local chains, ray_launch.py + ray_plan.py on Ray, certs.py),
               models/ (synthetic GGUFs), commands/ (CLI: generate, up, serve, plan, certs, demo)
""", r"^skippy/        __main__\.py \(the skippy command\)"),
)

#: Extensions of files that are build outputs or sources of a module (for path rewriting).
_PATH_EXTENSIONS = r"(?:py|pyx|pxd|pxi|h|c|html|so|cpython)"

# ------------------------------------------------------------------------------------------------
# Derived maps
# ------------------------------------------------------------------------------------------------


def _dotted(path: str) -> str | None:
    """The module a source file defines (``skippy/_wire.pyx`` -> ``skippy._wire``), or None."""
    p = Path(path)
    if p.suffix not in (".py", ".pyx"):
        return None
    parts = p.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: old module -> new module
MODULE_MAP: dict[str, str] = {}
#: old path without extension -> new one (``skippy/_wire`` -> ``skippy/codec/_wire``)
STEM_MAP: dict[str, str] = {}
for _move in MOVES:
    _old, _new = _dotted(_move.old), _dotted(_move.new)
    if _old and _new:
        MODULE_MAP[_old] = _new
    STEM_MAP[str(Path(_move.old).with_suffix(""))] = str(Path(_move.new).with_suffix(""))
#: (old module, name) -> new module, for the extracted names
NAME_MAP: dict[tuple[str, str], str] = {
    (str(_dotted(source)), name): str(_dotted(e.target))
    for e in EXTRACTS for source in (e.source, *e.alternatives) for name in e.names
}

# ------------------------------------------------------------------------------------------------
# Mechanism
# ------------------------------------------------------------------------------------------------


class Relayout:
    def __init__(self, root: Path, dry: bool) -> None:
        self.root = root
        self.dry = dry
        self.changes: list[str] = []
        self.warnings: list[str] = []

    def note(self, text: str) -> None:
        self.changes.append(text)
        print(("would: " if self.dry else "") + text)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        print(f"WARNING: {text}", file=sys.stderr)

    def git(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.root, check=True, capture_output=True, text=True).stdout

    def write(self, rel: str, text: str) -> None:
        if not self.dry:
            (self.root / rel).write_text(text)

    # -- 1. moves -------------------------------------------------------------------------------

    def moves(self) -> None:
        for package in sorted({str(Path(m.new).parent) for m in MOVES}):
            if not (self.root / package / "__init__.py").exists():
                raise SystemExit(f"{package}/__init__.py is missing: it is written by hand, not by this script")
        for move in MOVES:
            old, new = self.root / move.old, self.root / move.new
            if old.exists() and new.exists():
                raise SystemExit(f"both {move.old} and {move.new} exist: merge them by hand first")
            if old.exists():
                self.note(f"git mv {move.old} {move.new}")
                if not self.dry:
                    self.git("mv", move.old, move.new)
            elif not new.exists() and not move.optional:
                self.warn(f"neither {move.old} nor {move.new} exists")

    # -- 2. extractions -------------------------------------------------------------------------

    def extractions(self) -> None:
        for extract in EXTRACTS:
            self.extract(extract)

    def extract(self, ex: Extract) -> None:
        target_path = self.root / ex.target
        candidates = [path for path in (ex.source, *ex.alternatives) if (self.root / path).exists()]
        for source in candidates:
            text = (self.root / source).read_text()
            tree = ast.parse(text)
            defined = _top_level_definitions(tree)
            present = [name for name in ex.names if name in defined]
            if present:
                break
        else:
            if not target_path.exists():
                self.warn(f"none of {', '.join(ex.names)} is in {' or '.join((ex.source, *ex.alternatives))}, "
                          f"and {ex.target} does not exist")
            return
        ex = dataclasses.replace(ex, source=source)
        if target_path.exists():
            raise SystemExit(f"{ex.target} exists but {ex.source} still defines {', '.join(present)}")
        if len(present) != len(ex.names):
            missing = sorted(set(ex.names) - set(present))
            raise SystemExit(f"{ex.source} defines {', '.join(present)} but not {', '.join(missing)}")
        lines = text.splitlines(keepends=True)
        # line spans (0-based, end exclusive) of each moved definition, with decorators and the
        # comment lines right above it
        spans: dict[str, tuple[int, int]] = {}
        missing_shared = [name for name in ex.shared if name not in defined]
        if missing_shared:
            raise SystemExit(f"{ex.source} does not define {', '.join(missing_shared)} (shared)")
        for name in ex.names + ex.shared:
            node = defined[name]
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
            while start > 0 and lines[start - 1].lstrip().startswith("#"):
                start -= 1
            spans[name] = (start, node.end_lineno or node.lineno)
        moved_nodes = [defined[name] for name in ex.names + ex.shared]
        used = set().union(*(_names_used(node) for node in moved_nodes))
        left_behind = {name for name in defined
                       if name not in ex.names + ex.shared and not _is_import_name(tree, name)}
        needs = sorted((used & left_behind) - set(ex.names))
        if needs and not ex.import_from_source:
            raise SystemExit(f"{', '.join(ex.names)} in {ex.source} use {', '.join(needs)}, which stays: "
                             f"add it to the extraction or leave both")
        source_module, target_module = str(_dotted(ex.source)), str(_dotted(ex.target))
        # the target module
        imports = _imports_used_by(tree, lines, used)
        if needs:
            imports.append(("\n" if imports and imports[-1] != "\n" and not imports[-1].startswith("from skippy")
                            else "")
                           + _format_from("", source_module, [(n, None) for n in _import_order(needs)], "", False)
                           + "\n")
        exported = _all_names(tree)
        public_all = [name for name in exported or () if name in ex.names]
        body: list[str] = []
        previous_end = None
        for name in sorted(ex.names + ex.shared, key=lambda n: spans[n][0]):
            start, end = spans[name]
            chunk = "".join(lines[start:end]).rstrip("\n") + "\n"
            if previous_end is not None:
                gap = "".join(lines[previous_end:start])
                compound = isinstance(defined[name], (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    or isinstance(defined[previous_name], (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                body.append("\n\n" if compound else ("" if gap == "" else "\n"))
            body.append(chunk)
            previous_end, previous_name = end, name
        header = f'"""{ex.doc}\n"""\n\n'
        future = "from __future__ import annotations\n\n" if _has_future_annotations(tree) else ""
        import_block = "".join(imports)
        all_block = ""
        if public_all:
            all_block = "__all__ = [" + ", ".join(f'"{n}"' for n in public_all) + "]\n\n"
        target_text = header + future + (import_block + "\n" if import_block else "") + all_block + "\n" + "".join(body)
        target_text = re.sub(r"\n{4,}", "\n\n\n", target_text)
        self.note(f"extract {', '.join(ex.names)}: {ex.source} -> {ex.target}")
        # the source module
        keep = [True] * len(lines)
        for start, end in (spans[name] for name in ex.names):
            for i in range(start, end):
                keep[i] = False
        remaining = "".join(line for line, k in zip(lines, keep) if k)
        remaining = re.sub(r"\n{4,}", "\n\n\n", remaining)
        remaining_tree = ast.parse(remaining)
        still_used = set()
        for node in remaining_tree.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                still_used |= _names_used(node)
        exported_after = set(exported or ()) - set(ex.names)
        # drop the imports only the moved code used (names in __all__ count as used)
        before_used = set().union(*(_names_used(n) for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))))
        drop = (before_used - still_used - exported_after) & used
        remaining = _drop_import_names(remaining, drop)
        # import back the moved names the source still uses
        back = [name for name in ex.names if name in still_used]
        if back:
            remaining = _add_import(remaining, target_module, back)
        if exported is not None:
            remaining = _rewrite_all(remaining, [n for n in exported if n not in ex.names])
        self.write(ex.target, target_text)
        self.write(ex.source, remaining)
        if not self.dry:
            self.git("add", ex.target)

    # -- 3. rewrites ----------------------------------------------------------------------------

    def rewrites(self) -> None:
        listed = self.git("ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
        for rel in sorted(set(filter(None, listed))):
            path = self.root / rel
            if path.resolve() == SELF or not path.is_file():
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if "\0" in text:
                continue
            new = rewrite_text(text)
            if new != text and path.suffix == ".py":
                new = sort_moved_imports(new)
            if new != text:
                self.note(f"rewrite {rel}")
                self.write(rel, new)

    # -- 4. fixups ------------------------------------------------------------------------------

    def fixups(self) -> None:
        for fix in FIXUPS:
            path = self.root / fix.path
            if not path.exists():
                if not fix.optional:
                    self.warn(f"fixup skipped, {fix.path} does not exist")
                continue
            text = path.read_text()
            found = re.search(fix.done or fix.pattern, text, re.MULTILINE | re.DOTALL)
            if (found is not None) if fix.done else (found is None):
                continue
            new, count = re.subn(fix.pattern, fix.replacement, text, flags=re.MULTILINE | re.DOTALL)
            if count == 0 or (fix.count and count != fix.count):
                self.warn(f"fixup of {fix.path} matched {count} times (expected {fix.count or 'some'}): "
                          f"{fix.pattern[:70]!r}; edit it by hand or fix the table")
                continue
            self.note(f"fixup {fix.path}: {(fix.replacement.splitlines() or ['(a deletion)'])[0][:60]!r}")
            self.write(fix.path, new)

    # -- 5. stale build outputs -----------------------------------------------------------------

    def stale_outputs(self) -> None:
        tracked = set(self.git("ls-files", "-z").split("\0"))
        for move in MOVES:
            if Path(move.old).suffix != ".pyx":
                continue
            old = self.root / move.old
            for output in sorted(old.parent.glob(old.stem + ".*")):
                rel = str(output.relative_to(self.root))
                if rel in tracked or output.suffix not in (".so", ".c", ".html"):
                    continue
                self.note(f"delete stale build output {rel}")
                if not self.dry:
                    output.unlink()

    def check_file_paths(self) -> None:
        """Warn about ``__file__`` in moved Python modules: a path made from it may be one level off."""
        fixed = {fix.path for fix in FIXUPS}
        for move in MOVES:
            path = self.root / move.new
            if path.suffix == ".py" and path.exists() and move.new not in fixed and "__file__" in path.read_text():
                self.warn(f"{move.new} uses __file__ and moved to another directory: check its paths")


# -- text rules ----------------------------------------------------------------------------------

_FROM_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)from[ \t]+(?P<module>skippy(?:\.\w+)*)[ \t]+import[ \t]+"
    r"(?:\((?P<paren>(?:[^)#]|\#[^\n]*)*)\)(?P<ptail>[^\n]*)|(?P<plain>(?:[^\n(#\\]|\\\n)*(?:\#[^\n]*)?))",
    re.MULTILINE,
)


def _split_names(body: str) -> tuple[list[tuple[str, str | None]], str]:
    """Names of an import body and its trailing comment(s)."""
    comments = []
    cleaned = []
    for line in body.replace("\\\n", " ").splitlines():
        code, hash_, comment = line.partition("#")
        cleaned.append(code)
        if hash_:
            comments.append("#" + comment.rstrip())
    names: list[tuple[str, str | None]] = []
    for item in " ".join(cleaned).split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split()
        if len(parts) == 3 and parts[1] == "as":
            names.append((parts[0], parts[2]))
        elif len(parts) == 1:
            names.append((parts[0], None))
        else:
            raise ValueError(f"cannot parse import names {body!r}")
    return names, "  ".join(comments)


def _format_from(indent: str, module: str, names: list[tuple[str, str | None]], comment: str,
                 parenthesized: bool) -> str:
    items = [name if alias is None else f"{name} as {alias}" for name, alias in names]
    tail = f"  {comment}" if comment else ""
    line = f"{indent}from {module} import {', '.join(items)}"
    if len(line + tail) <= 120 or len(items) == 1:
        return line + tail
    out = [f"{indent}from {module} import ({tail}"]
    current = indent + "    "
    for item in items:
        piece = item + ","
        if len(current) + len(piece) + 1 > 110 and current.strip():
            out.append(current.rstrip())
            current = indent + "    "
        current += piece + " "
    out.append(current.rstrip())
    out.append(f"{indent})")
    return "\n".join(out)


def _rewrite_from_imports(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        module = match["module"]
        parenthesized = match["paren"] is not None
        body = match["paren"] if parenthesized else match["plain"]
        tail = (match["ptail"] or "") if parenthesized else ""
        try:
            names, comment = _split_names(body)
        except ValueError:
            return match[0]
        tail_comment = tail.strip()
        if tail_comment.startswith("#"):
            comment = (comment + "  " + tail_comment).strip()
        elif tail_comment:
            return match[0]
        groups: dict[str, list[tuple[str, str | None]]] = {module: []}
        changed = False
        for name, alias in names:
            full = f"{module}.{name}"
            if full in MODULE_MAP:
                new = MODULE_MAP[full]
                parent, leaf = new.rsplit(".", 1)
                groups.setdefault(parent, []).append((leaf, alias if alias else (name if leaf != name else None)))
                changed = True
            elif (module, name) in NAME_MAP:
                groups.setdefault(NAME_MAP[(module, name)], []).append((name, alias))
                changed = True
            else:
                groups[module].append((name, alias))
        if not changed:
            return match[0]
        statements = [_format_from(match["indent"], mod, group, comment, parenthesized and mod == module)
                      for mod, group in groups.items() if group]
        return "\n".join(statements)

    return _FROM_IMPORT.sub(replace, text)


def _alternation(keys: list[str]) -> str:
    return "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))


_DOTTED_NAMES = re.compile(
    r"(?<![\w.])(" + _alternation([f"{m}.{n}" for m, n in NAME_MAP]) + r")(?!\w)")
_DOTTED_MODULES = re.compile(r"(?<![\w.])(" + _alternation(list(MODULE_MAP)) + r")(?!\w)")
_PATHS = re.compile(r"(?<![\w.-])(" + _alternation(list(STEM_MAP)) + r")(?=\." + _PATH_EXTENSIONS + r"\b)")


def rewrite_text(text: str) -> str:
    """Every rule of step 3 applied to one file's text."""
    text = _rewrite_from_imports(text)
    text = _DOTTED_NAMES.sub(lambda m: NAME_MAP[tuple(m[1].rsplit(".", 1))] + "." + m[1].rsplit(".", 1)[1],  # type: ignore[index]
                             text)
    text = _DOTTED_MODULES.sub(lambda m: MODULE_MAP[m[1]], text)
    text = _PATHS.sub(lambda m: STEM_MAP[m[1]], text)
    return _LONG_IMPORT.sub(_wrap_long_import, text)


_LONG_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<module>skippy[\w.]*)[ \t]+import[ \t]+"
                          r"(?P<names>[^(#\n\\]+?)(?P<comment>[ \t]+#[^\n]*)?$", re.MULTILINE)


def _wrap_long_import(match: re.Match[str]) -> str:
    """A one-line import of a new place that the longer module name pushed past 120 columns,
    wrapped in parentheses."""
    if len(match[0]) <= 120 or match["module"] not in _NEW_MODULES:
        return match[0]
    names, _ = _split_names(match["names"])
    return _format_from(match["indent"], match["module"], names, (match["comment"] or "").strip(), True)


#: Modules (and their packages) that the rewrite makes code import.
_NEW_MODULES = frozenset(MODULE_MAP.values()) | frozenset(NAME_MAP.values()) \
    | frozenset(m.rsplit(".", 1)[0] for m in MODULE_MAP.values())


def sort_moved_imports(text: str) -> str:
    """Sort by module each run of adjacent top-level ``from skippy... import`` statements that
    imports from a new place (a rewritten import keeps its old place, which no longer sorts)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    runs: list[list[ast.ImportFrom]] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("skippy") \
                and node.col_offset == 0:
            if runs and runs[-1] and (runs[-1][-1].end_lineno or 0) + 1 == node.lineno:
                runs[-1].append(node)
            else:
                runs.append([node])
        else:
            runs.append([])
    for run in reversed(runs):
        if len(run) < 2 or not any(node.module in _NEW_MODULES for node in run):
            continue
        start, end = run[0].lineno - 1, run[-1].end_lineno or run[-1].lineno
        statements = ["".join(lines[n.lineno - 1:n.end_lineno]) for n in run]
        ordered = [statement for _, statement in sorted(zip((n.module or "" for n in run), statements),
                                                           key=lambda pair: pair[0])]
        lines[start:end] = ordered
    return "".join(lines)


# -- AST helpers for the extractions -------------------------------------------------------------

def _top_level_definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    defined: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            defined[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    defined[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined[node.target.id] = node
    return defined


def _is_import_name(tree: ast.Module, name: str) -> bool:
    return any(isinstance(node, (ast.Import, ast.ImportFrom))
               and any((a.asname or a.name.split(".")[0]) == name for a in node.names) for node in tree.body)


def _names_used(node: ast.AST) -> set[str]:
    """Names a piece of code reads, string annotations included."""
    used: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            used.add(sub.id)
        annotations = []
        if isinstance(sub, ast.arg) and sub.annotation is not None:
            annotations.append(sub.annotation)
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.returns is not None:
            annotations.append(sub.returns)
        if isinstance(sub, ast.AnnAssign):
            annotations.append(sub.annotation)
        for annotation in annotations:
            for part in ast.walk(annotation):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    try:
                        used |= {n.id for n in ast.walk(ast.parse(part.value, mode="eval")) if isinstance(n, ast.Name)}
                    except SyntaxError:
                        pass
    return used


def _has_future_annotations(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body)


def _imports_used_by(tree: ast.Module, lines: list[str], used: set[str]) -> list[str]:
    """The source's top-level import statements, cut down to the names ``used`` (source order,
    a blank line between the standard library, third-party and skippy groups)."""
    out: list[tuple[int, str]] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            kept = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used]
            if kept:
                group = _group(kept[0].name)
                out.append((group, "import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "")
                                                         for a in kept) + "\n"))
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            kept = [a for a in node.names if (a.asname or a.name) in used]
            if kept:
                statement = _format_from("", node.module or "", [(a.name, a.asname) for a in kept], "", False)
                out.append((_group(node.module or ""), statement + "\n"))
    result: list[str] = []
    last_group = None
    for group, statement in out:
        if last_group is not None and group != last_group:
            result.append("\n")
        result.append(statement)
        last_group = group
    return result


def _group(module: str) -> int:
    top = module.split(".")[0]
    if top == "skippy":
        return 2
    return 0 if top in sys.stdlib_module_names else 1


def _drop_import_names(text: str, drop: set[str]) -> str:
    if not drop:
        return text
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "module", None) == "__future__":
            continue
        bound = [(a, a.asname or (a.name if isinstance(node, ast.ImportFrom) else a.name.split(".")[0]))
                 for a in node.names]
        if not any(name in drop for _, name in bound):
            continue
        kept = [a for a, name in bound if name not in drop]
        start, end = node.lineno - 1, node.end_lineno or node.lineno
        if not kept:
            edits.append((start, end, ""))
        elif isinstance(node, ast.Import):
            edits.append((start, end, "import " + ", ".join(
                a.name + (f" as {a.asname}" if a.asname else "") for a in kept) + "\n"))
        else:
            original = "".join(lines[start:end])
            edits.append((start, end, _format_from("", node.module or "", [(a.name, a.asname) for a in kept], "",
                                                   "(" in original) + "\n"))
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start:end] = [replacement] if replacement else []
    result = "".join(lines)
    # an import group emptied entirely leaves two blank lines in a row
    return re.sub(r"(\n(?:import|from) [^\n]*\n)\n\n(?=(?:import|from) )", r"\1\n", result)


def _add_import(text: str, module: str, names: list[str]) -> str:
    """Add ``from module import names`` after the last top-level ``from skippy`` import (or the
    last top-level import)."""
    tree = ast.parse(text)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    if not imports:
        raise SystemExit(f"no import to put 'from {module} import ...' next to")
    skippy_imports = [node for node in imports if isinstance(node, ast.ImportFrom)
                      and (node.module or "").startswith("skippy")]
    later = [node for node in skippy_imports if (node.module or "") > module]
    # before the first skippy import that sorts after it, else after the last skippy (or any) import
    insert_at = later[0].lineno - 1 if later else ((skippy_imports or imports)[-1].end_lineno or 0)
    statement = _format_from("", module, [(n, None) for n in _import_order(names)], "", False) + "\n"
    lines = text.splitlines(keepends=True)
    lines.insert(insert_at, statement)
    return "".join(lines)


def _import_order(names: list[str]) -> list[str]:
    """isort's order of imported names: constants, classes, then the rest."""
    return sorted(names, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))


def _all_names(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return None


def _rewrite_all(text: str, names: list[str]) -> str:
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            lines = text.splitlines(keepends=True)
            start, end = node.lineno - 1, node.end_lineno or node.lineno
            items = [f'"{n}"' for n in names]
            one_line = "__all__ = [" + ", ".join(items) + "]\n"
            if end - start == 1 and len(one_line) <= 111:
                new = one_line
            else:
                rows, current = [], "    "
                for item in items:
                    if len(current) + len(item) + 2 > 110 and current.strip():
                        rows.append(current.rstrip() + "\n")
                        current = "    "
                    current += item + ", "
                rows.append(current.rstrip() + "\n")
                new = "__all__ = [\n" + "".join(rows) + "]\n"
            lines[start:end] = [new]
            return "".join(lines)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if applying would change anything")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    args = parser.parse_args(argv)
    run = Relayout(args.root.resolve(), dry=args.check)
    run.moves()
    if run.dry and run.changes:
        print("(moves pending: the later steps are listed as they would run on today's paths)")
    run.extractions()
    run.rewrites()
    run.fixups()
    run.stale_outputs()
    run.check_file_paths()
    if args.check:
        print(f"{len(run.changes)} change(s) pending, {len(run.warnings)} warning(s)")
        return 1 if run.changes else 0
    print(f"applied {len(run.changes)} change(s), {len(run.warnings)} warning(s); "
          "now rebuild the extensions: python setup.py build_ext --inplace")
    return 0


if __name__ == "__main__":
    sys.exit(main())
