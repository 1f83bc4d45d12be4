"""Which layers of a model are recurrent, what memory each layer keeps, and whether a file's
recurrent tensors match its declared layer kinds.

Strategy: the layer kinds are read from the GGUF metadata exactly as llama.cpp's loaders set
``hparams.is_recr_impl`` (src/models/<arch>.cpp): a whole-model recurrent architecture (Mamba,
RWKV, Falcon-H1) has every layer recurrent; Qwen3-Next / Qwen3.5 / MiniMax-01 take an
``attention.recurrent_layers`` array or ``(il + 1) % full_attention_interval != 0``; Nemotron-H a
layer with neither KV heads nor an FFN; the other hybrids a layer with 0 KV heads.  A recurrent
layer keeps, per sequence, llama.cpp's f32 ``n_embd_r() + n_embd_s()`` (src/llama-hparams.cpp:
RWKV's token shifts and WKV state, LFM2's short-convolution window, the KDA and linear-attention
heads, else Mamba's conv window and SSM state); an attention layer keeps KV cells.  The planner
(:mod:`skippy.deploy.plan`) and the runtime's figures (:class:`skippy.runtime.model.GGUFInfo`) both ask
:func:`layer_memory`, so the two agree by construction.  :func:`recurrent_tensor_refusal` names
the first tensor of a recurrent kind (``ssm_*``, ``shortconv.*``, ``time_mix_*``) on a layer the
metadata declares attention, or the conv tensor a declared recurrent layer lacks: a stage holding
only some layers would otherwise load such a file and compute garbage, or fail without naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from skippy.runtime.gguf_header import TensorEntry

__all__ = ["recurrent_layers", "recurrent_tensor_refusal", "rolls_back", "state_values_per_layer", "layer_memory",
           "stage_kv_bytes"]

#: llm_arch_is_recurrent (src/llama-arch.cpp) and Falcon-H1 (every layer runs attention + SSM).
_ALL_RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "falcon-h1"})
#: Architectures that read ``attention.recurrent_layers`` or ``full_attention_interval`` (default).
_INTERVAL = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4, "qwen4exp": 4, "minimax-01": 8}
#: A layer is recurrent iff its head_count_kv and feed_forward_length are both 0.
_KV_AND_FF = frozenset({"nemotron_h", "nemotron_h_moe"})
#: A layer is recurrent iff its head_count_kv is 0.
_KV_ONLY = frozenset({"jamba", "granitehybrid", "lfm2", "lfm2moe", "glm5-next", "bailingmoe3", "plamo2",
                      "kimi-linear", "kimi-k3"})
#: llm_arch_is_hybrid's one architecture without a recurrent layer kind (DeepSeek V4's compressed
#: KV): its stages keep checkpoints as well.
_CHECKPOINTED_ONLY = frozenset({"deepseek4"})
_RECURRENT_TENSOR = re.compile(r"^blk\.(\d+)\.(ssm_\w+|shortconv\.\w+|time_mix_\w+)\.(weight|bias)$|"
                               r"^blk\.(\d+)\.(ssm_a|ssm_d)$")
#: The tensor every recurrent layer of a family holds (its convolution); the first found names it.
_CONV_TENSORS = ("ssm_conv1d.weight", "ssm_conv1d_q.weight", "shortconv.conv.weight")
_KV_PROJ = re.compile(r"^blk\.(\d+)\.attn_(k|v|qkv)\.weight$")
_F32 = 4
_F16 = 2


def _per_layer(metadata: Mapping[str, object], key: str, n_layer: int, default: int) -> list[int]:
    value = metadata.get(key, default)
    if isinstance(value, tuple):
        return [int(v) for v in value[:n_layer]] + [0] * (n_layer - len(value))
    return [int(value) if isinstance(value, int) and not isinstance(value, bool) else default] * n_layer


def _first(metadata: Mapping[str, object], key: str, default: int) -> int:
    value = metadata.get(key, default)
    if isinstance(value, tuple):
        value = value[0] if value else default
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def recurrent_layers(arch: str, n_layer: int, metadata: Mapping[str, object]) -> frozenset[int] | None:
    """The layers llama.cpp's loader makes recurrent; None for an architecture without any."""
    if arch in _ALL_RECURRENT:
        return frozenset(range(n_layer))
    if arch in _INTERVAL:
        declared = metadata.get(f"{arch}.attention.recurrent_layers")
        if isinstance(declared, tuple):
            return frozenset(il for il, flag in enumerate(declared[:n_layer]) if flag)
        interval = _first(metadata, f"{arch}.full_attention_interval", _INTERVAL[arch]) or 1
        return frozenset(il for il in range(n_layer) if (il + 1) % interval != 0)
    if arch in _KV_AND_FF or arch in _KV_ONLY:
        kv = _per_layer(metadata, f"{arch}.attention.head_count_kv", n_layer, 0)
        ff = _per_layer(metadata, f"{arch}.feed_forward_length", n_layer, 0)
        return frozenset(il for il in range(n_layer) if kv[il] == 0 and (arch in _KV_ONLY or ff[il] == 0))
    return None


