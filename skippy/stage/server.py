"""The stage process: load the runtime, then listen, accept lanes, and shut down cleanly.

Strategy: the model is loaded *before* the listener exists, so a stage that answers READY is
ready.  ``StageServer.serve`` runs, in one nursery, the scheduler (the only user of the runtime),
the optional stats-file writer, and the listener; each accepted stream is answered READY and
served by its own :class:`~skippy.stage.connection.Connection` in a second nursery, so one failing
lane never touches another.  A plain-TCP lane whose first byte has not come yet waits in
:class:`WaitingLanes` (one selector for all of them, one task to wake them) and gets its
``Connection`` when it becomes readable: an idle lane holds its socket, not a Connection and its
tasks, which is what lets the memory of a burst of idle lanes go back (see that class); the
watchdog closes one that waits past ``--idle-timeout``.  Shutdown (SIGTERM / SIGINT or
:meth:`StageServer.shutdown`) stops accepting, closes the lanes still waiting, gives open lanes
``drain_timeout`` seconds to finish, cancels the rest, then releases every session and frees the
runtime.

With ``prefix_cache`` on (the default), the context gets ``cache_slots`` sequence ids above the
sessions' and a :class:`~skippy.cache.StageCache` claims them right after the context is made,
before any session opens (:func:`build_cache`); the executor owns it and closes it at shutdown.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import selectors
import signal
import ssl
import sys
from typing import Any, Callable

import trio

from skippy.cache import CacheBudget, StageCache, context_sessions, prefix_cache_refusal
from skippy.lane.errors import StageError, error_code
from skippy.net.address import Address
from skippy.net.socket_io import set_no_delay
from skippy.net.tls import TlsFiles, client_context, handshake_as_server, link_uses_tls, server_context
from skippy.runtime.model import LayerRange
from skippy.runtime.null import NullContext, NullModel, is_null_spec
from skippy.stage.config import StageConfig
from skippy.stage.connection import Connection, LaneSettings
from skippy.stage.direct_return import ReturnHub
from skippy.stage.executor import Executor
from skippy.stage.limits import BufferBudget, IdleLane, StageLimits, fair_share, frame_limit, return_freed_memory
from skippy.stage.liveness import watch_downstream
from skippy.stage.scheduler import Scheduler, decode_groups
from skippy.stage.standby import wait_for_activation
from skippy.stage.stats import StageStats, write_stats_file, write_stats_periodically
from skippy.stage.transport import WireCondition, send_ready

log = logging.getLogger("skippy.stage")

#: A decode relay idle this long (waiting for its next frame) is ended by the stats file's read
#: of the runtime's figures (:meth:`StageServer.refresh_runtime_stats`).
RELAY_IDLE_READ_S = 0.5


def load_runtime(config: StageConfig, progress: Callable[[float], object] | None = None) -> Executor:
    """Load the model range and create its context (the null runtime for ``null:`` specs).

    Raises:
        skippy.runtime.NativeError / ValueError: the model or range cannot be loaded.
    """
    context: Any
    prefix_cache = config.prefix_cache
    if prefix_cache and not is_null_spec(config.model):
        from skippy.runtime import read_gguf_info

        if (refusal := prefix_cache_refusal(read_gguf_info(config.model).architecture)) is not None:
            log.warning("prefix cache off: %s", refusal)
            prefix_cache = False
    sequence_ids = (context_sessions(config.max_sessions, config.cache_slots) if prefix_cache
                    else config.max_sessions)
    if is_null_spec(config.model) and (config.head_split or config.serve_head_rows):
        raise ValueError("the null runtime has no head to split (head_split / serve_head_rows)")
    if is_null_spec(config.model):
        model: Any = NullModel(config.model, LayerRange.parse(config.layers))
        context = NullContext(model, n_ctx=config.ctx_size, max_sessions=sequence_ids,
                              n_batch=config.batch_size)
    else:
        from skippy.runtime.offload import devices
        # the native library loads only here
        from skippy.runtime import Model, StageContext, huge_page_bytes, read_gguf_info

        layers = LayerRange.parse(config.layers)
        offload = config.offload.resolve(devices(), layers.start, layers.end, read_gguf_info(config.model).n_layer)
        log.info("compute: %s", offload.describe())
        model = Model(config.model, layers, progress=progress, offload=offload, use_mmap=config.mmap,
                      split_head=config.head_split or None)
        try:
            context = StageContext(model, n_ctx=config.ctx_size, max_sessions=sequence_ids,
                                   n_batch=config.batch_size, threads=config.threads or None, offload=offload,
                                   checkpoint_depth=config.recurrent_checkpoints,
                                   checkpoint_interval=config.recurrent_checkpoint_interval,
                                   kv_streams=config.kv_streams)
        except Exception:  # free the weights before reporting a context failure
            model.close()
            raise
        log.info("weights: %.0f MiB %s; %.0f MiB of this process on 2 MiB pages (SKIPPY_HUGE_PAGES=0: none)",
                 model.size_bytes / (1 << 20), "mapped from the file" if model.use_mmap else "read into memory",
                 huge_page_bytes() / (1 << 20))
        if context.recurrent:
            log.info("recurrent state: rollback by checkpoints (%d per session, one every %d decode steps and "
                     "before every prefill chunk and verify window); decode relay off for this model: its loop "
                     "does not log the rows a rollback decodes again",
                     context.checkpoint_depth, context.checkpoint_interval)
    if model.is_last != (config.downstream is None):
        message = (
            f"layers {config.layers} of a {model.n_layer}-layer model "
            + ("end the model, so the stage must not have --downstream" if model.is_last
               else "do not end the model, so the stage needs --downstream")
        )
        context.close()
        model.close()
        raise ValueError(message)
    head_shard = None
    if config.head_split or config.serve_head_rows:  # issue 31: the head split by vocabulary rows
        from skippy.stage.head_split import attach_head_port, serve_head_rows

        if config.head_split:
            attach_head_port(config, context)
        if config.serve_head_rows:
            head_shard = serve_head_rows(config)
    executor = Executor(context, build_cache(config, context) if prefix_cache else None)
    executor.head_shard = head_shard
    executor.configure_resume(int(config.resume_log_mib * (1 << 20)), config.resume_hold_s)
    return executor


def close_runtime(executor: Executor) -> None:
    """Free what :func:`load_runtime` made: the sessions and prefix cache, the context, then the
    weights (idempotent).  Only once nothing runs on it any more: after :meth:`StageServer.serve`
    returned, cancelled or not (its scheduler joins the runtime thread on the way out).  A stage
    process need not call it (its exit frees all); a process that serves stages one after
    another must, or each keeps its weights and KV cache to the end."""
    executor.close()
    context = executor.context
    context.close()
    context.model.close()


def build_cache(config: StageConfig, context: Any) -> StageCache:
    """The stage's prefix cache over a fresh context (claims the ids above ``max_sessions``)."""
    dtype = config.cache_input_dtype
    if dtype is None and not context.model.is_first:
        dtype = config.wire_dtype.name.lower()
    budget = CacheBudget(
        resident_entries=config.cache_slots, resident_tokens=config.cache_resident_tokens,
        spill_entries=config.cache_spill_entries, spill_bytes=int(config.cache_spill_mib * (1 << 20)),
        min_tokens=config.cache_min_tokens,
    )
    return StageCache.for_context(context, sessions=config.max_sessions, wire_dtype=dtype,
                                  page_size=config.cache_page_size, budget=budget)


