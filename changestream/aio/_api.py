"""Entry point of the asyncio streams: :func:`watch` over ``AsyncMongoClient`` targets.

The async twin of :mod:`changestream._sync._api`, written by hand (the sync side also
has the ``Client``/``Database``/``Collection`` wrappers, which asyncio code
does not need). :func:`unwrap` is here so that the generated shells can call
it on both sides under one name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from .._options import ChangeStreamOptions
from ._stream import AsyncChangeStream, TokenCallback, open_stream

if TYPE_CHECKING:
    # The types of the generated option parameters (see tools/gen_watch_signatures.py).
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

    from ..events import ChangeEvent

__all__ = ["unwrap", "watch"]

_D = TypeVar("_D")


def unwrap(target: Any) -> Any:
    """The PyMongo object behind ``target`` (asyncio has no wrappers: ``target`` itself)."""
    return target


# As changestream.watch: the event type follows ``typed`` and ``document_class``.
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *, typed: Literal[True],
    document_class: type[Any] | None = None, on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
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
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[ChangeEvent]: ...
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *,
    typed: Literal[False] = False, document_class: type[_D],
    on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
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
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[_D]: ...
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *,
    typed: Literal[False] = False, document_class: None = None,
    on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
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
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[Mapping[str, Any]]: ...
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *, typed: bool = False,
    document_class: type[Any] | None = None, on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
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
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[Any]: ...
async def watch(
    target: Any,
    pipeline: list[Mapping[str, Any]] | None = None,
    *,
    typed: bool = False,
    document_class: type[Any] | None = None,
    on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
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
    session: AsyncClientSession | None = None,
    # END generated watch options
    **unknown_options: Any,
) -> AsyncChangeStream[Any]:
    """Open a change stream on a PyMongo ``AsyncMongoClient``, ``AsyncDatabase`` or ``AsyncCollection``.

    The options are those of :func:`changestream.watch`; the initial
    ``aggregate`` has run when the returned awaitable completes::

        async with await changestream.aio.watch(coll) as stream:
            async for change in stream:
                ...

    ``on_resume_token_change(token)`` (a function or a coroutine function)
    is called whenever the cached resume token really changes: after the
    initial aggregate, for each returned change (just before it is
    returned) and for each new ``postBatchResumeToken`` of an empty batch,
    even while :meth:`AsyncChangeStream.next` keeps waiting.
    """
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
    return await open_stream(target, options, on_resume_token_change=on_resume_token_change)


