"""Unique indexes and the duplicate-key error (11000) they raise.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from ..core.errors import CommandError
from .order import bson_repr, id_key
from .query import matches, path_values

if TYPE_CHECKING:
    pass

# -- errors ------------------------------------------------------------------------


class DuplicateKey(Exception):
    """A write would break a unique index (11000), with mongod's ``keyPattern``/``keyValue``."""

    def __init__(self, ns: str, index: dict[str, Any], key_value: dict[str, Any], legacy: bool):
        self.key_pattern = dict(index["key"])
        self.key_value = key_value
        shown = (
            "{ " + ", ".join(f": {bson_repr(v)}" for v in key_value.values()) + " }"
            if legacy
            else bson_repr(key_value)
        )
        self.errmsg = (
            f"E11000 duplicate key error collection: {ns} index: {index['name']} dup key: {shown}"
        )
        super().__init__(self.errmsg)

    def command_error(self) -> CommandError:
        return CommandError(
            11000, self.errmsg, extra={"keyPattern": self.key_pattern, "keyValue": self.key_value}
        )

    def write_error(self, index: int) -> dict[str, Any]:
        """The ``writeErrors`` entry (``index, code, keyPattern, keyValue, errmsg``)."""
        return {
            "index": index,
            "code": 11000,
            "keyPattern": self.key_pattern,
            "keyValue": self.key_value,
            "errmsg": self.errmsg,
        }


# -- indexes -------------------------------------------------------------------------


class _UniqueIndex:
    """Enforces one unique index: index key -> ``_id`` key of the owning document."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.fields = list(spec["key"])
        self.sparse = bool(spec.get("sparse"))
        self.partial = spec.get("partialFilterExpression")
        self.entries: dict[Hashable, Hashable] = {}

    def keys_for(self, doc: dict[str, Any]) -> list[tuple[Hashable, dict[str, Any]]]:
        """The index keys of ``doc`` (several for arrays), each with its ``keyValue``."""
        if self.partial is not None and not matches(self.partial, doc):
            return []
        per_field: list[list[Any]] = []
        present = False
        for field in self.fields:
            values = path_values(doc, field)
            present = present or bool(values)
            expanded: list[Any] = []
            for v in values or [None]:
                if isinstance(v, list):
                    expanded.extend(v if v else [None])
                else:
                    expanded.append(v)
            per_field.append(expanded)
        if self.sparse and not present:
            return []
        keys: list[tuple[Hashable, dict[str, Any]]] = []
        for combo in itertools.product(*per_field):
            keys.append(
                (tuple(id_key(v) for v in combo), dict(zip(self.fields, combo, strict=False)))
            )
        return keys




