"""Sync entry points: :func:`watch` and thin ``Client``/``Database``/``Collection`` wrappers.

Prefer these helpers over running a raw ``aggregate`` with a ``$changeStream``
stage: only the helpers track resume tokens and resume automatically.
Written by hand, beside its async twin :mod:`changestream.aio._api` (the sync
side also has the wrappers).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload

from pymongo.synchronous.collection import Collection as PyMongoCollection
from pymongo.synchronous.database import Database as PyMongoDatabase
from pymongo.synchronous.mongo_client import MongoClient

from .._options import ChangeStreamOptions
from ._stream import ChangeStream, open_stream

if TYPE_CHECKING:
    # The types of the generated option parameters (see tools/gen_watch_signatures.py).
    from bson.codec_options import CodecOptions
    from bson.timestamp import Timestamp
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

    from ..events import ChangeEvent

__all__ = ["Client", "Collection", "Database", "unwrap", "watch"]

_D = TypeVar("_D")
Pipeline = list[Mapping[str, Any]]


# The event type follows ``typed`` and ``document_class``: typed events, the given class,
# else mappings (the target's document class). Only the types differ between overloads.
@overload
def watch(
    target: Any, pipeline: Pipeline | None = None, *, typed: Literal[True],
    document_class: type[Any] | None = None,
    # BEGIN generated watch options: params sync
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    version: str | None = None,
    ignore_removed_shards: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: ClientSession | None = None,
    # END generated watch options
) -> ChangeStream[ChangeEvent]: ...
@overload
def watch(
    target: Any, pipeline: Pipeline | None = None, *, typed: Literal[False] = False,
    document_class: type[_D],
    # BEGIN generated watch options: params sync
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    version: str | None = None,
    ignore_removed_shards: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: ClientSession | None = None,
    # END generated watch options
) -> ChangeStream[_D]: ...
@overload
def watch(
    target: Any, pipeline: Pipeline | None = None, *, typed: Literal[False] = False,
    document_class: None = None,
    # BEGIN generated watch options: params sync
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    version: str | None = None,
    ignore_removed_shards: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: ClientSession | None = None,
    # END generated watch options
) -> ChangeStream[Mapping[str, Any]]: ...
@overload
def watch(
    target: Any, pipeline: Pipeline | None = None, *, typed: bool = False,
    document_class: type[Any] | None = None,
    # BEGIN generated watch options: params sync
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    version: str | None = None,
    ignore_removed_shards: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: ClientSession | None = None,
    # END generated watch options
) -> ChangeStream[Any]: ...
def watch(
    target: Any,
    pipeline: Pipeline | None = None,
    *,
    typed: bool = False,
    document_class: type[Any] | None = None,
    # BEGIN generated watch options: params sync
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    version: str | None = None,
    ignore_removed_shards: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: ClientSession | None = None,
    # END generated watch options
    **unknown_options: Any,
) -> ChangeStream[Any]:
    """Open a change stream on a PyMongo ``MongoClient``, ``Database`` or ``Collection``.

    ``pipeline`` stages are appended after ``$changeStream``. Options use
    PyMongo's ``watch()`` names (``full_document``, ``resume_after``,
    ``start_after``, ``start_at_operation_time``, ``max_await_time_ms``,
    ``batch_size``, ``collation``, ``comment``, ``full_document_before_change``,
    ``show_expanded_events``, ``session``) plus ``read_preference``,
    ``read_concern``, ``timeout_ms``, ``codec_options``, ``document_class``,
    ``typed`` (return :mod:`changestream.events` objects) and
    ``reassemble_split_events`` (merge ``$changeStreamSplitLargeEvent``
    fragments; the stage is appended when the pipeline lacks it, and a server
    without it, before 7.0 and 6.0.9, refuses with :class:`~changestream.errors.SplitEventError`). Change streams require read concern "majority" or none (the
    server rejects others). The initial ``aggregate`` runs before this returns.
    """
    target = unwrap(target)
    options = ChangeStreamOptions.from_kwargs(
        pipeline,
        typed=typed,
        document_class=document_class,
        # BEGIN generated watch options: arguments
        full_document=full_document,
        full_document_before_change=full_document_before_change,
        resume_after=resume_after,
        start_after=start_after,
        start_at_operation_time=start_at_operation_time,
        max_await_time_ms=max_await_time_ms,
        batch_size=batch_size,
        collation=collation,
        comment=comment,
        show_expanded_events=show_expanded_events,
        version=version,
        ignore_removed_shards=ignore_removed_shards,
        read_preference=read_preference,
        read_concern=read_concern,
        timeout_ms=timeout_ms,
        codec_options=codec_options,
        reassemble_split_events=reassemble_split_events,
        session=session,
        # END generated watch options
        **unknown_options,  # unknown names: from_kwargs raises, listing the valid ones
    )
    return open_stream(target, options)


def unwrap(target: Any) -> Any:
    """The PyMongo object behind a ``Client``/``Database``/``Collection`` wrapper, else ``target``."""
    if isinstance(target, (Client, Database, Collection)):
        return target.pymongo
    return target


class _BoundWatch(Protocol):
    """The type of ``Client.watch``, ``Database.watch`` and ``Collection.watch``: :func:`watch`
    with its target bound (same overloads)."""

    @overload
    def __call__(
        self, pipeline: Pipeline | None = None, *, typed: Literal[True],
        document_class: type[Any] | None = None,
        # BEGIN generated watch options: params sync
        full_document: str | None = None,
        full_document_before_change: str | None = None,
        resume_after: Mapping[str, Any] | None = None,
        start_after: Mapping[str, Any] | None = None,
        start_at_operation_time: Timestamp | None = None,
        max_await_time_ms: int | None = None,
        batch_size: int | None = None,
        collation: Mapping[str, Any] | Collation | None = None,
        comment: Any = None,
        show_expanded_events: bool | None = None,
        version: str | None = None,
        ignore_removed_shards: bool | None = None,
        read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
        read_concern: ReadConcern | None = None,
        timeout_ms: float | None = None,
        codec_options: CodecOptions[Any] | None = None,
        reassemble_split_events: bool = False,
        session: ClientSession | None = None,
        # END generated watch options
    ) -> ChangeStream[ChangeEvent]: ...
    @overload
    def __call__(
        self, pipeline: Pipeline | None = None, *, typed: Literal[False] = False,
        document_class: type[_D],
        # BEGIN generated watch options: params sync
        full_document: str | None = None,
        full_document_before_change: str | None = None,
        resume_after: Mapping[str, Any] | None = None,
        start_after: Mapping[str, Any] | None = None,
        start_at_operation_time: Timestamp | None = None,
        max_await_time_ms: int | None = None,
        batch_size: int | None = None,
        collation: Mapping[str, Any] | Collation | None = None,
        comment: Any = None,
        show_expanded_events: bool | None = None,
        version: str | None = None,
        ignore_removed_shards: bool | None = None,
        read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
        read_concern: ReadConcern | None = None,
        timeout_ms: float | None = None,
        codec_options: CodecOptions[Any] | None = None,
        reassemble_split_events: bool = False,
        session: ClientSession | None = None,
        # END generated watch options
    ) -> ChangeStream[_D]: ...
    @overload
    def __call__(
        self, pipeline: Pipeline | None = None, *, typed: Literal[False] = False,
        document_class: None = None,
        # BEGIN generated watch options: params sync
        full_document: str | None = None,
        full_document_before_change: str | None = None,
        resume_after: Mapping[str, Any] | None = None,
        start_after: Mapping[str, Any] | None = None,
        start_at_operation_time: Timestamp | None = None,
        max_await_time_ms: int | None = None,
        batch_size: int | None = None,
        collation: Mapping[str, Any] | Collation | None = None,
        comment: Any = None,
        show_expanded_events: bool | None = None,
        version: str | None = None,
        ignore_removed_shards: bool | None = None,
        read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
        read_concern: ReadConcern | None = None,
        timeout_ms: float | None = None,
        codec_options: CodecOptions[Any] | None = None,
        reassemble_split_events: bool = False,
        session: ClientSession | None = None,
        # END generated watch options
    ) -> ChangeStream[Mapping[str, Any]]: ...
    @overload
    def __call__(
        self, pipeline: Pipeline | None = None, *, typed: bool = False,
        document_class: type[Any] | None = None,
        # BEGIN generated watch options: params sync
        full_document: str | None = None,
        full_document_before_change: str | None = None,
        resume_after: Mapping[str, Any] | None = None,
        start_after: Mapping[str, Any] | None = None,
        start_at_operation_time: Timestamp | None = None,
        max_await_time_ms: int | None = None,
        batch_size: int | None = None,
        collation: Mapping[str, Any] | Collation | None = None,
        comment: Any = None,
        show_expanded_events: bool | None = None,
        version: str | None = None,
        ignore_removed_shards: bool | None = None,
        read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
        read_concern: ReadConcern | None = None,
        timeout_ms: float | None = None,
        codec_options: CodecOptions[Any] | None = None,
        reassemble_split_events: bool = False,
        session: ClientSession | None = None,
        # END generated watch options
    ) -> ChangeStream[Any]: ...


class Collection:
    """A PyMongo collection whose ``watch()`` returns a :class:`ChangeStream`."""

    def __init__(self, collection: PyMongoCollection[Any]) -> None:
        if not isinstance(collection, PyMongoCollection):
            raise TypeError(f"expected a pymongo Collection, not {type(collection).__name__}")
        self._collection = collection

    @property
    def pymongo(self) -> PyMongoCollection[Any]:
        """The underlying PyMongo collection."""
        return self._collection

    @property
    def name(self) -> str:
        return self._collection.name

    if TYPE_CHECKING:
        watch: _BoundWatch  # :func:`watch`'s overloads, target bound
    else:

        def watch(self, pipeline=None, **options):
            """Watch this collection (see :func:`watch`)."""
            return watch(self._collection, pipeline, **options)

    def __repr__(self) -> str:
        return f"changestream.Collection({self._collection.full_name!r})"


class Database:
    """A PyMongo database whose ``watch()`` returns a :class:`ChangeStream`."""

    def __init__(self, database: PyMongoDatabase[Any]) -> None:
        if not isinstance(database, PyMongoDatabase):
            raise TypeError(f"expected a pymongo Database, not {type(database).__name__}")
        self._database = database

    @property
    def pymongo(self) -> PyMongoDatabase[Any]:
        """The underlying PyMongo database."""
        return self._database

    @property
    def name(self) -> str:
        return self._database.name

    def __getitem__(self, name: str) -> Collection:
        return Collection(self._database[name])

    def __getattr__(self, name: str) -> Collection:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    if TYPE_CHECKING:
        watch: _BoundWatch  # :func:`watch`'s overloads, target bound
    else:

        def watch(self, pipeline=None, **options):
            """Watch every collection of this database (see :func:`watch`)."""
            return watch(self._database, pipeline, **options)

    def __repr__(self) -> str:
        return f"changestream.Database({self._database.name!r})"


class Client:
    """A PyMongo client (given, or created from a URI) whose ``watch()`` covers the cluster."""

    def __init__(self, client: MongoClient[Any] | str | None = None, **client_kwargs: Any) -> None:
        if isinstance(client, MongoClient):
            if client_kwargs:
                raise TypeError("client keyword arguments need a URI, not a MongoClient")
            self._client: MongoClient[Any] = client
            self._owned = False
        else:
            self._client = MongoClient(client, **client_kwargs)
            self._owned = True

    @property
    def pymongo(self) -> MongoClient[Any]:
        """The underlying PyMongo client."""
        return self._client

    def __getitem__(self, name: str) -> Database:
        return Database(self._client[name])

    def __getattr__(self, name: str) -> Database:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    if TYPE_CHECKING:
        watch: _BoundWatch  # :func:`watch`'s overloads, target bound
    else:

        def watch(self, pipeline=None, **options):
            """Watch every database of the cluster (see :func:`watch`)."""
            return watch(self._client, pipeline, **options)

    def close(self) -> None:
        """Close the PyMongo client if this wrapper created it."""
        if self._owned:
            self._client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"changestream.Client({self._client!r})"


if not TYPE_CHECKING:
    # ``inspect.signature(Client.watch)`` (editors, help(), the API reference) shows the option
    # parameters of :func:`watch` itself: the methods only bind the target and forward.
    def _bound_signature() -> inspect.Signature:
        signature = inspect.signature(watch)
        self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return signature.replace(parameters=[self, *list(signature.parameters.values())[1:]])

    for _wrapper in (Client, Database, Collection):
        _wrapper.watch.__signature__ = _bound_signature()
    del _wrapper
