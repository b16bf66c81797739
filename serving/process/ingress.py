"""How HTTP reaches the replicas: the Ray Serve settings of each ingress, as environment variables that Ray's
processes read once, when they start — so they are set before fusionserve starts Ray (a cluster joined through
``RAY_ADDRESS`` must have been started with them; see docs/guides/serving.md).

- ``haproxy`` (default): HAProxy listens on the server's port and hands each connection to a replica's own HTTP
  port (Ray 2.60's direct ingress: uvicorn inside the replica); Serve's throughput settings run the replica's code
  on its main event loop. Measured against the others by ``benchmarks/load.py``: benchmarks/RESULTS.md.
- ``proxy``: Serve's proxy actor on the port, which forwards every request to a replica over a Ray call (Serve's
  default; no HAProxy needed).

The ``-throughput`` / ``-default`` variants exist for the benchmark's comparison: HAProxy with Serve's default
threading, and the proxy with the throughput settings.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import tempfile
from pathlib import Path

from fusionserve.errors import FusionServeError

from .. import options
from ..private import HAPROXY_BINARY_ENV, serve_env
from .haproxy_rules import real_haproxy, write_wrapper
from .ports import free_port, replica_grpc_ports
from .routing import ADMIN_SOCKET
from .runs import RUN_PREFIX

INGRESSES = ("haproxy", "proxy")  # what `fusionserve serve --ingress` offers; the first is the default
VARIANTS = {
    "haproxy": ("haproxy", True),
    "proxy": ("proxy", False),
    "haproxy-default": ("haproxy", False),
    "proxy-throughput": ("proxy", True),
}
# Serve's throughput settings without the parts that change the ingress itself (direct ingress) or what handles
# use to call other deployments (gRPC; we call none): the replica's code and the router run on its main event
# loop, request logs are buffered and not echoed to stderr.
_THROUGHPUT = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}


# Room for a busy machine: Serve's controller kills a proxy (Serve's, or the HAProxy manager) that is not ready
# within 5 s, and serve.start then fails; seen in CI on a loaded 2-core machine when a second node joined.
_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def node_env(ingress: str) -> dict[str, str]:
    """The settings of ``ingress`` that every Ray node must be started with (one of INGRESSES, or a benchmark
    variant): what a cluster's `ray start` needs, and what a KubeRay pod's environment holds.

    Raises FusionServeError for an unknown ingress."""
    if ingress not in VARIANTS:
        raise FusionServeError(f"--ingress '{ingress}' is not known; allowed: {', '.join(INGRESSES)}")
    kind, throughput = VARIANTS[ingress]
    env = dict(_PATIENCE) | (dict(_THROUGHPUT) if throughput else {})
    if kind == "haproxy":
        env |= {
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_NBTHREAD": str(min(4, max(1, len(os.sched_getaffinity(0))))),
            # a stopping replica stays open this long so HAProxy can take it out of rotation (HAProxy also retries
            # refused connections on another replica); Serve's 30 s made every Ctrl-C wait half a minute
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
            # a client silent this long loses its connection (Serve's default, an hour, lets a client that never
            # finishes its body, answered 408 by the replica, hold an HAProxy connection that long)
            "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": "60",
            "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S": "120",  # Serve's 30 s, for HAProxy to come up on a busy node
            # Serve's manager starts HAProxy again after 3 failed health checks in a row, one every this many seconds:
            # Serve's 10 s kept a killed HAProxy's port dark for 15-30 s; a check is one admin-socket command
            "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "1",
        }
    return serve_env(env)  # every name one Serve was checked to read (serving/private.py)


# Serve's HAProxy takes 4096 connections and asks for about 2.5 file descriptors per connection: ~10,300, far above
# the common 1024 default, and under that limit it fails to start with no clear reason.
HAPROXY_MAXCONN = 4096
_FDS_PER_CONN = 2.5
_FDS_SPARE = 256


def fit_open_files() -> int | None:
    """Raise this process's soft open-file limit to its hard limit (Ray's processes and HAProxy inherit it); returns
    the HAProxy connection limit that fits when even the hard limit is short of Serve's default, else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):  # a limit we may not raise: work within the soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY or soft >= HAPROXY_MAXCONN * _FDS_PER_CONN + _FDS_SPARE:
        return None
    return max(64, int((soft - _FDS_SPARE) / _FDS_PER_CONN))


