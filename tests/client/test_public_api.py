"""The public face: everything users import resolves, internals are private, and
``import changestream`` loads neither the asyncio shell nor PySpark."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import changestream

SPARK_EXTRA = ("pyspark", "pyarrow")
"""What ``spark_adapter`` needs (the ``spark`` extra); the oldest-PyMongo leg runs without it."""


def test_every_exported_name_resolves() -> None:
    spark_missing = [m for m in SPARK_EXTRA if importlib.util.find_spec(m) is None]
    for name in changestream.__all__:
        if name == "spark_adapter" and spark_missing:
            with pytest.raises(ImportError):
                getattr(changestream, name)
            continue
        assert getattr(changestream, name) is not None, name


def test_aio_and_spark_adapter_are_imported_on_first_use() -> None:
    code = (
        "import sys, changestream\n"
        "assert 'changestream.aio' not in sys.modules\n"
        "assert 'changestream.spark_adapter' not in sys.modules\n"
        "assert 'pyspark' not in sys.modules\n"
        "assert callable(changestream.aio.watch)\n"
        "assert 'changestream.aio' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        changestream.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_internal_modules_are_private() -> None:
    from pathlib import Path

    package = Path(changestream.__file__).parent
    public = {"__init__", "__main__", "delta", "errors", "events", "stores"}
    modules = {p.stem for p in package.glob("*.py")}
    assert {m for m in modules if not m.startswith("_")} <= public


def test_spark_adapter_without_the_extra_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['pyspark'] = None  # as if the spark extra were not installed\n"
        "import changestream\n"
        "try:\n"
        "    changestream.spark_adapter\n"
        "except ImportError as exc:\n"
        "    assert \"pip install 'changestream[spark]'\" in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_lazy_table_matches_the_static_imports() -> None:
    """``changestream._HOMES`` (where a public name is imported from on first use) says
    what the ``TYPE_CHECKING`` imports (what type checkers and readers see) say, and
    names everything in ``__all__`` but the lazy subpackages and ``__version__``."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(changestream.__file__).read_text(encoding="utf-8"))
    static: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module:
                    home = "." * statement.level + statement.module
                    static.update((alias.name, home) for alias in statement.names)
    assert static == changestream._HOMES
    assert set(changestream.__all__) - set(static) == {"aio", "spark_adapter", "__version__"}


def test_import_changestream_loads_no_pymongo() -> None:
    """What lets the command line catch a Ctrl-C while PyMongo loads (issue 33 item 16)."""
    code = ("import sys, changestream\n"
            "assert 'pymongo' not in sys.modules, 'pymongo'\n"
            "assert callable(changestream.watch) and 'pymongo' in sys.modules\n"
            "assert changestream.errors.ChangeStreamError and changestream.stores.TokenStore\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
