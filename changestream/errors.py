"""Exceptions raised by the change-stream client (besides PyMongo's own errors): one hierarchy.

They subclass PyMongo's exceptions so code that already catches
``pymongo.errors.PyMongoError`` around ``watch()`` keeps working unchanged::

    ChangeStreamError                 the stream cannot continue for a client-side reason
    ├── MissingResumeTokenError       an event had no _id
    ├── MalformedReplyError           a reply field has the wrong shape; .field, .value
    │   └── InvalidResumeTokenError   an event _id / postBatchResumeToken is not a token
    ├── SplitEventError               fragments of a split event missing or out of order
    ├── TokenStoreError               a stored token cannot be read (changestream.stores)
    ├── SchemaMismatchError           a document does not fit the Spark schema (spark_adapter)
    └── ConsumeError                  a consumer stopped on a dead end; .token: where to restart
        ├── HistoryLostError          ChangeStreamHistoryLost (286): the token left the oplog
        ├── StreamInvalidatedError    the namespace was dropped/renamed; .invalidate_token
        ├── NotResumableError         credentials (13, 18), a token not in this deployment's
        │                             history (280), NonResumableChangeStreamError
        ├── EventTooLargeError        an event over 16 MB (10334) without reassemble_split_events
        └── RetriesExhaustedError     transient failures outlasted retry_for

A consumer is :func:`changestream.consume`, its asyncio twin, or the Spark
adapter (``foreach_batch`` and the data source). Each says in the message how
to recover in its own terms (store, checkpoint); the classes are shared, so one
``except changestream.HistoryLostError`` catches all of them.
``spark_adapter.ChangeStreamHistoryLostError`` and
``spark_adapter.ChangeStreamInvalidatedError`` are other names for
:class:`HistoryLostError` and :class:`StreamInvalidatedError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pymongo.errors import InvalidOperation, OperationFailure

__all__ = [
    "ChangeStreamError",
    "ConsumeError",
    "EventTooLargeError",
    "HistoryLostError",
    "InvalidResumeTokenError",
    "MalformedReplyError",
    "MissingResumeTokenError",
    "NotResumableError",
    "RetriesExhaustedError",
    "SplitEventError",
    "StreamInvalidatedError",
    "describe_error",
    "one_line",
]


class ChangeStreamError(InvalidOperation):
    """Base class: the stream cannot continue for a client-side reason."""


class MissingResumeTokenError(ChangeStreamError):
    """A change document had no ``_id`` (e.g. a ``$project`` removed it).

    The stream is closed: without the token it could not resume correctly.
    """

    MESSAGE = "Cannot provide resume functionality when the resume token is missing."

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class SplitEventError(ChangeStreamError):
    """Fragments of a split event (``$changeStreamSplitLargeEvent``) were missing or out of order.

    Raised instead of returning half an event; the stream is closed and its
    resume token still points before the first fragment.
    """


class ConsumeError(ChangeStreamError):
    """A consumer stopped on something a retry cannot fix.

    ``token`` is the token of the last handled change (also in the store
    when the error is raised): the safe point to restart from once fixed.
    """

    def __init__(self, message: str, *, token: Any) -> None:
        super().__init__(message)
        self.token = token


class HistoryLostError(ConsumeError):
    """The token is older than the server's oplog (ChangeStreamHistoryLost, code 286)."""


class NotResumableError(ConsumeError):
    """The server refuses the stream itself; the message says what to change before running again.

    Missing or wrong credentials (13, 18), a token that is not in this deployment's
    history (ChangeStreamFatalError 280: another deployment, a restored backup, a
    stage that changed ``_id``), or any ``NonResumableChangeStreamError``.
    """


class EventTooLargeError(ConsumeError):
    """A change event is over 16 MB (BSONObjectTooLarge, 10334); every resume would hit it again.

    Open the stream with ``reassemble_split_events=True`` (MongoDB 7.0+ or 6.0.9+;
    ``consume(..., oversize="split")``) or leave the large fields out with ``$project``.
    """


class StreamInvalidatedError(ConsumeError):
    """The watched collection or database was dropped or renamed (an ``invalidate`` event).

    ``invalidate_token`` starts a new stream after it: ``start_after=error.invalidate_token``.
    """

    def __init__(self, message: str, *, token: Any, invalidate_token: Any) -> None:
        super().__init__(message, token=token)
        self.invalidate_token = invalidate_token


class RetriesExhaustedError(ConsumeError):
    """Transient failures went on for longer than ``retry_for`` seconds."""


class MalformedReplyError(ChangeStreamError):
    """A server reply (or an event in it) has a field of the wrong shape.

    ``field`` names it (``"cursor.nextBatch"``, ``"postBatchResumeToken"``, ...) and
    ``value`` is what arrived. The stream is closed; nothing from the reply was kept.
    """

    def __init__(self, message: str, *, field: str, value: object) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class InvalidResumeTokenError(MalformedReplyError):
    """An event ``_id`` or a ``postBatchResumeToken`` is not a resume token.

    A resume token is a document whose ``_data`` is a string. An invalid one is
    refused when it arrives (never cached), so the stream's :attr:`resume_token`
    stays the last valid one.
    """


_MAX_MESSAGE = 500


def describe_error(exc: BaseException) -> str:
    """One line for people: ``code codeName: errmsg`` for a server error.

    PyMongo's own message appends the whole reply (``full error: {...}``, with
    ``$clusterTime`` and its signature bytes) and server selection errors a
    topology dump; both bury the cause, so they are left out. Other errors are
    ``TypeName: message``.
    """
    if getattr(exc, "_reworded", False):
        return str(exc)  # written for people already (reworded)
    details = getattr(exc, "details", None)
    if isinstance(exc, OperationFailure) or (
        isinstance(details, Mapping) and "errmsg" in details
    ):
        details = details if isinstance(details, Mapping) else {}
        code = details.get("code", getattr(exc, "code", None))
        name = details.get("codeName")
        message = details.get("errmsg") or _cut(str(exc))
        head = " ".join(str(part) for part in (code, name) if part is not None)
        text = f"{head}: {message}" if head else str(message)
    else:
        text = f"{type(exc).__name__}: {_cut(str(exc))}"
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


def one_line(exc: BaseException) -> BaseException:
    """``exc`` itself, or for a PyMongo error a copy whose message is :func:`describe_error`'s.

    Same type, code, labels and ``details``; only ``str()`` changes, so logs
    and Spark's error reports show the cause instead of the reply dump.
    """
    from pymongo.errors import PyMongoError

    if (not isinstance(exc, PyMongoError) or isinstance(exc, ChangeStreamError)
            or getattr(exc, "_reworded", False)):
        return exc  # ours are written for people already
    text = describe_error(exc)
    if str(exc) == text or text.endswith(f": {exc}"):
        return exc  # nothing to cut
    return reworded(exc, text)


def reworded(exc: BaseException, text: str) -> BaseException:
    """A copy of ``exc`` (same type, code, labels, ``details``) whose ``str()`` is ``text``."""
    kind = type(exc)
    clean = kind.__new__(kind)  # not __init__: subclasses differ in their arguments
    clean.__dict__.update(exc.__dict__)
    clean.args = (text,)
    clean._reworded = True  # type: ignore[attr-defined]
    return clean.with_traceback(exc.__traceback__)


def _cut(message: str) -> str:
    for marker in (", full error:", ", Timeout:", ", Topology Description:"):
        message = message.split(marker, 1)[0]
    return re.sub(r" \(configured timeouts: [^)]*\)", "", message)
