"""``changestream mirror``: keep a Delta table equal to a collection, exactly once.

A new table is first filled from the consistent snapshot
(:func:`changestream.snapshot_then_watch`), then follows the change stream.
It is :func:`changestream.consume` with :class:`changestream.delta.DeltaSink`
as both handler and token store, so the resume token is committed in the same
Delta commit as the batch it ends: after a ``kill -9`` the table and its
position agree, and the next run continues from there. The status line and
``--until-idle`` are ``changestream watch``'s.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from .. import StreamInvalidatedError, consume, describe_error
from .._delta_sizes import BATCH_BYTES, BATCH_CHANGES, BATCH_SECONDS
from .common import (
    DEFAULT_CONNECT_TIMEOUT,
    Parser,
    call_seconds,
    cluster_time,
    collection_name,
    database_name,
    failure_line,
    log_level,
    not_dead_end,
    positive_int,
    reach,
    redact,
    say,
    seconds,
    sink_failure,
)
from .native_stderr import panics_held
from .progress import StatusLine, WatchProgress

__all__ = ["main"]


_CHUNK = 10_000
"""Documents per chunk of a re-snapshot (``--resnapshot-chunk``'s default)."""

_ONE_COLLECTION: dict[str, Callable[[argparse.Namespace], bool]] = {
    "--verify": lambda args: bool(args.verify),
    "--history": lambda args: args.history is not None,
    "--on-history-lost resnapshot": lambda args: args.on_history_lost == "resnapshot",
    "--snapshot-readers": lambda args: args.snapshot_readers is not None,
    "--resnapshot": lambda args: bool(args.resnapshot),
    "--resnapshot-chunk": lambda args: args.resnapshot_chunk is not None,
}
"""Flags of a one-collection mirror only, refused without ``--coll`` (not silently ignored)."""


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="changestream mirror",
        description="Keep a Delta Lake table equal to a collection: a consistent snapshot when "
        "the table is new, then the change stream, exactly once (the resume token is committed "
        "with each batch). Needs the 'delta' extra.",
    )
    parser.add_argument("uri", metavar="URI", help="MongoDB connection string")
    parser.add_argument("--db", required=True, type=database_name,
                        help="database of the collection")
    parser.add_argument("--coll", type=collection_name,
                        help="collection to mirror (without it: every collection of --db, one "
                        "table each under --to/<collection>, from one change stream)")
    parser.add_argument(
        "--coll-regex", metavar="REGEX", type=_regex,
        help="without --coll: only the collections whose whole name matches REGEX",
    )
    parser.add_argument(
        "--exclude", metavar="REGEX", type=_regex, action="append", default=[],
        help="without --coll: leave out the collections whose whole name matches REGEX "
        "(repeatable)",
    )
    parser.add_argument("--to", required=True, metavar="PATH",
                        help="the Delta table's directory (without --coll: the directory of "
                        "the tables)")
    parser.add_argument(
        "--app-id", default="changestream-mirror", metavar="ID", type=_app_id,
        help="the writer's id in the table's application transactions (default %(default)s)",
    )
    parser.add_argument(
        "--full-document", choices=("updateLookup", "required"), default="updateLookup",
        help="how updates get their document: updateLookup (the current document) or required "
        "(post-images; enable changeStreamPreAndPostImages) (default %(default)s)",
    )
    parser.add_argument(
        "--json", choices=("relaxed", "canonical"), default="relaxed", dest="json_mode",
        help="Extended JSON of the document column (default %(default)s)",
    )
    parser.add_argument(
        "--schema", metavar="SCHEMA",
        help="store these document fields as typed columns instead of one JSON column: a Spark "
        "DDL ('name STRING, qty INT, tags ARRAY<STRING>') or Spark's/Delta's schema JSON; "
        "@FILE reads it from FILE",
    )
    parser.add_argument(
        "--on-mismatch", choices=("fail", "rescue"), default="fail",
        help="with --schema, a value that does not fit its column: stop, nothing written "
        "(fail, default), or keep it and every field outside the schema in the row's "
        "_rescued JSON column (rescue)",
    )
    parser.add_argument(
        "--evolve", action="store_true",
        help="with --schema, add new top-level fields as new columns (Delta schema evolution)",
    )
    parser.add_argument(
        "--history", metavar="PATH",
        help="also keep a history table at PATH: one row per change with valid_from (and "
        "valid_to by a query), SCD type 2; committed exactly once with the table",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=BATCH_CHANGES, metavar="N",
        help="commit after N changes at most (default %(default)s)",
    )
    parser.add_argument(
        "--batch-mb", type=positive_int, default=BATCH_BYTES >> 20, metavar="MB",
        help="commit once the staged changes hold about MB megabytes (default %(default)s)",
    )
    parser.add_argument(
        "--batch-seconds", type=seconds, default=BATCH_SECONDS, metavar="S",
        help="commit at least every S seconds while changes come (default %(default)s)",
    )
    parser.add_argument(
        "--oversize", choices=("fail", "split"), default="fail",
        help="a change over 16 MB: stop with a message (fail, default) or let the server split "
        "it and join the fragments before they reach the table (split; MongoDB 7.0+ or 6.0.9+)",
    )
    parser.add_argument(
        "--resnapshot", action="store_true",
        help="ask the mirror running on --to to re-read the collection in chunks while it "
        "streams (a signal commit in the table), then exit; a mirror started later takes it up",
    )
    parser.add_argument(
        "--resnapshot-chunk", type=positive_int, metavar="N",
        help=f"documents per chunk of a re-snapshot (default {_CHUNK})",
    )
    parser.add_argument(
        "--snapshot-readers", type=positive_int, metavar="N",
        help="read a new table's first copy with N readers in parallel, over _id ranges, at "
        "one cluster time (default 1)",
    )
    parser.add_argument(
        "--verify", action="store_true",
        help="compare the table with the collection at the table's position (a snapshot read; "
        "if the server no longer keeps it, catch up first), print the counts of missing, extra "
        "and different keys with examples, and exit 1 if they differ (0 if equal); writes "
        "nothing else",
    )
    parser.add_argument(
        "--on-history-lost", choices=("raise", "resnapshot"), default="raise",
        help="when the oplog no longer holds the table's position (code 286): exit 1 with "
        "advice (raise, default), or copy the collection into the table again and drop the "
        "documents the copy did not bring (resnapshot)",
    )
    parser.add_argument(
        "--until-idle", type=seconds, metavar="SECONDS",
        help="exit (status 0) once caught up: the table holds every change made before the "
        "command started (never during the snapshot or a backlog) and no change arrived for "
        "SECONDS (a one-off catch-up, e.g. from cron)",
    )
    parser.add_argument(
        "--connect-timeout", type=call_seconds, default=DEFAULT_CONNECT_TIMEOUT, metavar="S",
        help=f"give up (exit 1) if the deployment cannot be reached within S seconds "
        f"(default {DEFAULT_CONNECT_TIMEOUT:g})",
    )
    parser.add_argument("--no-status", dest="status", action="store_false",
                        help="no status line, even on a terminal")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v for INFO (resumes, reopens), -vv for DEBUG")
    parser.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        type=str.upper, help="log level of the 'changestream' logger")
    return parser


