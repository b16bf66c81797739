"""Loopback means loopback: a server that starts its own Ray keeps every socket of its process tree on loopback,
but for the serving ports when ``--host`` is not loopback.

Ray 2.60's C++ servers (the GCS, the raylet, every core worker: the driver inside the server process, the agents,
Serve's controller, proxy and replicas) bind their gRPC servers on the wildcard address with no setting to change it,
and so do some of its Python parts (metrics exporters, the agents' HTTP servers). So the server preloads a small
shim into its whole process tree (``loopback_bind.c``, built here with the system's C compiler at first use and kept
in the cache, or prebuilt: ``FUSIONSERVE_LOOPBACK_SHIM``): it turns a TCP bind to 0.0.0.0 or :: into one to loopback,
except for the ports in ``FUSIONSERVE_OPEN_PORTS``. Ray's node address is loopback as well
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-machine mode, whose node address is 127.0.0.1), so that its
processes find each other where they now listen, and its agents that bind the node address bind loopback.

The server process hosts a Ray driver (a core worker with a gRPC server of its own), and a preload only takes effect
when a program starts: so ``serve_supervised`` execs the forked server afresh with the preload in its environment
(``exec_preloaded``), and everything it starts inherits it. Without a compiler nor a prebuilt shim, the server still
starts and says once what stays on every interface. A joined cluster (``RAY_ADDRESS``) is not this server's to
change: there Ray's token authentication and the cluster's network guard its ports (see docs/guides/serving.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionserve.settings import HANDOFF_ENV, LOOPBACK_SHIM_ENV, OPEN_PORTS_ENV, c_compiler, cache_root

SOURCE = Path(__file__).with_name("loopback_bind.c")
COMPILERS = ("cc", "gcc", "clang")  # tried in this order, after $CC
_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's single-machine mode: its node address is loopback
_COMPILE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Shim:
    """The shim library to preload, or None with the reason there is none (one line, for the warning)."""

    library: Path | None
    problem: str | None = None


def find_shim() -> Shim:
    """``$FUSIONSERVE_LOOPBACK_SHIM`` when set (a prebuilt library: the container image's), else the shim built from
    SOURCE into the cache (built now when it is not there yet). Never raises: a missing compiler, a failed build or a
    library that does not load is a Shim without a library, saying why."""
    chosen = os.environ.get(LOOPBACK_SHIM_ENV)
    if chosen:
        path = Path(chosen)
        why = _unloadable(path)
        return Shim(path) if why is None else Shim(None, f"{LOOPBACK_SHIM_ENV}={chosen}: {why}")
    try:
        path = build_shim(cache_root() / "native")
    except ShimBuildError as exc:
        return Shim(None, str(exc))
    why = _unloadable(path)
    return Shim(path) if why is None else Shim(None, f"the shim built at {path} does not load: {why}")


class ShimBuildError(Exception):
    """The shim could not be built (no C compiler, the compiler failed, or the cache is not writable)."""


def build_shim(cache: Path) -> Path:
    """The shim compiled from SOURCE into ``cache`` (named by the source's hash, so a changed source builds anew;
    compiled to a temporary name and renamed, so a concurrent start never loads half a file). Returns the library.
    Raises ShimBuildError."""
    source = SOURCE.read_bytes()
    target = cache / f"loopback_bind-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    compiler = next((found for name in (c_compiler(), *COMPILERS) if name and (found := shutil.which(name))), None)
    if compiler is None:
        raise ShimBuildError(f"no C compiler ({', '.join(COMPILERS)}; or $CC) to build {SOURCE.name}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".loopback_bind-", suffix=".so")
        os.close(fd)
    except OSError as exc:
        raise ShimBuildError(f"cannot write the shim into {cache}: {exc.strerror or exc}") from None
    try:
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
            capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise ShimBuildError(f"{compiler} failed to build {SOURCE.name} (exit {done.returncode}): {first}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ShimBuildError(f"{compiler} failed to build {SOURCE.name}: {exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


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
    return out | _NODE_ENV


def open_ports(host: str, ports: Iterable[int | None], loopback: Iterable[str]) -> list[int]:
    """The ports that keep the wildcard address: the serving ports when ``host`` is not a loopback one, else none."""
    return [] if host in set(loopback) else [p for p in ports if p]


def exec_preloaded(library: Path, ports: Iterable[int], entry: str, handoff: dict[str, Any]) -> None:
    """Replace this process by a fresh interpreter with the shim preloaded that runs ``entry`` (a module's function,
    ``"package.module:function"``), which takes ``handoff`` back with ``take_handoff``. The process stays the same
    one (pid, session, parent-death signal), so a supervisor sees no difference, and keeps its arguments after the
    code (what ps shows; the code ignores them). Never returns; raises OSError where the exec itself fails."""
    module, function = entry.split(":")
    code = f"from {module} import {function}; {function}()"
    env = preload_env(library, ports) | {HANDOFF_ENV: json.dumps(handoff)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-c", code, *sys.argv[1:]], env)


def take_handoff() -> dict[str, Any]:
    """What ``exec_preloaded`` handed this process, removed from its environment (nothing it starts inherits it).
    Raises KeyError when this process was not started by ``exec_preloaded``."""
    return json.loads(os.environ.pop(HANDOFF_ENV))


def fallback_warning(problem: str) -> str:
    """The one warning line of a server whose Ray could not be kept on loopback."""
    return (
        f"WARNING: {problem}: Ray's GCS, raylet, agents and workers (Serve's controller, proxy and replicas, this "
        f"server's own Ray driver) stay listening on every interface; install a C compiler (e.g. apt-get install gcc) "
        f"or point {LOOPBACK_SHIM_ENV} at a prebuilt {SOURCE.stem}.so (docs/guides/serving.md)"
    )
