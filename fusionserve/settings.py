"""Environment variables fusionserve reads, all in this one module (no heavy imports: both halves use it).

``FUSIONSERVE_CACHE``: the cache root (default ``~/.cache/fusionserve``). Datasets go to ``<root>/data``,
the default model's exported artifact to ``<root>/artifacts``.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FUSIONSERVE_CACHE"


def cache_root() -> Path:
    """``$FUSIONSERVE_CACHE`` if set (``~`` expanded), else ``~/.cache/fusionserve``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "fusionserve"
