"""``.. event-fields::``: one table per typed event class: attribute, server field, type.

Generated from ``changestream.events`` itself (the dataclass fields and the
parser's field table), so a new event class or field appears in the reference
without anyone remembering to add it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _rst(cls: type[Any], operation: str | None, server_keys: dict[str, str]) -> list[str]:
    title = f"``{cls.__name__}``" + (f" (``operationType: {operation}``)" if operation else "")
    lines = [title, "~" * len(title), "", ".. list-table::", "   :header-rows: 1", ""]
    lines += ["   * - attribute", "     - server field", "     - type"]
    for field in dataclasses.fields(cls):
        key = server_keys.get(field.name)
        lines += [
            f"   * - ``{field.name}``",
            f"     - ``{key}``" if key else "     - (see below the tables)",
            f"     - ``{field.type}``",
        ]
    return [*lines, ""]


class EventFields(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        from changestream import _event_build, events

        server_keys = {attr: field.key for attr, field in _event_build._EVENT_FIELDS.items()}
        server_keys.setdefault("operation_type", "operationType")
        classes = [events.ChangeEvent, *events._EVENT_CLASSES.values(), events.UnknownEvent]
        operations = {cls: op.value for op, cls in events._EVENT_CLASSES.items()}
        text: list[str] = []
        for cls in dict.fromkeys(classes):
            text += _rst(cls, operations.get(cls), server_keys)
        text += [
            "``extra`` holds every top-level field a class does not model (or whose value had",
            "an unexpected type); ``raw`` is the document as received.",
        ]
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, StringList(text, source="event-fields"), container)
        return list(container.children)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("event-fields", EventFields)
    return {"parallel_read_safe": True}
