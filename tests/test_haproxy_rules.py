"""The HAProxy wrapper (serving/process/haproxy_rules.py) always runs the real HAProxy, also in a process that starts a second
server after the first one's run folder (with its wrapper) was removed. No Ray here."""

from __future__ import annotations

import http.client
import shutil
import subprocess
import time

import grpc
import pytest

from fusionserve.serving.api.tracing import INGRESS_HEADER, INGRESS_KEY_FILE, ingress_instant, ingress_key
from fusionserve.serving.private import HAPROXY_BINARY_ENV as BINARY_ENV
from fusionserve.serving.process.haproxy_rules import real_haproxy, write_wrapper
from tests.serving_helpers import free_port


def test_a_removed_wrapper_of_an_earlier_server_is_not_taken_for_the_binary(tmp_path, monkeypatch):
    """ingress_env sets RAY_SERVE_HAPROXY_BINARY_PATH to its wrapper in this process's environment; once that server
    stopped and its run folder was removed, the next server's wrapper ran the removed file ('setpriv: failed to
    execute .../haproxy: No such file or directory'), and no HAProxy started."""
    monkeypatch.delenv(BINARY_ENV, raising=False)
    binary = real_haproxy()
    if binary is None:
        pytest.skip("no HAProxy on this machine")
    first = write_wrapper(tmp_path / "fs-first", [binary], 30.0)
    monkeypatch.setenv(BINARY_ENV, str(first))  # what the first server's ingress_env left in os.environ
    assert real_haproxy() == binary  # the wrapper is recognised while it exists
    shutil.rmtree(first.parent)
    assert real_haproxy() == binary


def test_a_binary_the_user_named_is_kept(tmp_path, monkeypatch):
    own = tmp_path / "my-haproxy"
    own.write_text("#!/bin/sh\nexit 0\n")
    own.chmod(0o755)
    monkeypatch.setenv(BINARY_ENV, str(own))
    assert real_haproxy() == str(own)


def test_haproxy_own_pages_bind_loopback_and_the_serving_ports_stay_as_asked(tmp_path):
    """Serve's template binds HAProxy's stats and Prometheus pages on every interface (`bind *:PORT`, `bind :PORT`);
    the wrapper binds those two on 127.0.0.1 (an explicit address: HAProxy takes its listeners over on a reload by
    their configured address, and one the loopback shim had moved did not match, which paused the HTTP frontend).
    The serving ports keep what `--host` asked for, `*` included."""
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "frontend prometheus\n    bind :28001\nfrontend http_frontend\n    bind *:8000\n"
        "frontend grpc_frontend\n    bind *:9000 proto h2\nlisten stats\n  bind *:28002\n"
    )
    wrapper = write_wrapper(tmp_path / "fs-run", ["true"], 30.0, private_ports=(28001, 28002))
    subprocess.run([str(wrapper), "-db", "-f", str(config)], check=True, timeout=30)
    binds = [line.strip() for line in config.read_text().splitlines() if line.strip().startswith("bind ")]
    assert binds == ["bind 127.0.0.1:28001", "bind *:8000", "bind *:9000 proto h2", "bind 127.0.0.1:28002"]


