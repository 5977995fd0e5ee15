"""What the hub's subscribers receive besides changes, shared by :class:`changestream.Hub` and
:class:`changestream.aio.AsyncHub` (so one ``except`` or ``isinstance`` serves both)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DEFAULT_MAX_QUEUE", "POLICIES", "Gap", "SubscriberDisconnected"]

POLICIES = ("block", "drop", "disconnect")
"""What a full subscription does (see the module docstring)."""
DEFAULT_MAX_QUEUE = 1000
"""Changes a subscription holds by default before its policy applies."""


@dataclasses.dataclass
class Gap:
    """Delivered in place of changes a ``"drop"`` subscription had no room for."""

    dropped: int
    """How many changes were dropped here."""
    after_token: Any
    """Resume token of the last change delivered before the gap (``None``: none yet)."""
    until_token: Any
    """Resume token of the last change dropped (resume after it to continue past the gap)."""


class SubscriberDisconnected(Exception):
    """Raised by a ``"disconnect"`` subscription that fell ``max_queue`` changes behind."""


_END = object()


class _Failed:
    """The stream's error, queued for each subscriber after its changes."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
