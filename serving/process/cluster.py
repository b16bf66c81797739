"""Joining Ray: the running instance (a test's, or the cluster named by ``RAY_ADDRESS`` or an address), or a new
local one. Shared by the server and by ``score --ray``; Ray is imported only here, when it is needed."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from typing import Any

from fusionserve.errors import FusionServeError
from fusionserve.settings import full_ray

from ..private import WORKER_NICENESS, lean_head, without_dataframes

_PROBE_S = 5.0  # an address where nothing answers: Ray itself would retry for minutes


class ClusterError(FusionServeError):
    """Ray did not start, or the cluster could not be joined."""


def connect(
    address: str | None = None, quiet: bool = False, runtime_env: dict[str, Any] | None = None, serving: bool = False
) -> bool:
    """Join Ray or start it; True when this call started it (the caller then shuts it down). ``quiet``: keep Ray's
    and Serve's informational lines (and the token-authentication notice) off the terminal; errors still show.
    ``runtime_env``: this job's (a ``working_dir`` is uploaded to the cluster and unpacked on each node that runs
    one of the job's workers). ``serving``: the caller is a server; a local Ray it starts then runs without pandas
    and pyarrow in this process and in every worker (serving/private.py: without_dataframes).

    Raises ClusterError with one line saying what failed, instead of Ray's traceback."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reporting from an offline machine
    import ray

    if ray.is_initialized():
        return False
    target = address or os.environ.get("RAY_ADDRESS") or None
    if target is not None:
        _probe(target)
    else:  # Ray starts its workers at nice 15 (under the driver); a server's proxy and replicas are its main work
        for name, value in WORKER_NICENESS.items():
            os.environ.setdefault(name, value)
    # a local Ray without the head's processes that nothing here uses (serving/private.py: lean_head)
    lean = target is None and not full_ray()
    if lean and serving:  # the whole Ray is this server's: none of its processes needs pandas or pyarrow
        os.environ.update(without_dataframes())  # the raylet, and with it every worker, inherits the hook
    try:
        level = logging.ERROR if quiet else logging.INFO
        with lean_head() if lean else contextlib.nullcontext():
            ray.init(address=target, include_dashboard=False, log_to_driver=False, logging_level=level, runtime_env=runtime_env)
    except Exception as exc:  # Ray's start-up raises ConnectionError, RuntimeError, TimeoutError, ValueError, ...
        where = f"join the Ray cluster at {target}" if target else "start a local Ray instance"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "no reason given"
        raise ClusterError(f"could not {where}: {type(exc).__name__}: {reason}") from None
    if quiet:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    return True


def _probe(address: str) -> None:
    """Fail at once, with the reason, when nothing answers at a ``host:port`` (or ``ray://host:port``) address;
    other forms ('auto', ...) are left to Ray."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d+)", address.strip())
    if m is None:
        return
    host, port = m.group(1), int(m.group(2))
    try:
        with socket.create_connection((host, port), timeout=_PROBE_S):
            pass
    except OSError as exc:
        raise ClusterError(
            f"could not join the Ray cluster at {address}: nothing answers there ({type(exc).__name__}: {exc.strerror or exc}); "
            "start it with `ray start --head`, or unset RAY_ADDRESS to start a local Ray"
        ) from None
