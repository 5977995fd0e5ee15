"""Validation of ``watch()`` options and of the watched target.

Option names are PyMongo's (``full_document``, ``max_await_time_ms``, ...).
Only the *types* are checked here, each failure naming its option; values the
server understands (an unknown ``fullDocument`` string, both ``resume_after``
and ``start_after``, a ``$changeStream`` stage inside the pipeline, ...) are
passed through unvalidated so the server reports them, as the change-streams
spec requires. Shared by the sync and the async shells.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import bson
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.asynchronous.mongo_client import AsyncMongoClient
from pymongo.collation import validate_collation_or_none
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import (
    Nearest,
    Primary,
    PrimaryPreferred,
    Secondary,
    SecondaryPreferred,
)
from pymongo.synchronous.client_session import ClientSession
from pymongo.synchronous.collection import Collection
from pymongo.synchronous.database import Database
from pymongo.synchronous.mongo_client import MongoClient

__all__ = [
    "ChangeStreamOptions",
    "Target",
    "check_max_await",
    "effective_codec_options",
    "effective_timeout_ms",
    "event_decoder",
    "reply_codec",
    "resolve_target",
]

_READ_PREFERENCES = (Primary, PrimaryPreferred, Secondary, SecondaryPreferred, Nearest)
_RAW_REPLIES: CodecOptions[Any] = CodecOptions(document_class=RawBSONDocument)


_READER_VERSION = re.compile(r"v[1-9][0-9]*")
"""``$changeStream.version``: mongod's reader versions are ``"v1"`` and ``"v2"`` (8.2+); a later
server may add more, so the client checks the form and leaves the value to the server."""


def _check_reader_version(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"version must be a string such as 'v2', not {type(value).__name__}")
    if _READER_VERSION.fullmatch(value) is None:
        raise ValueError(
            f"version must be a change stream reader version, 'v1' or 'v2' (MongoDB 8.2+), "
            f"not {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class ChangeStreamOptions:
    """The validated options of one ``watch()`` call (``None`` = not set by the caller)."""

    pipeline: tuple[Mapping[str, Any], ...] = ()
    full_document: str | None = None
    full_document_before_change: str | None = None
    resume_after: Mapping[str, Any] | None = None
    start_after: Mapping[str, Any] | None = None
    start_at_operation_time: Timestamp | None = None
    max_await_time_ms: int | None = None
    batch_size: int | None = None
    collation: Mapping[str, Any] | None = None
    comment: Any = None
    show_expanded_events: bool | None = None
    version: str | None = None
    ignore_removed_shards: bool | None = None
    read_preference: Any = None
    read_concern: ReadConcern | None = None
    session: Any = None
    timeout_ms: float | None = None
    codec_options: CodecOptions[Any] | None = None
    document_class: type[Any] | None = None
    typed: bool = False
    reassemble_split_events: bool = False

    @classmethod
    def from_kwargs(cls, pipeline: Any = None, **options: Any) -> ChangeStreamOptions:
        """Validate ``watch(pipeline, **options)`` arguments; raise TypeError/ValueError naming the option."""
        known = {f.name for f in dataclasses.fields(cls)} - {"pipeline"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"watch() got unexpected option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = dict(options)
        values["pipeline"] = _pipeline(pipeline)
        for name in ("full_document", "full_document_before_change"):
            _check(name, values.get(name), (str,), "a string")
            _check_spelling(name, values.get(name))
        for name in ("resume_after", "start_after"):
            _check(name, values.get(name), (Mapping,), "a document (mapping)")
            values[name] = copy.deepcopy(values.get(name))
        _check("start_at_operation_time", values.get("start_at_operation_time"), (Timestamp,),
               "a bson.timestamp.Timestamp")
        for name in ("max_await_time_ms", "batch_size"):
            _non_negative(name, values.get(name), integral=True)
        _non_negative("timeout_ms", values.get("timeout_ms"), integral=False)
        values["collation"] = validate_collation_or_none(values.get("collation"))
        _check("show_expanded_events", values.get("show_expanded_events"), (bool,), "a bool")
        _check("ignore_removed_shards", values.get("ignore_removed_shards"), (bool,), "a bool")
        _check_reader_version(values.get("version"))
        for name in ("typed", "reassemble_split_events"):
            if not isinstance(values.get(name, False), bool):
                raise TypeError(f"{name} must be a bool, not {type(values[name]).__name__}")
        _check("read_preference", values.get("read_preference"), _READ_PREFERENCES,
               "a pymongo read preference (e.g. ReadPreference.SECONDARY)")
        _check("read_concern", values.get("read_concern"), (ReadConcern,),
               "a pymongo.read_concern.ReadConcern")
        _check("session", values.get("session"), (ClientSession, AsyncClientSession),
               "a pymongo ClientSession")
        _check("codec_options", values.get("codec_options"), (CodecOptions,),
               "a bson.codec_options.CodecOptions")
        document_class = values.get("document_class")
        if document_class is not None and not isinstance(document_class, type):
            raise TypeError(f"document_class must be a class, not {document_class!r}")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Target:
    """What a stream watches and the defaults it inherits from the PyMongo object."""

    client: Any
    """The PyMongo ``MongoClient`` (or ``AsyncMongoClient``) that runs the commands."""
    database: str
    """The database the aggregate runs on (``admin`` for a cluster stream)."""
    collection: str | None
    """The collection name; ``None`` for database and cluster streams."""
    cluster: bool
    read_preference: Any
    read_concern: ReadConcern
    codec_options: CodecOptions[Any]


_CHOICES: dict[str, tuple[str, ...]] = {
    "full_document": ("default", "updateLookup", "whenAvailable", "required"),
    "full_document_before_change": ("off", "whenAvailable", "required"),
}
"""The values the server takes (names are case-sensitive there)."""


def _check_spelling(name: str, value: str | None) -> None:
    """A known value in the wrong case is one clear error here, not the server's BadValue.
    Values this list does not know go to the server, which may be newer."""
    if value is None or value in _CHOICES[name]:
        return
    for choice in _CHOICES[name]:
        if value.lower() == choice.lower():
            raise ValueError(f"{name}={value!r}: the server's values are case-sensitive; did "
                             f"you mean {choice!r}? ({', '.join(map(repr, _CHOICES[name]))})")


def resolve_target(target: Any) -> Target:
    """Describe a PyMongo client, database or collection (sync or async) as a :class:`Target`."""
    if isinstance(target, (Collection, AsyncCollection)):
        return Target(target.database.client, target.database.name, target.name, False,
                      target.read_preference, target.read_concern, target.codec_options)
    if isinstance(target, (Database, AsyncDatabase)):
        return Target(target.client, target.name, None, False,
                      target.read_preference, target.read_concern, target.codec_options)
    if isinstance(target, (MongoClient, AsyncMongoClient)):
        return Target(target, "admin", None, True,
                      target.read_preference, target.read_concern, target.codec_options)
    raise TypeError(
        "watch() target must be a pymongo MongoClient, Database or Collection, "
        f"not {type(target).__name__}"
    )


def effective_timeout_ms(options: ChangeStreamOptions, client: Any) -> float | None:
    """``timeout_ms`` if given, else the client's ``timeoutMS`` (``None`` = no CSOT)."""
    if options.timeout_ms is not None:
        return options.timeout_ms
    seconds = client.options.timeout
    return None if seconds is None else seconds * 1000


