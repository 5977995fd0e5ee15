"""Every stream class implements the consumers' typed view (``_stream_view.StreamView``).

``consume``, the hub, the stats timer and the Spark prefetcher read a stream only
through :class:`StreamView`; a stream class that lacked a member used to make them
fall back silently (no batch admission, no stall detection). Here every class of the
client that can be polled (it has ``try_next``) must have every member of the view.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import pytest

import changestream
from changestream._stream_view import StreamView


def view_members() -> set[str]:
    return {
        name for name, value in vars(StreamView).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def missing_members(cls: type) -> set[str]:
    return {name for name in view_members() if not hasattr(cls, name)}


OPTIONAL = frozenset({"pyarrow", "deltalake", "numpy", "duckdb", "pyspark", "pandas",
                      "prometheus_client", "opentelemetry"})
"""Packages of the extras: a module needing one that is not installed holds no stream class."""


def polled_classes() -> list[type]:
    """Every class defined in the client (not the simulator) that has ``try_next``."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(changestream.__path__, "changestream."):
        if info.name.startswith(("changestream.testing", "changestream.spark_adapter",
                                 "changestream.exporters", "changestream.delta")) or (
                info.name.endswith("__main__")):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:  # a module of an extra that is not installed
            missing = exc if isinstance(exc, ModuleNotFoundError) else exc.__cause__
            if (isinstance(missing, ModuleNotFoundError)
                    and (missing.name or "").split(".")[0] in OPTIONAL):
                continue
            raise
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and hasattr(cls, "try_next"):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[name] for name in sorted(found)]


def test_the_view_names_what_the_consumers_use() -> None:
    assert {"stalled", "carried_token", "present_token", "take_carried", "client",
            "buffered", "resume_token", "alive", "position", "resumes"} <= view_members()


def test_the_view_has_the_interrupt_the_stop_watcher_calls() -> None:
    """The sync stop watcher ends a waiting poll from its own thread through ``interrupt``
    (a close from there raced a snapshot's copy for its session)."""
    assert "interrupt" in view_members()


def test_the_stream_classes_are_all_found() -> None:
    names = {cls.__name__ for cls in polled_classes()}
    assert {"ChangeStream", "AsyncChangeStream", "SnapshotThenWatch",
            "AsyncSnapshotThenWatch"} <= names


@pytest.mark.parametrize("cls", polled_classes(), ids=lambda cls: cls.__qualname__)
def test_every_stream_class_implements_the_view(cls: type) -> None:
    assert missing_members(cls) == set(), (
        f"{cls.__qualname__} lacks {sorted(missing_members(cls))} of StreamView: consume, the "
        "hub and the Spark prefetcher need them (see changestream/_stream_view.py)"
    )


def test_a_class_lacking_a_member_is_caught() -> None:
    class HalfStream:
        resume_token: Any = None
        alive = True

        def try_next(self) -> None:
            return None

    assert "take_carried" in missing_members(HalfStream)
    assert not isinstance(HalfStream(), StreamView)


# -- nobody else reads a stream's private members ------------------------------------------------
STREAM_MODULES = ("_shell.py", "aio/_stream.py", "_sync/_stream.py", "aio/_snapshot_watch.py",
                  "_sync/_snapshot_watch.py")
"""Where the stream classes live: their private members are theirs alone."""


def _private_names_of_streams(root: Any) -> set[str]:
    """Every ``self._name`` a stream class assigns or defines (its private members)."""
    import ast

    names: set[str] = set()
    for relative in STREAM_MODULES:
        tree = ast.parse((root / relative).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and item.name.startswith("_") and not item.name.startswith("__")):
                        names.add(item.name)
                    if (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name)
                            and item.value.id == "self" and item.attr.startswith("_")
                            and not item.attr.startswith("__")):
                        names.add(item.attr)
    return names


def private_stream_reads(root: Any) -> list[str]:
    """``module:line name`` of each read of a stream's private member outside its class's
    modules: ``x._name`` on anything but ``self``/``cls``, or ``getattr(x, "_name")``."""
    import ast

    private = _private_names_of_streams(root)
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative in STREAM_MODULES or relative.startswith("testing/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in private):
                name = str(node.args[1].value)
            if name is not None:
                found.append(f"{relative}:{node.lineno} {name}")
    return found


def test_no_module_reads_a_streams_private_members() -> None:
    from pathlib import Path

    root = Path(changestream.__file__).parent
    assert {"_machine", "_take_guarded", "_start"} <= _private_names_of_streams(root)
    assert private_stream_reads(root) == [], (
        "read through changestream._stream_view.StreamView (or a public method) instead"
    )


def test_a_private_read_is_found(tmp_path: Any) -> None:
    from pathlib import Path

    root = Path(changestream.__file__).parent
    package = tmp_path / "pkg"
    for relative in STREAM_MODULES:
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text((root / relative).read_text())
    (package / "consumer.py").write_text(
        "def f(stream):\n    return stream._machine, getattr(stream, '_take_guarded', None)\n")
    assert private_stream_reads(package) == ["consumer.py:2 _machine", "consumer.py:2 _take_guarded"]
