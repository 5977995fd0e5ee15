"""Options of the ``changestream`` Spark data source: parsed once, validated, picklable.

Spark hands options over as case-insensitive strings; everything is checked
here, on the driver, so a typo fails the query at start with a message
naming the option instead of surfacing later inside an executor.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from bson import json_util
from bson.timestamp import Timestamp
from pymongo import MongoClient

from .. import token_from_json

__all__ = [
    "MONGO_SPARK_ALIASES",
    "MONGO_SPARK_UNSUPPORTED",
    "SESSION_PREFIX",
    "STARTUP_MODES",
    "SourceConfig",
    "session_settings",
    "splits_events",
]

STARTUP_MODES = ("latest", "timestamp", "token", "snapshot")

MONGO_SPARK_ALIASES: dict[str, str] = {
    "connection.uri": "uri",
    "aggregation.pipeline": "pipeline",
    "change.stream.lookup.full.document": "full_document",
    "change.stream.lookup.full.document.before.change": "full_document_before_change",
    "change.stream.publish.full.document.only": "publish_full_document_only",
    "change.stream.startup.mode": "startup_mode",
    "change.stream.startup.mode.timestamp.start.at.operation.time": "start_at_operation_time",
    "change.stream.micro.batch.max.rows": "max_rows_per_batch",
    "samplesize": "infer_schema_sample_size",
}
"""The MongoDB Spark connector's streaming option names (lower case) -> ours (docs/spark.md)."""

MONGO_SPARK_UNSUPPORTED: dict[str, str] = {
    "comment": "not supported by this source",
    "mongoclientfactory": "pass client options in the connection string ('uri')",
    "change.stream.micro.batch.max.partition.count": (
        "not needed: every batch is split into partitions of equal size, in order"
    ),
    "change.stream.micro.batch.max.rows.offset.collection": (
        "not needed: max_rows_per_batch needs no side collection here"
    ),
    "outputextendedjson": "BSON in STRING columns is always relaxed Extended JSON",
    "mode": "rows that do not fit full_document_schema always fail the batch (FAILFAST)",
    "columnnameofcorruptrecord": "rows that do not fit full_document_schema always fail",
    "schemahints": "pass the whole schema as full_document_schema",
    "aggregation.allowdiskuse": "not used by change streams",
}
"""Connector options without an equivalent here: refused, with what to do instead."""

SESSION_PREFIX = "spark.mongodb.read."
"""Session-wide settings with this prefix are read as defaults of every query's options."""
_SPARK_CONF_PREFIXES = (SESSION_PREFIX, "spark.mongodb.")

