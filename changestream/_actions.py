"""The machine's vocabulary with its shells: what it asks them to do, and what they tell it.

:class:`~changestream._machine.ChangeStreamMachine` answers
:meth:`~changestream._machine.ChangeStreamMachine.next_action` with one of these
actions (a command to run, or the operation's end) and is fed back a reply with
its :class:`ReplyInfo` or an :class:`ErrorInfo`. They are plain frozen data, no
driver types, so the machine stays testable without a server and both shells
(and the tests' fake servers) speak the same terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ._options import ChangeStreamOptions

__all__ = [
    "Action",
    "Command",
    "Deliver",
    "ErrorInfo",
    "KillCursors",
    "NoDocument",
    "Raise",
    "ReplyInfo",
    "RunAggregate",
    "RunGetMore",
    "StreamSpec",
]


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    """A failed command, described without reference to any driver's exception types."""

    exception: BaseException
    """What the shell raises if the machine gives up."""
    code: int | None = None
    """Server error code; ``None`` for client-side errors."""
    labels: frozenset[str] = frozenset()
    wire_version: int | None = None
    """``maxWireVersion`` of the connection that ran the command (``None``: none was obtained)."""
    is_network: bool = False
    """Not a server error: network failure, server selection failure, ..."""
    is_timeout: bool = False
    """The client-side operation timeout (CSOT ``timeoutMS``) of this call expired."""
    is_server_selection: bool = False


@dataclasses.dataclass(frozen=True)
class ReplyInfo:
    """Where a successful command ran."""

    address: Any
    """Opaque server handle; later getMore/killCursors must go to the same server."""
    wire_version: int
    load_balanced: bool = False
    """It ran through a load balancer: the cursor lives on that one connection
    (load-balancers spec), so it dies with it."""


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """Everything the machine needs to know about one stream, fixed at ``watch()``."""

    database: str
    collection: str | None
    cluster: bool
    options: ChangeStreamOptions
    read_preference: Any = None
    """Opaque; every aggregate (initial and resume) selects a server with it."""
    read_concern: Any = None
    """Opaque; handed to the transport with every aggregate."""
    retry_reads: bool = True
    decode: Callable[[Mapping[str, Any]], Any] | None = None
    """Turns an event into what the user receives (``None``: as received); runs before the token is cached."""


@dataclasses.dataclass(frozen=True)
class RunAggregate:
    """Select a server with ``read_preference`` and run ``command`` on ``database``."""

    command: dict[str, Any]
    database: str
    read_preference: Any
    read_concern: Any
    is_resume: bool
    attempt: int = 1
    """2 for the retryable-reads retry of a failed aggregate."""


@dataclasses.dataclass(frozen=True)
class RunGetMore:
    """Run ``command`` on the server at ``address`` (the one holding the cursor).

    CSOT: ``maxTimeMS`` is ``maxAwaitTimeMS`` or absent. Under a client-side
    timeout the transport must lower it to ``remaining - minRTT`` when that is
    smaller, and must never add one (spec: ``min(maxAwaitTimeMS, remaining -
    minRoundTripTime)`` only when ``maxAwaitTimeMS`` is set).
    """

    command: dict[str, Any]
    database: str
    address: Any


@dataclasses.dataclass(frozen=True)
class KillCursors:
    """Best effort: run on ``address`` only; the machine ignores the outcome."""

    command: dict[str, Any]
    database: str
    address: Any


@dataclasses.dataclass(frozen=True)
class Deliver:
    """The operation returns ``document`` to the user."""

    document: Any


@dataclasses.dataclass(frozen=True)
class NoDocument:
    """The operation returns nothing (``try_next`` gives ``None``; a closed stream stops iterating)."""


@dataclasses.dataclass(frozen=True)
class Raise:
    """The operation fails with ``error``."""

    error: BaseException


Command = RunAggregate | RunGetMore | KillCursors
Action = RunAggregate | RunGetMore | KillCursors | Deliver | NoDocument | Raise
