"""An update (operator, replacement or pipeline) and what it did to one document.

Replacement updates log the whole new document; pipeline-style updates are
logged as the diff of the two images (:func:`~.diff.diff_or_replacement`);
an update that changes nothing produces no oplog entry at all.
"""

from __future__ import annotations

import re
from typing import Any

from bson.objectid import ObjectId
from bson.regex import Regex

from ..core.errors import CommandError
from ..storage import (
    bson_repr,
    copy_value,
    type_name,
    values_equal,
    values_identical,
)
from .apply import _Applier, _check_top_level_name, positional_match
from .diff import diff_or_replacement
from .parse import Outcome, UpdateEnv, _Node, _parse_array_filters, _parse_operator_update
from .pipeline import _set_path, apply_pipeline

# ======================================================================================
# The public entry points
# ======================================================================================


def is_operator_update(update: Any) -> bool:
    return isinstance(update, dict) and bool(update) and next(iter(update)).startswith("$")


class Update:
    """One parsed ``u`` of an update statement (operator, replacement or pipeline)."""

    def __init__(
        self,
        spec: Any,
        *,
        array_filters: list[Any] | None = None,
        multi: bool = False,
    ) -> None:
        self.spec = spec
        self.tree: _Node | None = None
        self.positional = False
        self.filters: dict[str, dict[str, Any]] = {}
        if isinstance(spec, list):
            self.kind = "pipeline"
            if array_filters:
                raise CommandError(
                    9, "arrayFilters may not be specified for pipeline-style updates"
                )
        elif not isinstance(spec, dict):
            raise CommandError(
                14,
                f"BSON field 'update.updates.u' is the wrong type '{type_name(spec)}', expected "
                "type 'object' or 'array'",
            )
        elif is_operator_update(spec):
            self.kind = "operator"
            self.tree, self.positional = _parse_operator_update(spec, array_filters)
            self.filters = _parse_array_filters(array_filters)
        else:
            self.kind = "replacement"
            if multi:
                raise CommandError(9, "multi update is not supported for replacement-style update")
            if array_filters:
                raise CommandError(
                    2, "arrayFilters may not be specified for replacement-style updates"
                )
            for name in spec:
                _check_top_level_name(name)

    def apply(
        self,
        doc: dict[str, Any],
        env: UpdateEnv,
        *,
        query: dict[str, Any] | None = None,
        is_insert: bool = False,
    ) -> Outcome:
        """Apply to ``doc`` (not modified); the new document and what to log."""
        if self.kind == "replacement":
            return self._replace(doc)
        if self.kind == "pipeline":
            return self._pipeline(doc)
        assert self.tree is not None
        work = copy_value(doc)
        matched = positional_match(query or {}, doc) if self.positional else None
        applier = _Applier(
            work, env, is_insert=is_insert, matched=matched, array_filters=self.filters
        )
        modified = applier.apply(self.tree, None, None, work, [], [])
        if not modified or applier.log is None or applier.log.empty:
            return Outcome(doc, None)
        return Outcome(work, {"$v": 2, "diff": applier.log.serialize()})

    def _replace(self, doc: dict[str, Any]) -> Outcome:
        new: dict[str, Any] = {}
        if "_id" in doc:
            if "_id" in self.spec and not values_equal(self.spec["_id"], doc["_id"]):
                raise _id_altered(self.spec["_id"])
            new["_id"] = doc["_id"]
        for name, value in self.spec.items():
            if name != "_id" or "_id" not in new:
                new[name] = copy_value(value)
        if values_identical(new, doc):
            return Outcome(doc, None)
        return Outcome(new, copy_value(new), replacement=True)

    def _pipeline(self, doc: dict[str, Any]) -> Outcome:
        result = apply_pipeline(self.spec, doc)
        new: dict[str, Any] = {}
        if "_id" in doc:
            if "_id" in result and not values_equal(result["_id"], doc["_id"]):
                raise _id_altered(result["_id"])
            new["_id"] = doc["_id"]
        for name, value in result.items():
            if name != "_id" or "_id" not in new:
                new[name] = value
        kind, diff = diff_or_replacement(doc, new)
        if kind == "noop":
            return Outcome(doc, None)
        if kind == "diff":
            assert diff is not None
            return Outcome(new, {"$v": 2, "diff": diff})
        return Outcome(new, copy_value(new), replacement=True)

    def upsert_document(self, query: dict[str, Any], env: UpdateEnv) -> dict[str, Any]:
        """The document an upsert inserts: query equalities + the update, ``_id`` first."""
        if self.kind == "replacement":
            seed: dict[str, Any] = {}
            equalities = _equalities(query)
            if "_id" in equalities:
                seed["_id"] = equalities["_id"]
            doc = self._replace(seed).doc if seed else copy_value(self.spec)
        else:
            seed = {}
            for path, value in sorted(_equalities(query).items()):
                _set_path(seed, path, copy_value(value))
            if self.kind == "pipeline":
                doc = apply_pipeline(self.spec, seed)
            else:
                doc = self.apply(seed, env, is_insert=True).doc
        if "_id" not in doc:
            return {"_id": ObjectId(), **doc}
        if next(iter(doc)) != "_id":
            return {"_id": doc["_id"], **{k: v for k, v in doc.items() if k != "_id"}}
        return doc


def _id_altered(value: Any) -> CommandError:
    return CommandError(
        66,
        "After applying the update, the (immutable) field '_id' was found to have been altered "
        f"to _id: {bson_repr(value)}",
    )


def _equalities(query: dict[str, Any]) -> dict[str, Any]:
    """The ``path: value`` equalities of a query (``extractEqualityMatches``)."""
    out: dict[str, Any] = {}
    for key, cond in query.items():
        if key == "$and" and isinstance(cond, list):
            for sub in cond:
                if isinstance(sub, dict):
                    out.update(_equalities(sub))
            continue
        if key.startswith("$") or isinstance(cond, (Regex, re.Pattern)):
            continue
        if isinstance(cond, dict) and any(k.startswith("$") for k in cond):
            if list(cond) == ["$eq"]:
                out[key] = cond["$eq"]
            elif list(cond) == ["$in"] and isinstance(cond["$in"], list) and len(cond["$in"]) == 1:
                out[key] = cond["$in"][0]
            continue
        out[key] = cond
    return out
