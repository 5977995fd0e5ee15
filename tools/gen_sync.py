"""Write the synchronous twins from their asyncio sources (as PyMongo's ``tools/synchro.py``).

The async modules under ``changestream/aio/`` are the one source; each sync
module in :data:`PAIRS` is generated from its twin, so a fix is written once
and the twins cannot drift. The rewrite works on :mod:`tokenize` tokens, not
on text, so a name inside a longer name, a string or a comment is never hit by
accident:

* ``async`` before ``def`` / ``with`` / ``for`` and every ``await`` are dropped;
* each name in :data:`NAMES` (``AsyncChangeStream``, ``__aenter__``,
  ``pymongo.asynchronous`` ...) becomes its sync name, in code and, as a whole
  word, in docstrings and comments; ``Awaitable[X]`` becomes ``X``;
* relative imports lose one level (``from .._token`` -> ``from ._token``,
  ``from ._stream`` stays), so ``aio/_x.py`` imports ``changestream/_x.py``;
* ``asyncio`` may appear only as ``import asyncio`` and ``asyncio.Event``
  (written ``threading``): any other use is an error, since it has no sync
  spelling; such steps live in ``changestream/aio/_async_io.py``, whose sync
  counterpart ``changestream/_sync_io.py`` defines the same names.

Where a twin must differ otherwise (a docstring, an import from elsewhere),
the source says so in a marked block::

    # BEGIN async-only
    ...code kept in the async module, dropped from the sync one
    # END async-only
    # BEGIN sync-only
    # ...code commented out in the async module, written uncommented in the sync one
    # END sync-only

Run from the checkout: ``python tools/gen_sync.py`` (rewrite the sync modules)
or ``python tools/gen_sync.py --check`` (exit 1 naming the stale ones);
``tests/test_gen_sync.py`` runs the check.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS = (
    ("changestream/aio/_consume.py", "changestream/_consume.py"),
    ("changestream/aio/_snapshot_watch.py", "changestream/_snapshot_watch.py"),
)
"""(async source, generated sync module), relative to the checkout."""

NAMES = {
    # pymongo
    "AsyncMongoClient": "MongoClient",
    "AsyncDatabase": "Database",
    "AsyncCollection": "Collection",
    "AsyncClientSession": "ClientSession",
    "asynchronous": "synchronous",
    # this package
    "AsyncChangeStream": "ChangeStream",
    "AsyncSnapshotThenWatch": "SnapshotThenWatch",
    "AsyncTransport": "SyncTransport",
    "_async_io": "_sync_io",
    # the language and the standard library
    "AsyncIterator": "Iterator",
    "AsyncIterable": "Iterable",
    "AsyncExitStack": "ExitStack",
    "asynccontextmanager": "contextmanager",
    "enter_async_context": "enter_context",
    "StopAsyncIteration": "StopIteration",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "aclose": "close",
    # tenacity
    "AsyncRetrying": "Retrying",
}
"""Async name -> sync name: identifiers in code, whole words in docstrings and comments."""

PROSE = {
    "changestream.aio.": "changestream.",
    "async with": "with",
    "async for": "for",
}
"""Phrases of docstrings and comments that name the async side (applied after :data:`NAMES`)."""

UNIONS = {"TokenStore | AsyncTokenStore": "TokenStore"}
"""Type unions (in code) that have fewer members on the sync side (an import the sync side
then does not use is dropped, and the imports are sorted again, by ruff's own fixes)."""

_MARK = re.compile(r"^(\s*)# (BEGIN|END) (sync|async)-only\s*$")
_WORD = re.compile(r"\b(" + "|".join(map(re.escape, NAMES)) + r")\b")


class GenerateError(Exception):
    """The async source uses something the generator cannot write synchronously."""


def _select_blocks(source: str, path: str) -> str:
    """Drop ``async-only`` blocks, uncomment ``sync-only`` ones, drop the marker lines."""
    out: list[str] = []
    block: str | None = None
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        mark = _MARK.match(line)
        if mark:
            indent, edge, side = mark.groups()
            if (edge == "BEGIN") == (block is not None) or (edge == "END" and side != block):
                raise GenerateError(f"{path}:{number}: unbalanced {edge} {side}-only")
            block = side if edge == "BEGIN" else None
            continue
        if block == "async":
            continue
        if block == "sync":
            stripped = line.lstrip()
            indent = line[: len(line) - len(stripped)]
            if stripped.startswith("# "):
                line = indent + stripped[2:]
            elif stripped.rstrip("\n") == "#":
                line = "\n"
            else:
                raise GenerateError(f"{path}:{number}: a sync-only line must be a comment")
        out.append(line)
    if block is not None:
        raise GenerateError(f"{path}: {block}-only block not closed")
    return "".join(out)


def _prose(text: str) -> str:
    text = _WORD.sub(lambda m: NAMES[m.group(1)], text)
    for old, new in PROSE.items():
        text = text.replace(old, new)
    return text.replace("await ", "")


def _rewrite(source: str, path: str) -> str:
    """Rewrite async code token by token (edits by position, so the layout stays)."""
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def at(position: tuple[int, int]) -> int:
        return offsets[position[0] - 1] + position[1]

    tokens = [
        t for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT)
    ]
    edits: list[tuple[int, int, str]] = []
    closing: list[int] = []  # indices of ``]`` tokens that close a dropped ``Awaitable[``
    for index, token in enumerate(tokens):
        start, end = at(token.start), at(token.end)
        following = tokens[index + 1] if index + 1 < len(tokens) else token
        previous = tokens[index - 1] if index else token
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            edits.append((start, end, _prose(token.string)))
        elif token.type != tokenize.NAME and token.type != tokenize.OP:
            continue
        elif token.string == "await" or (
            token.string == "async" and following.string in ("def", "with", "for")
        ):
            edits.append((start, at(following.start), ""))
        elif token.string == "Awaitable" and following.string == "[":
            edits.append((start, at(following.end), ""))
            depth = 0
            for later in range(index + 1, len(tokens)):
                depth += {"[": 1, "]": -1}.get(tokens[later].string, 0)
                if depth == 0:
                    closing.append(later)
                    break
        elif token.string == "]" and index in closing:
            edits.append((start, end, ""))
        elif token.string == "asyncio":
            if previous.string == "import" or (
                following.string == "." and tokens[index + 2].string == "Event"
            ):
                edits.append((start, end, "threading"))
            else:
                raise GenerateError(
                    f"{path}:{token.start[0]}: asyncio.{tokens[index + 2].string} has no sync "
                    "spelling: call it through changestream/aio/_async_io.py"
                )
        elif token.string in NAMES:
            edits.append((start, end, NAMES[token.string]))
        elif token.string == "." and previous.string == "from" and following.string == ".":
            edits.append((start, end, ""))  # ``from ..x`` -> ``from .x``
    text = source
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    for union, sync in UNIONS.items():
        text = text.replace(union, sync)
    return text


