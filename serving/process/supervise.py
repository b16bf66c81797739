"""``fusionserve serve`` in two processes: the supervisor, which a terminal, systemd or a container runtime started,
and the server, which it starts and then only watches.

The supervisor checks everything that can be checked before Ray starts (the options, the artifact, the ports: a
refusal is the command's one line and exit 2, and no process is started), makes the run folder
(serving/process/runs.py), and starts the server as a child process of its own session (``subprocess``), with the
loopback shim preloaded (serving/process/loopback.py) and a parent-death signal. Then it waits: it forwards SIGINT,
SIGTERM and SIGHUP to the server (SIGHUP as SIGTERM), and once the server is gone, however it ended, it does the
run's whole clean-up itself (``runs.end_run``, and whatever else is left below it: it is a child subreaper, so the
orphans of a killed server are handed to it) and exits with the server's code (1 where a signal ended it). So:

- a signal to the whole process group (Ctrl-C in a terminal, ``kill -TERM -PGID``) reaches the supervisor only,
  never Ray's processes, which the server then stops in order;
- ``kill -9`` of the supervisor hands the server a SIGTERM (its parent-death signal): the usual clean stop;
- ``kill -9`` of the server, a crash, a dead raylet: the supervisor ends what is left, frees the port and exits
  non-zero (a supervisor's ``Restart=on-failure`` then starts a new server);
- both killed at once: the next start on the machine reaps the run (``runs.reap_stale``).

The server process (``serve_child``) ends with ``os._exit`` once Ray is shut down: C++'s static destructors raced
Ray's native threads at interpreter exit and spun forever in Ray's terminate handler (seen: a child stopped cleanly,
then hung at 100% CPU until killed). Its code: 0 after a clean stop, 2 for a refusal, 1 for anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fusionserve.errors import FusionServeError
from fusionserve.settings import HANDOFF_ENV

from . import loopback
from .runs import STOP_GRACE_S, descendants, end, end_run, identities, new_run_folder, record
from .server import LOOPBACK, ServerConfig, check_before_ray, serve_forever

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_ENTRY = f"from {__name__} import serve_child; serve_child()"


def supervise(cfg: ServerConfig) -> int:
    """Serve ``cfg`` in a server process under this one until it ends (see the module's notes); returns its exit code.
    Raises FusionServeError (a refusal before anything starts: see ``server.check_before_ray``)."""
    check_before_ray(cfg)
    folder = new_run_folder()
    env = dict(os.environ)
    shim = None
    if not os.environ.get("RAY_ADDRESS"):  # a joined cluster's processes are not this server's to keep on loopback
        found = loopback.find_shim()
        if found.library is None:
            print(f"fusionserve: {loopback.fallback_warning(str(found.problem))}", file=sys.stderr, flush=True)
        else:
            shim = found.library
            env = loopback.preload_env(shim, loopback.open_ports(cfg.host, (cfg.port, cfg.grpc_port), LOOPBACK), env)
    handoff = {"artifact": str(cfg.artifact), "options": cfg.options(), "folder": str(folder), "parent": os.getpid()}
    env[HANDOFF_ENV] = json.dumps(handoff | {"shim": str(shim) if shim else None})
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    asked: list[float] = []
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        if not asked:
            asked.append(time.monotonic())
        if child:
            with contextlib.suppress(ProcessLookupError):
                child[0].send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        sys.stderr.flush()
        # what ps shows: the command as given (its API key already hidden by the CLI); the server ignores it
        child.append(subprocess.Popen([sys.executable, "-c", _ENTRY, *sys.argv[1:]], env=env, start_new_session=True))
        record(folder, owners=[child[0].pid])
        if asked:  # a signal came before the server was there to forward it to
            forward(signal.SIGTERM, None)
        return _wait(child[0], folder, asked)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(child: subprocess.Popen[bytes], folder: Path, asked: list[float]) -> int:
    """Wait for the server (SIGKILL once it has had ``STOP_GRACE_S`` to stop), then clean up after it: its exit code,
    1 where a signal ended it."""
    while child.poll() is None:
        if asked and time.monotonic() - asked[0] > STOP_GRACE_S:
            print(f"fusionserve: the server did not stop within {STOP_GRACE_S:.0f} s; ending it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            asked[0] = float("inf")
        time.sleep(0.1)
    left = identities(descendants(os.getpid()))
    end(left, grace_s=1.0)
    ended = [pid for pid, _ in left] + end_run(folder)
    _collect_orphans()
    if child.returncode < 0:
        print(
            f"fusionserve: the server process (pid {child.pid}) was ended by {signal.Signals(-child.returncode).name}; "
            f"ended the {len(ended)} process(es) it left and removed its run folder",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return child.returncode


def _collect_orphans() -> None:
    """Collect every exited child, the orphans handed to this subreaper included, so that none stays a zombie."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def serve_child() -> None:
    """The server process the supervisor started: its options and run folder from the supervisor, then
    ``serve_forever``; ends with ``os._exit`` (see the module's notes). Raises KeyError when started any other way."""
    handoff: dict[str, Any] = json.loads(os.environ.pop(HANDOFF_ENV))
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    code = 1
    try:
        if os.getppid() != handoff["parent"]:  # the supervisor died before the line above: nothing to serve for
            return
        if handoff["shim"] and not loopback.preloaded(Path(handoff["shim"])):  # a loader that ignores LD_PRELOAD
            warning = loopback.fallback_warning(f"{handoff['shim']} was not preloaded")
            print(f"fusionserve: {warning}", file=sys.stderr, flush=True)
        cfg = ServerConfig(handoff["artifact"], **handoff["options"])
        code = serve_forever(cfg, run_folder=Path(handoff["folder"]), supervised=True)
    except FusionServeError as exc:  # a refusal, said as the command says every other one (cli/main.py)
        print(f"fusionserve: error: {exc}", file=sys.stderr)
        code = 2
    except BaseException:  # a crash: the traceback, and a failure the supervisor passes on
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
