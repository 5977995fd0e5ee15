"""The transport twins in ``_pymongo.py`` cannot drift: each sync method is its async twin minus ``await``.

The stream shells, ``snapshot_then_watch`` and ``consume`` are generated from
their asyncio sources (``tools/gen_sync.py``, checked by
``tests/test_generated_twins.py``). ``_pymongo.py`` is not: it is the one home of
PyMongo's private API and holds both transports side by side. This test
unasyncs the async methods (``async def``/``async with``/``await`` dropped,
``Async*`` names mapped) and requires the sync ones to be the same code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from changestream import _pymongo

_NAMES = {
    "AsyncRetrying": "Retrying",
    "AsyncTransport": "SyncTransport",
    "AsyncChangeStream": "ChangeStream",
    "AsyncSnapshotThenWatch": "SnapshotThenWatch",
    "AsyncExitStack": "ExitStack",
    "enter_async_context": "enter_context",
    "aclose": "close",
    "StopAsyncIteration": "StopIteration",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__anext__": "__next__",
    "__aiter__": "__iter__",
}


class _Unasync(ast.NodeTransformer):
    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> Any:
        node.name = _NAMES.get(node.name, node.name)
        return self.generic_visit(ast.FunctionDef(**{f: getattr(node, f) for f in node._fields}))

    def visit_AsyncWith(self, node: ast.AsyncWith) -> Any:
        return self.generic_visit(ast.With(**{f: getattr(node, f) for f in node._fields}))

    def visit_AsyncFor(self, node: ast.AsyncFor) -> Any:
        return self.generic_visit(ast.For(**{f: getattr(node, f) for f in node._fields}))

    def visit_Await(self, node: ast.Await) -> Any:
        return self.visit(node.value)

    def visit_Name(self, node: ast.Name) -> Any:
        node.id = _NAMES.get(node.id, node.id)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        node.attr = _NAMES.get(node.attr, node.attr)
        return self.generic_visit(node)


class _Normalise(ast.NodeTransformer):
    """Drop docstrings and annotations: prose and types may differ, the code may not."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        node.body = body or [ast.Pass()]
        node.returns = None
        for arg in [*node.args.args, *node.args.kwonlyargs]:
            arg.annotation = None
        return self.generic_visit(node)


def _code(function: Any, *, unasync: bool = False) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    if unasync:
        tree = _Unasync().visit(tree)
    return ast.dump(_Normalise().visit(tree))


@pytest.mark.parametrize(
    ("sync", "asynchronous"),
    [
        (_pymongo.SyncTransport.run, _pymongo.AsyncTransport.run),
        (_pymongo.SyncTransport.close, _pymongo.AsyncTransport.close),
        (_pymongo.SyncTransport._release, _pymongo.AsyncTransport._release),
    ],
    ids=lambda f: f.__qualname__,
)
def test_sync_code_is_the_async_code_without_await(sync: Any, asynchronous: Any) -> None:
    assert _code(sync) == _code(asynchronous, unasync=True)


def test_the_check_notices_drift() -> None:
    assert _code(_pymongo.SyncTransport.run) != _code(_pymongo.AsyncTransport.close, unasync=True)
