"""Suite-wide pytest glue: skipped tests summarised by reason instead of one line each.

``-rs`` (or ``-ra``) still lists every skip with its location, as pytest does.
"""

from __future__ import annotations

from collections import Counter

import pytest

_SHOWN = 8
"""Most frequent reasons printed; the rest are folded into one count."""


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    return text.removeprefix("Skipped: ").strip()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    chars = terminalreporter.config.option.reportchars or ""
    if any(c in chars for c in "saA"):
        return  # asked for one line per skip: pytest prints them
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    if not skipped:
        return
    reasons = Counter(_reason(r) for r in skipped)
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason (-rs lists each)")
    for reason, count in reasons.most_common(_SHOWN):
        terminalreporter.write_line(f"{count:5d} x {reason}")
    rest = sum(count for _, count in reasons.most_common()[_SHOWN:])
    if rest:
        others = len(reasons) - _SHOWN
        terminalreporter.write_line(f"{rest:5d} x ({others} other reasons)")