def rolls_back(arch: str) -> bool:
    """Whether llama.cpp counts the architecture recurrent or hybrid (``llm_arch_is_recurrent`` /
    ``llm_arch_is_hybrid``), whatever a file's layers are: its stages roll a session back through
    checkpoints (:mod:`skippy.runtime.rollback`), so a driver never cuts a multi-row chunk to its
    first row on a chain of it."""
    return (arch in _ALL_RECURRENT or arch in _INTERVAL or arch in _KV_AND_FF or arch in _KV_ONLY
            or arch in _CHECKPOINTED_ONLY)


def recurrent_tensor_refusal(arch: str, n_layer: int, metadata: Mapping[str, object],
                             tensor_names: Sequence[str]) -> str | None:
    """Why the file's recurrent tensors do not match its declared layer kinds (None: they do)."""
    recurrent = recurrent_layers(arch, n_layer, metadata)
    if recurrent is None:
        return None
    holders: dict[int, list[str]] = {}
    for name in tensor_names:
        if match := _RECURRENT_TENSOR.match(name):
            holders.setdefault(int(match.group(1) or match.group(4)), []).append(name)
    for layer in sorted(holders):
        if layer < n_layer and layer not in recurrent:
            return (f"tensor {holders[layer][0]!r} is a recurrent layer's, but the metadata declares layer "
                    f"{layer} an attention layer (see {arch}'s head counts / recurrent-layer keys)")
    names = set(tensor_names)
    conv = next((suffix for suffix in _CONV_TENSORS if any(f"blk.{il}.{suffix}" in names for il in recurrent)), None)
    if conv is not None:
        for layer in sorted(recurrent):
            if f"blk.{layer}.{conv}" not in names:
                return (f"tensor 'blk.{layer}.{conv}' is missing: the metadata declares layer {layer} "
                        f"recurrent, and {arch}'s other recurrent layers hold one")
    return None


