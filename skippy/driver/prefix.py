"""The driver's side of the prefix KV cache: configure, probe, restore, then prefill only the rest.

Strategy (docs/prefix-cache.md §6): one request's prefill becomes

1. ConfigureGeneration with the sampling section and, when the cache is used, the chat metadata
   ``{"skippy.prefix_cache": {"namespace": <key>, "record": <bool>}}`` that every stage keeps for
   the session (an opted-out request says ``record: false`` and never probes);
2. ProbePrefill (15, state flag ``PREFIX_EXTENT``) of the page-floor of ``prompt[:-1]`` (``R``
   tokens). The reply's ``kv_hit_stage_mask`` bit 0 means every stage hit (each stage clears its
   bit when the one behind it missed), and the chain-wide hit is ``M = R - kv_imported_tokens``
   (the sum of what each stage cut);
3. TryRestorePrefill (17) of ``prompt[:M]``; bit 0 again means every stage now holds exactly
   ``M`` positions. On anything else the driver sends TrimSession(0) so no stage keeps a partial
   restore, and prefills from 0;
4. prefill of ``prompt[M:]`` from position ``M`` (at least one token is always left).

When ``M = len(prompt) - 1`` (the whole prompt but its last token is cached), steps 3 and 4 are
fused into one TryRestorePrefillDecode (18): the sideband is the whole prompt, ``token_count`` 1,
``pos_start`` ``M``; every stage restores ``M`` and decodes the last token, and the reply is the
first token's PredictedToken (a hit only with bit 0 of ``kv_hit_stage_mask``).  A miss ACK is
handled as a failed TryRestorePrefill: TrimSession(0), then a full prefill.

A request's further choices (``n`` > 1) are forks: :func:`fork_prefill` configures each new session
with ``{"skippy.fork": {"session": <first choice's>, "length": len(prompt) - 1}}`` so every stage
copies that KV prefix (skippy/stage/prefix_control.py), and only the last prompt token is computed.
A fork takes the same path as any session: it opens its own return lane when the request returns
directly (its parent's stays open meanwhile), and a fork that not every stage made is undone by
TrimSession(0) before the full prefill, as a partial restore is.

A chain without the extension (or with the cache off) answers both messages as misses, so the
cost of trying is one round trip, and the answer is never wrong: at worst the prompt is prefilled
in full. ``page_size`` must match the stages' (it only decides where the probe is cut; a stage
with another page size still returns page-aligned hits of its own size, which are valid).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

import numpy as np

from skippy.codec.protocol import MessageKind, ReplyKind, SamplingConfig, StageMessage, StageReply
from skippy.codec.protocol_ext import (
    PREFIX_EXTENT_FLAG,
    RESUME_METADATA_KEY,
    SAMPLING_EXTENSION_FLAG,
    SAMPLING_METADATA_KEY,
    SamplingRequest,
)
from skippy.driver.client import PrefillResult, StageClient, StageClientError
from skippy.net.address import Address


class SamplingExtensionRefused(StageClientError):
    """The chain did not confirm a request's grammar / logprobs (docs/protocol.md §10): its final
    stage predates the extension, or a stage between dropped the confirmation."""

#: Tokens per page the driver assumes (the stage default).
DEFAULT_PAGE_SIZE = 64


@dataclasses.dataclass(frozen=True, slots=True)
class CacheRequest:
    """What one request asks of the cache."""

    #: Probe and restore (False: opt out; the prompt is neither looked up nor recorded).
    enabled: bool = True
    #: Tenant key (``prompt_cache_key``, else ``user``); None shares the default namespace.
    namespace: str | None = None
    page_size: int = DEFAULT_PAGE_SIZE
    #: Send TryRestorePrefillDecode when all but the last token is cached (False: restore + prefill).
    fused: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class CachedPrefill:
    """The prefill's outcome: the final chunk's reply, every other reply, and the cached length."""

    result: PrefillResult
    #: Prompt tokens restored from the cache on every stage (``cached_tokens``).
    cached_tokens: int
    #: Replies of the configure / probe / restore / trim messages (their stats carry kv_* figures).
    control: tuple[StageReply, ...]
    #: The prefill's chunk size (0: nothing was prefilled, the fused restore decoded the last token).
    chunk_size: int = 0

    @property
    def replies(self) -> tuple[StageReply, ...]:
        return self.control + self.result.acks

    def last_chunk(self, prompt_length: int) -> tuple[int, int]:
        """(start, size) of the last chunk this prefill computed (a fused restore: the last token)."""
        if self.chunk_size <= 0:
            return self.cached_tokens, 1
        rest = prompt_length - self.cached_tokens
        return self.cached_tokens + (rest - 1) // self.chunk_size * self.chunk_size, self.chunk_size


def metadata(cache: CacheRequest) -> str:
    """The ConfigureGeneration / control chat metadata for ``cache``."""
    return json.dumps({"skippy.prefix_cache": {"namespace": cache.namespace, "record": cache.enabled}},
                      separators=(",", ":"))


def configure_metadata(cache: CacheRequest | None, extension: SamplingRequest | None,
                       resume: dict[str, object] | None = None) -> str | None:
    """ConfigureGeneration's chat metadata: the cache settings, the sampling extension (§10) and
    the resume section (§14: ``{"hold": true}`` on a resumable request's first configure)."""
    sections: dict[str, object] = {}
    if resume is not None:
        sections[RESUME_METADATA_KEY] = resume
    if cache is not None:
        sections["skippy.prefix_cache"] = {"namespace": cache.namespace, "record": cache.enabled}
    if extension is not None:
        sections[SAMPLING_METADATA_KEY] = extension.section()
    return json.dumps(sections, separators=(",", ":")) if sections else None


def probe_length(prompt_tokens: int, page_size: int) -> int:
    """``R``: the page-floor of ``prompt[:-1]`` (at least one token is always computed)."""
    return max(0, (prompt_tokens - 1) // page_size * page_size)


def control_message(kind: MessageKind, session_id: int, tokens: Sequence[int], text: str,
                    request_id: int = 0) -> StageMessage:
    """A prefix-control message with the extension flag and the token sideband."""
    values = np.asarray(tokens, dtype=np.int32)
    return StageMessage.create(
        kind, request_id=request_id, session_id=session_id, tokens=values, token_count=len(values),
        pos_start=0, chat_sampling_metadata=text,
        state_changes={"flags": PREFIX_EXTENT_FLAG, "prompt_token_count": len(values)},
    )


def restore_decode_message(session_id: int, prompt: Sequence[int], text: str, request_id: int = 0) -> StageMessage:
    """TryRestorePrefillDecode (18): restore ``prompt[:-1]`` and decode ``prompt[-1]`` at ``M``."""
    values = np.asarray(prompt, dtype=np.int32)
    length = len(values) - 1
    return StageMessage.create(
        MessageKind.TRY_RESTORE_PREFILL_DECODE, request_id=request_id, session_id=session_id, tokens=values,
        token_count=1, pos_start=length, chat_sampling_metadata=text,
        state_changes={"flags": PREFIX_EXTENT_FLAG, "prompt_token_count": len(values),
                       "current_token": int(values[-1])},
    )


async def lookup_and_restore(client: StageClient, session_id: int, prompt: Sequence[int],
                             cache: CacheRequest, *, request_id: int = 0,
                             fused: list[StageReply] | None = None) -> tuple[int, list[StageReply]]:
    """Probe, then restore the chain-wide hit; returns (restored tokens, control replies).

    With ``fused`` (a list to fill) a hit of all but the last token is restored and decoded in one
    TryRestorePrefillDecode; on success its PredictedToken is appended to ``fused`` and the
    restored length is ``len(prompt) - 1`` with nothing left to prefill.
    """
    replies: list[StageReply] = []
    length = probe_length(len(prompt), cache.page_size)
    if not cache.enabled or length == 0:
        return 0, replies
    text = metadata(cache)
    probe = await client.request(control_message(MessageKind.PROBE_PREFILL, session_id, prompt[:length], text,
                                                 request_id), ReplyKind.ACK)
    replies.append(probe)
    hit = length - probe.stats.kv_imported_tokens
    if not probe.stats.kv_hit_stage_mask & 1 or not 0 < hit <= length:
        return 0, replies
    if fused is not None and hit == len(prompt) - 1:
        reply = await client.request(restore_decode_message(session_id, prompt, text, request_id),
                                     (ReplyKind.ACK, ReplyKind.PREDICTED_TOKEN))
        if reply.kind == ReplyKind.PREDICTED_TOKEN and reply.stats.kv_hit_stage_mask & 1:
            fused.append(reply)
            return hit, replies
        replies.append(reply)
    else:
        restore = await client.request(control_message(MessageKind.TRY_RESTORE_PREFILL, session_id, prompt[:hit],
                                                       text, request_id), ReplyKind.ACK)
        replies.append(restore)
        if restore.stats.kv_hit_stage_mask & 1:
            return hit, replies
    replies.append(await client.trim(session_id, 0, request_id=request_id))  # nothing half-restored anywhere
    return 0, replies


def fork_metadata(cache: CacheRequest, parent: int, length: int, extension: SamplingRequest | None = None) -> str:
    """ConfigureGeneration metadata that forks a session from ``parent``'s first ``length`` positions
    (the new session records nothing: its prompt is its parent's), with the sampling extension (§10)."""
    sections: dict[str, object] = {"skippy.prefix_cache": {"namespace": cache.namespace, "record": False},
                                   "skippy.fork": {"session": parent, "length": length}}
    if extension is not None:
        sections[SAMPLING_METADATA_KEY] = extension.section()
    return json.dumps(sections, separators=(",", ":"))


def _check_confirmed(client: StageClient, extension: SamplingRequest | None) -> None:
    """docs/protocol.md §10: the configure ACK just received must come with the final stage's
    SamplingAccepted frame naming every feature asked for.

    Raises:
        SamplingExtensionRefused: it did not.
    """
    if extension is None:
        return
    accepted = client.last_accepted
    if accepted is None or accepted.features & extension.features != extension.features:
        wanted = " and ".join(name for name, on in (("grammar", extension.grammar is not None),
                                                    ("logprobs", extension.logprobs is not None)) if on)
        raise SamplingExtensionRefused(
            f"the chain at {client.address} did not confirm the request's {wanted}: every stage must be a "
            "skippy stage with the sampling extension (docs/protocol.md §10)")


async def fork_prefill(client: StageClient, session_id: int, prompt: Sequence[int], *, parent: int, stages: int,
                       at: tuple[int, int] | None = None, sampling: SamplingConfig | None, cache: CacheRequest,
                       chunk_size: int | Callable[[int], int], credit: int, request_id: int = 0,
                       extension: SamplingRequest | None = None, direct_return: Address | None = None) -> CachedPrefill:
    """Configure ``session_id`` as a fork of ``parent`` (which holds ``prompt``'s KV on every stage of
    the lane) and compute the rest of the prompt, whose logits the fork cannot carry.

    ``at`` (start, size): the parent's last prefill chunk (:meth:`CachedPrefill.last_chunk`); the
    fork copies ``prompt[:start]`` and computes that chunk again with the same size, so its first
    token is made exactly as the parent's was (a token computed alone rounds differently from the
    same token inside its chunk on quantized models).  None: copy all but the last prompt token.

    The fork holds when the ACK says every one of the ``stages`` stages forked (``kv_lookup_hits``
    ``stages``, ``kv_imported_tokens`` ``stages * (len(prompt) - 1)``, no miss); otherwise the prompt
    is prefilled in full from position 0, after a TrimSession(0) when some stage did copy (a stage
    refuses a chunk that would overwrite positions it holds).  ``cached_tokens`` of the result is
    the forked length.  ``extension`` and ``direct_return`` as for :func:`prefill` (the return lane
    is the fork's own).

    Raises:
        SamplingExtensionRefused: the chain did not confirm ``extension``.
        StageLost: the final stage named by ``direct_return`` cannot be reached.
    """
    length = len(prompt) - 1 if at is None else at[0]
    if not 0 <= length < len(prompt):
        raise ValueError(f"a fork of a {len(prompt)}-token prompt cannot copy {length} positions")
    text = (fork_metadata(cache, parent, length, extension) if length > 0
            else configure_metadata(dataclasses.replace(cache, enabled=False), extension))
    ack = await client.configure(session_id, sampling=sampling, prompt_token_count=len(prompt),
                                 request_id=request_id, metadata=text,
                                 flags=SAMPLING_EXTENSION_FLAG if extension is not None else 0)
    _check_confirmed(client, extension)
    stats = ack.stats
    forked = length if (length > 0 and stages > 0 and stats.kv_lookup_hits == stages and not stats.kv_lookup_misses
                        and stats.kv_imported_tokens == stages * length) else 0
    control = [ack]
    if not forked and stats.kv_lookup_hits:  # some stage copied the prefix: nothing half-forked anywhere
        control.append(await client.trim(session_id, 0, request_id=request_id))
    if direct_return is not None:
        await client.open_direct_return(direct_return, session_id, request_id=request_id)
    rest = len(prompt) - forked
    size = chunk_size(rest) if callable(chunk_size) else chunk_size
    if at is not None and (forked == at[0] or at[0] % at[1] == 0):
        size = at[1]  # the parent's last chunk, or (no fork) the prompt in the parent's chunks
    result = await client.prefill(session_id, prompt[forked:], pos_start=forked, chunk_size=size,
                                  credit=credit, request_id=request_id)
    return CachedPrefill(result, forked, tuple(control), size)


async def prefill(client: StageClient, session_id: int, prompt: Sequence[int], *,
                  sampling: SamplingConfig | None, cache: CacheRequest | None,
                  chunk_size: int | Callable[[int], int], credit: int, request_id: int = 0,
                  extension: SamplingRequest | None = None, direct_return: Address | None = None,
                  resumable: bool = False) -> CachedPrefill:
    """Configure the session and prefill ``prompt``, restoring what the chain has cached.

    ``chunk_size`` is a size, or a function of the token count left to prefill after the restore
    that returns one (the driver's adaptive chunking, :mod:`skippy.driver.prefill_chunking`).
    ``extension``: the session's grammar / logprobs (docs/protocol.md §10), sent with the
    sampling-extension flag; the final stage must confirm it in the configure ACK.
    ``direct_return``: the chain's final stage; a return lane to it is opened for the session
    before the prompt's chunks go (docs/protocol.md §8), so the first token and every later
    prediction come straight back.  A final stage that refuses leaves the session hop by hop; a
    restore that already answered the first token (fused) leaves it hop by hop too.

    Raises:
        SamplingExtensionRefused: the chain did not confirm ``extension``.
        StageLost: the final stage named by ``direct_return`` cannot be reached.
    """
    text = configure_metadata(cache, extension, {"hold": True} if resumable else None)
    flags = SAMPLING_EXTENSION_FLAG if extension is not None else 0
    control = [await client.configure(session_id, sampling=sampling, prompt_token_count=len(prompt),
                                      request_id=request_id, metadata=text, flags=flags)]
    _check_confirmed(client, extension)
    cached = 0
    fused: list[StageReply] = []
    if cache is not None:
        cached, replies = await lookup_and_restore(client, session_id, prompt, cache, request_id=request_id,
                                                   fused=fused if cache.fused else None)
        control += replies
    if fused:  # restored and decoded in one trip: the reply is the first token's
        return CachedPrefill(PrefillResult(fused[0], ()), cached, tuple(control))
    if direct_return is not None:
        await client.open_direct_return(direct_return, session_id, request_id=request_id)
    size = chunk_size(len(prompt) - cached) if callable(chunk_size) else chunk_size
    result = await client.prefill(session_id, prompt[cached:], pos_start=cached, chunk_size=size,
                                  credit=credit, request_id=request_id)
    return CachedPrefill(result, cached, tuple(control), size)
