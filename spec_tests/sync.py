"""``python -m spec_tests.sync``: download the spec test files at the pinned commit.

The spec files are never committed here. A clone without ``../shared/spec``
(or ``$SPEC_TESTS_DIR``) fetches them once with this command; they land in
``<checkout>/.spec`` (git-ignored), which the loader looks at last. The
source (repository and commit) is pinned in this module only: the tests were
written against that commit, so a newer one is an upgrade to make on purpose.

Only the in-scope files are extracted from the repository archive, laid out
as the loader expects (see ``LAYOUT``).
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath
from typing import IO

from spec_tests.runner.loader import downloaded_dir, missing_reason, spec_dir

REPOSITORY = "https://github.com/mongodb/specifications"
COMMIT = "92b3c0b9287bfba1b0ec4084300858d05c654f8c"
"""The specifications commit the runner and its expectations were written against."""

ARCHIVE_URL = f"{REPOSITORY}/archive/{COMMIT}.tar.gz"

LAYOUT: tuple[tuple[str, str], ...] = (
    ("source/change-streams/tests/README.md", "change-streams/"),
    ("source/change-streams/tests/unified/*.json", "change-streams/unified/"),
    ("source/change-streams/tests/unified/*.yml", "change-streams/unified/"),
    ("source/change-streams/change-streams.md", "change-streams/"),
    ("source/unified-test-format/unified-test-format.md", "unified-test-format/"),
    ("source/unified-test-format/schema-latest.json", "unified-test-format/"),
    (
        "source/client-side-operations-timeout/client-side-operations-timeout.md",
        "csot/",
    ),
    ("source/client-side-operations-timeout/tests/README.md", "csot/tests/"),
    ("source/client-side-operations-timeout/tests/change-streams.json", "csot/tests/"),
    ("source/client-side-operations-timeout/tests/change-streams.yml", "csot/tests/"),
    ("source/retryable-reads/tests/unified/changeStreams-*.json", "related/retryable-reads/"),
    (
        "source/unified-test-format/tests/valid-pass/poc-change-streams.json",
        "related/unified-test-format-valid-pass/",
    ),
)
"""(glob inside the repository, destination folder relative to the spec directory)."""

MARKER = "SOURCE.txt"


class SyncError(Exception):
    """The archive could not be fetched or held none of the expected files."""


def destination(path_in_repo: str) -> str | None:
    """Where one repository file goes (relative to the spec directory), or None to skip it."""
    for pattern, folder in LAYOUT:
        if fnmatch.fnmatchcase(path_in_repo, pattern):
            return folder + PurePosixPath(path_in_repo).name
    return None


def extract(archive: IO[bytes], dest: Path) -> list[str]:
    """Extract the in-scope files of a streamed ``.tar.gz`` into ``dest``; their relative paths."""
    written: list[str] = []
    with tarfile.open(fileobj=archive, mode="r|gz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            # Archives from GitHub put everything under "<repo>-<commit>/".
            parts = PurePosixPath(member.name).parts
            target = destination("/".join(parts[1:])) if len(parts) > 1 else None
            if target is None:
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            out = dest / target
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("wb") as fh:
                shutil.copyfileobj(source, fh)
            written.append(target)
    return written


def sync(dest: Path, url: str = ARCHIVE_URL, timeout: float = 60.0) -> list[str]:
    """Download ``url`` and replace ``dest`` with its in-scope files; their relative paths.

    The files are extracted into a temporary folder next to ``dest`` and moved
    into place only when all of them arrived, so an interrupted download never
    leaves a half-filled spec directory behind.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".spec-sync-", dir=dest.parent))
    try:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                written = extract(response, staging)
        except (OSError, tarfile.TarError) as exc:
            raise SyncError(f"cannot download {url}: {exc}") from exc
        if not any(w.startswith("change-streams/unified/") for w in written):
            raise SyncError(f"{url} holds no change-streams/unified/*.json files")
        (staging / MARKER).write_text(
            f"Source repository: {REPOSITORY}\nCommit: {COMMIT}\nDownloaded from: {url}\n"
            "Written by `python -m spec_tests.sync`; do not edit or commit.\n",
            encoding="utf-8",
        )
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spec_tests.sync",
        description=f"Download the change-stream spec test files from {REPOSITORY} "
        f"at commit {COMMIT[:12]}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--dest",
        type=Path,
        help=f"where to put the files (default {downloaded_dir()}, where the tests look)",
    )
    parser.add_argument("--url", default=ARCHIVE_URL, help="the archive to read")
    parser.add_argument(
        "--force",
        action="store_true",
        help="download even if spec files are already found ($SPEC_TESTS_DIR, ../shared/spec)",
    )
    args = parser.parse_args(argv)
    if args.dest is None and not args.force and missing_reason() is None:
        print(f"spec files already present in {spec_dir()}; nothing to do (--force to download)")
        return 0
    dest: Path = args.dest or downloaded_dir()
    print(f"downloading {args.url} ...", flush=True)
    try:
        written = sync(dest, args.url)
    except SyncError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(written)} files written to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