_SPLIT_STAGE = "$changeStreamSplitLargeEvent"


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """Validated data-source options (see ``docs/spark.md`` for the table)."""

    uri: str
    database: str | None = None
    collection: str | None = None
    pipeline: tuple[dict[str, Any], ...] = ()
    full_document: str | None = None
    full_document_before_change: str | None = None
    show_expanded_events: bool = False
    startup_mode: str = "latest"
    start_at_operation_time: Timestamp | None = None
    start_after: dict[str, Any] | None = None
    max_rows_per_batch: int | None = None
    full_document_schema: str | None = None
    infer_schema: bool = False
    infer_schema_sample_size: int = 1000
    namespaces: tuple[tuple[str, str | None], ...] = ()
    publish_full_document_only: bool = False
    batch_size: int = 10_000
    max_await_time_ms: int = 200
    max_scan_ms: int = 2_000
    idle_advance_seconds: float = 60.0
    arrow_batch_rows: int = 10_000
    prefetch_rows: int = 50_000
    prefetch_mb: int = 64
    snapshot_partitions: int = 4
    """``_id`` ranges a copy is split into (read in parallel by the executors)."""
    snapshot_ranges_per_batch: int | None = None
    """Ranges per micro-batch during ``startup_mode=snapshot`` (None: all in the first batch)."""
    at_cluster_time: Timestamp | None = None
    """Batch read: the cluster time to read at (None: the server picks one, reported in
    the rows' ``cluster_time``)."""

    @classmethod
    def from_options(
        cls, options: Mapping[str, str], session: Mapping[str, str] | None = None
    ) -> SourceConfig:
        """Parse Spark's string options (keys case-insensitive); raise ValueError naming the option.

        ``session`` holds the session-wide ``spark.mongodb.read.*`` settings
        (:func:`session_settings`): defaults that a query's own option of the
        same meaning overrides, as the MongoDB Spark connector reads them.
        """
        known = {field.name for field in dataclasses.fields(cls)}
        opts = {
            **_canonical(dict(session or {}), known, strict=False),
            **_canonical({key.lower(): value for key, value in options.items()}, known),
        }
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(_unknown_message(unknown, known))
        if not opts.get("uri"):
            raise ValueError("option 'uri' is required (a mongodb:// connection string)")
        if opts.get("collection") and not opts.get("database"):
            raise ValueError("option 'collection' needs option 'database'")
        mode = opts.get("startup_mode", "latest").lower()
        if mode not in STARTUP_MODES:
            raise ValueError(
                f"startup_mode must be one of {', '.join(STARTUP_MODES)}, not {mode!r}"
            )
        start_time = (
            _timestamp(opts["start_at_operation_time"])
            if "start_at_operation_time" in opts
            else None
        )
        start_after = _token("start_after", opts["start_after"]) if "start_after" in opts else None
        if mode == "timestamp" and start_time is None:
            raise ValueError("startup_mode=timestamp needs option 'start_at_operation_time'")
        if mode == "token" and start_after is None:
            raise ValueError("startup_mode=token needs option 'start_after' (a resume token JSON)")
        if mode != "timestamp" and start_time is not None:
            raise ValueError("option 'start_at_operation_time' needs startup_mode=timestamp")
        if mode != "token" and start_after is not None:
            raise ValueError("option 'start_after' needs startup_mode=token")
        if mode == "snapshot" and not (opts.get("database") and opts.get("collection")):
            raise ValueError(
                "startup_mode=snapshot copies one collection: options 'database' and "
                "'collection' are required"
            )
        namespaces = _namespaces(opts.get("namespaces"), opts.get("database"))
        if namespaces and opts.get("collection"):
            raise ValueError(
                "option 'namespaces' filters a database- or cluster-level source; with "
                "'collection' set there is only one namespace"
            )
        infer = _bool("infer_schema", opts.get("infer_schema"))
        if infer and not (opts.get("database") and opts.get("collection")):
            raise ValueError(
                "infer_schema=true samples one collection: set options 'database' and "
                "'collection' (or pass full_document_schema)"
            )
        publish = _bool("publish_full_document_only", opts.get("publish_full_document_only"))
        full_document = opts.get("full_document")
        if publish and full_document is None:
            full_document = "updateLookup"  # updates carry no document otherwise
        return cls(
            uri=opts["uri"],
            database=opts.get("database") or None,
            collection=opts.get("collection") or None,
            pipeline=_namespace_filter(namespaces) + _pipeline(opts.get("pipeline")),
            full_document=full_document,
            full_document_before_change=opts.get("full_document_before_change"),
            show_expanded_events=_bool("show_expanded_events", opts.get("show_expanded_events")),
            startup_mode=mode,
            start_at_operation_time=start_time,
            start_after=start_after,
            max_rows_per_batch=_int("max_rows_per_batch", opts.get("max_rows_per_batch"), 1, None),
            full_document_schema=opts.get("full_document_schema") or None,
            infer_schema=infer,
            infer_schema_sample_size=_int(
                "infer_schema_sample_size", opts.get("infer_schema_sample_size"), 1,
                cls.infer_schema_sample_size,
            ),
            namespaces=namespaces,
            publish_full_document_only=publish,
            batch_size=_int("batch_size", opts.get("batch_size"), 1, cls.batch_size),
            max_await_time_ms=_int(
                "max_await_time_ms", opts.get("max_await_time_ms"), 1, cls.max_await_time_ms
            ),
            max_scan_ms=_int("max_scan_ms", opts.get("max_scan_ms"), 1, cls.max_scan_ms),
            idle_advance_seconds=_float(
                "idle_advance_seconds", opts.get("idle_advance_seconds"), cls.idle_advance_seconds
            ),
            arrow_batch_rows=_int(
                "arrow_batch_rows", opts.get("arrow_batch_rows"), 1, cls.arrow_batch_rows
            ),
            prefetch_rows=_int("prefetch_rows", opts.get("prefetch_rows"), 1, cls.prefetch_rows),
            prefetch_mb=_int("prefetch_mb", opts.get("prefetch_mb"), 1, cls.prefetch_mb),
            snapshot_partitions=_int(
                "snapshot_partitions", opts.get("snapshot_partitions"), 1, cls.snapshot_partitions
            ),
            snapshot_ranges_per_batch=_int(
                "snapshot_ranges_per_batch", opts.get("snapshot_ranges_per_batch"), 1, None
            ),
            at_cluster_time=(
                _timestamp(opts["at_cluster_time"], "at_cluster_time") if "at_cluster_time" in opts else None
            ),
        )

    def connect(self) -> MongoClient[dict[str, Any]]:
        """A new client (never shared across processes)."""
        return MongoClient(self.uri)

    def target(self, client: MongoClient[dict[str, Any]]) -> Any:
        """What to watch: a collection, a database, or (no database) the whole cluster."""
        if self.database is None:
            return client
        database = client[self.database]
        return database if self.collection is None else database[self.collection]

    def watch_options(self, *, with_lookups: bool = True) -> dict[str, Any]:
        """``watch()`` keywords shared by every stream of the query (the start comes separately)."""
        options: dict[str, Any] = {
            "batch_size": self.batch_size,
            "max_await_time_ms": self.max_await_time_ms,
        }
        if splits_events(self.pipeline):
            options["reassemble_split_events"] = True  # one row per event, never a fragment
        if self.show_expanded_events:
            options["show_expanded_events"] = True
        if with_lookups:
            if self.full_document is not None:
                options["full_document"] = self.full_document
            if self.full_document_before_change is not None:
                options["full_document_before_change"] = self.full_document_before_change
        return options


