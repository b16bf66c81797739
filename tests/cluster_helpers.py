"""A Ray cluster of real nodes on this one machine, as Ray's own tests build one: ``ray start --head`` and
``ray start --address`` with their own resources, every port chosen free (other servers and other engineers' Ray
instances share the machine), each node with its own temp dir and its own HAProxy files and ports. Stopping a node
here is a crash: SIGKILL to every process of that node (never ``ray stop``, which stops every Ray on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fusionserve.serving.process.ingress import ingress_env
from fusionserve.serving.process.ports import free_port
from tests.serving_helpers import descendants

RAY = str(Path(sys.executable).with_name("ray"))
SERVE = str(Path(sys.executable).with_name("serve"))


@dataclass
class Node:
    name: str
    temp_dir: Path  # short, under /tmp: Ray's socket paths below it must stay under 107 characters
    env: dict[str, str]
    address: str = ""  # the cluster's GCS address (the head's)
    http_port: int = 0  # this node's HAProxy HTTP port
    grpc_port: int = 0
    patterns: list[str] = field(default_factory=list)  # strings in the command line of this node's processes


# Ray's token authentication, on for these clusters whatever this machine's ~/.ray holds: every node and every
# driver (serve run, fusionserve serve, the queries below) carries the same token
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _env(haproxy_dir: Path) -> dict[str, str]:
    return dict(os.environ, **ingress_env("haproxy", haproxy_dir), **AUTH, RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")


def _ray_start(node: Node, *args: str) -> None:
    ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]  # fmt: skip
    cmd = [RAY, "start", "--temp-dir", str(node.temp_dir), "--disable-usage-stats", *args]
    for flag in ports:
        cmd += [flag, str(free_port())]
    done = subprocess.run(cmd, env=node.env, capture_output=True, text=True, timeout=240, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ray start for the {node.name} node failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def start_head(cpus: int, http_port: int, grpc_port: int, env: dict[str, str] | None = None) -> Node:
    """The head node: the GCS, HAProxy on ``http_port`` / ``grpc_port`` (the ports Serve's config names); ``env``:
    more environment for the node (its workers, Serve's actors and replicas inherit it) and its drivers."""
    temp = Path(tempfile.mkdtemp(prefix="fsr-", dir="/tmp"))
    node_env = _env(temp / "haproxy") | (env or {})
    node = Node("head", temp, node_env, http_port=http_port, grpc_port=grpc_port, patterns=[str(temp)])
    port = free_port()
    node.address = f"{_node_ip()}:{port}"
    # no autoscaler monitor: these clusters have no autoscaler (their nodes are started here, by hand), and Serve's
    # autoscaling is Serve's controller's; fusionserve's own local Ray leaves it out too (serving/private.py lean_head)
    _ray_start(node, "--head", "--port", str(port), "--num-cpus", str(cpus), "--resources", json.dumps({"head": 1}),
               "--include-dashboard", "false", "--dashboard-port", str(free_port()),
               "--ray-client-server-port", str(free_port()), "--no-monitor")  # fmt: skip
    return node


def start_worker(head: Node, cpus: int) -> Node:
    """A worker node joining ``head``, with its own HAProxy ports (Serve's per-worker-node override)."""
    temp = Path(tempfile.mkdtemp(prefix="fsr-", dir="/tmp"))
    http, grpc_port = free_port(), free_port()
    env = _env(temp / "haproxy") | {
        "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(http),
        "RAY_SERVE_WORKER_PROXY_GRPC_PORT": str(grpc_port),
    }
    node = Node("worker", temp, env, head.address, http, grpc_port, [str(temp)])
    # no log monitor (`ray start --help`: one per physical host, and the head has this machine's): the output of
    # this node's workers stays in its log files, under temp_dir, and is not streamed to the drivers (no test reads it)
    _ray_start(node, "--address", head.address, "--num-cpus", str(cpus), "--resources", json.dumps({"worker": 1}),
               "--include-log-monitor", "false")  # fmt: skip
    return node


def processes(node: Node) -> set[int]:
    """Every process of ``node``: those naming its temp dir (raylet, GCS, agents, log monitor) or its HAProxy folder,
    and everything below them (workers, replicas, HAProxy)."""
    roots = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(p in cmdline for p in node.patterns):
            roots.add(int(entry.name))
    return roots.union(*(descendants(pid) for pid in roots)) if roots else set()


def kill(node: Node, remove: bool = False) -> int:
    """SIGKILL every process of ``node`` at once (a crashed machine); returns how many there were. ``remove``: also
    delete the node's temp dir (logs, sockets, runtime-env copies) once its processes are gone."""
    pids = processes(node)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and processes(node):
        time.sleep(0.2)
    if remove:
        shutil.rmtree(node.temp_dir, ignore_errors=True)
    return len(pids)


def ray_query(address: str, code: str, timeout: float = 120) -> object:
    """Run ``code`` (which sets ``out``) in a driver connected to the cluster; returns ``out`` (JSON)."""
    script = (
        "import json, ray\n"
        f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n"
        f"{code}\n"
        "print('RESULT=' + json.dumps(out))\n"
    )
    env = dict(os.environ, **AUTH, RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT=")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"query failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT="))


def replica_counts(address: str, app: str = "fusionserve") -> dict[str, int]:
    """Serve's replica states of the application's deployment, e.g. {'RUNNING': 2}."""
    code = (
        "from ray import serve\n"
        f"st = serve.status().applications[{app!r}]\n"
        "out = {k.value if hasattr(k, 'value') else str(k): v for d in st.deployments.values() for k, v in d.replica_states.items()}"
    )
    result = ray_query(address, code)
    assert isinstance(result, dict)
    return result


_WATCH = """
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
from ray import serve
while True:
    st = serve.status().applications.get(sys.argv[2])
    ds = st.deployments.values() if st is not None else ()
    out = {k.value if hasattr(k, "value") else str(k): v for d in ds for k, v in d.replica_states.items()}
    nodes = {n["NodeID"]: ("head" if "head" in n["Resources"] else "worker") for n in ray.nodes() if n["Alive"]}
    print("WATCH " + json.dumps({"replicas": out, "nodes": nodes}), flush=True)
    time.sleep(float(sys.argv[3]))
"""


class ReplicaWatch:
    """Serve's replica states of an application and the cluster's live nodes, read every ``interval_s`` by ONE
    driver connected for the watch's life (a ``replica_counts`` per poll starts a Python, imports Ray and joins the
    cluster as a new job each time, a few CPU-seconds apiece). Use as a context manager; ``wait`` counts only states
    read after it was called."""

    def __init__(self, address: str, app: str = "fusionserve", interval_s: float = 0.5) -> None:
        env = dict(os.environ, **AUTH, RAY_USAGE_STATS_ENABLED="0")
        cmd = [sys.executable, "-c", _WATCH, address, app, str(interval_s)]
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in __exit__) a file, not a pipe: warnings never block
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.latest: tuple[float, dict[str, int]] = (0.0, {})
        self.nodes: dict[str, str] = {}  # the live nodes at the latest reading: node id -> 'head' or 'worker'
        self.changes: list[tuple[float, dict[str, int]]] = []  # (monotonic time, states) at each change of the states
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("WATCH "):  # Ray's own lines (a node's death, for one)
                continue
            seen = json.loads(line.removeprefix("WATCH "))
            self.nodes, self.latest = seen["nodes"], (time.monotonic(), seen["replicas"])
            if not self.changes or self.changes[-1][1] != self.latest[1]:
                self.changes.append(self.latest)

    def wait(self, running: int, timeout_s: float) -> tuple[float, dict[str, int]]:
        """(seconds it took, the states) once exactly ``running`` replicas run and none is in another state;
        AssertionError after ``timeout_s`` (or when the watching driver ended), with the last states seen."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s and self.proc.poll() is None:
            seen_at, states = self.latest
            if seen_at > started and states.get("RUNNING", 0) == running and len(states) == 1:
                return seen_at - started, states
            time.sleep(0.2)
        err = ""
        if self.proc.poll() is not None:
            self._err.seek(0)
            err = f"; the watching driver ended: {self._err.read()[-3000:]}"
        seen = ", ".join(f"{t - started:.1f} s {states}" for t, states in self.changes if t > started - 60)
        raise AssertionError(f"not {running} running replica(s) within {timeout_s:.0f} s: {self.latest[1]} (seen: {seen}){err}")

    def replaced(self, since: float, running: int, timeout_s: float) -> float | None:
        """Seconds from ``since`` (a monotonic time) until the states, once other than exactly ``running`` running
        replicas after ``since``, were exactly that again (Serve replaced what it lost); None after ``timeout_s``."""
        deadline = since + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            changes = [(t, states) for t, states in list(self.changes) if t > since]
            left = next((i for i, (_, states) in enumerate(changes) if states != {"RUNNING": running}), None)
            back = next((t for t, states in changes[left or 0 :] if states == {"RUNNING": running}), None)
            if left is not None and back is not None:
                return back - since
            time.sleep(0.2)
        return None

    def __enter__(self) -> ReplicaWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self._reader.join(10)
        self._err.close()


def _node_ip() -> str:
    """The address Ray gives this machine's nodes (and drivers expect the GCS at): the route to the outside, as
    Ray finds it."""
    from ray.util import get_node_ip_address

    return get_node_ip_address()
