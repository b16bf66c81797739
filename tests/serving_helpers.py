"""Shared by the end-to-end serving tests: a real `fusionserve serve` on 127.0.0.1 in its own process, HTTP calls to
it, and the processes it started (to check that stopping it leaves none)."""

import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusionserve.serving.process import loopback
from fusionserve.serving.process.ports import free_port


def mutations(good: bytes, count: int, most_edits: int, seed: int = 0) -> list[bytes]:
    """``count`` copies of ``good``, each with 1 to ``most_edits`` random byte edits (a byte changed, inserted or
    deleted): the fuzz corpora of the HTTP and gRPC hardening tests, the same for a seed on every run."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        b = bytearray(good)
        for _ in range(rng.randint(1, most_edits)):
            op, i = rng.random(), rng.randrange(len(b))
            if op < 0.4:
                b[i] = rng.randrange(256)
            elif op < 0.7:
                b.insert(i, rng.randrange(256))
            else:
                del b[i]
        out.append(bytes(b))
    return out


def call(
    url: str, body: object = None, raw: bytes | None = None, timeout: float = 30, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    head = ({"content-type": "application/json"} if data else {}) | (headers or {})
    req = urllib.request.Request(url, data=data, headers=head)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, answer_body(err.read())


def answer_body(text: bytes) -> dict:
    """An answer's body: its JSON object, or ``{"raw": text}`` where it is not one (HAProxy's or Serve's own pages)."""
    return json.loads(text) if text.startswith(b"{") else {"raw": text.decode()}


@dataclass
class Served:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path
    grpc_port: int | None = None  # set by SharedServers when it turns gRPC on


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


MARK_ENV = "FUSIONSERVE_TEST_MARK"  # set on a server's environment: every process it starts inherits it


def new_mark() -> str:
    return f"fusionserve-test-{os.getpid()}-{time.monotonic_ns()}"


def carrying(mark: str) -> dict[int, str]:
    """The live processes whose environment has ``MARK_ENV=mark`` (pid -> the start of its command line). A process
    that retitles itself past its argument area may blank its environment (Ray's agents do in the image, where the
    paths are short; not with this repository's venv paths)."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{MARK_ENV}={mark}".encode() in environ.read_bytes().split(b"\0"):
                found[int(environ.parent.name)] = (environ.parent / "cmdline").read_bytes()[:100].decode(errors="replace")
        except OSError:  # gone, or not ours to read (a zombie's environment reads as empty)
            continue
    return found


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "gone"


def launch(
    artifact: Path,
    log: Path,
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
    own_group: bool = False,
) -> Served:
    """Start `fusionserve serve` (on ``port``, default a free one; with ``env``, default this process's; with
    ``own_group``, as the leader of a process group of its own, so that a test can signal the group as an operator
    does) and wait (up to 240 s) until it says it is serving."""
    port = port or free_port()
    env = dict(env or os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(port), *args]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=own_group)
    deadline = time.time() + 240
    while not _says_serving(log.read_text()):
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"server not serving in 240 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return Served(f"http://127.0.0.1:{port}", port, proc, log)


def _says_serving(text: str) -> bool:
    """The server's line that it serves, as text or (``--log-format json``) as a JSON object."""
    return "fusionserve: serving" in text or '"message": "serving ' in text


def stop(served: Served, sig: int = signal.SIGINT) -> None:
    if served.proc.poll() is None:
        served.proc.send_signal(sig)
        try:
            served.proc.wait(60)
        except subprocess.TimeoutExpired:
            served.proc.kill()


@contextmanager
def serving(artifact: Path, log: Path, *args: str, **kwargs) -> Iterator[Served]:
    """``launch(artifact, log, *args, **kwargs)``, stopped (SIGINT) at the end unless a test stopped it."""
    served = launch(artifact, log, *args, **kwargs)
    try:
        yield served
    finally:
        stop(served)


