"""The HAProxy wrapper (serving/process/haproxy_rules.py) always runs the real HAProxy, also in a process that starts a second
server after the first one's run folder (with its wrapper) was removed. No Ray here."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from fusionserve.serving.private import HAPROXY_BINARY_ENV as BINARY_ENV
from fusionserve.serving.process.haproxy_rules import real_haproxy, write_wrapper


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
