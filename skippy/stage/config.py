"""Stage settings: one frozen dataclass, filled from a TOML/JSON file and then the command line.

Strategy: every setting has exactly one definition (``_OPTIONS``: name, type, default, help) from
which both the argparse flags and the config-file schema are derived, so the two forms cannot
drift.  Precedence: built-in defaults < config file (``--config``) < explicit flags.  Values are
validated once, in :func:`StageConfig.validated`, with messages that name the setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any, Final, Sequence

from skippy.codec.protocol import WireDType
from skippy.net.address import Address
from skippy.runtime.offload import CACHE_TYPES, FLASH_ATTN_MODES, SPLIT_MODES, OffloadSettings
from skippy.stage.threads import THREAD_WAITS, host_cores, plan_host_threads


@dataclasses.dataclass(frozen=True, slots=True)
class StageConfig:
    """Everything a stage process needs; see ``python -m skippy.stage --help`` for each field."""

    model: str
    layers: str
    listen: Address = Address("127.0.0.1", 0)
    downstream: Address | None = None
    ctx_size: int = 4096
    max_sessions: int = 8
    threads: int = 0
    thread_wait: str = "auto"
    host_threads: int = 0
    batch_size: int = 512
    wire_dtype: WireDType = WireDType.F32
    max_inflight: int = 4
    reply_credit_limit: int | None = None
    connect_timeout: float = 60.0
    batch_window_ms: float = 0.0
    wire_delay_ms: float = 0.0
    wire_mbps: float = 0.0
    wire_reply_delay_ms: float = 0.0
    write_through: bool = True
    inline_hand_offs: bool = True
    decode_relay: bool = True
    inline_decode: bool = True
    decode_batching: bool = True
    decode_policy: str = "groups"
    chain_stages: int = 0
    stats_file: Path | None = None
    metrics_listen: Address | None = None
    downstream_file: Path | None = None
    drain_timeout: float = 2.0
    exit_on_stdin_eof: bool = False
    heartbeat_timeout: float = 0.0
    standby: bool = False
    log_level: str = "INFO"
    prefix_cache: bool = True
    cache_slots: int = 8
    resume_log_mib: float = 64.0
    resume_hold_s: float = 30.0
    cache_page_size: int = 64
    cache_resident_tokens: int | None = None
    cache_spill_entries: int = 64
    cache_spill_mib: float = 256.0
    cache_min_tokens: int = 0
    cache_input_dtype: str | None = None
    n_gpu_layers: int | None = None
    device: str | None = None
    main_gpu: int | None = None
    split_mode: str = "layer"
    flash_attn: str = "off"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    mmap: bool = False
    kv_streams: bool = False
    recurrent_checkpoints: int = 6
    recurrent_checkpoint_interval: int = 8
    # -- the output head split by vocabulary rows (issue 31; skippy.runtime.head_shard) --
    head_split: int = 0
    head_shard_listen: Address | None = None
    serve_head_rows: int = 0
    head_shard_dial: Address | None = None
    head_shard_dial_file: Path | None = None

    @property
    def offload(self) -> OffloadSettings:
        """The GPU settings (resolved against the host's devices when the stage loads)."""
        names = tuple(name.strip() for name in self.device.split(",")) if self.device else ()
        return OffloadSettings(self.n_gpu_layers, names, self.main_gpu, self.split_mode, self.flash_attn,
                               self.cache_type_k, self.cache_type_v)
    # -- limits per peer and in total (skippy.stage.limits) --
    session_quota: int | None = None
    max_connections: int = 512
    idle_timeout: float = 600.0
    header_timeout: float = 10.0
    frame_timeout: float = 60.0
    max_frame_mib: float | None = None
    max_buffered_mib: float = 256.0
    # -- mutual TLS on stage links (skippy.net.tls) --
    tls: str = "auto"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None

    @property
    def credit_limit(self) -> int:
        """Unacknowledged early-ACKed prefill chunks allowed downstream (at least 1)."""
        if self.reply_credit_limit is not None:
            return max(1, self.reply_credit_limit)
        return max(1, self.max_inflight - 1)

    @property
    def tls_files_needed(self) -> str:
        """Why this stage needs TLS files ("" when none of its links uses TLS)."""
        from skippy.net.tls import link_uses_tls

        if link_uses_tls(self.tls, self.listen.host):
            return f"the stage listens on {self.listen}" + ("" if self.tls == "on" else ", not a loopback address")
        if self.downstream is not None and link_uses_tls(self.tls, self.downstream.host):
            return f"the downstream {self.downstream}" + ("" if self.tls == "on" else " is not a loopback address")
        shard = self.head_shard_listen or Address(self.listen.host, 0)  # the head split's link (issue 31)
        if self.head_split and link_uses_tls(self.tls, shard.host):
            return f"the head shard port {shard}" + ("" if self.tls == "on" else " is not a loopback address")
        dial = self.head_shard_dial
        if self.serve_head_rows and dial is not None and link_uses_tls(self.tls, dial.host):
            return f"the head shard link to {dial}" + ("" if self.tls == "on" else " is not a loopback address")
        return ""

    def validated(self) -> "StageConfig":
        """Return self after checking every value.

        Raises:
            ValueError: naming the setting and the value.
        """
        checks = [
            (self.ctx_size > 0, f"ctx_size must be > 0 (got {self.ctx_size})"),
            (1 <= self.max_sessions <= 256, f"max_sessions must be in 1..256 (got {self.max_sessions})"),
            (self.threads >= 0, f"threads must be >= 0 (got {self.threads})"),
            (self.host_threads >= 0, f"host_threads must be >= 0 (got {self.host_threads})"),
            (self.recurrent_checkpoints >= 1, f"recurrent_checkpoints must be >= 1 (got {self.recurrent_checkpoints})"),
            (self.recurrent_checkpoint_interval >= 1,
             f"recurrent_checkpoint_interval must be >= 1 (got {self.recurrent_checkpoint_interval})"),
            (self.batch_size > 0, f"batch_size must be > 0 (got {self.batch_size})"),
            (0 <= self.chain_stages <= 256, f"chain_stages must be in 0..256 (got {self.chain_stages})"),
            (self.max_inflight >= 1, f"max_inflight must be >= 1 (got {self.max_inflight})"),
            (self.reply_credit_limit is None or self.reply_credit_limit >= 0,
             f"reply_credit_limit must be >= 0 (got {self.reply_credit_limit})"),
            (self.connect_timeout > 0, f"connect_timeout must be > 0 (got {self.connect_timeout})"),
            (0 <= self.batch_window_ms <= 10, f"batch_window_ms must be in [0, 10] (got {self.batch_window_ms})"),
            (math.isfinite(self.wire_delay_ms) and self.wire_delay_ms >= 0,
             f"wire_delay_ms must be finite and >= 0 (got {self.wire_delay_ms})"),
            (math.isfinite(self.wire_reply_delay_ms) and self.wire_reply_delay_ms >= 0,
             f"wire_reply_delay_ms must be finite and >= 0 (got {self.wire_reply_delay_ms})"),
            (math.isfinite(self.wire_mbps) and self.wire_mbps >= 0,
             f"wire_mbps must be finite and >= 0, 0 = unlimited (got {self.wire_mbps})"),
            (self.drain_timeout >= 0, f"drain_timeout must be >= 0 (got {self.drain_timeout})"),
            (self.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR"},
             f"log_level must be DEBUG, INFO, WARNING or ERROR (got {self.log_level})"),
            (not self.prefix_cache or (1 <= self.cache_slots and self.max_sessions + self.cache_slots <= 256),
             f"cache_slots must be >= 1 and max_sessions + cache_slots <= 256 (got {self.cache_slots})"),
            (self.cache_page_size >= 1, f"cache_page_size must be >= 1 (got {self.cache_page_size})"),
            (0 <= self.resume_log_mib < 1 << 30, f"resume_log_mib must be >= 0 (got {self.resume_log_mib})"),
            (0 <= self.resume_hold_s <= 86400, f"resume_hold_s must be in [0, 86400] (got {self.resume_hold_s})"),
            (self.cache_resident_tokens is None or self.cache_resident_tokens >= 0,
             f"cache_resident_tokens must be >= 0 (got {self.cache_resident_tokens})"),
            (self.cache_spill_entries >= 0, f"cache_spill_entries must be >= 0 (got {self.cache_spill_entries})"),
            (math.isfinite(self.cache_spill_mib) and self.cache_spill_mib >= 0,
             f"cache_spill_mib must be finite and >= 0 (got {self.cache_spill_mib})"),
            (self.cache_min_tokens >= 0, f"cache_min_tokens must be >= 0 (got {self.cache_min_tokens})"),
            (self.head_split >= 0 and self.serve_head_rows >= 0,
             f"head_split and serve_head_rows must be >= 0 (got {self.head_split}, {self.serve_head_rows})"),
            (self.downstream is None or not self.head_split,
             "head_split is for the final stage (no --downstream); another stage serves the rows with serve_head_rows"),
            (not self.serve_head_rows or self.head_shard_dial is not None,
             "serve_head_rows needs --head-shard-dial (the final stage's head shard port)"),
            (self.session_quota is None or self.session_quota >= 0,
             f"session_quota must be >= 0, 0 = no quota (got {self.session_quota})"),
            (self.max_connections >= 0, f"max_connections must be >= 0, 0 = no limit (got {self.max_connections})"),
            *((math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, 0 = none (got {value})")
              for name, value in (("idle_timeout", self.idle_timeout), ("header_timeout", self.header_timeout),
                                  ("frame_timeout", self.frame_timeout),
                                  ("heartbeat_timeout", self.heartbeat_timeout),
                                  ("max_buffered_mib", self.max_buffered_mib))),
            (self.max_frame_mib is None or (math.isfinite(self.max_frame_mib) and self.max_frame_mib > 0),
             f"max_frame_mib must be > 0 (got {self.max_frame_mib})"),
            (self.tls in ("auto", "on", "off"), f"tls must be auto, on or off (got {self.tls})"),
            (not self.tls_files_needed or None not in (self.tls_cert, self.tls_key, self.tls_ca),
             f"{self.tls_files_needed}: TLS is on (--tls {self.tls}), so --tls-cert, --tls-key and --tls-ca are "
             "needed (skippy certs makes them; --tls off for a trusted network)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid stage setting: {message}")
        try:
            self.offload.check()
        except ValueError as exc:
            raise ValueError(f"invalid stage setting: {exc}") from None
        return self


def _dtype(text: str) -> WireDType:
    try:
        return WireDType[text.upper()]
    except KeyError:
        raise ValueError(f"activation wire dtype {text!r} is not f32, f16 or q8") from None


def _optional_address(text: str) -> Address | None:
    return None if text in ("", "none") else Address.parse(text)


def _optional_int(text: str) -> int | None:
    return None if str(text) in ("", "none") else int(text)


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (on/off, true/false)")


def _optional_float(text: str) -> float | None:
    return None if str(text) in ("", "none") else float(text)


def _optional_str(text: str) -> str | None:
    return None if text in ("", "none") else text


def _gpu_layers(text: str) -> int | None:
    return None if str(text) in ("", "none", "all") else int(text)


def _choice(name: str, *allowed: str) -> Any:
    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in allowed:
            raise ValueError(f"{name} {text!r} is not one of {', '.join(allowed)}")
        return value
    return parse


def _optional_path(text: str) -> Path | None:
    return None if text in ("", "none") else Path(text)


#: name -> (parser from text, help).  The dataclass holds the defaults.
_OPTIONS: Final[dict[str, tuple[Any, str]]] = {
    "model": (str, "GGUF model file (or null:n_embd=..,n_layer=.. for the no-compute runtime)"),
    "layers": (str, "layer range START:END this stage runs (half-open)"),
    "listen": (Address.parse, "HOST:PORT to listen on for upstream lanes (default 127.0.0.1:0, port 0 = any)"),
    "downstream": (_optional_address, "HOST:PORT of the next stage; absent on the final stage"),
    "ctx_size": (int, "KV cells shared by all sessions of this stage (--kv-streams on: the cells of each)"),
    "max_sessions": (int, "concurrent sessions (lanes, llama sequence ids)"),
    "threads": (int, "compute threads (0 = all cores)"),
    "thread_wait": (_choice("thread_wait", *THREAD_WAITS),
                    "how the compute threads wait between graphs (skippy.stage.threads): spin (libgomp's spin, "
                    "then sleep), passive (sleep at once), or auto: spin when the compute threads of the stages "
                    "on this host (--host-threads, else --threads) fit its cores, else passive; OMP_WAIT_POLICY "
                    "or GOMP_SPINCOUNT in the environment overrides it"),
    "host_threads": (int, "compute threads of all the skippy stages on this host, this one's included, for "
                     "--thread-wait auto (the launchers set it; 0 = this stage's --threads; a plan file counts "
                     "its stages on this stage's host)"),
    "batch_size": (int, "rows per llama.cpp batch; use the same value on every stage for exactness"),
    "wire_dtype": (_dtype, "activation dtype sent downstream: f32 (exact), f16 or q8"),
    "max_inflight": (int, "frames in flight per lane; the default credit limit is max_inflight - 1"),
    "reply_credit_limit": (_optional_int, "early-ACKed prefill chunks allowed unacknowledged downstream"),
    "connect_timeout": (float, "seconds to keep retrying the downstream connect before failing the lane"),
    "batch_window_ms": (float, "wait this long to collect more decode rows into one batch (0 = none)"),
    "wire_delay_ms": (float, "simulated one-way delay added to downstream writes (benchmarks)"),
    "wire_mbps": (float, "simulated downstream bandwidth in Mbit/s (0 = unlimited)"),
    "wire_reply_delay_ms": (float, "simulated one-way delay added to every reply this stage writes, upstream "
                            "or into a direct-return lane (benchmarks; docs/protocol.md §8)"),
    "write_through": (_bool, "on: the runtime thread writes a decode's frame (or a final stage's token) as its "
                      "compute ends; off: the trio side writes it (bench/RESULTS-stage.md has both figures)"),
    "inline_hand_offs": (_bool, "on: a lane task does an idle next task's step itself instead of waking it; "
                         "off: every message takes every hop (bench/RESULTS-stage.md has both figures)"),
    "recurrent_checkpoints": (int, "recurrent and hybrid models: checkpoints of its recurrent state kept per session "
                              "for rollbacks (a verify window's rejected drafts, a run's overshoot, forks); each "
                              "holds the state of this stage's layers (skippy.runtime.rollback)"),
    "recurrent_checkpoint_interval": (int, "recurrent and hybrid models: one-row decodes between two checkpoints "
                                      "(every prefill chunk and verify window takes one)"),
    "decode_relay": (_bool, "on: a stage relays a session's steady decode (hop by hop or direct return) in a loop "
                     "outside Python (skippy.stage._relay); off: every token takes the lane's path "
                     "(bench/RESULTS-stage.md has both figures)"),
    "inline_decode": (_bool, "on: a lone decode row on a stage with one lane open is computed on the trio thread, "
                      "without the runtime thread's hand-off (one compute thread only: with more, every compute "
                      "runs on the runtime thread, one OpenMP pool); off: always on the runtime thread "
                      "(bench/RESULTS-stage.md has both figures)"),
    "decode_batching": (_bool, "on: single-row decodes of different sessions that are ready together run as one "
                        "llama.cpp batch (throughput); off: each runs alone, so a session's logits never "
                        "depend on other sessions' traffic (bitwise reproducible under load)"),
    "decode_policy": (_choice("decode_policy", "groups", "greedy"),
                      "with decode batching: groups (default): the decode sessions are batched in groups that "
                      "rotate through the chain, one group per stage at a time, every ready row of a group in one "
                      "batch (docs/throughput.md); greedy: every ready row at once, as it comes (before issue 31)"),
    "chain_stages": (int, "stages in the chain (the launchers set it): the decode groups of --decode-policy groups; "
                     "0: 1 on a stage holding the whole model, else 2"),
    "stats_file": (_optional_path, "write the stage's counters as JSON to this file while serving"),
    "downstream_file": (_optional_path, "a file holding HOST:PORT of the next stage, read at every downstream dial "
                        "(overrides --downstream while it exists): a launcher re-wires a running stage by rewriting it"),
    "metrics_listen": (_optional_address, "HOST:PORT to serve Prometheus metrics on (GET /metrics; port 0 = any, "
                       "logged as 'metrics on http://HOST:PORT/metrics'); absent: no metrics server"),
    "drain_timeout": (float, "seconds to let lanes finish after SIGTERM before cancelling them"),
    "exit_on_stdin_eof": (_bool, "on: drain and exit (as on SIGTERM) when standard input reaches end of file; "
                          "a launcher holds a pipe on it, so the stage goes when the launcher does, however "
                          "it dies (with stdin at /dev/null the stage stops at once)"),
    "heartbeat_timeout": (float, "seconds the downstream may leave heartbeats unanswered before the lanes using it "
                          "close as DOWNSTREAM_LOST naming it (docs/protocol.md §13; a killed one is seen at once); "
                          "0 = no heartbeats (the default; skippy up passes 1.2)"),
    "standby": (_bool, "on: load the model, log 'standby ... waiting', then wait for a line 'activate HOST:PORT' on "
                "standard input and only then listen there (a launcher's warm standby, docs/replacement.md); "
                "implies --exit-on-stdin-eof"),
    "log_level": (str, "DEBUG, INFO, WARNING or ERROR"),
    "prefix_cache": (_bool, "keep the KV of recent prompt prefixes (docs/prefix-cache.md): on or off"),
    "cache_slots": (int, "sequence ids reserved for resident cached prefixes (max_sessions + slots <= 256)"),
    "resume_log_mib": (float, "memory for the activations this stage sent downstream, per session, so a request "
                       "survives a lost stage behind it without recomputing here (docs/protocol.md §14; 0 = off: "
                       "such a resume recomputes the session's positions on this stage)"),
    "resume_hold_s": (float, "seconds a session whose lane was lost with a stage waits for its driver's resume "
                      "before it is released (docs/protocol.md §14)"),
    "cache_page_size": (int, "tokens per cache page; use the same value on every stage"),
    "cache_resident_tokens": (_optional_int, "KV cells resident cached prefixes may hold (none = unlimited)"),
    "cache_spill_entries": (int, "cached prefixes kept in host memory after eviction (0 = no spill tier)"),
    "cache_spill_mib": (float, "host memory for spilled prefixes, MiB (0 = no spill tier)"),
    "cache_min_tokens": (int, "shortest prefix worth caching"),
    "cache_input_dtype": (_optional_str, "input wire dtype named in the cache identity (default: tokens on "
                          "the first stage, else this stage's wire_dtype)"),
    "head_split": (int, "final stage: compute only the head's vocabulary rows N: here; rows 0:N come from the stage "
                   "that serves them (--serve-head-rows N), which dials --head-shard-listen (0 = the whole head here; "
                   "docs/throughput.md, 'The head split')"),
    "head_shard_listen": (_optional_address, "HOST:PORT the final stage of a split head listens on for the stage "
                          "serving its other head rows (port 0 = any, logged as 'head shard port on HOST:PORT'); "
                          "default: the --listen host, any port"),
    "serve_head_rows": (int, "serve the head's vocabulary rows 0:N of this model file to the final stage of a split "
                        "head (beside this stage's layers, on a thread of its own), dialling --head-shard-dial"),
    "head_shard_dial": (_optional_address, "HOST:PORT of the final stage's head shard port (with serve_head_rows); "
                        "the link uses TLS under the --tls rule, as the stage links do"),
    "head_shard_dial_file": (_optional_path, "a file holding HOST:PORT of the final stage's head shard port, read at "
                             "every dial (overrides --head-shard-dial while it exists): a launcher re-wires a "
                             "serving stage by rewriting it"),
    "n_gpu_layers": (_gpu_layers, "how many of the stage's layers run on the GPU (its last ones); default: all "
                     "of them when the build has a GPU backend and the host a GPU, else 0 (docs/gpu.md)"),
    "device": (_optional_str, "GPU device(s) the stage uses, comma-separated (CUDA0,CUDA1); none = CPU only; "
               "default: every GPU"),
    "main_gpu": (_optional_int, "index among the stage's GPUs for split_mode none (the whole stage) or row"),
    "split_mode": (_choice("split_mode", *SPLIT_MODES), "how a stage spans several GPUs: none, layer or row"),
    "flash_attn": (_choice("flash_attn", *FLASH_ATTN_MODES),
                   "flash attention: off, on or auto (not bitwise equal to off; use the same on every stage "
                   "and in the reference)"),
    "cache_type_k": (_choice("cache_type_k", *CACHE_TYPES),
                     "K cache type: f32, f16, q8_0 or q4_0 (quantized: less memory, not bitwise equal to f16)"),
    "cache_type_v": (_choice("cache_type_v", *CACHE_TYPES),
                     "V cache type: f32, f16, q8_0 or q4_0 (quantized needs flash_attn on or auto)"),
    "kv_streams": (_bool, "off (default): one KV pool shared by the sessions; on: each session (and cache slot) its "
                   "own KV stream of ctx_size cells, ctx_size x (max_sessions + cache_slots) cells in all; an "
                   "answer does not depend on the other sessions either way (docs/kv-placement.md)"),
    "mmap": (_bool, "off (default): read this stage's tensors into memory, on 2 MiB pages where the kernel grants "
             "them (decodes faster: bench/RESULTS-real-model.md); on: map the GGUF file (page cache, 4 KiB "
             "pages, shared by the host's processes of that file; the kernel may drop and re-read weight "
             "pages under memory pressure)"),
    "session_quota": (_optional_int, "sessions one upstream connection may hold (none = a fair share: half of "
                      "max_sessions, at least 1; 0 = no quota)"),
    "max_connections": (int, "upstream connections served at once; more are closed before READY (0 = no limit)"),
    "idle_timeout": (float, "seconds a connection with nothing in flight may stay silent before it is closed "
                     "(0 = never)"),
    "header_timeout": (float, "seconds from a frame's first byte to its whole 76-byte header (0 = no limit)"),
    "frame_timeout": (float, "seconds from a frame's first byte to its last (0 = no limit)"),
    "max_frame_mib": (_optional_float, "largest frame accepted, MiB (none = what ctx_size rows of activation "
                      "need, plus 1 MiB)"),
    "tls": (str, "mutual TLS 1.3 on this stage's links: on, off, or auto = on for a link whose address (listen, "
            "downstream) is not a loopback one"),
    "tls_cert": (_optional_path, "this stage's certificate, PEM (skippy certs DIR --stages N makes DIR/stage-I.pem)"),
    "tls_key": (_optional_path, "this stage's private key, PEM"),
    "tls_ca": (_optional_path, "the chain CA certificate, PEM: peers must hold a certificate it signed"),
    "max_buffered_mib": (float, "MiB all connections together may hold in large frames being read or handled; "
                         "a frame waits for room (0 = no limit)"),
}


def load_config_file(path: Path, plan_stage: int | None = None) -> dict[str, Any]:
    """Read a TOML (``.toml``) or JSON file of settings (keys as in ``--help``, ``-`` or ``_``).

    A plan file of ``skippy plan`` (a ``[chain]`` table and ``[[stage]]`` tables) gives the
    settings of its stage ``plan_stage``: the chain's settings, then that stage's, less the keys
    that only describe the plan (``host``, ``expected``, ``model_digest``).

    Raises:
        ValueError: unreadable file, unknown keys, or a plan without a valid ``plan_stage``.
    """
    text = path.read_bytes()
    try:
        data = tomllib.loads(text.decode()) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:  # both parsers raise ValueError subclasses
        raise ValueError(f"cannot parse stage config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"stage config {path} must be a table/object of settings")
    if isinstance(data.get("stage"), list):
        data = _plan_stage_settings(path, data, plan_stage)
    elif plan_stage is not None:
        raise ValueError(f"--plan-stage {plan_stage} given but {path} is not a plan (no [[stage]] tables)")
    data = data.get("stage", data)
    settings = {str(key).replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(settings) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown settings in {path}: {', '.join(unknown)}")
    return settings


def _plan_stage_settings(path: Path, data: dict[str, Any], plan_stage: int | None) -> dict[str, Any]:
    from skippy.deploy.plan import PLAN_ONLY_CHAIN_KEYS, PLAN_ONLY_STAGE_KEYS

    stages = data["stage"]
    if plan_stage is None or not 0 <= plan_stage < len(stages):
        raise ValueError(f"{path} is a plan of {len(stages)} stages: name one with --plan-stage 0..{len(stages) - 1}")
    chain = data.get("chain", {})
    entry = stages[plan_stage]
    if not isinstance(chain, dict) or not isinstance(entry, dict):
        raise ValueError(f"{path}: [chain] and each [[stage]] must be tables")
    merged = {k: v for k, v in chain.items() if k not in PLAN_ONLY_CHAIN_KEYS}
    merged.update({k: v for k, v in entry.items() if k not in PLAN_ONLY_STAGE_KEYS})
    if "host_threads" not in merged and "host-threads" not in merged:  # the plan's stages on this host
        try:
            merged["host_threads"] = plan_host_threads(chain, stages, plan_stage, host_cores())
        except (TypeError, ValueError):  # a bad threads value: reported as that setting
            pass
    return merged


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m skippy.stage",
        description="Serve layers START:END of a GGUF model as one stage of a skippy chain.",
    )
    parser.add_argument("--config", type=Path, help="TOML or JSON file with any of the settings below, or a plan "
                        "file of skippy plan (with --plan-stage)")
    parser.add_argument("--plan-stage", type=int, help="with a plan file as --config: run its stage N (0 = first)")
    defaults = {f.name: f.default for f in dataclasses.fields(StageConfig)}
    for name, (_, help_text) in _OPTIONS.items():
        default = defaults.get(name, dataclasses.MISSING)
        shown = "" if default is dataclasses.MISSING or default is None else f" (default: {_show(default)})"
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=help_text + shown)
    return parser


def _show(value: object) -> str:
    if isinstance(value, WireDType):
        return value.name.lower()
    return str(value)


def parse_config(argv: Sequence[str] | None = None) -> StageConfig:
    """Build the validated config from ``argv`` (and ``--config``).

    Raises:
        SystemExit: via argparse, with a message, on bad input.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    raw: dict[str, Any] = {}
    try:
        if args.config is not None:
            raw.update(load_config_file(args.config, args.plan_stage))
        elif args.plan_stage is not None:
            raise ValueError("--plan-stage needs a plan file as --config")
        raw.update({name: getattr(args, name) for name in _OPTIONS if getattr(args, name) is not None})
        return config_from_mapping(raw)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))


def config_from_mapping(raw: dict[str, Any]) -> StageConfig:
    """Convert raw settings (strings or native values) to a validated StageConfig.

    Raises:
        ValueError: missing model/layers or an invalid value.
    """
    values: dict[str, Any] = {}
    for name, value in raw.items():
        convert = _OPTIONS[name][0]
        if value is None or (name == "wire_dtype" and isinstance(value, WireDType)):
            values[name] = value
        elif isinstance(value, str) or convert in (Address.parse, _optional_address, _dtype, _optional_path):
            values[name] = convert(str(value))
        else:
            values[name] = convert(value)
    for required in ("model", "layers"):
        if not values.get(required):
            raise ValueError(f"--{required} is required (on the command line or in --config)")
    values["log_level"] = str(values.get("log_level", "INFO")).upper()
    return StageConfig(**values).validated()
