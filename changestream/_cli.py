"""The ``changestream`` command line: ``watch`` a deployment, ``serve`` the simulator, ``demo``.

``changestream watch URI`` prints each change as one line of relaxed
Extended JSON on stdout and, with ``--token-file``, keeps the resume token
in that file (:class:`~changestream.stores.FileTokenStore`) so the next run
continues where this one stopped. Ctrl-C (or SIGTERM) exits with status 0
and leaves a valid token file. Messages go to stderr; credentials in the URI
are never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import pymongo
from bson import json_util
from pymongo import MongoClient
from pymongo.errors import PyMongoError
from pymongo.read_preferences import ReadPreference

from ._api import watch
from ._cli_progress import StatusLine, WatchProgress, parse_operation_time
from ._consume import consume
from ._consume_run import DEFAULT_CALL_TIMEOUT, ConsumeError, StreamInvalidatedError
from ._stream import ChangeStream
from ._token import token_from_json, token_to_json
from .errors import describe_error
from .stores import FileTokenStore, MemoryTokenStore, TokenStore, TokenStoreError

__all__ = ["main"]

_RELAXED = json_util.RELAXED_JSON_OPTIONS
_INT32_MAX = 2**31 - 1
DEFAULT_CONNECT_TIMEOUT = 10.0
"""Seconds ``watch`` waits to reach the deployment the first time before giving up (exit 1)."""


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _milliseconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ms, not {text!r}") from None
    if not 0 <= value <= _INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and {_INT32_MAX} ms, not {value}")
    return value


def _call_seconds(text: str) -> float:
    """A per-call time limit: finite, more than 0, at most a day."""
    value = _seconds(text)
    if not math.isfinite(value) or value > 86400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 86400 s, not {text}")
    return value


def _version() -> str:
    from . import __version__

    return f"changestream {__version__} (PyMongo {pymongo.version})"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, not {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="changestream",
        description="MongoDB change streams from the command line.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    watch_parser = sub.add_parser(
        "watch",
        help="print changes as JSON lines, resuming from a token file",
        description="Print every change as one line of relaxed Extended JSON. Without --db the "
        "whole deployment is watched; --db alone watches a database. On a terminal, a status "
        "line on stderr shows events, rate and lag.",
    )
    watch_parser.add_argument("--version", action="version", version=_version())
    watch_parser.add_argument("uri", metavar="URI", help="MongoDB connection string")
    watch_parser.add_argument("--db", help="database to watch (default: every database)")
    watch_parser.add_argument("--coll", help="collection to watch (needs --db)")
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
        "--max-await-ms", type=_milliseconds, default=1000, metavar="MS",
        help="how long each getMore waits for changes (default %(default)s)",
    )
    watch_parser.add_argument(
        "--call-timeout", type=_call_seconds, default=DEFAULT_CALL_TIMEOUT, metavar="S",
        help="longest a single server call may take before it is retried with a warning "
        f"(default {DEFAULT_CALL_TIMEOUT:g})",
    )
    watch_parser.add_argument(
        "--connect-timeout", type=_call_seconds, default=DEFAULT_CONNECT_TIMEOUT, metavar="S",
        help="give up (exit 1) if the deployment cannot be reached at start within S seconds "
        f"(default {DEFAULT_CONNECT_TIMEOUT:g})",
    )
    watch_parser.add_argument(
        "--batch-size", type=_positive_int, metavar="N",
        help="changes per batch (default: the server's)",
    )
    watch_parser.add_argument(
        "--show-expanded-events", action="store_true",
        help="also report DDL events (create, createIndexes, modify, ...; MongoDB 6.0+)",
    )
    watch_parser.add_argument(
        "--limit", type=_positive_int, metavar="N", help="exit (status 0) after N changes"
    )
    watch_parser.add_argument(
        "--until-idle", type=_seconds, metavar="SECONDS",
        help="exit (status 0) once no change arrived for SECONDS",
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
    sub.add_parser(
        "serve", add_help=False,
        help="run the replica-set simulator (see 'changestream serve --help')",
    )
    sub.add_parser("demo", add_help=False, help="a failover demo on the simulator, in seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    try:
        return _main(argv)
    finally:
        if argv is None:  # the program itself (not a test calling main()): exiting now
            _quiet_exit()


def _quiet_exit() -> None:
    """A Ctrl-C or SIGTERM while the interpreter shuts down ends it without a traceback."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            signal.signal(signum, signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["serve"]:
        from .testing.cli import main as serve

        return serve(arguments, prog="changestream")
    if arguments[:1] == ["demo"]:
        from ._demo import main as demo

        return demo(arguments[1:])
    parser = _parser()
    args = parser.parse_args(arguments)
    if args.coll and not args.db:
        parser.error("--coll needs --db")
    try:
        pipeline = json_util.loads(args.pipeline)
    except ValueError as exc:
        parser.error(f"--pipeline is not JSON: {exc}")
    if not isinstance(pipeline, list):
        parser.error("--pipeline must be a JSON array of stages")
    start_after = None
    given = args.start_after if args.start_after is not None else args.resume_after
    if given is not None:
        option = "--start-after" if args.start_after is not None else "--resume-after"
        try:
            start_after = token_from_json(given)
        except ValueError as exc:
            parser.error(f"{option}: {exc}")
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
    if not args.uri.startswith(("mongodb://", "mongodb+srv://")):
        scheme = args.uri.split("://", 1)[0] + "://" if "://" in args.uri else repr(args.uri[:20])
        parser.error(f"the URI must start with mongodb:// or mongodb+srv://, not {scheme}")
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(args.uri, connect=False)
    except (PyMongoError, ValueError, TypeError) as exc:
        parser.error(f"invalid URI: {_redact(describe_error(exc), args.uri)}")
    return _watch(args, client, store, pipeline, start_after)


