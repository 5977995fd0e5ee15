"""The storage layer: BSON value order, query matching, indexes, the catalog, sessions and
transactions, and the :class:`~.deployment.Deployment` that holds a deployment's state.

The names below are re-exported for callers that import them from the package.
"""

from __future__ import annotations

from .catalog import Catalog, CollectionState, check_collection_name, check_db_name
from .indexes import DuplicateKey
from .order import (
    bson_repr,
    canonical_type,
    compare_values,
    copy_value,
    id_key,
    sort_key,
    type_name,
    values_equal,
    values_identical,
)
from .query import compile_query, id_equality, matches, path_values

__all__ = [
    "Catalog",
    "CollectionState",
    "DuplicateKey",
    "bson_repr",
    "canonical_type",
    "check_collection_name",
    "check_db_name",
    "compare_values",
    "compile_query",
    "copy_value",
    "id_equality",
    "id_key",
    "matches",
    "path_values",
    "sort_key",
    "type_name",
    "values_equal",
    "values_identical",
]
