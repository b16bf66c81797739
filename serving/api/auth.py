"""API keys: with ``api_key_env`` set, every model route asks for ``Authorization: Bearer KEY`` (gRPC: the same
metadata, lower-case ``authorization``) and refuses anything else with 401 ``unauthorized`` (gRPC UNAUTHENTICATED).

The keys come from an environment variable of the replica's own process (``FUSIONSERVE_API_KEY`` by default, see
fusionserve/settings.py): never an argument, so never in a Serve config, Ray's records of its actors, or a log.
Several comma-separated keys are all accepted (rotation: add the new key, move the clients, drop the old one).
A presented key is hashed and compared with every key's hash by ``hmac.compare_digest``: the time taken depends on
neither the key's content nor its length, nor on which key matched. No key, a wrong key and a malformed header all
get the same answer, which never repeats what was sent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from fusionserve.errors import FusionServeError
from fusionserve.settings import api_keys

from .schemas import HTTPError

# paths that never ask for a key: probes (the Open Inference Protocol's too), and the API's own description (it names
# no task and no data)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", "/docs", "/openapi.json"})
OPEN_PREFIXES = ("/docs-assets/",)
METRICS_PATH = "/metrics"
UNAUTHORIZED = HTTPError(401, "unauthorized", "missing or wrong API key: send the header 'Authorization: Bearer <key>'")
CHALLENGE = {"www-authenticate": 'Bearer realm="fusionserve"'}


class KeyCheck:
    """The accepted keys, kept only as SHA-256 digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)
        if not self._digests:
            raise FusionServeError("an API key check needs at least one key")

    @classmethod
    def from_env(cls, variable: str) -> KeyCheck:
        """The keys in ``$variable``. Raises FusionServeError when it holds none: a server asked to check keys must
        not start open (fail closed)."""
        keys = api_keys(variable)
        if not keys:
            raise FusionServeError(
                f"the application asks for an API key from ${variable}, but it is unset or empty in this replica's "
                f"environment: set it on every node (a Kubernetes Secret in the RayService manifests), or leave "
                f"api_key_env out"
            )
        return cls(keys)

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (``Bearer`` in any case)."""
        if authorization is None:
            return False
        value = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
        scheme, _, token = value.strip().partition(" ")
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for known in self._digests:  # every key compared, whichever matches: no early exit to time
            ok |= hmac.compare_digest(known, digest)
        return ok and scheme.lower() == "bearer"


def is_open(path: str, open_metrics: bool) -> bool:
    """Whether ``path`` is answered without a key."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or (open_metrics and path == METRICS_PATH)


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes = b"authorization") -> bytes | None:
    """The first ``name`` header of an ASGI scope's raw header list (names are lower-case there)."""
    for key, value in headers:
        if key == name:
            return value
    return None


def grpc_authorization(metadata: Iterable[tuple[str, str | bytes]]) -> str | bytes | None:
    """The ``authorization`` entry of a gRPC call's invocation metadata."""
    for key, value in metadata:
        if key == "authorization":
            return value
    return None
