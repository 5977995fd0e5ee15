"""The machine's phases and transitions: one table, and the docs' diagram is drawn from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from changestream._states import TRANSITIONS, Phase, Step, advance, mermaid

DOC = Path(__file__).resolve().parents[2] / "docs" / "resumability.md"


def test_the_docs_diagram_is_the_table() -> None:
    text = DOC.read_text()
    found = re.search(r"<!-- states:begin[^>]*-->\n```mermaid\n(.*?)\n```\n<!-- states:end -->",
                      text, re.S)
    assert found is not None, "docs/resumability.md lost its generated state diagram"
    assert found.group(1) == mermaid(), (
        "regenerate the diagram: python -c 'from changestream._states import mermaid; "
        "print(mermaid())'"
    )


def test_every_phase_is_reachable_and_closed_is_final() -> None:
    reached, frontier = {Phase.NEW}, [Phase.NEW]
    while frontier:
        phase = frontier.pop()
        for (source, _), target in TRANSITIONS.items():
            if source is phase and target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(Phase)
    assert {target for (source, _), target in TRANSITIONS.items()
            if source is Phase.CLOSED} == {Phase.CLOSED}


def test_a_step_the_table_does_not_allow_is_refused() -> None:
    assert advance(Phase.OPEN, Step.GETMORE_RESUMABLE) is Phase.RESUME_PENDING
    with pytest.raises(RuntimeError, match="cannot happen in phase 'closed'"):
        advance(Phase.CLOSED, Step.AGGREGATE_OK)
    with pytest.raises(RuntimeError, match="cannot happen in phase 'new'"):
        advance(Phase.NEW, Step.GETMORE_TIMEOUT)
