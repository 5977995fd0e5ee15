"""The command registry, built from an explicit list of command modules.

A module that fails to import fails the import of this one: there is no
optional command module.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType, ModuleType

from . import (
    admin,
    aggregate,
    auth,
    bulk_write,
    crud,
    cursors,
    ddl,
    diagnostics,
    failpoints,
    fcv,
    indexes,
    listing,
    reads,
    transactions,
    users,
)
from .spec import CommandSpec, specs_of

MODULES: tuple[ModuleType, ...] = (
    admin,
    auth,
    crud,
    reads,
    bulk_write,
    ddl,
    diagnostics,
    fcv,
    indexes,
    listing,
    cursors,
    failpoints,
    transactions,
    aggregate,
    users,
)
"""Every module that defines commands."""


def build_registry(modules: tuple[ModuleType, ...] = MODULES) -> Mapping[str, CommandSpec]:
    """Command name (and alias) -> spec, from the handlers ``modules`` mark with ``@command``."""
    registry: dict[str, CommandSpec] = {}
    for module in modules:
        for value in vars(module).values():
            for name, spec in specs_of(value):
                known = registry.get(name)
                if known is not None and known.handler is not spec.handler:
                    raise RuntimeError(f"command {name!r} is defined twice")
                registry[name] = spec
    return MappingProxyType(registry)


REGISTRY: Mapping[str, CommandSpec] = build_registry()
"""Read-only: the dispatcher of every deployment shares it."""
