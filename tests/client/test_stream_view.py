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


def polled_classes() -> list[type]:
    """Every class defined in the client (not the simulator) that has ``try_next``."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(changestream.__path__, "changestream."):
        if info.name.startswith(("changestream.testing", "changestream.spark_adapter",
                                 "changestream.exporters", "changestream.delta")) or (
                info.name.endswith("__main__")):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and hasattr(cls, "try_next"):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[name] for name in sorted(found)]


def test_the_view_names_what_the_consumers_use() -> None:
    assert {"stalled", "carried_token", "present_token", "take_carried", "client",
            "buffered", "resume_token", "alive", "position", "resumes"} <= view_members()


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
