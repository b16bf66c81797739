"""Environment variables fusionserve reads, all in this one module (no heavy imports: both halves use it).

``FUSIONSERVE_CACHE``: the cache root (default ``~/.cache/fusionserve``). Datasets go to ``<root>/data``,
the default model's exported artifact to ``<root>/artifacts``.

``FUSIONSERVE_API_KEY``: the key (or several, comma-separated: rotation) every model route of ``fusionserve serve``
asks for as ``Authorization: Bearer KEY``; read by the server and by each replica from its own environment, so the
key is never written into a config, an argument list Ray records, or a log.

``FUSIONSERVE_LOOPBACK_SHIM``: a build of the loopback shim (``serving/process/loopback_bind.c``) for ``fusionserve serve``
to preload into the Ray it starts, instead of the one built with the package (serving/process/loopback.py).

``FUSIONSERVE_PORT_RANGE``: ``LOW-HIGH`` (both included, within 1024-65535): the ports ``fusionserve serve`` draws its
own from (HAProxy's stats and metrics pages, Serve's fallback proxy, the replicas' gRPC range of 65), instead of
20000-32639. Give servers that start at the same time on one machine disjoint ranges, so that no two draw one port in
the seconds before its user binds it (the test suite does this for its parallel workers). Avoid the kernel's ephemeral
range (``/proc/sys/net/ipv4/ip_local_port_range``): Ray's processes connect from those ports while a server starts.

``FUSIONSERVE_OPEN_PORTS``: set by ``fusionserve serve`` for the Ray it starts, read by the shim itself: the ports
(comma-separated) that keep the wildcard address, the serving ports when ``--host`` is not loopback.

``FUSIONSERVE_FULL_RAY``: ``1`` starts a local Ray (``fusionserve serve``, ``score --ray`` without a cluster) with
every process ``ray.init`` starts; by default its autoscaler monitor and log monitor are left out (nothing
fusionserve does uses them: serving/private.py, ``lean_head``).

OpenTelemetry's standard variables, as the tracing of ``fusionserve serve`` reads them (serving/api/tracing.py; the
exporter's own, headers, timeout, compression and the batch settings, in serving/api/otlp.py): ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (either set turns tracing on, as ``--otlp-endpoint`` does),
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (only ``http/protobuf`` is served) and
``OTEL_SERVICE_NAME`` (default ``fusionserve``).
"""

from __future__ import annotations

import os
from pathlib import Path

from fusionserve.errors import FusionServeError

CACHE_ENV = "FUSIONSERVE_CACHE"
# the loopback shim (serving/process/loopback.py): another build of it to preload; and the ports that keep the wildcard
# address, set by the supervisor for the server it starts and read by the shim itself (loopback_bind.c)
LOOPBACK_SHIM_ENV = "FUSIONSERVE_LOOPBACK_SHIM"
OPEN_PORTS_ENV = "FUSIONSERVE_OPEN_PORTS"
PORT_RANGE_ENV = "FUSIONSERVE_PORT_RANGE"  # LOW-HIGH: the ports fusionserve draws its own from (serving/process/ports.py)
# "1": a local Ray started with every process ray.init starts (serving/process/cluster.py, serving/private.py: lean_head)
FULL_RAY_ENV = "FUSIONSERVE_FULL_RAY"
HANDOFF_ENV = "FUSIONSERVE_SERVER_HANDOFF"  # internal: what the supervisor hands the server process it starts


def full_ray() -> bool:
    """``$FUSIONSERVE_FULL_RAY`` set to 1 (or true, yes): a local Ray starts with every process ``ray.init`` starts."""
    return os.environ.get(FULL_RAY_ENV, "").strip() in ("1", "true", "yes")


def cache_root() -> Path:
    """``$FUSIONSERVE_CACHE`` if set (``~`` expanded), else ``~/.cache/fusionserve``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "fusionserve"


API_KEY_ENV = "FUSIONSERVE_API_KEY"  # the key(s) every model route asks for; several, comma-separated, for rotation


def parse_keys(value: str) -> tuple[str, ...]:
    """The keys in a comma-separated list: blanks around each dropped, empty ones ignored."""
    return tuple(k.strip() for k in value.split(",") if k.strip())


def api_keys(variable: str = API_KEY_ENV) -> tuple[str, ...]:
    """The API keys in ``$variable`` (see ``parse_keys``): none when it is unset or empty."""
    return parse_keys(os.environ.get(variable, ""))


def port_range() -> range | None:
    """``$FUSIONSERVE_PORT_RANGE`` ("LOW-HIGH", both included) as a range; None when it is unset or empty. Raises
    FusionServeError naming the variable, its value and what is allowed when it is not such a range."""
    value = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not value:
        return None
    low, sep, high = value.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()):
        raise FusionServeError(f"{PORT_RANGE_ENV} = {value!r} is not a port range; expected LOW-HIGH, e.g. 20000-24999")
    ports = range(int(low), int(high) + 1)
    if not 1024 <= ports.start < ports.stop <= 65536:
        raise FusionServeError(f"{PORT_RANGE_ENV} = {value!r} is out of range; allowed: 1024 <= LOW <= HIGH <= 65535")
    return ports


def otlp_env() -> dict[str, str]:
    """OpenTelemetry's OTLP settings in the environment that fusionserve reads itself: ``endpoint`` (the traces
    endpoint, or the base one), ``protocol`` and ``service_name``, each only when set."""
    found = {
        "endpoint": os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        "protocol": os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL"),
        "service_name": os.environ.get("OTEL_SERVICE_NAME"),
    }
    return {k: v.strip() for k, v in found.items() if v and v.strip()}
