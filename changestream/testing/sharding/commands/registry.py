"""The mongos command table, built from an explicit list of modules.

The mongod commands that act on the mongos itself (``ping``, ``getMore``,
failpoints, ...) are shared with mongod's table; the others are mongos's own.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

from ...commands.registry import REGISTRY as MONGOD_COMMANDS
from ...commands.spec import CommandSpec
from . import admin, ddl, handshake, reads, writes
from .spec import marks_of

if TYPE_CHECKING:
    from ..router import Router

MODULES: tuple[ModuleType, ...] = (handshake, writes, reads, ddl, admin)
"""Every module that defines mongos commands."""

_SHARED = (
    "buildInfo", "buildinfo", "ping", "serverStatus", "hostInfo",
    "connectionStatus", "whatsmyuri", "getCmdLineOpts", "endSessions", "refreshSessions",
    "killSessions", "killAllSessions", "getMore", "killCursors", "configureFailPoint",
    "waitForFailPoint", "saslStart", "saslContinue", "usersInfo", "createUser", "updateUser",
    "dropUser", "dropAllUsersFromDatabase", "grantRolesToUser", "revokeRolesFromUser",
)  # fmt: skip
"""mongod commands that behave the same on mongos (they act on the mongos itself; the
users are the cluster's, shared by every mongos)."""


def registry_for(router: Router) -> dict[str, CommandSpec]:
    """The mongos command table: the shared mongod commands plus the routed ones."""
    registry = {name: MONGOD_COMMANDS[name] for name in _SHARED if name in MONGOD_COMMANDS}
    for module in MODULES:
        for value in vars(module).values():
            for name, flags in marks_of(value):
                registry[name] = CommandSpec(handler=functools.partial(value, router), **flags)
    return registry
