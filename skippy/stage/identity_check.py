"""A stage's check of its downstream's model identity (``docs/protocol.md`` §9), and its refusal.

Strategy: :class:`DownstreamIdentities` asks the downstream for its Identity frame each time a
lane dials it (:func:`skippy.identity.query_identity`), remembers peers that gave none (a plain
v11 peer costs the timeout once per address), and raises :class:`ModelMismatch` (a
:class:`~skippy.stage.errors.StageError`, so the lane closes with an Error frame) when the two
stages cannot form a chain.  What identifies a stage, and asking a peer: :mod:`skippy.identity`.
"""

from __future__ import annotations

import logging
import ssl

from skippy.codec.protocol_ext import ErrorCode, IdentityFrame
from skippy.identity import QUERY_TIMEOUT, query_identity
from skippy.lane.errors import StageError
from skippy.net.address import Address

__all__ = ["DownstreamIdentities", "ModelMismatch"]


log = logging.getLogger("skippy.identity")


class ModelMismatch(StageError):
    """Two stages of a chain (or the driver and the first stage) serve different models, ranges
    that do not meet, or different context settings; the text names both sides."""

    code = ErrorCode.MODEL_MISMATCH


def _describe_pair(own_label: str, own: IdentityFrame, other_label: str, other: IdentityFrame) -> str:
    return f"{own_label} serves {own.describe()}; {other_label} serves {other.describe()}"


class DownstreamIdentities:
    """A stage's checks of its downstream (module notes); one per stage, shared by its lanes."""

    def __init__(self, own: IdentityFrame, *, timeout: float = QUERY_TIMEOUT,
                 tls: ssl.SSLContext | None = None) -> None:
        self.own = own
        self.timeout = timeout
        self.tls = tls
        self._plain: set[str] = set()

    async def verify(self, address: Address) -> IdentityFrame | None:
        """Check the stage at ``address`` can follow this one; its frame (None: unverified).

        Raises:
            ModelMismatch: it cannot, naming both files and ranges.
        """
        key = str(address)
        if key in self._plain:
            return None
        try:
            frame = await query_identity(address, timeout=self.timeout, tls=self.tls)
        except OSError as exc:  # the lane's own connect just worked: report, do not fail on it
            log.warning("could not ask downstream stage %s for its model identity: %s", address, exc)
            return None
        if frame is None:
            self._plain.add(key)
            log.warning("downstream stage %s does not report its model identity (a plain v11 stage?); "
                        "the chain's model files are not checked", address)
            return None
        why = self.own.mismatch(frame)
        if why is not None:
            raise ModelMismatch(f"model mismatch with downstream stage {address}: {why}: "
                                + _describe_pair("this stage", self.own, "the downstream", frame))
        return frame
