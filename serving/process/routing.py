"""Waiting until the ingress routes to the replicas: the application's route answering on the serving port, and
HAProxy routing to every replica, read from its admin socket (``<run folder>/<node id>/a.sock``: Serve's layout,
serving/private.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from fusionserve.errors import FusionServeError

from ..private import admin_sockets, routed

ADMIN_SOCKET = "a.sock"  # HAProxy's admin socket's name in the run folder (ingress.py: RAY_SERVE_HAPROXY_SOCKET_PATH)


def routed_replicas(folder: Path, app: str) -> int | None:
    """How many of ``app``'s replicas the HAProxy started from ``folder`` routes to right now, read from its admin
    socket; None when there is no such HAProxy (another ingress, or a joined cluster whose node started its own).
    A folder can hold the socket of an earlier Ray node too (a start that drew a taken port starts Ray again in the
    same run folder, under a new node id): the newest socket that answers counts. When none answers (HAProxy is being
    reloaded) nothing is routed this time: 0."""
    sockets = admin_sockets(folder, ADMIN_SOCKET)
    if not sockets:
        return None
    for path in sorted(sockets, key=_mtime, reverse=True):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(path))
                s.sendall(b"show stat\n")
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
        except OSError:  # a socket left by an HAProxy that is gone, or one being reloaded
            continue
        return routed(b"".join(chunks).decode(errors="replace"), app)
    return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


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