def test_haproxy_stamps_each_request_with_its_arrival_and_overwrites_a_forged_stamp(tmp_path):
    """Every request through HAProxy, HTTP/1.1 and HTTP/2 (gRPC's frontend), carries HAProxy's own arrival stamp
    (serving/api/tracing.py starts a trace's root span there) with the run's key; a client's header of that name,
    even one with the right key, is replaced, never passed on. Real HAProxy, whose frontends answer with the header
    they would hand a replica. Fails on the code before: no stamp."""
    binary = real_haproxy()
    if binary is None:
        pytest.skip("no HAProxy on this machine")
    http_port, h2_port = free_port(), free_port()
    seen = f"%[req.hdr_cnt({INGRESS_HEADER})] %[req.hdr({INGRESS_HEADER})]"  # what a replica would be handed
    run = tmp_path / "fs-run"
    run.mkdir()
    config = run / "haproxy.cfg"  # in the run folder, as ingress_env puts it
    config.write_text(
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 5s\n    timeout server 5s\n"
        f"frontend http_frontend\n    bind 127.0.0.1:{http_port}\n"
        f'    http-request return status 200 content-type text/plain lf-string "{seen}"\n'
        f"frontend grpc_frontend\n    bind 127.0.0.1:{h2_port} proto h2\n"  # a gRPC refusal telling it
        f'    http-request return status 200 content-type application/grpc hdr grpc-status 5 hdr grpc-message "{seen}"\n'
    )
    wrapper = write_wrapper(run, [binary], 30.0)
    key = ingress_key(str(config))
    assert key is not None and len(key) == 32 and (run / INGRESS_KEY_FILE).stat().st_mode & 0o077 == 0
    proc = subprocess.Popen([str(wrapper), "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        forged = f"t={(time.time_ns() // 1000) - 10_000_000} r=0 k={key}"  # ten seconds early, with the right key
        for port, http2 in ((http_port, False), (h2_port, True)):
            before = time.time_ns() // 1000
            count, stamp = _ask(port, forged, http2).split(" ", 1)
            after = time.time_ns() // 1000
            assert count == "1" and stamp != forged, stamp
            assert before <= int(stamp.split()[0][2:]) <= after, (before, stamp, after)  # HAProxy's own instant
            now_s, now_ns = time.perf_counter(), time.time_ns()
            start = ingress_instant(stamp, key, now_s, now_ns)
            assert start is not None and now_s - start <= (now_ns // 1000 - before) / 1e6 + 0.002, stamp
            assert ingress_instant(stamp, "0" * 32, now_s, now_ns) is None  # another key: not believed
    finally:
        proc.kill()
        proc.wait(10)


def _ask(port: int, forged: str, http2: bool) -> str:
    """One call through HAProxy on 127.0.0.1:``port`` with a forged stamp, over HTTP/1.1 (the answer's body) or gRPC
    (its status message), retried while HAProxy starts."""
    deadline = time.monotonic() + 30
    while True:
        try:
            if not http2:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("POST", "/x", b"{}", {INGRESS_HEADER: forged})
                return conn.getresponse().read().decode()
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    channel.unary_unary("/x.Y/Z")(b"", metadata=((INGRESS_HEADER, forged),), timeout=10)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        return exc.details()
                    raise OSError(exc.details()) from None
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_stamp_is_believed_only_whole_with_the_key_and_not_in_the_future_or_an_hour_old():
    key, now_s, now_ns = "ab" * 16, 1000.0, 1_800_000_000_000_000_000
    now_us = now_ns // 1000

    def at(stamp: str | None, with_key: str | None = key) -> float | None:
        start = ingress_instant(stamp, with_key, now_s, now_ns)
        return None if start is None else round(start - now_s, 6)

    assert at(f"t={now_us - 5000} r=0 k={key}") == -0.005
    assert at(f"t={now_us - 5000} r=2 k={key}") == -0.007  # the request's bytes took 2 ms to arrive before that
    assert at(f"t={now_us + 9000} r=0 k={key}") == 0.0  # a clock ahead (another node's): now
    assert at(f" t={now_us} r=-1 k={key} ") == 0.0
    for bad in (None, "", f"t={now_us} r=0 k={'cd' * 16}", f"t={now_us} r=0", f"t={now_us}", f"t=x r=0 k={key}",
                f"t={now_us} r=0 k={key}, t={now_us - 10**7} r=0 k={key}", f"t={now_us - 3_601_000_000} r=0 k={key}"):  # fmt: skip
        assert at(bad) is None, bad
    assert at(f"t={now_us} r=0 k={key}", None) is None  # no key here (no HAProxy of fusionserve's): nothing believed
