"""``changestream watch``: print every change as a JSON line, resuming from a token file.

``changestream watch URI`` prints each change as one line of relaxed
Extended JSON on stdout and, with ``--token-file``, keeps the resume token
in that file (:class:`~changestream.stores.FileTokenStore`) so the next run
continues where this one stopped. Ctrl-C (or SIGTERM) exits with status 0
and leaves a valid token file. Messages go to stderr; credentials in the URI
are never printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from bson import json_util
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from .. import (
    ChangeStream,
    ConsumeError,
    FileTokenStore,
    HistoryGap,
    HistoryLostError,
    MemoryTokenStore,
    StreamInvalidatedError,
    TokenStore,
    TokenStoreError,
    consume,
    describe_error,
    token_cluster_time,
    token_from_json,
    token_to_json,
    watch,
)
from .._consumer.bounds import DEFAULT_CALL_TIMEOUT
from .common import (
    DEFAULT_CONNECT_TIMEOUT,
    call_seconds,
    cluster_time,
    collection_name,
    database_name,
    milliseconds,
    not_dead_end,
    open_client,
    positive_int,
    reach,
    redact,
    say,
    seconds,
    setup_logging,
    version,
)
from .progress import StatusLine, WatchProgress, parse_operation_time

__all__ = ["add_parser", "run"]

_RELAXED = json_util.RELAXED_JSON_OPTIONS
MAX_PIPELINE_DEPTH = 200
"""Levels of arrays and documents in ``--pipeline`` (the array is one): mongod refuses
a command whose pipeline goes deeper (``maxBSONDepth``, 15 Overflow)."""


def add_parser(sub: Any) -> None:
    """Add ``watch`` and its options to the command line's subcommands (``sub``)."""
    watch_parser = sub.add_parser(
        "watch",
        help="print changes as JSON lines, resuming from a token file",
        description="Print every change as one line of relaxed Extended JSON. Without --db the "
        "whole deployment is watched; --db alone watches a database. On a terminal, a status "
        "line on stderr shows events, rate and lag.",
    )
    watch_parser.add_argument("--version", action="version", version=version())
    watch_parser.add_argument("uri", metavar="URI", help="MongoDB connection string")
    watch_parser.add_argument(
        "--db", type=database_name, help="database to watch (default: every database)"
    )
    watch_parser.add_argument(
        "--coll", type=collection_name, help="collection to watch (needs --db)"
    )
    watch_parser.add_argument(
        "--pipeline", default="[]", metavar="JSON",
        help='stages after $changeStream, e.g. \'[{"$match": {"operationType": "insert"}}]\' '
        "(default %(default)s)",
    )
    watch_parser.add_argument(
        "--full-document", metavar="MODE",
        help="updateLookup, whenAvailable or required (passed to the server as is)",
    )
    watch_parser.add_argument(
        "--full-document-before-change", metavar="MODE", help="whenAvailable, required or off"
    )
    watch_parser.add_argument(
        "--token-file", metavar="F",
        help="keep the resume token in F: resume from it, save after every change",
    )
    start = watch_parser.add_mutually_exclusive_group()
    start.add_argument(
        "--start-after", metavar="TOKEN_JSON",
        help="start after this token (e.g. an invalidate token), replacing the token file's",
    )
    start.add_argument(
        "--resume-after", metavar="TOKEN_JSON",
        help="resume after this token (resumeAfter), replacing the token file's",
    )
    start.add_argument(
        "--start-at-operation-time", metavar="TIME",
        help="start at this cluster time when there is no token to resume from: SECONDS, "
        "SECONDS:INCREMENT or ISO-8601 (e.g. 2026-11-26T02:00:00Z)",
    )
    watch_parser.add_argument(
        "--max-await-ms", type=milliseconds, default=1000, metavar="MS",
        help="how long each getMore waits for changes (default %(default)s)",
    )
    watch_parser.add_argument(
        "--call-timeout", type=call_seconds, default=DEFAULT_CALL_TIMEOUT, metavar="S",
        help="longest a single server call may take before it is retried with a warning "
        f"(default {DEFAULT_CALL_TIMEOUT:g})",
    )
    watch_parser.add_argument(
        "--connect-timeout", type=call_seconds, default=DEFAULT_CONNECT_TIMEOUT, metavar="S",
        help="give up (exit 1) if the deployment cannot be reached at start within S seconds "
        f"(default {DEFAULT_CONNECT_TIMEOUT:g})",
    )
    watch_parser.add_argument(
        "--batch-size", type=positive_int, metavar="N",
        help="changes per batch (default: the server's)",
    )
    watch_parser.add_argument(
        "--oversize", choices=("fail", "split"), default="fail",
        help="a change over 16 MB: stop with a message (fail, default) or let the server split "
        "it and join the fragments (split; MongoDB 7.0+ or 6.0.9+)",
    )
    watch_parser.add_argument(
        "--show-expanded-events", action="store_true",
        help="also report DDL events (create, createIndexes, modify, ...; MongoDB 6.0+)",
    )
    watch_parser.add_argument(
        "--change-stream-version", choices=("v1", "v2"), metavar="v1|v2",
        help="$changeStream reader version (MongoDB 8.2+; v2: mongos targets only the shards "
        "that hold the data)",
    )
    watch_parser.add_argument(
        "--ignore-removed-shards", action="store_true",
        help="with --change-stream-version v2 on MongoDB 9.0+: go on past a removed shard's "
        "data instead of failing",
    )
    watch_parser.add_argument(
        "--on-history-lost", choices=("raise", "from-now", "resnapshot"), default="raise",
        help="when the oplog no longer holds the stored token (code 286): exit 1 with advice "
        "(raise, the default); skip to now and print the lost interval on stderr (from-now); "
        "or print every document of --coll again, then its changes (resnapshot)",
    )
    watch_parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="exit (status 0) after N changes"
    )
    watch_parser.add_argument(
        "--until-idle", type=seconds, metavar="SECONDS",
        help="exit (status 0) once caught up: the stream has reached the cluster time at the "
        "start and no change arrived for SECONDS",
    )
    watch_parser.add_argument(
        "--no-status", dest="status", action="store_false",
        help="no status line, even on a terminal",
    )
    watch_parser.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="more log records on stderr: -v for INFO (resumes, reopens), -vv for DEBUG",
    )
    watch_parser.add_argument(
        "--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper,
        help="log level of the 'changestream' logger (overrides -v; default WARNING)",
    )


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, *, exits: bool) -> int:
    """``changestream watch`` with ``args`` parsed by ``parser``; returns the exit status.

    ``exits``: the process ends when this returns (not ``main()`` called as a function).
    """
    if args.coll is not None and args.db is None:
        parser.error("--coll needs --db")
    if args.on_history_lost == "resnapshot" and not args.coll:
        parser.error("--on-history-lost resnapshot needs --coll (it copies one collection)")
    try:
        pipeline = json_util.loads(args.pipeline)
    except ValueError as exc:
        parser.error(f"--pipeline is not JSON: {exc}")
    except RecursionError:
        parser.error(f"--pipeline is nested deeper than the {MAX_PIPELINE_DEPTH} levels "
                     "MongoDB accepts")
    if not isinstance(pipeline, list):
        parser.error("--pipeline must be a JSON array of stages")
    depth = _nesting_depth(pipeline)
    if depth > MAX_PIPELINE_DEPTH:
        parser.error(f"--pipeline is nested {depth} levels deep, deeper than the "
                     f"{MAX_PIPELINE_DEPTH} MongoDB accepts")
    start_after = None
    given = args.start_after if args.start_after is not None else args.resume_after
    if given is not None:
        option = "--start-after" if args.start_after is not None else "--resume-after"
        try:
            start_after = token_from_json(given)
        except ValueError as exc:
            parser.error(f"{option}: {exc}")
        problem = _token_data_problem(start_after.get("_data"))
        if problem is not None:
            parser.error(f"{option}: not a resume token: {problem}")
    if args.start_at_operation_time is not None:
        try:
            args.start_at_operation_time = parse_operation_time(args.start_at_operation_time)
        except ValueError as exc:
            parser.error(f"--start-at-operation-time: {exc}")
    store: TokenStore = MemoryTokenStore()
    if args.token_file:
        directory = Path(args.token_file).parent
        if not directory.is_dir():
            parser.error(f"--token-file: the directory {directory} does not exist")
        try:
            store = FileTokenStore(args.token_file)
        except TokenStoreError as exc:
            parser.error(f"--token-file: {exc}")
    client = open_client(parser, args.uri)
    return _watch(args, client, store, pipeline, start_after, exits=exits)