SHARED_BODY_TIMEOUT_S = 2  # the shared server's --body-timeout-s: a stalled body is answered 408 this soon
SHARED_ARGS = ("--body-timeout-s", str(SHARED_BODY_TIMEOUT_S), "--threads", "1")  # and gRPC on (conftest.shared_server)

# conftest.keyed_server, for test_serving_api and test_serving_e2e: two accepted API keys (rotation), a default task,
# gRPC, tight limits, and a 1 s batch wait with batches of 4 (a request of fewer than 4 inputs reaching an idle model
# is still queued 1 s after it arrived: what lets a 50 ms deadline pass, or a client hang up, while it waits).
KEY = "k-" + os.urandom(12).hex()  # 26 characters, fresh for every run: any trace of it in a log is the tests'
OTHER_KEY = "k2-" + os.urandom(8).hex()  # the second accepted key
KEYED_MAX_INPUTS, KEYED_MAX_BODY, KEYED_MAX_BATCH = 8, 4096, 4
KEYED_ARGS = ("--api-key", f"{KEY}, {OTHER_KEY}", "--default-task", "rte", "--threads", "1",
              "--max-inputs", str(KEYED_MAX_INPUTS), "--max-body-bytes", str(KEYED_MAX_BODY),
              "--max-batch-size", str(KEYED_MAX_BATCH), "--batch-wait-ms", "1000", "--max-ongoing", "4",
              "--max-queued", "4")  # fmt: skip

# conftest.oip_server, for test_open_inference, test_openapi_description and test_tracing_server: the key from
# FUSIONSERVE_API_KEY, gRPC, --log-format json, small limits, a 300 ms batch wait with batches of 8 (a lone request
# waits that long for company: deadlines and mixed batches testable on any machine), and every request traced to
# conftest.otlp_receiver.
OIP_KEY = "k-" + os.urandom(10).hex()
OIP_MAX_INPUTS, OIP_MAX_BODY, OIP_MAX_BATCH = 8, 8192, 8
OIP_ARGS = ("--threads", "1", "--max-inputs", str(OIP_MAX_INPUTS), "--max-body-bytes", str(OIP_MAX_BODY),
            "--batch-wait-ms", "300", "--max-batch-size", str(OIP_MAX_BATCH), "--log-format", "json")  # fmt: skip


