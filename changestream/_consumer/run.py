"""One consume run, without its I/O: every decision of both loops, in one place.

``consume`` polls a stream with ``try_next``, calls the handler, and saves the
token of the last handled change in a :class:`~changestream.stores.TokenStore`
(:mod:`.saves`); a transient failure reopens the stream (:mod:`.retry`); what no
retry can fix stops with a :class:`~changestream.errors.ConsumeError` saying how
to recover (:mod:`.dead_ends`). The loops (``changestream/aio/_consume.py`` and
its generated twin) only do the I/O between :class:`Run`'s decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from .._diagnosis import not_a_store_message
from .._metrics import StatsReporter
from .._stream_view import StreamView
from ..errors import ConsumeError, describe_error, one_line
from ..stores import BatchingTokenStore, StoredToken
from .bounds import DEFAULT_CALL_TIMEOUT, check_call_timeout
from .dead_ends import (
    DEAD_END_MARK,
    ERROR_EVENT,
    error_event,
    invalidated,
    is_error_event,
    is_invalidate,
    operation_type,
)
from .handler_errors import HandlerCalls, TransientBudget
from .history import HistoryGap, HistoryPolicy
from .retry import RetryPolicy, is_transient
from .saves import SaveSchedule, check_save_options

__all__ = ["GAP", "HANDLE", "MARK", "NOTHING", "SAVE", "ConsumeResult", "Run"]

log = logging.getLogger("changestream.consume")
_LAST_TRY = 1.0
"""Seconds an open may take when ``retry_for`` is (nearly) spent: the last attempt."""


@dataclasses.dataclass(frozen=True)
class ConsumeResult:
    """How a :func:`consume` run that was stopped (``stop`` set) ended."""

    handled: int
    """Changes passed to the handler."""
    reopens: int
    """Times the stream was reopened after a transient failure."""
    token: Any
    """The last handled (and stored) token."""


HANDLE = "handle"
"""A change came: call the handler, then :meth:`Run.handled` (with workers: submit it, then
:meth:`Run.advanced_to`)."""
MARK = "mark"
"""With workers: no change came; hand the stream's token to the workers in order, then
:meth:`Run.advanced_to`."""
GAP = "gap"
"""The stream opened after a lost history: pass :attr:`Run.gap` to the ``gap`` function, then save."""
SAVE = "save"
"""Store the token now."""
NOTHING = "nothing"


class Run:
    """Everything :func:`consume` and :func:`changestream.aio.consume` decide, in one place.

    The two loops only do the I/O in between (open the stream, ``try_next``,
    call the handler, save the token, sleep), awaited or not; each decision
    (what to save and when, what ends the run, when to reopen, which error
    to raise) is a method here, so a fix lands once.
    """

    def __init__(
        self,
        store: object,
        *,
        save_every: int,
        save_interval: float | None,
        retry_for: float | None,
        backoff_initial: float,
        backoff_max: float,
        stats: StatsReporter,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        history: HistoryPolicy | None = None,
        calls: HandlerCalls | None = None,
        parallel: bool = False,
    ) -> None:
        if not (callable(getattr(store, "load", None)) and callable(getattr(store, "save", None))):
            raise TypeError(not_a_store_message(store))
        check_save_options(save_every, save_interval)
        check_call_timeout(call_timeout)
        self.call_timeout = call_timeout
        self.policy = RetryPolicy(retry_for, backoff_initial, backoff_max)
        self.progress = SaveSchedule(save_every, save_interval, full=(
            store.batch_full if isinstance(store, BatchingTokenStore) else None))
        self.store = store
        self.stats = stats
        self.opened = 0
        self.handler_error: BaseException | None = None
        """The handler's own exception, if it ended the run (propagated untouched)."""
        self.store_error: BaseException | None = None
        """The token store's exception if the last save failed (no second save on the way out;
        cleared by the next save that succeeds)."""
        self.history = history if history is not None else HistoryPolicy(
            "raise", None, is_collection=False)
        self.calls = calls if calls is not None else HandlerCalls(None)
        # transient errors inside the handler are retried for the run's budget
        self.calls.budget = TransientBudget(retry_for, backoff_initial, backoff_max)
        stats.calls = self.calls
        self.parallel = parallel
        """Changes go to worker threads or tasks (``workers`` > 1)."""
        self._stalled = False
        self.gap: HistoryGap | None = None
        """The lost interval to report (after :data:`GAP`)."""
        self._retries_began = time.monotonic()
        """When the current run of attempts (one ``tenacity`` call) began."""

    def loaded(self, stored: StoredToken | None) -> None:
        """What the store held when the run began."""
        self.progress.start(stored.token if stored is not None else None)

    @property
    def token(self) -> Any:
        """The token to save (last handled change or empty batch) and to reopen from."""
        return self.progress.token

    def opening(self) -> Any:
        """A stream is about to open: the token to open it from."""
        self.opened += 1
        return self.history.opening(self.progress.token)

    def open_timeout(self) -> float:
        """The bound of one open: ``call_timeout``, cut to what is left of ``retry_for``
        (at least :data:`_LAST_TRY` s), so waiting to select a server (30 s by default)
        cannot stretch ``retry_for=3`` to half a minute."""
        retry_for = self.policy.retry_for
        if retry_for is None:
            return self.call_timeout
        left = retry_for - (time.monotonic() - self._retries_began)
        return min(self.call_timeout, max(left, _LAST_TRY))

    def started(self, stream: StreamView) -> str:
        """``stream`` opened: :data:`SAVE` if its token moved the position."""
        self.stats.on_stream(stream)
        # the shells present tokens with the stream's codec (the same for every reopen)
        self.progress.present = stream.present_token
        if self.opened > 1:
            log.info("reopened the change stream (reopen %d)", self.opened - 1)
        due = self.progress.on_idle(stream.resume_token)
        self.progress.advanced = False
        self.gap = self.history.opened(stream)
        if self.gap is not None:
            return GAP
        return SAVE if due else NOTHING

    def gap_reported(self) -> str:
        """The ``gap`` function returned (after :data:`GAP`): :data:`SAVE` if the position moved."""
        self.gap = None
        return SAVE if self.progress.pending else NOTHING

    def polled(self, change: Any, token: Any, alive: bool, stalled: bool = False) -> str:
        """``try_next`` returned ``change`` and left ``token``; raise at the stream's end.

        ``stalled``: the stream resumed and no getMore succeeded since, so a
        moved token is saved but does not count as progress.
        """
        progress = self.progress
        self._stalled = stalled
        self.stats.poll(progress.handled, self.opened - 1)
        if change is None:
            token = self.present(token)  # (still the last event's, without a batch token)
            if not alive:
                raise invalidated(None, progress.token, token)
            if self.parallel:
                return MARK
            return SAVE if progress.on_idle(token, healthy=not stalled) else NOTHING
        operation = operation_type(change)  # (read once: this runs per change)
        if operation == "invalidate":
            raise invalidated(change, progress.token, self.present(token))
        if operation == ERROR_EVENT and not self.calls.dead_letters_error_events:
            raise error_event(change, progress.token, self.store)
        return HANDLE

    def polled_buffered(self, batch: list[tuple[Any, Any]]) -> int:
        """With workers: ``batch`` came from the stream's buffer after a :data:`HANDLE`
        (no poll, no I/O); how many of its changes to admit: all but an invalidate and what
        follows it (after admitting them, :meth:`polled` the invalidate: it raises). An error
        event stops the batch the same way unless ``dead_letter`` takes it."""
        self.stats.poll(self.progress.handled, self.opened - 1)
        stops = ("invalidate",) if self.calls.dead_letters_error_events else ("invalidate", "error")
        for index, (change, _) in enumerate(batch):
            if type(change) is dict:  # (is_invalidate inline for dicts: this runs per change)
                if change.get("operationType") in stops:
                    return index
            elif is_invalidate(change) or ("error" in stops and is_error_event(change)):
                return index
        return len(batch)

    def present(self, carried: Any) -> Any:
        """A token from :meth:`~changestream._stream_view.StreamView.take_carried` as a token in the stream's document class."""
        present = self.progress.present
        return carried if present is None else present(carried)

    def handled(self, token: Any) -> str:
        """The handler returned for the change that left ``token``."""
        return SAVE if self.progress.on_change(token) else NOTHING

    def advanced_to(self, watermark: Any, handled: int) -> str:
        """With workers: ``handled`` changes are done and ``watermark`` may be stored."""
        due = self.progress.on_watermark(watermark, handled, healthy=not self._stalled)
        return SAVE if due else NOTHING

    def saved(self) -> None:
        """A save succeeded: the store works again (the way out flushes to it too)."""
        self.store_error = None
        self.progress.saved()
        self.stats.on_stored(self.progress.token)

    @property
    def pending(self) -> bool:
        """A token not yet in the store."""
        return self.progress.pending

    def history_lost(self, exc: BaseException) -> bool:
        """Opening or reading failed with ``exc``: a lost history ``on_history_lost`` recovers
        from (reopen at once, from now or with a new snapshot) or not."""
        if not self.history.recover(exc, self.progress.token):
            return False
        self.progress.token = None
        self.progress.advanced = True
        return True

    def reopen_after(self, exc: BaseException) -> bool:
        """The stream failed with ``exc``: reopen at once (it had made progress) or not."""
        if exc is not self.handler_error and self.history_lost(exc):
            return True
        if self.progress.advanced and is_transient(exc):
            log.warning("change stream failed after progress (%s); reopening",
                        describe_error(exc))
            return True
        return False

    def retrying(self) -> dict[str, Any]:
        """Keyword arguments for ``tenacity.Retrying`` / ``AsyncRetrying`` (plus ``sleep``);
        a new run of attempts begins (``retry_for`` counts from here)."""
        self._retries_began = time.monotonic()
        return self.policy.arguments()

    def dead_end(self, exc: BaseException) -> ConsumeError | None:
        """What the run raises for ``exc`` that ended it (``None``: ``exc`` itself)."""
        return self.policy.dead_end(exc, self.progress.token, self.store,
                                    from_handler=exc is self.handler_error)

    def final_error(self, exc: BaseException) -> BaseException:
        """The exception the run raises for ``exc`` that ended it (``exc``: re-raise it).

        A dead end becomes its :class:`ConsumeError` (caused by ``exc``); another
        server error keeps its type but reads ``code codeName: errmsg``; the
        handler's own errors propagate untouched. Raise it ``from error.__cause__``.
        """
        if self.parallel and isinstance(exc, ConsumeError):
            exc.token = self.progress.token  # raised before the workers finished: now they have
        dead_end = self.dead_end(exc)
        if dead_end is not None:
            log.error("%s", dead_end, extra={DEAD_END_MARK: True})
            dead_end.__cause__ = exc
            return dead_end
        return exc if exc is self.handler_error else one_line(exc)

    def finished(self) -> None:
        """The run ends (returns or raises): the last statistics."""
        self.stats.finish(self.progress.handled, max(self.opened - 1, 0))

    def result(self) -> ConsumeResult:
        """How a run that was stopped ended."""
        self.finished()
        return ConsumeResult(self.progress.handled, max(self.opened - 1, 0), self.progress.token)