def check_max_await(options: ChangeStreamOptions, timeout_ms: float | None) -> None:
    """CSOT spec: ``maxAwaitTimeMS`` must be below a non-zero ``timeoutMS``."""
    max_await = options.max_await_time_ms
    if max_await is not None and timeout_ms and max_await >= timeout_ms:
        raise ValueError(
            f"max_await_time_ms ({max_await}) must be less than timeout_ms ({timeout_ms:g}); "
            "a getMore could otherwise never return before the client-side timeout"
        )


def effective_codec_options(options: ChangeStreamOptions, target: Target) -> CodecOptions[Any]:
    """``codec_options`` (default: the target's) with ``document_class`` applied."""
    codec = options.codec_options or target.codec_options
    if options.document_class is not None:
        codec = codec.with_options(document_class=options.document_class)
    return codec


def reply_codec(codec: CodecOptions[Any], typed: bool = False) -> CodecOptions[Any]:
    """The codec the transport decodes replies with, chosen so each event is decoded only once.

    A ``RawBSONDocument`` class gets its own codec: the reply is split into
    raw events in C and the bytes are kept. Every other stream gets
    ``RawBSONDocument`` replies and :func:`event_decoder` decodes each event
    with the user's codec when it is delivered (typed: when a field is first
    read). Decoding a whole batch to dicts up front costs more than decoding
    event by event: the batch's ~15 containers per event are all alive at the
    next garbage collection, which then traverses every one of them (5-7 µs per
    event on the canned benchmark, more than PyMongo's whole per-event
    overhead); an event decoded on delivery is usually dropped before that.
    """
    if issubclass(codec.document_class, RawBSONDocument):
        return codec
    return _RAW_REPLIES


