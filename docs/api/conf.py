"""Sphinx configuration of the API reference (``sphinx-build -W -b html docs/api build/api``).

Sphinx with autodoc, because the docstrings are already written in its markup
(``:func:``, ``:class:``, ``:attr:`` cross-references, ``::`` literal blocks);
the user guides stay Markdown in ``docs/``. Warnings are errors in CI: a broken
docstring or a typed event class missing from the reference fails the build.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the checkout, ahead of any installed copy
sys.path.insert(0, str(HERE / "_ext"))

import changestream  # noqa: E402

project = "changestream"
release = version = changestream.__version__
extensions = ["sphinx.ext.autodoc", "event_fields"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Names that only exist for type checkers (``if TYPE_CHECKING:`` imports) stay unresolved.
autodoc_type_aliases: dict[str, str] = {}
suppress_warnings = ["ref.python"]
