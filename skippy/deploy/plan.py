"""Plan a chain: contiguous layer ranges for a list of hosts, from the GGUF header alone.

Strategy
--------
* **Shape** (:class:`ModelShape`): one pass over the tensor-info table (no weights read). Every
  ``blk.N.*`` tensor is charged to layer N; ``token_embd`` to the first stage; ``output`` and
  ``output_norm`` (or, with a tied head, a second copy of ``token_embd``) to the last stage; any
  other global tensor to every stage.  KV bytes per layer per cell are llama.cpp's f16 cache
  (``(n_embd_k_gqa + n_embd_v_gqa) * 2``; skippy runs with ``swa_full``, so every layer holds every
  cell), plus a per-token adapter router's on every stage (Granite Switch).  A recurrent or hybrid model (:mod:`skippy.runtime.layer_kinds`, which the runtime's
  figures use too) keeps, per recurrent layer and per sequence, llama.cpp's f32 recurrent state
  (``n_embd_r() + n_embd_s()``: Mamba's conv window and SSM state, the delta-net's, LFM2's short
  convolution, RWKV's token shifts and WKV state), and KV cells only in its attention layers, of
  the width their K / V projections write.
* **Memory of a stage** (:func:`stage_memory`): weights + KV (``ctx_size`` cells, shared by all
  sessions) + recurrent state (one slot per sequence id: the sessions and the prefix cache's
  slots) + llama.cpp's compute reserve + the stage process itself (interpreter, libraries and
  the tokenizer tables llama.cpp builds on every stage, which grow with the vocabulary).  The compute reserve is
  llama.cpp's graph peak for one micro-batch without flash attention: the larger of the attention
  scores (``n_ubatch x ctx x n_head`` f32, plus the FFN and residual rows) and, on the last stage,
  the logits rows (``n_ubatch x n_vocab`` f32).  It is allocated up front but becomes resident only
  as long prompts fill it, so it is the part of the figure a short test touches least.  The
  prefix cache's host spill tier (``cache_spill_mib``) is counted on top, as the stage's peak
  (none, and no cache slots, for a model whose stages run without the cache:
  ``skippy.cache.prefix_cache_refusal``).  DeepSeek V4 has terms of its own (``_dsv4_memory``:
  its per-sequence compressed caches, and a reserve fitted to its wide query heads).
* **Time of a stage**: per-token decode time of its layers, plus the output head on the last
  stage, in the batch each stage runs under ``max_sessions`` sessions (about ``max_sessions /
  stages`` rows) and at one row (:class:`LayerTimes`; the cut: :func:`skippy.deploy.cost.choose_cut`).
  Without ``--measure`` it is estimated from the model's shapes (:mod:`skippy.deploy.cost`: the
  longer of computing each part at its weight type's cost in that batch and reading its weights
  once a batch at ``bandwidth_gbs``; MoE layers count their routed experts, attention and
  recurrent layers their own work); with it, each legal segment of layers is timed with the
  runtime in batches of both sizes and the head is timed apart (:func:`measure_times`): on each Ray node
  for a cluster's hosts (:mod:`skippy.deploy.ray_plan`, one :class:`LayerTimes` per host), else on this
  machine, and a named host that could not be measured keeps this machine's figure, which the
  plan says on that stage's line and in its file (``decode_source``).  A host's ``speed`` divides
  its time.
* **Split** (:func:`plan_chain`): hosts keep their order (the chain's order); each gets one
  non-empty contiguous range.  A dynamic programme over (host, end layer) minimises the slowest
  stage under load among splits where every stage fits its host, and a second one takes, among
  those within ``LOAD_TOLERANCE`` of it, the fastest at one row; when none fits, a programme finds the
  split with the smallest worst overshoot and :class:`PlanError` names each host that is short
  and by how much.
* **File** (:meth:`Plan.to_toml`, :func:`load_plan`): a ``[chain]`` table of settings every stage
  shares, one ``[[stage]]`` table per host (``host``, ``layers``, ``listen``, ``downstream`` and an
  ``[stage.expected]`` table of the figures).  A head split (issue 31, :meth:`Plan.with_head_split`)
  adds the final stage's ``head_split`` and ``head_shard_listen``, the serving stage's
  ``serve_head_rows`` and ``head_shard_dial`` (on loopback where both are on one host, else
  ``0.0.0.0`` and the final stage's host: mutual TLS with the stages' certificates, as the stage
  links) and each one's ``head_rows``;
  :func:`plan_head` reads it back.  ``python -m skippy.stage --config plan.toml
  --plan-stage N`` runs stage N of it (:func:`skippy.stage.config.load_config_file`), and
  ``skippy up --plan plan.toml`` runs all of it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import tomllib
from pathlib import Path
from typing import Any, Final, Sequence, final

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from skippy.cache.stage_cache import prefix_cache_refusal
from skippy.deploy.cost import (
    HeadSplit,
    PartCosts,
    LOAD_TOLERANCE,
    Regime,
    choose_cut,
    head_split,
    load_rows,
    part_costs,
    shares,
    split_head_times,
    split_times,
)
from skippy.runtime._architectures import STAGE_TOKEN_EMBEDDINGS
from skippy.runtime.cuts import KvGroup, kv_groups, legal_cuts
from skippy.runtime.gguf_header import GGUFHeaderError, GGUFLayout, header_digest, read_layout
from skippy.runtime.layer_kinds import layer_memory, stage_kv_bytes

__all__ = [
    "DEFAULT_SESSIONS", "HostSpec", "LayerTimes", "ModelShape", "Plan", "PlanError", "PlanSettings", "StagePlan",
    "load_plan", "balanced_stages", "balanced_stages_head", "choose_head_split", "estimated_times", "plan_head",
    "plan_head_split", "measure_layer_times", "measure_times", "parse_size", "plan_chain", "stage_memory",
    "stage_times",
]

MIB: Final = 1 << 20
GIB: Final = 1 << 30
#: Resident memory of an idle stage process before its weights and KV (interpreter, numpy, trio,
#: cffi, llama.cpp's libraries), measured on the development host; plus the tokenizer tables every
#: stage's llama.cpp builds, about this much per vocabulary entry (``tests/test_plan.py`` checks
#: both through whole stage processes).
PROCESS_OVERHEAD_BYTES: Final = 60 * MIB
VOCAB_BYTES_PER_TOKEN: Final = 240
#: Output buffer llama.cpp keeps per sequence on the last stage (one logits row).
_F32: Final = 4
_F16: Final = 2
_BLOCK = re.compile(r"^blk\.(\d+)\.")
#: StageConfig.cache_slots' default: the prefix cache's sequence ids beside the sessions'.
CACHE_SLOTS: Final = 8
_HEAD_TENSORS: Final = frozenset({"output.weight", "output.bias", "output_norm.weight", "output_norm.bias"})
_EMBED_TENSORS: Final = frozenset({"token_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias"})
#: Gemma 4's per-layer token table: mapped and read by rows on demand (skippy.runtime.model), so
#: only the rows of the tokens seen become resident; not counted in a stage's weights.
_PER_LAYER_TABLE: Final = "per_layer_token_embd.weight"
#: Loaders that create the tied head (llama.cpp's duplicate of token_embd) before token_embd itself
#: (src/models/gemma3n.cpp, gemma4.cpp): the loader shares a duplicate only with a tensor created
#: before it, so a stage holding both (the last stage of a model with per-layer token embeddings,
#: or a whole model) holds two copies.
_HEAD_FIRST: Final = frozenset({"gemma3n", "gemma4"})


class PlanError(ValueError):
    """No split fits, or a plan / host description is invalid; the text names what is wrong."""


def parse_size(text: str) -> int:
    """``16GiB``, ``512MiB``, ``8G``, ``1.5T`` or a byte count -> bytes (binary units).

    Raises:
        PlanError: not a size.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not match:
        raise PlanError(f"{text!r} is not a memory size (e.g. 16GiB, 512MiB, 8G)")
    scale = {"": 1, "k": 1 << 10, "m": MIB, "g": GIB, "t": 1 << 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


@final
@dataclasses.dataclass(frozen=True, slots=True)
class HostSpec:
    """A host of the chain: its name (the address peers dial), memory budgets and relative speed.

    ``node_id``: the Ray node this host is (a plan made from a Ray cluster); ``skippy up --ray``
    pins the stage's bundle to it.  A host with GPU memory gets one GPU per stage.
    """

    name: str
    memory: int
    gpu_memory: int = 0
    speed: float = 1.0
    port: int = 7000
    node_id: str = ""

    @property
    def gpus(self) -> int:
        """GPUs a stage on this host asks for (its Ray bundle's ``GPU``)."""
        return 1 if self.gpu_memory > 0 else 0

    @classmethod
    def parse(cls, text: str) -> "HostSpec":
        """``NAME=MEMORY[,gpu=MEMORY][,speed=X][,port=N]``, e.g. ``10.0.0.2=16GiB,gpu=24GiB``.

        Raises:
            PlanError: naming the part that is wrong.
        """
        name, sep, rest = text.partition("=")
        if not sep or not name.strip() or not rest:
            raise PlanError(f"host {text!r} is not NAME=MEMORY[,gpu=MEMORY][,speed=X][,port=N]")
        memory_text, *options = rest.split(",")
        values: dict[str, Any] = {"name": name.strip(), "memory": parse_size(memory_text)}
        for option in options:
            key, sep, value = option.partition("=")
            key = key.strip()
            if not sep:
                raise PlanError(f"host {text!r}: option {option!r} is not KEY=VALUE")
            try:
                if key == "gpu":
                    values["gpu_memory"] = parse_size(value)
                elif key == "speed":
                    values["speed"] = float(value)
                elif key == "port":
                    values["port"] = int(value)
                else:
                    raise PlanError(f"host {text!r}: unknown option {key!r} (gpu, speed, port)")
            except ValueError as exc:
                if isinstance(exc, PlanError):
                    raise
                raise PlanError(f"host {text!r}: {key}={value!r} is not a number") from exc
        host = cls(**values)
        if host.memory <= 0 or host.gpu_memory < 0:
            raise PlanError(f"host {text!r}: memory must be > 0 and gpu memory >= 0")
        if not (math.isfinite(host.speed) and host.speed > 0):
            raise PlanError(f"host {text!r}: speed must be a positive number")
        if not 1 <= host.port <= 65535:
            raise PlanError(f"host {text!r}: port must be in 1..65535")
        return host


def _tensor_bytes(dims: Sequence[int], ggml_type: int) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:  # a type this gguf package does not know
        raise PlanError(f"unknown ggml tensor type {ggml_type}") from exc
    elements = math.prod(dims) if dims else 1
    return elements // block * size


@final
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a GGUF header (bytes unless named otherwise)."""

    path: Path
    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_vocab: int
    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    global_bytes: int
    kv_bytes_per_cell_layer: int
    tied_head: bool
    digest: str
    #: Layers that must share one stage (skippy.runtime.cuts): a split cuts only between groups.
    kv_groups: tuple[KvGroup, ...] = ()
    #: Every stage holds the token embeddings (see stage_memory): per-layer token embeddings, or
    #: layers that read the input embedding (patch 0010's STAGE_TOKEN_EMBEDDINGS).
    reads_tokens: bool = False
    #: Bytes every stage maps but reads only by rows (the per-layer token table).
    mapped_bytes: int = 0
    #: KV bytes per cell of each layer where they differ by layer (a hybrid's attention layers
    #: only); empty: ``kv_bytes_per_cell_layer`` for every layer
    kv_layer_bytes: tuple[int, ...] = ()
    #: recurrent-state bytes per sequence of each layer (recurrent layers); empty: none
    state_layer_bytes: tuple[int, ...] = ()
    #: the file's block count where its layers loop over the blocks (layer il runs block
    #: il % layer_period, Nanbeige's num_loops); 0: one block per layer
    layer_period: int = 0
    #: KV bytes per cell every stage keeps beside its layers' (Granite Switch's router)
    kv_stage_bytes: int = 0
    #: per-token compute of each part (skippy.deploy.cost); None: charged by bytes alone
    costs: PartCosts | None = None
    #: DeepSeek V4: each layer's KV compression ratio (0: raw window only; 4 with the lightning
    #: indexer; 128), the key width and the indexer's key width (see _dsv4_memory)
    compress_ratios: tuple[int, ...] = ()
    head_dim: int = 0
    indexer_head_size: int = 0

    def layer_weight_bytes(self, start: int, end: int) -> int:
        """Weight bytes of layers ``start:end``, each block once (looped layers share blocks)."""
        if not self.layer_period:
            return sum(self.layer_bytes[start:end])
        return sum(self.layer_bytes[b] for b in {il % self.layer_period for il in range(start, end)})

    def kv_bytes_per_cell(self, start: int, end: int) -> int:
        """KV bytes per cell of layers ``start:end``."""
        if self.kv_layer_bytes:
            return sum(self.kv_layer_bytes[start:end]) + self.kv_stage_bytes
        return self.kv_bytes_per_cell_layer * (end - start) + self.kv_stage_bytes

    def state_bytes_per_sequence(self, start: int, end: int) -> int:
        """Recurrent-state bytes per sequence of layers ``start:end``."""
        return sum(self.state_layer_bytes[start:end])

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ModelShape":
        """Read the shape of ``path`` from its header (milliseconds; no weights are read).

        Raises:
            PlanError: not a readable GGUF model file, or one without layers.
        """
        file = Path(path)
        try:
            layout = read_layout(file)
        except (GGUFHeaderError, OSError) as exc:
            raise PlanError(f"cannot read {file}: {exc}") from exc
        return cls._from_layout(file, layout)

    @classmethod
    def _from_layout(cls, file: Path, layout: GGUFLayout) -> "ModelShape":
        meta = layout.metadata
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise PlanError(f"{file} has no general.architecture")

        def number(key: str, default: int | None = None) -> int:
            value = meta.get(f"{arch}.{key}", default)
            if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
                value = max(value)  # a per-layer array (hybrids, OpenELM): the widest layer
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanError(f"{file} lacks {arch}.{key} (a vocab-only file?)")
            return value

        n_layer, n_embd = number("block_count"), number("embedding_length")
        n_head = number("attention.head_count", 1)
        n_head_kv = number("attention.head_count_kv", n_head)
        head_k = number("attention.key_length", n_embd // max(1, n_head))
        head_v = number("attention.value_length", n_embd // max(1, n_head))
        layer_bytes = [0] * n_layer
        embed = head = other = mapped = 0
        n_vocab = 0
        names = set()
        for tensor in layout.tensors:
            names.add(tensor.name)
            size = _tensor_bytes(tensor.dims, tensor.ggml_type)
            block = _BLOCK.match(tensor.name)
            if block:
                index = int(block.group(1))
                if not 0 <= index < n_layer:
                    raise PlanError(f"{file}: tensor {tensor.name} names layer {index} of {n_layer}")
                layer_bytes[index] += size
            elif tensor.name in _EMBED_TENSORS:
                embed += size
                if tensor.name == "token_embd.weight" and len(tensor.dims) == 2:
                    n_vocab = tensor.dims[1]
            elif tensor.name in _HEAD_TENSORS:
                head += size
            elif tensor.name == _PER_LAYER_TABLE:
                mapped += size
            else:
                other += size
        tied = "output.weight" not in names
        loops = meta.get(f"{arch}.num_loops")
        period = 0
        if isinstance(loops, int) and not isinstance(loops, bool) and loops > 1:
            # a looped model (Nanbeige): layer slot il runs block il % the file's block count
            period, n_layer = n_layer, n_layer * loops
            layer_bytes = [layer_bytes[i % period] for i in range(n_layer)]
        if tied:
            head += next((_tensor_bytes(t.dims, t.ggml_type) for t in layout.tensors
                          if t.name == "token_embd.weight"), 0)
        n_ff = meta.get(f"{arch}.feed_forward_length")
        try:
            groups = kv_groups(arch, n_layer, meta)
        except ValueError as exc:
            raise PlanError(f"{file}: {exc}") from exc
        per_layer = meta.get(f"{arch}.embedding_length_per_layer_input")
        kv_per_cell = n_head_kv * (head_k + head_v) * _F16
        # per layer (a hybrid's attention layers, Gemma 4's head widths): the runtime's own figures
        # (GGUFInfo) come from here too
        kv_layers, state_layers = layer_memory(arch, n_layer, meta, layout.tensors, kv_per_cell)
        sizes = {t.name: _tensor_bytes(t.dims, t.ggml_type) for t in layout.tensors}
        costs = part_costs(arch, n_layer, meta, layout.tensors, sizes, layer_period=period)
        return cls(
            path=file, architecture=arch, n_layer=n_layer, n_embd=n_embd,
            n_ff=n_ff if isinstance(n_ff, int) and not isinstance(n_ff, bool) else 4 * n_embd,
            n_head=n_head, n_vocab=n_vocab, layer_bytes=tuple(layer_bytes), embed_bytes=embed,
            head_bytes=head, global_bytes=other, kv_bytes_per_cell_layer=kv_per_cell,
            tied_head=tied, digest=header_digest(file, layout), kv_groups=groups,
            reads_tokens=(isinstance(per_layer, int) and not isinstance(per_layer, bool) and per_layer > 0)
            or arch in STAGE_TOKEN_EMBEDDINGS,
            kv_layer_bytes=kv_layers, state_layer_bytes=state_layers,
            mapped_bytes=mapped, layer_period=period, kv_stage_bytes=stage_kv_bytes(arch, meta),
            costs=costs,
            **_dsv4_shape(arch, n_layer, meta, head_k),
        )


def _dsv4_shape(arch: str, n_layer: int, meta: dict[str, Any], head_k: int) -> dict[str, Any]:
    """The fields of a DeepSeek V4 file that _dsv4_memory reads (none for other models)."""
    ratios = meta.get(f"{arch}.attention.compress_ratios")
    if arch != "deepseek4" or not isinstance(ratios, tuple) or len(ratios) < n_layer:
        return {}
    indexer = meta.get(f"{arch}.attention.indexer.key_length", 0)
    return {"compress_ratios": tuple(int(r) for r in ratios[:n_layer]), "head_dim": head_k,
            "indexer_head_size": indexer if isinstance(indexer, int) else 0}


def _pad256(cells: int) -> int:
    return (cells + 255) // 256 * 256


def _dsv4_memory(shape: ModelShape, start: int, end: int, settings: PlanSettings, sequences: int) -> tuple[int, int]:
    """DeepSeek V4's compressed KV and compute reserve of layers ``start:end`` (bytes).

    KV: beside the raw window cells (the generic term), every layer of ratio r keeps, per
    sequence (one stream each), ctx/r compressed keys (f16, padded to 256 cells), a ratio-4 layer
    also the indexer's keys, and a compressor state of f32 kv and score rows (2r rows of twice the
    width with the overlap of ratio 4, r rows otherwise; llama-kv-cache-dsv4.cpp).  Compute:
    llama.cpp's reserve is ``n_ubatch x 4 x`` (``ctx x n_head`` scores plus four rows of
    ``n_head x head_dim``: the 64 query heads of 512) for raw-only layers, and with compressed
    layers the scores over the compressed cells and indexer too, whose streams grow with the
    sequences: ``ctx x n_head x (11/8 + 3/16 x sequences)`` plus two such rows.  The factors are
    fitted to the Flash shape's reserve (n_ubatch 32..128, ctx 1024..4096, 2..8 sequences: within
    5% above n_ubatch 32)."""
    ratios = shape.compress_ratios[start:end]
    ctx, width = settings.ctx_size, shape.head_dim
    kv = 0
    for ratio in (r for r in ratios if r):
        overlap = 2 if ratio == 4 else 1
        kv += _pad256(ctx // ratio) * width * _F16
        kv += ratio * overlap * overlap * width * 2 * _F32
        if ratio == 4:
            kv += _pad256(ctx // 4) * shape.indexer_head_size * _F16
            kv += 2 * ratio * 2 * shape.indexer_head_size * 2 * _F32
    q_rows = shape.n_head * width
    scores = ctx * shape.n_head
    if any(ratios):
        compute = settings.batch_size * _F32 * (scores * (22 + 3 * sequences) // 16 + 2 * q_rows)
    else:
        compute = settings.batch_size * _F32 * (scores + 4 * q_rows)
    return kv * sequences, compute


@final
@dataclasses.dataclass(frozen=True, slots=True)
class PlanSettings:
    """The chain settings a plan is computed for (and writes into its ``[chain]`` table)."""

    ctx_size: int = 4096
    max_sessions: int = 8
    batch_size: int = 512
    cache_spill_mib: float = 256.0
    prefix_cache: bool = True
    wire_dtype: str = "f32"
    kv_streams: bool = False  #: each sequence id its own ctx_size cells (the stage's --kv-streams)
    bandwidth_gbs: float = 20.0  #: assumed memory bandwidth for time estimates without --measure
    #: assumed compute of a stage (billions of multiply-adds a second) for estimates without --measure
    compute_gmacs: float = 8.0

    def __post_init__(self) -> None:
        if self.ctx_size <= 0 or not 1 <= self.max_sessions <= 256 or self.batch_size <= 0:
            raise PlanError("ctx_size and batch_size must be > 0 and max_sessions in 1..256")
        for name in ("bandwidth_gbs", "compute_gmacs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PlanError(f"{name} must be a positive number")


@final
@dataclasses.dataclass(frozen=True, slots=True)
class StageMemory:
    """A stage's expected memory, by part (bytes)."""

    weights: int
    kv: int
    compute: int
    overhead: int
    spill: int
    gpu: int  #: the part placed in GPU memory (weights of the layers, KV, compute) on a GPU host
    state: int = 0  #: recurrent state of its Mamba layers, every sequence id's

    @property
    def resident(self) -> int:
        """Host memory the stage holds once its compute reserve is in use (spill tier empty)."""
        return self.weights + self.kv + self.state + self.compute + self.overhead - self.gpu

    @property
    def peak(self) -> int:
        """``resident`` plus a full prefix-cache spill tier: what the host budget must cover."""
        return self.resident + self.spill


