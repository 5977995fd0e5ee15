"""The API reference (``docs/api``, Sphinx autodoc) builds without a warning and covers
every typed event class and every public name."""

from __future__ import annotations

import dataclasses
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

import changestream
from changestream import events

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("sphinx", reason='Sphinx is not installed (pip install -e ".[docs]")')
    out = tmp_path_factory.mktemp("api")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(ROOT / "docs" / "api"), str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def text(page: Path) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page.read_text())).split())


def test_every_event_class_and_field_is_in_the_reference(built: Path) -> None:
    page = text(built / "events.html")
    for cls in [events.ChangeEvent, *events._EVENT_CLASSES.values(), events.UnknownEvent]:
        start = page.index("Fields of every event class")
        section = page[page.index(cls.__name__, start):]
        for field in dataclasses.fields(cls):
            assert field.name in section[:4000], (cls.__name__, field.name)


def test_every_public_name_is_in_the_reference(built: Path) -> None:
    pages = " ".join(text(p) for p in built.glob("*.html"))
    lazy = {"aio", "spark_adapter", "__version__"}
    missing = [n for n in changestream.__all__ if n not in lazy and n not in pages]
    assert missing == []
