"""A lost history (``on_history_lost``): the oplog rolled past the stored token (code 286).

``"raise"`` :class:`~changestream.errors.HistoryLostError` (the default),
``"resnapshot"`` (copy the collection into the handler again, as
``initial_snapshot=True`` does, then stream on) or ``"from_now"`` (open a new
stream from the current time). Both recoveries log a warning and call ``gap``
with a :class:`HistoryGap` (the lost interval) before anything is stored, so a
crash in between calls it again; ``"from_now"`` requires it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final, Literal

from pymongo.errors import OperationFailure

from .._codes import CHANGE_STREAM_HISTORY_LOST
from .._token import token_cluster_time
from ..errors import describe_error

__all__ = [
    "FRESH_SNAPSHOT",
    "HISTORY_LOST_CHOICES",
    "HistoryGap",
    "HistoryLost",
    "HistoryPolicy",
    "resnapshotting",
]

log = logging.getLogger("changestream.consume")

HistoryLost = Literal["raise", "resnapshot", "from_now"]
HISTORY_LOST_CHOICES: Final = ("raise", "resnapshot", "from_now")

@dataclasses.dataclass(frozen=True)
class HistoryGap:
    """Changes the run could not deliver: the oplog rolled past its stored token (code 286)."""

    token: Any
    """The stored token the stream could not resume from."""
    lost_after: datetime | None
    """Its cluster time (UTC): changes after it up to :attr:`resumed_at` are lost."""
    resumed_at: datetime | None
    """Where the new stream starts (UTC) with ``"from_now"``; ``None`` with ``"resnapshot"``
    (the copy brings every document's current state) or if the server sent no time."""
    action: str
    """``"from_now"`` or ``"resnapshot"``."""


class _FreshSnapshot:
    def __repr__(self) -> str:
        return "FRESH_SNAPSHOT"


FRESH_SNAPSHOT: Final[Any] = _FreshSnapshot()
"""The token :meth:`HistoryPolicy.opening` gives when the next stream must copy the collection anew."""


def resnapshotting(open_stream: Callable[[Any], Any], open_snapshot: Callable[[Any], Any]
                   ) -> Callable[[Any], Any]:
    """``open_stream`` that starts a new snapshot when given :data:`FRESH_SNAPSHOT` (sync or async)."""

    def opener(token: Any) -> Any:
        if token is FRESH_SNAPSHOT:
            return open_snapshot(None)
        return open_stream(token)

    return opener


class HistoryPolicy:
    """``on_history_lost=`` of one run: what a 286 leads to, and the gap to report."""

    def __init__(self, choice: object, gap: Callable[[HistoryGap], Any] | None,
                 *, is_collection: bool) -> None:
        if choice not in HISTORY_LOST_CHOICES:
            raise ValueError(
                f"on_history_lost must be one of {', '.join(map(repr, HISTORY_LOST_CHOICES))}, "
                f"not {choice!r}"
            )
        if gap is not None and not callable(gap):
            raise ValueError(f"gap must be a function of a HistoryGap, not {type(gap).__name__}")
        if choice == "from_now" and gap is None:
            raise ValueError(
                "on_history_lost='from_now' skips the changes the oplog no longer holds: pass "
                "gap=function(HistoryGap) to record or repair that interval (never silent)"
            )
        if choice == "resnapshot" and not is_collection:
            raise ValueError(
                "on_history_lost='resnapshot' needs the collection itself as consume's first "
                "argument (consume then copies it again); an open_stream function cannot"
            )
        self.choice = choice
        self.gap = gap
        self._lost: tuple[Any, str] | None = None
        self._fresh_snapshot = False

    def recover(self, exc: BaseException, token: Any) -> bool:
        """``exc`` ended a stream: ``True`` if it is a lost history this run recovers from."""
        if (self.choice == "raise" or not isinstance(exc, OperationFailure)
                or exc.code != CHANGE_STREAM_HISTORY_LOST):
            return False
        lost_after = token_cluster_time(token) if token is not None else None
        log.warning(
            "change stream history lost (code 286) after %s: %s; on_history_lost=%r, so %s",
            "?" if lost_after is None else f"{lost_after.as_datetime():%Y-%m-%d %H:%M:%S} UTC",
            describe_error(exc), self.choice,
            "the collection is copied into the handler again" if self.choice == "resnapshot"
            else "the changes since then are skipped and the stream continues from now",
        )
        self._lost = (token, str(self.choice))
        self._fresh_snapshot = self.choice == "resnapshot"
        return True

    def opening(self, token: Any) -> Any:
        """The token to open the next stream from (``token``, or a fresh start after a loss)."""
        if self._lost is None:
            return token
        return FRESH_SNAPSHOT if self._fresh_snapshot else None

    def opened(self, stream: Any) -> HistoryGap | None:
        """A stream opened: the gap to hand to ``gap`` before anything is stored, if any."""
        if self._lost is None:
            return None
        token, action = self._lost
        self._lost = None
        lost_after = token_cluster_time(token) if token is not None else None
        resumed_at = None
        if action == "from_now":
            start = token_cluster_time(stream.resume_token) if stream.resume_token else None
            resumed_at = start.as_datetime() if start is not None else None
        gap = HistoryGap(token, None if lost_after is None else lost_after.as_datetime(),
                         resumed_at, action)
        return gap if self.gap is not None else None