def session_settings(conf: Mapping[str, str]) -> dict[str, str]:
    """The ``spark.mongodb.read.*`` entries of a session's configuration (keys lower-cased)."""
    return {
        key.lower(): value
        for key, value in conf.items()
        if key.lower().startswith(SESSION_PREFIX)
    }


def _unknown_message(unknown: list[str], known: set[str]) -> str:
    """One line: the unknown names, the closest valid one, and every valid name."""
    names = sorted(known | set(MONGO_SPARK_ALIASES))
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"unknown changestream option(s) {', '.join(hints)}; valid options are: "
        f"{', '.join(sorted(known))}; and the MongoDB Spark connector's names: "
        f"{', '.join(sorted(MONGO_SPARK_ALIASES))} (see docs/spark.md)"
    )


def _canonical(opts: dict[str, str], known: set[str], *, strict: bool = True) -> dict[str, str]:
    """Our option names for the MongoDB Spark connector's (lower-cased keys in and out).

    Not ``strict`` (session-wide settings): names this source does not use
    are skipped, as the connector skips settings it does not know, since a
    session may hold settings for the connector's own batch reads.
    """
    out: dict[str, str] = {}
    given: dict[str, str] = {}
    for key, value in opts.items():
        name = key
        for prefix in _SPARK_CONF_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name in MONGO_SPARK_UNSUPPORTED:
            if not strict:
                continue
            raise ValueError(
                f"option {key!r} (MongoDB Spark connector) has no equivalent here: "
                f"{MONGO_SPARK_UNSUPPORTED[name]} (see docs/spark.md, 'Coming from mongo-spark')"
            )
        ours = MONGO_SPARK_ALIASES.get(name, name)
        if not strict and ours not in known:
            continue
        if name == "collection" and value.strip() == "*":
            continue  # the connector's "every collection": a database-level source
        if name == "collection" and "," in value:
            ours = "namespaces"  # several collections: a database-level source, filtered
        if ours == "start_at_operation_time" and value.strip() == "-1":
            continue  # the connector's "unset"
        if ours in out:
            raise ValueError(
                f"{'options' if strict else 'session settings'} {given[ours]!r} and {key!r} "
                f"both set {ours!r}; keep one"
            )
        out[ours] = value
        given[ours] = key
    return out


