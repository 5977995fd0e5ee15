"""The sync twins are generated from the async sources (``tools/gen_sync.py``) and cannot drift."""

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


def test_the_generated_sync_modules_are_up_to_date() -> None:
    """Edit the async source, then run ``python tools/gen_sync.py``; the committed code is its output."""
    result = subprocess.run(
        [sys.executable, "tools/gen_sync.py", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_generated_module_names_its_source_and_the_command() -> None:
    for source, target in _tool().PAIRS:
        first = (ROOT / target).read_text().splitlines()[0]
        assert first.startswith(f"# Generated from {source} by `python tools/gen_sync.py`")


def test_the_rewrite_drops_await_and_maps_names_in_code_only_as_whole_words() -> None:
    source = (
        "import asyncio\n"
        "from .._token import ResumeToken\n"
        "from ._stream import AsyncChangeStream\n\n\n"
        "async def f(s: AsyncChangeStream[int], e: asyncio.Event) -> Awaitable[list[int]]:\n"
        '    """Iterate with ``async for`` over an :class:`AsyncChangeStream`."""\n'
        "    MyAsyncChangeStream = 1  # AsyncChangeStream.__aenter__\n"
        "    async with s:\n"
        "        async for x in s:\n"
        "            await s.aclose()\n"
        "    raise StopAsyncIteration\n"
    )
    assert _tool()._rewrite(source, "x.py") == (
        "import threading\n"
        "from ._token import ResumeToken\n"
        "from ._stream import ChangeStream\n\n\n"
        "def f(s: ChangeStream[int], e: threading.Event) -> list[int]:\n"
        '    """Iterate with ``for`` over an :class:`ChangeStream`."""\n'
        "    MyAsyncChangeStream = 1  # ChangeStream.__enter__\n"
        "    with s:\n"
        "        for x in s:\n"
        "            s.close()\n"
        "    raise StopIteration\n"
    )


def test_asyncio_without_a_sync_spelling_is_refused() -> None:
    tool = _tool()
    with pytest.raises(tool.GenerateError, match=r"x\.py:2: asyncio\.to_thread has no sync spelling"):
        tool._rewrite("import asyncio\nasyncio.to_thread(print)\n", "x.py")


def test_marked_blocks_choose_the_side() -> None:
    source = (
        "a = 1\n"
        "# BEGIN async-only\n"
        "b = 2\n"
        "# END async-only\n"
        "# BEGIN sync-only\n"
        "# b = 3\n"
        "#\n"
        "# END sync-only\n"
    )
    tool = _tool()
    assert tool._select_blocks(source, "x.py") == "a = 1\nb = 3\n\n"
    with pytest.raises(tool.GenerateError, match=r"x\.py: async-only block not closed"):
        tool._select_blocks("# BEGIN async-only\n", "x.py")


def test_the_check_names_a_stale_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tool = _tool()
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    for source, target in tool.PAIRS:
        for path in (source, target):
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text((ROOT / path).read_text())
    source, target = tool.PAIRS[0]
    (tmp_path / target).write_text((ROOT / target).read_text() + "# a hand edit\n")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    assert tool.main(["gen_sync.py", "--check"]) == 1
    assert f"stale generated sync modules (edit the async source, then run `python tools/gen_sync.py`): {target}" in capsys.readouterr().err
    assert tool.main(["gen_sync.py"]) == 0
    assert (tmp_path / target).read_text() == (ROOT / target).read_text()
