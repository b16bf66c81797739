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
import errno
import os
import random
import resource
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fusionserve.errors import FusionServeError

from .. import options
from .haproxy_rules import BINARY_ENV, real_haproxy, write_wrapper

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


# ports Ray's own processes take by default once they start, after our ports are chosen (the dashboard agent's
# 52365 came out of the kernel's range once: HAProxy's stats page was given it, and HAProxy could not start)
_RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365, 52366})


# Ports drawn for a server lie below the kernel's ephemeral range (Linux's default 32768-60999) and above Ray's
# worker ports (10002-19999): while a server starts, Ray's processes bind port 0 and connect from ephemeral ports, and
# one of them could take a port chosen in that range before Serve binds it ("Failed to bind to address [::]:PORT";
# seen once in a full run). Room is left above for a server's range of replica gRPC ports.
_DRAWN_PORTS = range(20000, 32768 - 2 * 64)


def _ephemeral_ports() -> range:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return range(32768, 61000)
    return range(low, high + 1)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# every port free_port has handed out in this process (and the replica gRPC ranges of ingress_env): a port is free
# until whoever asked for it binds it, so a second draw could return it again - two of one `ray start`'s ports
# were the same once ("Ray component metrics_export is trying to use a port number 29665 that is used by other
# components"); the kernel never hands out one port twice in a row, but random draws from a range do
_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (on ``host`` nor on every interface) and not handed out before by
    this process, drawn at random outside the kernel's ephemeral range and none of Ray's default ports; the kernel's
    choice if no such port is found."""
    ephemeral = _ephemeral_ports()
    for _ in range(256):
        port = random.choice(_DRAWN_PORTS)
        if port in ephemeral or port in _RAY_DEFAULT_PORTS or port in _GIVEN:
            continue
        if _bindable(host, port) and _bindable("0.0.0.0", port):
            _GIVEN.add(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _RAY_DEFAULT_PORTS and port not in _GIVEN:
            _GIVEN.add(port)
            return port


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
    return env


# Serve's HAProxy takes 4096 connections and asks for about 2.5 file descriptors per connection: ~10,300, far above
# the common 1024 default, and under that limit it fails to start with no clear reason.
HAPROXY_MAXCONN = 4096
_GRPC_PORTS = 64  # replicas' gRPC ports a server's Ray node may hand out
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
        folder = workdir or Path(tempfile.mkdtemp(prefix="fs-"))
        grpc_first = free_port()
        _GIVEN.update(range(grpc_first, grpc_first + _GRPC_PORTS + 1))  # the replicas' range: no other port of ours
        folder.mkdir(parents=True, exist_ok=True)
        env |= {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(folder / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(folder / "a.sock"),
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
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_first),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_first + _GRPC_PORTS),
        }
        maxconn = fit_open_files()
        if maxconn is not None:
            env["RAY_SERVE_HAPROXY_MAXCONN"] = str(maxconn)
        command = _haproxy_command()
        if command is not None:  # none: Serve says so itself when it starts HAProxy
            pages = (int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]))
            env[BINARY_ENV] = str(write_wrapper(folder, command, body_timeout_s, private_ports=pages))
    return env


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


def routed_replicas(folder: Path, app: str) -> int | None:
    """How many of ``app``'s replicas the HAProxy started from ``folder`` routes to right now (its servers UP in the
    app's backend, the proxy fallback not counted), read from HAProxy's admin socket; None when there is no such
    HAProxy (another ingress, or a joined cluster whose node started its own)."""
    sockets = sorted(folder.glob("*/a.sock"))  # Serve puts each node's files in a folder named by the node id
    if not sockets:
        return None
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(sockets[0]))
            s.sendall(b"show stat\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
    except OSError:  # HAProxy is being reloaded: nothing to count this time
        return 0
    lines = b"".join(chunks).decode(errors="replace").splitlines()
    if not lines:
        return 0
    header = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:]]
    return sum(
        r.get("pxname") == f"http-{app}" and r.get("svname", "").startswith("SERVE_REPLICA") and r.get("status") == "UP"
        for r in rows
    )


def wait_routed(url: str, timeout_s: float = 120.0) -> None:
    """Return once the port answers the application's own route (200, or 401 when it asks for an API key): the
    replicas report ready before the ingress (HAProxy) has its routes, and until then it answers 404. Raises
    FusionServeError after ``timeout_s``."""
    import urllib.error
    import urllib.request

    probe = url.replace("://0.0.0.0:", "://127.0.0.1:") + "/v1/tasks"
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(probe, timeout=5) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # the application answered: it asks for its API key
                return
            last = str(exc)
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise FusionServeError(f"the application was deployed but {probe} did not answer within {timeout_s:.0f} s ({last})")


def wait_all_routed(folder: Path, app: str, expected: int, say: Callable[[str], object], timeout_s: float = 120.0) -> None:
    """Wait until HAProxy routes to ``expected`` replicas of ``app``: Serve reports the deployment running before HAProxy has
    reloaded with every replica and health-checked it (seen: the second of two joined 0.5-2 s after the first, longer
    on a busy machine), and until then every request goes to the first. After ``timeout_s`` it says so and goes on:
    the others join as they become healthy."""
    deadline = time.monotonic() + timeout_s
    routed = routed_replicas(folder, app)
    while routed is not None and routed < expected:
        if time.monotonic() > deadline:
            say(
                f"only {routed} of {expected} replicas are routed after {timeout_s:.0f} s; the others join as they become healthy"
            )
            return
        time.sleep(0.2)
        routed = routed_replicas(folder, app)


def port_holder(host: str, port: int) -> str | None:
    """Who listens on ``port`` (any address), as "pid N (command)", or None when nobody does. Tries to bind it the
    way a server would (address reuse on, port reuse off), so a lingering closed connection is not a holder."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return None  # not ours to judge (e.g. an address this machine does not have): let the server say
    return _listener(port) or "another process (not visible from here)"


def _listener(port: int) -> str | None:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").glob("[0-9]*"):
        if wanted and wanted & _links(proc / "fd"):
            command = " ".join((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split())
            return f"pid {proc.name} ({command[:120]})"
    return None


def _links(folder: Path) -> set[str]:
    out: set[str] = set()
    try:
        entries = list(folder.iterdir())
    except OSError:  # gone, or not ours to read
        return out
    for entry in entries:
        with contextlib.suppress(OSError):  # closed in between
            out.add(os.readlink(entry))
    return out
