"""A port the server drew for its own use (HAProxy's stats page, seen taken in a full suite run: "cannot bind socket
(Address already in use)") is taken by another process between the draw and the bind: the server starts again with
freshly drawn ports, says so in one line, and serves. The draw is forced here: a real server (``Server``, as a
program embeds it) whose first drawn port is one this test holds open.

The same embedded server checks that a server embedded in a program ends none of that program's other children, at
its stop or at the end of the failed first start (merged here from tests/test_process_cleanup.py, whose test of it
started a server of its own)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.serving_helpers import call, free_port

pytestmark = pytest.mark.slow

# the server, with its first draw in serving/process/ingress.py (HAProxy's stats port) forced to the held port
_SERVER = """
import subprocess, sys
from fusionserve.serving.process import ingress
from fusionserve.serving.process.server import Server, ServerConfig

real, forced = ingress.free_port, [int(sys.argv[3])]
ingress.free_port = lambda *a, **k: forced.pop() if forced else real(*a, **k)
other = subprocess.Popen(["sleep", "300"])  # the embedding program's own child
code = Server(ServerConfig(sys.argv[1], port=int(sys.argv[2]))).serve_forever()
print("other child:", "alive" if other.poll() is None else f"ended ({other.returncode})", flush=True)
other.kill()
sys.exit(code)
"""


def test_a_drawn_port_taken_before_it_is_bound_is_drawn_again_and_the_server_serves(artifact, tmp_path, marked):
    """Also: serve_forever in the caller's own process recorded every descendant of that process as the run's, and its
    stop ended them: a program embedding the server lost its other children."""
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(marked[1], HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        script = tmp_path / "server.py"
        script.write_text(_SERVER)
        with log.open("w") as fh:
            cmd = [sys.executable, str(script), str(artifact), str(port), str(taken)]
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while "fusionserve: serving" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            assert call(f"http://127.0.0.1:{port}/v1/classify", {"task": "rte", "inputs": ["a fine film"]})[0] == 200
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            code = proc.wait(120)
    text = log.read_text()
    said = [line for line in text.splitlines() if "starting again" in line]
    assert len(said) == 1, text[-3000:]
    assert f"port {taken}" in said[0] and f"pid {os.getpid()}" in said[0], said[0]
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "other child: alive" in text, text[-3000:]
    # the second start read the first node's admin socket, left in the run folder, half the time (node ids sort at
    # random) and waited 120 s for replicas that were routed (serving/process/routing.py)
    assert "replicas are routed after" not in text, text[-3000:]
