"""Weights loaded once per test session: a load is most of a tiny chain's cost.

A generated model's range loads in about 55 ms of CPU (llama.cpp reading the 32000-token vocabulary,
skippy's header parse and identity hash), and the fast suite loaded the same few ranges of the tiny
llama some 200 times (in-process stages, chains and references).  :class:`SharedLoads` patches
:class:`skippy.runtime.Model` for the session: a load with the arguments of an earlier one (the
same file, unchanged on disk, range, weight mode and offload settings) hands out the weights already
loaded, and ``close`` gives them back instead of freeing them; the weights are read-only, and each
``Model`` object is still its own (closed objects raise as before).  The least recently used idle
loads beyond ``limit`` are freed.  Not shared: a load with a progress callback (the callback must
run), and models with per-layer token embeddings (mapped lazily, rows loaded on demand).  A test
marked ``own_loads`` (one that checks loading itself: leaks, file descriptors) loads afresh.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

from skippy._llama import ffi
from skippy.runtime.model import Model

_Key = tuple[object, ...]


class SharedLoads:
    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self.enabled = True
        self.loads = self.reuses = 0
        #: key -> [the owning Model, shared objects open]
        self._entries: OrderedDict[_Key, list[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._init = Model.__init__
        self._close = Model.close

    def install(self) -> None:
        shared = self

        def init(model: Model, path: Any, layers: Any = None, *, progress: Any = None, use_mmap: bool | None = None,
                 n_gpu_layers: int = -1, offload: Any = None) -> None:
            key = shared._key(path, layers, progress, use_mmap, n_gpu_layers, offload)
            if key is None:
                shared._init(model, path, layers, progress=progress, use_mmap=use_mmap, n_gpu_layers=n_gpu_layers,
                             offload=offload)
                return
            shared._share(model, key, lambda owner: shared._init(owner, path, layers, use_mmap=use_mmap,
                                                                 n_gpu_layers=n_gpu_layers, offload=offload))

        def close(model: Model) -> None:
            key = model.__dict__.get("_shared_key")
            if key is None:
                shared._close(model)
                return
            with model._lock:
                if model._ptr != ffi.NULL:
                    model._ptr = ffi.NULL
                    shared._release(key)

        Model.__init__ = init  # type: ignore[method-assign]
        Model.close = close  # type: ignore[method-assign]

    def uninstall(self) -> None:
        Model.__init__ = self._init  # type: ignore[method-assign]
        Model.close = self._close  # type: ignore[method-assign]
        with self._lock:
            for key, (owner, users) in list(self._entries.items()):
                if users == 0:  # (one still open belongs to a test that never closed it)
                    self._close(owner)
                    del self._entries[key]

    def _key(self, path: Any, layers: Any, progress: Any, use_mmap: bool | None, n_gpu_layers: int,
             offload: Any) -> _Key | None:
        if not self.enabled or progress is not None:
            return None
        try:
            stat = os.stat(path)
        except (OSError, TypeError):
            return None  # the real load reports it
        return (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, str(layers), bool(use_mmap),
                n_gpu_layers, repr(offload))

    def _share(self, model: Model, key: _Key, load: Any) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.reuses += 1
                self._adopt(model, key, entry)
                return
        owner = Model.__new__(Model)
        load(owner)  # raises as a fresh load does
        self.loads += 1
        if owner.info.embeds_tokens:
            model.__dict__.update(owner.__dict__)  # this object owns them: close frees them
            return
        with self._lock:
            entry = self._entries.setdefault(key, [owner, 0])
            if entry[0] is not owner:  # another thread loaded the same meanwhile
                self._close(owner)
            self._adopt(model, key, entry)
            self._evict()

    @staticmethod
    def _adopt(model: Model, key: _Key, entry: list[Any]) -> None:
        entry[1] += 1
        model.__dict__.update(entry[0].__dict__)
        model._lock = threading.Lock()
        model._shared_key = key  # type: ignore[attr-defined]

    def _release(self, key: _Key) -> None:
        with self._lock:
            self._entries[key][1] -= 1
            self._evict()

    def _evict(self) -> None:
        idle = [key for key, (_, users) in self._entries.items() if users == 0]
        for key in idle[: max(0, len(self._entries) - self.limit)]:
            owner, _ = self._entries.pop(key)
            self._close(owner)