def _tidy_imports(text: str, target_path: str) -> str:
    """Sort the imports and drop the ones only the async side used (ruff's own fixes)."""
    try:
        done = subprocess.run(
            ["ruff", "check", "--fix-only", "--quiet", "--select", "I,F401",
             "--stdin-filename", target_path, "-"],
            input=text, capture_output=True, text=True, cwd=ROOT, check=False,
        )
    except FileNotFoundError:
        raise GenerateError("needs ruff on PATH (pip install -e '.[dev]')") from None
    if done.returncode != 0:
        raise GenerateError(f"ruff could not tidy {target_path}: {done.stderr.strip()}")
    return done.stdout


def generate(source_path: str, target_path: str) -> str:
    """The sync module written from ``source_path``."""
    source = (ROOT / source_path).read_text()
    text = _tidy_imports(_rewrite(_select_blocks(source, source_path), source_path), target_path)
    header = (
        f"# Generated from {source_path} by `python tools/gen_sync.py`: edit that file and "
        "rerun, do not edit this one.\n"
    )
    compile(text, target_path, "exec")  # a broken rewrite fails here, not at import time
    return header + text


def main(argv: list[str]) -> int:
    check = argv[1:] == ["--check"]
    if argv[1:] and not check:
        print("usage: python tools/gen_sync.py [--check]", file=sys.stderr)
        return 2
    stale = []
    for source_path, target_path in PAIRS:
        try:
            text = generate(source_path, target_path)
        except GenerateError as exc:
            print(f"gen_sync: {exc}", file=sys.stderr)
            return 1
        target = ROOT / target_path
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target_path)
        if not check:
            target.write_text(text)
    if check and stale:
        print(
            "stale generated sync modules (edit the async source, then run "
            f"`python tools/gen_sync.py`): {', '.join(stale)}",
            file=sys.stderr,
        )
        return 1
    for target_path in [] if check else stale:
        print(f"wrote {target_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
