"""The process machinery's own faults: clean-up ends only the processes a run started (a ``tail -f`` of its HAProxy
config, or an embedding program's other children, are not the run's: the latter checked on the embedded server of
tests/test_drawn_port_taken.py); each test ends only what it started, by pid. A server whose serving loop crashes exits
non-zero (so that systemd's ``Restart=on-failure`` restarts it) and leaves nothing: checked at the end of
tests/test_live_serving.py, on its server (tests/fault_helpers.crash_leaves_nothing; it started a server of its own
here)."""

import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.serving_helpers import free_port


def _fake_haproxy(folder: Path) -> subprocess.Popen:
    """A stand-in for HAProxy started the way Serve starts it (``RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG``), through
    the wrapper fusionserve writes into the run folder: a process whose command line names the config."""
    from fusionserve.serving.process.haproxy_rules import write_wrapper

    config = folder / "node" / "haproxy.cfg"
    config.parent.mkdir()
    config.write_text("frontend http_frontend\n    bind 127.0.0.1:1\n")
    wrapper = write_wrapper(folder, [sys.executable, "-c", "import time; time.sleep(300)"], 10.0)
    proc = subprocess.Popen([str(wrapper), "-db", "-f", str(config)])
    deadline = time.monotonic() + 30
    while not Path(f"/proc/{proc.pid}/cmdline").read_text(errors="replace").startswith(sys.executable):  # exec'd
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def _tail(folder: Path) -> subprocess.Popen:
    return subprocess.Popen(["tail", "-f", str(folder / "node" / "haproxy.cfg")], stdout=subprocess.DEVNULL)


def test_the_end_of_a_run_ends_its_haproxy_and_spares_a_tail_of_its_config():
    """reap() ended every process of the user whose command line mentioned the run folder (an operator's ``tail -f``
    of its haproxy.cfg), then SIGKILLed them after 3 s without checking who they were."""
    from fusionserve.serving.process.runs import end_run, new_run_folder

    folder = new_run_folder()
    haproxy = _fake_haproxy(folder)
    tail = _tail(folder)
    try:
        end_run(folder)
        assert haproxy.wait(10) is not None
        assert tail.poll() is None, "the tail of the run's haproxy.cfg was ended"
        assert not folder.exists()
    finally:
        for proc in (haproxy, tail):
            proc.kill()
            proc.wait()


# A process of the run that still writes into its folder while the folder is removed: Serve's HAProxy manager in the
# middle of a reload when Ray shut down (it writes the config, the server state and a log file for each HAProxy it
# starts; the wrapper appends to ``started``). Here: a new file every moment, for WRITES_S or until the folder is gone.
WRITER = textwrap.dedent(
    """
    import sys, time
    folder, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
    n = 0
    while time.monotonic() < until:
        try:
            open(f"{folder}/reload.{n}.log", "w").close()
        except FileNotFoundError:  # the folder is gone
            break
        n += 1
    """
)
WRITES_S = 1.5


def test_the_end_of_a_run_removes_its_folder_while_a_process_of_the_run_still_writes_into_it():
    """A clean-clone CI saw the run folder left after the server, its supervisor killed with kill -9, had stopped
    cleanly and ended every process of the run (tests/test_serving_faults_load.py): the one ``rmtree`` raced a file
    written into the folder as it emptied it, failed on "directory not empty", and the failure was ignored."""
    from fusionserve.serving.process.runs import end_run, new_run_folder

    folder = new_run_folder()
    for n in range(2000):  # a removal that takes a while, as the replicas' metrics and HAProxy's logs make it
        (folder / f"metrics.{n}.db").touch()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(WRITES_S)])
    try:
        deadline = time.monotonic() + 30
        while not (folder / "reload.0.log").exists():
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        end_run(folder)
        assert not folder.exists(), sorted(p.name for p in folder.iterdir())[:5]
    finally:
        writer.kill()
        writer.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_reaping_a_stale_run_folder_spares_a_tail_of_its_config(tmp_path):
    """The same when the next start reaps a folder whose owners are all gone (both killed with kill -9)."""
    from fusionserve.serving.process.runs import RUN_PREFIX, reap_stale, record

    folder = tmp_path / f"{RUN_PREFIX}stale"
    folder.mkdir()
    owner = subprocess.Popen(["sleep", "300"])
    record(folder, owners=[owner.pid])
    haproxy = _fake_haproxy(folder)
    tail = _tail(folder)
    owner.kill()
    owner.wait()
    try:
        assert reap_stale(tmp_path) == [folder]
        assert haproxy.wait(10) is not None
        assert tail.poll() is None, "the tail of the stale run's haproxy.cfg was ended"
    finally:
        for proc in (haproxy, tail):
            proc.kill()
            proc.wait()


