"""Errors that end a Spark change-stream pipeline, each saying how to recover.

Both subclass :class:`changestream.ChangeStreamError`, so existing handlers
for the client's errors catch them too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from pymongo.errors import OperationFailure

from .._token import token_to_json
from ..errors import ChangeStreamError

__all__ = [
    "CHANGE_STREAM_HISTORY_LOST",
    "ChangeStreamHistoryLostError",
    "ChangeStreamInvalidatedError",
    "SchemaMismatchError",
    "history_lost_as_error",
]

CHANGE_STREAM_HISTORY_LOST = 286


class ChangeStreamHistoryLostError(ChangeStreamError):
    """The stored position (resume token) is older than the oldest oplog entry (server code 286)."""

    def __init__(self, token: Mapping[str, Any] | None, cause: str) -> None:
        where = token_to_json(token) if token is not None else "the requested start"
        super().__init__(
            f"ChangeStreamHistoryLost (code 286): cannot resume from {where}; it is no longer in "
            f"the oplog, so the events after it are lost ({cause}). The checkpoint / token store "
            "cannot be reused. To recover: re-load the affected data from the collections if you "
            "need it, then start over with a NEW checkpointLocation (data source) or an emptied "
            "token store (foreach_batch) and a start inside the oplog window: startup_mode=latest, "
            "or startup_mode=timestamp with a recent start_at_operation_time. Size the oplog to "
            "outlast your longest outage to avoid this."
        )
        self.token = token


class ChangeStreamInvalidatedError(ChangeStreamError):
    """The watched collection was dropped or renamed (or its database dropped): the stream ended."""

    def __init__(self, token: Mapping[str, Any] | None) -> None:
        text = token_to_json(token) if token is not None else "<the invalidate token>"
        super().__init__(
            "the change stream was invalidated (the watched collection was dropped or renamed, "
            "or its database dropped); every event before the invalidate was delivered. To "
            "watch the collection again, start a new query with a new checkpointLocation and "
            f"startup_mode=token, start_after={text}"
        )
        self.token = token


class SchemaMismatchError(ChangeStreamError):
    """A full document does not fit the user's ``full_document_schema`` (fail fast, lose nothing)."""


@contextlib.contextmanager
def history_lost_as_error(token: Mapping[str, Any] | None) -> Iterator[None]:
    """Turn the server's ChangeStreamHistoryLost into :class:`ChangeStreamHistoryLostError`."""
    try:
        yield
    except OperationFailure as exc:
        if exc.code == CHANGE_STREAM_HISTORY_LOST:
            raise ChangeStreamHistoryLostError(token, str(exc).split(", full error")[0]) from exc
        raise
