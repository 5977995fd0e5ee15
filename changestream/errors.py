"""Exceptions raised by the change-stream client (besides PyMongo's own errors).

They subclass PyMongo's exceptions so code that already catches
``pymongo.errors.PyMongoError`` around ``watch()`` keeps working unchanged.
"""

from __future__ import annotations

from pymongo.errors import InvalidOperation

__all__ = ["ChangeStreamError", "MissingResumeTokenError", "SplitEventError"]


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
