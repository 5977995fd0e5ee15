"""Applying a parsed operator update to a document, recording every change in a
:class:`~.diff_log.DiffLog`.

Appends by ``$push``/``$addToSet`` log only the new elements; other array
rewrites log the whole array. A modifier that changes nothing logs nothing.
Also the positional (``$``) match of a query against an array.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..core.errors import CommandError
from ..storage import (
    bson_repr,
    compare_values,
    copy_value,
    matches,
    path_values,
    type_name,
    values_equal,
    values_identical,
)
from .diff_log import DiffLog, Path
from .parse import (
    _MISSING,
    _NO_CREATE,
    UpdateEnv,
    _arith,
    _bitwise,
    _conflict,
    _Leaf,
    _Node,
    _num_rank,
    _Push,
    _zero_like,
)

# ======================================================================================
# Applying an operator update
# ======================================================================================

_NOOP, _NORMAL = 0, 1
"""Results of a modifier on an existing element; a positive ``n + 1`` means "appended n"."""


def _dotted(path: Path) -> str:
    return ".".join(part for part, _ in path)


def _index(part: str) -> int | None:
    return int(part) if part.isdigit() and (part == "0" or not part.startswith("0")) else None


def _not_viable(part: str, name: str, elem: Any) -> CommandError:
    return CommandError(
        28,
        f"Cannot create field '{part}' in element {{{name}: {bson_repr(elem)}}}",
        code_name="PathNotViable",
    )


def _elem_matches(query: dict[str, Any], element: Any) -> bool:
    return matches(query, {"__elem": element})


class _Applier:
    """Applies one update tree to a working copy of one document."""

    def __init__(
        self,
        doc: dict[str, Any],
        env: UpdateEnv,
        *,
        is_insert: bool,
        matched: str | None,
        array_filters: dict[str, dict[str, Any]],
    ) -> None:
        self.doc = doc
        self.env = env
        self.is_insert = is_insert
        self.matched = matched
        self.array_filters = array_filters
        self.log: DiffLog | None = DiffLog()

    @property
    def id_text(self) -> str:
        return f"_id: {bson_repr(self.doc['_id'])}" if "_id" in self.doc else "no id"

    # -- internal nodes -----------------------------------------------------------------
    def apply(
        self, node: _Node | _Leaf, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        if isinstance(node, _Leaf):
            return self._leaf(node, holder, key, elem, taken, create)
        if node.is_array:
            return self._array(node, elem, taken, create)
        return self._object(node, holder, key, elem, taken, create)

    def _ordered(self, node: _Node) -> list[tuple[str, _Node | _Leaf]]:
        names = sorted(k for k in node.children if k != "$")
        ordered = [(k, node.children[k]) for k in names]
        if "$" in node.children:
            if self.matched is None:
                raise CommandError(
                    2, "The positional operator did not find the match needed from the query."
                )
            if self.matched in node.children:
                raise _conflict(self.matched, self.matched)
            ordered.append((self.matched, node.children["$"]))
            ordered.sort(key=lambda item: item[0])
        return ordered

    def _object(
        self, node: _Node, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        modified = False
        for name, child in self._ordered(node):
            if create:
                c_holder, c_key, c_elem, c_taken, c_create = (
                    holder,
                    key,
                    elem,
                    taken,
                    [*create, name],
                )
            elif isinstance(elem, dict) and name in elem:
                c_holder, c_key, c_elem = elem, name, elem[name]
                c_taken, c_create = [*taken, (name, False)], []
            elif isinstance(elem, list) and (idx := _index(name)) is not None and idx < len(elem):
                c_holder, c_key, c_elem = elem, idx, elem[idx]
                c_taken, c_create = [*taken, (name, True)], []
            else:
                c_holder, c_key, c_elem, c_taken, c_create = holder, key, elem, taken, [name]
            modified = self.apply(child, c_holder, c_key, c_elem, c_taken, c_create) or modified
            if create:  # a child may have created the missing path: continue from there
                found = self._resolve(elem, create)
                if found is not None:
                    holder, key, elem = found[0], found[1], found[2]
                    taken = [*taken, *found[3]]
                    create = []
        return modified

    @staticmethod
    def _resolve(elem: Any, parts: list[str]) -> tuple[Any, Any, Any, Path] | None:
        holder: Any = None
        key: Any = None
        path: Path = []
        for part in parts:
            if isinstance(elem, dict) and part in elem:
                holder, key, elem = elem, part, elem[part]
                path.append((part, False))
            elif isinstance(elem, list) and (idx := _index(part)) is not None and idx < len(elem):
                holder, key, elem = elem, idx, elem[idx]
                path.append((part, True))
            else:
                return None
        return holder, key, elem, path

    def _array(self, node: _Node, elem: Any, taken: Path, create: list[str]) -> bool:
        if create:
            raise CommandError(
                2,
                f"The path '{_dotted(taken + [(p, False) for p in create])}' must exist in the "
                "document in order to apply array updates.",
            )
        if not isinstance(elem, list):
            raise CommandError(
                2,
                f"Cannot apply array updates to non-array element {taken[-1][0]}: "
                f"{bson_repr(elem)}",
            )
        targets: list[tuple[int, list[tuple[str, _Node | _Leaf]]]] = []
        for i, item in enumerate(elem):
            children = [
                (ident, child)
                for ident, child in sorted(node.children.items())
                if not ident or _elem_matches(self.array_filters[ident], item)
            ]
            if children:
                targets.append((i, children))
        if len(targets) == 1:  # one element: the children log their own paths
            return self._apply_element(elem, *targets[0], taken)
        saved, self.log = self.log, None
        changed: list[int] = []
        try:
            for i, children in targets:
                if self._apply_element(elem, i, children, taken):
                    changed.append(i)
        finally:
            self.log = saved
        if self.log is not None and len(changed) > 1:
            self.log.updated(taken, elem)
        elif self.log is not None and changed:
            self.log.updated([*taken, (str(changed[0]), True)], elem[changed[0]])
        return bool(changed)

    def _apply_element(
        self, array: list[Any], i: int, children: list[tuple[str, _Node | _Leaf]], taken: Path
    ) -> bool:
        modified = False
        for _, child in children:
            modified = (
                self.apply(child, array, i, array[i], [*taken, (str(i), True)], []) or modified
            )
        return modified

    # -- leaves -----------------------------------------------------------------------------
    def _leaf(
        self, leaf: _Leaf, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        if leaf.op == "$setOnInsert" and not self.is_insert:
            return False
        if leaf.op == "$rename":
            return self._rename(leaf, holder, key, elem, taken, create)
        if create:
            if leaf.op in _NO_CREATE:
                return False
            return self._create(leaf, elem, taken, create, self._new_value(leaf))
        result = self._update_existing(leaf, holder, key, elem, taken)
        if result == _NOOP:
            return False
        self._check_immutable(taken)
        if self.log is None:
            return True
        if result == _NORMAL:
            if leaf.op == "$unset" and not taken[-1][1]:
                self.log.deleted(taken)
            else:
                self.log.updated(taken, holder[key])
        else:
            array = holder[key]
            for j in range(len(array) - (result - 1), len(array)):
                self.log.created([*taken, (str(j), True)], len(taken), array[j])
        return True

    def _check_immutable(self, path: Path) -> None:
        if path and path[0][0] == "_id":
            raise CommandError(
                66,
                f"Performing an update on the path '{_dotted(path)}' would modify the immutable "
                "field '_id'",
            )

    def _create(
        self, leaf: _Leaf | None, elem: Any, taken: Path, create: list[str], value: Any
    ) -> bool:
        """Create ``create`` under ``elem`` holding ``value`` and log it (PathCreatingNode)."""
        name = taken[-1][0] if taken else ""
        first, rest = create[0], create[1:]
        if isinstance(elem, dict):
            first_is_index = False
            target: Any = elem
            target_key: Any = first
        elif isinstance(elem, list):
            idx = _index(first)
            if idx is None:
                raise _not_viable(first, name, elem)
            first_is_index = True
            elem.extend([None] * (idx + 1 - len(elem)))
            target, target_key = elem, idx
        else:
            raise _not_viable(first, name, elem)
        if leaf is not None and leaf.op in ("$set", "$setOnInsert") and not taken:
            _check_top_level_name(first)
        full: Path = [*taken, (first, first_is_index), *((p, False) for p in rest)]
        if full[0][0] == "_id" and (taken or rest):
            self._check_immutable(full)
        for part in rest:
            new: dict[str, Any] = {}
            target[target_key] = new
            target, target_key = new, part
        target[target_key] = value
        if self.log is not None:
            self.log.created(full, len(taken), value)
        return True

    def _new_value(self, leaf: _Leaf) -> Any:
        op, arg = leaf.op, leaf.arg
        if op in ("$set", "$setOnInsert", "$min", "$max", "$inc"):
            return copy_value(arg)
        if op == "$mul":
            return _zero_like(arg)
        if op == "$currentDate":
            return self.env.now() if leaf.parsed == "date" else self.env.timestamp()
        if op == "$bit":
            return _bitwise(0, leaf.parsed)
        if op == "$push":
            array: list[Any] = []
            self._push(leaf.parsed, array)
            return array
        if op == "$addToSet":
            return copy_value(list(leaf.parsed))
        raise AssertionError(op)

    def _update_existing(self, leaf: _Leaf, holder: Any, key: Any, elem: Any, taken: Path) -> int:
        op, arg = leaf.op, leaf.arg
        if op in ("$set", "$setOnInsert"):
            if values_identical(elem, arg):
                return _NOOP
            holder[key] = copy_value(arg)
            return _NORMAL
        if op == "$unset":
            if isinstance(holder, list):
                holder[key] = None
            else:
                del holder[key]
            return _NORMAL
        if op in ("$inc", "$mul"):
            if not _num_rank(elem):
                raise CommandError(
                    14,
                    f"Cannot apply {op} to a value of non-numeric type. {{{self.id_text}}} has "
                    f"the field '{key}' of non-numeric type {type_name(elem)}",
                )
            result = _arith(op, elem, arg, self.id_text)
            if values_identical(result, elem):
                return _NOOP
            holder[key] = result
            return _NORMAL
        if op in ("$min", "$max"):
            cmp = compare_values(elem, arg)
            if cmp == 0 or (op == "$max") != (cmp < 0):
                return _NOOP
            holder[key] = copy_value(arg)
            return _NORMAL
        if op == "$currentDate":
            holder[key] = self._new_value(leaf)
            return _NORMAL
        if op == "$bit":
            if _num_rank(elem) not in (1, 2):
                raise CommandError(
                    2,
                    f"Cannot apply $bit to a value of non-integral type.{{{self.id_text}}} has "
                    f"the field {key} of non-integer type {type_name(elem)}",
                )
            result = _bitwise(elem, leaf.parsed)
            if values_identical(result, elem):
                return _NOOP
            holder[key] = result
            return _NORMAL
        if op == "$placeholder":
            return _NOOP
        if not isinstance(elem, list):
            raise self._not_array(op, key, elem, taken)
        if op == "$push":
            return self._push(leaf.parsed, elem)
        if op == "$addToSet":
            added = [v for v in leaf.parsed if not any(values_equal(v, e) for e in elem)]
            if not added:
                return _NOOP
            elem.extend(copy_value(added))
            return len(added) + 1
        if op == "$pop":
            if not elem:
                return _NOOP
            elem.pop(0 if leaf.parsed == -1 else -1)
            return _NORMAL
        keep = self._cull(op, arg, elem)
        if len(keep) == len(elem):
            return _NOOP
        elem[:] = keep
        return _NORMAL

    def _not_array(self, op: str, key: Any, elem: Any, taken: Path) -> CommandError:
        if op == "$push":
            return CommandError(
                2,
                f"The field '{_dotted(taken)}' must be an array but is of type "
                f"{type_name(elem)} in document {{{self.id_text}}}",
            )
        if op == "$addToSet":
            return CommandError(
                2,
                f"Cannot apply $addToSet to non-array field. Field named '{key}' has non-array "
                f"type {type_name(elem)}",
            )
        if op == "$pop":
            return CommandError(
                14,
                f"Path '{_dotted(taken)}' contains an element of non-array type "
                f"'{type_name(elem)}'",
            )
        return CommandError(2, f"Cannot apply {op} to a non-array value")

    def _cull(self, op: str, arg: Any, array: list[Any]) -> list[Any]:
        """The elements ``$pull``/``$pullAll`` keep."""
        if op == "$pullAll":
            return [e for e in array if not any(values_equal(e, v) for v in arg)]
        if isinstance(arg, dict) and arg and all(k.startswith("$") for k in arg):
            return [e for e in array if not matches({"__elem": arg}, {"__elem": e})]
        if isinstance(arg, dict) and arg:
            return [e for e in array if not (isinstance(e, dict) and matches(arg, e))]
        return [e for e in array if not values_equal(e, arg)]

    def _push(self, push: _Push, array: list[Any]) -> int:
        """Apply a ``$push`` to ``array`` in place (PushNode::performPush)."""
        values = copy_value(push.values)
        size = len(array)
        result = _NOOP
        if values:
            position = push.position
            if size == 0:
                array.extend(values)
                result = _NORMAL
            elif position is None or position > size:
                array.extend(values)
                result = len(values) + 1
            else:
                at = position if position >= 0 else max(size + position, 0)
                array[at:at] = values
                result = _NORMAL
        if push.sort is not None:
            result = _NORMAL
            array.sort(key=_push_sort_key(push.sort))
        if push.slice is not None and len(array) > abs(push.slice):
            result = _NORMAL
            if push.slice >= 0:
                del array[push.slice :]
            else:
                del array[: len(array) + push.slice]
        return result

    # -- $rename ----------------------------------------------------------------------------
    def _rename(
        self, leaf: _Leaf, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        """Set the destination to the source's value, then delete the source (RenameNode)."""
        source = str(leaf.arg)
        parts = source.split(".")
        parent: Any = self.doc
        for i, part in enumerate(parts[:-1]):
            nxt = parent.get(part, _MISSING)
            if isinstance(nxt, list):
                raise CommandError(
                    2,
                    f"The source field cannot be an array element, '{source}' in doc with "
                    f"{self.id_text} has an array field called '{part}'",
                )
            if nxt is _MISSING:
                return False
            if not isinstance(nxt, dict):
                raise _not_viable(parts[i + 1], part, nxt)
            parent = nxt
        if parts[-1] not in parent:
            return False
        array_at = next((i for i, (_, is_index) in enumerate(taken) if is_index), None)
        if array_at is not None or (create and isinstance(elem, list)):
            name = taken[array_at - 1][0] if array_at else (taken[-1][0] if taken else "")
            raise CommandError(
                2,
                f"The destination field cannot be an array element, '{leaf.path}' in doc with "
                f"{self.id_text} has an array field called '{name}'",
            )
        value = parent[parts[-1]]
        if create:
            self._create(None, elem, taken, create, copy_value(value))
        elif not values_equal(elem, value):
            self._check_immutable(taken)
            holder[key] = copy_value(value)
            if self.log is not None:
                self.log.updated(taken, holder[key])
        if parts[0] == "_id":
            raise CommandError(
                66,
                f"Unsetting the path '{source}' using $rename would modify the immutable field "
                "'_id'",
            )
        del parent[parts[-1]]
        if self.log is not None:
            self.log.deleted([(p, False) for p in parts])
        return True


