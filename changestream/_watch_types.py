"""The static types of ``watch()``'s options: the table the signatures are written from.

Every ``watch()`` entry point (:func:`changestream.watch`, ``Client``/
``Database``/``Collection.watch`` and :func:`changestream.aio.watch`, each
``@overload`` included) takes each option as an explicit keyword-only
parameter. Those parameters are not typed by hand: ``tools/gen_watch_signatures.py``
writes them from the ``TypedDict`` s below (names and types) and from the field
defaults of :class:`~changestream._options.ChangeStreamOptions` (the runtime
option table, which still validates every value). ``tests/test_typing.py``
fails when the written signatures or these keys drift from the runtime table.
``typed`` and ``document_class`` are not here: they are written into each
overload by hand because they decide the type of the events.

The ``TypedDict`` s are public for code that forwards options to ``watch()``
(``def my_watch(coll, **options: Unpack[WatchOptions])``). Every option
defaults to "not set" (``None``, ``False`` for ``reassemble_split_events``):
the server's default, or the target's.
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
    version: str | None
    """``$changeStream.version``: the reader version, ``"v1"`` or ``"v2"`` (MongoDB 8.2+)."""
    ignore_removed_shards: bool | None
    """``$changeStream.ignoreRemovedShards`` (MongoDB 9.0+, with ``version="v2"``)."""
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
