"""A server's run folder, and the one clean-up of a run.

Every server has a folder of its own under /tmp (``fs-XXXXXXXX``): HAProxy's config, sockets and state files, the
replicas' pooled metrics, and the run's record of its processes, each as (pid, start time), an identity a recycled
pid cannot take:

- ``owner.json``: the run's owners (the supervisor, the server), whose life is the run's, and the processes the server
  started (its tree once it serves: Ray's);
- ``started``: "pid start-time" lines, appended by what the run starts outside Python as it starts (HAProxy's launcher,
  serving/process/haproxy_rules.py: HAProxy is the child of one of Ray's workers, and every reload starts a new one).

``end_run`` is the one clean-up: it ends every recorded process that is still that process, then removes the folder.
It runs in the supervisor once the server process is gone (serving/process/supervise.py), in an embedded server's own
``stop`` (serving/process/server.py), and, for a run whose supervisor and server were both killed at once (``kill -9
-PGID``, the OOM killer), or whose supervisor was killed and whose server did not stop within ``STOP_GRACE_S``, in the
next start on the machine (``reap_stale``). It also ends the run's HAProxy processes that the record missed, found by
their config file in the folder (``haproxies``). A process that merely names the folder (an operator's ``tail -f`` of
its haproxy.cfg) is not the run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..model.files import write_atomic

RUN_PREFIX = "fs-"  # /tmp/fs-XXXXXXXX: short, because HAProxy's admin socket goes two levels below it (<= 97 chars)
OWNER = "owner.json"
STARTED = "started"
REMOVE_S = 5.0  # how long ``end_run`` tries to remove a folder that a process of the run still writes into
STOP_GRACE_S = 25.0  # a server asked to stop has this long; past it the supervisor (or a next start) ends it


def run_root() -> Path:
    return Path("/tmp") if os.path.isdir("/tmp") else Path(tempfile.gettempdir())


def started_at(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), or None when there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def running(entry: Iterable[int]) -> bool:
    """Whether the process [pid, start time] still runs (the same process, not a zombie)."""
    pid, start = entry
    return started_at(pid) == start and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def new_run_folder() -> Path:
    """A fresh run folder whose owner is this process."""
    folder = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=run_root()))
    record(folder, owners=[os.getpid()])
    return folder


def record(folder: Path, owners: Iterable[int] = (), tree: Iterable[int] = ()) -> None:
    """Add ``owners`` (processes whose life is the run's) and ``tree`` (processes the run started) to the folder's
    owner file, each as (pid, start time); a reader never sees half of it."""
    try:
        data = json.loads((folder / OWNER).read_text())
    except (OSError, ValueError):
        data = {"owners": [], "tree": []}
    for key, pids in (("owners", owners), ("tree", tree)):
        for pid in pids:
            start = started_at(pid)
            if start is not None and [pid, start] not in data[key]:
                data[key].append([pid, start])
    write_atomic(folder / OWNER, json.dumps(data).encode(), durable=False)


def recorded(folder: Path) -> list[list[int]]:
    """Every process the run in ``folder`` recorded as its own, as [pid, start time]."""
    try:
        entries = [list(e) for e in json.loads((folder / OWNER).read_text()).get("tree", [])]
    except (OSError, ValueError):
        entries = []
    try:
        lines = (folder / STARTED).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and all(f.isdigit() for f in fields) and [int(f) for f in fields] not in entries:
            entries.append([int(f) for f in fields])
    return entries


def end_run(folder: Path, remove: bool = True) -> list[int]:
    """End the processes the run in ``folder`` recorded that still run (but this one), then remove the folder (unless
    not ``remove``: a server starting again on fresh ports keeps it). Returns the pids ended.

    The removal is tried again, the run's HAProxy processes looked up again each time, until the folder stays gone
    or ``REMOVE_S`` has passed: a process of the run can still be writing into it as it is emptied (Serve's HAProxy
    manager in the middle of a reload when Ray shut down), and one ``rmtree`` then fails on a file that came after
    its listing ("directory not empty"), leaving the folder behind."""
    entries = recorded(folder)
    entries += [entry for entry in identities(haproxies(folder)) if entry not in entries]
    left = [entry for entry in entries if entry[0] != os.getpid() and running(entry)]
    end(left)
    ended = [pid for pid, _ in left]
    deadline = time.monotonic() + REMOVE_S
    while remove:
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
        again = [entry for entry in identities(haproxies(folder)) if running(entry)]
        end(again)
        ended += [pid for pid, _ in again]
    return ended


def haproxies(folder: Path) -> list[int]:
    """The HAProxy processes of the run in ``folder``, recorded or not: this user's processes whose command is HAProxy
    (``haproxy``, as Serve runs it through our wrapper and ``setpriv``) with a config file (``-f``) in the folder. A
    process that merely names the folder (an editor, ``tail -f`` of the config) is not one."""
    inside = f"{folder}/"
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid != os.getuid():
                continue
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        config = argv[argv.index("-f") + 1] if "-f" in argv[:-1] else ""
        if Path(argv[0]).name == "haproxy" and config.startswith(inside):
            found.append(int(proc.name))
    return found


def reap_stale(root: Path | None = None) -> list[Path]:
    """End the runs under ``root`` (default /tmp) whose owners are all gone (``end_run``): a folder of this user with
    an owner file naming no running owner. A folder without one, or of another user, is not judged. A run whose
    supervisor is gone but whose server still runs (stopping, on its parent-death signal) is ended as its supervisor
    would have: the server is asked to stop (SIGTERM, once more), given ``STOP_GRACE_S``, then killed, and the run
    ended; so a restart right after a kill -9 of the supervisor waits for the port instead of being refused, and a
    server whose stop hangs or outlasts the grace (Serve's replica drain on a loaded machine) cannot keep the port.
    Returns the folders reaped."""
    reaped = []
    for folder in sorted((root or run_root()).glob(f"{RUN_PREFIX}*")):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            owners = json.loads((folder / OWNER).read_text()).get("owners", [])
        except (OSError, ValueError):
            continue
        if owners and running(owners[0]):
            continue
        orphans = [entry for entry in owners if running(entry)]  # a server whose supervisor is gone
        if orphans:
            _signal(orphans, signal.SIGTERM)
            _wait_until(lambda orphans=orphans: not any(running(entry) for entry in orphans), STOP_GRACE_S)
            end(orphans, grace_s=1.0)
        end_run(folder)
        reaped.append(folder)
    return reaped


def _wait_until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def identities(pids: Iterable[int]) -> list[list[int]]:
    """[pid, start time] of each of ``pids`` that still runs."""
    return [[pid, start] for pid in pids if (start := started_at(pid)) is not None]


def _signal(entries: Iterable[list[int]], sig: int) -> None:
    """Send ``sig`` to each process ([pid, start time]) that is still that process."""
    for pid, start in entries:
        if started_at(pid) == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def end(entries: Iterable[list[int]], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is still there after ``grace_s``: each process ([pid, start time]) only while it is
    still that process (a pid the kernel handed to another process meanwhile is left alone). Collects the exit status
    of those that are this process's children, and of no other child."""
    entries = list(entries)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _signal(entries, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(running(entry) for entry in entries):
            time.sleep(0.05)
            _collect(entries)
    _collect(entries)


def _collect(entries: list[list[int]]) -> None:
    for pid, _ in entries:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