def stage_limits(config: StageConfig, width: int) -> StageLimits:
    """The stage's limits from its settings (defaults filled in: the fair-share quota, the frame
    size the stage's KV could use; a frame limit above the buffer budget is lowered to it)."""
    budget = int(config.max_buffered_mib * (1 << 20))
    frame = (int(config.max_frame_mib * (1 << 20)) if config.max_frame_mib is not None
             else frame_limit(config.ctx_size, width))
    if budget:
        frame = min(frame, budget)
    quota = fair_share(config.max_sessions) if config.session_quota is None else config.session_quota
    return StageLimits(session_quota=quota, max_connections=config.max_connections,
                       idle_timeout=config.idle_timeout, header_timeout=config.header_timeout,
                       frame_timeout=config.frame_timeout, max_frame_bytes=frame, max_buffered_bytes=budget)


def _identity_settings(config: StageConfig, executor: Executor, tls: ssl.SSLContext | None) -> dict[str, Any]:
    """docs/protocol.md §9: this stage's Identity frame and its downstream checker."""
    from skippy.identity import file_identity
    from skippy.stage.identity_check import DownstreamIdentities

    layers = LayerRange.parse(config.layers)
    count = int(getattr(executor.model, "n_layer", layers.end))
    try:
        own = file_identity(config.model, layers.start, layers.end, count, config.ctx_size, config.batch_size)
    except (OSError, ValueError) as exc:  # a model that loaded but whose header cannot be hashed
        log.warning("no model identity for %s: %s; identity queries go unanswered", config.model, exc)
        return {}
    checker = DownstreamIdentities(own, tls=tls) if config.downstream is not None else None
    return {"identity": own, "identities": checker}


