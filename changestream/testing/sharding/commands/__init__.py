"""mongos's commands, split as mongod's :mod:`changestream.testing.commands` is: one
module per area, an explicit :mod:`.registry`. Handlers take the mongos's
:class:`~..router.Router` and the command context."""

from __future__ import annotations

from .registry import MODULES, registry_for
from .spec import router_command

__all__ = ["MODULES", "registry_for", "router_command"]
