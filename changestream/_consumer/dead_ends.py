"""What no retry of :func:`changestream.consume` can fix, and the error that says how to recover.

A dead token never loops: history lost (286), missing or wrong credentials, a
token from another deployment, an event over 16 MB, a stream the server says
cannot resume, an invalidate. Each becomes a :class:`~changestream.errors.ConsumeError`
whose message (the wording is :mod:`changestream._diagnosis`'s, shared with the CLI
and Spark) names what to do and where the stored token is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bson.raw_bson import RawBSONDocument
from pymongo.errors import OperationFailure

from .._codes import (
    BSON_OBJECT_TOO_LARGE,
    CHANGE_STREAM_FATAL,
    CHANGE_STREAM_HISTORY_LOST,
    NON_RESUMABLE_LABEL,
    OVERFLOW,
    UNAUTHORIZED,
)
from .._diagnosis import (
    authentication_failed,
    damaged_token_message,
    describe_store,
    errmsg,
    event_too_large_message,
    missing_credentials,
    missing_credentials_message,
    not_authorized_message,
    token_not_in_history_message,
    wrong_credentials_message,
)
from .._event_build import raw_operation_type
from .._token import token_cluster_time, token_to_json
from ..errors import (
    ConsumeError,
    EventTooLargeError,
    HistoryLostError,
    InvalidResumeTokenError,
    NotResumableError,
    StreamInvalidatedError,
    describe_error,
)

__all__ = [
    "DEAD_END_MARK", "ERROR_EVENT", "describe_token", "error_event", "invalidated", "is_error_event",
    "is_invalidate", "operation_type", "removed_shard", "unrecoverable",
]

REMOVED_SHARD_MESSAGE = "Change stream events no more available due to removed shard"
"""mongod's errmsg of 286 when a v1 stream would need a removed shard (MongoDB 9.0)."""

DEAD_END_MARK = "changestream_dead_end"
"""Set on the log record of the error a run stops with (the CLI prints it itself)."""
START_OPTIONS = ("resumeAfter", "startAfter")
"""A start token the stream refused names its option as the error's ``field``."""


def removed_shard(exc: BaseException) -> bool:
    """Is this 286 the removed-shard one (not an oplog that rolled over)?"""
    return errmsg(exc).startswith(REMOVED_SHARD_MESSAGE)


def describe_token(token: Any) -> str:
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
    where = describe_token(token)
    held = describe_store(store)
    server = f" Server: {describe_error(exc)}"
    if authentication_failed(exc):
        return NotResumableError(wrong_credentials_message(where, held) + "." + server,
                                 token=token)
    if isinstance(exc, InvalidResumeTokenError) and exc.field in START_OPTIONS:
        return NotResumableError(f"{exc}; {held} holds {where}.", token=token)
    if not isinstance(exc, OperationFailure):
        return None
    if exc.code == CHANGE_STREAM_HISTORY_LOST and removed_shard(exc):
        return HistoryLostError(
            f"a shard was removed from the cluster (code 286): a v1 change stream cannot "
            f"resume past a removed shard, so the stored {where} cannot be resumed. With "
            f"MongoDB 9.0+, open the stream with version='v2', ignore_removed_shards=True "
            f"(the CLI's --change-stream-version v2 --ignore-removed-shards) to go on without "
            f"the removed shard's events; otherwise resynchronise from the collection and "
            f"start from now after clearing {held}.{server}",
            token=token,
        )
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
    if exc.code == OVERFLOW and token is not None:
        return NotResumableError(damaged_token_message(where, held) + "." + server, token=token)
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


def operation_type(change: Any) -> Any:
    """``operationType`` of a document or a typed event (``None``: not an event)."""
    if type(change) is dict:  # (no ABC check per change)
        return change.get("operationType")
    if type(change) is RawBSONDocument:  # read from the bytes, not inflated per change
        found = raw_operation_type(change.raw)
        if found is not None:
            return found
    if isinstance(change, Mapping):
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
    return bool(operation_type(change) == "invalidate")


ERROR_EVENT = "error"
"""The ``operationType`` of an error reported as an event (said to come with MongoDB 9.1's
``showErrorsAsEvents``; not in mongod's source as of this writing, so nothing about its
fields is assumed)."""


def is_error_event(change: Any) -> bool:
    """Is ``change`` an ``operationType: "error"`` event (never data to apply)?"""
    return bool(operation_type(change) == ERROR_EVENT)


def _event_token(change: Any) -> Any:
    if isinstance(change, Mapping):
        return change.get("_id")
    return getattr(change, "resume_token", None)


def _event_text(change: Any) -> str:
    """The event's document, short: it is all we know of what the server reported."""
    raw = change if isinstance(change, Mapping) else getattr(change, "raw", None)
    try:
        shown = {key: value for key, value in (raw or {}).items() if key != "_id"}
    except Exception:  # a damaged raw document: the type is enough
        shown = {"operationType": ERROR_EVENT}
    text = repr(shown)
    return text if len(text) <= 300 else text[:297] + "..."


def error_event(change: Any, token: Any, store: object | None) -> NotResumableError:
    """The error for an ``operationType: "error"`` event: stop (``store`` given: the run's)
    or the exception handed to ``dead_letter`` with the event (``store`` None)."""
    event_token = _event_token(change)
    at = "no token" if event_token is None else f"token {token_to_json(event_token)}"
    what = (f"the change stream delivered an error event (operationType 'error', {at}): "
            f"the server reports a failure in place of a change, so it was not applied as "
            f"data. Event: {_event_text(change)}")
    if store is None:
        return NotResumableError(what, token=event_token)
    return NotResumableError(
        f"{what}. Fix the cause it names, then run again: {describe_store(store)} holds "
        f"{describe_token(token)}, before the event (to skip it instead, start after the "
        f"event's token, or pass on_error=OnError(dead_letter=...) to set such events aside).",
        token=token,
    )