def _nesting_depth(value: Any) -> int:
    """How many arrays and documents deep ``value`` goes (counted without recursion)."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (Mapping, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, Mapping) else item
            pending.extend((child, depth + 1) for child in children)
    return deepest


def _token_data_problem(data: Any) -> str | None:
    """Why a token's ``_data`` cannot be resumed from (``None``: it can)."""
    if not isinstance(data, str):
        return f"'_data' must be a hex string, not {type(data).__name__} {data!r:.40}"
    try:
        bytes.fromhex(data)
    except ValueError:
        return f"'_data' must be a hex string (copy it from an event's _id), not {data!r:.40}"
    return None


class _PrintGuard:
    """Ctrl-C and SIGTERM never repeat a printed change: its token is stored before exit.

    From the moment a change is printed until its token is stored, a signal
    only asks the loop to stop (it stores that token, then returns);
    otherwise, and for a second signal, it interrupts at once (the loop
    stores the last printed change's token on the way out). Either way the
    cursor is killed and the token file stays valid. Once the loop is over
    only closing is left: then, in the program, a signal ends the process at
    once, as the default action does, without a traceback.
    """

    def __init__(self, store: TokenStore, stop: threading.Event, *, exits: bool = False) -> None:
        self.store = store
        self.stop = stop
        self.exits = exits
        """The process ends when ``watch`` returns (not ``main()`` called as a function)."""
        self.unstored = False
        """A change was printed and its token is not stored yet."""
        self.signalled = False
        self.finished = False
        """The loop is over (returned or raised): nothing is left to store."""

    def printing(self) -> None:
        self.unstored = True

    def load(self) -> Any:
        return self.store.load()

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        self.store.save(token, batch_id=batch_id)
        self.unstored = False

    def interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self.finished and self.exits:
            # A KeyboardInterrupt here (closing the client, saying "stopped") would print a
            # traceback: end at once, killed by the signal as without a handler.
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        again = self.signalled
        self.signalled = True
        self.stop.set()
        if again or not self.unstored:
            raise KeyboardInterrupt

    def __repr__(self) -> str:
        return repr(self.store)


