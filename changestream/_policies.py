"""What a consume run does when the handler keeps failing, or when the stream's history is gone.

Shared by :func:`changestream.consume` and :func:`changestream.aio.consume`
(and used by :class:`changestream._consume_run.Run`), so both loops decide alike:

- :class:`OnError` (poison changes): retry the handler on the same change with
  exponential backoff (tenacity) up to ``retries`` times, then stop the run
  with the handler's exception (the default, and what happens without a
  policy) or pass the change and the exception to ``dead_letter``, whose
  return counts as handled. Retries and dead letters are counted
  (:class:`HandlerCalls`, reported in ``ConsumeStats``) and logged: a change is
  never skipped silently.
- ``on_history_lost`` (:class:`HistoryPolicy`): on ``ChangeStreamHistoryLost``
  (286) ``"raise"`` :class:`~changestream.errors.HistoryLostError` (the
  default), ``"resnapshot"`` (copy the collection into the handler again, as
  ``initial_snapshot=True`` does, then stream on) or ``"from_now"`` (open a
  new stream from the current time). Both recoveries log a warning and call
  ``gap`` with a :class:`HistoryGap` (the lost interval) before anything is
  stored, so a crash in between calls it again; ``"from_now"`` requires it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final, Literal

import tenacity
from pymongo.errors import OperationFailure

from ._codes import CHANGE_STREAM_HISTORY_LOST
from ._lanes import KeyFunction, Lanes, key_of, lanes_for
from ._token import token_cluster_time
from .errors import describe_error

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT",
    "FRESH_SNAPSHOT",
    "HISTORY_LOST_CHOICES",
    "HandlerCalls",
    "HistoryGap",
    "HistoryPolicy",
    "OnError",
    "Setup",
    "resnapshotting",
]

log = logging.getLogger("changestream.consume")

HistoryLost = Literal["raise", "resnapshot", "from_now"]
HISTORY_LOST_CHOICES: Final = ("raise", "resnapshot", "from_now")


# -- poison changes ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OnError:
    """How :func:`~changestream.consume` treats a handler that raises (``on_error=``).

    The handler is called again on the same change up to ``retries`` times,
    waiting ``backoff_initial`` seconds, doubling up to ``backoff_max``. If it
    still raises: with ``dead_letter=None`` the run stops with that exception
    (the stored token stays before the change, so a restart tries it again);
    otherwise ``dead_letter(change, exception)`` is called (a coroutine
    function is awaited by ``changestream.aio.consume``) and its return counts
    as handled. If ``dead_letter`` itself raises, the run stops with that.
    """

    retries: int = 3
    backoff_initial: float = 0.1
    backoff_max: float = 10.0
    dead_letter: Callable[[Any, BaseException], Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"OnError.retries must be an integer >= 0, not {self.retries!r}")
        for name in ("backoff_initial", "backoff_max"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"OnError.{name} must be a number of seconds >= 0, not {value!r}")
        if self.backoff_initial > self.backoff_max:
            raise ValueError(
                f"OnError needs backoff_initial <= backoff_max, got {self.backoff_initial} and "
                f"{self.backoff_max}"
            )
        if self.dead_letter is not None and not callable(self.dead_letter):
            raise ValueError(
                "OnError.dead_letter must be a function (change, exception), not "
                f"{type(self.dead_letter).__name__}"
            )


def check_on_error(on_error: object) -> OnError | None:
    if on_error is None or isinstance(on_error, OnError):
        return on_error
    raise TypeError(
        "on_error must be a changestream.OnError(retries=..., dead_letter=...) or None, not "
        f"{type(on_error).__name__}"
    )


class HandlerCalls:
    """The ``on_error`` policy of one run, and its counts (safe to update from worker threads)."""

    def __init__(self, policy: OnError | None) -> None:
        self.policy = policy
        self.retries = 0
        """Handler calls repeated after an exception."""
        self.dead_letters = 0
        """Changes ``dead_letter`` took (it returned)."""
        self._lock = threading.Lock()

    @property
    def retrying(self) -> bool:
        """Is there anything to do beyond one plain handler call?"""
        return self.policy is not None

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``tenacity.Retrying`` / ``AsyncRetrying`` (plus ``sleep``)."""
        policy = self.policy
        assert policy is not None
        return {
            "retry": tenacity.retry_if_exception_type(Exception),
            "stop": tenacity.stop_after_attempt(policy.retries + 1),
            "wait": tenacity.wait_exponential(multiplier=policy.backoff_initial,
                                              max=policy.backoff_max),
            "before_sleep": self._retried,
            "reraise": True,
        }

    def _retried(self, state: tenacity.RetryCallState) -> None:
        with self._lock:
            self.retries += 1
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        log.warning("the handler failed (%s); calling it again on the same change (retry %d)",
                    "?" if exc is None else describe_error(exc), state.attempt_number)

    def gave_up(self, change: Any, exc: BaseException) -> Callable[[Any, BaseException], Any] | None:
        """The handler failed for good on ``change``: its ``dead_letter``, or ``None`` (stop)."""
        policy = self.policy
        if policy is None or policy.dead_letter is None:
            return None
        log.warning("the handler failed %d times on a change (%s); passed to dead_letter",
                    policy.retries + 1, describe_error(exc))
        return policy.dead_letter

    def dead_lettered(self) -> None:
        """``dead_letter`` returned: the change is counted (one that raised is not)."""
        with self._lock:
            self.dead_letters += 1


# -- lost history --------------------------------------------------------------------------------
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


# -- one run's options -----------------------------------------------------------------------------
DEFAULT_DRAIN_TIMEOUT: Final = 30.0
"""Seconds ``consume`` lets admitted changes finish after a stop, Ctrl-C or an error (workers > 1)."""


class Setup:
    """The parallel, poison and lost-history options of one consume run, checked once.

    Shared by :func:`changestream.consume` and :func:`changestream.aio.consume`:
    ``source`` is their first argument, ``opener`` what
    :func:`~changestream._snapshot_watch.stream_opener` made of it (``source``
    itself unless it is a collection).
    """

    def __init__(
        self,
        source: object,
        opener: object,
        *,
        workers: object,
        key: KeyFunction | None,
        max_in_flight: object,
        drain_timeout: object,
        on_error: object,
        on_history_lost: object,
        gap: Callable[[HistoryGap], Any] | None,
    ) -> None:
        self.lanes: Lanes | None = lanes_for(workers, max_in_flight)
        """The dispatcher (``None``: ``workers=1``, the sequential loop)."""
        self.key = key_of(key)
        if (isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float))
                or not math.isfinite(drain_timeout) or drain_timeout < 0):
            raise ValueError(f"drain_timeout must be a number of seconds >= 0, not {drain_timeout!r}")
        self.drain_timeout = float(drain_timeout)
        self.calls = HandlerCalls(check_on_error(on_error))
        self.history = HistoryPolicy(on_history_lost, gap, is_collection=opener is not source)
        self.resnapshot = on_history_lost == "resnapshot"

    def report_gap(self, gap: HistoryGap | None) -> Any:
        """Call the ``gap`` function (its result: awaited by the async loop if awaitable)."""
        assert gap is not None and self.history.gap is not None
        return self.history.gap(gap)
