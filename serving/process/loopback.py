"""Loopback means loopback: a server that starts its own Ray keeps every socket of its process tree on loopback,
but for the serving ports when ``--host`` is not loopback.

Ray 2.60's C++ servers (the GCS, the raylet, every core worker: the driver inside the server process, the agents,
Serve's controller, proxy and replicas) bind their gRPC servers on the wildcard address with no setting to change it,
and so do some of its Python parts (metrics exporters, the agents' HTTP servers). So the server is started with a
small shim preloaded, which everything it starts inherits (``loopback_bind.c``: it turns a TCP bind to 0.0.0.0 or ::
into one to loopback, except for the ports in ``FUSIONSERVE_OPEN_PORTS``). The shim is built once, with the package
(pyproject.toml's ext-modules: a wheel, an install from source, the container image), never at run time;
``FUSIONSERVE_LOOPBACK_SHIM`` names another build of it. Ray's node address is loopback as well
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-machine mode, whose node address is 127.0.0.1), so that its
processes find each other where they now listen, and its agents that bind the node address bind loopback.

A preload only takes effect when a program starts: the supervisor (serving/process/supervise.py) starts the server
process with it in its environment. Where fusionserve was installed without a C compiler (no shim was built) the
server still starts and says once what stays on every interface. A joined cluster (``RAY_ADDRESS``) is not this
server's to change: there Ray's token authentication and the cluster's network guard its ports (see
docs/guides/serving.md).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fusionserve.settings import LOOPBACK_SHIM_ENV, OPEN_PORTS_ENV

from ..private import SINGLE_MACHINE

SOURCE = Path(__file__).with_name("loopback_bind.c")
BUILT = "_loopback_bind"  # the extension module's name in pyproject.toml (built, never imported)


@dataclass(frozen=True)
class Shim:
    """The shim library to preload, or None with the reason there is none (one line, for the warning)."""

    library: Path | None
    problem: str | None = None


def packaged() -> Path | None:
    """The shim built with the package (``_loopback_bind`` with this interpreter's extension suffix, beside this
    module), or None where it was installed without a C compiler."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name(BUILT + suffix)
        if path.is_file():
            return path
    return None


def find_shim() -> Shim:
    """``$FUSIONSERVE_LOOPBACK_SHIM`` when set (another build of it), else the shim built with the package. Never
    raises: a shim not there, or one that does not load, is a Shim without a library, saying why."""
    chosen = os.environ.get(LOOPBACK_SHIM_ENV)
    if chosen:
        path = Path(chosen)
        why = _unloadable(path)
        return Shim(path) if why is None else Shim(None, f"{LOOPBACK_SHIM_ENV}={chosen}: {why}")
    path = packaged()
    if path is None:
        return Shim(None, f"fusionserve was installed without its loopback shim (no C compiler to build {SOURCE.name})")
    why = _unloadable(path)
    return Shim(path) if why is None else Shim(None, f"the loopback shim {path} does not load: {why}")


def _unloadable(path: Path) -> str | None:
    """Why ``path`` cannot be preloaded (not there, not a library of this machine's kind), or None. Loading it here is
    harmless: a library loaded after libc does not take libc's ``bind`` from anyone."""
    if not path.is_file():
        return "no such file"
    try:
        ctypes.CDLL(str(path))
    except OSError as exc:
        return str(exc)
    return None


def preloaded(library: Path) -> bool:
    """Whether this process runs with ``library`` loaded (read from /proc/self/maps: what was preloaded when it started,
    not what its environment says now)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return str(library.resolve()) in maps


def preload_env(library: Path, open_ports: Iterable[int], env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default this process's) with the shim preloaded (added to any ``LD_PRELOAD`` already there), the ports
    that keep the wildcard address, and Ray's node address on loopback."""
    out = dict(os.environ if env is None else env)
    others = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split() if p != str(library)]
    out["LD_PRELOAD"] = " ".join([*others, str(library)])
    out[OPEN_PORTS_ENV] = ",".join(str(p) for p in sorted(set(open_ports)))
    return out | SINGLE_MACHINE  # Ray's single-machine mode: its node address is loopback


def open_ports(host: str, ports: Iterable[int | None], loopback: Iterable[str]) -> list[int]:
    """The ports that keep the wildcard address: the serving ports when ``host`` is not a loopback one, else none."""
    return [] if host in set(loopback) else [p for p in ports if p]


def fallback_warning(problem: str) -> str:
    """The one warning line of a server whose Ray could not be kept on loopback."""
    return (
        f"WARNING: {problem}: Ray's GCS, raylet, agents and workers (Serve's controller, proxy and replicas, this "
        f"server's own Ray driver) stay listening on every interface; reinstall fusionserve where a C compiler is "
        f"(e.g. apt-get install gcc) or point {LOOPBACK_SHIM_ENV} at a build of {SOURCE.name} (docs/guides/serving.md)"
    )
