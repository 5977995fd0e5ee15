"""A handler that keeps failing (a poison change): retry it, then stop or dead-letter.

:class:`OnError` (``on_error=``): retry the handler on the same change with
exponential backoff (tenacity) up to ``retries`` times, then stop the run with
the handler's exception (the default, and what happens without a policy) or
pass the change and the exception to ``dead_letter``, whose return counts as
handled. Retries and dead letters are counted (:class:`HandlerCalls`, reported
in ``ConsumeStats``) and logged: a change is never skipped silently.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import tenacity

from ..errors import describe_error

__all__ = ["HandlerCalls", "OnError", "check_on_error"]

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
