"""The commands layer: parse a command, run it against storage, build the reply.

Command modules hold no state of their own (everything lives on the
:class:`~changestream.testing.storage.deployment.Deployment`). :mod:`.registry`
imports each of them explicitly and builds the read-only :data:`REGISTRY`.
"""

from __future__ import annotations

from ..core.context import CLIENT_CHECK_SECONDS, CommandContext, ConnectionInfo
from .registry import REGISTRY
from .spec import CommandSpec, Handler, command

__all__ = [
    "CLIENT_CHECK_SECONDS",
    "REGISTRY",
    "CommandContext",
    "CommandSpec",
    "ConnectionInfo",
    "Handler",
    "command",
]
