"""What ``changestream watch`` and ``changestream mirror`` share.

Argument types and checks (one line and exit status 2 for a mistake), opening
the client without connecting, reaching the deployment at start (one line
saying what was tried), logging on stderr and never printing credentials.
The subcommand modules import from here; this module imports none of them.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
import time
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

import pymongo
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.errors import PyMongoError
from pymongo.read_preferences import ReadPreference

from .. import ConsumeError, TokenStoreError, describe_error
from .._consumer.dead_ends import DEAD_END_MARK
from .._diagnosis import authentication_failed, wrong_credentials_message
from .._position import reply_cluster_time

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "Parser",
    "call_seconds",
    "collection_name",
    "database_name",
    "failure_line",
    "log_level",
    "milliseconds",
    "one_line",
    "open_client",
    "positive_int",
    "reach",
    "redact",
    "say",
    "seconds",
    "setup_logging",
    "sink_failure",
    "version",
]

INT32_MAX = 2**31 - 1
DEFAULT_CONNECT_TIMEOUT = 10.0
"""Seconds ``watch`` waits to reach the deployment the first time before giving up (exit 1)."""


class Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def milliseconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of ms, not {text!r}") from None
    if not 0 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"must be between 0 and {INT32_MAX} ms, not {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, not {text}")
    return value


def call_seconds(text: str) -> float:
    """A per-call time limit: finite, more than 0, at most a day."""
    value = seconds(text)
    if not math.isfinite(value) or value > 86400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 86400 s, not {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


_DATABASE_FORBIDDEN = ' ./\\"$\x00'


def database_name(text: str) -> str:
    """``--db``: a name the server accepts (an empty one would silently mean "everything")."""
    if not text:
        raise argparse.ArgumentTypeError(
            "a database name cannot be empty (leave --db out to watch every database)")
    bad = next((char for char in text if char in _DATABASE_FORBIDDEN), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a database name: it cannot contain {bad!r}")
    if len(text.encode()) >= 64:
        raise argparse.ArgumentTypeError(
            f"{text[:20]!r}... is not a database name: at most 63 bytes")
    return text


def collection_name(text: str) -> str:
    """``--coll``: a name of a collection that can hold documents (not ``$cmd`` and the like)."""
    if not text:
        raise argparse.ArgumentTypeError("a collection name cannot be empty")
    if "$" in text or "\x00" in text:
        bad = "$" if "$" in text else "\\x00"
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a collection name: it cannot contain {bad!r}")
    if text.startswith(".") or text.endswith(".") or ".." in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a collection name: no empty part between dots")
    return text


def version() -> str:
    from .. import __version__

    return f"changestream {__version__} (PyMongo {pymongo.version})"


def say(message: str) -> None:
    """A message for the user: one line on stderr (stdout holds only the data)."""
    print(f"changestream: {one_line(message)}", file=sys.stderr, flush=True)


_TERMINAL_CODES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_CAUSE_MARKS = "\u21b3 "
"""How Rust libraries (deltalake's object store) start each cause on a line of its own."""


def one_line(text: str) -> str:
    """``text`` without colour codes, its lines joined by ": " (a chain of causes reads on)."""
    lines = (line.strip().lstrip(_CAUSE_MARKS) for line in _TERMINAL_CODES.sub("", text).splitlines())
    return ": ".join(line for line in lines if line)


def redact(text: str, uri: str) -> str:
    """Never print the credentials of a URI (``user:password@``)."""
    userinfo = uri.split("://", 1)[-1].split("/", 1)[0].rpartition("@")[0]
    return text.replace(userinfo, "***") if userinfo else text


def open_client(parser: argparse.ArgumentParser, uri: str) -> MongoClient[dict[str, Any]]:
    """A client for ``uri`` that has not connected yet; a URI mistake is a usage error."""
    if not uri.startswith(("mongodb://", "mongodb+srv://")):
        scheme = uri.split("://", 1)[0] + "://" if "://" in uri else repr(uri[:20])
        parser.error(f"the URI must start with mongodb:// or mongodb+srv://, not {scheme}")
    try:
        return MongoClient(uri, connect=False)
    except (PyMongoError, ValueError, TypeError) as exc:
        parser.error(f"invalid URI: {redact(describe_error(exc), uri)}")


def log_level(args: argparse.Namespace) -> int:
    """``--log-level`` if given, else ``-v``'s count: WARNING, INFO, DEBUG."""
    if args.log_level is not None:
        return int(getattr(logging, args.log_level))
    return {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)


def setup_logging(args: argparse.Namespace) -> None:
    """Log records on stderr, prefixed like the command's own messages."""
    logging.basicConfig(level=logging.WARNING, format="changestream: %(message)s")
    logging.getLogger("changestream").setLevel(log_level(args))


def not_dead_end(record: logging.LogRecord) -> bool:
    """A log filter: ``consume`` logs the error it stops with, and the command prints that line
    itself as its exit message (once)."""
    return not getattr(record, DEAD_END_MARK, False)


def reach(client: MongoClient[dict[str, Any]], timeout: float, uri: str) -> str | None:
    """``None`` once any member answers a ping; else one line saying what was tried.

    Pings in short rounds so failed authentication is reported at once: after
    it, PyMongo leaves the member unselectable until its next heartbeat.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with pymongo.timeout(max(min(left, 0.5), 0.01)):
                client.admin.command("ping", read_preference=ReadPreference.NEAREST)
            return None
        except PyMongoError as exc:
            failure = _auth_failure(client, exc)
            if failure is not None:
                return (f"the deployment ({hosts(uri)}): {wrong_credentials_message()}. "
                        f"Server: {describe_error(failure)}")
            timed_out = getattr(exc, "timeout", False) or not hasattr(exc, "code")
            if not timed_out:
                return (f"the deployment ({hosts(uri)}) refused the first command: "
                        f"{describe_error(exc)}")
            if time.monotonic() >= deadline:
                return (f"could not reach the deployment ({hosts(uri)}) within {timeout:g} s: "
                        f"{describe_error(exc)}{_set_name_hint(exc, uri)}")


def cluster_time(client: MongoClient[dict[str, Any]]) -> Timestamp | None:
    """The deployment's cluster time now (``None``: it keeps none, e.g. a standalone server).

    ``--until-idle`` stops only once the stream's token has reached it: the table (or the
    output) then holds every change made before the command started.
    """
    try:
        return reply_cluster_time(client.admin.command("ping"))
    except PyMongoError:
        return None


def _auth_failure(client: MongoClient[dict[str, Any]], exc: PyMongoError) -> BaseException | None:
    """The authentication error behind ``exc`` (or a member's last error), if any."""
    if authentication_failed(exc):
        return exc
    for description in client.topology_description.server_descriptions().values():
        if description.error is not None and authentication_failed(description.error):
            return description.error
    return None


def hosts(uri: str) -> str:
    """The hosts as written in the URI (an SRV name is marked so), never its credentials."""
    rest = uri.split("://", 1)[-1]
    listed = rest.split("/", 1)[0].split("?", 1)[0].rpartition("@")[2]
    return f"{listed} (SRV)" if uri.startswith("mongodb+srv://") else listed


def _set_name_hint(exc: PyMongoError, uri: str) -> str:
    """A wrong ``replicaSet`` name removes every member from the topology: say so."""
    wanted = parse_qs(urlsplit(uri).query).get("replicaSet")
    if not wanted or "No replica set members available for replica set name" not in str(exc):
        return ""
    return (f"; no member answered as replica set {wanted[0]!r}: check that the URI's "
            f"replicaSet= is the set's name (rs.status().set), or leave it out")


def failure_line(exc: BaseException, uri: str, target: str, sink: Any) -> str:
    """The one line ``mirror`` ends with for ``exc``: a dead end's own advice, the server's
    error, or the table's failure (:func:`sink_failure`), never the URI's credentials."""
    if isinstance(exc, (ConsumeError, TokenStoreError)):
        text = str(exc)
    elif isinstance(exc, PyMongoError):
        text = describe_error(exc)
    else:
        text = sink_failure(exc, target, sink)
    return redact(text, uri)


def sink_failure(exc: BaseException, target: str, sink: Any) -> str:
    """One line for a failure of the table itself: what happened and what to do."""
    text = str(exc)
    errno = getattr(exc, "errno", None)
    if errno == 28 or "No space left on device" in text or "os error 28" in text:
        try:
            version = sink.applied_version
        except Exception:  # the table cannot even be read
            version = None
        held = "nothing yet" if version is None else f"batch {version}"
        return (f"the disk holding {target} is full (No space left on device): the failed "
                f"batch was not committed and the table holds {held}; free some space, then "
                f"run again: it resumes from there")
    return f"{type(exc).__name__}: {text}"  # (say() makes it one line)