def state_values_per_layer(arch: str, metadata: Mapping[str, object]) -> int:
    """f32 values of recurrent state one recurrent layer keeps per sequence:
    llama.cpp's ``n_embd_r() + n_embd_s()``."""
    def key(name: str, default: int = 0) -> int:
        return _first(metadata, f"{arch}.{name}", default)

    n_embd, n_head = key("embedding_length"), key("attention.head_count", 1)
    wkv, l_cache, kda = key("wkv.head_size"), key("shortconv.l_cache"), key("kda.head_dim")
    d_conv, d_inner = key("ssm.conv_kernel"), key("ssm.inner_size")
    d_state, n_group = key("ssm.state_size"), key("ssm.group_count")
    if wkv:  # RWKV: token shifts and the WKV state
        return key("token_shift_count", 2) * n_embd + n_embd * wkv
    if l_cache:  # LFM2: the short convolution's window (no SSM state)
        return n_embd * (l_cache - 1) + d_state * d_inner
    if kda:  # Kimi delta attention: conv windows of q, k and v, and a head_dim^2 state per head
        return 3 * (d_conv - 1 if d_conv > 0 else 3) * n_head * kda + kda * kda * n_head
    conv = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
    if arch == "minimax-01":  # linear attention: a key_length^2 state per head
        head = key("attention.key_length", n_embd // max(1, n_head))
        return conv + head * head * n_head
    return conv + d_state * d_inner


def stage_kv_bytes(arch: str, metadata: Mapping[str, object]) -> int:
    """KV bytes per cell (f16) every stage keeps beside its layers' own: a per-token adapter router
    (Granite Switch, a file with ``adapters.count``), one head of the model's head width at KV slot
    n_layer, which every stage runs from the token ids (patch 0014); 0 for other models."""
    if f"{arch}.adapters.count" not in metadata:
        return 0
    n_embd = _first(metadata, f"{arch}.embedding_length", 0)
    head = n_embd // max(1, _first(metadata, f"{arch}.attention.head_count", 1))
    return (_first(metadata, f"{arch}.attention.key_length", head)
            + _first(metadata, f"{arch}.attention.value_length", head)) * _F16


def _attention_kv(arch: str, n_layer: int, metadata: Mapping[str, object], uniform: int) -> tuple[int, ...]:
    """KV bytes per cell (f16) of each layer of an attention-only model: ``uniform`` in every layer,
    except where the file gives sliding-window layers heads of their own width
    (``attention.key_length_swa`` / ``value_length_swa`` beside the ``sliding_window_pattern``
    array: Gemma 4, whose global heads are twice as wide).  There each layer's K is its own width,
    its V row the widest layer's (llama.cpp pads a transposed V cache, which it keeps without flash
    attention, skippy's CPU default), and the trailing ``attention.shared_kv_layers`` keep none (they
    read earlier layers' KV: create_memory's reuse)."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    swa_k = metadata.get(f"{arch}.attention.key_length_swa")
    if not isinstance(pattern, tuple) or not isinstance(swa_k, int) or isinstance(swa_k, bool):
        return (uniform,) * n_layer
    n_embd = _first(metadata, f"{arch}.embedding_length", 0)
    n_head = _first(metadata, f"{arch}.attention.head_count", 1)
    head_k = _first(metadata, f"{arch}.attention.key_length", n_embd // max(1, n_head))
    head_v = _first(metadata, f"{arch}.attention.value_length", head_k)
    swa_v = _first(metadata, f"{arch}.attention.value_length_swa", swa_k)
    kv_heads = _per_layer(metadata, f"{arch}.attention.head_count_kv", n_layer, n_head)
    swa = [il < len(pattern) and bool(pattern[il]) for il in range(n_layer)]
    v_row = max(kv_heads[il] * (swa_v if swa[il] else head_v) for il in range(n_layer))
    kv_layers = n_layer - _first(metadata, f"{arch}.attention.shared_kv_layers", 0)
    return tuple(
        0 if il >= kv_layers else (kv_heads[il] * (swa_k if swa[il] else head_k) + v_row) * _F16
        for il in range(n_layer)
    )


def layer_memory(arch: str, n_layer: int, metadata: Mapping[str, object],
                 tensors: Sequence[TensorEntry], uniform_kv_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(KV bytes per cell, recurrent-state bytes per sequence) of each layer.

    A model without recurrent layers keeps ``uniform_kv_bytes`` (llama.cpp's f16 K + V of one
    cell) in every layer and no state.  A recurrent or hybrid one keeps KV only in its attention
    layers, of the width their K / V projections write (f16; with MLA, ``key_length`` per KV head:
    llama.cpp caches the compressed row and reads V from it), and f32 state in its recurrent ones.
    """
    recurrent = recurrent_layers(arch, n_layer, metadata)
    if not recurrent:
        return _attention_kv(arch, n_layer, metadata, uniform_kv_bytes), (0,) * n_layer
    n_head = _first(metadata, f"{arch}.attention.head_count", 1)
    n_embd = _first(metadata, f"{arch}.embedding_length", 0)
    head_k = _first(metadata, f"{arch}.attention.key_length", n_embd // max(1, n_head))
    widths = [0] * n_layer
    for tensor in tensors:
        if (proj := _KV_PROJ.match(tensor.name)) and int(proj.group(1)) < n_layer and len(tensor.dims) == 2:
            # attn_qkv holds q too: n_head * head_k of its width
            widths[int(proj.group(1))] += tensor.dims[1] - (n_head * head_k if proj.group(2) == "qkv" else 0)
    if f"{arch}.attention.kv_lora_rank" in metadata:  # MLA: the cache holds the compressed K row only
        kv_heads = _per_layer(metadata, f"{arch}.attention.head_count_kv", n_layer, 1)
        widths = [kv_heads[il] * head_k for il in range(n_layer)]
    state = state_values_per_layer(arch, metadata) * _F32
    kv = tuple(0 if il in recurrent and arch not in ("falcon-h1",) else widths[il] * _F16 for il in range(n_layer))
    return kv, tuple(state if il in recurrent else 0 for il in range(n_layer))
