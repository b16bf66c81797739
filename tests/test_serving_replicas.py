"""Two replicas behind the default ingress (HAProxy): concurrent load reaches both, and each answers correctly."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from fusionserve.export.artifact import export_artifact
from tests.adapterhub_models import SENTENCES

pytestmark = pytest.mark.slow


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read()), resp.headers.get("x-fusionserve-replica", "")


def test_two_replicas_both_serve(built_st, tmp_path):
    art = tmp_path / "art"
    export_artifact(built_st.spec, art, max_seq_len=32, progress=False)
    port = _free_port()
    log = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "fusionserve.cli.main",
        "serve",
        str(art),
        "--port",
        str(port),
        "--replicas",
        "2",
        "--threads",
        "1",
    ]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}/v1/classify"
    try:
        deadline = time.time() + 240
        while "serving" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        body = {"task": "rte", "inputs": [SENTENCES[0]]}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(url, body), range(80)))
        assert {status for status, _, _ in answers} == {200}
        replicas = {replica for _, _, replica in answers}
        assert len(replicas) == 2, replicas  # HAProxy spread the connections over both
        assert len({json.dumps(answer) for _, answer, _ in answers}) == 1  # and both answer alike
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