def event_decoder(
    codec: CodecOptions[Any], typed: bool, wire: CodecOptions[Any] | None = None
) -> Callable[[Mapping[str, Any]], Any] | None:
    """How an event, as the transport decoded it with ``wire``, reaches the user.

    ``wire`` is :func:`reply_codec` of ``codec``, or ``None`` for
    ``RawBSONDocument`` replies. Events are decoded with the user's codec
    options (document class, type registry, tz, UUID representation) unless
    the transport already did so; merged split events (plain dicts) are
    converted. With ``typed=True`` each event becomes a lazy typed event of a
    :class:`changestream.events.EventParser` of the stream: decoded with the
    user's codec when a field is first read. ``None``: deliver events as received.
    """
    document_class = codec.document_class
    if typed:
        parse = importlib.import_module("changestream.events").EventParser(codec).parse

        def typed_event(event: Mapping[str, Any]) -> Any:
            if not isinstance(event, RawBSONDocument):  # a merged split event
                event = RawBSONDocument(bson.encode(event))
            return parse(event)

        return typed_event
    decoded_by_transport = wire is codec
    if not issubclass(document_class, RawBSONDocument):
        # bson.decode checks its codec on every call; this one is checked: decode with
        # the function it calls (one Python call less per event), where bson has it
        decode_bytes = getattr(bson, "_bson_to_dict", bson.decode)

        def decode(event: Mapping[str, Any]) -> Any:
            # each event as the transport delivers it (the exact type first: no ABC check)
            if type(event) is RawBSONDocument or isinstance(event, RawBSONDocument):
                return decode_bytes(event.raw, codec)
            return decode_bytes(bson.encode(event), codec)  # a merged split event

        return decode

    def decode_raw(event: Mapping[str, Any]) -> Any:
        if decoded_by_transport and type(event) is document_class:
            return event
        data = event.raw if isinstance(event, RawBSONDocument) else bson.encode(event)
        return document_class(data, codec)

    return decode_raw


def _pipeline(pipeline: Any) -> tuple[Mapping[str, Any], ...]:
    if pipeline is None:
        return ()
    if not isinstance(pipeline, list):
        raise TypeError(f"pipeline must be a list of stages, not {type(pipeline).__name__}")
    for index, stage in enumerate(pipeline):
        if not isinstance(stage, Mapping):
            raise TypeError(f"pipeline stage {index} must be a document, not {type(stage).__name__}")
    return tuple(copy.deepcopy(pipeline))


def _check(name: str, value: Any, types: tuple[type[Any], ...], what: str) -> None:
    if value is not None and not isinstance(value, types):
        raise TypeError(f"{name} must be {what} or None, not {type(value).__name__}")


_INT32_MAX = 2**31 - 1
"""The largest ``maxTimeMS`` / ``batchSize`` a server accepts."""


def _non_negative(name: str, value: Any, *, integral: bool) -> None:
    if value is None:
        return
    kinds: tuple[type[Any], ...] = (int,) if integral else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = "an integer" if integral else "a number"
        raise TypeError(f"{name} must be {what} or None, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, not {value}")
    if value > _INT32_MAX:
        raise ValueError(
            f"{name} must be at most {_INT32_MAX} (the server's limit, about 24.8 days in ms), "
            f"not {value:g}"
        )
