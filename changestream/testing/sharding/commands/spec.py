"""How a mongos command is declared: a handler ``(router, ctx) -> dict`` and the
dispatcher's flags (those of :class:`~changestream.testing.commands.spec.CommandSpec`).

Marking a handler registers nothing: :mod:`.registry` lists the modules and
binds their handlers to one :class:`~..router.Router` per mongos.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...core.context import CommandContext

if TYPE_CHECKING:
    from ..router import Router

RouterHandler = Callable[["Router", CommandContext], dict[str, Any]]
_MARK = "__router_commands__"


def router_command(*names: str, **flags: Any) -> Callable[[RouterHandler], RouterHandler]:
    """Mark ``handler`` as mongos's command ``names[0]`` (the others are aliases)."""

    def mark(handler: RouterHandler) -> RouterHandler:
        marks = getattr(handler, _MARK, ())
        setattr(handler, _MARK, (*marks, *((name, {"name": names[0], **flags}) for name in names)))
        return handler

    return mark


def marks_of(value: object) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The ``(name, flags)`` pairs :func:`router_command` marked ``value`` with."""
    marks: tuple[tuple[str, dict[str, Any]], ...] = getattr(value, _MARK, ())
    return marks
