"""Faults a supervised server meets, sent as operators send them: to the whole process group (the server is started as
the leader of its own group, as a terminal, systemd or a container runtime starts it), ``kill -9`` of the server,
``kill -9`` of the whole group, then a restart on the same port. Nothing of a run may outlive it, a restart must
serve, a stop must end with exit 0. Each test ends only the processes it started (by pid, found by the mark in their
environment)."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fusionserve.serving.process.ports import port_holder
from tests.serving_helpers import (
    alive,
    call,
    carrying,
    descendants,
    free_port,
    haproxy_config,
    is_loopback,
    launch,
)

pytestmark = pytest.mark.slow

BOUND_S = 30  # the targets are 5 s (port free) and 10 s (stopped, nothing left); room for a loaded 2-core machine
TEXT = {"task": "rte", "inputs": ["a fine film"]}


def _within(done: Callable[[], bool], bound_s: float = BOUND_S) -> float | None:
    """Seconds until ``done()`` holds, or None when it does not within ``bound_s``."""
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > bound_s:
            return None
        time.sleep(0.1)
    return time.monotonic() - started


def _left(pids: set[int]) -> list[bytes]:
    return [Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in alive(pids)]


def _haproxy(pid: int) -> int:
    config = haproxy_config(pid)
    return next(p for p in descendants(pid) if str(config) in Path(f"/proc/{p}/cmdline").read_text(errors="replace"))


def test_a_killed_server_leaves_nothing_and_a_restart_on_its_port_serves(artifact, tmp_path, marked):
    """kill -9 of the server (the OOM killer, a crash): HAProxy outlived it, holding the port and answering 500, and a
    restart was refused ("already in use by pid N (haproxy)"); Ray's processes took a minute to go. Then kill -9 of the
    whole group, which no process of the server sees coming: the next start reaps what the run left."""
    _, env = marked
    port = free_port()
    first = launch(artifact, tmp_path / "first.log", port=port, env=env, own_group=True)
    tree, folder = descendants(first.proc.pid), haproxy_config(first.proc.pid).parent.parent
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    free_s = _within(lambda: port_holder("127.0.0.1", port) is None)
    gone_s = _within(lambda: not alive(tree))
    print(f"\nkill -9 of the server: port free after {free_s} s, its {len(tree)} processes gone after {gone_s} s")
    assert free_s is not None, port_holder("127.0.0.1", port)
    assert gone_s is not None, _left(tree)
    assert not folder.exists()

    second = launch(artifact, tmp_path / "second.log", port=port, env=env, own_group=True)
    assert call(second.url + "/v1/classify", TEXT)[0] == 200
    tree, folder, haproxy = descendants(second.proc.pid), haproxy_config(second.proc.pid).parent.parent, _haproxy(second.proc.pid)
    os.killpg(second.proc.pid, signal.SIGKILL)  # HAProxy, in the process group of Serve's worker, outlives this
    second.proc.wait()

    third = launch(artifact, tmp_path / "third.log", port=port, env=env, own_group=True)
    assert call(third.url + "/v1/classify", TEXT)[0] == 200
    assert not folder.exists() and not alive({haproxy})
    assert _within(lambda: not alive(tree)) is not None, _left(tree)

    os.killpg(third.proc.pid, signal.SIGTERM)
    assert third.proc.wait(BOUND_S) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_group_signal_while_starting_stops_everything_and_exits_0(artifact, tmp_path, marked, sig):
    """A group SIGTERM while starting (systemd stopping a unit that is still starting) reached Ray's GCS and raylet
    with the server, whose clean-up then waited 60 s for a GCS that was gone and exited 1, leaving HAProxy."""
    mark, env = marked
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(free_port())]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    while "fusionserve: deploying" not in log.read_text():  # Ray runs; Serve and the replica are on their way
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    sent = time.monotonic()
    os.killpg(proc.pid, sig)
    try:
        code = proc.wait(BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {BOUND_S} s after a group {sig.name}:\n{log.read_text()[-2000:]}")
    exited_s = time.monotonic() - sent
    gone_s = _within(lambda: not carrying(mark))
    print(f"\ngroup {sig.name} while starting: exit {code} after {exited_s:.1f} s, nothing left after {gone_s} s")
    assert code == 0, log.read_text()[-3000:]
    assert gone_s is not None, carrying(mark)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_group_signal_while_serving_stops_everything_and_exits_0(artifact, tmp_path, marked, sig):
    """SIGTERM to the group (systemd's default KillMode=control-group, `kill -TERM -PGID`) reached Ray's GCS and raylet
    with the server: "shutting down", then 60 s waiting for the GCS, exit 1, HAProxy left holding the port. SIGINT to
    the group is Ctrl-C in a terminal (Ray's processes block SIGINT: that one was clean)."""
    mark, env = marked
    served = launch(artifact, tmp_path / "serve.log", env=env, own_group=True)
    folder = haproxy_config(served.proc.pid).parent.parent
    sent = time.monotonic()
    os.killpg(served.proc.pid, sig)
    try:
        code = served.proc.wait(BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {BOUND_S} s after a group {sig.name}:\n{served.log.read_text()[-2000:]}")
    exited_s = time.monotonic() - sent
    gone_s = _within(lambda: not carrying(mark))
    print(f"\ngroup {sig.name} while serving: exit {code} after {exited_s:.1f} s, nothing left after {gone_s} s")
    assert code == 0 and "Traceback" not in served.log.read_text(), served.log.read_text()[-3000:]
    assert gone_s is not None, carrying(mark)
    assert not folder.exists()


def test_with_a_loopback_host_the_replicas_own_grpc_port_is_on_loopback(shared_server):
    """--host 127.0.0.1 (the default) bound the replica's own gRPC server, HAProxy's gRPC target, on every interface
    (Serve writes "[::]:PORT"); it is on loopback now (the loopback shim, serving/process/loopback.py), and gRPC through
    HAProxy still answers. The whole process tree: tests/test_loopback.py. The server: the shared one (conftest.py)."""
    import grpc
    import psutil

    from fusionserve.serving.api import fusionserve_pb2 as pb
    from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc

    served = shared_server
    replica = next(p for p in descendants(served.proc.pid) if b"ServeReplica" in Path(f"/proc/{p}/cmdline").read_bytes())
    environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{replica}/environ").read_bytes().split(b"\0") if b"=" in kv)
    first, last = (
        int(environ[k]) for k in (b"RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", b"RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT")
    )
    listening = [c.laddr for c in psutil.Process(replica).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    own_grpc = [a for a in listening if first <= a.port <= last]
    assert own_grpc and all(is_loopback(a.ip) for a in own_grpc), listening
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        answer = pb_grpc.ClassifierStub(channel).Classify(
            pb.ClassifyRequest(task="rte", inputs=[pb.Input(text="a fine film")]),
            metadata=(("application", "fusionserve"),),
            timeout=60,
        )
    assert len(answer.predictions) == 1
