"""The package layout's nevers (issue 27): which packages may not import which, read from the code.

Strategy: :data:`NEVERS` maps a checked source (a package: every ``.py`` module under it; or one
module) to the module prefixes none of its modules may import.  Every import statement counts, at
module level, inside functions and under ``TYPE_CHECKING`` alike (a never is about what the code
depends on, not about when it loads); relative imports are resolved, and ``from skippy import
stage`` names ``skippy.stage``.  A *transitive* row also follows every skippy module the source
reaches, with the packages whose ``__init__`` that runs (importing ``skippy.stage.errors`` runs
``skippy/stage/__init__.py``), and names the chain that breaks it.  A source that does not exist
fails, so when a package moves its row must follow it (edit the table: the checks are data).
Cython sources are not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: (checked source, prefixes it never imports, transitively)
NEVERS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    # the driver and the API talk to stages over the wire; they share the codec and the network layer
    ("skippy.driver", ("skippy.stage",), True),
    ("skippy.api", ("skippy.stage",), True),
    # the lane's rules are sans-IO: no event loop, no sockets, no native runtime, no server
    ("skippy.lane", ("trio", "socket", "ssl", "cffi", "skippy.net", "skippy.runtime", "skippy.stage",
                     "skippy.driver", "skippy.api", "skippy.deploy"), True),
    # the codec is sans-IO and below everything that uses it
    ("skippy.codec", ("trio", "socket", "ssl", "skippy.net", "skippy.runtime", "skippy.stage", "skippy.driver",
                      "skippy.api", "skippy.deploy"), True),
    # the network layer knows neither end's protocol
    ("skippy.net", ("skippy.runtime", "skippy.stage", "skippy.driver", "skippy.api", "skippy.deploy"), True),
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


def _module_file(name: str, root: Path) -> Path | None:
    """The file of a skippy module or package (None: not one, e.g. a class imported from one)."""
    path = root / Path(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def violations(source: str, forbidden: tuple[str, ...], root: Path = ROOT, *, transitive: bool = False) -> list[str]:
    def banned(name: str) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)

    found = []
    #: module -> the module that first imported it (None: a module of the source)
    reached: dict[str, str | None] = {module: None for module, _ in modules(source, root)}
    queue = list(reached)
    while queue:
        module = queue.pop(0)
        file = _module_file(module, root)
        if file is None:
            continue
        for name in sorted(imported_modules(module, file.read_text(), is_package=file.name == "__init__.py")):
            if banned(name):
                chain = [module]
                while reached[chain[-1]] is not None:
                    chain.append(reached[chain[-1]])  # type: ignore[arg-type]
                found.append(" <- ".join([name, *chain]))
            if not transitive or not name.startswith("skippy"):
                continue
            parts = name.split(".")
            for depth in range(2, len(parts) + 1):  # the packages on the way run their __init__
                prefix = ".".join(parts[:depth])
                if prefix not in reached and _module_file(prefix, root) is not None:
                    reached[prefix] = module
                    queue.append(prefix)
    return sorted(set(found))


@pytest.mark.parametrize(("source", "forbidden", "transitive"), NEVERS, ids=[row[0] for row in NEVERS])
def test_never(source: str, forbidden: tuple[str, ...], transitive: bool) -> None:
    assert violations(source, forbidden, transitive=transitive) == []


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
        "skippy.stage <- skippy.driver.client",
        "skippy.stage.errors <- skippy.driver.client",
        "skippy.stage.server <- skippy.driver.client",
        "skippy.stage.server.StageServer <- skippy.driver.client",
        "skippy.stage.transport <- skippy.driver.client",
    ]
    with pytest.raises(FileNotFoundError, match="point its NEVERS row"):
        violations("skippy.lane", ("trio",), tmp_path)


def test_a_transitive_row_follows_skippy_modules_and_their_packages(tmp_path: Path) -> None:
    for name, text in {"skippy/__init__.py": "", "skippy/api/__init__.py": "",
                       "skippy/api/app.py": "from skippy.shared.ids import check\n",
                       "skippy/shared/__init__.py": "", "skippy/shared/ids.py": "import skippy.stage.errors\n",
                       "skippy/stage/__init__.py": "from skippy.stage.server import serve\n",
                       "skippy/stage/errors.py": "", "skippy/stage/server.py": "import trio\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations("skippy.api", ("skippy.stage",), tmp_path) == []
    assert violations("skippy.api", ("skippy.stage", "trio"), tmp_path, transitive=True) == [
        "skippy.stage.errors <- skippy.shared.ids <- skippy.api.app",
        "skippy.stage.server <- skippy.stage <- skippy.shared.ids <- skippy.api.app",
        "skippy.stage.server.serve <- skippy.stage <- skippy.shared.ids <- skippy.api.app",
        "trio <- skippy.stage.server <- skippy.stage <- skippy.shared.ids <- skippy.api.app",
    ]