def ingress_env(
    ingress: str, workdir: Path | None = None, body_timeout_s: float = options.default("body_timeout_s")
) -> dict[str, str]:
    """``node_env(ingress)`` plus, for HAProxy, a private folder for its config, admin and metrics sockets and state files
    (default: a new temporary one) and free ports for its stats and Prometheus pages, so that two servers (or two
    Ray nodes) on one machine never share them, both bound to 127.0.0.1; and fusionserve's rules in its config
    (serving/process/haproxy_rules.py: requests not complete within ``body_timeout_s`` get 408 and their connection closed,
    JSON error pages).

    Raises FusionServeError for an unknown ingress."""
    env = node_env(ingress)
    if VARIANTS[ingress][0] == "haproxy":
        folder = workdir or Path(tempfile.mkdtemp(prefix=RUN_PREFIX))
        grpc = replica_grpc_ports()  # the replicas' range: no other port of ours
        folder.mkdir(parents=True, exist_ok=True)
        env |= {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(folder / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(folder / ADMIN_SOCKET),
            # its metrics socket too (Serve's default, /tmp/haproxy-serve/<node id>/, is shared and never removed)
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(folder / "m.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(folder),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(folder / "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            # and its fallback proxy (HAProxy's backup when no replica is up), which Serve binds on 8500 / 9500 with
            # port reuse: two servers on one machine shared it, so one HAProxy could reach the other server's model
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
            # and the replicas' own gRPC ports from a free range of this server's: Serve asks gRPC for them with
            # port reuse on (its "0" for grpc.so_reuseport is a string, which gRPC ignores), so every server's first
            # replica bound the default first port, 40000, and the kernel spread gRPC calls over all their replicas:
            # one server's HAProxy reached another server's model
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc[0]),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc[-1]),
        }
        maxconn = fit_open_files()
        if maxconn is not None:
            env["RAY_SERVE_HAPROXY_MAXCONN"] = str(maxconn)
        command = _haproxy_command()
        if command is not None:  # none: Serve says so itself when it starts HAProxy
            pages = (int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]))
            env[HAPROXY_BINARY_ENV] = str(write_wrapper(folder, command, body_timeout_s, private_ports=pages))
    return serve_env(env)


# the ports ``ingress_env`` draws, by what binds them: free when drawn, bound only once Ray and Serve are up, tens of
# seconds later, so another process may take one in between (Server.start then starts again on fresh ones)
_DRAWN = {
    "RAY_SERVE_HAPROXY_STATS_PORT": "HAProxy's stats page",
    "RAY_SERVE_HAPROXY_METRICS_PORT": "HAProxy's Prometheus page",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "Serve's fallback proxy (HTTP)",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": "Serve's fallback proxy (gRPC)",
}


def drawn_ports(env: dict[str, str]) -> dict[int, str]:
    """The ports ``env`` (an ``ingress_env``) drew for the server's own use, each with what binds it."""
    return {int(env[name]): what for name, what in _DRAWN.items() if name in env}


def _haproxy_command() -> list[str] | None:
    """How the launcher (serving/process/haproxy_rules.py) runs the HAProxy Serve would start: with a parent-death signal
    (util-linux ``setpriv --pdeathsig``) where there is ``setpriv``. HAProxy is the child of Serve's HAProxy manager,
    and when the manager dies (its node's raylet gone, the server killed) HAProxy was left holding the port, answering
    500 to every request, until a person killed it. None where there is no HAProxy."""
    binary = real_haproxy()
    if binary is None:
        return None
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", binary] if setpriv else [binary]