def _redact(text: str, uri: str) -> str:
    """Never print the credentials of a URI (``user:password@``)."""
    userinfo = uri.split("://", 1)[-1].split("/", 1)[0].rpartition("@")[0]
    return text.replace(userinfo, "***") if userinfo else text


def _reach(client: MongoClient[dict[str, Any]], seconds: float) -> str | None:
    """``None`` once any member answers a ping; else one line saying what was tried."""
    try:
        with pymongo.timeout(seconds):
            client.admin.command("ping", read_preference=ReadPreference.NEAREST)
    except PyMongoError as exc:
        seeds = ", ".join(
            f"{host}:{port}" for host, port in client.topology_description.server_descriptions()
        )
        if getattr(exc, "timeout", False) or not hasattr(exc, "code"):
            return (f"could not reach the deployment ({seeds}) within {seconds:g} s: "
                    f"{describe_error(exc)}")
        return f"the deployment ({seeds}) refused the first command: {describe_error(exc)}"
    return None


def _say(message: str) -> None:
    print(f"changestream: {message}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM stops like Ctrl-C: the cursor is killed and the token file stays valid."""
    raise KeyboardInterrupt


def _log_level(args: argparse.Namespace) -> int:
    if args.log_level is not None:
        return int(getattr(logging, args.log_level))
    return {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)


def _watch(args: argparse.Namespace, client: MongoClient[dict[str, Any]], store: TokenStore,
           pipeline: list[Any], start_after: Any) -> int:
    logging.basicConfig(level=logging.WARNING, format="changestream: %(message)s")
    logging.getLogger("changestream").setLevel(_log_level(args))
    stop = threading.Event()
    status = StatusLine(sys.stderr) if args.status and sys.stderr.isatty() else None
    progress = WatchProgress(stop, status, args.until_idle)
    for handler in logging.getLogger().handlers:
        progress.attach(handler)
    # Also when started in the background, where SIGINT is inherited as ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    options: dict[str, Any] = {"max_await_time_ms": args.max_await_ms}
    if args.full_document is not None:
        options["full_document"] = args.full_document
    if args.full_document_before_change is not None:
        options["full_document_before_change"] = args.full_document_before_change
    if args.batch_size is not None:
        options["batch_size"] = args.batch_size
    if args.show_expanded_events:
        options["show_expanded_events"] = True
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
            _say(f"watching {namespace} {where}; Ctrl-C to stop")
        return stream

    printed = 0

    def print_change(change: Any) -> None:
        nonlocal printed
        sys.stdout.write(json_util.dumps(change, json_options=_RELAXED) + "\n")
        sys.stdout.flush()
        printed += 1
        if args.limit is not None and printed >= args.limit:
            stop.set()

    try:
        problem = _reach(client, args.connect_timeout)
        if problem is not None:
            _say(_redact(problem, args.uri))
            return 1
        if start_after is not None:
            store.save(start_after)
        consume(open_stream, print_change, store, stop=stop, on_stats=progress,
                stats_interval=progress.interval, call_timeout=args.call_timeout)
    except KeyboardInterrupt:
        progress.clear()
        saved = args.token_file and Path(args.token_file).is_file()
        _say("stopped" + (f"; the token is in {args.token_file}" if saved else ""))
        return 0
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): the unprinted change was not stored.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except StreamInvalidatedError as exc:
        _say(str(exc))
        _say(f"to continue, run again with --start-after '{token_to_json(exc.invalidate_token)}'")
        return 1
    except (ConsumeError, TokenStoreError) as exc:
        _say(_redact(str(exc), args.uri))
        return 1
    except PyMongoError as exc:
        _say(_redact(describe_error(exc), args.uri))
        return 1
    finally:
        progress.clear()
        client.close()
    if progress.idle_stop:
        _say(f"no change for {args.until_idle:g} s; stopped after {printed} changes")
    return 0
