"""When a stats report reads something from the deployment: every so often, until it cannot.

The stats timer reads the oplog (headroom, ``_headroom``) and ``serverStatus`` (the server's
change-stream counters, ``_server_metrics``) rarely, not per report: each reader is a
:class:`PeriodicRead` that says when it is due and, once the deployment says it cannot be
read here (no privilege, through mongos, an old server), says why once and stops asking.
No I/O here: the stats timer does the reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["PeriodicRead"]

log = logging.getLogger("changestream.consume")


class PeriodicRead:
    """Due every ``every`` seconds; never again after :meth:`give_up` (logged once, INFO)."""

    what = "a deployment read"
    """What is not reported once given up (the log line's subject)."""

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._every = every
        self._clock = clock
        self._last: float | None = None
        self.unavailable: str | None = None
        """Why it cannot be read here (logged once); no more reads then."""

    def due(self) -> bool:
        """Time to read again (never once the deployment said it cannot be read)."""
        if self.unavailable is not None:
            return False
        return self._last is None or self._clock() - self._last >= self._every

    def read_now(self) -> None:
        """A read was made (it succeeded or failed): the next is due ``every`` seconds later."""
        self._last = self._clock()

    def give_up(self, why: str) -> None:
        """It cannot be known here: say why, once, and stop reading."""
        if self.unavailable is None:
            self.unavailable = why
            log.info("%s not reported: %s", self.what, why)
