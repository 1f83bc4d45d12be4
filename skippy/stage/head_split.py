"""A stage's part in a head split by vocabulary rows (issue 31; skippy.runtime.head_shard).

The final stage of a split head (``--head-split N``) computes the head's rows ``N:`` beside its
layers and listens on a head shard port for the stage that serves the rows ``0:N``
(``--serve-head-rows N --head-shard-dial HOST:PORT``, usually stage 0 of the same chain, which
starts after the final stage): that stage loads the head alone for those rows beside its layers
and serves them on a thread of its own, dialling the port again whenever the link is lost.
"""

from __future__ import annotations

import logging
from typing import Any

from skippy.net.address import Address
from skippy.stage.config import StageConfig

log = logging.getLogger("skippy.stage")

#: What this process serves or listens with: kept for the process's life (daemon threads).
_KEPT: list[Any] = []


def attach_head_port(config: StageConfig, context: Any) -> Address:
    """Give the final stage's split head its shard: the connections of the stage serving the
    other rows to a port of this stage; returns (and logs) the port's address."""
    from skippy.runtime.head_shard import HeadShardPort, RemoteHeadShard

    model = context.model
    listen = config.head_shard_listen or Address(config.listen.host, 0)
    port = HeadShardPort(listen.host, listen.port)
    _KEPT.append(port)
    context.attach_shard(RemoteHeadShard.through(port, rows=(0, config.head_split), identity=model.identity,
                                                 n_embd=model.n_embd, timeout=config.connect_timeout))
    address = Address(*port.address)
    log.info("head split: rows %d:%d here, rows 0:%d from the stage that dials; head shard port on %s",
             config.head_split, model.n_vocab, config.head_split, address)
    return address


def serve_head_rows(config: StageConfig) -> None:
    """Load the head alone for the rows ``0:serve_head_rows`` and serve them to the final stage."""
    from skippy.runtime import LayerRange, Model, read_gguf_info
    from skippy.runtime.head_shard import HeadCompute, HeadShardServer
    from skippy.runtime.offload import devices

    assert config.head_shard_dial is not None
    n_layer = read_gguf_info(config.model).n_layer
    offload = config.offload.resolve(devices(), n_layer, n_layer, n_layer)
    head = Model(config.model, LayerRange(n_layer, n_layer), head_rows=(0, config.serve_head_rows),
                 offload=offload, use_mmap=config.mmap)
    compute = HeadCompute(head, n_batch=config.batch_size, threads=config.threads or None)
    server = HeadShardServer(compute, host=None)
    server.dial(config.head_shard_dial.host, config.head_shard_dial.port)
    _KEPT.extend((head, compute, server))
    log.info("head split: serving head rows 0:%d (%.0f MiB) to %s", config.serve_head_rows,
             head.size_bytes / (1 << 20), config.head_shard_dial)
