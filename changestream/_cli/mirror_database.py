"""``changestream mirror`` without ``--coll``: every collection of a database, one table each.

:class:`changestream.delta.DatabaseSink` under :func:`changestream.consume`:
one change stream on the database, one Delta table per collection under
``--to/<collection>``, each with its own position (exactly once on its own).
Collections without a table are copied while the stream goes on. The status
line and ``--until-idle`` are ``mirror``'s; ``--until-idle`` also waits for
the copies, then compacts every table.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from pymongo import MongoClient

from .. import StreamInvalidatedError, consume
from .common import cluster_time, failure_line, log_level, not_dead_end, reach, redact, say
from .progress import StatusLine, WatchProgress

__all__ = ["mirror_database"]


def _include(args: argparse.Namespace) -> Any:
    """The collections ``--coll-regex`` and ``--exclude`` pick (whole names)."""
    pick, leave = args.coll_regex, list(args.exclude)

    def include(name: str) -> bool:
        if pick is not None and not pick.fullmatch(name):
            return False
        return not any(pattern.fullmatch(name) for pattern in leave)

    return include


def mirror_database(args: argparse.Namespace, client: MongoClient[dict[str, Any]]) -> int:
    """Run the database mirror; returns the exit status."""
    from ..delta import DatabaseDroppedError, DatabaseSink

    logging.basicConfig(level=logging.WARNING, format="changestream: %(message)s")
    logging.getLogger("changestream").setLevel(log_level(args))
    stop = threading.Event()
    status = StatusLine(sys.stderr) if args.status and sys.stderr.isatty() else None
    progress = WatchProgress(stop, status, args.until_idle)
    for handler in logging.getLogger().handlers:
        progress.attach(handler)
        handler.addFilter(not_dead_end)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sink = DatabaseSink(
        args.to, client[args.db], app_id=args.app_id, include=_include(args),
        full_document=args.full_document, json_mode=args.json_mode,
        batch_bytes=args.batch_mb << 20,
        watch_options={"max_await_time_ms": 500,
                       **({"reassemble_split_events": True} if args.oversize == "split" else {})},
    )
    result = None
    try:
        problem = reach(client, args.connect_timeout, args.uri)
        if problem is not None:
            say(redact(problem, args.uri))
            return 1
        if args.until_idle is not None:
            progress.caught_up_to = cluster_time(client)
        sink.load()
        copying = sink.copying
        held = len(sink.tables) - len(copying)
        say(f"mirroring the database {args.db} into {args.to}: {held} tables from their last "
             f"commit, {len(copying)} to copy first; Ctrl-C to stop")
        result = consume(
            sink.open_stream, sink, sink, save_every=args.batch, save_interval=args.batch_seconds,
            stop=stop, on_stats=progress,
            stats_interval=progress.interval, stop_on_signals=True,
        )
        if progress.idle_stop:  # caught up: the copies finish, every table is compacted
            sink.finish()
    except KeyboardInterrupt:
        say("stopped")
        return 0
    except DatabaseDroppedError as exc:
        progress.clear()
        say(str(exc))
        return 1
    except StreamInvalidatedError as exc:
        progress.clear()
        say(f"the database {args.db} was dropped; its tables hold their last state: {exc}")
        return 1
    except Exception as exc:  # a dead end, the server's error, a table's (a full disk, ...)
        progress.clear()
        say(failure_line(exc, args.uri, args.to, None))
        return 1
    finally:
        sink.close()
        for handler in logging.getLogger().handlers:
            handler.removeFilter(not_dead_end)
        progress.clear()
        client.close()
    why = f"no change for {args.until_idle:g} s" if progress.idle_stop else "stopped"
    say(f"{why}; {result.handled} changes mirrored by this run into {len(sink.tables)} tables "
         f"under {args.to}")
    return 0
