"""What :func:`changestream.consume` decides, without its I/O: one :class:`Run` and its policy.

``consume`` polls a stream with ``try_next``, calls the handler, and saves
the token of the last *handled* change (and of empty batches, the
postBatchResumeToken) in a :class:`~changestream.stores.TokenStore`. After a
crash, a restart resumes from the stored token, so every change is handled
at least once. When the stream's own single resume fails for a transient
reason (server unreachable, network errors, a failover longer than server
selection) the stream is reopened from the last handled token with
exponential backoff (tenacity). What no retry can fix stops with a
:class:`ConsumeError` saying how to recover; a dead token never loops.

Both consume loops (``changestream/aio/_consume.py`` and the sync module
generated from it) only do the I/O between :class:`Run`'s decisions: which
errors are transient (:func:`is_transient`), which are dead ends
(:func:`unrecoverable`), the save schedule (:class:`Progress`) and the retry
settings (:class:`RetryPolicy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any, Final

import pymongo
import tenacity
from pymongo.errors import ConnectionFailure, OperationFailure, PyMongoError

from ._codes import (
    BSON_OBJECT_TOO_LARGE,
    CHANGE_STREAM_FATAL,
    CHANGE_STREAM_HISTORY_LOST,
    NON_RESUMABLE_LABEL,
    TRANSIENT_CODES,
    TRANSIENT_LABELS,
    UNAUTHORIZED,
)
from ._diagnosis import (
    authentication_failed,
    describe_store,
    errmsg,
    event_too_large_message,
    missing_credentials,
    missing_credentials_message,
    not_authorized_message,
    token_not_in_history_message,
    wrong_credentials_message,
)
from ._metrics import StatsReporter
from ._policies import HandlerCalls, HistoryGap, HistoryPolicy
from ._token import ResumeToken, token_cluster_time, token_to_json
from .errors import (
    ConsumeError,
    EventTooLargeError,
    HistoryLostError,
    NotResumableError,
    RetriesExhaustedError,
    StreamInvalidatedError,
    describe_error,
    one_line,
)
from .stores import StoredToken

__all__ = [
    "ConsumeError",
    "ConsumeResult",
    "HistoryLostError",
    "NotResumableError",
    "RetriesExhaustedError",
    "StreamInvalidatedError",
    "is_transient",
    "unrecoverable",
]

log = logging.getLogger("changestream.consume")
DEAD_END_MARK = "changestream_dead_end"
"""Set on the log record of the error a run stops with (the CLI prints it itself)."""
DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds each stream call (open, poll, close) of :func:`consume` may take by default."""
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


# -- classification (shared with the async loop) -----------------------------------------------
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


def _describe_token(token: Any) -> str:
    if token is None:
        return "no token (the stream started at the current time)"
    text = token_to_json(token)
    cluster_time = token_cluster_time(token)
    if cluster_time is None:
        return f"token {text}"
    return f"token {text} (cluster time {cluster_time.as_datetime():%Y-%m-%d %H:%M:%S} UTC)"


def unrecoverable(exc: BaseException, token: Any, store: object) -> ConsumeError | None:
    """The :class:`ConsumeError` for ``exc`` if it is one of the known dead ends, else ``None``.

    The wording is :mod:`changestream._diagnosis`'s (shared with the CLI and Spark).
    """
    where = _describe_token(token)
    held = describe_store(store)
    server = f" Server: {describe_error(exc)}"
    if authentication_failed(exc):
        return NotResumableError(wrong_credentials_message(where, held) + "." + server,
                                 token=token)
    if not isinstance(exc, OperationFailure):
        return None
    if exc.code == CHANGE_STREAM_HISTORY_LOST:
        return HistoryLostError(
            f"change stream history lost (code 286): the stored {where} is older than the "
            f"oldest entry of the server's oplog, so the changes since then are gone from the "
            f"change stream. To recover: resynchronise from the collection itself (e.g. a full "
            f"copy), then start a new stream at the time of that copy "
            f"(start_at_operation_time=...) or from now after clearing {held}. A larger "
            f"oplog (replSetResizeOplog) or a faster consumer prevents this.{server}",
            token=token,
        )
    if exc.code == UNAUTHORIZED:
        message = (missing_credentials_message if missing_credentials(exc)
                   else not_authorized_message)(where, held)
        return NotResumableError(message + "." + server, token=token)
    if exc.code == CHANGE_STREAM_FATAL:
        return NotResumableError(
            token_not_in_history_message(where, held, errmsg(exc), stored=token is not None) + "." + server, token=token
        )
    if exc.code == BSON_OBJECT_TOO_LARGE:
        return EventTooLargeError(event_too_large_message(where, held) + "." + server,
                                  token=token)
    if exc.has_error_label(NON_RESUMABLE_LABEL):
        return NotResumableError(
            f"the server says this change stream cannot be resumed "
            f"(NonResumableChangeStreamError): {describe_error(exc)}. Fix the cause (often the "
            f"pipeline), then run again: {held} holds {where}.",
            token=token,
        )
    return None