def _watch(args: argparse.Namespace, client: MongoClient[dict[str, Any]], store: TokenStore,
           pipeline: list[Any], start_after: Any, *, exits: bool = False) -> int:
    setup_logging(args)
    stop = threading.Event()
    status = StatusLine(sys.stderr) if args.status and sys.stderr.isatty() else None
    progress = WatchProgress(stop, status, args.until_idle)
    filtered = list(logging.getLogger().handlers)
    for handler in filtered:
        progress.attach(handler)
        handler.addFilter(not_dead_end)  # printed once below, as the exit message
    guard = _PrintGuard(store, stop, exits=exits)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    options: dict[str, Any] = {"max_await_time_ms": args.max_await_ms}
    if args.full_document is not None:
        options["full_document"] = args.full_document
    if args.full_document_before_change is not None:
        options["full_document_before_change"] = args.full_document_before_change
    if args.batch_size is not None:
        options["batch_size"] = args.batch_size
    if args.show_expanded_events:
        options["show_expanded_events"] = True
    if args.oversize == "split":
        options["reassemble_split_events"] = True
    if args.change_stream_version is not None:
        options["version"] = args.change_stream_version
    if args.ignore_removed_shards:
        options["ignore_removed_shards"] = True
    # With --resume-after, stored tokens are passed as resumeAfter; else as startAfter.
    token_key = "resume_after" if args.resume_after is not None else "start_after"
    namespace = ".".join(part for part in (args.db, args.coll) if part) or "the deployment"
    target: Any = client
    if args.db:
        target = client[args.db][args.coll] if args.coll else client[args.db]

    opened: list[bool] = []

    def open_stream(token: Mapping[str, Any] | None) -> ChangeStream[Any]:
        # startAfter also accepts an invalidate token; otherwise it acts as resumeAfter.
        start: dict[str, Any] = {} if token is None else {token_key: token}
        if token is None and args.start_at_operation_time is not None:
            start["start_at_operation_time"] = args.start_at_operation_time
        stream: ChangeStream[Any] = watch(target, pipeline, **start, **options)
        if not opened:
            opened.append(True)
            where = (
                f"from cluster time {args.start_at_operation_time}"
                if token is None and args.start_at_operation_time is not None
                else "from now" if token is None
                else f"after the token in {args.token_file}" if args.token_file
                else "after the given token"
            )
            say(f"watching {namespace} {where}; Ctrl-C to stop")
        return stream

    printed = 0

    def print_change(change: Any) -> None:
        nonlocal printed
        guard.printing()
        sys.stdout.write(json_util.dumps(change, json_options=_RELAXED) + "\n")
        sys.stdout.flush()
        printed += 1
        if args.limit is not None and printed >= args.limit:
            stop.set()

    try:
        try:
            # Installed in here, so that a signal right after is a stop like any other;
            # also when started in the background, where SIGINT is inherited as ignored.
            for signum in previous:
                signal.signal(signum, guard.interrupt)
            problem = reach(client, args.connect_timeout, args.uri)
            if problem is not None:
                say(redact(problem, args.uri))
                return 1
            if args.until_idle is not None:
                progress.caught_up_to = cluster_time(client)
            if start_after is not None:
                store.save(start_after)
            source: Any = open_stream
            recovery: dict[str, Any] = {}
            if args.on_history_lost == "from-now":
                recovery = {"on_history_lost": "from_now", "gap": _print_gap}
            elif args.on_history_lost == "resnapshot":
                # consume opens the copy and the streams itself (resumeAfter the stored token).
                say(f"watching {namespace}; Ctrl-C to stop")
                source, recovery = target, {"on_history_lost": "resnapshot", "gap": _print_gap,
                                            "pipeline": pipeline, "watch_options": options}
            consume(source, print_change, guard, stop=stop, on_stats=progress,
                    stats_interval=progress.interval, call_timeout=args.call_timeout, **recovery)
        finally:
            guard.finished = True  # before the messages and the close below
    except KeyboardInterrupt:
        return _stopped(args, progress)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): the unprinted change was not stored.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except StreamInvalidatedError as exc:
        say(str(exc))
        say(f"to continue, run again with --start-after '{token_to_json(exc.invalidate_token)}'")
        return 1
    except HistoryLostError as exc:
        say(redact(_history_lost_advice(exc, args), args.uri))
        return 1
    except (ConsumeError, TokenStoreError) as exc:
        say(redact(str(exc), args.uri))
        return 1
    except PyMongoError as exc:
        say(redact(describe_error(exc), args.uri))
        return 1
    finally:
        for handler in filtered:  # the process may go on (the CLI called as a function)
            handler.removeFilter(not_dead_end)
        progress.clear()
        client.close()  # a signal meanwhile: see _PrintGuard (the program ends at once)
        for signum, previous_handler in previous.items():
            # The program exits soon: a signal until then ends it as on interpreter shutdown.
            signal.signal(signum, signal.SIG_DFL if exits else previous_handler)
    if guard.signalled:
        return _stopped(args, progress)
    if progress.idle_stop:
        say(f"no change for {args.until_idle:g} s; stopped after {printed} changes")
    return 0


