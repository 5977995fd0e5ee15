"""The public API's static types, checked by mypy (see ``tests/typing/api_types.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_public_api_types_check_with_mypy_strict() -> None:
    pytest.importorskip("mypy", reason='mypy is not installed (pip install -e ".[dev]")')
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
         "tests/typing/api_types.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_typed_options_are_exactly_the_runtime_options() -> None:
    import dataclasses

    from changestream._options import ChangeStreamOptions
    from changestream._watch_types import AsyncWatchOptions, WatchOptions

    runtime = {f.name for f in dataclasses.fields(ChangeStreamOptions)}
    explicit = {"pipeline", "typed", "document_class"}  # parameters of watch() itself
    assert set(WatchOptions.__annotations__) | set(WatchOptions.__optional_keys__) == (
        runtime - explicit
    )
    assert set(AsyncWatchOptions.__optional_keys__) == runtime - explicit