def _namespaces(text: str | None, database: str | None) -> tuple[tuple[str, str | None], ...]:
    """``namespaces``: comma-separated ``db.coll``, ``coll`` (in ``database``) or ``db.*``."""
    if text is None:
        return ()
    result: list[tuple[str, str | None]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        db, dot, coll = item.partition(".")
        if not dot:
            if database is None:
                raise ValueError(
                    f"option 'namespaces': {item!r} needs a database ('db.{item}'), or set "
                    "option 'database'"
                )
            db, coll = database, item
        if not db or not coll:
            raise ValueError(f"option 'namespaces': {item!r} is not 'db.coll', 'coll' or 'db.*'")
        if database is not None and db != database:
            raise ValueError(
                f"option 'namespaces': {item!r} is outside database {database!r}"
            )
        result.append((db, None if coll == "*" else coll))
    if not result:
        raise ValueError("option 'namespaces' is empty")
    return tuple(result)


def _namespace_filter(
    namespaces: tuple[tuple[str, str | None], ...],
) -> tuple[dict[str, Any], ...]:
    """A ``$match`` keeping the events of these namespaces (and invalidates, which have none)."""
    if not namespaces:
        return ()
    alternatives: list[dict[str, Any]] = [
        {"ns.db": db} if coll is None else {"ns.db": db, "ns.coll": coll}
        for db, coll in namespaces
    ]
    alternatives.append({"operationType": "invalidate"})
    return ({"$match": {"$or": alternatives}},)


def _bool(name: str, text: str | None) -> bool:
    if text is None:
        return False
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"option {name!r} must be true or false, not {text!r}")
    return value == "true"


def _int(name: str, text: str | None, minimum: int, default: int | None) -> Any:
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"option {name!r} must be an integer, not {text!r}") from None
    if value < minimum:
        raise ValueError(f"option {name!r} must be >= {minimum}, not {value}")
    return value


def _float(name: str, text: str | None, default: float) -> float:
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"option {name!r} must be a number, not {text!r}") from None
    if value < 0:
        raise ValueError(f"option {name!r} must be >= 0, not {value}")
    return value


def _timestamp(text: str, name: str = "start_at_operation_time") -> Timestamp:
    """Epoch seconds (``1700000000``), ISO-8601 (``2026-11-26T02:00:00Z``, as the MongoDB
    Spark connector accepts) or Extended JSON ``{"$timestamp": {"t": .., "i": ..}}``."""
    stripped = text.strip()
    if stripped.isdigit():
        return Timestamp(int(stripped), 0)
    if stripped[:4].isdigit() and stripped[4:5] == "-":
        try:
            when = datetime.fromisoformat(stripped.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            return Timestamp(int(when.timestamp()), 0)
    try:
        value = json_util.loads(stripped)
    except (ValueError, TypeError):
        value = None
    if not isinstance(value, Timestamp):
        raise ValueError(
            f"option '{name}' must be epoch seconds, ISO-8601 or "
            f'{{"$timestamp": {{"t": <seconds>, "i": <increment>}}}}, not {text!r}'
        )
    return value


def _token(name: str, text: str) -> dict[str, Any]:
    try:
        return token_from_json(text)
    except ValueError as exc:
        raise ValueError(f"option {name!r}: {exc}") from None


def _pipeline(text: str | None) -> tuple[dict[str, Any], ...]:
    if not text:
        return ()
    try:
        stages = json_util.loads(text)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"option 'pipeline' is not (Extended) JSON: {exc}") from None
    if isinstance(stages, dict):
        stages = [stages]
    if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
        raise ValueError("option 'pipeline' must be a JSON array of stage documents")
    if any(_SPLIT_STAGE in stage for stage in stages[:-1]):
        raise ValueError(
            f"option 'pipeline': {_SPLIT_STAGE} must be the last stage (the server requires it "
            "there)"
        )
    return tuple(stages)


def splits_events(pipeline: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether a pipeline ends with ``$changeStreamSplitLargeEvent`` (events over 16 MiB come
    in fragments, which the client merges back with ``reassemble_split_events``)."""
    return bool(pipeline) and _SPLIT_STAGE in pipeline[-1]  # type: ignore[index]
