"""Weights and vocabularies loaded once per test session: a load is most of a tiny chain's cost.

A generated model's range loads in about 55 ms of CPU (llama.cpp reading the 32000-token vocabulary,
skippy's header parse and identity hash), a vocabulary alone (a driver's :class:`Tokenizer`) in
about 100 ms, and the fast suite loaded the same few ranges of the tiny llama some 200 times
(in-process stages, chains and references).  :class:`SharedLoads` patches
:class:`skippy.runtime.Model` and :class:`skippy.runtime.tokenizer.Tokenizer` for the session: a
load with the arguments of an earlier one (the same file, unchanged on disk; for a model the same
range, weight mode and placement on devices) hands out what is already loaded, and ``close`` gives
it back instead of freeing it.  Weights and vocabularies are read-only, and each object is still
its own (a closed one raises as before).  The least recently used idle loads beyond ``limit``
loads or ``budget`` bytes of weights (the real model's ranges are hundreds of MiB) are freed.  The
header facts a load reads first (``read_gguf_info``, ``model_identity``: pure functions of the
file) are read once per file as it is on disk.  Not shared: a load with a progress callback (the
callback must run).  A test marked ``own_loads`` (one that checks loading itself: leaks, file
descriptors) loads afresh.

A :class:`StageContext` made on a shared model holds its load until the context closes: the
weights are not freed under an open context however the test orders its closes (a context closed
after its model, or never), neither by an eviction nor at the session's end.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import skippy.runtime
import skippy.runtime.local
import skippy.runtime.model
from skippy.runtime.context import StageContext
from skippy.runtime.ffi import ffi
from skippy.runtime.model import Model
from skippy.runtime.tokenizer import Tokenizer

_Key = tuple[object, ...]
#: The classes' own methods and the header readers, as imported (before any install): what every
#: :class:`SharedLoads` loads and frees with, however many are installed at once.
_PATCHED = (Model, Tokenizer, StageContext)
_ORIGINALS = {cls: (cls.__init__, cls.close) for cls in _PATCHED}
_FACTS = [(module, name) for module in (skippy.runtime, skippy.runtime.model, skippy.runtime.local)
          for name in ("read_gguf_info", "model_identity") if hasattr(module, name)]
_ORIGINAL_FACTS = [getattr(module, name) for module, name in _FACTS]


class SharedLoads:
    def __init__(self, limit: int = 48, budget: int = 512 << 20) -> None:
        self.limit = limit
        self.budget = budget
        self.enabled = True
        self.loads = self.reuses = 0
        #: key -> [the owning object, shared objects open, how to free the owner, its weights' bytes]
        #: (the users count each shared object open and each context open on one)
        self._entries: OrderedDict[_Key, list[Any]] = OrderedDict()
        self._lock = threading.Lock()
        #: loads freed (evicted or at uninstall)
        self.frees = 0
        #: what install replaced, put back by uninstall (another SharedLoads's methods when nested)
        self._saved: list[tuple[object, str, object]] = []

    def install(self) -> None:
        shared = self
        model_init, model_close = _ORIGINALS[Model]
        tokenizer_init, tokenizer_close = _ORIGINALS[Tokenizer]
        context_init, context_close = _ORIGINALS[StageContext]

        def init_model(model: Model, path: Any, layers: Any = None, *, progress: Any = None,
                       use_mmap: bool | None = None, n_gpu_layers: int = -1, offload: Any = None,
                       **head: Any) -> None:
            # (of the offload settings the load reads the placement only; attention and KV types are the context's)
            placement = None if offload is None else (offload.n_gpu_layers, offload.device_indices, offload.main_gpu,
                                                      offload.split_mode)
            # (a head split, a head alone or no head: a load of its own, never shared)
            key = None if progress is not None or head else shared._key(path, str(layers), bool(use_mmap),
                                                                        n_gpu_layers, placement)
            if key is None:
                model_init(model, path, layers, progress=progress, use_mmap=use_mmap, n_gpu_layers=n_gpu_layers,
                           offload=offload, **head)
                return
            shared._share(model, key, lambda owner: model_init(owner, path, layers, use_mmap=use_mmap,
                                                               n_gpu_layers=n_gpu_layers, offload=offload),
                          model_close)

        def init_tokenizer(tokenizer: Tokenizer, path: Any) -> None:
            key = shared._key(path, "vocabulary")
            if key is None:
                tokenizer_init(tokenizer, path)
                return
            shared._share(tokenizer, key, lambda owner: tokenizer_init(owner, path), tokenizer_close)

        # (an object shared by another SharedLoads, installed before or after this one, goes back to it)
        def close_model(model: Model) -> None:
            model.__dict__.get("_shared_by", shared)._give_back(model, "_ptr", model_close)

        def close_tokenizer(tokenizer: Tokenizer) -> None:
            tokenizer.__dict__.get("_shared_by", shared)._give_back(tokenizer, "_model", tokenizer_close)

        def init_context(context: StageContext, model: Any, *args: Any, **kwargs: Any) -> None:
            context_init(context, model, *args, **kwargs)
            owner = getattr(model, "__dict__", {}).get("_shared_by")
            if owner is not None:
                owner._hold(context, model.__dict__["_shared_key"])

        def close_context(context: StageContext) -> None:
            context_close(context)
            hold = context.__dict__.get("_shared_hold")
            if hold is not None:
                hold[0]._release(context)

        patches: list[tuple[object, str, object]] = [
            (Model, "__init__", init_model), (Model, "close", close_model),
            (Tokenizer, "__init__", init_tokenizer), (Tokenizer, "close", close_tokenizer),
            (StageContext, "__init__", init_context), (StageContext, "close", close_context)]
        patches += [(module, name, self._remembered(original))
                    for (module, name), original in zip(_FACTS, _ORIGINAL_FACTS)]
        self._saved = [(target, name, getattr(target, name)) for target, name, _ in patches]
        for target, name, value in patches:
            setattr(target, name, value)

    def _remembered(self, read: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``read`` (a pure function of the file) once per file as it is on disk and spelling of its path."""
        answers: dict[_Key, Any] = {}

        def remembered(path: Any) -> Any:
            key = self._key(path)
            if key is None:
                return read(path)
            if key not in answers:
                answers[key] = read(path)  # (raises as before: nothing kept)
            return answers[key]

        return remembered

    def uninstall(self) -> None:
        for target, name, value in reversed(self._saved):
            setattr(target, name, value)
        self._saved = []
        with self._lock:
            for key, (owner, users, free, _) in list(self._entries.items()):
                if users == 0:  # (one still open, or with a context open on it, is left loaded)
                    free(owner)
                    self.frees += 1
                    del self._entries[key]

    def users(self, obj: Any) -> int:
        """Shared objects and contexts open on the load ``obj`` (a model or tokenizer) shares; 0 once freed."""
        key = obj.__dict__.get("_shared_key")
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
            return 0 if entry is None else int(entry[1])

    def _key(self, path: Any, *arguments: object) -> _Key | None:
        if not self.enabled:
            return None
        try:
            stat = os.stat(path)
        except (OSError, TypeError, ValueError):
            return None  # the real load reports it
        # (the path as given: a loaded object reports it, in its info and messages)
        return (os.fspath(path), os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns,
                *arguments)

    def _share(self, obj: Any, key: _Key, load: Callable[[Any], None], free: Callable[[Any], None]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.reuses += 1
                self._adopt(obj, key, entry)
                return
        owner = type(obj).__new__(type(obj))
        load(owner)  # raises as a fresh load does
        self.loads += 1
        with self._lock:
            entry = self._entries.setdefault(key, [owner, 0, free, int(getattr(owner, "size_bytes", 0))])
            if entry[0] is not owner:  # another thread loaded the same meanwhile
                free(owner)
            self._adopt(obj, key, entry)
            self._evict()

    def _adopt(self, obj: Any, key: _Key, entry: list[Any]) -> None:
        entry[1] += 1
        obj.__dict__.update(entry[0].__dict__)
        obj._lock = threading.Lock()
        obj._shared_key = key
        obj._shared_by = self

    def _hold(self, context: StageContext, key: _Key) -> None:
        """``context`` keeps the load of ``key`` until it closes (its model may be closed first)."""
        with self._lock:
            self._entries[key][1] += 1  # (its model is open: the entry is there)
            context.__dict__["_shared_hold"] = (self, key)

    def _release(self, context: StageContext) -> None:
        with self._lock:
            hold = context.__dict__.pop("_shared_hold", None)  # (once: close is idempotent)
            if hold is None:
                return
            self._entries[hold[1]][1] -= 1
            self._evict()

    def _give_back(self, obj: Any, pointer: str, close: Callable[[Any], None]) -> None:
        key = obj.__dict__.get("_shared_key")
        if key is None:
            close(obj)
            return
        with obj._lock:
            if getattr(obj, pointer) == ffi.NULL:
                return
            setattr(obj, pointer, ffi.NULL)
        with self._lock:
            self._entries[key][1] -= 1
            self._evict()

    def _evict(self) -> None:
        """Free the least recently used idle loads beyond ``limit`` loads or ``budget`` bytes of idle weights."""
        idle = [key for key, (_, users, _, _) in self._entries.items() if users == 0]
        idle_bytes = sum(self._entries[key][3] for key in idle)
        for key in idle:
            if len(self._entries) <= self.limit and idle_bytes <= self.budget:
                break
            owner, _, free, size = self._entries.pop(key)
            idle_bytes -= size
            free(owner)
            self.frees += 1
