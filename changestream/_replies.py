"""Reading a server's cursor reply into the machine's terms, shape checked before any use.

A reply that is not what a server sends (a batch that is not an array, a cursor
id that is not an integer, an event without a token) becomes one
:class:`~changestream.errors.MalformedReplyError` naming the field, never a bare
``TypeError`` deep in the machine. Raw events keep their token inside them
(:data:`IN_EVENT`): it is sliced out only when used.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from bson.raw_bson import RawBSONDocument

from ._token import check_resume_token, describe, raw_event_token, token_in_raw_event
from .errors import MalformedReplyError

__all__ = ["IN_EVENT", "event_token", "not_an_event", "parse_cursor"]

IN_EVENT: Any = object()
"""From :func:`event_token`: the token is the raw event's own ``_id`` (see the machine's
``_token_event``)."""


def event_token(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """The event's ``_id`` (its resume token); ``KeyError`` if it has none.

    For a raw event in ``bytes`` whose first field is ``_id`` (as the server sends it) and
    whose token starts with a ``_data`` string, :data:`IN_EVENT`: the caller
    keeps the event and the token's bytes are sliced out only when used
    (:func:`~changestream._token.raw_event_token`). Anything but a document with a ``_data`` string
    raises :class:`~changestream.errors.InvalidResumeTokenError`.
    """
    kind = type(event)
    if kind is RawBSONDocument:
        raw = event.raw  # type: ignore[attr-defined]
        if token_in_raw_event(raw):
            if type(raw) is bytes:
                return IN_EVENT  # type: ignore[no-any-return]
            # PyMongo's sync client hands a reply over 64 KiB or so as a memoryview, and
            # its events as views into it: the token is copied out now, so what a stream
            # carries (consume stores it, workers pickle it) is a token or an event's bytes.
            return raw_event_token(raw)  # type: ignore[return-value]
    elif kind is not dict and not isinstance(event, Mapping):
        raise not_an_event(event)
    token = event["_id"]
    if type(token) is dict and type(token.get("_data")) is str:
        return token
    return check_resume_token(token, "_id")


def not_an_event(value: Any) -> MalformedReplyError:
    return MalformedReplyError(
        f"a change event must be a document, not {describe(value)}", field="event", value=value
    )


def parse_cursor(
    reply: Any, batch_field: str, name: str
) -> tuple[Mapping[str, Any], deque[Mapping[str, Any]], int, Mapping[str, Any] | None]:
    """Check a cursor reply's shape before anything of it is used (fields named on errors)."""
    if not isinstance(reply, Mapping):
        raise MalformedReplyError(f"malformed {name} reply: it must be a document, not {describe(reply)}",
                                  field="reply", value=reply)
    cursor = reply.get("cursor")
    if not isinstance(cursor, Mapping):
        raise MalformedReplyError(
            f"malformed {name} reply: 'cursor' must be a document, not {describe(cursor)}",
            field="cursor", value=cursor,
        )
    batch = cursor.get(batch_field)
    if not isinstance(batch, list):
        raise MalformedReplyError(
            f"malformed {name} reply: cursor.{batch_field} must be an array, not {describe(batch)}",
            field=f"cursor.{batch_field}", value=batch,
        )
    cursor_id = cursor.get("id")
    if isinstance(cursor_id, bool) or not isinstance(cursor_id, int):
        raise MalformedReplyError(
            f"malformed {name} reply: cursor.id must be an integer, not {describe(cursor_id)}",
            field="cursor.id", value=cursor_id,
        )
    post_batch_token = cursor.get("postBatchResumeToken")
    if post_batch_token is not None:
        check_resume_token(post_batch_token, "cursor.postBatchResumeToken")
    return cursor, deque(batch), int(cursor_id), post_batch_token
