"""Loopback means loopback (serving/process/loopback.py, issue 29): `fusionserve serve --host 127.0.0.1` has no listening
socket outside loopback anywhere in its process tree (the supervisor, the server with its Ray driver, Ray's GCS,
raylet, agents and workers, Serve's replicas, HAProxy); with `--host 0.0.0.0` only the serving ports are on every
interface. Before, 18 listeners of such a server were on every interface (or on the machine's address). The shim
itself is checked first, without Ray. The `--host 0.0.0.0` server is tests/test_bf16_serving.py's, and its test is
there (moved from here: it started a server of its own for nothing else); the checks of a server are
tests/serving_helpers.only_the_serving_ports_beyond_loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fusionserve.serving.process import loopback
from fusionserve.serving.process.server import ServerConfig
from tests.serving_helpers import free_port, needs_shim, only_the_serving_ports_beyond_loopback

# binds each socket the way a server does and prints what the kernel bound (getsockname: the shim does not lie)
_BINDS = """
import json, socket, sys
open_port = int(sys.argv[1])
def bound(family, address, kind=socket.SOCK_STREAM, v6only=None):
    s = socket.socket(family, kind)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind(address)
    keep.append(s)
    return s.getsockname()[0]
keep = []
out = {"v4": bound(socket.AF_INET, ("0.0.0.0", 0)), "v6_dual": bound(socket.AF_INET6, ("::", 0), v6only=0),
       "v6_only": bound(socket.AF_INET6, ("::", 0), v6only=1),
       "udp": bound(socket.AF_INET, ("0.0.0.0", 0), socket.SOCK_DGRAM),
       "open_port": bound(socket.AF_INET, ("0.0.0.0", open_port)), "explicit": bound(socket.AF_INET, ("127.0.0.1", 0))}
taken = socket.socket()
try:
    taken.bind(("0.0.0.0", keep[0].getsockname()[1]))
except OSError as exc:
    out["errno_in_use"] = exc.errno
print(json.dumps(out))
"""


@needs_shim
def test_the_shim_moves_wildcard_tcp_binds_to_loopback_and_nothing_else(tmp_path):
    """A TCP bind to 0.0.0.0 lands on 127.0.0.1, to :: on ::ffff:127.0.0.1 (dual-stack: IPv4 clients still reach it)
    or ::1 (IPv6 only); UDP, explicit addresses and an open port keep what they asked for; a failing bind keeps its
    errno. Without the shim every one of them is on every interface."""
    library = loopback.packaged()  # built with the package (pyproject.toml: ext-modules)
    assert library is not None and loopback.find_shim() == loopback.Shim(library)
    port = free_port("0.0.0.0")
    code = [sys.executable, "-c", _BINDS, str(port)]
    plain = json.loads(subprocess.run(code, capture_output=True, text=True, check=True, timeout=60).stdout)
    env = loopback.preload_env(library, [port])
    shimmed = json.loads(subprocess.run(code, capture_output=True, text=True, check=True, timeout=60, env=env).stdout)
    assert plain == {"v4": "0.0.0.0", "v6_dual": "::", "v6_only": "::", "udp": "0.0.0.0", "open_port": "0.0.0.0",
                     "explicit": "127.0.0.1", "errno_in_use": 98}  # fmt: skip
    assert shimmed == {"v4": "127.0.0.1", "v6_dual": "::ffff:127.0.0.1", "v6_only": "::1", "udp": "0.0.0.0",
                       "open_port": "0.0.0.0", "explicit": "127.0.0.1", "errno_in_use": 98}  # fmt: skip


def test_without_the_shim_the_server_is_told_what_stays_open(tmp_path, monkeypatch):
    """Installed where no C compiler was (the shim was not built) and no other build named: no error, one warning that
    names what stays on every interface and the two ways out; a named build that is not there is named as such."""
    monkeypatch.setattr(loopback, "packaged", lambda: None)
    monkeypatch.delenv("FUSIONSERVE_LOOPBACK_SHIM", raising=False)
    shim = loopback.find_shim()
    assert shim.library is None and shim.problem is not None and "without its loopback shim" in shim.problem
    line = loopback.fallback_warning(shim.problem)
    assert line.startswith("WARNING: fusionserve was installed without its loopback shim") and "\n" not in line
    assert all(word in line for word in ("GCS, raylet", "every interface", "C compiler", "FUSIONSERVE_LOOPBACK_SHIM"))
    monkeypatch.setenv("FUSIONSERVE_LOOPBACK_SHIM", str(tmp_path / "missing.so"))
    assert loopback.find_shim() == loopback.Shim(None, f"FUSIONSERVE_LOOPBACK_SHIM={tmp_path / 'missing.so'}: no such file")


def test_the_server_options_survive_the_handoff_to_the_server_process(tmp_path):
    """The supervisor hands the server process its options as JSON, and the shim's open ports."""
    cfg = ServerConfig(tmp_path, host="0.0.0.0", port=8123, grpc_port=9123, max_batch_size=8, min_replicas=1, max_replicas=2)
    again = ServerConfig(str(cfg.artifact), **json.loads(json.dumps(cfg.options())))
    assert again == cfg and again.app == cfg.app
    assert loopback.open_ports(cfg.host, (cfg.port, cfg.grpc_port), ("127.0.0.1",)) == [8123, 9123]
    assert loopback.open_ports("127.0.0.1", (8123, None), ("127.0.0.1",)) == []


# --- a real server ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_shim
def test_with_host_127_0_0_1_nothing_listens_beyond_loopback(shared_server):
    """With --host 127.0.0.1 (the default: the shared server of conftest.py) nothing of the server's process tree
    listens outside loopback, and it answers HTTP and gRPC."""
    only_the_serving_ports_beyond_loopback(shared_server, shared_server.grpc_port, "127.0.0.1")
