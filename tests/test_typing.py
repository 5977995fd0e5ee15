"""The public API's static types, checked by mypy (see ``tests/typing/api_types.py``)."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

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


def _runtime_options() -> dict[str, object]:
    """The runtime option table: ``ChangeStreamOptions``' fields and their defaults ("not set")."""
    import dataclasses

    from changestream._options import ChangeStreamOptions

    return {f.name: f.default for f in dataclasses.fields(ChangeStreamOptions) if f.name != "pipeline"}


def test_the_typed_options_are_exactly_the_runtime_options() -> None:
    from changestream._watch_types import AsyncWatchOptions, WatchOptions

    explicit = {"typed", "document_class"}  # parameters of watch() itself (they pick the overload)
    runtime = set(_runtime_options())
    assert set(WatchOptions.__optional_keys__) == runtime - explicit
    assert set(AsyncWatchOptions.__optional_keys__) == runtime - explicit


def _keyword_options(function: Any) -> dict[str, object]:
    signature = inspect.signature(function)
    return {
        name: parameter.default
        for name, parameter in signature.parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "on_resume_token_change"
    }


@pytest.mark.parametrize(
    "name",
    ["changestream.watch", "changestream.Client.watch", "changestream.Database.watch",
     "changestream.Collection.watch", "changestream.aio.watch"],
)
def test_every_watch_signature_lists_every_runtime_option_with_its_default(name: str) -> None:
    import changestream
    import changestream.aio

    module, _, attribute = name.rpartition(".")
    owner: Any = changestream.aio if module == "changestream.aio" else changestream
    if module.count(".") == 1 and module != "changestream.aio":
        owner = getattr(changestream, module.rpartition(".")[2])
    function = getattr(owner, attribute)
    assert _keyword_options(function) == _runtime_options()
    # Only misspelt names reach the catch-all, which raises the clear error listing valid ones.
    assert list(inspect.signature(function).parameters)[-1] == "unknown_options"


def test_every_overload_lists_every_runtime_option() -> None:
    get_overloads = getattr(typing, "get_overloads", None)
    if get_overloads is None:
        pytest.skip("typing.get_overloads needs Python 3.11+")
    import changestream
    import changestream.aio
    # Client/Database/Collection.watch are typed by the _BoundWatch protocol (overloads only).
    bound_watch = types.SimpleNamespace(__module__="changestream._sync._api",
                                        __qualname__="_BoundWatch.__call__")
    for function in (changestream.watch, bound_watch, changestream.aio.watch):
        overloads = get_overloads(function)
        assert len(overloads) == 4, function
        for overload in overloads:
            # typed / document_class have no default where they pick the overload
            options = _keyword_options(overload)
            assert set(options) == set(_runtime_options()), overload
            for name in set(options) - {"typed", "document_class"}:
                assert options[name] == _runtime_options()[name], (overload, name)


def test_an_unknown_option_still_gets_the_clear_error() -> None:
    from pymongo import AsyncMongoClient, MongoClient

    import changestream
    import changestream.aio

    client = MongoClient("mongodb://127.0.0.1:9", connect=False)
    try:
        for call in (
            lambda: changestream.watch(client.db.coll, fullDocument="updateLookup"),
            lambda: changestream.Client(client).db.coll.watch(fullDocument="updateLookup"),
        ):
            with pytest.raises(TypeError, match=r"unexpected option\(s\) 'fullDocument'; valid options are: .*full_document"):
                call()
    finally:
        client.close()

    async def async_call() -> None:
        aclient: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:9", connect=False)
        try:
            await changestream.aio.watch(aclient.db.coll, fullDocument="updateLookup")
        finally:
            await aclient.close()

    with pytest.raises(TypeError, match=r"unexpected option\(s\) 'fullDocument'; valid options are: "):
        asyncio.run(async_call())


def test_the_generated_signatures_are_up_to_date() -> None:
    """``tools/gen_watch_signatures.py`` writes the option parameters; the committed code is its output."""
    result = subprocess.run(
        [sys.executable, "tools/gen_watch_signatures.py", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
