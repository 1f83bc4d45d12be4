"""``HOST:PORT`` addresses of stages: listening, downstream, and the driver's first stage.

One frozen value, parsed from what the command line, a config file or a plan writes
(``tcp://`` prefix allowed, IPv6 as ``[::1]:PORT``) and printed back the same way.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Address:
    """A ``HOST:PORT`` pair."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "Address":
        """Parse ``HOST:PORT`` (``tcp://`` prefix allowed, IPv6 as ``[::1]:PORT``).

        Raises:
            ValueError: missing or invalid port.
        """
        body = text.removeprefix("tcp://")
        host, sep, port = body.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"address {text!r} is not HOST:PORT")
        host = host.strip("[]") or "127.0.0.1"
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
