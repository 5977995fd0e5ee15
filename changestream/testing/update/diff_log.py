"""The ``$v: 2`` oplog diff of an update, recorded as ``V2LogBuilder`` records it.

``u`` updated, ``i`` created, ``d`` deleted, ``s<field>`` sub-diffs, array
diffs ``{a: true, u<idx>: ...}``.
"""

from __future__ import annotations

from typing import Any

from ..storage import (
    copy_value,
)

# ======================================================================================
# The $v:2 diff (V2LogBuilder)
# ======================================================================================

_DOC, _ARRAY, _INSERT = 0, 1, 2
Path = list[tuple[str, bool]]
"""A runtime path: ``(component, is_array_index)`` pairs."""


class _DiffNode:
    __slots__ = ("children", "deletes", "inserts", "kind", "subdiffs", "updates")

    def __init__(self, kind: int) -> None:
        self.kind = kind
        self.children: dict[str, Any] = {}
        self.deletes: list[str] = []
        self.updates: list[tuple[str, Any]] = []
        self.inserts: list[tuple[str, Any]] = []
        self.subdiffs: list[tuple[str, _DiffNode]] = []

    def add(self, name: str, child: Any) -> None:
        self.children[name] = child
        if self.kind != _DOC:
            return
        if isinstance(child, _DiffNode):
            (self.inserts if child.kind == _INSERT else self.subdiffs).append((name, child))
        elif child[0] == "d":
            self.deletes.append(name)
        elif child[0] == "u":
            self.updates.append((name, child[1]))
        else:
            self.inserts.append((name, child))


class DiffLog:
    """Collects logged changes and serializes them as a ``$v: 2`` diff."""

    def __init__(self) -> None:
        self.root = _DiffNode(_DOC)
        self.empty = True

    def updated(self, path: Path, value: Any) -> None:
        self._add(path, ("u", value), None)

    def created(self, path: Path, first_new: int, value: Any) -> None:
        self._add(path, ("i", value), first_new)

    def deleted(self, path: Path) -> None:
        self._add(path, ("d", None), None)

    def _add(self, path: Path, leaf: tuple[str, Any], first_new: int | None) -> None:
        self.empty = False
        node = self.root
        for i, (part, _) in enumerate(path[:-1]):
            child = node.children.get(part)
            if child is None:
                if path[i + 1][1]:
                    kind = _ARRAY
                elif first_new is not None and i >= first_new:
                    kind = _INSERT
                else:
                    kind = _DOC
                child = _DiffNode(kind)
                node.add(part, child)
            node = child
        node.add(path[-1][0], leaf)

    def serialize(self) -> dict[str, Any]:
        return _serialize(self.root)


def _serialize(node: _DiffNode) -> dict[str, Any]:
    if node.kind == _INSERT:
        return {
            name: _serialize(child) if isinstance(child, _DiffNode) else copy_value(child[1])
            for name, child in node.children.items()
        }
    if node.kind == _ARRAY:
        out: dict[str, Any] = {"a": True}
        for name in sorted(node.children, key=int):
            child = node.children[name]
            if not isinstance(child, _DiffNode):
                out[f"u{name}"] = copy_value(child[1])
            elif child.kind == _INSERT:
                out[f"u{name}"] = _serialize(child)
            else:
                out[f"s{name}"] = _serialize(child)
        return out
    out = {}
    if node.deletes:
        out["d"] = dict.fromkeys(node.deletes, False)
    if node.updates:
        out["u"] = {name: copy_value(value) for name, value in node.updates}
    if node.inserts:
        out["i"] = {
            name: _serialize(child) if isinstance(child, _DiffNode) else copy_value(child[1])
            for name, child in node.inserts
        }
    for name, child in node.subdiffs:
        out["s" + name] = _serialize(child)
    return out




