"""What a member's listener reports about its connections (``serverStatus``).

The server layer owns the sockets; a member only holds a view of its running
listener (:class:`ListenerStats`), so the commands above the core read the
counts without importing the server.
"""

from __future__ import annotations

import threading
from typing import Protocol


class ListenerStats(Protocol):
    """The running listener of a member, as ``serverStatus`` sees it."""

    @property
    def connection_count(self) -> int: ...

    @property
    def total_created(self) -> int: ...

    network: NetworkCounters


class NetworkCounters:
    """``serverStatus().network`` byte and request counts (logical vs. on the wire)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_in = self.bytes_out = self.physical_in = self.physical_out = 0
        self.requests = 0

    def received(self, size: int, wire_size: int) -> None:
        """One request of ``size`` bytes, ``wire_size`` as it arrived (compressed or not)."""
        with self._lock:
            self.requests += 1
            self.bytes_in += size
            self.physical_in += wire_size

    def sent(self, logical: int, physical: int) -> None:
        with self._lock:
            self.bytes_out += logical
            self.physical_out += physical
