"""The Delta sink's column schema from what users write, without a JVM.

:class:`changestream.delta.DeltaSink` stores documents as columns when given a
schema: a ``pyarrow.Schema``, a Spark ``StructType`` (converted by pyspark's
own ``to_arrow_schema``), or text: a Spark DDL (``"name STRING, qty INT,
tags ARRAY<STRING>"``) or the schema JSON that Spark's ``StructType.json()``
prints and a Delta log stores. Spark parses DDL in the JVM, which the
``mirror`` command has not got, so DDL is read here into that same JSON and
delta-rs maps it to Arrow: the types pyspark's ``to_arrow_schema`` gives
(checked by the Spark tests), one mapping for every path.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa
from deltalake import Schema

from .errors import ChangeStreamError

__all__ = ["SchemaTextError", "arrow_schema", "ddl_to_json"]


class SchemaTextError(ChangeStreamError, ValueError):
    """A schema given as text (DDL or JSON) cannot be read; the message names where."""


_PRIMITIVE = {
    "string": "string", "varchar": "string", "char": "string", "text": "string",
    "int": "integer", "integer": "integer", "bigint": "long", "long": "long",
    "smallint": "short", "short": "short", "tinyint": "byte", "byte": "byte",
    "float": "float", "real": "float", "double": "double", "boolean": "boolean",
    "bool": "boolean", "binary": "binary", "date": "date", "timestamp": "timestamp",
    "timestamp_ltz": "timestamp", "timestamp_ntz": "timestamp_ntz",
}
"""Spark DDL type names -> Delta's (= Spark's JSON) type names."""

_TOKEN = re.compile(r"\s*(`(?:[^`]|``)*`|[A-Za-z_][A-Za-z0-9_]*|\d+|'(?:[^']|'')*'|[<>(),:])")


class _Ddl:
    """A recursive-descent reader of Spark DDL's column lists and types."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, int]] = []
        at = 0
        while at < len(text):
            if text[at:].strip() == "":
                break
            match = _TOKEN.match(text, at)
            if match is None:
                raise self.error(f"unexpected {text[at:].strip()[:20]!r}", at)
            self.tokens.append((match.group(1), match.start(1)))
            at = match.end()
        self.next = 0

    def error(self, problem: str, at: int | None = None) -> SchemaTextError:
        if at is None:
            at = self.tokens[self.next][1] if self.next < len(self.tokens) else len(self.text)
        return SchemaTextError(f"schema DDL at character {at + 1}: {problem}")

    def peek(self) -> str | None:
        return self.tokens[self.next][0] if self.next < len(self.tokens) else None

    def take(self, expected: str | None = None, what: str | None = None) -> str:
        """The next token (``expected``: must be it; ``what``: its description)."""
        token = self.peek()
        if token is None:
            wanted = what or (repr(expected) if expected else "more")
            raise self.error(f"expected {wanted}, the text ended")
        if expected is not None and token.upper() != expected.upper():
            raise self.error(f"expected {expected!r}, found {token!r}")
        self.next += 1
        return token

    def name(self) -> str:
        token = self.take(what="a column name")
        if token.startswith("`"):
            return token[1:-1].replace("``", "`")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token):
            raise self.error(f"expected a column name, found {token!r}", self.tokens[self.next - 1][1])
        return token

    def number(self, what: str) -> int:
        token = self.take(what=what)
        if not token.isdigit():
            raise self.error(f"expected {what}, found {token!r}", self.tokens[self.next - 1][1])
        return int(token)

    def fields(self, end: str | None) -> list[dict[str, Any]]:
        fields = []
        while True:
            name = self.name()
            if self.peek() == ":":
                self.take()
            type_ = self.type()
            nullable = True
            while (self.peek() or "").upper() in ("NOT", "COMMENT"):
                if self.take().upper() == "NOT":
                    self.take("NULL")
                    nullable = False
                elif not (self.peek() or "").startswith("'"):
                    raise self.error("expected a quoted comment")
                else:
                    self.take()
            fields.append({"name": name, "type": type_, "nullable": nullable, "metadata": {}})
            if self.peek() != ",":
                break
            self.take()
        if self.peek() != end:
            raise self.error(f"expected ',' or {'the end' if end is None else repr(end)}, "
                             f"found {self.peek()!r}")
        return fields

    def type(self) -> Any:
        at = self.tokens[self.next][1] if self.next < len(self.tokens) else len(self.text)
        word = self.take(what="a type").lower()
        if word == "array":
            self.take("<")
            element = self.type()
            self.take(">")
            return {"type": "array", "elementType": element, "containsNull": True}
        if word == "map":
            self.take("<")
            key = self.type()
            self.take(",")
            value = self.type()
            self.take(">")
            return {"type": "map", "keyType": key, "valueType": value, "valueContainsNull": True}
        if word == "struct":
            self.take("<")
            fields = self.fields(">")
            self.take(">")
            return {"type": "struct", "fields": fields}
        if word in ("decimal", "dec", "numeric"):
            precision, scale = 10, 0
            if self.peek() == "(":
                self.take()
                precision = self.number("a precision")
                if self.peek() == ",":
                    self.take()
                    scale = self.number("a scale")
                self.take(")")
            if not 0 < precision <= 38 or not 0 <= scale <= precision:
                raise self.error(f"decimal({precision},{scale}) is not a valid decimal", at)
            return f"decimal({precision},{scale})"
        if word not in _PRIMITIVE:
            raise self.error(f"unknown type {word.upper()!r}", at)
        if word in ("varchar", "char") and self.peek() == "(":
            self.take()
            self.take(what="a length")
            self.take(")")
        return _PRIMITIVE[word]


def ddl_to_json(ddl: str) -> str:
    """A Spark DDL column list as Spark's/Delta's schema JSON (``StructType.json()``)."""
    reader = _Ddl(ddl)
    if not reader.tokens:
        raise SchemaTextError("the schema is empty; give columns such as 'name STRING, qty INT'")
    return json.dumps({"type": "struct", "fields": reader.fields(None)})


def arrow_schema(schema: Any) -> pa.Schema:
    """``schema`` (Arrow, Spark ``StructType``, DDL or schema JSON) as a ``pyarrow.Schema``."""
    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, str):
        text = schema.strip()
        if text.startswith("{"):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SchemaTextError(f"schema JSON: {exc}") from exc
            if not isinstance(parsed, dict) or parsed.get("type") != "struct":
                raise SchemaTextError('schema JSON must be a struct: {"type": "struct", '
                                      '"fields": [...]} (what StructType.json() prints)')
        else:
            text = ddl_to_json(text)
        try:
            return pa.schema(Schema.from_json(text).to_arrow())
        except Exception as exc:  # delta-rs' own reading of the JSON: one line
            raise SchemaTextError(f"schema JSON: {str(exc).splitlines()[0]}") from exc
    if type(schema).__module__.startswith("pyspark") and type(schema).__name__ == "StructType":
        from pyspark.sql.pandas.types import to_arrow_schema

        return to_arrow_schema(schema, timezone="UTC")
    raise TypeError(
        "schema must be a pyarrow.Schema, a pyspark StructType or a Spark DDL / schema JSON "
        f"string, not {type(schema).__name__}"
    )