def _push_sort_key(pattern: Any) -> Callable[[Any], Any]:
    if isinstance(pattern, dict):
        fields = list(pattern.items())

        def cmp(x: Any, y: Any) -> int:
            if isinstance(x, dict) and isinstance(y, dict):
                for field, direction in fields:
                    vx, vy = path_values(x, field), path_values(y, field)
                    c = compare_values(vx[0] if vx else None, vy[0] if vy else None)
                    if c:
                        return c * int(direction)
                return 0
            return compare_values(x, y) * int(fields[0][1])

        return functools.cmp_to_key(cmp)
    direction = int(pattern)
    return functools.cmp_to_key(lambda x, y: compare_values(x, y) * direction)


def _check_top_level_name(name: str) -> None:
    if name.startswith("$"):
        raise CommandError(
            52,
            f"The dollar ($) prefixed field '{name}' in '{name}' is not allowed in the context of "
            "an update's replacement document. Consider using an aggregation pipeline with "
            "$replaceWith.",
        )


# ======================================================================================
# Positional matching ("$" = the index the query matched)
# ======================================================================================


def positional_match(query: dict[str, Any], doc: dict[str, Any]) -> str | None:
    """The array index the query matched in ``doc`` (what ``$`` stands for), or None."""
    for key, cond in query.items():
        if key == "$and" and isinstance(cond, list):
            for sub in cond:
                found = positional_match(sub, doc) if isinstance(sub, dict) else None
                if found is not None:
                    return found
            continue
        if key.startswith("$"):
            continue
        found_idx = _first_matching_index(doc, key.split("."), cond)
        if found_idx is not None:
            return str(found_idx)
    return None


def _first_matching_index(value: Any, parts: list[str], cond: Any) -> int | None:
    for j, part in enumerate(parts):
        if isinstance(value, list):
            rest = parts[j:]
            for i, item in enumerate(value):
                if isinstance(item, dict) and matches({".".join(rest): cond}, item):
                    return i
            return None
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, list):
        for i, item in enumerate(value):
            if matches({"__elem": cond}, {"__elem": [item]}):
                return i
    return None