class SharedServers:
    """The servers of the tests that only need a server, by name: each started at its first use and kept while the
    tests that use it run one after the other (conftest stops it after the last of them), so that the modules that
    share one start Ray once. A test that stops a shared server (the tests of stopping do) leaves it stopped; the next
    test that asks for it gets it started again. Stopped at the end."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.folder, self.env = folder, env
        self.running: dict[str, tuple[tuple[str, ...], Served]] = {}
        self.starts: dict[str, int] = {}
        self.failed: dict[str, str] = {}  # name -> why its start failed: the tests after it fail at once, not each in 240 s

    def get(self, name: str, artifact: Path, *args: str, grpc: bool = False, env: dict[str, str | None] | None = None) -> Served:
        """The running server ``name`` (``fusionserve serve artifact *args``, with ``--grpc-port`` on a free port if
        ``grpc``, in the shared environment changed by ``env``: a variable set, or removed where its value is None),
        started now if it is not running."""
        env = env or {}
        key = (str(artifact), *args, "--grpc" if grpc else "", *sorted(f"{k}={v}" for k, v in env.items()))
        if name in self.running:
            started_with, served = self.running[name]
            assert started_with == key, f"shared server {name!r} asked for with {key}, started with {started_with}"
            if served.proc.poll() is None:
                return served
        if name in self.failed:
            pytest.fail(f"shared server {name!r} did not start earlier in this session: {self.failed[name]}")
        self.starts[name] = self.starts.get(name, 0) + 1
        grpc_port = free_port() if grpc else None
        extra = ("--grpc-port", str(grpc_port)) if grpc_port else ()
        environ = {k: v for k, v in (self.env or os.environ).items() if k not in env} | {
            k: v for k, v in env.items() if v is not None
        }
        try:
            served = launch(artifact, self.folder / f"{name}-{self.starts[name]}.log", *args, *extra, env=environ)
        except pytest.fail.Exception as exc:
            self.failed[name] = str(exc)[:3000]
            raise
        served.grpc_port = grpc_port
        self.running[name] = (key, served)
        return served

    def stop(self, name: str) -> None:
        """Stop the server ``name`` if it runs (SIGINT); the next ``get`` starts it again."""
        if name in self.running:
            stop(self.running[name][1])

    def stop_all(self) -> None:
        for _, served in self.running.values():
            stop(served)


def haproxy_config(pid: int) -> Path:
    """The config file of the HAProxy that the server ``pid`` started: ``<its private folder>/<node id>/haproxy.cfg``
    (see serving/process/ingress.py)."""
    for child in descendants(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if Path(argv[0]).name == "haproxy" and "-f" in argv:
            return Path(argv[argv.index("-f") + 1])
    raise AssertionError(f"no HAProxy below pid {pid}")


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip)
    return address.is_loopback or (address.version == 6 and bool(address.ipv4_mapped and address.ipv4_mapped.is_loopback))


def listeners(pid: int) -> list[tuple[str, str, int]]:
    """Every listening TCP socket of ``pid`` and the processes below it: (process name, address, port)."""
    import psutil

    root = psutil.Process(pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name, conns = proc.name(), proc.net_connections(kind="inet")
        except psutil.Error:  # ended meanwhile
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def listeners_once_up(pid: int, ports: set[int], within_s: float = 30) -> list[tuple[str, str, int]]:
    """``listeners(pid)`` once every one of ``ports`` is among them (or after ``within_s``): while HAProxy reloads,
    its listeners pass from one process to the next, and a reading in between missed the serving port."""
    found, until = listeners(pid), time.monotonic() + within_s
    while not ports <= {port for _, _, port in found} and time.monotonic() < until:
        time.sleep(0.5)
        found = listeners(pid)
    return found


# --- loopback means loopback: tests/test_loopback.py (--host 127.0.0.1) and tests/test_bf16_serving.py (0.0.0.0) ------

needs_shim = pytest.mark.skipif(
    loopback.packaged() is None, reason="fusionserve was installed without its loopback shim (no C compiler then)"
)
TEXT = {"task": "rte", "inputs": ["a fine film"]}


def outside_ip() -> str:
    """An address of this machine that is not loopback (where another machine would reach it)."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    pytest.skip("this machine has no address outside loopback")


def classify_grpc(port: int, host: str = "127.0.0.1") -> int:
    import grpc

    from fusionserve.serving.api import fusionserve_pb2 as pb
    from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        answer = pb_grpc.ClassifierStub(channel).Classify(
            pb.ClassifyRequest(task="rte", inputs=[pb.Input(text="a fine film")]), timeout=60
        )
    return len(answer.predictions)


def only_the_serving_ports_beyond_loopback(served: Served, grpc_port: int, host: str) -> None:
    """``served`` (on ``host``: 127.0.0.1 or 0.0.0.0) answers HTTP and gRPC, and nothing of its process tree listens
    outside loopback but, on 0.0.0.0, its HTTP and gRPC ports, which then answer at the machine's own address."""
    assert call(served.url + "/v1/classify", TEXT)[0] == 200
    assert classify_grpc(grpc_port) == 1
    found = listeners_once_up(served.proc.pid, {served.port, grpc_port})
    outside = sorted({(name, ip, port) for name, ip, port in found if not is_loopback(ip)})
    allowed = set() if host == "127.0.0.1" else {served.port, grpc_port}
    assert {port for _, _, port in outside} == allowed, f"listening outside loopback: {outside}"
    assert len(found) > 10  # Ray's processes were seen (psutil read the whole tree)
    if allowed:
        ip = outside_ip()
        assert call(f"http://{ip}:{served.port}/v1/classify", TEXT)[0] == 200
        assert classify_grpc(grpc_port, ip) == 1
    assert "WARNING" not in Path(served.log).read_text()
