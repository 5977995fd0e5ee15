"""An update event's ``updateDescription`` from a ``$v: 2`` oplog diff.

Follows ``change_stream_document_diff_parser.cpp``: at each object level the
``u``, ``i`` and ``b`` entries become updatedFields (dotted paths), ``d``
entries removedFields, then ``s<field>`` sub-diffs recurse; an array diff's
``l`` becomes a truncatedArrays entry and its ``u<idx>``/``s<idx>`` entries
continue the path with the index. Paths whose components could be misread
(a dotted name, or a numeric name after the first component) are spelled out
in ``disambiguatedPaths`` (6.1+, showExpandedEvents only).

``legacy=True`` emulates 4.2/4.4, whose ``$v: 1`` oplog could not express an
array resize: that array is reported whole, from the post-image, in
updatedFields, and there is no truncatedArrays.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_SECTIONS = ("u", "i", "b", "d")
_STRICT_NUMERIC = re.compile(r"(?:0|[1-9][0-9]*)\Z")
_DECIMAL = re.compile(r"[0-9]+\Z")

PathPart = str | int
"""A path component: a field name, or an array index (int)."""


def _is_array_diff(diff: Mapping[str, Any]) -> bool:
    if not diff:
        raise ValueError("malformed update diff: expected diff to be non-empty")
    return next(iter(diff)) == "a"


class _Builder:
    """Tracks the current path and its ambiguity while the diff is walked."""

    def __init__(self, *, legacy: bool, track_ambiguity: bool, post_image: Any) -> None:
        self.legacy = legacy
        self.track_ambiguity = track_ambiguity
        self.post_image = post_image
        self.parts: list[PathPart] = []
        self.ambiguous: list[bool] = []
        self.updated: dict[str, Any] = {}
        self.removed: list[str] = []
        self.truncated: list[dict[str, Any]] = []
        self.disambiguated: dict[str, list[PathPart]] = {}

    def push(self, part: PathPart) -> None:
        self.parts.append(part)
        if self.ambiguous and self.ambiguous[-1]:
            self.ambiguous.append(True)
        elif isinstance(part, int):
            self.ambiguous.append(False)
        else:
            numeric = len(self.parts) > 1 and _STRICT_NUMERIC.match(part) is not None
            self.ambiguous.append(numeric or "." in part)

    def pop(self) -> None:
        self.parts.pop()
        self.ambiguous.pop()

    def path(self) -> str:
        """The dotted path, noting it in disambiguatedPaths when it is ambiguous."""
        dotted = ".".join(str(part) for part in self.parts)
        if self.track_ambiguity and self.ambiguous[-1]:
            self.disambiguated[dotted] = list(self.parts)
        return dotted

    def update(self, part: PathPart, value: Any) -> None:
        self.push(part)
        self.updated[self.path()] = value
        self.pop()

    def document(self, diff: Mapping[str, Any]) -> None:
        for key in diff:
            if key not in _SECTIONS and not key.startswith("s"):
                raise ValueError(f"malformed update diff: unexpected section {key!r}")
        for section in ("u", "i", "b"):
            for name, value in diff.get(section, {}).items():
                self.update(name, value)
        for name in diff.get("d", {}):
            self.push(name)
            self.removed.append(self.path())
            self.pop()
        for key, sub in diff.items():
            if key not in _SECTIONS:
                self.sub_diff(key[1:], sub)

    def sub_diff(self, part: PathPart, diff: Mapping[str, Any]) -> None:
        self.push(part)
        if _is_array_diff(diff):
            self.array(diff)
        else:
            self.document(diff)
        self.pop()

    def array(self, diff: Mapping[str, Any]) -> None:
        if "l" in diff:
            if self.legacy:
                self.updated[self.path()] = self._post_image_value()
                return
            self.truncated.append({"field": self.path(), "newSize": diff["l"]})
        for key, value in diff.items():
            if key in ("a", "l"):
                continue
            kind, index = key[:1], key[1:]
            if kind not in ("u", "s") or not _DECIMAL.match(index):
                raise ValueError(f"malformed update diff: unexpected array entry {key!r}")
            if kind == "u":
                self.update(int(index), value)
            else:
                self.sub_diff(int(index), value)

    def _post_image_value(self) -> Any:
        """The current path's value in the post-image (a $v:1 oplog logged resized arrays whole)."""
        value: Any = self.post_image
        dotted = ".".join(map(str, self.parts))
        if value is None:
            raise ValueError(
                f"a legacy update description needs the post-image to report "
                f"the resized array {dotted!r}"
            )
        for part in self.parts:
            if isinstance(part, int):
                found = isinstance(value, (list, tuple)) and part < len(value)
            else:
                found = isinstance(value, Mapping) and part in value
            if not found:
                raise ValueError(f"path {dotted!r} is missing from the post-image")
            value = value[part]
        return value


def update_description(
    diff: Mapping[str, Any],
    *,
    legacy: bool,
    show_expanded_events: bool,
    disambiguated_paths_supported: bool,
    post_image: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``updateDescription`` for the oplog ``o.diff`` of a ``$v: 2`` update.

    Key order: updatedFields, removedFields, truncatedArrays, [disambiguatedPaths].
    """
    track = not legacy and show_expanded_events and disambiguated_paths_supported
    builder = _Builder(legacy=legacy, track_ambiguity=track, post_image=post_image)
    builder.document(diff)
    result: dict[str, Any] = {"updatedFields": builder.updated, "removedFields": builder.removed}
    if not legacy:
        result["truncatedArrays"] = builder.truncated
        if track:
            result["disambiguatedPaths"] = builder.disambiguated
    return result
