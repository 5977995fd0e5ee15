"""How a command is declared: its handler and the flags the dispatcher obeys.

Handlers are plain functions ``handler(ctx) -> dict`` marked with :func:`command`.
They return the reply fields without ``ok``, ``$clusterTime`` and
``operationTime`` (the dispatcher adds those) and raise
:class:`~changestream.testing.core.errors.CommandError` to fail. Marking a
handler registers nothing: :mod:`.registry` lists the command modules and
collects their marked handlers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.context import CommandContext

Handler = Callable[[CommandContext], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """How the dispatcher treats a command."""

    name: str
    handler: Handler
    admin_only: bool = False
    """Only runs against the ``admin`` database (else Unauthorized 13)."""
    write: bool = False
    """Needs a writable primary (else NotWritablePrimary 10107)."""
    locks: bool = True
    """Run while holding ``deployment.lock`` (getMore waits without it)."""
    standalone_ok: bool = True
    secondary_ok: bool = True
    """Reads allowed on a secondary when the request has a secondaryOk read preference."""
    any_member: bool = False
    """Runs on a secondary whatever the read preference (mongod's
    ``AllowedOnSecondary::kAlways``: hello, getMore, killCursors, ...)."""
    handshake: bool = False
    """Allowed over OP_QUERY on 5.1+ (hello/isMaster)."""
    auth: bool = True
    """Needs an authenticated connection when the deployment has users (mongod's
    ``requiresAuth``; else Unauthorized 13)."""
    requires: str | None = None
    """A :class:`~changestream.testing.core.versions.VersionProfile` flag the command needs;
    without it the command does not exist (CommandNotFound, as on older servers)."""



_SPECS_ATTR = "__command_specs__"


def command(*names: str, **flags: Any) -> Callable[[Handler], Handler]:
    """Mark ``handler`` as the command ``names[0]`` (the others are aliases sharing its flags)."""

    def mark(handler: Handler) -> Handler:
        specs: tuple[tuple[str, CommandSpec], ...] = getattr(handler, _SPECS_ATTR, ())
        added = tuple((name, CommandSpec(name=names[0], handler=handler, **flags)) for name in names)
        setattr(handler, _SPECS_ATTR, specs + added)
        return handler

    return mark


def specs_of(value: object) -> tuple[tuple[str, CommandSpec], ...]:
    """The ``(name, spec)`` pairs :func:`command` marked ``value`` with (none if unmarked)."""
    specs: tuple[tuple[str, CommandSpec], ...] = getattr(value, _SPECS_ATTR, ())
    return specs
