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

from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient, MongoClient
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


def stats_callback(stats: ConsumeStats) -> None:
    assert_type(stats.lag, timedelta | None)
    assert_type(stats.events_per_second, float)
