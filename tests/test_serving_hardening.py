"""The server against hostile and broken input, and starting and stopping as a user sees it: every bad body is a
JSON 4xx (never a 500), a body that never completes is a 408, flags are strict, the docs work offline, a taken
port is refused before anything starts, and SIGTERM stops everything it started."""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fusionserve.serving.options import MAX_ERROR_CHARS
from tests.serving_helpers import (
    MARK_ENV,
    alive,
    call,
    carrying,
    descendants,
    free_port,
    haproxy_config,
    mutations,
    new_mark,
)

pytestmark = pytest.mark.slow

STOP_BOUND_S = 30  # SIGTERM to no process left (the target is 10 s; room for a loaded machine)


@pytest.fixture
def server(shared_server):
    """The server shared with other modules (conftest.py): its body timeout (SHARED_BODY_TIMEOUT_S, 2 s) is what the
    408 tests meet; test_sigterm_stops_every_process_it_started_and_exits_0 stops it, last of all its tests."""
    return shared_server


def _raw(port: int, request: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    (int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")), None
                )
                if length is not None and len(body) >= length:
                    break
        except TimeoutError:
            pass
    return data


def _post(port: int, body: bytes) -> tuple[int, dict | None]:
    head = f"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    answer = _raw(port, head.encode() + body)
    status = int(answer.split(b" ", 2)[1])
    payload = answer.partition(b"\r\n\r\n")[2]
    return status, json.loads(payload) if payload.startswith(b"{") else None


def test_deep_nesting_and_huge_numbers_are_malformed_json_not_500(server):
    cases = {
        "10k deep": b"[" * 10_000 + b"]" * 10_000,
        "100k deep": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        "5000 digits": b'{"task": "rte", "inputs": [' + b"9" * 5000 + b"]}",
    }
    for what, body in cases.items():
        status, answer = _post(server.port, body)
        assert status == 422 and answer["error"]["type"] == "malformed_json", (what, status, answer)
        assert ("recursion" if "deep" in what else "number") in answer["error"]["message"], answer


def _corpus() -> list[bytes]:
    good = json.dumps({"task": "rte", "inputs": ["a fine film", {"text": "a cat", "text_pair": "a dog"}]}).encode()
    fixed = [
        b"", b"null", b"[]", b"{}", b"1", b'"text"', b"true", b"\x00", b'{"task": "rte", "inputs": ["a\\u0000b"]}',
        b'{"task": "rte", "inputs": ["a\x00b"]}', b'{"task": "rte", "inputs": ["\xc0\xaf"]}', b"\xef\xbb\xbf" + good,
        b'{"task": "rte", "inputs": ["\\ud800"]}', b'{"task": "rte", "inputs": ["\\udc00x"]}', b'{"task": "rte", "inputs": ["\\ud83d\\ude00"]}',
        b'{"task": 5, "inputs": ["a"]}', b'{"task": "rte", "inputs": {"text": "a"}}', b'{"task": "rte", "inputs": [["a"]]}',
        b'{"task": "rte", "inputs": [{"text": "a", "text_pair": 3}]}', b'{"task": "rte", "inputs": ["a"], "strict": null}',
        b'{"task": "rte", "inputs": ["' + "\u202e\u0301\U0001f600".encode() * 50 + b'"]}', b'{"task": "rte", "inputs": ["' + b"a" * 3000 + b'"]}',
        b'{"task": "rte", "inputs": [1e999]}', b'{"task": "rte", "inputs": [-0.0, NaN]}', b'{"task": "' + b"x" * 3000 + b'", "inputs": ["a"]}',
        b'{"task": "rte", "task": "nli", "inputs": ["a"]}', b'{"task": "rte", "inputs": ["a"]} trailing', good[:-1], good + b"}",
        # issue 30: texts of only control or zero-width characters, long and many task names, a text far over the
        # token limit (cut before tokenizing), strict on it
        b'{"task": "rte", "inputs": ["\\u200b\\u200d\\ufeff"]}', b'{"task": "rte", "inputs": ["\x01\x02\\u0000"]}',
        b'{"task": "' + b"y" * 16_500 + b'", "inputs": ["a"]}', json.dumps({"tasks": ["n" * 100 + str(i) for i in range(300)], "inputs": ["a"]}).encode(),
        b'{"task": "rte", "inputs": ["' + b"word " * 180_000 + b'"]}', b'{"task": "rte", "strict": true, "inputs": ["' + b"w " * 400_000 + b'"]}',
    ]  # fmt: skip
    return fixed + mutations(good, 150, 6)


def test_fuzzed_bodies_never_get_a_500_and_the_server_keeps_serving(server):
    seen = set()
    for body in _corpus():
        status, answer = _post(server.port, body)
        seen.add(status)
        assert status in (200, 404, 413, 422), (status, body[:80], answer)
        if status != 200:
            assert set(answer) == {"error"} and set(answer["error"]) == {"type", "message"}, answer
            assert len(answer["error"]["message"]) <= MAX_ERROR_CHARS, answer
    assert {200, 422} <= seen
    big = b'{"task": "rte", "inputs": ["' + b"x" * 10_000_000 + b'"]}'  # 10 MB: refused by its Content-Length (limit 1 MB)
    status, answer = _post(server.port, big)
    assert status == 413 and answer["error"]["type"] == "body_too_large"
    assert call(server.url + "/v1/classify", {"task": "rte", "inputs": ["still here"]})[0] == 200


def test_a_body_shorter_than_its_content_length_gets_408_and_the_server_goes_on(server):
    started = time.time()
    answer = _raw(
        server.port,
        b'POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"task": ',
    )
    waited = time.time() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"body_timeout"' in answer
    assert waited < 30  # answered, not held until the client gives up
    assert call(server.url + "/v1/classify", {"task": "rte", "inputs": ["after a slow client"]})[0] == 200


def test_after_a_408_the_connection_is_closed(server):
    """Through HAProxy the replica's 408 lost its `connection: close`: the client's connection stayed open, HAProxy
    still waiting for the rest of the body, and a request sent on it hung. HAProxy now answers the 408 itself (JSON,
    serving/process/haproxy_rules.py) and closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as s:
        s.sendall(b'POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"ta')
        answer = b""
        while b"}}" not in answer:
            chunk = s.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answer, answer
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            after = s.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            after = b""
        assert after == b""  # closed, not a request read as the rest of the body


def test_a_method_http_does_not_define_gets_a_json_501(server):
    """uvicorn answered an unknown method with a plain-text 400; HAProxy answers it (RFC 9110: 501, the server does
    not know the method; a 405 would owe an Allow header of the path's methods)."""
    answer = _raw(server.port, b"FOO /healthz HTTP/1.1\r\nHost: x\r\n\r\n", timeout=15)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501") and json.loads(body)["error"]["type"] == "not_implemented", answer


@pytest.mark.parametrize("flag", ["strict", "return_fusion_activations"])
@pytest.mark.parametrize("value", ["yes", 1, 0, "true", None])
def test_flags_must_be_true_or_false(server, flag, value):
    status, answer = call(server.url + "/v1/classify", {"task": "rte", "inputs": ["a"], flag: value})
    assert status == 422 and answer["error"]["type"] == "invalid_request" and flag in answer["error"]["message"], answer


def test_a_lone_surrogate_is_named_as_such(server):
    status, answer = call(server.url + "/v1/classify", raw=b'{"task": "rte", "inputs": ["\\ud800"]}')
    assert status == 422 and answer["error"]["type"] == "malformed_json"
    assert "lone UTF-16 surrogate" in answer["error"]["message"] and "hex escape" not in answer["error"]["message"]


def test_unknown_paths_and_methods_get_the_error_shape(server):
    assert call(server.url + "/v2/classify", {"task": "rte"}) == (
        404, {"error": {"type": "not_found", "message": "POST /v2/classify: Not Found"}}
    )  # fmt: skip
    status, answer = call(server.url + "/v1/classify")
    assert status == 405 and answer["error"]["type"] == "method_not_allowed"


def test_the_docs_load_nothing_from_outside(server):
    with urllib.request.urlopen(server.url + "/docs", timeout=10) as resp:
        html = resp.read().decode()
    assets = [a for a in ("/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css") if a in html]
    assert len(assets) == 2 and "cdn" not in html.lower() and "https://" not in html.replace("https://fastapi", "")
    for asset in assets:
        with urllib.request.urlopen(server.url + asset, timeout=10) as resp:
            assert resp.status == 200 and len(resp.read()) > 10_000


def test_a_second_server_on_a_taken_port_is_refused_before_anything_starts(server, artifact):
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(server.port)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert f"port {server.port} on 127.0.0.1 is already in use by pid" in done.stderr and "haproxy" in done.stderr
    assert "starting Ray" not in done.stderr


def test_start_up_says_one_line_per_step_and_nothing_else(server):
    """Until it serves, the server prints only its own steps ("fusionserve: ..."): no Ray or Serve notice."""
    lines = server.log.read_text().splitlines()
    serving = next(i for i, line in enumerate(lines) if line.startswith("fusionserve: serving "))
    assert serving >= 2 and all(line.startswith("fusionserve: ") for line in lines[:serving]), lines[: serving + 1]


def test_the_server_runs_where_torch_cannot_be_imported(server):
    """`serve` imports no torch: the shared server runs with a sitecustomize that refuses torch, transformers and
    adapters in every Python process (conftest.shared_servers), and none of its processes has torch's library
    mapped. Before the last test here, which stops it."""
    tree = [server.proc.pid, *descendants(server.proc.pid)]
    replica = next(p for p in tree if b"ServeReplica" in Path(f"/proc/{p}/cmdline").read_bytes())
    environ = Path(f"/proc/{replica}/environ").read_bytes().split(b"\0")
    paths = next(v for v in environ if v.startswith(b"PYTHONPATH=")).split(b"=", 1)[1].split(b":")
    assert "_BLOCKED = ('torch'" in (Path(paths[0].decode()) / "sitecustomize.py").read_text()
    mapped = {p for p in tree if _maps_torch(p)}
    assert not mapped, [Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in mapped]
    assert call(server.url + "/v1/classify", {"task": "rte", "inputs": ["no torch here"]})[0] == 200


def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # ended meanwhile
        return False


@pytest.mark.stops_shared_server
def test_sigterm_stops_every_process_it_started_and_exits_0(server):
    """The issue's target is 10 s (once measured at 45 s); the bound asserted is 30 s, room for a loaded CI machine,
    and the time taken is printed."""
    before = descendants(server.proc.pid)
    assert len(before) >= 4  # Ray's processes, the replica, HAProxy
    config = haproxy_config(server.proc.pid)
    # HAProxy's files, its metrics socket included, are in the server's own folder (Serve's default for that socket
    # is /tmp/haproxy-serve/<node id>/, shared and never removed), and go with it
    assert not (Path("/tmp/haproxy-serve") / config.parent.name).exists()
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {STOP_BOUND_S} s after SIGTERM:\n{server.log.read_text()[-2000:]}")
    exited_s = time.monotonic() - sent
    assert code == 0, server.log.read_text()[-2000:]
    while alive(before) and time.monotonic() - sent < STOP_BOUND_S:
        time.sleep(0.1)
    gone_s = time.monotonic() - sent
    print(f"\nSIGTERM: exited 0 after {exited_s:.1f} s, every process it started gone after {gone_s:.1f} s")
    assert not alive(before), [Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in alive(before)]
    # nor one started after `before` was taken: a HAProxy reloaded during the shutdown names the same folder
    assert not _command_lines_naming(config.parent.parent)
    text = server.log.read_text()
    assert "fusionserve: shutting down" in text and "SIGTERM received" not in text and "Traceback" not in text
    assert "failed" not in text.lower(), text
    assert not config.parent.parent.exists()


def test_sigterm_while_starting_stops_everything_it_started(artifact, tmp_path):
    """SIGTERM after Ray started but before 'serving' (a container stopped early; the image test and
    benchmarks.image_start stop the server at its first /readyz 200, which can come before that line) went to Ray's
    own handler: a crash report, exit by the signal, no clean-up, so HAProxy and some of Ray's processes outlived the
    server. It is an interruption while starting, as Ctrl-C is."""
    mark = new_mark()
    log = tmp_path / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", **{MARK_ENV: mark})
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(free_port())]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "fusionserve: deploying" not in log.read_text():  # Ray runs; Serve and the replica are on their way
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(STOP_BOUND_S)
        while carrying(mark) and time.monotonic() - sent < STOP_BOUND_S:
            time.sleep(0.1)
        left = carrying(mark)
    finally:
        for pid in carrying(mark):
            os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0 and "SIGTERM received" not in text, text[-3000:]
    assert "fusionserve: interrupted while starting; shutting down" in text, text[-3000:]
    assert not left, left


def test_an_interruption_caught_while_starting_still_exits_0():
    """The start-up interruption above exited by SIGINT (-2) about one time in five under load, after a clean
    shutdown and with no traceback: CPython marks a KeyboardInterrupt that leaves code run by exec() as unhandled
    even when it is caught later, and then ends the process by SIGINT. Start-up runs such code (dataclasses and
    namedtuple build their methods with exec and eval) while the signal lands; here it lands there every time."""
    code = (
        "import os, signal, threading\n"
        "from fusionserve.serving.process import server\n"
        "server._on_signals(server._interrupt)\n"
        "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "try:\n"
        "    exec('while True: pass')\n"
        "except KeyboardInterrupt as exc:\n"
        "    print('interrupted by', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "interrupted by SIGTERM\n"), done.stderr[-2000:]


def _command_lines_naming(folder: Path) -> dict[int, str]:
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{folder}/" in text:
            found[int(cmdline.parent.name)] = text[:120]
    return found


def test_haproxy_fits_the_open_file_limit_it_gets(tmp_path):
    """HAProxy asks for ~10,300 descriptors for Serve's 4096 connections and, under a 1024 limit (a common default,
    and what `buildah run` gives), did not start at all ("Cannot raise FD limit"). The soft limit is raised to the
    hard one; when even that is short, HAProxy's connection limit is lowered to fit."""
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])));"
        "from pathlib import Path; from fusionserve.serving.process.ingress import ingress_env;"
        "env = ingress_env('haproxy', Path(sys.argv[3]));"
        "print(env.get('RAY_SERVE_HAPROXY_MAXCONN'), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )

    def run(soft, hard):
        return subprocess.run(
            [sys.executable, "-c", code, str(soft), str(hard), str(tmp_path / f"{soft}-{hard}")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert run(1024, 1024) == ["307", "1024"]  # (1024 - 256) / 2.5: fits, and HAProxy starts
    if hard == resource.RLIM_INFINITY or hard >= 10_500:
        assert run(1024, 10_500) == ["None", "10500"]  # raised to the hard limit: Serve's default stands


def test_each_server_has_its_own_fallback_proxy_ports(tmp_path):
    """With HAProxy, Serve also starts a fallback proxy (HAProxy's backup server when no replica is up) on 8500 / 9500
    unless told otherwise, bound with port reuse: two servers on one machine both listened on 127.0.0.1:8500 (seen with
    ss), so one server's HAProxy could hand requests to the other server's model. Each server gets free ports of its own."""
    from fusionserve.serving.process.ingress import ingress_env
    from fusionserve.serving.process.ports import port_holder

    first, second = ingress_env("haproxy", tmp_path / "first"), ingress_env("haproxy", tmp_path / "second")
    for key in ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"):
        assert first[key] != second[key]
        assert port_holder("127.0.0.1", int(first[key])) is None
    assert "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT" not in ingress_env("proxy")  # Serve's proxy ingress has no fallback


def test_each_server_has_its_own_replica_grpc_ports(tmp_path):
    """Serve binds the replicas' gRPC ports with port reuse on (its option to turn it off is a string gRPC ignores):
    with Serve's one default range, the first replica of every server on a machine listened on *:40000 (seen with ss:
    three servers' replicas on one port), and gRPC calls through one server's HAProxy reached the others' models (a
    call got another server's size limit). Each server's replicas take their gRPC ports from a free range of its own."""
    from fusionserve.serving.process.ingress import ingress_env
    from fusionserve.serving.process.ports import port_holder

    first, second = ingress_env("haproxy", tmp_path / "first"), ingress_env("haproxy", tmp_path / "second")
    low, high = (int(first[f"RAY_SERVE_DIRECT_INGRESS_{e}_GRPC_PORT"]) for e in ("MIN", "MAX"))
    assert low != int(second["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"]) and low < high <= 65535
    assert port_holder("127.0.0.1", low) is None


def test_free_port_never_hands_out_one_port_twice_in_a_process(tmp_path):
    """Ports are drawn at random and stay free until their user binds them: two draws for one `ray start` once gave
    two of its components the same port ("Ray component metrics_export is trying to use a port number 29665 that is
    used by other components"), and a server's other ports may not fall in its replicas' gRPC range either."""
    code = (
        "import json, sys; from pathlib import Path; from fusionserve.serving.process.ingress import ingress_env; from fusionserve.serving.process.ports import free_port;"
        "env = ingress_env('haproxy', Path(sys.argv[1]));"
        "print(json.dumps({'env': env, 'ports': [free_port() for _ in range(1500)]}))"
    )  # a process of its own: 1500 ports handed out here would be 1500 fewer for the other tests of this one
    out = json.loads(
        subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True).stdout
    )
    env, ports = out["env"], out["ports"]
    low, high = (int(env[f"RAY_SERVE_DIRECT_INGRESS_{e}_GRPC_PORT"]) for e in ("MIN", "MAX"))
    ours = [int(v) for k, v in env.items() if k.endswith("_PORT") and "DIRECT_INGRESS" not in k] + ports
    assert len(set(ours)) == len(ours), sorted(p for p in set(ours) if ours.count(p) > 1)[:10]
    assert not [p for p in ours if low <= p <= high]
