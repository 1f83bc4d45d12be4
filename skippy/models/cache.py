# A content-addressed cache of generated model files.
#
# Strategy: the key of a spec is the sha256 of its canonical JSON (every field plus the
# generator version) and of the vocab file's own sha256, so a change to the spec, to the
# generator, or to the tokenizer source gives a new file rather than a stale one. The file name is
# `<readable stem>-<key[:16]>.gguf` in $SKIPPY_MODEL_CACHE (default ~/.cache/skippy/models), which
# is never inside the repository. `write_model` already writes under a temporary name and renames,
# so two processes racing on the same spec both produce the same bytes and the loser's rename
# simply replaces an identical file; a reader never sees a partial model.
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Final

from skippy.models.spec import ModelSpec
from skippy.models.synthetic import ProgressCallback, spec_json, write_model
from skippy.models.vocab_files import read_tokenizer

__all__ = ["CACHE_ENV", "cache_dir", "cached_path", "ensure_model", "spec_key"]

#: Environment variable overriding the cache directory.
CACHE_ENV: Final = "SKIPPY_MODEL_CACHE"


def cache_dir() -> Path:
    """Return the cache directory ($SKIPPY_MODEL_CACHE or ~/.cache/skippy/models); not created."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "skippy" / "models"


def spec_key(spec: ModelSpec) -> str:
    """Return the hex sha256 that identifies the file of a spec.

    Raises:
        skippy.models.vocab_files.VocabNotFoundError: the spec's vocab file cannot be found.
    """
    digest = hashlib.sha256()
    digest.update(spec_json(spec).encode("utf-8"))
    digest.update(b"\0vocab:")
    digest.update(read_tokenizer(spec.vocab).sha256.encode("ascii"))
    return digest.hexdigest()


def cached_path(spec: ModelSpec) -> Path:
    """Return where the cache keeps (or would keep) the file of a spec."""
    return cache_dir() / f"{spec.short_name()}-{spec_key(spec)[:16]}.gguf"


def ensure_model(spec: ModelSpec, *, progress: ProgressCallback | None = None) -> Path:
    """Return the path of the spec's model file, generating it on first use.

    Args:
        spec: the model.
        progress: passed to `write_model` when the file has to be generated.

    Returns:
        The cached file's path.

    Raises:
        skippy.models.vocab_files.VocabNotFoundError: the spec's vocab file cannot be found.
        OSError: the cache directory or file cannot be written.
    """
    path = cached_path(spec)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_model(spec, path, progress=progress)
