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
import logging
import os
import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from bson import json_util
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from ._api import watch
from ._consume import ConsumeError, StreamInvalidatedError, consume
from ._stream import ChangeStream
from ._token import token_from_json, token_to_json
from .stores import FileTokenStore, MemoryTokenStore, TokenStore, TokenStoreError

__all__ = ["main"]

_RELAXED = json_util.RELAXED_JSON_OPTIONS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="changestream",
        description="MongoDB change streams from the command line.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    watch_parser = sub.add_parser(
        "watch",
        help="print changes as JSON lines, resuming from a token file",
        description="Print every change as one line of relaxed Extended JSON. Without --db the "
        "whole deployment is watched; --db alone watches a database.",
    )
    watch_parser.add_argument("uri", metavar="URI", help="MongoDB connection string")
    watch_parser.add_argument("--db", help="database to watch (default: every database)")
    watch_parser.add_argument("--coll", help="collection to watch (needs --db)")
    watch_parser.add_argument(
        "--pipeline", default="[]", metavar="JSON",
        help='stages after $changeStream, e.g. \'[{"$match": {"operationType": "insert"}}]\'',
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
    watch_parser.add_argument(
        "--start-after", metavar="TOKEN_JSON",
        help="start after this token (e.g. an invalidate token), replacing the token file's",
    )
    watch_parser.add_argument(
        "--max-await-ms", type=int, default=1000, metavar="MS",
        help="how long each getMore waits for changes (default 1000)",
    )
    sub.add_parser(
        "serve", add_help=False,
        help="run the replica-set simulator (see 'changestream serve --help')",
    )
    sub.add_parser("demo", add_help=False, help="a failover demo on the simulator, in seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["serve"]:
        from .testing.cli import main as serve

        return serve(arguments)
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
    if args.start_after is not None:
        try:
            start_after = token_from_json(args.start_after)
        except ValueError as exc:
            parser.error(f"--start-after: {exc}")
    return _watch(args, pipeline, start_after)


def _say(message: str) -> None:
    print(f"changestream: {message}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM stops like Ctrl-C: the cursor is killed and the token file stays valid."""
    raise KeyboardInterrupt


def _watch(args: argparse.Namespace, pipeline: list[Any], start_after: Any) -> int:
    logging.basicConfig(level=logging.WARNING, format="changestream: %(message)s")
    # Also when started in the background, where SIGINT is inherited as ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    store: TokenStore = (
        FileTokenStore(args.token_file) if args.token_file else MemoryTokenStore()
    )
    options: dict[str, Any] = {"max_await_time_ms": args.max_await_ms}
    if args.full_document is not None:
        options["full_document"] = args.full_document
    if args.full_document_before_change is not None:
        options["full_document_before_change"] = args.full_document_before_change
    namespace = ".".join(part for part in (args.db, args.coll) if part) or "the deployment"
    client: MongoClient[dict[str, Any]] = MongoClient(args.uri)
    target: Any = client
    if args.db:
        target = client[args.db][args.coll] if args.coll else client[args.db]

    opened: list[bool] = []

    def open_stream(token: Mapping[str, Any] | None) -> ChangeStream[Any]:
        # startAfter also accepts an invalidate token; otherwise it acts as resumeAfter.
        start = {} if token is None else {"start_after": token}
        stream: ChangeStream[Any] = watch(target, pipeline, **start, **options)
        if not opened:
            opened.append(True)
            where = (
                "from now" if token is None
                else f"after the token in {args.token_file}" if args.token_file
                else "after the given token"
            )
            _say(f"watching {namespace} {where}; Ctrl-C to stop")
        return stream

    def print_change(change: Any) -> None:
        sys.stdout.write(json_util.dumps(change, json_options=_RELAXED) + "\n")
        sys.stdout.flush()

    try:
        if start_after is not None:
            store.save(start_after)
        consume(open_stream, print_change, store)
    except KeyboardInterrupt:
        _say("stopped" + (f"; the token is in {args.token_file}" if args.token_file else ""))
        return 0
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): the unprinted change was not stored.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except StreamInvalidatedError as exc:
        _say(str(exc))
        _say(f"to continue, run again with --start-after '{token_to_json(exc.invalidate_token)}'")
        return 1
    except (ConsumeError, TokenStoreError, PyMongoError) as exc:
        _say(str(exc))
        return 1
    finally:
        client.close()
    return 0
