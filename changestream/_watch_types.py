"""The static types of ``watch()``'s options, for editors and type checkers (no runtime effect).

``**options: Unpack[WatchOptions]`` lets an editor complete every option name
and a type checker check its value, while ``watch()`` itself still validates at
run time (:class:`~changestream._options.ChangeStreamOptions`, whose fields a
test keeps equal to these keys). ``typed`` and ``document_class`` are explicit
parameters of ``watch()`` because they decide the type of the events; every
option here defaults to "not set" (the server's or the target's default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from bson.codec_options import CodecOptions
    from bson.timestamp import Timestamp
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.collation import Collation
    from pymongo.read_concern import ReadConcern
    from pymongo.read_preferences import (
        Nearest,
        Primary,
        PrimaryPreferred,
        Secondary,
        SecondaryPreferred,
    )
    from pymongo.synchronous.client_session import ClientSession

__all__ = ["AsyncWatchOptions", "WatchOptions"]


class _CommonOptions(TypedDict, total=False):
    full_document: str | None
    """``fullDocument``: ``"updateLookup"``, ``"whenAvailable"``, ``"required"``, ``"default"``."""
    full_document_before_change: str | None
    """``fullDocumentBeforeChange``: ``"whenAvailable"``, ``"required"``, ``"off"``."""
    resume_after: Mapping[str, Any] | None
    start_after: Mapping[str, Any] | None
    start_at_operation_time: Timestamp | None
    max_await_time_ms: int | None
    batch_size: int | None
    collation: Mapping[str, Any] | Collation | None
    comment: Any
    show_expanded_events: bool | None
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None
    read_concern: ReadConcern | None
    timeout_ms: float | None
    codec_options: CodecOptions[Any] | None
    reassemble_split_events: bool


class WatchOptions(_CommonOptions, total=False):
    """The keyword options of :func:`changestream.watch` besides ``typed`` and ``document_class``."""

    session: ClientSession | None


class AsyncWatchOptions(_CommonOptions, total=False):
    """The keyword options of :func:`changestream.aio.watch` besides ``typed``, ``document_class``
    and ``on_resume_token_change``."""

    session: AsyncClientSession | None