def main(argv: list[str]) -> int:
    """``changestream mirror ...``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.uri.startswith(("mongodb://", "mongodb+srv://")):
        parser.error("the URI must start with mongodb:// or mongodb+srv://")
    if args.coll is not None and (args.coll_regex is not None or args.exclude):
        parser.error("--coll-regex and --exclude pick collections of a whole database: "
                     "leave out --coll")
    if args.coll is None and args.schema is not None:
        parser.error("--schema types one collection's documents: give --coll")
    if args.coll is None:
        for flag, given in _ONE_COLLECTION.items():
            if given(args):
                parser.error(f"{flag} works on one collection's table: give --coll (a whole "
                             "database's mirror does not do it)")
    if args.snapshot_readers is None:
        args.snapshot_readers = 1
    if args.resnapshot_chunk is None:
        args.resnapshot_chunk = _CHUNK
    if args.coll is None and "://" in args.to:
        parser.error("--to: a whole database is mirrored into a local directory (one table "
                     "per collection); give --coll for an object store")
    if "://" not in args.to and not Path(args.to).parent.is_dir():
        parser.error(f"--to: the directory {Path(args.to).parent} does not exist")
    if "://" not in args.to and Path(args.to).exists() and not Path(args.to).is_dir():
        parser.error(f"--to: {args.to} is not a directory")
    if args.history is not None:
        if args.history == args.to:
            parser.error("--history: give another path than --to")
        if "://" not in args.history and not Path(args.history).parent.is_dir():
            parser.error(f"--history: the directory {Path(args.history).parent} does not exist")
    try:
        from ..delta import DeltaSink, SchemaTextError
    except ImportError as exc:
        say(str(exc))
        return 1
    schema = None
    if args.schema is None and (args.on_mismatch != "fail" or args.evolve):
        parser.error("--on-mismatch rescue and --evolve need --schema (without it every "
                     "document is stored whole as JSON)")
    if args.schema is not None:
        try:
            schema = _schema_text(args.schema)
            DeltaSink(args.to, schema=schema)  # reads it: a mistake is named before connecting
        except (OSError, SchemaTextError, ValueError) as exc:
            parser.error(f"--schema: {exc}")
    if args.resnapshot:
        return _request(args.to)
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(args.uri, connect=False)
    except (PyMongoError, ValueError, TypeError) as exc:
        parser.error(f"invalid URI: {redact(describe_error(exc), args.uri)}")
    if args.coll is None:
        from .mirror_database import mirror_database

        with panics_held():
            return mirror_database(args, client)
    sink = DeltaSink(args.to, app_id=args.app_id, full_document=args.full_document,
                     json_mode=args.json_mode, schema=schema, history=args.history,
                     on_mismatch=args.on_mismatch, evolve=args.evolve,
                     batch_bytes=args.batch_mb << 20)
    with panics_held():  # delta-rs's writer threads may panic on a failed write: one line, ours
        if args.verify:
            return _verify(args, client, sink)
        return _mirror(args, client, sink)


def _request(target: str) -> int:
    """``--resnapshot``: the signal commit; the running mirror does the rest."""
    from .._delta_resnapshot import request_snapshot

    try:
        version = request_snapshot(target)
    except (ValueError, OSError) as exc:
        say(str(exc))
        return 1
    say(f"re-snapshot requested (table version {version}): the mirror running on {target} "
         "re-reads the collection in chunks while it streams; its status line shows progress")
    return 0


def _verify(args: argparse.Namespace, client: MongoClient[dict[str, Any]], sink: Any) -> int:
    """``--verify``: the table against the collection; 0 equal, 1 different (or an error)."""
    from ..delta import DeltaSinkError

    try:
        problem = reach(client, args.connect_timeout, args.uri)
        if problem is not None:
            say(redact(problem, args.uri))
            return 1
        collection = client[args.db][args.coll]
        try:
            result = sink.verify(collection)
        except DeltaSinkError as exc:  # mid-copy, or the position is too old: catch up first
            say(f"{exc}; catching up first")
            args.until_idle = 0.5 if args.until_idle is None else args.until_idle
            status = _mirror(args, MongoClient(args.uri, connect=False), sink)
            if status != 0:
                return status
            result = sink.verify(collection)
    except PyMongoError as exc:
        say(redact(describe_error(exc), args.uri))
        return 1
    except Exception as exc:  # the table cannot be read, still mid-copy, ...
        say(redact(sink_failure(exc, args.to, sink), args.uri))
        return 1
    finally:
        client.close()
    say(("verified: " if result.ok else "DIFFERENT: ") + result.summary())
    return 0 if result.ok else 1


def _resnapshot_gap(gap: Any) -> None:
    """One line on stderr: the history was lost and the table is copied anew."""
    after = "?" if gap.lost_after is None else f"{gap.lost_after:%Y-%m-%d %H:%M:%S} UTC"
    say(f"the oplog no longer holds the table's position (changes after {after} are lost): "
         "copying the collection into the table again; documents it no longer has are "
         "deleted when the copy ends")


def _app_id(text: str) -> str:
    """``--app-id``: the writer's name in the table; an empty one names nobody."""
    if not text:
        raise argparse.ArgumentTypeError("must name the writer, not be empty")
    return text


