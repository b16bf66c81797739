"""Two replicas behind the default ingress (HAProxy): `serve` says it is serving only once HAProxy routes to both,
concurrent load then reaches both, and each answers correctly."""

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from fusionserve.serving.process.routing import routed_replicas
from fusionserve.serving.process.server import APP_NAME
from tests.adapterhub_models import SENTENCES
from tests.serving_helpers import haproxy_config, serving

pytestmark = pytest.mark.slow


def _post(url: str, body: dict) -> tuple[int, dict, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read()), resp.headers.get("x-fusionserve-replica", "")


def test_two_replicas_both_serve(artifact, tmp_path):
    with serving(artifact, tmp_path / "server.log", "--replicas", "2", "--threads", "1") as served:
        # said before the wait for HAProxy existed: the second replica joined 0.5-2 s after "serving", and under load
        # (CI) every request of the burst below went to the first
        assert routed_replicas(haproxy_config(served.proc.pid).parent.parent, APP_NAME) == 2
        body = {"task": "rte", "inputs": [SENTENCES[0]]}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(f"{served.url}/v1/classify", body), range(80)))
        assert {status for status, _, _ in answers} == {200}
        replicas = {replica for _, _, replica in answers}
        assert len(replicas) == 2, replicas  # HAProxy spread the connections over both
        assert len({json.dumps(answer) for _, answer, _ in answers}) == 1  # and both answer alike