def _operation_type(change: Any) -> Any:
    if type(change) is dict or isinstance(change, Mapping):  # (dict: no ABC check per change)
        return change.get("operationType")
    return getattr(change, "operation_type", None)


def invalidated(change: Any, token: Any, invalidate_token: Any) -> StreamInvalidatedError:
    """The error for an ``invalidate`` event (``change``) or a stream the server ended (``None``)."""
    if change is None:
        what = "the server closed the change stream without an invalidate event (a pipeline "
        what += "stage may have filtered it out)"
    else:
        what = "the change stream was invalidated: the watched collection or database was "
        what += "dropped or renamed"
    return StreamInvalidatedError(
        f"{what}. Every change before it was handled and its token stored. To keep watching "
        f"the namespace, open a new stream with start_after={token_to_json(invalidate_token)} "
        f"(StreamInvalidatedError.invalidate_token); resume_after cannot pass an invalidate.",
        token=token,
        invalidate_token=invalidate_token,
    )


def is_invalidate(change: Any) -> bool:
    return bool(_operation_type(change) == "invalidate")


# -- the save schedule and retry settings (shared with the async loop) ------------------------
def _key(token: Any) -> ResumeToken | None:
    return ResumeToken.maybe(token)


@dataclasses.dataclass
class Progress:
    """Which token is safe to store and when to store it."""

    save_every: int
    save_interval: float | None
    _token: Any = dataclasses.field(default=None, init=False)
    _carried: Any = dataclasses.field(default=None, init=False)
    """A raw event's bytes holding :attr:`token`, presented when the token is read (most
    changes' tokens never are: the store takes one in ``save_every``)."""
    handled: int = 0
    advanced: bool = False
    """The current stream handled a change or moved its token (resets the retry budget)."""
    _saved: ResumeToken | None = dataclasses.field(default=None, init=False)
    _unsaved: int = dataclasses.field(default=0, init=False)
    _last_save: float = dataclasses.field(default_factory=time.monotonic, init=False)
    _watermark: Any = dataclasses.field(default=None, init=False)
    """The workers' watermark at the last :meth:`on_watermark` (moved or not)."""
    present: Callable[[Any], Any] | None = dataclasses.field(default=None, init=False)
    """The stream's token presentation: workers get raw tokens or the raw events holding
    them (most are never stored), and the one taken as :attr:`token` becomes a token
    in the stream's document class here."""

    @property
    def token(self) -> Any:
        """Token of the last handled change or empty batch: restarting there loses nothing."""
        carried = self._carried
        if carried is not None:
            self._token = carried if self.present is None else self.present(carried)
            self._carried = None
        return self._token

    @token.setter
    def token(self, token: Any) -> None:
        self._token, self._carried = token, None

    def start(self, token: Any) -> None:
        """The token loaded from the store."""
        self.token = token
        self._saved = _key(token)

    def on_change(self, token: Any) -> bool:
        """A change was handled, ``token`` after it (as :func:`token_after` gives it: the
        raw event's bytes are presented only if read); ``True``: save now."""
        if type(token) is bytes:
            self._carried = token
        else:
            self.token = token
        self.handled += 1
        self._unsaved += 1
        self.advanced = True
        due = self.save_interval is not None and (
            time.monotonic() - self._last_save >= self.save_interval
        )
        return self._unsaved >= self.save_every or due

    def on_watermark(self, token: Any, handled: int, *, healthy: bool = True) -> bool:
        """Parallel handlers: ``handled`` changes so far, ``token`` their low watermark;
        ``True``: save now (as :meth:`on_change` for changes, :meth:`on_idle` for a moved mark)."""
        newly = handled - self.handled
        self.handled = handled
        if newly:
            self._unsaved += newly
            self.advanced = True
        # Only a watermark that moved since the last call counts: after a reopen the workers
        # still hold the previous stream's (e.g. before a lost history), never to be stored.
        moved, self._watermark = token is not self._watermark, token
        if token is None or not moved:
            return False
        if self.present is not None:
            token = self.present(token)
        if not newly and _key(token) == _key(self.token):
            return False  # (a watermark past newly handled changes is a new token: no compare)
        self.token = token
        if not newly and not self._unsaved:
            # Only an empty batch's token moved: saved at once, as without workers.
            self.advanced = self.advanced or healthy
            return True
        due = self.save_interval is not None and (
            time.monotonic() - self._last_save >= self.save_interval
        )
        return self._unsaved >= self.save_every or due

    def on_idle(self, token: Any, *, healthy: bool = True) -> bool:
        """No change came (empty batch, or a new stream): ``True``: save the new token now.

        A token that moved only because the stream resumed (``healthy`` false:
        no getMore succeeded since) is saved but is no progress: a server that
        accepts every resume and fails every getMore must exhaust ``retry_for``.
        """
        if token is not None:
            self.token = token
        if self.pending:
            self.advanced = self.advanced or healthy
            return True
        return False

    @property
    def pending(self) -> bool:
        return self.token is not None and _key(self.token) != self._saved

    def saved(self) -> None:
        self._saved = _key(self.token)
        self._unsaved = 0
        self._last_save = time.monotonic()


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
                f"{describe_error(exc)}; {describe_store(store)} holds {_describe_token(token)}: run again once"
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


