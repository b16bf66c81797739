"""Ports: the free ones a server draws for its own use, the range its replicas' gRPC servers take, and who holds a
port that is not free. The port arithmetic lives here only."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
from pathlib import Path
from typing import NamedTuple

from fusionserve.errors import FusionServeError
from fusionserve.settings import PORT_RANGE_ENV, port_range

# ports Ray's own processes take by default once they start, after our ports are chosen (the dashboard agent's
# 52365 came out of the kernel's range once: HAProxy's stats page was given it, and HAProxy could not start)
_RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365, 52366})


# Ports drawn for a server lie below the kernel's ephemeral range (Linux's default 32768-60999) and above Ray's
# worker ports (10002-19999): while a server starts, Ray's processes bind port 0 and connect from ephemeral ports, and
# one of them could take a port chosen in that range before Serve binds it ("Failed to bind to address [::]:PORT";
# seen once in a full run). Room is left above for a server's range of replica gRPC ports. $FUSIONSERVE_PORT_RANGE
# replaces the range (servers started side by side, e.g. the test suite's parallel workers, each get their own).
REPLICA_GRPC_PORTS = 64  # replicas' gRPC ports a server's Ray node may hand out (a range of its own)
_DEFAULT_PORTS = range(20000, 32768 - 2 * REPLICA_GRPC_PORTS)
_LEAST_PORTS = 2 * (REPLICA_GRPC_PORTS + 1)  # a replicas' gRPC range and a server's other ports, with room to draw


def draw_range() -> range:
    """The ports free_port draws from: ``$FUSIONSERVE_PORT_RANGE`` when set, else 20000-32639. Raises
    FusionServeError when the variable is malformed or holds fewer ports than one server takes."""
    chosen = port_range()
    if chosen is None:
        return _DEFAULT_PORTS
    if len(chosen) < _LEAST_PORTS:
        raise FusionServeError(
            f"{PORT_RANGE_ENV} = {os.environ[PORT_RANGE_ENV]!r} holds {len(chosen)} ports; a server needs at least"
            f" {_LEAST_PORTS} (its replicas' gRPC range takes {REPLICA_GRPC_PORTS + 1})"
        )
    return chosen


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


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A TCP port nothing listens on right now (on ``host`` nor on every interface) and not handed out before by
    this process, drawn at random from ``draw_range()`` (with ``span`` - 1 more ports above it in that range), outside
    the kernel's ephemeral range and none of Ray's default ports. Where no such port is found: with the default range
    the kernel's choice, with ``$FUSIONSERVE_PORT_RANGE`` the first free one in it, or FusionServeError if none is."""
    ports = draw_range()
    starts = range(ports.start, ports.stop - span + 1)
    ephemeral = _ephemeral_ports()

    def usable(port: int) -> bool:
        if port in ephemeral or port in _RAY_DEFAULT_PORTS or port in _GIVEN:
            return False
        return _bindable(host, port) and _bindable("0.0.0.0", port)

    for port in (random.choice(starts) for _ in range(256)):
        if usable(port):
            _GIVEN.add(port)
            return port
    if ports is not _DEFAULT_PORTS:
        for port in starts:
            if usable(port):
                _GIVEN.add(port)
                return port
        raise FusionServeError(f"no free port left in {PORT_RANGE_ENV} = {os.environ[PORT_RANGE_ENV]!r}")
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _RAY_DEFAULT_PORTS and port not in _GIVEN:
            _GIVEN.add(port)
            return port


def replica_grpc_ports() -> range:
    """A range of ``REPLICA_GRPC_PORTS`` + 1 ports for one server's replicas' own gRPC servers, starting at a free port,
    inside ``draw_range()``; no later ``free_port`` of this process falls in it."""
    first = free_port(span=REPLICA_GRPC_PORTS + 1)
    ports = range(first, first + REPLICA_GRPC_PORTS + 1)
    _GIVEN.update(ports)
    return ports


class Holder(NamedTuple):
    """A process listening on a port: its pid and command line (None, "") when it is not visible from here."""

    pid: int | None
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})" if self.pid is not None else "another process (not visible from here)"


def listener(host: str, port: int) -> Holder | None:
    """Who listens on ``port`` (any address), or None when nobody does. Tries to bind it the way a server would
    (address reuse on, port reuse off), so a lingering closed connection is not a holder."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return None  # not ours to judge (e.g. an address this machine does not have): let the server say
    return _listening_process(port) or Holder(None, "")


def port_holder(host: str, port: int) -> str | None:
    """``listener`` as a phrase for a message: "pid N (command)", or None when nobody listens."""
    holder = listener(host, port)
    return None if holder is None else str(holder)


def _listening_process(port: int) -> Holder | None:
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
            return Holder(int(proc.name), command[:120])
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
