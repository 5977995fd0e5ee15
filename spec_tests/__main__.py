"""``python -m spec_tests``: run the spec matrix without pytest and write a JSON report.

One report row per (file, test, version, topology) with the client, its
status and reason; per-version counts and a final ``N passed, N failed, N
skipped`` line go to stdout. ``--client`` picks the change-stream client
(``changestream-async`` runs changestream.aio over AsyncMongoClient). Exit
status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from .runner import RunnerError
from .runner.adapter import CLIENTS, DEFAULT_CLIENT
from .runner.matrix import Case, Outcome, build_cases, grouped_by_target, run_case
from .runner.targets import TargetPool


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m spec_tests", description=__doc__)
    parser.add_argument("--json", metavar="REPORT.json", type=Path, help="write the report here")
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default=DEFAULT_CLIENT,
        help="change-stream implementation under test (default %(default)s)",
    )
    parser.add_argument("--versions", help="comma-separated emulated versions, e.g. 6.0,8.0")
    parser.add_argument("--files", metavar="GLOB", help="only spec files matching this glob")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case")
    return parser.parse_args(argv)


def _row(case: Case, client: str, outcome: Outcome, seconds: float) -> dict[str, object]:
    return {
        "file": case.label,
        "test": case.description,
        "version": case.version,
        "topology": case.topology,
        "client": client,
        "status": outcome.status,
        "reason": outcome.reason,
        "seconds": round(seconds, 3),
    }


def _counts(rows: list[dict[str, object]]) -> str:
    c = Counter(str(r["status"]) for r in rows)
    return f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    real_uri = os.environ.get("MONGODB_URI")
    versions = [v.strip() for v in args.versions.split(",")] if args.versions else None
    if real_uri and versions:
        print("note: MONGODB_URI is set; --versions is ignored", file=sys.stderr)
    pool = TargetPool(real_uri)
    rows: list[dict[str, object]] = []
    try:
        try:
            cases = grouped_by_target(build_cases(pool, versions, args.files),
                                      lambda case: (case.version, case.topology))
        except RunnerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for case in cases:
            started = time.monotonic()
            outcome = run_case(case, pool, args.client)
            rows.append(_row(case, args.client, outcome, time.monotonic() - started))
            if outcome.status == "fail" or args.verbose:
                first_line = outcome.reason.splitlines()[0] if outcome.reason else ""
                print(
                    f"{outcome.status.upper():4} {case.id_for(args.client)}  {first_line}",
                    flush=True,
                )
    finally:
        pool.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    for version in dict.fromkeys(str(r["version"]) for r in rows):
        print(f"{version}: {_counts([r for r in rows if r['version'] == version])}")
    print(_counts(rows))
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