# A server whose serving loop gets SIGTERM at the worst moment: inside the loop's wait, whatever that wait is. The hooks
# below raise it while the main thread holds the lock of a threading.Condition (as it does for a few instructions of
# every Event.wait: the loop's wait when the deadlock was found) or while it sleeps (time.sleep: the loop's wait since),
# whichever comes first, and say so ("signalled"); Ray is not started (start and stop stand in), the serving loop and
# its signal handling are the server's own.
WORST_MOMENT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from fusionserve.serving.process import server

    serving = []
    real, real_sleep = threading.Condition._is_owned, time.sleep

    def signal_once():
        if serving and len(serving) == 1:
            serving.append("sent")
            print("signalled", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def _is_owned(self):  # called by Condition.wait with the condition's lock held
        owned = real(self)
        signal_once()
        return owned

    def sleep(seconds):  # the signal arrives while the loop sleeps
        signal_once()
        real_sleep(seconds)

    threading.Condition._is_owned = _is_owned
    time.sleep = sleep
    server._ray_died = lambda: None
    server.Server.start = lambda self, say, after_ray: serving.append("up") or "http://127.0.0.1:1"
    server.Server.stop = lambda self: print("stopped", flush=True)
    sys.exit(server.Server(server.ServerConfig(sys.argv[1])).serve_forever())
    """
)


def test_a_signal_while_the_serving_loop_holds_a_lock_stops_the_server(artifact, tmp_path):
    """The serving loop waited on a threading.Event that its SIGTERM handler set: a signal handled while the main thread
    held the Event's lock (a few instructions of every wait, more often on a loaded machine) deadlocked the server
    in its own handler. A server whose supervisor was killed then never stopped (never said "shutting down"), and
    the restart was refused, its port still held ("already in use by pid N (haproxy ...)"). A second SIGTERM, as the
    supervisor or the next start sends, did not help either."""
    script = tmp_path / "worst_moment.py"
    script.write_text(WORST_MOMENT)
    proc = subprocess.Popen([sys.executable, str(script), str(artifact)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:  # the hook's signal comes at the loop's first wait (it wakes every second), and stops the server
        proc.wait(5)
    except subprocess.TimeoutExpired:  # not stopped in 5 s: another, as the next start's reap sends it
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the server did not stop on SIGTERM: {proc.communicate()[0].decode()[-2000:]}")
    assert b"signalled" in out, out.decode()[-2000:]  # the hook found the loop's wait: the signal came inside it
    assert proc.returncode == 0, out.decode()[-2000:]
    assert b"shutting down" in out and b"stopped" in out, out.decode()[-2000:]


# a server that stops too slowly (Serve's replica drain, Ray's shutdown on a loaded machine) or not at all
_STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"


def test_a_server_left_by_its_killed_supervisor_that_does_not_stop_is_ended_by_the_next_start(tmp_path, monkeypatch):
    """kill -9 of the supervisor's group: its server had its parent-death signal, and a restart reaped the run once the
    server stopped; a server still stopping after the grace (seen in a full suite run) kept its run, its HAProxy held
    the port, and the restart was refused ("already in use by pid N (haproxy ...)")."""
    from fusionserve.serving.process import runs

    monkeypatch.setattr(runs, "STOP_GRACE_S", 1.0)
    folder = tmp_path / f"{runs.RUN_PREFIX}orphaned"
    folder.mkdir()
    supervisor = subprocess.Popen(["sleep", "300"])
    server = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE)
    assert server.stdout.readline() == b"ready\n"
    runs.record(folder, owners=[supervisor.pid, server.pid])
    haproxy = _fake_haproxy(folder)
    supervisor.kill()
    supervisor.wait()
    try:
        assert runs.reap_stale(tmp_path) == [folder]
        assert server.wait(10) is not None  # (its exit status collected by the reap, which ended it)
        assert haproxy.wait(10) is not None
        assert not folder.exists()
    finally:
        for proc in (server, haproxy):
            proc.kill()
            proc.wait()


def test_the_reap_ends_a_haproxy_of_the_dead_run_that_its_record_missed(tmp_path):
    """An HAProxy of a dead run is ended by the next start even where the run's record does not name it (started
    outside the wrapper, or its line lost): a real HAProxy, found by its config in the run's folder, and its port
    freed; an HAProxy of another folder is left alone."""
    from fusionserve.serving.process.haproxy_rules import real_haproxy
    from fusionserve.serving.process.ports import port_holder
    from fusionserve.serving.process.runs import RUN_PREFIX, reap_stale, record

    binary = real_haproxy()
    if binary is None:
        pytest.skip("no HAProxy here")
    folder, other = tmp_path / f"{RUN_PREFIX}dead", tmp_path / "elsewhere"
    folder.mkdir()
    owner = subprocess.Popen(["sleep", "300"])
    record(folder, owners=[owner.pid])
    owner.kill()
    owner.wait()
    procs, ports = [], []
    for where in (folder, other):
        config, port = where / "node" / "haproxy.cfg", free_port()
        config.parent.mkdir(parents=True)
        config.write_text(
            "defaults\n    mode http\n    timeout connect 1s\n    timeout client 1s\n    timeout server 1s\n"
            f"frontend http_frontend\n    bind 127.0.0.1:{port}\n"
        )
        procs.append(subprocess.Popen([binary, "-db", "-f", str(config)], stderr=subprocess.DEVNULL))
        ports.append(port)
    try:
        deadline = time.monotonic() + 30
        while not all(port_holder("127.0.0.1", port) for port in ports):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.05)
        assert reap_stale(tmp_path) == [folder]
        assert procs[0].wait(10) is not None and port_holder("127.0.0.1", ports[0]) is None
        assert procs[1].poll() is None, "the HAProxy of another folder was ended"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# Ray's ray.get lets a signal's Python handler run while it waits, and turns what the handler raised into a KeyboardInterrupt
# of its own (Ray 2.x, ray._raylet's check_status): the server's _Interrupted arrives as a plain KeyboardInterrupt.
RAY_GET_INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, time
    from fusionserve.serving.process import server

    def start(self, say, after_ray):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # while Serve starts: ray.get(controller.get_proxies.remote())
            time.sleep(30)
        except KeyboardInterrupt:
            raise KeyboardInterrupt() from None  # what Ray's ray.get raises instead

    server.Server.start = start
    server.Server.stop = lambda self: print("stopped", flush=True)
    sys.exit(server.Server(server.ServerConfig(sys.argv[1])).serve_forever())
    """
)


def test_a_signal_that_ray_get_turned_into_its_own_keyboard_interrupt_is_an_interruption_while_starting(artifact, tmp_path):
    """A SIGTERM while Serve started (its ray.get of the proxies) exited 1 with a traceback and no 'interrupted while
    starting' (seen once in a full `pytest -n 2`, in test_serving_hardening's SIGTERM-while-starting test): Ray raised
    its own KeyboardInterrupt for the handler's _Interrupted. It is the same interruption: stopped, exit 0."""
    script = tmp_path / "ray_get.py"
    script.write_text(RAY_GET_INTERRUPTED)
    done = subprocess.run([sys.executable, str(script), str(artifact)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "stopped\n" and "interrupted while starting; shutting down" in done.stderr, done.stderr[-3000:]