def _print_gap(gap: HistoryGap) -> None:
    """``--on-history-lost``: the lost interval, on stderr (stdout holds only changes)."""
    after = "?" if gap.lost_after is None else f"{gap.lost_after:%Y-%m-%d %H:%M:%S} UTC"
    if gap.action == "resnapshot":
        say(f"history lost: the changes after {after} are gone from the oplog; printing every "
             "document again (records with a 'snapshot' field), then the changes")
    else:
        until = "now" if gap.resumed_at is None else f"{gap.resumed_at:%Y-%m-%d %H:%M:%S} UTC"
        say(f"history lost: the changes after {after} up to {until} are gone from the oplog "
             "and were skipped (--on-history-lost from-now)")


def _history_lost_advice(exc: HistoryLostError, args: argparse.Namespace) -> str:
    """What to do after a 286, in this command's flags (the library's advice speaks Python)."""
    where = f"the token in {args.token_file}" if args.token_file else "the given token"
    cluster_time = token_cluster_time(exc.token) if exc.token is not None else None
    if cluster_time is not None:
        where += f" (cluster time {cluster_time.as_datetime():%Y-%m-%d %H:%M:%S} UTC)"
    resnapshot = ("--on-history-lost resnapshot (prints every document again, then the changes)"
                  if args.coll else "--coll C --on-history-lost resnapshot")
    restart = (f"delete {args.token_file} and " if args.token_file else "")
    return (f"change stream history lost (code 286): {where} is older than the oldest entry of "
            f"the server's oplog, so the changes since then are gone. To go on, run again with "
            f"--on-history-lost from-now (skips them and prints the lost interval), or with "
            f"{resnapshot}; or resynchronise from the collection, then {restart}run with "
            f"--start-at-operation-time TIME (the time of that copy). A larger oplog "
            f"(replSetResizeOplog) or a faster consumer prevents this.")


def _stopped(args: argparse.Namespace, progress: WatchProgress) -> int:
    progress.clear()
    saved = args.token_file and Path(args.token_file).is_file()
    say("stopped" + (f"; the token is in {args.token_file}" if saved else ""))
    return 0
