"""Environment variables fusionserve reads, all in this one module (no heavy imports: both halves use it).

``FUSIONSERVE_CACHE``: the cache root (default ``~/.cache/fusionserve``). Datasets go to ``<root>/data``,
the default model's exported artifact to ``<root>/artifacts``.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FUSIONSERVE_CACHE"
# set by `fusionserve serve --host <loopback>` for the Ray it starts: the address the replicas bind their own gRPC
# server to (Serve's is every interface); read in the replicas (serving/grpc_ingress.py)
REPLICA_GRPC_HOST_ENV = "FUSIONSERVE_REPLICA_GRPC_HOST"


def cache_root() -> Path:
    """``$FUSIONSERVE_CACHE`` if set (``~`` expanded), else ``~/.cache/fusionserve``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "fusionserve"


def replica_grpc_host() -> str | None:
    """``$FUSIONSERVE_REPLICA_GRPC_HOST``, or None (Serve's own choice: every interface)."""
    return os.environ.get(REPLICA_GRPC_HOST_ENV) or None
