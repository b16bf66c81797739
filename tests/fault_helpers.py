"""Load while a part of a running server is killed, and what the clients saw: shared by tests/test_serving_faults_load.py
(which asserts behaviour) and benchmarks/faults.py (which records the figures).

A client sends one request at a time. A connection refused before anything was sent is retried (every 0.2 s, as a
load balancer's client does; nothing was sent, so nothing runs twice); a request is **lost** when it got no answer
once sent (connection reset, timeout) or a 5xx other than the documented 503 overload answer, or when no attempt
connected within ``give_up_s``. A **hang** is a request that ran into the client's timeout.

By default a client sends its next request as soon as it has an answer (benchmarks/faults.py: the figures under full
load). With ``pause_s`` (the tests) the clients send together, once every ``pause_s`` (a burst of ``CLIENTS`` requests
in flight and queued at once, then nothing until the next): the fault can be made while a burst is in flight
(``under_load``'s ``in_flight``), without clients that keep both cores busy for the whole test."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

STOP_S = 30  # the targets are 5 s (port free) and 10 s (stopped, nothing left); room for a loaded 2-core machine
CLIENTS = 16
TIMEOUT_S = 20.0  # one attempt's timeout: a request that takes this long is a hang
BODY = json.dumps({"task": "rte", "inputs": ["a fine film, well acted"]}).encode()


@dataclass
class Record:
    sent: float
    done: float
    status: int  # 0: no answer
    error: str = ""
    retries: int = 0


@dataclass
class Load:
    """``CLIENTS`` threads posting to ``port`` until ``stop()``."""

    port: int
    give_up_s: float = 60.0
    pause_s: float = 0.0  # > 0: each client waits for the next multiple of it (on one clock) before its next request
    records: list[Record] = field(default_factory=list)
    in_flight: int = 0  # requests sent (connected) and not yet answered, this moment
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, clients: int = CLIENTS) -> Load:
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Record]:
        self._stop.set()
        for t in self._threads:
            t.join(TIMEOUT_S + self.give_up_s)
        return self.records

    def _client(self) -> None:
        while not self._stop.is_set():
            rec = self._one()
            with self._lock:
                self.records.append(rec)
            if rec.status != 200:
                time.sleep(0.1)
            if self.pause_s > 0:  # the next tick, the same for every client: they send together
                self._stop.wait(self.pause_s - time.monotonic() % self.pause_s)

    def _flight(self, step: int) -> None:
        with self._lock:
            self.in_flight += step

    def _one(self) -> Record:
        sent, retries = time.monotonic(), 0
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
            try:
                conn.connect()
            except OSError as exc:
                conn.close()
                if time.monotonic() - sent > self.give_up_s or self._stop.is_set():
                    return Record(sent, time.monotonic(), 0, f"no connection: {exc}", retries)
                retries += 1
                time.sleep(0.2)
                continue
            self._flight(1)
            try:
                conn.request("POST", "/v1/classify", BODY, {"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                return Record(sent, time.monotonic(), resp.status, "", retries)
            except TimeoutError as exc:
                return Record(sent, time.monotonic(), 0, f"hang: {exc}", retries)
            except OSError as exc:
                return Record(sent, time.monotonic(), 0, f"{type(exc).__name__}: {exc}", retries)
            except http.client.HTTPException as exc:
                return Record(sent, time.monotonic(), 0, f"{type(exc).__name__}: {exc}", retries)
            finally:
                self._flight(-1)
                conn.close()


def lost(r: Record) -> bool:
    return r.status == 0 or (r.status >= 500 and r.status != 503)


def summary(fault: str, records: list[Record], killed_at: float) -> dict:
    """What the clients saw around a kill at ``killed_at``: requests, answers, lost and hung ones, the outage (the
    longest time without a 200, from the kill to the end of the load) and the time from the kill to the 200 that
    ended it (None when none did: the load ended first)."""
    oks = sorted(r.done for r in records if r.status == 200 and r.done >= killed_at)
    end = max((r.done for r in records), default=killed_at)
    gaps = [(b - a, b) for a, b in itertools.pairwise([killed_at, *oks, end])]
    outage, back = max(gaps, default=(0.0, killed_at))
    return {
        "fault": fault,
        "requests": len(records),
        "ok": sum(r.status == 200 for r in records),
        "overloaded_503": sum(r.status == 503 for r in records),
        "lost": sum(lost(r) for r in records),
        "in_flight_at_kill": sum(r.sent <= killed_at < r.done for r in records),  # sent, not answered when killed
        "lost_sent_s": sorted(round(r.sent - killed_at, 3) for r in records if lost(r)),  # when each lost one was sent
        "lost_examples": sorted({(r.error or f"HTTP {r.status}")[:80] for r in records if lost(r)})[:4],
        "answered_4xx": sum(400 <= r.status < 500 for r in records),  # 404 from a HAProxy that has no routes yet
        "hung": sum(r.error.startswith("hang") for r in records),
        "retried": sum(r.retries > 0 for r in records),
        "outage_s": round(outage, 2),
        "back_after_s": round(back - killed_at, 2) if back in oks else None,
    }


def under_load(
    port: int,
    fault: str,
    kill: Callable[[], object],
    restart: Callable[[], object] | None = None,
    settle_s: float = 4.0,
    after_s: float = 6.0,
    bound_s: float = 90.0,
    pause_s: float = 0.0,
    in_flight: int = 0,
) -> dict:
    """``CLIENTS`` clients on ``port`` (sending in bursts every ``pause_s`` where it is > 0: ``Load``); after
    ``settle_s``, once at least ``in_flight`` requests are in flight (at most ``bound_s`` more), ``kill()`` then
    ``restart()`` (a supervisor's restart, by hand); the load goes on until the server has answered for ``after_s`` s
    again (at most ``bound_s``). Returns ``summary``."""
    load = Load(port, give_up_s=bound_s, pause_s=pause_s).start()
    time.sleep(settle_s)
    flying = time.monotonic() + bound_s
    while load.in_flight < in_flight and time.monotonic() < flying:
        time.sleep(0.002)
    killed_at = time.monotonic()
    kill()
    if restart is not None:
        restart()
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        back = [r.done for r in list(load.records) if r.status == 200 and r.sent > killed_at + 0.5]
        if back and time.monotonic() - min(back) > after_s:
            break
        time.sleep(0.5)
    return summary(fault, load.stop(), killed_at)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes(server_pid: int) -> dict[int, str]:
    """Every process below the server ``server_pid``, with its command line."""
    from tests.serving_helpers import descendants

    return {p: cmdline(p) for p in descendants(server_pid)}


def replica_pid(server_pid: int) -> int:
    return next(p for p, c in processes(server_pid).items() if "ServeReplica" in c)


def kill_replica(server_pid: int) -> list[int]:
    pid = replica_pid(server_pid)
    os.kill(pid, signal.SIGKILL)
    return [pid]


def kill_all(pids: list[int], again: Callable[[], list[int]] | None = None) -> list[int]:
    """kill -9 of ``pids``, found beforehand (a fault at a chosen moment: reading /proc for them takes a while); the
    ones killed. Where one of them is gone by then (an HAProxy replaced by a reload since: seen in CI), ``again``
    finds the ones to kill now, and those are killed too: the fault still meets what serves."""
    killed, gone = [], False
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            gone = True
    if gone and again is not None:
        killed += kill_all([pid for pid in again() if pid not in killed])
    return killed


def haproxy_pids(server_pid: int) -> list[int]:
    """Every HAProxy process of the server's (a reload leaves the old one draining for a while); none during a
    reload's gap, when the HAProxy found a moment ago is gone and its successor not yet exec'd (its command line still
    its parent's)."""
    from tests.serving_helpers import haproxy_config

    try:
        config = str(haproxy_config(server_pid))
    except AssertionError:  # no HAProxy below the server this moment
        return []
    return [p for p, c in processes(server_pid).items() if config in c]


def haproxy_pids_once_up(server_pid: int, within_s: float = 30.0) -> list[int]:
    """``haproxy_pids``, once there is one (at most ``within_s``: a reload's gap)."""
    pids: list[int] = []

    def found() -> bool:
        pids[:] = haproxy_pids(server_pid)
        return bool(pids)

    within(found, within_s)
    return pids


def kill_haproxy(server_pid: int, within_s: float = 30.0) -> list[int]:
    """kill -9 of every HAProxy process of the server's, once there is one (at most ``within_s``: a reload's gap)."""
    return kill_all(haproxy_pids_once_up(server_pid, within_s))


def raylet_pid(server_pid: int) -> int:
    return next(p for p, c in processes(server_pid).items() if "/raylet/raylet " in c)


def kill_raylet(server_pid: int) -> list[int]:
    return kill_all([raylet_pid(server_pid)])


# --- what the fault tests check after a kill or a signal (tests/test_serving_faults*.py) ---------------------------


def within(done: Callable[[], bool], bound_s: float = STOP_S) -> float | None:
    """Seconds until ``done()`` holds, or None when it does not within ``bound_s``."""
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > bound_s:
            return None
        time.sleep(0.1)
    return time.monotonic() - started


def left(pids: set[int]) -> list[bytes]:
    """The start of the command line of those of ``pids`` that still run."""
    from tests.serving_helpers import alive

    return [Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in alive(pids)]


def haproxy(server_pid: int) -> int:
    """The HAProxy process of the server ``server_pid``."""
    pids = haproxy_pids(server_pid)
    assert pids, f"no HAProxy below pid {server_pid}"
    return pids[0]


def group_signal_stops(served, sig: int, mark: str) -> None:
    """``sig`` to the process group of the serving ``served`` (started with ``own_group``, its environment carrying
    ``mark``): it exits 0 within ``STOP_S`` without a traceback, nothing carrying the mark is left and its run folder
    is gone."""
    import subprocess

    import pytest

    from tests.serving_helpers import carrying, haproxy_config

    folder = haproxy_config(served.proc.pid).parent.parent
    sent = time.monotonic()
    os.killpg(served.proc.pid, sig)
    try:
        code = served.proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {STOP_S} s after a group {signal.Signals(sig).name}:\n{served.log.read_text()[-2000:]}")
    exited_s = time.monotonic() - sent
    gone_s = within(lambda: not carrying(mark))
    print(f"\ngroup {signal.Signals(sig).name} while serving: exit {code} after {exited_s:.1f} s, nothing left after {gone_s} s")
    assert code == 0 and "Traceback" not in served.log.read_text(), served.log.read_text()[-3000:]
    assert gone_s is not None, carrying(mark)
    assert not folder.exists()


# --- a crash of the serving loop, on cue (tests/test_live_serving.py, merged from tests/test_process_cleanup.py) -------

CUE_ENV = "FUSIONSERVE_TEST_CRASH_CUE"  # the file whose creation crashes the serving loop
# Loaded by every Python process of the server (PYTHONPATH): once the server's module is imported, its serving loop's
# per-second check raises as soon as the cue file exists, as an unexpected error in the loop would.
_CRASH = textwrap.dedent(
    """
    import importlib.abc, importlib.util, os, sys

    TARGET = "fusionserve.serving.process.server"
    CUE = os.environ.get("FUSIONSERVE_TEST_CRASH_CUE")

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                check = module._ray_died

                def _crash_on_cue():
                    if os.path.exists(CUE):
                        raise RuntimeError("the serving loop crashed (made to, by tests/fault_helpers.py)")
                    return check()

                module._ray_died = _crash_on_cue

            spec.loader.exec_module = exec_module
            return spec

    if CUE:
        sys.meta_path.insert(0, _Hook())
    """
)


def crash_on_cue(folder: Path, env: dict[str, str]) -> Path:
    """Set ``env`` (a server's environment, changed in place) to load the crash hook from ``folder``; returns the cue:
    the file whose creation makes the serving loop of a server started with ``env`` raise."""
    hook = folder / "crash-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_CRASH)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
    env[CUE_ENV] = str(folder / "crash-now")
    return folder / "crash-now"


def crash_leaves_nothing(served, cue: Path, mark: str) -> None:
    """Crash the serving loop of ``served`` (started with ``crash_on_cue``'s environment carrying ``mark``, as the
    leader of its own process group, as systemd starts it): it exits 1 (so that ``Restart=on-failure`` restarts it),
    saying so, and within 30 s nothing carrying the mark is left and its run folder is gone. An uncaught exception in
    the serving loop ended the supervised server with exit 0 (its exit code stayed 0 unless a start-up failure set
    it), so the supervisor exited 0 and Restart=on-failure did not restart it."""
    import subprocess

    import pytest

    from tests.serving_helpers import carrying, haproxy_config

    folder = haproxy_config(served.proc.pid).parent.parent
    cue.touch()
    try:
        code = served.proc.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 120 s after its serving loop crashed:\n{served.log.read_text()[-3000:]}")
    text = served.log.read_text()
    assert code == 1, text[-3000:]
    assert "the serving loop crashed" in text, text[-3000:]
    assert within(lambda: not carrying(mark), 30) is not None, carrying(mark)
    assert not folder.exists()
