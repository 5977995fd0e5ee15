"""The errors that end a Spark change-stream pipeline, each saying how to recover in Spark's terms.

The classes are the client's own (:mod:`changestream.errors`):
``ChangeStreamHistoryLostError`` is :class:`~changestream.errors.HistoryLostError`
and ``ChangeStreamInvalidatedError`` is
:class:`~changestream.errors.StreamInvalidatedError` (the names the Spark docs
use); only the messages, which speak of checkpoints and token stores, live here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from pymongo.errors import OperationFailure, PyMongoError, ServerSelectionTimeoutError

from .. import token_to_json
from .._codes import CHANGE_STREAM_HISTORY_LOST
from ..errors import (
    ChangeStreamError,
    HistoryLostError,
    NotResumableError,
    StreamInvalidatedError,
    describe_error,
    one_line,
)

AUTHENTICATION_FAILED = 18
"""mongod's AuthenticationFailed: every failed authentication, whatever the reason."""

__all__ = [
    "ChangeStreamHistoryLostError",
    "ChangeStreamInvalidatedError",
    "SchemaMismatchError",
    "error_event",
    "history_lost",
    "history_lost_as_error",
    "invalidated",
]

ChangeStreamHistoryLostError = HistoryLostError
ChangeStreamInvalidatedError = StreamInvalidatedError


def history_lost(token: Mapping[str, Any] | None, cause: str) -> HistoryLostError:
    """The stored position (resume token) is older than the oldest oplog entry (server code 286)."""
    where = token_to_json(token) if token is not None else "the requested start"
    return HistoryLostError(
        f"ChangeStreamHistoryLost (code 286): cannot resume from {where}; it is no longer in "
        f"the oplog, so the events after it are lost ({cause}). The checkpoint / token store "
        "cannot be reused. To recover: re-load the affected data from the collections if you "
        "need it, then start over with a NEW checkpointLocation (data source) or an emptied "
        "token store (foreach_batch) and a start inside the oplog window: startup_mode=latest, "
        "or startup_mode=timestamp with a recent start_at_operation_time. Size the oplog to "
        "outlast your longest outage to avoid this.",
        token=token,
    )


def invalidated(token: Mapping[str, Any] | None) -> StreamInvalidatedError:
    """The watched collection was dropped or renamed (or its database dropped): the stream ended.

    ``token`` is the invalidate event's token (also ``invalidate_token``): the
    new query starts after it.
    """
    text = token_to_json(token) if token is not None else "<the invalidate token>"
    return StreamInvalidatedError(
        "the change stream was invalidated (the watched collection was dropped or renamed, "
        "or its database dropped); every event before the invalidate was delivered. To "
        "watch the collection again, start a new query with a new checkpointLocation and "
        f"startup_mode=token, start_after={text}",
        token=token,
        invalidate_token=token,
    )


def error_event(token: Mapping[str, Any] | None) -> NotResumableError:
    """The stream delivered an ``operationType: "error"`` event: the failure of a change, not
    data; the query stops after writing every event before it."""
    text = token_to_json(token) if token is not None else "<no token>"
    return NotResumableError(
        f"the change stream delivered an error event (operationType 'error', token {text}): "
        "the server reports a failure in place of a change, so it was not written as data; "
        "every event before it was delivered. Fix the cause the event names (read it with "
        "changestream.watch(..., start_at_operation_time=...) or the mongo shell), then "
        f"restart the query; to skip it, start a new query with startup_mode=token, "
        f"start_after={text}",
        token=token,
    )


class SchemaMismatchError(ChangeStreamError):
    """A full document does not fit the user's ``full_document_schema`` (fail fast, lose nothing)."""


def unreachable(exc: BaseException) -> ChangeStreamError:
    """No server could be selected: the deployment is down, or the URI points elsewhere."""
    return ChangeStreamError(
        f"cannot reach the MongoDB deployment ({describe_error(exc)}): check option 'uri' and "
        "that the deployment is up and reachable from the Spark driver and executors"
    )


def refused_credentials(exc: BaseException) -> ChangeStreamError:
    """The deployment refused the URI's credentials (mongod never says why)."""
    return ChangeStreamError(
        f"the MongoDB deployment refused the credentials ({describe_error(exc)}): check the "
        "user name, password and authSource in option 'uri'"
    )


@contextlib.contextmanager
def history_lost_as_error(token: Mapping[str, Any] | None) -> Iterator[None]:
    """Turn the server's errors into messages whose first words name the cause.

    ChangeStreamHistoryLost becomes :class:`HistoryLostError` (with the
    recovery steps); an unreachable deployment and refused credentials become
    one-line :class:`~changestream.errors.ChangeStreamError`s saying so. Other
    server errors keep their type but read ``code codeName: errmsg``
    (:func:`~changestream.errors.one_line`): Spark shows the message, and
    PyMongo's would end with the whole reply, signature bytes included.
    """
    try:
        yield
    except ServerSelectionTimeoutError as exc:
        raise unreachable(exc) from None
    except OperationFailure as exc:
        if exc.code == CHANGE_STREAM_HISTORY_LOST:
            raise history_lost(token, describe_error(exc)) from exc
        if exc.code == AUTHENTICATION_FAILED:
            raise refused_credentials(exc) from None
        clean = one_line(exc)
        if clean is exc:
            raise
        raise clean from None
    except PyMongoError as exc:
        clean = one_line(exc)
        if clean is exc:
            raise
        raise clean from None
