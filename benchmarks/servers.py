"""The servers the load benchmark measures, each in its own process tree: ``fusionserve serve`` with a given
ingress (Ray reads its settings when it starts, so every variant gets a fresh Ray), and a bare uvicorn + FastAPI
echo app, the floor any Python HTTP server pays here. Also: the memory of a process tree, and metric scrapes."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_SERVE = """
import sys
from pathlib import Path
from fusionserve.serving.process.server import ServerConfig, serve_forever
threads = int(sys.argv[7]) or None
grpc_port = int(sys.argv[8]) or None
queued = {"max_queued": int(sys.argv[9])} if int(sys.argv[9]) else {}
serve_forever(ServerConfig(Path(sys.argv[1]), port=int(sys.argv[2]), ingress=sys.argv[3], replicas=int(sys.argv[4]),
                           device=sys.argv[5], max_batch_size=int(sys.argv[6]), threads=threads, grpc_port=grpc_port,
                           **queued))
"""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    started_s: float  # seconds from launch to the first 200 on its route

    def stop(self) -> float:
        """SIGINT, then wait; returns how long it took to exit (killed after 60 s)."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return time.perf_counter() - t0


def _wait(proc: subprocess.Popen[bytes], port: int, path: str, log: Path, timeout_s: float = 240) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server not answering {path} after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def start_fusionserve(
    artifact: Path,
    port: int,
    ingress: str,
    logs: Path,
    replicas: int = 1,
    device: str = "cpu",
    max_batch_size: int = 32,
    threads: int | None = None,
    grpc_port: int | None = None,
    max_queued: int | None = None,
    cwd: Path = ROOT,
) -> Server:
    """``threads``: ONNX Runtime threads per replica (None: the server's default, CPUs / replicas); ``grpc_port``:
    Serve's gRPC ingress there too; ``max_queued``: the replica's queue limit (None: the server's default); ``cwd``:
    where it runs (first on its path: another checkout's package there runs instead of this one's)."""
    log = logs / f"serve-{ingress}{'-q' + str(max_queued) if max_queued else ''}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    args = [str(artifact), str(port), ingress, str(replicas), device, str(max_batch_size), str(threads or 0), str(grpc_port or 0),
            str(max_queued or 0)]  # fmt: skip
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-c", _SERVE, *args], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    return Server(ingress, proc, port, log, _wait(proc, port, "/v1/tasks", log))


def start_uvicorn(
    name: str, app: str, port: int, logs: Path, env: dict[str, str] | None = None, timeout_s: float = 240
) -> Server:
    """``python -m uvicorn APP`` on ``port`` (``env``: its environment, default this one's), its output in
    ``logs/NAME.log``, once ``/healthz`` answers 200."""
    log = logs / f"{name}.log"
    cmd = [sys.executable, "-m", "uvicorn", app, "--port", str(port), "--log-level", "warning", "--no-access-log"]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Server(name, proc, port, log, _wait(proc, port, "/healthz", log, timeout_s))


def start_echo(port: int, logs: Path) -> Server:
    return start_uvicorn("echo", "benchmarks.echo_app:app", port, logs)


def tree_rss_mb(pid: int) -> dict[str, float]:
    """Resident memory (MB) of a process and every descendant, by ``name[pid]``."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(p.cmdline()[:1]).rsplit("/", 1)[-1] or p.name()
            if name.startswith("ray::"):
                name = p.cmdline()[0]
            out[f"{name}[{p.pid}]"] = round(p.memory_info().rss / 2**20, 1)
        except psutil.Error:  # exited in between
            continue
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and every descendant so far (a server: `fusionserve serve`, Ray's, its replica,
    HAProxy); a process that exits in between counts no more."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def replica_ports(pid: int) -> list[int]:
    """Ports in Serve's direct-ingress range (30000-31000) that the server's replicas listen on."""
    import psutil

    ports = set()
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "ServeReplica" not in " ".join(p.cmdline()):
                continue
            ports |= {c.laddr.port for c in p.net_connections("tcp") if c.status == "LISTEN" and 30000 <= c.laddr.port < 31000}
        except psutil.Error:
            continue
    return sorted(ports)


def batch_sums(port: int, task: str) -> tuple[float, float]:
    """(sum, count) of fusionserve_batch_size_inputs (batches of any tasks; ``task`` is kept for the signature):
    two scrapes give the mean batch in between."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "fusionserve_batch_size_inputs":
            vals = {s.name: s.value for s in fam.samples}
            return vals.get("fusionserve_batch_size_inputs_sum", 0.0), vals.get("fusionserve_batch_size_inputs_count", 0.0)
    return 0.0, 0.0


def body_maker(task: str, texts: list[str]) -> Any:
    encoded = [json.dumps({"task": task, "inputs": [t]}).encode() for t in texts]
    return lambda i: encoded[i % len(encoded)]


def artifact_and_task(artifact: Path | None, task: str | None) -> tuple[Path, str, Any]:
    """The artifact a benchmark serves (default: the built-in model, exported on first use), the task it asks
    (default: the first fusion task, else the first task) and the loaded artifact (``load_artifact``'s)."""
    from fusionserve.serving.model.artifact import load_artifact

    if artifact is None:
        from fusionserve.cli.default import ensure_artifact

        artifact = ensure_artifact()
    art = load_artifact(artifact)
    return artifact, task or next((n for n, t in art.tasks.items() if t.kind == "fusion"), next(iter(art.tasks))), art