def _regex(text: str) -> re.Pattern[str]:
    """``--coll-regex``/``--exclude``: a Python regular expression, matched against whole names."""
    try:
        return re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {exc}") from exc


def _copying(stored: Any) -> bool:
    """Is the table new or in its first copy (a parallel copy may fill it)?"""
    if stored is None:
        return True
    token = stored.token
    return isinstance(token, dict) and token.get("_data") == "snapshot" \
        and token.get("phase") == "copy"


def _schema_text(value: str) -> str:
    """``--schema``'s text: as given, or the contents of the file named after ``@``."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except OSError as exc:
        raise OSError(f"cannot read {value[1:]}: {exc.strerror or exc}") from exc


def _mirror(args: argparse.Namespace, client: MongoClient[dict[str, Any]], sink: Any) -> int:
    logging.basicConfig(level=logging.WARNING, format="changestream: %(message)s")
    logging.getLogger("changestream").setLevel(log_level(args))
    stop = threading.Event()
    status = StatusLine(sys.stderr) if args.status and sys.stderr.isatty() else None
    progress = WatchProgress(stop, status, args.until_idle)
    from .._delta_resnapshot import DeltaResnapshot

    resnapshot = DeltaResnapshot(sink, client[args.db][args.coll],
                                 chunk_size=args.resnapshot_chunk)
    progress.extra = resnapshot.progress_text
    progress.busy = lambda: resnapshot.progress.active
    for handler in logging.getLogger().handlers:
        progress.attach(handler)
        handler.addFilter(not_dead_end)  # printed once below, as the exit message
    signal.signal(signal.SIGINT, signal.default_int_handler)
    namespace = f"{args.db}.{args.coll}"
    try:
        problem = reach(client, args.connect_timeout, args.uri)
        if problem is not None:
            say(redact(problem, args.uri))
            return 1
        if args.until_idle is not None:
            progress.caught_up_to = cluster_time(client)
        stored = resnapshot.load()
        if args.snapshot_readers > 1 and _copying(stored):
            from .._parallel_copy import parallel_copy

            say(f"copying {namespace} into {args.to} with {args.snapshot_readers} readers")
            copied = parallel_copy(client[args.db][args.coll], sink,
                                   readers=args.snapshot_readers,
                                   batch=min(args.batch, sink.file_rows))  # a base file each
            if copied.too_old:
                say("the server no longer keeps the copy's cluster time (SnapshotTooOld): the "
                    "copy goes on with one reader at a new time")
            stored = resnapshot.load()
        if stored is None:
            say(f"mirroring {namespace} into {args.to}: snapshot first; Ctrl-C to stop")
        else:
            say(f"mirroring {namespace} into {args.to} from its last commit "
                 f"(batch {stored.batch_id}); Ctrl-C to stop")
        result = consume(
            client[args.db][args.coll], resnapshot, resnapshot, initial_snapshot=True,
            # raw events: the sink reads what it needs from their bytes and decodes only
            # each key's last document of a batch (changestream._raw_rows)
            watch_options={"full_document": args.full_document, "max_await_time_ms": 500,
                           "document_class": RawBSONDocument},
            save_every=args.batch, save_interval=args.batch_seconds, stop=stop,
            oversize=args.oversize, on_history_lost=args.on_history_lost,
            gap=_resnapshot_gap if args.on_history_lost == "resnapshot" else None,
            on_stats=sink.reporting(progress), stats_interval=progress.interval,
            stop_on_signals=True,
        )
        if progress.idle_stop:  # caught up: fold the change log, the table is the collection
            sink.finish()
    except KeyboardInterrupt:
        say("stopped")
        return 0
    except StreamInvalidatedError as exc:
        progress.clear()
        say(f"{namespace} was dropped or renamed; the table holds its last state: {exc}")
        return 1
    except Exception as exc:  # a dead end, the server's error, the sink's (a full disk, ...)
        progress.clear()
        say(failure_line(exc, args.uri, args.to, sink))
        return 1
    finally:
        for handler in logging.getLogger().handlers:  # main() may be called as a function
            handler.removeFilter(not_dead_end)
        progress.clear()
        client.close()
    version = sink.applied_version
    why = f"no change for {args.until_idle:g} s" if progress.idle_stop else "stopped"
    done = resnapshot.progress
    again = f"; re-snapshot: {done.chunks} chunks, {done.keys} keys re-read, {done.dropped} " \
        f"left to the stream, {done.deleted} deleted" if done.chunks else ""
    rescued = f"; {sink.rescued} values rescued into _rescued" if sink.rescued else ""
    say(f"{why}; {result.handled} changes mirrored by this run; {args.to} holds batch "
         f"{version}{again}{rescued}")
    return 0
