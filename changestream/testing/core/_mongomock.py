"""The ONLY module that touches mongomock: the simulator's query matcher and the aggregation
engine behind its plain pipelines, views and expressions.

mongomock's public API is a fake ``MongoClient``; the pieces the simulator needs sit below it
and are untyped. Every one is listed here with why, and typed once below, so a new mongomock
is checked in one place (``pyproject.toml`` bounds it to the versions checked: each item exists
with the same call shape in 4.1.1, 4.1.2, 4.2.0.post1 and 4.3.0):

* ``mongomock.OperationFailure`` (public): what its matcher and evaluators raise for a bad
  query, expression or stage; callers turn it into mongod's error.
* ``mongomock.filtering.filter_applies(query, doc)``: the query matcher behind ``$match``,
  find filters and validators (its ``$expr`` needs ``mongomock.aggregate`` imported, which
  registers the expression parser with the matcher).
* ``mongomock.aggregate._Parser(doc_dict, user_vars=, ignore_missing_keys=)`` and its
  ``parse(expression)``: the expression evaluator. Subclassed here so the simulator can add
  operators mongomock lacks (``$mergeObjects``); its ``parse`` recurses through ``self.parse``,
  so an added operator works at any depth.
* ``mongomock.aggregate.*_operators`` (``arithmetic_operators``, ``date_operators``, ...): the
  expression operators it knows, so an unknown one is refused when the stage is parsed (as
  mongod does) rather than on the first event.
* ``mongomock.aggregate._PIPELINE_HANDLERS``: the stage functions ``(docs, database, spec) ->
  docs`` (``$sort``, ``$group``, ``$unwind``, ...) for plain aggregations.
* ``mongomock.aggregate.process_pipeline(docs, database, pipeline, session)``: a whole
  pipeline, for views.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import mongomock
from mongomock import aggregate as _aggregate
from mongomock import filtering as _filtering

OperationFailure: Final[type[Exception]] = mongomock.OperationFailure
"""mongomock's error for a bad query, expression or stage."""

Doc = dict[str, Any]
StageHandler = Callable[[list[Doc], Any, Any], list[Doc]]
ExtraOperator = Callable[[Callable[[Any], Any], Any], Any]
"""An operator mongomock lacks: ``(parse, argument) -> value``; ``parse`` evaluates a
sub-expression (raising ``KeyError`` for a missing field)."""

KNOWN_OPERATORS: Final[frozenset[str]] = frozenset(
    op
    for name in dir(_aggregate)
    if name.endswith("_operators")
    for op in getattr(_aggregate, name)
)
"""Every expression operator mongomock's evaluator knows."""

STAGE_HANDLERS: Final[Mapping[str, StageHandler]] = {
    name: handler
    for name, handler in _aggregate._PIPELINE_HANDLERS.items()
    if handler is not None and name not in ("$out", "$lookup", "$graphLookup", "$facet")
}
"""mongomock's stage functions, without those that reach other collections (its ``$out``,
``$lookup``, ``$graphLookup`` and ``$facet`` need its own database object)."""

_filter_applies: Callable[[Any, Any], bool] = _filtering.filter_applies
_process_pipeline: Callable[[Any, Any, Any, Any], Iterable[Doc]] = _aggregate.process_pipeline
_base_parse: Callable[[Any, Any], Any] = _aggregate._Parser.parse


def filter_applies(query: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` matches ``query`` (raises mongomock's errors for a bad query)."""
    return bool(_filter_applies(query, doc))


class _Parser(_aggregate._Parser):
    """mongomock's evaluator plus the simulator's ``extra`` operators."""

    def __init__(
        self, doc: Any, user_vars: dict[str, Any], extra: Mapping[str, ExtraOperator]
    ) -> None:
        super().__init__(doc, user_vars=user_vars, ignore_missing_keys=True)  # type: ignore[no-untyped-call]
        self._extra = extra

    def parse(self, expression: Any) -> Any:
        if isinstance(expression, dict) and len(expression) == 1:
            op, arg = next(iter(expression.items()))
            extra = self._extra.get(op)
            if extra is not None:
                return extra(self.parse, arg)
        return _base_parse(self, expression)


def evaluate(
    expr: Any,
    doc: Any,
    *,
    user_vars: Mapping[str, Any] | None = None,
    extra: Mapping[str, ExtraOperator] | None = None,
) -> Any:
    """Aggregation expression ``expr`` against ``doc``, missing fields ignored where mongod
    ignores them; ``KeyError`` when the result itself is missing."""
    return _Parser(doc, dict(user_vars or {}), extra or {}).parse(expr)


def run_pipeline(docs: list[Doc], pipeline: list[Any]) -> list[Doc]:
    """A whole pipeline over ``docs`` (views); raises mongomock's errors."""
    return list(_process_pipeline(docs, None, pipeline, None))
