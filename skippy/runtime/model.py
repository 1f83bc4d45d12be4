"""A GGUF model opened for one contiguous layer range ``[start, end)``.

Strategy: the range is validated in Python first from the GGUF metadata (so the caller gets a
clear error naming the range, the layer count or the architecture), then passed to the patched
llama.cpp as the kv overrides ``stage.layer_start`` / ``stage.layer_end``; the library reports
back the range it loaded, which proves it is the patched build (a stock library ignores the keys).
The head can be split by vocabulary rows (issue 31): ``head=False`` loads a range ending at the last
layer without the head (it hands on its hidden state, ``stage.no_head``), and the empty range
``[n_layer, n_layer)`` is the head alone, optionally only its rows ``head_rows=(r0, r1)``
(``stage.head_row_start`` / ``stage.head_row_end``: only those rows of the weight are read; its
logits rows stay n_vocab wide with only the columns ``[r0, r1)`` written).  ``split_head=r0`` on a
range ending at the last layer loads both: the layers without the head and, beside them, the head
alone for its rows ``[r0, n_vocab)`` (``head_model``); the model is still the last stage, the other rows
come from a head shard (:mod:`skippy.runtime.head_shard`) through its context.
Weights are memory-mapped, except on a partial last stage whose head is tied to the token
embeddings: that stage needs the file's first tensor and its last layers, and the loader can only
trim the two ends of a mapping, so it would stay resident at full-file size; it is read instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable, Final, final

from skippy.runtime import _callbacks
from skippy.runtime._architectures import REFUSED, SPLIT_ARCHITECTURES, STAGE_TOKEN_EMBEDDINGS, STAGE_TOKEN_IDS
from skippy.runtime.cuts import KvGroup, cut_refusal, kv_groups
from skippy.runtime.errors import (
    ClosedError,
    LayerRangeError,
    ModelLoadError,
    UnsupportedArchitecture,
)
from skippy.runtime.ffi import ffi, lib
from skippy.runtime.gguf_header import GGUFHeaderError, read_layout
from skippy.runtime.layer_kinds import layer_memory, recurrent_tensor_refusal, stage_kv_bytes
from skippy.runtime.offload import Offload


ProgressCallback = Callable[[float], object]
_F16: Final = 2


@dataclasses.dataclass(frozen=True, slots=True)
class LayerRange:
    """Layers ``[start, end)`` of a model."""

    start: int
    end: int

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        """Parse ``"A:B"``; raises LayerRangeError on anything else."""
        parts = text.split(":")
        if len(parts) != 2:
            raise LayerRangeError(f"layer range {text!r} is not of the form START:END")
        try:
            start, end = int(parts[0]), int(parts[1])
        except ValueError:
            raise LayerRangeError(f"layer range {text!r} is not of the form START:END (integers)") from None
        return cls(start, end)

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"

    @property
    def n_layers(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFInfo:
    """The few facts about a GGUF file needed before loading it."""

    path: Path
    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    tied_head: bool
    file_size: int
    #: Layers that must share one stage (later layers read earlier layers' KV; skippy.runtime.cuts).
    kv_groups: tuple[KvGroup, ...] = ()
    #: Every stage reads the token ids beside the hidden state: per-layer token embeddings, or
    #: layers that read the ids or the input embedding (patch 0010's architectures).
    reads_tokens: bool = False
    #: ... and holds the token embeddings to embed them (per-layer inputs, an embedding skip).
    embeds_tokens: bool = False

    #: KV bytes per cell (f16) of each layer: a hybrid's attention layers only (skippy.runtime.layer_kinds)
    kv_layer_bytes: tuple[int, ...] = ()
    #: Recurrent-state bytes per sequence (f32) of each layer: a recurrent or hybrid model's
    state_layer_bytes: tuple[int, ...] = ()
    #: KV bytes per cell every stage keeps beside its layers' (Granite Switch's router; layer_kinds)
    kv_stage_bytes: int = 0

    def kv_bytes_per_cell(self, start: int, end: int) -> int:
        """KV bytes one cell (one token position) takes in layers ``start:end`` (f16 cache)."""
        return sum(self.kv_layer_bytes[start:end]) + self.kv_stage_bytes

    def state_bytes_per_sequence(self, start: int, end: int) -> int:
        """Recurrent-state bytes one sequence id holds in layers ``start:end`` (0: none)."""
        return sum(self.state_layer_bytes[start:end])


def _widest(value: object, default: int) -> int:
    """A count, or the largest of a per-layer array of counts (as ``skippy plan`` reads them)."""
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        return max(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def read_gguf_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read architecture, layer count, width and head tying from a GGUF file's metadata."""
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"model file {str(file)!r} does not exist")
    try:
        layout = read_layout(file)
    except (GGUFHeaderError, OSError) as exc:
        raise ModelLoadError(f"{file} is not a readable GGUF file: {exc}") from exc
    metadata = layout.metadata
    tensor_names = [tensor.name for tensor in layout.tensors]

    def field(key: str) -> object:
        return metadata.get(key)

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{file} has no general.architecture")
    n_layer = field(f"{arch}.block_count")
    n_embd = field(f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise ModelLoadError(f"{file} lacks {arch}.block_count / {arch}.embedding_length (vocab-only file?)")
    loops = field(f"{arch}.num_loops")
    if isinstance(loops, int) and not isinstance(loops, bool) and loops > 1:
        n_layer *= loops  # a looped model (Nanbeige): one layer slot per run of a block
    names = set(tensor_names)
    n_head = _widest(field(f"{arch}.attention.head_count"), 1)
    n_head_kv = _widest(field(f"{arch}.attention.head_count_kv"), n_head)
    head_dim_k = field(f"{arch}.attention.key_length")
    head_dim_v = field(f"{arch}.attention.value_length")
    default_head_dim = n_embd // max(1, n_head)
    try:
        groups = kv_groups(arch, n_layer, metadata)
    except ValueError as exc:
        raise ModelLoadError(f"{file}: {exc}") from exc
    per_layer = field(f"{arch}.embedding_length_per_layer_input")
    nextn = field(f"{arch}.nextn_predict_layers")  # MTP blocks after the trunk: not recurrent
    trunk = n_layer - (nextn if isinstance(nextn, int) and not isinstance(nextn, bool) else 0)
    if (refusal := recurrent_tensor_refusal(arch, trunk, metadata, tensor_names)) is not None:
        raise ModelLoadError(f"{file}: {refusal}")
    head_k = head_dim_k if isinstance(head_dim_k, int) else default_head_dim
    head_v = head_dim_v if isinstance(head_dim_v, int) else default_head_dim
    kv_layers, state_layers = layer_memory(arch, n_layer, metadata, layout.tensors,
                                           n_head_kv * (head_k + head_v) * _F16)
    return GGUFInfo(
        path=file,
        architecture=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=head_v,
        tied_head="output.weight" not in names,
        file_size=file.stat().st_size,
        kv_groups=groups,
        reads_tokens=(isinstance(per_layer, int) and per_layer > 0) or arch in STAGE_TOKEN_IDS,
        embeds_tokens=(isinstance(per_layer, int) and per_layer > 0) or arch in STAGE_TOKEN_EMBEDDINGS,
        kv_layer_bytes=kv_layers,
        state_layer_bytes=state_layers,
        kv_stage_bytes=stage_kv_bytes(arch, metadata),
    )


def model_identity(path: Path) -> str:
    """A cheap content identity of a model file: size plus digests of its head and tail."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(4 << 20))
        handle.seek(max(0, size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:24]


def validate_range(info: GGUFInfo, layers: LayerRange) -> None:
    if layers.start == layers.end == info.n_layer:
        if info.architecture not in SPLIT_ARCHITECTURES:
            raise UnsupportedArchitecture(f"architecture {info.architecture!r} does not split: its head cannot "
                                          "run alone")
        return  # the head alone (issue 31's head split)
    if layers.start < 0 or layers.end <= layers.start:
        raise LayerRangeError(f"layer range {layers} is empty or negative (need 0 <= START < END)")
    if layers.end > info.n_layer:
        raise LayerRangeError(
            f"layer range {layers} is out of bounds: {info.path.name} has {info.n_layer} layers"
        )
    partial = layers.start > 0 or layers.end < info.n_layer
    if partial and info.architecture not in SPLIT_ARCHITECTURES:
        reason = REFUSED.get(info.architecture, "an architecture this llama.cpp does not know")
        raise UnsupportedArchitecture(
            f"architecture {info.architecture!r} does not support a partial layer range: {reason} "
            f"(requested {layers} of {info.n_layer}; see docs/architectures.md)"
        )
    for cut in (layers.start, layers.end):
        refusal = cut_refusal(info.n_layer, info.kv_groups, cut)
        if refusal is not None:
            raise LayerRangeError(f"layer range {layers} of {info.path.name}: {refusal}")


def architecture_refusal(name: str) -> str | None:
    """Why the loaded library refuses a partial range of architecture ``name`` (None: it splits)."""
    reason = lib.llama_stage_arch_refusal(name.encode())
    return None if reason == ffi.NULL else ffi.string(reason).decode()


@final
class Model:
    """Layers ``[start, end)`` of a GGUF model loaded into llama.cpp.

    Use as a context manager or call :meth:`close`; the weights are freed when closed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layers: LayerRange | str | None = None,
        *,
        progress: ProgressCallback | None = None,
        use_mmap: bool | None = None,
        n_gpu_layers: int = -1,
        offload: Offload | None = None,
        head: bool = True,
        head_rows: tuple[int, int] | None = None,
        split_head: int | None = None,
    ) -> None:
        """Load ``path`` for ``layers`` (default: all).

        Args:
            path: the GGUF file.
            layers: a LayerRange, ``"A:B"`` or None for the whole model.
            progress: called with a fraction in [0, 1] while loading; returning False aborts.
            use_mmap: map the file (True) or read the range's tensors into process memory (False,
                the default). Read weights decode faster on the hosts measured (3-4% on the real
                Gemma 3 270M in-process, bench/RESULTS-real-model.md, "Weights read, not mapped");
                a mapped file shares its page cache between processes of one host.
            n_gpu_layers: layers to offload when built with a GPU backend (-1: all).
            offload: resolved GPU settings (:mod:`skippy.runtime.offload`); they replace ``n_gpu_layers``.
            head: False: a range ending at the last layer without the output head (it hands on
                its hidden state like a stage before the last).
            head_rows: the head's vocabulary rows ``(r0, r1)`` to compute; only for the head-only
                range ``[n_layer, n_layer)``.
            split_head: on a range ending at the last layer: load it without the head and the
                head's rows ``r0:n_vocab`` beside it as ``head_model`` (issue 31's head split;
                the rows ``0:r0`` come from a head shard attached to its context).

        Raises:
            ModelLoadError, LayerRangeError, UnsupportedArchitecture.
        """
        self.info = read_gguf_info(path)
        if layers is None:
            layers = LayerRange(0, self.info.n_layer)
        elif isinstance(layers, str):
            layers = LayerRange.parse(layers)
        validate_range(self.info, layers)
        #: The head's rows this final stage computes beside its layers (split_head), or None.
        self.head_model: Model | None = None
        if split_head is not None:
            if layers.start == layers.end or layers.end != self.info.n_layer or not head or head_rows is not None:
                raise LayerRangeError(f"a split head needs a non-empty range ending at the last layer "
                                      f"{self.info.n_layer} with the head (got {layers})")
            head = False
        head_only = layers.start == layers.end
        if not head and (head_only or layers.end != self.info.n_layer):
            raise LayerRangeError(f"head=False needs a non-empty range ending at the last layer {self.info.n_layer}, "
                                  f"not {layers}")
        if head_rows is not None and (not head_only or not 0 <= head_rows[0] < head_rows[1]):
            raise LayerRangeError(f"head rows {head_rows[0]}:{head_rows[1]} need 0 <= START < END and the head-only "
                                  f"range {self.info.n_layer}:{self.info.n_layer} (got {layers})")
        self.layers = layers
        self._lock = threading.Lock()
        self.use_mmap = bool(use_mmap)

        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        chosen_devices = None
        if offload is not None:
            params.n_gpu_layers = offload.n_gpu_layers
            params.split_mode = {"none": lib.LLAMA_SPLIT_MODE_NONE, "layer": lib.LLAMA_SPLIT_MODE_LAYER,
                                 "row": lib.LLAMA_SPLIT_MODE_ROW}[offload.split_mode]
            params.main_gpu = offload.main_gpu
            if offload.device_indices:  # a NULL-terminated list of the devices to use
                chosen_devices = ffi.new("ggml_backend_dev_t[]", len(offload.device_indices) + 1)
                for slot, index in enumerate(offload.device_indices):
                    chosen_devices[slot] = lib.ggml_backend_dev_get(index)
                params.devices = chosen_devices
        params.load_mode = lib.LLAMA_LOAD_MODE_MMAP if use_mmap else lib.LLAMA_LOAD_MODE_NONE
        if self.info.embeds_tokens:
            # Per-layer token embeddings: every stage holds the per-layer token table (n_vocab rows
            # of n_layer slices; Gemma 4 E2B's is most of its file), or at least the token
            # embeddings.  Mapped and read on demand, only the rows of the tokens a stage has seen
            # become resident, not the table.
            params.lazy_mode = lib.LLAMA_LAZY_MODE_ON
        keys: list[tuple[str, int]] = [("stage.layer_start", layers.start), ("stage.layer_end", layers.end)]
        if head_rows is not None:
            keys += [("stage.head_row_start", head_rows[0]), ("stage.head_row_end", head_rows[1])]
        if not head:
            keys.append(("stage.no_head", 1))
        overrides = ffi.new("struct llama_model_kv_override[]", len(keys) + 1)  # the last: the end mark
        for slot, (key, value) in enumerate(keys):
            overrides[slot].tag = lib.LLAMA_KV_OVERRIDE_TYPE_INT
            overrides[slot].key = key.encode()
            overrides[slot].val_i64 = value

        params.kv_overrides = overrides
        payload = None
        handle = None
        if progress is not None:
            payload = _callbacks.ProgressPayload(progress)
            handle = ffi.new_handle(payload)
            params.progress_callback = lib.skippy_on_progress
            params.progress_callback_user_data = handle
        _callbacks.take_recent_errors()
        pointer = lib.llama_model_load_from_file(str(self.info.path).encode(), params)
        if payload is not None:
            payload.check()
        if pointer == ffi.NULL:
            detail = _callbacks.take_recent_errors() or "see the skippy.llama log"
            raise ModelLoadError(f"llama.cpp failed to load {self.info.path} layers {layers}: {detail}")
        self._ptr = pointer
        loaded = (lib.llama_model_stage_layer_start(pointer), lib.llama_model_stage_layer_end(pointer))
        if loaded != (layers.start, layers.end):
            lib.llama_model_free(pointer)
            self._ptr = ffi.NULL
            raise ModelLoadError(
                f"libllama loaded layers {loaded[0]}:{loaded[1]} instead of {layers}: not the patched library"
            )
        self.has_head: Final = bool(lib.llama_model_stage_has_head(pointer))
        #: The head's vocabulary rows this model computes (all of them unless ``head_rows``).
        self.head_rows: Final = (int(lib.llama_model_stage_head_row_start(pointer)),
                                 int(lib.llama_model_stage_head_row_end(pointer)))
        if self.has_head != (head and layers.end == lib.llama_model_n_layer(pointer)) or (
                head_rows is not None and self.head_rows != head_rows):
            lib.llama_model_free(pointer)
            self._ptr = ffi.NULL
            raise ModelLoadError(f"libllama loaded head {self.has_head} rows {self.head_rows} instead of {head} "
                                 f"{head_rows}: not the patched library")
        self.n_layer: Final = lib.llama_model_n_layer(pointer)
        self.n_embd: Final = lib.llama_model_n_embd(pointer)
        # n_embd-wide parts per activation row at this stage's boundaries: more than one where the
        # architecture hands on a sideband beside the hidden state (patch 0012: RWKV-7's v_first)
        self.input_rows: Final = 1 if self.is_first else self._boundary_rows(lib.llama_model_n_embd_inp(pointer))
        self.output_rows: Final = 1 if self.is_last else self._boundary_rows(lib.llama_model_n_embd_out(pointer))
        self._vocab = lib.llama_model_get_vocab(pointer)
        self.n_vocab: Final = lib.llama_vocab_n_tokens(self._vocab)
        if split_head is not None:
            try:
                if not 0 < split_head < self.n_vocab:
                    raise LayerRangeError(f"a split head's first local row must be in 1..{self.n_vocab - 1} "
                                          f"(got {split_head})")
                self.head_model = Model(path, LayerRange(self.info.n_layer, self.info.n_layer), use_mmap=use_mmap,
                                        n_gpu_layers=n_gpu_layers, offload=offload,
                                        head_rows=(split_head, self.n_vocab))
            except BaseException:
                lib.llama_model_free(pointer)
                self._ptr = ffi.NULL
                raise
        self.identity: Final = model_identity(self.info.path)

    def _boundary_rows(self, width: int) -> int:
        if width <= 0 or width % self.n_embd:
            raise ModelLoadError(f"{self.info.path}: a stage boundary {width} wide is not whole rows of {self.n_embd}")
        return width // self.n_embd

    # -- facts -------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.info.architecture

    @property
    def is_first(self) -> bool:
        """This stage embeds tokens (layer 0)."""
        return self.layers.start == 0

    @property
    def reads_tokens(self) -> bool:
        """Every stage reads the token ids (per-layer token embeddings, layers that read the ids or
        the input embedding), not the first only."""
        return self.info.reads_tokens

    @property
    def is_last(self) -> bool:
        """This stage produces logits (last layer, with the head)."""
        return self.layers.end == self.n_layer and (self.has_head or self.head_model is not None)

    @property
    def head_only(self) -> bool:
        """The empty range ``[n_layer, n_layer)``: the output head alone (hidden states in, logits out)."""
        return self.layers.start == self.layers.end

    @property
    def size_bytes(self) -> int:
        """Bytes of weights this stage loaded (not the file size; a split head's rows included)."""
        head = 0 if self.head_model is None else self.head_model.size_bytes
        return int(lib.llama_model_size(self.pointer)) + head

    @property
    def n_params(self) -> int:
        return int(lib.llama_model_n_params(self.pointer))

    def is_end_of_generation(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self._vocab, token))

    @property
    def pointer(self) -> object:
        """The ``llama_model *``; raises ClosedError after close()."""
        if self._ptr == ffi.NULL:
            raise ClosedError(f"model {self.info.path.name} [{self.layers}] is closed")
        return self._ptr

    @property
    def vocab_pointer(self) -> object:
        self.pointer  # noqa: B018 - raises when closed
        return self._vocab

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the weights; idempotent.  Contexts on this model must be closed first."""
        with self._lock:
            if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
                lib.llama_model_free(self._ptr)
                self._ptr = ffi.NULL
            if getattr(self, "head_model", None) is not None:
                self.head_model.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if getattr(self, "_ptr", ffi.NULL) == ffi.NULL else "open"
        return f"<Model {self.info.path.name} {self.architecture} layers {self.layers} of {self.info.n_layer} {state}>"
