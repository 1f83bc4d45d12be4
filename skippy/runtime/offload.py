"""Where a stage computes: the backend devices of the loaded build and a stage's GPU settings.

Strategy: :class:`OffloadSettings` is plain data (what the command line and config file give: GPU
layers, devices, main GPU, split mode, flash attention, KV cache types), checked on its own by
:meth:`OffloadSettings.check` without the native library.  :meth:`OffloadSettings.resolve` then
meets it with the devices this build and host really have (:func:`devices`, ggml's registry after
the backends are loaded): a named device that does not exist, or a GPU-only setting on a host
without a GPU backend, is a ``ValueError`` naming the setting and listing the devices there are.
Unset GPU layers mean every layer of the stage when a GPU is present and none otherwise, so one
command line serves both kinds of host.  The result (:class:`Offload`) holds the llama.cpp values
``Model`` and ``StageContext`` put into their parameter structs.

Exactness (docs/gpu.md): a split equals the unsplit model bitwise when every layer runs on the same
kind of device with the same flash-attention and cache-type settings in both; GPU and CPU kernels,
flash attention on and off, and quantized (q8_0, q4_0) against f16 caches each give different
(not bitwise equal) logits.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

__all__ = [
    "CACHE_TYPES",
    "FLASH_ATTN_MODES",
    "SPLIT_MODES",
    "Device",
    "Offload",
    "OffloadSettings",
    "devices",
]

#: KV cache element types a stage accepts (llama.cpp's ``--cache-type-k/-v`` names).
CACHE_TYPES: Final = ("f32", "f16", "q8_0", "q4_0")
FLASH_ATTN_MODES: Final = ("off", "on", "auto")
#: none: the whole stage on --main-gpu; layer: layers spread over the devices; row: rows of each
#: matrix spread over them (CUDA only).
SPLIT_MODES: Final = ("none", "layer", "row")

DeviceKind = Literal["cpu", "gpu", "igpu", "accel"]


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """One backend device of the loaded build (``CPU``, ``CUDA0``, ...)."""

    index: int
    name: str
    description: str
    kind: DeviceKind
    memory_free: int
    memory_total: int

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")

    def describe(self) -> str:
        return f"{self.name} ({self.description})"


def devices() -> list[Device]:
    """The devices ggml's registry holds now (the backends the build loaded on this host)."""
    from skippy.runtime.ffi import ffi, lib

    kinds: dict[int, DeviceKind] = {
        lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
        lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
    }
    found = []
    free = ffi.new("size_t *")
    total = ffi.new("size_t *")
    for index in range(lib.ggml_backend_dev_count()):
        device = lib.ggml_backend_dev_get(index)
        lib.ggml_backend_dev_memory(device, free, total)
        found.append(Device(index, ffi.string(lib.ggml_backend_dev_name(device)).decode(),
                            ffi.string(lib.ggml_backend_dev_description(device)).decode(),
                            kinds.get(int(lib.ggml_backend_dev_type(device)), "accel"), int(free[0]), int(total[0])))
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class Offload:
    """Resolved settings for one stage on this host (llama.cpp's values)."""

    #: llama_model_params.n_gpu_layers (-1: every layer and the output head).
    n_gpu_layers: int
    #: registry indices of the devices the model may use (empty: llama.cpp's default, every GPU).
    device_indices: tuple[int, ...]
    main_gpu: int
    split_mode: str
    flash_attn: str
    cache_type_k: str
    cache_type_v: str
    #: the stage's layers that run on a GPU.
    gpu_layers: int

    def describe(self) -> str:
        return (f"{self.gpu_layers} layers on GPU (n_gpu_layers {self.n_gpu_layers}), split {self.split_mode}, "
                f"flash attention {self.flash_attn}, KV cache {self.cache_type_k}/{self.cache_type_v}")


