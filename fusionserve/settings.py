"""Environment variables fusionserve reads, all in this one module (no heavy imports: both halves use it).

``FUSIONSERVE_CACHE``: the cache root (default ``~/.cache/fusionserve``). Datasets go to ``<root>/data``,
the default model's exported artifact to ``<root>/artifacts``.

``FUSIONSERVE_API_KEY``: the key (or several, comma-separated: rotation) every model route of ``fusionserve serve``
asks for as ``Authorization: Bearer KEY``; read by the server and by each replica from its own environment, so the
key is never written into a config, an argument list Ray records, or a log.
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


API_KEY_ENV = "FUSIONSERVE_API_KEY"  # the key(s) every model route asks for; several, comma-separated, for rotation


def parse_keys(value: str) -> tuple[str, ...]:
    """The keys in a comma-separated list: blanks around each dropped, empty ones ignored."""
    return tuple(k.strip() for k in value.split(",") if k.strip())


def api_keys(variable: str = API_KEY_ENV) -> tuple[str, ...]:
    """The API keys in ``$variable`` (see ``parse_keys``): none when it is unset or empty."""
    return parse_keys(os.environ.get(variable, ""))
