"""The Spark schema of change events: a fixed envelope, optionally with a typed full document.

One place defines the columns so the ``foreach_batch`` helper and the data
source produce identical DataFrames. BSON values that Spark cannot type
without a user schema (document keys, documents, update descriptions) are
relaxed Extended JSON strings: lossless and readable with ``from_json``.
"""

from __future__ import annotations

__all__ = ["ENVELOPE_COLUMNS", "event_ddl"]

ENVELOPE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("resume_token", "STRING"),  # the token's _data hex: unique, sorts in stream order
    ("operation_type", "STRING"),
    ("database", "STRING"),  # ns.db
    ("collection", "STRING"),  # ns.coll (null for dropDatabase)
    ("document_key", "STRING"),
    ("cluster_time", "STRUCT<t: BIGINT, i: BIGINT>"),  # seconds AND increment
    ("wall_time", "TIMESTAMP"),
    ("full_document", "STRING"),
    ("full_document_before_change", "STRING"),
    ("update_description", "STRING"),
    ("operation_description", "STRING"),  # DDL events (show_expanded_events)
    ("to_database", "STRING"),  # rename target
    ("to_collection", "STRING"),
    ("txn_number", "BIGINT"),
    ("lsid", "STRING"),
)
"""``(name, Spark type)`` of every envelope column, in order."""

_DOCUMENT_COLUMNS = frozenset({"full_document", "full_document_before_change"})


def event_ddl(
    full_document_schema: str | None = None, *, publish_full_document_only: bool = False
) -> str:
    """The Spark DDL of the rows produced for these options.

    ``full_document_schema`` (a DDL such as ``"_id STRING, qty INT"``) types
    both document columns as a ``STRUCT``; with ``publish_full_document_only``
    the rows *are* the full documents (its columns, or one ``full_document``
    JSON string column without a schema).
    """
    user = full_document_schema.strip() if full_document_schema else None
    if full_document_schema is not None and not user:
        raise ValueError("full_document_schema is empty; pass a DDL such as '_id STRING, qty INT'")
    if publish_full_document_only:
        return user or "full_document STRING"
    columns = [
        (name, f"STRUCT<{user}>" if user and name in _DOCUMENT_COLUMNS else spark_type)
        for name, spark_type in ENVELOPE_COLUMNS
    ]
    return ", ".join(f"{name} {spark_type}" for name, spark_type in columns)
