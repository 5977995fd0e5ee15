"""Write the state diagram and transition table of ``docs/resumability.md`` from the machine's table.

Both are drawn from :mod:`changestream._states` (``mermaid()`` and
``markdown()``) between marker comments, so the docs cannot drift from the
code: ``tests/client/test_states.py`` fails when the committed page differs
from what this script writes.

Run from the checkout: ``python tools/gen_state_docs.py`` (rewrite the page) or
``python tools/gen_state_docs.py --check`` (exit 1 if it is stale).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from changestream._states import markdown, mermaid

DOC = Path(__file__).resolve().parents[1] / "docs" / "resumability.md"


def render(text: str) -> str:
    """``text`` with the generated blocks (``states``, ``transitions``) written afresh."""
    blocks = {"states": f"```mermaid\n{mermaid()}\n```", "transitions": markdown()}
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- {name}:begin[^>]*-->\n).*?(\n<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC}: the markers of the generated {name} are missing")
        text = pattern.sub(lambda found, body=body: found.group(1) + body + found.group(2), text)
    return text


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    fresh = render(text)
    if "--check" in argv:
        if fresh != text:
            print(f"{DOC} is stale: run python tools/gen_state_docs.py", file=sys.stderr)
            return 1
        return 0
    if fresh != text:
        DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
