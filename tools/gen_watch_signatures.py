"""Write the keyword parameters of every ``watch()`` signature from the one option table.

Why generated source, not a runtime trick: a type checker and an editor only
see parameters that are written in the source, and each ``@overload`` of
``changestream.watch``, ``Client/Database/Collection.watch`` (the
``_BoundWatch`` protocol) and ``changestream.aio.watch`` needs all of them.
Copying ~20 parameters by hand into ~14 signatures would drift, so this script
writes them between marker comments, from one table:

* names and static types: the ``TypedDict`` s of ``changestream/_watch_types.py``
  (``WatchOptions``, ``AsyncWatchOptions``; read with :mod:`ast`);
* defaults ("not set"): the field defaults of the runtime option table,
  :class:`changestream._options.ChangeStreamOptions` (also read with :mod:`ast`, so the
  script needs nothing installed).

``tests/test_typing.py`` fails when the committed code differs from what this
script writes (like PyMongo's synchro check) and when the two tables name
different options. Nothing runs at import time of ``changestream``.

Markers (the generated lines take the indentation of the ``BEGIN`` line)::

    # BEGIN generated watch options: params sync    (or: params async, arguments)
    # END generated watch options

Run from the checkout: ``python tools/gen_watch_signatures.py`` (rewrite the files) or
``python tools/gen_watch_signatures.py --check`` (exit 1 if they are stale).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = ROOT / "changestream" / "_watch_types.py"
OPTIONS = ROOT / "changestream" / "_options.py"
FILES = (ROOT / "changestream" / "_sync" / "_api.py", ROOT / "changestream" / "aio" / "_api.py")
BEGIN = "# BEGIN generated watch options: "
END = "# END generated watch options"
_REGION = re.compile(
    rf"^(?P<indent>[ \t]*){re.escape(BEGIN)}(?P<kind>[a-z ]+)\n(?P<body>.*?)^(?P=indent){re.escape(END)}$",
    re.MULTILINE | re.DOTALL,
)
# The parameters of watch() itself, not options (they pick the overload: they are written out).
EXPLICIT = ("pipeline", "typed", "document_class")


def typed_options() -> dict[str, dict[str, str]]:
    """``{"sync" | "async": {option: annotation source}}`` from the TypedDicts, in table order."""
    classes: dict[str, ast.ClassDef] = {
        node.name: node for node in ast.parse(TYPES.read_text()).body if isinstance(node, ast.ClassDef)
    }

    def fields(name: str) -> dict[str, str]:
        node = classes[name]
        found: dict[str, str] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                found.update(fields(base.id))
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                found[statement.target.id] = ast.unparse(statement.annotation)
        return found

    return {"sync": fields("WatchOptions"), "async": fields("AsyncWatchOptions")}


def defaults() -> dict[str, str]:
    """``{option: default source}`` from the runtime table (every option has a default), read
    with :mod:`ast` as the TypedDicts are: the script runs without PyMongo installed."""
    tree = ast.parse(OPTIONS.read_text())
    table = next(node for node in tree.body
                 if isinstance(node, ast.ClassDef) and node.name == "ChangeStreamOptions")
    return {
        statement.target.id: ast.unparse(statement.value)
        for statement in table.body
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
        and statement.value is not None and statement.target.id not in EXPLICIT
    }


def region(kind: str, tables: dict[str, dict[str, str]], default: dict[str, str]) -> list[str]:
    """The lines of one region, without indentation."""
    what, _, flavour = kind.partition(" ")
    names = list(tables["sync"])
    if what == "params" and flavour in tables:
        return [f"{name}: {tables[flavour][name]} = {default[name]}," for name in tables[flavour]]
    if what == "arguments" and not flavour:
        return [f"{name}={name}," for name in names]
    raise ValueError(f"unknown region kind {kind!r} (params sync, params async, arguments)")


def render(text: str, tables: dict[str, dict[str, str]], default: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        indent = match["indent"]
        lines = region(match["kind"].strip(), tables, default)
        body = "".join(f"{indent}{line}\n" for line in lines)
        return f"{indent}{BEGIN}{match['kind']}\n{body}{indent}{END}"

    return _REGION.sub(replace, text)


def generate() -> dict[Path, tuple[str, str]]:
    """``{file: (current text, generated text)}``."""
    tables, default = typed_options(), defaults()
    for flavour, table in tables.items():
        if set(table) != set(default):
            raise SystemExit(
                f"the {flavour} typed options ({TYPES.name}) and ChangeStreamOptions differ: "
                f"{sorted(set(table) ^ set(default))}"
            )
    return {path: (path.read_text(), render(path.read_text(), tables, default)) for path in FILES}


def main(argv: list[str]) -> int:
    stale = [path for path, (old, new) in generate().items() if old != new]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python tools/gen_watch_signatures.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(generate()[path][1])
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
