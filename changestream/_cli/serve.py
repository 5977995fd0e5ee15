"""``changestream serve``: the replica-set simulator, as ``python -m changestream.testing serve``."""

from __future__ import annotations

from ..testing.cli import main as _serve

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``changestream serve ...``; returns the exit status."""
    return _serve(["serve", *argv], prog="changestream")