def stage_memory(shape: ModelShape, start: int, end: int, settings: PlanSettings, *,
                 gpu: bool = False) -> StageMemory:
    """Expected memory of a stage running layers ``start:end`` (see the module notes)."""
    first, last = start == 0, end == shape.n_layer
    weights = shape.layer_weight_bytes(start, end) + shape.global_bytes
    # per-layer token embeddings: every stage embeds the token ids for its layers' inputs
    embeds = first or shape.reads_tokens
    weights += shape.embed_bytes if embeds else 0
    if last:  # a tied head reads token_embd, which a stage that embeds holds once (but see _HEAD_FIRST)
        shared = embeds and shape.tied_head and shape.architecture not in _HEAD_FIRST
        weights += shape.head_bytes - (shape.embed_bytes if shared else 0)
    # a model whose stages run without the prefix cache has no cache slots and no spill tier
    prefix_cache = stage_prefix_cache(settings, shape.architecture)
    sequences = sequence_ids(settings, shape.architecture)
    # shared pool: ctx_size cells in all (patch 0016's placement adds none); --kv-streams: ctx_size
    # cells per sequence id, llama.cpp pads each stream to 256 cells
    cells = -(-settings.ctx_size // 256) * 256 * sequences if settings.kv_streams else settings.ctx_size
    kv = cells * shape.kv_bytes_per_cell(start, end)
    state = sequences * shape.state_bytes_per_sequence(start, end)
    ubatch = settings.batch_size  # skippy's StageContext runs n_ubatch = n_batch
    attention = ubatch * settings.ctx_size * shape.n_head * _F32
    rows = ubatch * (3 * shape.n_ff + 6 * shape.n_embd) * _F32
    compute = attention + rows
    if shape.compress_ratios:
        compressed, compute = _dsv4_memory(shape, start, end, settings, sequences)
        kv += compressed
    if last:
        logits = ubatch * (shape.n_vocab + shape.n_embd) * _F32
        compute = max(compute, logits) + settings.max_sessions * shape.n_vocab * _F32
    spill = int(settings.cache_spill_mib * MIB) if prefix_cache else 0
    on_gpu = 0
    if gpu:  # llama.cpp keeps the input embedding on the host; everything else of the range moves
        on_gpu = weights - (shape.embed_bytes if embeds else 0) + kv + state + compute
    overhead = PROCESS_OVERHEAD_BYTES + VOCAB_BYTES_PER_TOKEN * shape.n_vocab
    return StageMemory(weights, kv, compute, overhead, spill, on_gpu, state)


def stage_prefix_cache(settings: PlanSettings, architecture: str = "") -> bool:
    """Whether the stages keep a prefix cache: asked for, and the model's stages run one."""
    return settings.prefix_cache and prefix_cache_refusal(architecture) is None


def sequence_ids(settings: PlanSettings, architecture: str = "") -> int:
    """llama.cpp sequences of a stage context: the sessions, plus the prefix cache's slots (a
    recurrent memory holds one state slot per sequence)."""
    return settings.max_sessions + (CACHE_SLOTS if stage_prefix_cache(settings, architecture) else 0)


@final
@dataclasses.dataclass(frozen=True, slots=True)
class LayerTimes:
    """Per-layer and output-head decode time (ms per token row) of one host in decode batches of
    ``rows`` rows, and where the figure comes from (``source``: e.g. ``measured on Ray node
    1a2b...``, ``this machine's figure``); ``one_row``: the same parts at one row a batch, where
    ``rows`` > 1 (the cut is priced in both: :func:`skippy.deploy.cost.choose_cut`)."""

    layer_ms: tuple[float, ...]
    head_ms: float
    source: str
    rows: int = 1
    one_row: tuple[tuple[float, ...], float] | None = None

    def regimes(self) -> list[Regime]:
        """The figures as cost regimes: the batch of ``rows`` first, then one row (where given)."""
        found = [Regime(self.rows, tuple(self.layer_ms), self.head_ms)]
        if self.one_row is not None and self.rows > 1:
            found.append(Regime(1, tuple(self.one_row[0]), self.one_row[1]))
        return found


@final
@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage of a plan: its host, range, address and expected figures."""

    index: int
    host: HostSpec
    start: int
    end: int
    memory: StageMemory
    decode_ms: float
    #: where ``decode_ms`` comes from: "estimated", "measured on this machine", a Ray node, or
    #: "this machine's figure (HOST not measured)"
    decode_source: str = "estimated"
    #: the stage's expected share of a token's time through the chain (0..1)
    share: float = 1.0

    @property
    def layers(self) -> str:
        return f"{self.start}:{self.end}"


@final
@dataclasses.dataclass(frozen=True)
class Plan:
    """A computed plan (or one read back from its TOML file)."""

    model: Path
    digest: str
    settings: PlanSettings
    stages: tuple[StagePlan, ...]
    measured: bool = False
    #: The output head split by vocabulary rows (issue 31; :meth:`with_head_split`): rows
    #: ``0:head.rows`` on stage ``head.host``, the rest on the final stage; None: the whole head there.
    head: HeadSplit | None = None
    #: The vocabulary's rows (the final stage's rows end there) and the final stage's head shard port.
    n_vocab: int = 0
    head_port: int = 0

    def with_head_split(self, head: HeadSplit | None, head_ms: float, n_vocab: int) -> "Plan":
        """This plan with the head's rows ``0:head.rows`` on stage ``head.host`` (None: as it is):
        each stage's time and share with them (the final stage's ``head_ms`` in part), and a head
        shard port on the final stage's host that no stage of that host listens on.

        Raises:
            PlanError: the split's stage is not a stage of the chain before the final one, or its
                rows are not below the vocabulary's.
        """
        if head is None:
            return self
        if not 0 <= head.host < len(self.stages) - 1 or not 0 < head.rows < n_vocab:
            raise PlanError(f"a head split of rows 0:{head.rows} on stage {head.host} does not fit a chain of "
                            f"{len(self.stages)} stages and {n_vocab} rows")
        times = split_head_times([stage.decode_ms for stage in self.stages], head_ms, n_vocab, head)
        fractions = shares(times)
        stages = tuple(dataclasses.replace(stage, decode_ms=time_ms, share=share)
                       for stage, time_ms, share in zip(self.stages, times, fractions))
        final = self.stages[-1].host
        taken = {stage.host.port for stage in self.stages if stage.host.name == final.name}
        port = final.port + 1
        while port in taken:
            port += 1
        if port > 65535:
            raise PlanError(f"no port above {final.port} for the head shard on {final.name}")
        return dataclasses.replace(self, stages=stages, head=head, n_vocab=n_vocab, head_port=port)

    def describe(self) -> str:
        """The human-readable plan: one line per stage with its memory and time."""
        sources = {stage.decode_source for stage in self.stages}
        common = sources.pop() if len(sources) == 1 else ""
        estimate = (f"estimated from the shapes at {self.settings.compute_gmacs:g} GMAC/s, "
                    f"{self.settings.bandwidth_gbs:g} GB/s")
        rows = load_rows(self.settings.max_sessions, len(self.stages))
        timing = ("decode times " + (estimate if common == "estimated" else common) if common
                  else "decode times per stage as noted")
        timing += f", per token in a stage's batch of {rows} row{'s' if rows > 1 else ''} under that load"
        lines = [f"plan for {self.model.name} ({len(self.stages)} stages, ctx {self.settings.ctx_size}, "
                 f"{self.settings.max_sessions} sessions, batch {self.settings.batch_size}; {timing})"]
        for stage in self.stages:
            memory = stage.memory
            budget = f"of {stage.host.memory / GIB:.1f} GiB"
            gpu = (f", GPU {memory.gpu / GIB:.2f} of {stage.host.gpu_memory / GIB:.1f} GiB"
                   if stage.host.gpu_memory else "")
            where = stage.host.name + (f" (Ray node {stage.host.node_id[:12]})" if stage.host.node_id else "")
            source = "" if common else f" ({stage.decode_source})"
            rows = self.head_rows(stage.index)
            if rows:
                source += f"; head rows {rows}"
            lines.append(
                f"  stage {stage.index} on {where}: layers {stage.layers:>7}  "
                f"memory {memory.resident / GIB:.2f} GiB (peak {memory.peak / GIB:.2f} {budget}; weights "
                f"{memory.weights / MIB:.0f} MiB, KV {memory.kv / MIB:.0f} MiB, "
                + (f"state {memory.state / MIB:.0f} MiB, " if memory.state else "")
                + f"compute {memory.compute / MIB:.0f} MiB, "
                f"process {memory.overhead / MIB:.0f} MiB, spill {memory.spill / MIB:.0f} MiB){gpu}  "
                f"decode {stage.decode_ms:.2f} ms/token, {stage.share:.0%} of a token's time{source}")
        slowest = max(self.stages, key=lambda s: s.decode_ms)
        total = sum(s.decode_ms for s in self.stages)
        lines.append(f"  per token: {total:.2f} ms through the chain (slowest stage {slowest.index}: "
                     f"{slowest.decode_ms:.2f} ms) plus the network")
        return "\n".join(lines)

    def head_rows(self, index: int) -> str:
        """The head's rows stage ``index`` computes, ``START:END`` ("" where none, or no split)."""
        head = self.head
        if head is None:
            return ""
        if index == len(self.stages) - 1:
            return f"{head.rows}:{self.n_vocab}"
        return f"0:{head.rows}" if index == head.host else ""

    def to_toml(self) -> str:
        """The plan file (see the module notes)."""
        settings = self.settings
        out = [
            "# skippy plan: python -m skippy.stage --config THIS --plan-stage N on each host,",
            "# or skippy up --plan THIS on one machine.",
            "[chain]",
            f"model = {_quote(str(self.model))}",
            f"model_digest = {_quote(self.digest)}",
            f"ctx_size = {settings.ctx_size}",
            f"max_sessions = {settings.max_sessions}",
            f"batch_size = {settings.batch_size}",
            f"wire_dtype = {_quote(settings.wire_dtype)}",
            f"prefix_cache = {'true' if settings.prefix_cache else 'false'}",
            *(["kv_streams = true"] if settings.kv_streams else []),
            f"cache_spill_mib = {settings.cache_spill_mib!r}",
        ]
        for stage in self.stages:
            memory = stage.memory
            out += ["", "[[stage]]", f"host = {_quote(stage.host.name)}", f"layers = {_quote(stage.layers)}",
                    f"listen = {_quote(f'0.0.0.0:{stage.host.port}')}"]
            if stage.host.node_id:  # skippy up --ray pins this stage's bundle to the node
                out.append(f"ray_node = {_quote(stage.host.node_id)}")
            if stage.host.gpus:  # its Ray bundle asks for a GPU
                out.append(f"gpus = {stage.host.gpus}")
            if stage.index + 1 < len(self.stages):
                nxt = self.stages[stage.index + 1].host
                out.append(f"downstream = {_quote(_address(nxt.name, nxt.port))}")
            if self.head is not None:  # issue 31: the head's rows, and the shard link (TLS off loopback)
                final = self.stages[-1].host.name
                local = self.stages[self.head.host].host.name == final
                if stage.index == len(self.stages) - 1:
                    link = _address("127.0.0.1" if local else "0.0.0.0", self.head_port)
                    out += [f"head_split = {self.head.rows}", f"head_shard_listen = {_quote(link)}"]
                elif stage.index == self.head.host:
                    link = _address("127.0.0.1" if local else final, self.head_port)
                    out += [f"serve_head_rows = {self.head.rows}", f"head_shard_dial = {_quote(link)}"]
            # links off loopback use mutual TLS: `skippy certs certs --stages N` makes these (docs/security.md)
            out += [f"tls_cert = {_quote(f'certs/stage-{stage.index}.pem')}",
                    f"tls_key = {_quote(f'certs/stage-{stage.index}.key')}", f"tls_ca = {_quote('certs/ca.pem')}"]
            out += ["[stage.expected]",
                    f"memory_bytes = {memory.resident}", f"peak_bytes = {memory.peak}",
                    f"weights_bytes = {memory.weights}", f"kv_bytes = {memory.kv}", f"state_bytes = {memory.state}",
                    f"compute_bytes = {memory.compute}", f"gpu_bytes = {memory.gpu}",
                    f"host_memory_bytes = {stage.host.memory}", f"host_gpu_memory_bytes = {stage.host.gpu_memory}",
                    f"decode_ms = {stage.decode_ms:.4f}", f"decode_share = {stage.share:.4f}",
                    f"decode_source = {_quote(stage.decode_source)}",
                    *([f"head_rows = {_quote(self.head_rows(stage.index))}"] if self.head_rows(stage.index) else [])]
        return "\n".join(out) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: Keys of a plan file that describe the plan, not a stage setting (dropped for a stage config).
