"""Which failures of a consume run are transient, and the backoff between reopens.

When the stream's own single resume fails for a transient reason (server
unreachable, network errors, a failover longer than server selection) the
stream is reopened from the last handled token with exponential backoff
(tenacity) for at most ``retry_for`` seconds; then the run stops with
:class:`~changestream.errors.RetriesExhaustedError`. The Spark prefetcher reopens
with the same policy and logger.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import tenacity
from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

from .._codes import (
    BSON_OBJECT_TOO_LARGE,
    NON_RESUMABLE_LABEL,
    TRANSIENT_CODES,
    TRANSIENT_LABELS,
)
from .._diagnosis import authentication_failed, describe_store
from ..errors import ConsumeError, RetriesExhaustedError, describe_error
from .dead_ends import describe_token, unrecoverable

__all__ = ["RetryPolicy", "handler_error_is_transient", "is_transient"]

log = logging.getLogger("changestream.consume")


def is_transient(exc: BaseException) -> bool:
    """May reopening the stream from the stored token succeed later?

    Network errors, server selection timeouts, client-side timeouts, and
    server errors labelled resumable/retryable or with a retryable code are;
    anything labelled ``NonResumableChangeStreamError`` never is, nor failed
    authentication (a server selection timeout included: only new credentials help).
    """
    if not isinstance(exc, PyMongoError) or exc.has_error_label(NON_RESUMABLE_LABEL):
        return False
    if authentication_failed(exc) or getattr(exc, "code", None) == BSON_OBJECT_TOO_LARGE:
        return False  # the same credentials, the same oversized event: never better on retry
    if isinstance(exc, ConnectionFailure) or exc.timeout:
        return True
    if isinstance(exc, OperationFailure):
        return exc.code in TRANSIENT_CODES or any(map(exc.has_error_label, TRANSIENT_LABELS))
    return False


def handler_error_is_transient(exc: BaseException) -> bool:
    """An error inside the handler that says its target is briefly unreachable (a failover
    of the handler's own database): :func:`is_transient`'s, or a ``ConnectionError``."""
    return isinstance(exc, ConnectionError) or is_transient(exc)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Backoff between reopen attempts; ``retry_for=None`` retries forever."""

    retry_for: float | None
    backoff_initial: float
    backoff_max: float

    def __post_init__(self) -> None:
        if self.retry_for is not None and self.retry_for < 0:
            raise ValueError(f"retry_for must be >= 0 or None, not {self.retry_for}")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError(
                "backoff needs 0 < backoff_initial <= backoff_max, got "
                f"{self.backoff_initial} and {self.backoff_max}"
            )

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``tenacity.Retrying`` / ``AsyncRetrying``."""
        stop: Any = (
            tenacity.stop_never if self.retry_for is None
            else tenacity.stop_after_delay(self.retry_for)
        )
        return {
            "retry": tenacity.retry_if_exception(is_transient),
            "wait": tenacity.wait_exponential(multiplier=self.backoff_initial,
                                              max=self.backoff_max)
            + tenacity.wait_random(0, self.backoff_initial),
            "stop": stop,
            "before_sleep": _log_retry,
            "reraise": True,
        }

    def dead_end(
        self, exc: BaseException, token: Any, store: object, *, from_handler: bool
    ) -> ConsumeError | None:
        """What the loop raises for ``exc`` that ended it (``None``: ``exc`` itself)."""
        if is_transient(exc):
            source = "the handler" if from_handler else "the change stream"
            return RetriesExhaustedError(
                f"{source} kept failing for {self.retry_for:g} s, the last time with "
                f"{describe_error(exc)}; {describe_store(store)} holds {describe_token(token)}: run again once"
                " the deployment is reachable and it resumes from there",
                token=token,
            )
        return None if from_handler else unrecoverable(exc, token, store)


def _log_retry(state: tenacity.RetryCallState) -> None:
    outcome = state.outcome
    exc = outcome.exception() if outcome is not None else None
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning(
        "change stream failed (%s); reopening from the last handled token in %.2f s "
        "(attempt %d)", "?" if exc is None else describe_error(exc), delay,
        state.attempt_number + 1,
    )