def check_save_options(save_every: int, save_interval: float | None) -> None:
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
        raise ValueError(f"save_every must be an integer >= 1, not {save_every!r}")
    if save_interval is not None and save_interval < 0:
        raise ValueError(f"save_interval must be >= 0 or None, not {save_interval!r}")


def check_call_timeout(call_timeout: float) -> None:
    if (
        isinstance(call_timeout, bool)
        or not isinstance(call_timeout, (int, float))
        or not math.isfinite(call_timeout)
        or not 0 < call_timeout <= 86400
    ):
        raise ValueError(
            f"call_timeout must be a number of seconds in (0, 86400], not {call_timeout!r}"
        )


def stalled(stream: Any) -> bool:
    """The stream resumed and no getMore succeeded since (see ``_machine.MAX_IDLE_RESUMES``)."""
    machine = getattr(stream, "_machine", None)
    return bool(getattr(machine, "idle_resumes", 0))


def token_after(stream: Any) -> Callable[[], Any]:
    """For each change ``try_next`` returns: the token after it, as the raw event's bytes
    when it is inside the event (no copy, no decode: most are never stored; the
    stream's ``_present_carried`` makes the stored one a token), else the token."""
    carried = getattr(stream, "_carried_token", None)
    if carried is None:  # e.g. the initial-snapshot wrapper
        return lambda: stream.resume_token
    return carried  # type: ignore[no-any-return]


def take_buffered(stream: Any, limit: int) -> list[tuple[Any, Any]]:
    """Up to ``limit`` changes ``stream`` answers from its buffer, each with where its token
    is (the raw event's bytes, or a raw token: :attr:`Progress.present` presents the one
    stored); ``[]`` from a stream without it, such as the initial-snapshot wrapper."""
    take = getattr(stream, "_take_guarded", None)
    return [] if take is None or limit < 1 else take(limit, False, event_bytes=True)


@contextlib.contextmanager
def signals_stop(enabled: bool, set_stop: Callable[[], object]) -> Iterator[None]:
    """With ``enabled``, SIGTERM and SIGINT call ``set_stop`` instead of killing the process.

    Python delivers signals to the main thread only, so this needs it; the
    previous handlers come back when the block ends.
    """
    if not enabled:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("stop_on_signals=True needs the main thread (signals arrive there)")

    def handler(signum: int, frame: FrameType | None) -> None:
        log.warning("received %s: stopping after the current change", signal.Signals(signum).name)
        set_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def call_bound(stream: Any, call_timeout: float) -> contextlib.AbstractContextManager[Any]:
    """The client-side timeout around one poll of ``stream`` (a change stream, or the
    initial-snapshot wrapper, whose copy getMores go without ``maxTimeMS``:
    :func:`changestream._pymongo.plain_command_spec`). A poll answered from the
    stream's buffer does no I/O and needs none (it runs per change)."""
    if getattr(stream, "buffered", 0) > 1:
        return _NO_BOUND
    return pymongo.timeout(call_timeout)


_NO_BOUND: Final = contextlib.nullcontext()


# -- one run, without its I/O (shared with the async loop) ------------------------------------
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
        check_save_options(save_every, save_interval)
        check_call_timeout(call_timeout)
        self.call_timeout = call_timeout
        self.policy = RetryPolicy(retry_for, backoff_initial, backoff_max)
        self.progress = Progress(save_every, save_interval)
        self.store = store
        self.stats = stats
        self.opened = 0
        self.handler_error: BaseException | None = None
        self.history = history if history is not None else HistoryPolicy(
            "raise", None, is_collection=False)
        self.calls = calls if calls is not None else HandlerCalls(None)
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

    def started(self, stream: Any) -> str:
        """``stream`` opened: :data:`SAVE` if its token moved the position."""
        self.stats.on_stream(stream)
        # the shells present tokens with the stream's codec (the same for every reopen)
        self.progress.present = getattr(stream, "_present_carried", None)
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
        if is_invalidate(change):
            raise invalidated(change, progress.token, self.present(token))
        return HANDLE

    def polled_buffered(self, batch: list[tuple[Any, Any]]) -> int:
        """With workers: ``batch`` came from the stream's buffer after a :data:`HANDLE`
        (no poll, no I/O); how many of its changes to admit: all but an invalidate and what
        follows it (after admitting them, :meth:`polled` the invalidate: it raises)."""
        self.stats.poll(self.progress.handled, self.opened - 1)
        for index, (change, _) in enumerate(batch):
            if type(change) is dict:  # (is_invalidate inline for dicts: this runs per change)
                if change.get("operationType") == "invalidate":
                    return index
            elif is_invalidate(change):
                return index
        return len(batch)

    def present(self, carried: Any) -> Any:
        """A token from :func:`take_buffered` as a token in the stream's document class."""
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
