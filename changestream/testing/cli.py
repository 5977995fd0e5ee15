"""``python -m changestream.testing serve``: run a simulated deployment until interrupted."""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading
from types import FrameType
from typing import NoReturn

from .core.collector import IdleCollector
from .core.versions import DEFAULT_VERSION, VERSIONS
from .replset import ReplicaSet
from .sharding import ShardedCluster
from .storage.persist import DbPathError


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 2 (not the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


MAX_MEMBERS = 50
"""A replica set has at most 50 members (mongod's limit)."""


def _check_ports(port: int, members: int) -> str | None:
    """Why ``--port``/``--members`` cannot work (``None``: they can)."""
    if not 1 <= members <= MAX_MEMBERS:
        return f"--members must be between 1 and {MAX_MEMBERS}, not {members}"
    if not 0 <= port <= 65535:
        return f"--port must be between 0 and 65535, not {port}"
    if port and port + members - 1 > 65535:
        return (
            f"--port {port} with {members} members needs ports up to {port + members - 1}"
            " (above 65535); choose a lower --port or --port 0"
        )
    return None


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="A wire-level MongoDB replica-set simulator for tests.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a simulated deployment and print its URI",
        description="Serve a simulated MongoDB deployment until Ctrl-C or SIGTERM. The URI is "
        "the first line on stdout; a banner and a ready line go to stderr.",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port",
        type=int,
        default=27017,
        help="first member's port; the others follow (0: free ports) (default %(default)s)",
    )
    serve.add_argument(
        "--version",
        default=DEFAULT_VERSION,
        choices=sorted(VERSIONS),
        help="emulated server version (default %(default)s)",
    )
    serve.add_argument("--members", type=int, default=1, help="replica-set members (default 1)")
    serve.add_argument(
        "--sharded", action="store_true", help="a sharded cluster (mongoses on --port, --port+1...)"
    )
    serve.add_argument(
        "--shards", type=int, default=None, help="with --sharded: shards (default 2)"
    )
    serve.add_argument(
        "--mongoses", type=int, default=None, help="with --sharded: mongoses (default 2)"
    )
    serve.add_argument(
        "--load-balancer", action="store_true", help="with --sharded: a load balancer in front"
    )
    serve.add_argument(
        "--standalone", action="store_true", help="a standalone mongod instead of a replica set"
    )
    serve.add_argument("--set-name", default="rs0", help="replica-set name (default rs0)")
    serve.add_argument(
        "--oplog-max-entries",
        type=int,
        default=None,
        help="truncate the oplog beyond N entries (default: no limit)",
    )
    serve.add_argument(
        "--oplog-mb",
        type=float,
        default=None,
        metavar="MB",
        help="truncate the oplog beyond MB megabytes, like mongod's --oplogSize "
        "(default: no limit)",
    )
    serve.add_argument(
        "--noop-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="write a no-op oplog entry every SECONDS while idle, as mongod does, so idle "
        "streams advance (0: never) (default %(default)s)",
    )
    serve.add_argument(
        "--event-cache-mb",
        type=int,
        default=None,
        help="memory for re-serving already built change events (default 16)",
    )
    serve.add_argument(
        "--dbpath",
        default=None,
        metavar="DIR",
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


_SHARDED_ONLY = ("shards", "mongoses", "load_balancer")
_NOT_SHARDED = {
    "standalone": "--standalone",
    "oplog_mb": "--oplog-mb",
    "event_cache_mb": "--event-cache-mb",
    "compressors": "--networkMessageCompressors",
}


def _unsupported(args: argparse.Namespace) -> str | None:
    """An option the chosen deployment cannot honour (never shown as if it were on)."""
    if not args.sharded:
        for name in _SHARDED_ONLY:
            if getattr(args, name) not in (None, False):
                return f"--{name.replace('_', '-')} needs --sharded"
        return None
    for name, option in _NOT_SHARDED.items():
        if getattr(args, name) not in (None, False):
            return f"{option} is not supported with --sharded"
    if args.set_name != "rs0":
        return "--set-name is not supported with --sharded (shards are named shard0, shard1, ...)"
    for name in ("shards", "mongoses"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name} must be at least 1, not {value}"
    return None


def _banner(args: argparse.Namespace) -> str:
    kind = (
        f"sharded cluster, {args.shards} shards of {args.members} member"
        + ("s" if args.members != 1 else "")
        + f", {args.mongoses} mongos"
        + (" behind a load balancer" if args.load_balancer else "")
        if args.sharded
        else "standalone mongod"
        if args.standalone
        else f"replica set {args.set_name!r}, {args.members} member"
        + ("s" if args.members != 1 else "")
    )
    oplog = (
        f"oplog {args.oplog_mb:g} MB"
        if args.oplog_mb is not None
        else f"oplog {args.oplog_max_entries} entries"
        if args.oplog_max_entries is not None
        else "oplog unbounded"
    )
    noop = (
        "no periodic no-ops"
        if args.noop_interval <= 0 or args.standalone
        else f"no-op every {args.noop_interval:g} s"
    )
    data = "in memory" if args.dbpath is None else f"data in {args.dbpath}"
    auth = f"; authentication on ({len(args.auth)} user{'s' if len(args.auth) != 1 else ''})"
    return f"changestream simulator: MongoDB {args.version} {kind}; {oplog}; {noop}; {data}" + (
        auth if args.auth else ""
    )


def _port_in_use(args: argparse.Namespace) -> str:
    """A port already taken: say which, and that ``--port 0`` picks free ones."""
    several = args.sharded or args.members > 1
    ports = f"port {args.port} (or one after it)" if several else f"port {args.port}"
    return (
        f"cannot start the simulator: {ports} on {args.host} is in use (another mongod or "
        "simulator?); choose another --port, or --port 0 for free ports (the URI is the first "
        "line on stdout)"
    )


def _addresses(deployment: ReplicaSet | ShardedCluster) -> list[str]:
    if isinstance(deployment, ShardedCluster):
        return deployment.mongoses
    return deployment.members


def main(argv: list[str] | None = None, prog: str = "python -m changestream.testing") -> int:
    """Parse ``argv`` and serve until Ctrl-C or SIGTERM; return the exit status.

    ``prog`` is the command as the user typed it (``changestream`` when run as
    ``changestream serve``), for ``--help`` and error messages.
    """
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.standalone and args.members != 1:
        parser.error("--standalone runs exactly one member")
    problem = _check_ports(args.port, args.members)
    if problem is not None:
        parser.error(problem)
    users: dict[str, str] = {}
    for spec in args.auth:
        user, sep, password = spec.partition(":")
        if not sep or not user or not password:
            parser.error("--auth takes USER:PASSWORD (both non-empty)")
        users[user] = password
    problem = _unsupported(args)
    if problem is not None:
        parser.error(problem)
    args.shards = 2 if args.shards is None else args.shards
    args.mongoses = 2 if args.mongoses is None else args.mongoses
    if args.oplog_mb is not None and not args.oplog_mb > 0:
        parser.error(f"--oplog-mb must be > 0, not {args.oplog_mb:g}")
    if not args.noop_interval >= 0 or args.noop_interval == float("inf"):
        parser.error(f"--noop-interval must be a number of seconds >= 0, not {args.noop_interval}")
    deployment: ReplicaSet | ShardedCluster
    try:
        if args.sharded:
            deployment = ShardedCluster(
                args.version,
                shards=args.shards,
                mongoses=args.mongoses,
                members_per_shard=args.members,
                load_balancer=args.load_balancer,
                port=args.port,
                host=args.host,
                noop_interval=args.noop_interval,
                oplog_max_entries=args.oplog_max_entries,
                users=users,
                dbpath=args.dbpath,
            ).start()
        else:
            deployment = ReplicaSet(
                args.version,
                args.members,
                standalone=args.standalone,
                set_name=args.set_name,
                port=args.port,
                host=args.host,
                oplog_max_entries=args.oplog_max_entries,
                oplog_max_bytes=None if args.oplog_mb is None else int(args.oplog_mb * 1024 * 1024),
                noop_interval=args.noop_interval,
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
    except OSError as exc:
        message = (
            _port_in_use(args)
            if exc.errno == errno.EADDRINUSE
            else f"cannot start the simulator on {args.host}:{args.port}: {exc}"
        )
        print(f"error: {message}", file=sys.stderr)
        return 1
    except ValueError as exc:
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
        # Ctrl-C also when started in the background, where SIGINT is inherited as ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        print(_banner(args), file=sys.stderr, flush=True)
        print(deployment.uri, flush=True)
        if isinstance(deployment, ShardedCluster) and deployment.balancer is not None:
            print(deployment.lb_uri, flush=True)
        print(
            f"ready: listening on {', '.join(_addresses(deployment))}; Ctrl-C to stop",
            file=sys.stderr,
            flush=True,
        )
        with IdleCollector():  # full collections while idle: no pause amid a client's work
            while not done.wait(0.5):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    try:
        deployment.stop()
    except DbPathError as exc:
        print(f"error: --dbpath {args.dbpath}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
