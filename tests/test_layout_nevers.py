"""The package layout's nevers (issue 27): which packages may not import which, read from the code.

Strategy: :data:`NEVERS` maps a checked source (a package: every ``.py`` module under it; or one
module) to the module prefixes none of its modules may import.  Every import statement counts, at
module level, inside functions and under ``TYPE_CHECKING`` alike (a never is about what the code
depends on, not about when it loads); relative imports are resolved, and ``from skippy import
stage`` names ``skippy.stage``.  Only direct imports are read: a module outside the checked
source has its own row or none.  A source that does not exist fails, so when a package moves the
row must follow it (edit the table: the checks are data).  Cython sources are not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: (checked source, prefixes it never imports)
NEVERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the driver and the API talk to stages over the wire; they share only the codec and the network layer
    ("skippy.driver", ("skippy.stage",)),
    ("skippy.api", ("skippy.stage",)),
    # the lane's rules are sans-IO: no event loop, no sockets, no native runtime
    ("skippy.stage.lane_protocol", ("trio", "socket", "skippy.net", "skippy.runtime")),
    # the codec is sans-IO and below everything that uses it
    ("skippy.codec", ("trio", "socket", "ssl", "skippy.net", "skippy.runtime", "skippy.stage", "skippy.driver",
                      "skippy.api", "skippy.deploy")),
    # the network layer knows neither end's protocol
    ("skippy.net", ("skippy.runtime", "skippy.stage", "skippy.driver", "skippy.api", "skippy.deploy")),
)


def modules(source: str, root: Path = ROOT) -> list[tuple[str, Path]]:
    """The modules of a checked source: (dotted name, file)."""
    path = root / Path(*source.split("."))
    if path.is_dir():
        found = []
        for file in sorted(path.rglob("*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), file))
        return found
    if path.with_suffix(".py").is_file():
        return [(source, path.with_suffix(".py"))]
    raise FileNotFoundError(f"{source} is neither a package nor a module under {root}: "
                            "point its NEVERS row at where it lives now")


def imported_modules(module: str, text: str, *, is_package: bool = False) -> set[str]:
    """Every module name an import statement in ``text`` names (``from a import b`` names ``a``
    and ``a.b``: ``b`` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names if alias.name != "*"}
    return names


def violations(source: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    found = []
    for module, file in modules(source, root):
        for name in sorted(imported_modules(module, file.read_text(), is_package=file.name == "__init__.py")):
            if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden):
                found.append(f"{file.relative_to(root)} imports {name}")
    return found


@pytest.mark.parametrize(("source", "forbidden"), NEVERS, ids=[source for source, _ in NEVERS])
def test_never(source: str, forbidden: tuple[str, ...]) -> None:
    assert violations(source, forbidden) == []


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    package = tmp_path / "skippy" / "driver"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import client\n")
    (package / "client.py").write_text(
        "import trio\n"
        "from skippy import stage\n"
        "from ..stage.server import StageServer\n"
        "def late() -> None:\n"
        "    import skippy.stage.transport\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from skippy.stage import errors\n"
        "from skippy.staged import fine\n")
    assert violations("skippy.driver", ("skippy.stage",), tmp_path) == [
        "skippy/driver/client.py imports skippy.stage",
        "skippy/driver/client.py imports skippy.stage.errors",
        "skippy/driver/client.py imports skippy.stage.server",
        "skippy/driver/client.py imports skippy.stage.server.StageServer",
        "skippy/driver/client.py imports skippy.stage.transport",
    ]
    with pytest.raises(FileNotFoundError, match="point its NEVERS row"):
        violations("skippy.lane", ("trio",), tmp_path)
