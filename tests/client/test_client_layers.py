"""The client's structure: layers without import cycles (the simulator's are in
``tests/testing/test_layers.py``, whose import graph this reuses).

Every runtime import of ``changestream`` outside ``changestream.testing`` counts, at
module level or inside a function (annotation-only imports under ``if TYPE_CHECKING:``
do not). A module may import its own layer or the layers below it, never one above,
and no modules may import each other in a cycle. A new module must be placed in a
layer here: the test fails on a module that belongs to none.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

import changestream
import tests.testing.test_layers as graphs

PACKAGE = "changestream"
ROOT = Path(changestream.__file__).parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Decisions and data without I/O: the spec's machine and its table, tokens, options,
    # typed events, consume's decisions, the parallel lanes, the snapshot run, metrics.
    ("core", (
        "changestream.errors", "changestream._codes", "changestream._token",
        "changestream._position", "changestream._options", "changestream._watch_types",
        "changestream._event_types", "changestream._event_build", "changestream.events",
        "changestream._actions", "changestream._states", "changestream._replies",
        "changestream._error_rules",
        "changestream._commands", "changestream._machine", "changestream._split",
        "changestream._match", "changestream._lanes", "changestream._hub_items",
        "changestream._snapshot", "changestream.stores", "changestream._diagnosis",
        "changestream._stream_view", "changestream._merge", "changestream._delta_schema",
        "changestream._delta_json", "changestream._js_code", "changestream._raw_rows",
        "changestream._metrics", "changestream._headroom", "changestream._probe",
        "changestream._server_metrics",
        "changestream._consumer",
        "changestream._consumer.*",
    )),
    # The one module that touches PyMongo's internals, and what both shells share.
    ("transport", ("changestream._pymongo", "changestream._shell", "changestream._read_ahead")),
    # The shells: written once for asyncio (aio/), their sync twins generated.
    ("shells", (
        "changestream.aio._*", "changestream._sync", "changestream._sync.*",
        "changestream._snapshot_read",
    )),
    # The public face users import.
    ("api", ("changestream", "changestream.aio")),
    # What is built on the public client: sinks, exporters, Spark, the command line.
    ("integrations", (
        "changestream.delta", "changestream._delta_sink", "changestream._delta_rows",
        "changestream._delta_layout", "changestream._delta_history",
        "changestream._delta_drift", "changestream._delta_database",
        "changestream._delta_resnapshot", "changestream._parallel_copy",
        "changestream._delta_verify", "changestream._delta_recopy",
        "changestream._delta_merger", "changestream._delta_behind", "changestream._delta_sizes",
        "changestream._json_worker",
        "changestream.exporters", "changestream.exporters.*",
        "changestream.spark_adapter", "changestream.spark_adapter.*", "changestream._cli",
        "changestream._cli.*", "changestream.__main__",
    )),
)
"""Bottom to top; each layer's modules as names or ``fnmatch`` patterns."""

NAMES = [name for name, _ in LAYERS]


def layer_of(module: str) -> str:
    for name, patterns in LAYERS:
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return name
    raise AssertionError(
        f"{module} belongs to no layer of the client: place it in LAYERS "
        f"(tests/client/test_client_layers.py) by what it may import"
    )


def client_graph() -> dict[str, set[str]]:
    graph = graphs.import_graph(ROOT, PACKAGE)
    inside = f"{PACKAGE}.testing"
    return {
        module: {dst for dst in targets if not dst.startswith(inside)}
        for module, targets in graph.items()
        if module != inside and not module.startswith(inside + ".")
    }


def test_the_client_has_no_import_cycle() -> None:
    graph = client_graph()
    assert len(graph) > 60, "the scan found the client's modules"
    cycle = graphs.find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_every_client_module_is_in_a_layer() -> None:
    unplaced = []
    for module in client_graph():
        try:
            layer_of(module)
        except AssertionError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def test_each_client_layer_imports_only_itself_and_the_layers_below() -> None:
    wrong = [
        f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
        for src, targets in sorted(client_graph().items())
        for dst in sorted(targets)
        if NAMES.index(layer_of(dst)) > NAMES.index(layer_of(src))
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("module", "layer"), [
    ("changestream._machine", "core"),
    ("changestream._consumer.run", "core"),
    ("changestream.aio._stream", "shells"),
    ("changestream.spark_adapter._source", "integrations"),
])
def test_layers_are_assigned_as_documented(module: str, layer: str) -> None:
    assert layer_of(module) == layer


def test_an_upward_import_is_caught() -> None:
    """The rule bites: a core module importing a shell is reported."""
    graph = {"changestream._machine": {"changestream.aio._stream"}, "changestream.aio._stream": set()}
    wrong = [(s, d) for s, ds in graph.items() for d in ds
             if NAMES.index(layer_of(d)) > NAMES.index(layer_of(s))]
    assert wrong == [("changestream._machine", "changestream.aio._stream")]


MAX_LINES = 750
"""A module past this holds more than one responsibility (issue 29): split it by concern."""


def test_no_client_module_is_over_750_lines() -> None:
    long = {
        module: n
        for module, path in graphs.module_files(ROOT, PACKAGE).items()
        if not module.startswith(f"{PACKAGE}.testing")
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by concern: {long}"
