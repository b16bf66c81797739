"""End to end: the server's OpenAPI description as generators and fuzzers read it, on conftest's ``oip_server`` (a real
`fusionserve serve` on 127.0.0.1 with an API key and the Open Inference Protocol's routes; one group with
test_open_inference and test_tracing_server): every reference resolves, only served routes are described, a method a
route does not take is 405 with its Allow header, and schemathesis finds the API true to its description."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from tests.oip_helpers import request
from tests.serving_helpers import OIP_KEY as KEY

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("oip_server")]

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def described(oip_server) -> dict:
    with urllib.request.urlopen(oip_server.url + "/openapi.json", timeout=30) as resp:  # open, like the docs
        return json.loads(resp.read())


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_ref_resolves_and_only_served_routes_are_described(described):
    refs = set(_refs(described))
    assert refs and all(r.startswith("#/components/schemas/") for r in refs), sorted(refs)
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(described["components"]["schemas"])
    assert "PairInput" in described["components"]["schemas"]  # the pair input of /v1/classify, lost before
    assert "/predict" not in described["paths"] and "/" not in described["paths"]  # no --default-task: 404 there
    metrics = described["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [CONTENT_TYPE_LATEST]  # Prometheus text, as it answers
    for path, ops in described["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                if status[0] in "45":
                    assert list(response.get("content", {})) == ["application/json"], (path, method, status)


def _fill(path: str) -> str:
    return path.replace("{model}", "rte").replace("{version}", "1")


def test_a_method_a_route_does_not_take_is_405_with_its_allow_header(oip_server, described):
    checked = 0
    for path, ops in described["paths"].items():
        allowed = {m.upper() for m in ops}
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "QUERY"):
            if method in allowed:
                continue
            status, headers, body = request(oip_server.port, method, _fill(path), b"{}" if method != "GET" else None, AUTH)
            assert status == 405, (method, path, status, body)
            assert {m.strip() for m in headers["allow"].split(",")} == allowed, (method, path, headers)
            checked += 1
    assert checked > 50
    status, _, body = request(oip_server.port, "FOO", "/healthz")  # a method HTTP does not define: HAProxy's 501
    assert status == 501 and json.loads(body)["error"]["type"] == "not_implemented"


SCHEMATHESIS_CONFIG = """
[checks.negative_data_rejection]  # 413 is how a body over the limit is refused; a 5xx never counts
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]

[parameters]  # a served model at the version served: the routes behind a model name get real requests too
"path.model" = "rte"
"path.version" = "1"
"""


def test_the_api_holds_to_its_description_under_schemathesis(oip_server, tmp_path):
    """Every operation, generated requests (examples, boundaries, fuzzing, undeclared methods, sequences): no server
    error, every status, content type, header and body as described, schema-violating requests refused. Not checked:
    that every schema-valid request is accepted (positive_data_acceptance): what one request may hold depends on
    fields together (a shape and its data, the number of inputs and the server's --max-inputs), which a schema
    cannot say."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    st = Path(os.environ.get("VIRTUAL_ENV", "")) / "bin" / "schemathesis"
    st = st if st.exists() else Path(sys.executable).parent / "schemathesis"
    cmd = [str(st), "--config-file", str(config), "run", oip_server.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}", "--checks", "all",
           "--exclude-checks", "positive_data_acceptance", "--max-examples", "15", "--seed", "36", "--no-color"]  # fmt: skip
    # run in tmp_path: schemathesis keeps its cache (.schemathesis/) in the working directory, not in the checkout
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:]
    assert "passed" in done.stdout and " failed" not in done.stdout.split("SUMMARY")[-1], done.stdout[-3000:]
