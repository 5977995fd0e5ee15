"""A handler that keeps failing (a poison change): retry it, then stop or dead-letter.

:class:`OnError` (``on_error=``): retry the handler on the same change with
exponential backoff (tenacity) up to ``retries`` times, then stop the run with
the handler's exception (the default, and what happens without a policy) or
pass the change and the exception to ``dead_letter``, whose return counts as
handled. Retries and dead letters are counted (:class:`HandlerCalls`, reported
in ``ConsumeStats``) and logged: a change is never skipped silently.

A transient error inside the handler (its own database failing over: PyMongo's
transient errors, a ``ConnectionError``) is no sign of a poison change: it is
retried with the run's backoff (``backoff_initial`` .. ``backoff_max``) for up to
``retry_for`` seconds per change before it counts as one of the ``retries``, so an
outage of the handler's target never dead-letters healthy changes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import tenacity

from ..errors import describe_error
from .dead_ends import error_event, is_error_event
from .retry import handler_error_is_transient

__all__ = ["HandlerCalls", "OnError", "TransientBudget", "check_on_error"]

log = logging.getLogger("changestream.consume")


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
    A transient error (PyMongo's, a ``ConnectionError``: the handler's own database
    failing over) is first retried with the run's backoff for up to its
    ``retry_for`` before it counts as one of the ``retries``.
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


@dataclasses.dataclass(frozen=True)
class TransientBudget:
    """How long a transient error inside the handler is retried per change (the run's
    ``retry_for``, ``None``: for ever) and the backoff between the calls."""

    retry_for: float | None = 300.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0


class _Attempts:
    """One change's handler calls under :class:`OnError`: which failure counts as an attempt,
    and the wait before the next call (tenacity's ``stop`` and ``wait``)."""

    def __init__(self, policy: OnError, budget: TransientBudget,
                 stopping: Callable[[], bool]) -> None:
        self._policy = policy
        self._budget = budget
        self._stopping = stopping
        self._counted = 0
        self._transient_since: float | None = None
        self._transient_calls = 0
        self._seen = 0
        self._give_up = False
        self.transient = False
        """The last failure was a transient one, retried without counting."""

    def _classify(self, state: tenacity.RetryCallState) -> None:
        """Once per failed call (tenacity asks ``wait`` and ``stop`` about each)."""
        if state.attempt_number == self._seen:
            return
        self._seen = state.attempt_number
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        self.transient = self._give_up = False
        if exc is not None and handler_error_is_transient(exc):
            if self._stopping():
                self._give_up = True  # raised as is: never dead-lettered, handled again later
                return
            now = time.monotonic()
            if self._transient_since is None:
                self._transient_since = now
            retry_for = self._budget.retry_for
            if retry_for is None or now - self._transient_since < retry_for:
                self.transient = True
                self._transient_calls += 1
                return
        self._counted += 1
        self._give_up = self._counted > self._policy.retries

    def stop(self, state: tenacity.RetryCallState) -> bool:
        self._classify(state)
        return self._give_up

    def wait(self, state: tenacity.RetryCallState) -> float:
        self._classify(state)
        if self.transient:
            budget, calls = self._budget, self._transient_calls
            return float(min(budget.backoff_max, budget.backoff_initial * 2 ** (calls - 1)))
        policy = self._policy
        return float(min(policy.backoff_max, policy.backoff_initial * 2 ** (self._counted - 1)))


class HandlerCalls:
    """The ``on_error`` policy of one run, and its counts (safe to update from worker threads)."""

    def __init__(self, policy: OnError | None, budget: TransientBudget | None = None) -> None:
        self.policy = policy
        self.budget = budget if budget is not None else TransientBudget()
        """How long transient errors inside the handler are retried (the run's ``retry_for``)."""
        self.stop: Any = None
        """The run's stop event: a backoff wakes on it, and a transient error is then raised
        (the change is handled again after a restart) instead of retried or dead-lettered."""
        self.retries = 0
        """Handler calls repeated after an exception."""
        self.dead_letters = 0
        """Changes ``dead_letter`` took (it returned)."""
        self._lock = threading.Lock()

    @property
    def retrying(self) -> bool:
        """Is there anything to do beyond one plain handler call?"""
        return self.policy is not None

    def _stopping(self) -> bool:
        return self.stop is not None and bool(self.stop.is_set())

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``tenacity.Retrying`` / ``AsyncRetrying`` (plus ``sleep``),
        for one change."""
        policy = self.policy
        assert policy is not None
        attempts = _Attempts(policy, self.budget, self._stopping)
        return {
            "retry": tenacity.retry_if_exception_type(Exception),
            "stop": attempts.stop,
            "wait": attempts.wait,
            "before_sleep": lambda state: self._retried(state, attempts.transient),
            "reraise": True,
        }

    def _retried(self, state: tenacity.RetryCallState, transient: bool) -> None:
        with self._lock:
            self.retries += 1
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        if transient:
            retry_for = self.budget.retry_for
            log.warning("the handler hit a transient error (%s); calling it again on the same "
                        "change in %.2f s (for up to %s before on_error counts it)",
                        "?" if exc is None else describe_error(exc), delay,
                        "ever" if retry_for is None else f"retry_for={retry_for:g} s")
            return
        log.warning("the handler failed (%s); calling it again on the same change (retry %d)",
                    "?" if exc is None else describe_error(exc), state.attempt_number)

    def gave_up(self, change: Any, exc: BaseException) -> Callable[[Any, BaseException], Any] | None:
        """The handler failed for good on ``change``: its ``dead_letter``, or ``None`` (stop)."""
        policy = self.policy
        if policy is None or policy.dead_letter is None:
            return None
        if self._stopping() and handler_error_is_transient(exc):
            return None  # stopped during an outage: not a poison change
        log.warning("the handler failed %d times on a change (%s); passed to dead_letter",
                    policy.retries + 1, describe_error(exc))
        return policy.dead_letter

    @property
    def dead_letters_error_events(self) -> bool:
        """An ``operationType: "error"`` event goes to ``dead_letter`` (else the run stops)."""
        policy = self.policy
        return policy is not None and policy.dead_letter is not None

    def error_event(self, change: Any) -> tuple[Callable[[Any, BaseException], Any],
                                                BaseException] | None:
        """``change`` is an error event: its ``dead_letter`` and the exception passed with it,
        without calling the handler (it is no data, and no retry changes it)."""
        policy = self.policy
        if policy is None or policy.dead_letter is None or not is_error_event(change):
            return None
        exc = error_event(change, None, None)
        log.warning("%s; passed to dead_letter", exc)
        return policy.dead_letter, exc

    def dead_lettered(self) -> None:
        """``dead_letter`` returned: the change is counted (one that raised is not)."""
        with self._lock:
            self.dead_letters += 1
