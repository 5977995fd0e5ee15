"""Static checks of the public API's types: mypy --strict must pass on this file.

Not a test module (pytest does not collect it); ``tests/test_typing.py`` runs
mypy on it. ``assert_type`` fails the check when an inferred type differs;
each ``type: ignore[...]`` marks a call that must be rejected (``--strict``
includes ``--warn-unused-ignores``, so an accepted call fails the check too).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient, MongoClient, ReadPreference
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.read_concern import ReadConcern
from pymongo.synchronous.client_session import ClientSession
from typing_extensions import assert_type

import changestream
import changestream.aio
from changestream import ChangeStream, ConsumeStats, Position
from changestream.aio import AsyncChangeStream
from changestream.events import ChangeEvent


def sync_api(client: MongoClient[dict[str, Any]], flag: bool) -> None:
    coll = client.db.coll
    assert_type(changestream.watch(coll), ChangeStream[Mapping[str, Any]])
    assert_type(changestream.watch(coll, typed=True), ChangeStream[ChangeEvent])
    assert_type(
        changestream.watch(coll, document_class=RawBSONDocument), ChangeStream[RawBSONDocument]
    )
    assert_type(changestream.watch(coll, document_class=SON), ChangeStream[SON[Any, Any]])
    assert_type(changestream.watch(coll, typed=flag), ChangeStream[Any])
    assert_type(
        changestream.watch(
            coll,
            [{"$match": {"operationType": "insert"}}],
            full_document="updateLookup",
            start_at_operation_time=Timestamp(0, 0),
            batch_size=100,
            max_await_time_ms=500,
            show_expanded_events=True,
            timeout_ms=2000.0,
        ),
        ChangeStream[Mapping[str, Any]],
    )
    wrapped = changestream.Client(client)
    assert_type(wrapped.watch(typed=True), ChangeStream[ChangeEvent])
    assert_type(wrapped["db"].watch(), ChangeStream[Mapping[str, Any]])
    assert_type(
        wrapped["db"]["coll"].watch(document_class=RawBSONDocument), ChangeStream[RawBSONDocument]
    )

    with changestream.watch(coll, typed=True) as stream:
        for event in stream:
            assert_type(event, ChangeEvent)
        assert_type(stream.try_next(), ChangeEvent | None)
        assert_type(stream.lag, timedelta | None)
        assert_type(stream.position, Position)
        assert_type(stream.position.token_time, Timestamp | None)
        assert_type(stream.resumes, int)

    # Misspelt options and wrong value types are caught before run time.
    changestream.watch(coll, fullDocument="updateLookup")  # type: ignore[call-overload]
    changestream.watch(coll, batch_size="100")  # type: ignore[call-overload]
    changestream.watch(coll, typed="yes")  # type: ignore[call-overload]
    wrapped.watch(resume_after=42)  # type: ignore[call-overload]
    wrapped["db"]["coll"].watch(full_document_before_changes="required")  # type: ignore[call-overload]
    wrapped["db"].watch(start_at_operation_time=1700000000)  # type: ignore[call-overload]
    changestream.watch(coll, read_preference="secondary")  # type: ignore[call-overload]
    changestream.watch(coll, max_await_time_ms=0.5)  # type: ignore[call-overload]
    changestream.watch(coll, document_class=RawBSONDocument(b"\x05\x00\x00\x00\x00"))  # type: ignore[call-overload]


def sync_options_have_their_types(client: MongoClient[dict[str, Any]]) -> None:
    coll = client.db.coll
    with client.start_session() as session:
        assert_type(
            changestream.watch(
                coll,
                full_document_before_change="whenAvailable",
                resume_after={"_data": "82"},
                collation={"locale": "fr"},
                comment={"job": "etl"},
                read_preference=ReadPreference.SECONDARY,
                read_concern=ReadConcern("majority"),
                codec_options=CodecOptions(tz_aware=True),
                reassemble_split_events=True,
                session=session,
            ),
            ChangeStream[Mapping[str, Any]],
        )


async def async_api(client: AsyncMongoClient[dict[str, Any]]) -> None:
    coll = client.db.coll
    assert_type(await changestream.aio.watch(coll), AsyncChangeStream[Mapping[str, Any]])
    stream = await changestream.aio.watch(coll, typed=True, on_resume_token_change=print)
    assert_type(stream, AsyncChangeStream[ChangeEvent])
    async for event in stream:
        assert_type(event, ChangeEvent)
    assert_type(
        await changestream.aio.watch(coll, document_class=RawBSONDocument, batch_size=10),
        AsyncChangeStream[RawBSONDocument],
    )
    assert_type(stream.lag, timedelta | None)
    await changestream.aio.watch(coll, max_await_ms=5)  # type: ignore[call-overload]
    await changestream.aio.watch(coll, batch_size="10")  # type: ignore[call-overload]
    await changestream.aio.watch(coll, timeout_ms="1s")  # type: ignore[call-overload]


async def sessions(
    client: AsyncMongoClient[dict[str, Any]],
    sync_client: MongoClient[dict[str, Any]],
    async_session: AsyncClientSession,
    sync_session: ClientSession,
) -> None:
    # The async watch takes the async session; a sync one is rejected (and vice versa).
    assert_type(
        await changestream.aio.watch(client.db.coll, typed=True, session=async_session),
        AsyncChangeStream[ChangeEvent],
    )
    assert_type(
        changestream.watch(sync_client.db.coll, session=sync_session),
        ChangeStream[Mapping[str, Any]],
    )
    await changestream.aio.watch(client.db.coll, session=sync_session)  # type: ignore[call-overload]
    changestream.watch(sync_client.db.coll, session=async_session)  # type: ignore[call-overload]


def stats_callback(stats: ConsumeStats) -> None:
    assert_type(stats.lag, timedelta | None)
    assert_type(stats.events_per_second, float)