PLAN_ONLY_CHAIN_KEYS: Final = frozenset({"model_digest"})
PLAN_ONLY_STAGE_KEYS: Final = frozenset({"host", "expected", "ray_node", "gpus"})


def load_plan(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``[chain]`` table and the ``[[stage]]`` tables of a plan file.

    Raises:
        PlanError: unreadable, or not a plan (no ``[chain]`` / ``[[stage]]``, bad ranges).
    """
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:  # unreadable file; tomllib.TOMLDecodeError is a ValueError
        raise PlanError(f"cannot read plan {path}: {exc}") from exc
    chain, stages = data.get("chain"), data.get("stage")
    if not isinstance(chain, dict) or not isinstance(stages, list) or not stages:
        raise PlanError(f"{path} is not a skippy plan (needs [chain] and [[stage]] tables)")
    expected = 0
    for index, stage in enumerate(stages):
        layers = stage.get("layers") if isinstance(stage, dict) else None
        match = re.fullmatch(r"(\d+):(\d+)", str(layers))
        if not match or int(match.group(1)) != expected or int(match.group(2)) <= expected:
            raise PlanError(f"{path}: stage {index} layers {layers!r} do not continue the chain at {expected}")
        expected = int(match.group(2))
    return chain, stages


def plan_head(path: Path, stages: Sequence[dict[str, Any]]) -> HeadSplit | None:
    """The head split of a plan file's stage tables (the final stage's ``head_split``, the
    ``serve_head_rows`` of the stage serving the other rows; None: the whole head on the final stage).

    Raises:
        PlanError: one without the other, rows that differ, more than one serving stage, or the
            final stage serving rows.
    """
    def rows(stage: dict[str, Any], key: str) -> int:
        value = stage.get(key, stage.get(key.replace("_", "-"), 0))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"{path}: {key} = {value!r} is not a row count")
        return value

    split = rows(stages[-1], "head_split")
    servers = [(index, rows(stage, "serve_head_rows")) for index, stage in enumerate(stages)
               if rows(stage, "serve_head_rows")]
    if not split and not servers:
        return None
    if len(servers) != 1 or not split or servers[0][1] != split or servers[0][0] == len(stages) - 1:
        raise PlanError(f"{path}: a head split needs the final stage's head_split and one other stage's "
                        f"serve_head_rows, the same rows (got head_split = {split}, serve_head_rows on stages "
                        + (", ".join(f"{index}: {count}" for index, count in servers) or "none") + ")")
    return HeadSplit(servers[0][0], split)


def plan_chain(shape: ModelShape, hosts: Sequence[HostSpec], settings: PlanSettings, *,
               layer_ms: Sequence[float] | None = None, head_ms: float | None = None,
               host_times: Sequence[LayerTimes] | None = None) -> Plan:
    """The fastest split of ``shape`` over ``hosts`` (in order) where every stage fits its host.

    Args:
        layer_ms: per-layer decode time measured on this machine (:func:`measure_layer_times`),
            used for every host; None: estimated from bytes at ``settings.bandwidth_gbs``.
        head_ms: the output head's time with ``layer_ms``.
        host_times: one :class:`LayerTimes` per host (each host's own figures, e.g. measured on
            its Ray node); overrides ``layer_ms``.

    Raises:
        PlanError: more hosts than layers, or no split fits (naming each short host and by how much).
    """
    count, n_layer = len(hosts), shape.n_layer
    if count == 0:
        raise PlanError("no hosts to plan for")
    if count > n_layer:
        raise PlanError(f"{count} hosts but {shape.path.name} has only {n_layer} layers (one stage per host)")
    if host_times is None:
        if layer_ms is None:
            common = estimated_times(shape, settings, rows=load_rows(settings.max_sessions, count))
        else:
            common = LayerTimes(tuple(layer_ms), head_ms or 0.0, "measured on this machine")
        host_times = [common] * count
    elif len(host_times) != count:
        raise PlanError(f"{len(host_times)} host timings for {count} hosts")
    measured = any(times.source != "estimated" for times in host_times)
    legal = set(legal_cuts(n_layer, shape.kv_groups))
    if count - 1 > len(legal):
        raise PlanError(f"{count} hosts need {count - 1} cuts but {shape.path.name} allows only "
                        f"{sorted(legal)} (" + "; ".join(g.describe() for g in shape.kv_groups) + ")")

    def prefix_of(values: Sequence[float]) -> list[float]:
        if len(values) != n_layer:
            raise PlanError(f"{len(values)} layer times for {n_layer} layers")
        prefix = [0.0]
        for value in values:
            prefix.append(prefix[-1] + value)
        return prefix

    prefixes = [prefix_of(times.layer_ms) for times in host_times]
    # the same at one row a batch (the cut's second regime, skippy.deploy.cost.choose_cut)
    single = [prefix_of(times.one_row[0]) if times.one_row is not None else prefix
              for times, prefix in zip(host_times, prefixes)]

    def cost(host_index: int, start: int, end: int) -> tuple[float, int, StageMemory]:
        host, prefix = hosts[host_index], prefixes[host_index]
        head_time = host_times[host_index].head_ms if end == n_layer else 0.0
        memory = stage_memory(shape, start, end, settings, gpu=host.gpu_memory > 0)
        time_ms = (prefix[end] - prefix[start] + head_time) / host.speed
        over = memory.peak - host.memory
        if host.gpu_memory:
            over = max(over, memory.gpu - host.gpu_memory)
        return time_ms, over, memory

    def single_time(host_index: int, start: int, end: int) -> float:
        times, prefix = host_times[host_index], single[host_index]
        head_time = (times.one_row[1] if times.one_row is not None else times.head_ms) if end == n_layer else 0.0
        return (prefix[end] - prefix[start] + head_time) / hosts[host_index].speed

    def solve(objective: str, limit: float = math.inf) -> list[int] | None:
        # best[s][j]: best value of hosts 0..s covering layers 0..j-1; choice[s][j]: start of stage s
        inf = math.inf
        best = [[inf] * (n_layer + 1) for _ in range(count)]
        choice = [[-1] * (n_layer + 1) for _ in range(count)]
        for s in range(count):
            for end in range(s + 1, n_layer - (count - 1 - s) + 1):
                starts = [0] if s == 0 else range(s, end)
                for start in starts:
                    if s > 0 and start not in legal:
                        continue  # a cut inside a KV-sharing group
                    before = 0.0 if s == 0 else best[s - 1][start]
                    if before == inf:
                        continue
                    time_ms, over, _ = cost(s, start, end)
                    if objective == "time":
                        if over > 0 or time_ms > limit:
                            continue
                        value = max(before, time_ms)
                    elif objective == "single":  # among the cuts as fast under load, the best at one row
                        if over > 0 or time_ms > limit:
                            continue
                        value = max(before, single_time(s, start, end))
                    else:
                        value = max(before, float(over))
                    if value < best[s][end]:
                        best[s][end], choice[s][end] = value, start
        if best[count - 1][n_layer] == inf:
            return None
        bounds, end = [n_layer], n_layer
        for s in range(count - 1, -1, -1):
            end = choice[s][end]
            bounds.append(end)
        return bounds[::-1]

    bounds = solve("time")
    if bounds is not None and any(times.one_row is not None for times in host_times):
        fastest = max(cost(s, bounds[s], bounds[s + 1])[0] for s in range(count))
        bounds = solve("single", fastest * (1 + LOAD_TOLERANCE)) or bounds
    if bounds is None:
        closest = solve("overshoot")
        assert closest is not None  # without the fit constraint every split is allowed
        short = []
        for s in range(count):
            _, over, memory = cost(s, closest[s], closest[s + 1])
            if over > 0:
                host = hosts[s]
                what = (f"needs {memory.peak / GIB:.2f} GiB of its {host.memory / GIB:.2f} GiB"
                        if memory.peak > host.memory else
                        f"needs {memory.gpu / GIB:.2f} GiB of its {host.gpu_memory / GIB:.2f} GiB GPU memory")
                short.append(f"host {host.name} (layers {closest[s]}:{closest[s + 1]}) {what}: "
                             f"{over / GIB:.2f} GiB short")
        raise PlanError(f"{shape.path.name} does not fit on these {count} hosts at ctx {settings.ctx_size}, "
                        f"{settings.max_sessions} sessions; the closest split leaves " + "; ".join(short))
    stages = []
    figures = [cost(s, bounds[s], bounds[s + 1]) for s in range(count)]
    fractions = shares([time_ms for time_ms, _, _ in figures])
    for s, (time_ms, _, memory) in enumerate(figures):
        stages.append(StagePlan(s, hosts[s], bounds[s], bounds[s + 1], memory, time_ms, host_times[s].source,
                                fractions[s]))
    return Plan(shape.path, shape.digest, settings, tuple(stages), measured)


#: Sessions a one-machine chain's cut is priced for where no plan settings say (``skippy up``'s
#: ``--max-sessions`` default).
DEFAULT_SESSIONS: Final = 8


def stage_times(shape: ModelShape, n_stages: int, times: LayerTimes | None = None,
                settings: PlanSettings | None = None, *, sessions: int | None = None) -> LayerTimes:
    """The figures a chain of ``n_stages`` is cut by: ``times`` (measured) as given, else
    estimated from the shapes at each stage's batch under ``sessions`` sessions (default
    ``settings.max_sessions``: about ``sessions / n_stages`` rows, :func:`skippy.deploy.cost.load_rows`)
    and at one row."""
    if times is not None:
        return times
    settings = settings or PlanSettings(max_sessions=DEFAULT_SESSIONS)
    return estimated_times(shape, settings, rows=load_rows(sessions or settings.max_sessions, n_stages))


def balanced_stages(shape: ModelShape, n_stages: int, times: LayerTimes | None = None,
                    settings: PlanSettings | None = None, *,
                    sessions: int | None = None) -> tuple[list[tuple[int, int]], list[float]]:
    """``n_stages`` ranges of one machine's chain balanced by cost at each stage's batch under
    ``sessions`` sessions and at one row (:func:`skippy.deploy.cost.choose_cut`, at the legal
    cuts), and each stage's expected share of a token's time under that load.

    Args:
        times: measured figures (:func:`measure_times`); None: estimated from the shapes.

    Raises:
        ValueError: more stages than layers or legal cuts.
    """
    times = stage_times(shape, n_stages, times, settings, sessions=sessions)
    regimes = times.regimes()
    split, _ = choose_cut(regimes, n_stages, shape.n_vocab, shape.kv_groups, head=False)
    return split, shares(regimes[0].stage_times(split, None, shape.n_vocab))


def parse_head_split(text: str) -> str | int:
    """``--head-split``: ``off``, ``auto`` or a row count (the head's rows ``0:ROWS`` moved).

    Raises:
        ValueError: anything else.
    """
    if text in ("off", "auto"):
        return text
    try:
        rows = int(text)
    except ValueError:
        raise ValueError(f"--head-split must be off, auto or a row count (got {text!r})") from None
    if rows <= 0:
        raise ValueError(f"--head-split rows must be > 0 (got {rows})")
    return rows


def choose_head_split(shape: ModelShape, split: Sequence[tuple[int, int]], mode: str | int,
                      times: LayerTimes | None = None, settings: PlanSettings | None = None, *,
                      sessions: int | None = None) -> tuple[HeadSplit | None, list[float]]:
    """The head split of a one-machine chain ``split`` (``mode``: off, auto or a row count;
    :func:`skippy.deploy.cost.head_split` at each stage's batch under ``sessions`` sessions) and
    each stage's expected share of a token's time with it.

    Raises:
        ValueError: a row count not below the vocabulary.
    """
    times = stage_times(shape, len(split), times, settings, sessions=sessions)
    bounds = [start for start, _ in split] + [shape.n_layer]
    stage_ms = split_times(times.layer_ms, times.head_ms, bounds)
    chosen: HeadSplit | None = None
    if mode != "off":
        if isinstance(mode, int) and mode >= shape.n_vocab:
            raise ValueError(f"--head-split {mode}: the head has {shape.n_vocab} rows")
        chosen = head_split(stage_ms, times.head_ms, shape.n_vocab, rows=mode if isinstance(mode, int) else None)
    return chosen, shares(split_head_times(stage_ms, times.head_ms, shape.n_vocab, chosen))


def balanced_stages_head(shape: ModelShape, n_stages: int, times: LayerTimes | None = None,
                         settings: PlanSettings | None = None, *, sessions: int | None = None
                         ) -> tuple[list[tuple[int, int]], HeadSplit | None, list[float]]:
    """``n_stages`` ranges and the head split cut together (:func:`skippy.deploy.cost.choose_cut`:
    a split only where it pays at each stage's batch under ``sessions`` sessions) and each
    stage's expected share of a token's time with them under that load.

    Raises:
        ValueError: more stages than layers or legal cuts.
    """
    times = stage_times(shape, n_stages, times, settings, sessions=sessions)
    regimes = times.regimes()
    split, chosen = choose_cut(regimes, n_stages, shape.n_vocab, shape.kv_groups)
    return split, chosen, shares(regimes[0].stage_times(split, chosen, shape.n_vocab))


def plan_head_split(plan: "Plan", shape: ModelShape, head_ms: float) -> tuple[HeadSplit | None, list[float]]:
    """The head split a plan's chain would take (:func:`skippy.deploy.cost.head_split` over its
    stages' decode times, the final stage's head taking ``head_ms``: both at the plan's batch
    under load) and the shares with it."""
    times = [stage.decode_ms for stage in plan.stages]
    chosen = head_split(times, head_ms, shape.n_vocab)
    return chosen, shares(split_head_times(times, head_ms, shape.n_vocab, chosen))


def estimated_times(shape: ModelShape, settings: PlanSettings, *, rows: int = 1) -> LayerTimes:
    """Per-layer and head decode time per row estimated from the shapes (:mod:`skippy.deploy.cost`)
    in batches of ``rows`` rows, and at one row beside it; a shape without costs: its weight
    bytes read at ``bandwidth_gbs``, a batch's reads shared by its rows."""
    if shape.costs is None:
        per_byte = 1e3 / (settings.bandwidth_gbs * 1e9)
        one = (tuple(b * per_byte for b in shape.layer_bytes), shape.head_bytes * per_byte)
        return LayerTimes(tuple(t / rows for t in one[0]), one[1] / rows, "estimated", rows, one)
    rates = {"gmacs": settings.compute_gmacs, "bandwidth_gbs": settings.bandwidth_gbs}
    one_row = (shape.costs.layer_ms(**rates), shape.costs.head_ms(**rates))
    return LayerTimes(shape.costs.layer_ms(**rates, rows=rows), shape.costs.head_ms(**rates, rows=rows),
                      "estimated", rows, one_row)


def measure_layer_times(shape: ModelShape, *, rows: int = 4, steps: int = 6,
                        threads: int = 0) -> tuple[list[float], float]:
    """Per-layer and head decode time (ms per token row) in batches of ``rows`` rows, measured
    here with the runtime (:func:`measure_times`)."""
    measured = _measure(shape, (rows,), steps=steps, threads=threads)
    return measured[rows]


def measure_times(shape: ModelShape, *, rows: int = 4, steps: int = 6, threads: int = 0,
                  source: str = "measured on this machine") -> LayerTimes:
    """Per-layer and head decode time measured here in batches of ``rows`` rows and of one row
    (one load of each segment for both: see :func:`_measure`).

    Raises:
        skippy.runtime.NativeError: the model cannot be loaded here.
    """
    rows = max(1, rows)
    measured = _measure(shape, tuple(dict.fromkeys((rows, 1))), steps=steps, threads=threads)
    layer_ms, head_ms = measured[rows]
    one = measured[1]
    return LayerTimes(tuple(layer_ms), head_ms, source, rows, (tuple(one[0]), one[1]) if rows > 1 else None)


def _measure(shape: ModelShape, batches: tuple[int, ...], *, steps: int,
             threads: int) -> dict[int, tuple[list[float], float]]:
    """Per-layer and head decode time (ms per token row) measured here for each batch size.

    Each segment between two legal cuts (one layer, or a KV-sharing group) is loaded as a stage of
    its own and decodes ``steps`` batches of each size (one row per session, activations of the
    right width, tokens where the layers read them); the fastest batch (other load on the host
    only adds time) over its rows is the segment's time, shared among a group's layers by their
    estimated cost.  The last segment alternates batches with every row's logits wanted and with
    none: the difference of the two is the output head's time.

    Raises:
        skippy.runtime.NativeError: the model cannot be loaded here.
    """
    import os

    import numpy as np

    from skippy.runtime import Model, StageContext
    from skippy.runtime.model import LayerRange

    most = max(batches)
    threads = threads or max(1, os.cpu_count() or 1)
    n_layer = shape.n_layer
    bounds = [0, *legal_cuts(n_layer, shape.kv_groups), n_layer]
    noise = np.random.default_rng(0)
    layer_ms = {rows: [0.0] * n_layer for rows in batches}
    head_ms = dict.fromkeys(batches, 0.0)
    for start, end in zip(bounds, bounds[1:]):
        cells = max(64, most * 2 * (steps + 2) * len(batches))
        segment: dict[int, float] = {}
        with Model(shape.path, LayerRange(start, end)) as model, StageContext(
                model, n_ctx=cells, max_sessions=most, n_batch=most, threads=threads) as context:
            position = 0
            for rows in batches:
                activations = (noise.standard_normal((rows, context.input_width)).astype(np.float32)
                               if not model.is_first else None)
                tokens = [1 + row for row in range(rows)] if model.is_first or model.reads_tokens else None
                # the last segment alternates batches with every row's logits wanted and with none,
                # so that the two see the same load
                flags: list[list[bool] | None] = ([[True] * rows, [False] * rows] if model.is_last else [None])
                times: list[list[float]] = [[] for _ in flags]
                for step in range(steps + 1):
                    for which, outputs in enumerate(flags):
                        started = time.perf_counter()
                        context.decode(positions=[position] * rows, seq_ids=list(range(rows)), tokens=tokens,
                                       activations=activations, outputs=outputs)
                        if step:  # the first batch warms up
                            times[which].append((time.perf_counter() - started) * 1e3)
                        position += 1
                fastest = [min(values) for values in times]  # other load on the host only adds time
                segment[rows] = fastest[-1]
                if model.is_last:
                    head_ms[rows] = max(0.0, fastest[0] - fastest[1]) / rows
        weights = (shape.costs.layer_macs[start:end] if shape.costs is not None
                   else shape.layer_bytes[start:end])
        total = sum(weights) or 1
        for rows in batches:
            for il in range(start, end):
                layer_ms[rows][il] = max(0.0, segment[rows]) / rows * weights[il - start] / total
    return {rows: (layer_ms[rows], head_ms[rows]) for rows in batches}
