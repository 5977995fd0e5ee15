"""changestream: a spec-complete MongoDB change stream client."""

from __future__ import annotations

__version__ = "0.1.0"
