"""Reply-stats arithmetic of a lane (pure): merging a relayed reply's stats, the verify-window share."""

from __future__ import annotations

import dataclasses

from skippy.codec.protocol import EMPTY_REPLY_STATS, ReplyStats

__all__ = ["merge_stats", "timing_stats"]


def timing_stats(base: ReplyStats, *, compute_us: int, write_us: int, wait_us: int, total_us: int,
                 batch_size: int) -> ReplyStats:
    """Add one stage's share to a VerifyWindow reply's ``verify_window_*`` stats (summed along the
    chain, ``verify_window_stage_count`` += 1, the largest batch in ``verify_window_max_tokens``)."""
    return dataclasses.replace(
        base,
        verify_window_compute_us=base.verify_window_compute_us + compute_us,
        verify_window_forward_write_us=base.verify_window_forward_write_us + write_us,
        verify_window_downstream_wait_us=base.verify_window_downstream_wait_us + wait_us,
        verify_window_total_us=base.verify_window_total_us + total_us,
        verify_window_stage_count=base.verify_window_stage_count + 1,
        verify_window_max_tokens=max(base.verify_window_max_tokens, batch_size),
    )


def merge_stats(pending: ReplyStats, reply: ReplyStats) -> ReplyStats:
    """``pending.merge(reply)``, without the copy when nothing is pending (the decode hot path).

    Merging into empty stats gives back ``reply`` unchanged unless a max-merged field of it is
    negative or its prefill-edge fields are set without a positive total: only then is the full
    merge needed.
    """
    if pending is EMPTY_REPLY_STATS and reply.prefill_edge_total_us_max >= 0 and min(
        reply.verify_window_max_tokens, reply.prefill_edge_write_us_max, reply.prefill_edge_wait_us_max
    ) >= 0 and (reply.prefill_edge_total_us_max > 0 or not (
        reply.prefill_edge_stage_index or reply.prefill_edge_activation_bytes_max
    )):
        return reply
    return pending.merge(reply)