@dataclasses.dataclass(frozen=True, slots=True)
class StageTls:
    """The stage's TLS contexts: for the lanes it accepts, and for its downstream link."""

    server: ssl.SSLContext | None
    downstream: ssl.SSLContext | None


def stage_tls(config: StageConfig) -> StageTls | None:
    """The contexts of the links that use TLS (:mod:`skippy.net.tls`), None when none does.

    Raises:
        ValueError: a certificate, key or CA file that cannot be loaded (named).
    """
    listen = link_uses_tls(config.tls, config.listen.host)
    downstream = config.downstream is not None and link_uses_tls(config.tls, config.downstream.host)
    if not (listen or downstream):
        return None
    assert config.tls_cert is not None and config.tls_key is not None and config.tls_ca is not None  # validated
    files = TlsFiles(config.tls_cert, config.tls_key, config.tls_ca)
    try:
        return StageTls(server_context(files) if listen else None, client_context(files) if downstream else None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the stage's TLS files ({files.cert}, {files.key}, {files.ca}): {exc}") from exc


class WaitingLanes:
    """Plain-TCP lanes answered READY whose first byte has not arrived: sockets in one selector.

    Why: a lane served by a :class:`~skippy.stage.connection.Connection` holds about 16 KiB of
    small Python objects (its tasks, coroutines, cancel scopes, channels, protocol state), which
    CPython's allocator carves from 1 MiB arenas and gives back to the system only when a whole
    arena is empty.  2,000 idle lanes filled ~30 arenas; once they were closed, the few objects
    the stage allocated meanwhile and kept (counters, the accept loop's and the watchdog's current
    frames, timer entries) sat scattered in almost every one of them, so RSS stayed up (52 -> 84 ->
    83 MiB; ``malloc_trim`` cannot reach those arenas).  Here an idle lane costs its socket objects
    and one entry, so such a burst needs little heap in the first place.

    :meth:`wait` parks one task on the selector's descriptor; :meth:`take_ready` hands over the
    lanes that became readable (bytes, end of stream or an error: the Connection finds out which);
    :meth:`take_overdue` the ones waiting longer than the idle timeout (oldest first: entries are
    kept in arrival order).  Unavailable where the selector has no descriptor to wait on
    (:meth:`create` returns None; lanes then get their Connection at once).
    """

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        #: descriptor -> (stream, peer, since when it waits), in arrival order
        self._lanes: dict[int, tuple[trio.SocketStream, str, float]] = {}
        self.closed = False

    @classmethod
    def create(cls) -> "WaitingLanes | None":
        selector = selectors.DefaultSelector()
        if not hasattr(selector, "fileno"):  # select() / poll(): nothing trio can wait on
            selector.close()
            return None
        return cls(selector)

    def __len__(self) -> int:
        return len(self._lanes)

    def add(self, stream: trio.SocketStream, peer: str) -> bool:
        """Hold ``stream`` until it is readable; False once closed (the caller serves it itself)."""
        if self.closed:
            return False
        fd = stream.socket.fileno()
        self._selector.register(fd, selectors.EVENT_READ)
        self._lanes[fd] = (stream, peer, trio.current_time())
        return True

    async def wait(self) -> None:
        """Return when a held lane may be readable."""
        await trio.lowlevel.wait_readable(self._selector.fileno())  # type: ignore[attr-defined]

    def take_ready(self) -> list[tuple[trio.SocketStream, str]]:
        return [self._take(key.fd) for key, _ in self._selector.select(0)]

    def take_overdue(self, now: float, timeout: float) -> list[tuple[trio.SocketStream, str]]:
        overdue = []
        for fd, (_, _, since) in self._lanes.items():
            if now - since <= timeout:
                break
            overdue.append(fd)
        return [self._take(fd) for fd in overdue]

    def close(self) -> list[tuple[trio.SocketStream, str]]:
        """Stop holding lanes; returns the ones still held (the caller closes them)."""
        self.closed = True
        held = [self._take(fd) for fd in list(self._lanes)]
        self._selector.close()
        return held

    def _take(self, fd: int) -> tuple[trio.SocketStream, str]:
        self._selector.unregister(fd)
        stream, peer, _ = self._lanes.pop(fd)
        return stream, peer


class StageServer:
    """Serves upstream lanes for one loaded stage.

    Args:
        config: the stage settings.
        executor: the loaded runtime (see :func:`load_runtime`).
    """

    def __init__(self, config: StageConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.stats = StageStats()
        self.limits = stage_limits(config, executor.n_embd * max(executor.input_rows, executor.output_rows))
        #: Mutual TLS on the listening and downstream links (None: plain TCP on both).
        self.tls = stage_tls(config)
        #: Connections refused at the TLS handshake.
        self.tls_refused = 0
        self.scheduler = Scheduler(executor, self.stats, batch_window=config.batch_window_ms / 1000.0,
                                   inline_decode=config.inline_decode, decode_batching=config.decode_batching,
                                   decode_groups=decode_groups(config.decode_policy, config.chain_stages, executor))
        self.settings = LaneSettings(
            width=executor.n_embd, is_last=executor.is_last, downstream=config.downstream,
            wire_dtype=config.wire_dtype, credit_limit=config.credit_limit,
            max_inflight=config.max_inflight, connect_timeout=config.connect_timeout,
            wire=WireCondition.from_settings(config.wire_delay_ms, config.wire_mbps),
            write_through=config.write_through, inline_hand_offs=config.inline_hand_offs,
            decode_relay=config.decode_relay,
            reply_delay_s=config.wire_reply_delay_ms / 1000.0, max_rows=config.ctx_size,
            session_quota=self.limits.session_quota, max_frame_bytes=self.limits.max_frame_bytes,
            downstream_tls=self.tls.downstream if self.tls is not None else None,
            **_identity_settings(config, executor, self.tls.downstream if self.tls is not None else None),
            downstream_file=config.downstream_file,
        )
        self.budget = BufferBudget(self.limits.max_buffered_bytes)
        #: docs/protocol.md §8: the return lanes drivers open to this stage (when it is final).
        self.returns = ReturnHub(self._lanes_with_session)
        self.address: Address | None = None
        #: Where ``GET /metrics`` is served (``--metrics-listen``), once bound.
        self.metrics_address: Address | None = None
        self.connections: set[Connection] = set()
        #: Accepted connections not yet closed (READY included): the count --max-connections bounds.
        self.accepted = 0
        #: Connections refused at the limit, and lanes closed since the last heap trim.
        self.refused = 0
        self._closed_since_trim = 0
        #: Lanes waiting for their first byte, while serving (None: every lane gets its Connection at once).
        self.waiting: WaitingLanes | None = None
        self._shutdown = trio.Event()

    def _lanes_with_session(self, session_id: int) -> list[int]:
        """Ids of the open chain lanes that carry ``session_id`` (the return hub's owners)."""
        return [connection.id for connection in self.connections if connection.has_session(session_id)]

    def shutdown(self) -> None:
        """Ask :meth:`serve` to drain and return."""
        self._shutdown.set()

    async def refresh_runtime_stats(self) -> bool:
        """Read the runtime's figures (sessions, KV cells, prefix cache, recurrent rollbacks) into
        the statistics; False when they were left as they are.

        While a decode relay carries tokens the figures are left as they are (one session grows
        by a cell per token): a read would queue behind the relay and end its run, and the
        stats file refreshes ten times a second.  A relay that has waited :data:`RELAY_IDLE_READ_S`
        for its next frame is ended by the read (the session paused or finished: the run's end
        costs nothing then), so the figures never stay stale for long.
        """
        if self.scheduler.held and self.scheduler.holder_idle_s() < RELAY_IDLE_READ_S:
            return False
        snapshot = await self.scheduler.call(self.executor.snapshot)
        self.stats.sessions_in_use = snapshot["sessions_in_use"]
        self.stats.kv_cells_used = snapshot["kv_cells_used"]
        self.stats.kv_bytes_per_cell = snapshot.get("kv_bytes_per_cell", 0)
        self.stats.state_bytes_per_sequence = snapshot.get("state_bytes_per_sequence", 0)
        self.stats.prefix_cache = snapshot.get("prefix_cache", {})
        self.stats.recurrent_rollback = snapshot.get("recurrent_rollback", {})
        self.stats.resume = snapshot.get("resume", {})
        return True

    async def serve(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until :meth:`shutdown`; reports the bound address to ``task_status``."""
        config = self.config
        async with trio.open_nursery() as system:
            await system.start(self.scheduler.run)
            listeners = await trio.open_tcp_listeners(config.listen.port, host=config.listen.host)
            sockname = listeners[0].socket.getsockname()
            self.address = Address(sockname[0], sockname[1])
            if config.stats_file is not None:
                await system.start(write_stats_periodically, config.stats_file, self.stats,
                                   self.refresh_runtime_stats)
            if config.metrics_listen is not None:
                from skippy.stage.metrics import serve_metrics  # prometheus_client only when asked

                self.metrics_address = await system.start(serve_metrics, self, config.metrics_listen)
            system.start_soon(self._watch_limits)
            if config.downstream is not None and config.heartbeat_timeout > 0:  # docs/protocol.md §13
                system.start_soon(watch_downstream, self, config.heartbeat_timeout)
            async with trio.open_nursery() as lanes:
                accept_scope = trio.CancelScope()
                self.waiting = WaitingLanes.create()  # closed by _accept, whichever way it ends
                lanes.start_soon(self._accept, listeners, lanes, accept_scope)
                if self.executor.head_shard is not None and config.head_shard_dial is not None:
                    from skippy.stage.head_split import head_shard_link, serve_head_shard  # issue 31

                    # among the lanes: cancelled with them, before the runtime is closed
                    lanes.start_soon(functools.partial(serve_head_shard, self.scheduler, self.executor.head_shard,
                                                       config.head_shard_dial, **head_shard_link(config)))
                log.info("stage layers %s ready on %s (downstream: %s, wire %s)", config.layers,
                         self.address, config.downstream or "none (final stage)",
                         config.wire_dtype.name.lower())
                task_status.started(self.address)
                await self._shutdown.wait()
                accept_scope.cancel()
                log.info("shutting down: %d lane(s) open, draining up to %g s",
                         self.stats.connections_open, config.drain_timeout)
                with trio.move_on_after(config.drain_timeout):
                    # Lanes finish the requests they are in; idle lanes are closed at once.
                    while any(connection.inflight for connection in self.connections):
                        await trio.sleep(0.02)
                lanes.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await self.scheduler.call(self.executor.close)
                await self.refresh_runtime_stats()
                if config.stats_file is not None:
                    write_stats_file(config.stats_file, self.stats.as_dict())
            system.cancel_scope.cancel()

    async def _accept(self, listeners: list[trio.SocketListener], lanes: trio.Nursery,
                      scope: trio.CancelScope) -> None:
        try:
            with scope:
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        acceptors.start_soon(self._accept_one, listener, lanes)
                    if self.waiting is not None:
                        acceptors.start_soon(self._wake_waiting, lanes)
        finally:
            if self.waiting is not None:  # draining: lanes that never sent a byte are closed at once
                for stream, _ in self.waiting.close():
                    self._close_waiting(stream)
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    async def _wake_waiting(self, lanes: trio.Nursery) -> None:
        """Give each waiting lane that became readable its Connection."""
        waiting = self.waiting
        assert waiting is not None
        while True:
            await waiting.wait()
            for stream, peer in waiting.take_ready():
                lanes.start_soon(self._serve_woken, stream, peer)

    def _close_waiting(self, stream: trio.SocketStream, peer: str = "", error: StageError | None = None) -> None:
        """Close a lane that never sent a byte (``error``: the limit it passed, logged as a
        Connection logs it; None: the stage is draining)."""
        stats = self.stats
        if error is not None:
            log.info("closing lane from %s (no message yet): %s", peer, error)
            stats.connection_errors += 1
            stats.errors_by_code[error_code(error).name.lower()] += 1
        stream.socket.close()
        stats.connections_open -= 1
        stats.touch()
        self._lane_closed()

    async def _accept_one(self, listener: trio.SocketListener, lanes: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: log, back off, keep serving
                log.warning("accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            limit = self.limits.max_connections
            if limit and self.accepted >= limit:  # refused before READY: the peer sees a close
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning("refused a connection: %d open, the limit (--max-connections); %d refused so far",
                                self.accepted, self.refused)
                await trio.aclose_forcefully(stream)
                continue
            self.accepted += 1
            lanes.start_soon(self._serve_lane, stream)

    async def _watch_limits(self) -> None:
        """Close lanes past their read or idle timeouts; give closed lanes' memory back."""
        limits = self.limits
        period = min(limits.watch_period, 1.0)
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            for connection in list(self.connections):
                error = connection.overdue(now, limits)
                if error is not None:
                    connection.abort(error)  # type: ignore[arg-type]
            if self.executor.parked:  # docs/protocol.md §14: parked sessions past their resume deadline
                await self.scheduler.call(self.executor.expire_parked)
            if self.waiting and limits.idle_timeout > 0:
                for stream, peer in self.waiting.take_overdue(now, limits.idle_timeout):
                    self._close_waiting(stream, peer, IdleLane(f"lane idle for {limits.idle_timeout:g} s "
                                                               "(--idle-timeout)"))
            if self._closed_since_trim and not self.accepted:
                self._closed_since_trim = 0
                return_freed_memory()
            elif self._closed_since_trim >= 64:
                self._closed_since_trim = 0
                return_freed_memory()

    async def _serve_lane(self, stream: trio.SocketStream) -> None:
        waits = False
        try:
            waits = await self._serve_accepted(stream)
        finally:
            if not waits:
                self._lane_closed()

    def _lane_closed(self) -> None:
        self.accepted -= 1
        self._closed_since_trim += 1

    async def _serve_woken(self, stream: trio.SocketStream, peer: str) -> None:
        """Serve a lane that waited for its first byte (:class:`WaitingLanes`)."""
        self.stats.connections_open -= 1  # counted while it waited; the Connection counts it again
        self.stats.connections_total -= 1
        try:
            await self._serve_connection(stream, peer)
        finally:
            self._lane_closed()

    async def _serve_accepted(self, stream: trio.SocketStream) -> bool:
        """Answer READY, then serve the lane, or leave it waiting for its first byte (True)."""
        try:
            peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:  # the peer is already gone
            await trio.aclose_forcefully(stream)
            return False
        set_no_delay(stream)
        lane: trio.abc.Stream = stream
        if self.tls is not None and self.tls.server is not None:  # authenticated before anything is said
            secure = await handshake_as_server(stream, self.tls.server, peer, self.limits.header_timeout or 10.0)
            if secure is None:
                self.tls_refused += 1
                return False
            lane = secure
        try:
            await send_ready(lane)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):  # a probe that left at once
            await trio.aclose_forcefully(lane)
            return False
        if lane is stream and self.waiting is not None and self.waiting.add(stream, peer):
            self.stats.connections_open += 1  # an open lane, as it will be once it has its Connection
            self.stats.connections_total += 1
            self.stats.touch()
            return True
        await self._serve_connection(lane, peer)
        return False

    async def _serve_connection(self, lane: trio.abc.Stream, peer: str) -> None:
        connection = Connection(lane, peer, self.settings, self.scheduler, self.stats, self.returns, self.budget)
        self.connections.add(connection)
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)
            stats, upstream, downstream = self.stats, connection.upstream_io, connection.downstream_io
            stats.upstream_bytes_in += upstream.bytes_in
            stats.upstream_bytes_out += upstream.bytes_out
            if downstream is not None:
                stats.downstream_bytes_in += downstream.bytes_in
                stats.downstream_bytes_out += downstream.bytes_out


async def run_stage(config: StageConfig, executor: Executor, *,
                    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGTERM or SIGINT, then drain and return (``--standby``: listen only once activated)."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) if config.exit_on_stdin_eof or config.standby else None
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        if config.standby:
            assert stdin is not None
            listen = await wait_for_activation(stdin, config, signals)
            if listen is None:
                await stdin.aclose()
                return
            config = dataclasses.replace(config, listen=listen, standby=False)
        server = StageServer(config, executor)
        async with trio.open_nursery() as nursery:
            async def watch_signals() -> None:
                async for signum in signals:
                    log.info("received %s: draining", signal.Signals(signum).name)
                    server.shutdown()

            nursery.start_soon(watch_signals)
            if stdin is not None:
                nursery.start_soon(_drain_on_stdin_eof, server, stdin)
            await server.serve(task_status=task_status)
            nursery.cancel_scope.cancel()


async def _drain_on_stdin_eof(server: StageServer, stream: trio.lowlevel.FdStream) -> None:
    """Drain the stage when standard input ends: the launcher's pipe closed, so the launcher is
    gone (a SIGKILL included, which no signal handler of its can turn into a clean stop)."""
    async with stream:
        while await stream.receive_some(4096):  # whatever is written is ignored
            pass
    log.info("standard input closed (the launcher is gone): draining")
    server.shutdown()
