"""``python -m spec_tests.sync`` against a local archive shaped like GitHub's (no network)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from spec_tests import sync
from spec_tests.runner.loader import discover, label_for, missing_reason, spec_dir

UNIFIED = {"description": "x", "schemaVersion": "1.0", "tests": []}


def _archive(tmp_path: Path, files: dict[str, str]) -> Path:
    path = tmp_path / "specifications.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"specifications-{sync.COMMIT}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _fake_repo(tmp_path: Path) -> Path:
    unified = json.dumps(UNIFIED)
    return _archive(
        tmp_path,
        {
            "source/change-streams/tests/unified/change-streams.json": unified,
            "source/change-streams/tests/unified/change-streams.yml": "description: x\n",
            "source/retryable-reads/tests/unified/changeStreams-client.watch.json": unified,
            "source/retryable-reads/tests/unified/find.json": unified,
            "source/client-side-operations-timeout/tests/change-streams.json": unified,
            "source/unified-test-format/tests/valid-pass/poc-change-streams.json": unified,
            "source/crud/tests/unified/insertOne.json": unified,
        },
    )


@pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")
def test_the_pinned_commit_is_the_one_the_spec_files_here_came_from() -> None:
    source = (spec_dir() / sync.MARKER).read_text(encoding="utf-8")
    assert f"Commit: {sync.COMMIT}" in source


def test_sync_lays_out_only_the_in_scope_files_where_the_loader_looks(tmp_path: Path) -> None:
    dest = tmp_path / "spec"
    written = sync.sync(dest, _fake_repo(tmp_path).as_uri())
    assert sorted(written) == [
        "change-streams/unified/change-streams.json",
        "change-streams/unified/change-streams.yml",
        "csot/tests/change-streams.json",
        "related/retryable-reads/changeStreams-client.watch.json",
        "related/unified-test-format-valid-pass/poc-change-streams.json",
    ]
    assert sync.COMMIT in (dest / sync.MARKER).read_text()
    labels = sorted(label_for(p, dest) for p in discover(root=dest))
    assert labels == [
        "change-streams.json",
        "csot/change-streams.json",
        "retryable-reads/changeStreams-client.watch.json",
        "unified-test-format-valid-pass/poc-change-streams.json",
    ]


def test_an_archive_without_the_spec_files_leaves_the_destination_alone(tmp_path: Path) -> None:
    dest = tmp_path / "spec"
    dest.mkdir()
    (dest / "keep").write_text("old")
    bad = _archive(tmp_path, {"source/crud/tests/unified/insertOne.json": "{}"})
    with pytest.raises(sync.SyncError, match="no change-streams/unified"):
        sync.sync(dest, bad.as_uri())
    assert (dest / "keep").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".spec-sync-")] == []
    with pytest.raises(sync.SyncError, match="cannot download"):
        sync.sync(dest, (tmp_path / "absent.tar.gz").as_uri())


def test_command_line_downloads_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "out"
    url = _fake_repo(tmp_path).as_uri()
    assert sync.main(["--dest", str(dest), "--url", url]) == 0
    assert "5 files written" in capsys.readouterr().out
    assert sync.main(["--dest", str(dest), "--url", (tmp_path / "nope").as_uri()]) == 1
    assert "error: cannot download" in capsys.readouterr().err


def test_the_loader_prefers_spec_tests_dir_then_shared_then_the_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = tmp_path / "clone"
    monkeypatch.setattr("spec_tests.runner.loader.checkout_dir", lambda: checkout)
    monkeypatch.delenv("SPEC_TESTS_DIR", raising=False)
    reason = missing_reason()
    assert reason is not None and "python -m spec_tests.sync" in reason and "\n" not in reason
    sync.sync(checkout / ".spec", _fake_repo(tmp_path).as_uri())
    assert spec_dir() == checkout / ".spec" and missing_reason() is None
    shared = tmp_path / "shared" / "spec"
    shared.mkdir(parents=True)
    assert spec_dir() == shared
    monkeypatch.setenv("SPEC_TESTS_DIR", str(tmp_path / "elsewhere"))
    assert spec_dir() == tmp_path / "elsewhere"
    assert "$SPEC_TESTS_DIR" in (missing_reason() or "")
