"""A server's processes in its own care, whatever ends it.

``fusionserve serve`` runs in two processes. The one started (the supervisor: what a terminal, systemd or a
container runtime knows) forks the server into a session of its own and then only waits: it forwards SIGINT,
SIGTERM and SIGHUP to the server, and once the server is gone it ends every process left below it and removes the
run folder. So:

- a signal to the whole process group (Ctrl-C in a terminal, ``kill -TERM -PGID``) reaches the supervisor only, never
  Ray's processes, which the server then stops in order (before, a group SIGTERM killed Ray's GCS under the server,
  whose shutdown then waited 60 s for it);
- ``kill -9`` of the supervisor hands the server a SIGTERM (its parent-death signal): the usual clean stop;
- ``kill -9`` of the server leaves its orphans (HAProxy, Ray's workers) to the supervisor, a child subreaper, which
  ends them, frees the port and exits 1 (a supervisor's ``Restart=on-failure`` then starts a new server);
- both killed at once (``kill -9 -PGID``, the OOM killer taking both): the run folder names its owners by pid and
  start time (``owner.json``), and the next start on the machine reaps a folder whose owners are all gone: what its
  processes left, then the folder.

Clean-up only ever ends a process the run recorded as its own, by pid and start time (a pid the kernel gave to
another process since is not it): the processes the server started (``owner.json``'s tree) and every HAProxy that
Serve started for it, which its launcher records as it starts (``STARTED``; HAProxy is the child of a Ray worker,
and reloads start new ones). A process that merely names the run folder (an operator's ``tail -f`` of its
haproxy.cfg) is not the run's.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

RUN_PREFIX = "fs-"  # /tmp/fs-XXXXXXXX: short, because HAProxy's admin socket goes two levels below it (<= 97 chars)
OWNER = "owner.json"
STARTED = "started"  # "pid start-time" lines, appended by each process the run starts outside Python as it starts
STOP_GRACE_S = 25.0  # a forwarded stop signal to the server's exit; past it the supervisor ends everything itself
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_exit_code = [1]  # the server's exit code: a failure until a clean stop says otherwise (see ``exit_with``)


def run_root() -> Path:
    return Path("/tmp") if os.path.isdir("/tmp") else Path(tempfile.gettempdir())


def started_at(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), or None when there is no such process:
    with the pid, an identity a recycled pid cannot take."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _running(entry: list[int]) -> bool:
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


def record(folder: Path, owners: list[int] | None = None, tree: list[int] | None = None) -> None:
    """Add ``owners`` (processes whose life is the run's) and ``tree`` (processes the run started) to the folder's
    owner file, each as (pid, start time). Written whole then renamed: a reader never sees half of it."""
    path = folder / OWNER
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"owners": [], "tree": []}
    for key, pids in (("owners", owners), ("tree", tree)):
        for pid in pids or []:
            start = started_at(pid)
            if start is not None and [pid, start] not in data[key]:
                data[key].append([pid, start])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def reap_stale(root: Path | None = None) -> list[Path]:
    """Reap the run folders under ``root`` (default /tmp) left by servers that are gone: a folder of this user whose
    owner file names no running owner. Ends what its run recorded that still runs (by pid and start time), then
    removes it. A folder without an owner file, or of another user, is not judged. Returns the folders reaped."""
    reaped = []
    for folder in sorted((root or run_root()).glob(f"{RUN_PREFIX}*")):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            data = json.loads((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue
        owners = data.get("owners", [])
        if owners and not _running(owners[0]) and any(_running(entry) for entry in owners):
            # its supervisor is gone and the server is stopping (its parent-death signal): let it finish, so a restart
            # right after a kill -9 of the supervisor waits for the port instead of being refused
            _wait_until(lambda owners=owners: not any(_running(entry) for entry in owners), STOP_GRACE_S)
        if any(_running(entry) for entry in owners):
            continue
        _end(recorded(folder))
        shutil.rmtree(folder, ignore_errors=True)
        reaped.append(folder)
    return reaped


def _wait_until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def end_run(folder: Path) -> list[int]:
    """At the end of a run: end the processes it recorded that still run (by pid and start time: Ray's workers that
    outlive a raylet gone first, HAProxy, which outlives Ray's shutdown), then remove the folder. Returns the pids."""
    left = [entry for entry in recorded(folder) if entry[0] != os.getpid() and _running(entry)]
    _end(left)
    shutil.rmtree(folder, ignore_errors=True)
    return [pid for pid, _ in left]


def recorded(folder: Path) -> list[list[int]]:
    """Every process the run in ``folder`` recorded as its own, as [pid, start time]: the owner file's tree and the
    lines of ``STARTED``."""
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


def _end(entries: Iterable[list[int]], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is still there after ``grace_s``: each process ([pid, start time]) only while it is
    still that process (a pid the kernel handed to another process meanwhile is left alone)."""
    entries = list(entries)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in entries:
            if started_at(pid) == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_running(entry) for entry in entries):
            time.sleep(0.05)
            for pid, _ in entries:  # only these: a program embedding the server keeps its other children's statuses
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)


def _reap_children() -> None:
    """Collect every exited child (orphans handed to this subreaper included), so none stays a zombie."""
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


def supervise() -> Path:
    """Fork the server off this process (see the module's notes). Returns, in the server (the child), its run folder;
    in the supervisor it never returns: it waits for the server, cleans up after it and exits with its code (1 when
    the server died by a signal). Where there is no fork (not Linux), returns a run folder and stays one process."""
    folder = new_run_folder()
    if not sys.platform.startswith("linux"):
        return folder
    sys.stdout.flush()
    sys.stderr.flush()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.setsid()  # no group signal of the supervisor's, and no terminal's, reaches Ray's processes
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the line above
            os.kill(os.getpid(), signal.SIGTERM)
        record(folder, owners=[os.getpid()])
        resume_supervised()
        return folder
    os._exit(_wait(child, folder))


def resume_supervised() -> None:
    """In the server (the child): how it ends. Called by ``supervise``, and again by a server that exec'd itself
    afresh since (serving/process/loopback.py), whose new interpreter has none of it. Registered before Ray's own exit hooks,
    so it runs after them: once Ray is shut down the server ends without C++'s static destructors, which raced Ray's
    native threads and spun forever in Ray's terminate handler (seen: a child stopped cleanly, then hung at 100% CPU
    until killed)."""
    atexit.register(_exit_now)


def exit_with(code: int) -> None:
    """The exit code the server (the child) ends with once Python's own exit hooks ran: 1 (a crash: an exception
    nobody caught, in the serving loop or in its clean-up) until the server says otherwise, 0 after a clean stop."""
    _exit_code[0] = code


def supervise_end(code: int) -> None:
    """End the server now with ``code``, past every exit hook (Ray's would wait on the processes that died); what
    is left below it goes to the supervisor, its subreaper, which ends it."""
    exit_with(code)
    _exit_now()


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_code[0])


def _wait(child: int, folder: Path) -> int:
    asked: list[float] = []

    def forward(signum: int, _frame: object) -> None:
        if not asked:
            asked.append(time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM if signum == signal.SIGHUP else signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    status = None
    while status is None:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == child:
            status = st
        elif pid == 0:
            if asked and time.monotonic() - asked[0] > STOP_GRACE_S:
                print(f"fusionserve: the server did not stop within {STOP_GRACE_S:.0f} s; ending it", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
                asked[0] = float("inf")
            time.sleep(0.1)
    left = [[pid, start] for pid in descendants(os.getpid()) if (start := started_at(pid)) is not None]
    _end(left, grace_s=1.0)
    ended = [pid for pid, _ in left] + end_run(folder)
    _reap_children()
    if status is None or os.WIFSIGNALED(status):
        how = signal.Signals(os.WTERMSIG(status)).name if status is not None else "unknown means"
        print(
            f"fusionserve: the server process (pid {child}) was ended by {how}; ended the {len(ended)} process(es) it "
            "left and removed its run folder",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return os.WEXITSTATUS(status)
