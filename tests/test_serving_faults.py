"""Faults a supervised server meets, sent as operators send them: signals to the whole process group (the server is
started as the leader of its own group, as a terminal, systemd or a container runtime starts it) while it starts and
while it serves. Nothing of a run may outlive it, a stop must end with exit 0. ``kill -9`` of the server and of its
whole group, each followed by a restart on the same port, and a group SIGTERM while serving: in the sequence of
tests/test_serving_faults_load.py, on its server (one start less each). A group SIGINT while serving: at the end of
the ``--host 0.0.0.0`` test, on the server of tests/test_bf16_serving.py (one start less). Each test ends only the
processes it started (by pid, found by the mark in their environment)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fault_helpers import STOP_S, kill_all, within
from tests.serving_helpers import carrying, descendants, free_port, is_loopback

pytestmark = pytest.mark.slow

TEXT = {"task": "rte", "inputs": ["a fine film"]}


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
        code = proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {STOP_S} s after a group {sig.name}:\n{log.read_text()[-2000:]}")
    exited_s = time.monotonic() - sent
    gone_s = within(lambda: not carrying(mark))
    print(f"\ngroup {sig.name} while starting: exit {code} after {exited_s:.1f} s, nothing left after {gone_s} s")
    assert code == 0, log.read_text()[-3000:]
    assert gone_s is not None, carrying(mark)


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


def test_a_kill_aimed_at_a_process_gone_since_kills_what_runs_now():
    """The fault tests find what they kill before their load starts; an HAProxy replaced by a reload meanwhile was
    gone at the kill (CI). kill_all then kills what ``again`` finds now, and says which it killed."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    now = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert kill_all([gone.pid], lambda: [now.pid]) == [now.pid]
        assert now.wait(30) == -signal.SIGKILL
        assert kill_all([gone.pid]) == []
    finally:
        if now.poll() is None:
            now.kill()
