"""``python -m changestream.testing serve``: run a simulated deployment until interrupted."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from .core.versions import DEFAULT_VERSION, VERSIONS
from .replset import ReplicaSet
from .storage.persist import DbPathError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m changestream.testing",
        description="A wire-level MongoDB replica-set simulator for tests.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a simulated deployment and print its URI")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port", type=int, default=27017, help="first member's port (0: free ports)"
    )
    serve.add_argument(
        "--version",
        default=DEFAULT_VERSION,
        choices=sorted(VERSIONS),
        help="emulated server version",
    )
    serve.add_argument("--members", type=int, default=1, help="replica-set members (default 1)")
    serve.add_argument(
        "--standalone", action="store_true", help="a standalone mongod instead of a replica set"
    )
    serve.add_argument("--set-name", default="rs0", help="replica-set name (default rs0)")
    serve.add_argument(
        "--oplog-max-entries", type=int, default=None, help="truncate the oplog beyond N entries"
    )
    serve.add_argument(
        "--event-cache-mb",
        type=int,
        default=None,
        help="memory for re-serving already built change events (default 64)",
    )
    serve.add_argument(
        "--dbpath",
        default=None,
        help="keep the data, oplog and cluster time in DIR across restarts "
        "(default: in memory only)",
    )
    serve.add_argument(
        "--auth",
        action="append",
        default=[],
        metavar="USER:PASSWORD",
        help="require authentication (SCRAM) and create this user in admin; repeatable",
    )
    serve.add_argument(
        "--networkMessageCompressors",
        dest="compressors",
        default=None,
        help="mongod's option: e.g. 'zlib', 'zlib,noop' or 'disabled' "
        "(default: snappy,zstd,zlib, those available)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and serve until Ctrl-C or SIGTERM; return the exit status."""
    args = _parser().parse_args(argv)
    if args.standalone and args.members != 1:
        print("error: --standalone runs exactly one member", file=sys.stderr)
        return 2
    users: dict[str, str] = {}
    for spec in args.auth:
        user, sep, password = spec.partition(":")
        if not sep or not user or not password:
            print("error: --auth takes USER:PASSWORD (both non-empty)", file=sys.stderr)
            return 2
        users[user] = password
    try:
        rs = ReplicaSet(
            args.version,
            args.members,
            standalone=args.standalone,
            set_name=args.set_name,
            port=args.port,
            host=args.host,
            oplog_max_entries=args.oplog_max_entries,
            compressors=args.compressors,
            event_cache_bytes=None
            if args.event_cache_mb is None
            else args.event_cache_mb * 1024 * 1024,
            dbpath=args.dbpath,
            users=users,
        ).start()
    except DbPathError as exc:
        print(f"error: --dbpath {args.dbpath}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(
            f"error: cannot start the simulator on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    done = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_signal)
    try:
        print(rs.uri, flush=True)
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        rs.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
