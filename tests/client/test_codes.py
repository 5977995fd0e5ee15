"""One table of codes and labels, one exception hierarchy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import changestream
from changestream import _codes, errors


def test_client_modules_name_codes_and_labels_only_through_codes_py() -> None:
    package = Path(changestream.__file__).parent
    literal = re.compile(
        r"(==|!=|=)\s*(286|43|13)\b|\"(Resumable|NonResumable)ChangeStreamError\"|\"RetryableError\""
    )
    offenders = []
    for path in package.rglob("*.py"):
        if "testing" in path.relative_to(package).parts or path.name == "_codes.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if literal.search(code):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert offenders == []


def test_code_sets_are_the_specs() -> None:
    assert _codes.CURSOR_NOT_FOUND in _codes.TRANSIENT_CODES
    assert _codes.CURSOR_KILLED in _codes.TRANSIENT_CODES, "consume's choice, not the spec's"
    assert _codes.CURSOR_KILLED not in _codes.RESUMABLE_CODES_BEFORE_4_4
    assert 134 in _codes.RETRYABLE_READ_CODES and 134 not in _codes.RESUMABLE_CODES_BEFORE_4_4
    assert len(_codes.RESUMABLE_CODES_BEFORE_4_4) == 17


def test_one_hierarchy_without_pairs() -> None:
    for name in errors.__all__:
        assert getattr(changestream, name) is getattr(errors, name)
        if not isinstance(getattr(errors, name), type):  # describe_error, one_line
            continue
        assert issubclass(getattr(errors, name), errors.ChangeStreamError)
    for name in ("HistoryLostError", "StreamInvalidatedError", "NotResumableError",
                 "RetriesExhaustedError"):
        assert issubclass(getattr(errors, name), errors.ConsumeError)
    assert issubclass(changestream.TokenStoreError, errors.ChangeStreamError)


def test_spark_names_are_the_core_classes() -> None:
    pytest.importorskip("pyspark", reason="the Spark names need the spark extra (pyspark)")
    pytest.importorskip("pyarrow", reason="the Spark names need the spark extra (pyarrow)")
    from changestream.spark_adapter import _errors as spark_errors

    assert spark_errors.ChangeStreamHistoryLostError is errors.HistoryLostError
    assert spark_errors.ChangeStreamInvalidatedError is errors.StreamInvalidatedError
    lost = spark_errors.history_lost({"_data": "82"}, "cause")
    assert isinstance(lost, errors.HistoryLostError) and lost.token == {"_data": "82"}
    assert str(lost).startswith("ChangeStreamHistoryLost (code 286)")
    gone = spark_errors.invalidated({"_data": "83"})
    assert gone.invalidate_token == gone.token == {"_data": "83"}
