"""The sync twins are generated from their asyncio sources (``tools/gen_sync.py``) and up to date.

A fix made in a sync twin by hand, or in an asyncio source without running the
tool, fails here; so does a marker the tool cannot honour.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_sync", ROOT / "tools" / "gen_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sync_twins_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "tools/gen_sync.py", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_twin_names_its_source_in_its_first_line() -> None:
    gen = _tool()
    for source, target in gen.TWINS:
        first = (ROOT / "changestream" / target).read_text().splitlines()[0]
        assert first.startswith("# Generated from changestream/" + source), (target, first)
        assert "python tools/gen_sync.py" in first


def test_the_rewrite() -> None:
    gen = _tool()
    source = '''"""Docs of changestream.aio.thing."""
import asyncio  # sync: import threading
from .._shell import StreamShell
from ._stream import AsyncChangeStream


class AsyncThing(StreamShell):
    async def __aenter__(self) -> AsyncChangeStream[Any]:
        async with self._lock:
            await self._settle()  # async-only
            # async-only: begin
            self._task: asyncio.Task[None] | None = None
            # async-only: end
            # sync-only: begin
            # self._thread = threading.Thread()
            # sync-only: end
            async for change in self:
                return await self.next()
        raise StopAsyncIteration
'''
    assert gen.unasync(source, "aio/_thing.py").splitlines()[1:] == '''"""Docs of changestream.thing."""
import threading
from ._shell import StreamShell
from ._stream import ChangeStream


class AsyncThing(StreamShell):
    def __enter__(self) -> ChangeStream[Any]:
        with self._lock:
            self._thread = threading.Thread()
            for change in self:
                return self.next()
        raise StopIteration
'''.splitlines()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("# async-only: begin\nx = 1\n", "not closed"),
        ("# sync-only: end\n", "without its begin"),
        ("# sync-only: begin\nx = 1\n# sync-only: end\n", "must be comments"),
        ("# async-only: begin\n# sync-only: begin\n", "nested"),
    ],
)
def test_a_broken_marker_is_named_with_its_line(text: str, problem: str) -> None:
    gen = _tool()
    with pytest.raises(gen.SourceError, match=problem):
        gen.unasync(text, "aio/_thing.py")


def test_imports_are_sorted_again_after_renames() -> None:
    gen = _tool()
    text = (
        "from __future__ import annotations\n\nimport threading\n"
        "from pymongo.synchronous.collection import Collection\nfrom pymongo.errors import (\n"
        "    OperationFailure,\n)\n\nx = 1\n"
    )
    assert gen.sort_imports(text) == (
        "from __future__ import annotations\n\nimport threading\nfrom pymongo.errors import (\n"
        "    OperationFailure,\n)\nfrom pymongo.synchronous.collection import Collection\n\nx = 1\n"
    )
