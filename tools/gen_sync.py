"""Write the synchronous twins from their asyncio sources (one source for sync and async).

Why generated, not shared at run time: the sync and async shells differ only in
``async``/``await`` and in a few names, and both must be plain, fast, typed
code that an editor and ``mypy`` can read. Writing them twice let fixes land on
one side only; so the asyncio modules under ``changestream/aio/`` are the one
source, and this script rewrites each into its sync twin, as PyMongo's
``tools/synchro.py`` does.

The rewrite, line by line (strings and docstrings included):

* ``async def`` / ``async with`` / ``async for`` lose ``async``; ``await`` goes;
* names in :data:`NAMES` are mapped (``AsyncChangeStream`` -> ``ChangeStream``,
  ``pymongo.asynchronous`` -> ``pymongo.synchronous``, ``__aenter__`` ->
  ``__enter__``, ...), whole words only;
* relative imports move up one package (``from .._shell`` -> ``from ._shell``;
  ``from ._stream`` stays: the sync twin of a sibling is the sibling's twin).

Where a twin must differ, the async source says so, explicitly and locally:

* a line ending in ``# async-only`` is dropped;
* lines between ``# async-only: begin`` and ``# async-only: end`` are dropped;
* lines between ``# sync-only: begin`` and ``# sync-only: end`` are comments in the
  async source (``# `` after the indentation) and become code in the sync twin;
* a line ending in ``# sync: CODE`` becomes ``CODE`` (same indentation).

Each generated file starts with a line naming its source and this command. Run
from the checkout: ``python tools/gen_sync.py`` (rewrite the twins) or
``python tools/gen_sync.py --check`` (exit 1 naming the stale ones;
``tests/test_generated.py`` runs it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "changestream"

TWINS: tuple[tuple[str, str], ...] = (
    ("aio/_stream.py", "_stream.py"),
    ("aio/_snapshot_watch.py", "_snapshot_watch.py"),
    ("aio/_consume.py", "_consume.py"),
)
"""(asyncio source, generated sync twin), relative to ``changestream/``."""

NAMES: dict[str, str] = {
    "AsyncChangeStream": "ChangeStream",
    "AsyncSnapshotThenWatch": "SnapshotThenWatch",
    "AsyncMongoClient": "MongoClient",
    "AsyncDatabase": "Database",
    "AsyncCollection": "Collection",
    "AsyncClientSession": "ClientSession",
    "AsyncTransport": "SyncTransport",
    "AsyncRetrying": "Retrying",
    "AsyncExitStack": "ExitStack",
    "AsyncIterator": "Iterator",
    "AsyncIterable": "Iterable",
    "AsyncTokenStore": "TokenStore",
    "asynccontextmanager": "contextmanager",
    "enter_async_context": "enter_context",
    "aclose": "close",
    "StopAsyncIteration": "StopIteration",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__anext__": "__next__",
    "__aiter__": "__iter__",
    "asynchronous": "synchronous",
    "AsyncWorkers": "ThreadWorkers",
    "_async_io": "_sync_io",
}
"""Whole-word renames from the asyncio source to the sync twin."""

HEADER = (
    "# Generated from changestream/{source} by tools/gen_sync.py: "
    "edit that file, then run `python tools/gen_sync.py`.\n"
)

_NAME = re.compile(r"\b(" + "|".join(map(re.escape, NAMES)) + r")\b")
_ASYNC = re.compile(r"\basync (def|with|for)\b")
_AWAIT = re.compile(r"\bawait ")
_PARENT_IMPORT = re.compile(r"^(\s*from )\.\.(\w|\s)")
_AIO_DOC = re.compile(r"changestream\.aio\.")
_SYNC_LINE = re.compile(r"^(?P<indent>\s*)(?P<code>.*?)\s*# sync: (?P<sync>.*)$")
_COMMENTED = re.compile(r"^(?P<indent>\s*)# ?(?P<code>.*)$")


class SourceError(Exception):
    """The asyncio source breaks a marker rule (named with file and line)."""


def unasync(text: str, source: str) -> str:
    """The sync twin of one asyncio module's text."""
    out: list[str] = [HEADER.format(source=source)]
    block: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped in ("# async-only: begin", "# sync-only: begin"):
            if block is not None:
                raise SourceError(f"{source}:{number}: nested '{stripped}' inside a {block} block")
            block = stripped.split(":")[0][2:]
            continue
        if stripped in ("# async-only: end", "# sync-only: end"):
            if block != stripped.split(":")[0][2:]:
                raise SourceError(f"{source}:{number}: '{stripped}' without its begin")
            block = None
            continue
        if block == "async-only" or line.endswith("# async-only"):
            continue
        if block == "sync-only":
            if stripped:
                match = _COMMENTED.match(line)
                if match is None or not stripped.startswith("#"):
                    raise SourceError(f"{source}:{number}: sync-only lines must be comments")
                line = (match["indent"] + match["code"]).rstrip()
        else:
            match = _SYNC_LINE.match(line)
            if match is not None:
                line = match["indent"] + match["sync"]
        line = _ASYNC.sub(r"\1", line)
        line = _AWAIT.sub("", line)
        line = _NAME.sub(lambda m: NAMES[m[1]], line)
        line = _PARENT_IMPORT.sub(r"\1.\2", line)
        line = _AIO_DOC.sub("changestream.", line)
        out.append(line + "\n")
    if block is not None:
        raise SourceError(f"{source}: a {block} block is not closed")
    return "".join(out)


def _statements(lines: list[str]) -> list[list[str]]:
    """Split import lines into statements (a parenthesised import spans several lines)."""
    statements: list[list[str]] = []
    depth = 0
    for line in lines:
        if depth == 0:
            statements.append([])
        statements[-1].append(line)
        depth += line.count("(") - line.count(")")
    return statements


def _import_key(statement: list[str]) -> tuple[int, str]:
    words = statement[0].split()
    return (0 if words[0] == "import" else 1, words[1].lower())


def sort_imports(text: str) -> str:
    """Re-sort each block of top-level imports as ruff's isort does (renames move modules).

    Within a block (imports between blank lines): ``import x`` statements first,
    then ``from x import ...``, each by module name, case-insensitively.
    """
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    block: list[str] = []
    depth = 0

    def flush() -> None:
        for statement in sorted(_statements(block), key=_import_key):
            out.extend(statement)
        block.clear()

    for line in lines:
        is_import = line.startswith(("import ", "from ")) and not line.startswith("from __future__")
        if depth > 0 or is_import:
            block.append(line)
            depth += line.count("(") - line.count(")")
            continue
        flush()
        out.append(line)
    flush()
    return "".join(out)


def generated() -> dict[Path, str]:
    """``{sync twin path: its text}`` for every pair in :data:`TWINS` whose source exists."""
    result: dict[Path, str] = {}
    for source, target in TWINS:
        path = PACKAGE / source
        if path.exists():
            result[PACKAGE / target] = sort_imports(unasync(path.read_text(), source))
    return result


def main(argv: list[str]) -> int:
    check = "--check" in argv
    unknown = [arg for arg in argv if arg != "--check"]
    if unknown:
        print(f"gen_sync.py: unknown argument {unknown[0]!r} (usage: gen_sync.py [--check])")
        return 2
    try:
        twins = generated()
    except SourceError as exc:
        print(f"gen_sync.py: {exc}")
        return 1
    stale = [path for path, text in twins.items() if not path.exists() or path.read_text() != text]
    if check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python tools/gen_sync.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(twins[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