#: What a CPU-only run uses: nothing offloaded, llama.cpp's defaults otherwise.
CPU_ONLY: Final = Offload(0, (), 0, "layer", "off", "f16", "f16", 0)


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadSettings:
    """A stage's GPU settings as given (``None``: not given).

    Attributes:
        n_gpu_layers: how many of the stage's layers to offload (its last ones); None: all of them
            when a GPU backend is present, else 0.
        devices: device names (``CUDA0``, ...) the stage may use; ``("none",)`` or ``("cpu",)``:
            none (CPU only); empty: every GPU.
        main_gpu: index into the used GPUs for ``split_mode`` none (the whole stage) and row
            (intermediate results).
        split_mode: none, layer or row (see :data:`SPLIT_MODES`).
        flash_attn: off, on or auto (llama.cpp decides per device).
        cache_type_k, cache_type_v: KV cache types (:data:`CACHE_TYPES`); a quantized V cache
            needs flash attention.
    """

    n_gpu_layers: int | None = None
    devices: tuple[str, ...] = ()
    main_gpu: int | None = None
    split_mode: str = "layer"
    flash_attn: str = "off"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"

    def check(self) -> "OffloadSettings":
        """Return self after checking the values on their own.

        Raises:
            ValueError: naming the setting.
        """
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise ValueError(f"n_gpu_layers must be >= 0 or unset for all (got {self.n_gpu_layers})")
        if self.main_gpu is not None and self.main_gpu < 0:
            raise ValueError(f"main_gpu must be >= 0 (got {self.main_gpu})")
        for name, value, allowed in (("split_mode", self.split_mode, SPLIT_MODES),
                                     ("flash_attn", self.flash_attn, FLASH_ATTN_MODES),
                                     ("cache_type_k", self.cache_type_k, CACHE_TYPES),
                                     ("cache_type_v", self.cache_type_v, CACHE_TYPES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)} (got {value!r})")
        if self.cache_type_v not in ("f32", "f16") and self.flash_attn == "off":
            raise ValueError(f"cache_type_v {self.cache_type_v} needs flash attention (flash_attn on or auto); "
                             "llama.cpp quantizes the V cache only inside its flash-attention kernel")
        if any(not name.strip() for name in self.devices):
            raise ValueError(f"device names must not be empty (got {','.join(self.devices)!r})")
        return self

    @property
    def cpu_only(self) -> bool:
        return [name.lower() for name in self.devices] in (["none"], ["cpu"])

    def resolve(self, available: list[Device], first_layer: int, end_layer: int, n_layer: int) -> Offload:
        """The llama.cpp values for a stage running layers ``[first_layer, end_layer)`` of ``n_layer``.

        Raises:
            ValueError: a named device does not exist, or a GPU-only setting on a host without a
                GPU (the message lists the devices there are).
        """
        self.check()
        have = ", ".join(device.describe() for device in available) or "none"
        gpus = [device for device in available if device.is_gpu]
        chosen: list[Device] = []
        if self.devices and not self.cpu_only:
            by_name = {device.name.lower(): device for device in available}
            for name in self.devices:
                device = by_name.get(name.strip().lower())
                if device is None:
                    raise ValueError(f"device {name!r} does not exist; this build and host have: {have}")
                if not device.is_gpu:
                    raise ValueError(f"device {name!r} is not a GPU (use --device none for CPU only); "
                                     f"devices: {have}")
                chosen.append(device)
        usable = [] if self.cpu_only else (chosen or gpus)
        if not usable:
            needs_gpu = [label for label, given in (
                (f"--n-gpu-layers {self.n_gpu_layers}", bool(self.n_gpu_layers)),
                (f"--main-gpu {self.main_gpu}", self.main_gpu is not None),
                ("--split-mode row", self.split_mode == "row"),
            ) if given]
            if needs_gpu:
                where = "--device none was given" if self.cpu_only else "this build and host have no GPU device"
                raise ValueError(f"{', '.join(needs_gpu)} needs a GPU, but {where} (devices: {have}); "
                                 "leave it unset to run on the CPU")
            return dataclasses.replace(CPU_ONLY, flash_attn=self.flash_attn, cache_type_k=self.cache_type_k,
                                       cache_type_v=self.cache_type_v)
        main_gpu = self.main_gpu or 0
        if main_gpu >= len(usable):
            raise ValueError(f"--main-gpu {main_gpu} is out of range: the stage uses {len(usable)} GPU(s) "
                             f"({', '.join(device.name for device in usable)})")
        stage_layers = end_layer - first_layer
        wanted = stage_layers if self.n_gpu_layers is None else min(self.n_gpu_layers, stage_layers)
        # llama.cpp offloads layer i when i >= n_layer + 1 - n_gpu_layers (index n_layer is the output
        # head): the stage's last `wanted` layers start at end_layer - wanted.
        n_gpu_layers = -1 if wanted == stage_layers else (0 if wanted == 0 else n_layer + 1 - (end_layer - wanted))
        return Offload(n_gpu_layers, tuple(device.index for device in usable) if chosen else (), main_gpu,
                       self.split_mode, self.flash_attn, self.cache_type_k, self.cache_type_v, wanted)
