"""Start Ray Serve with the fusionserve application, wait, shut everything down on Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionserve.errors import FusionServeError

from .artifact import load_artifact
from .batching import BatchLimits
from .cluster import connect
from .ingress import INGRESSES, VARIANTS, ingress_env, port_holder, reap
from .runtime import DEVICES, DeviceError, resolve_device

APP_NAME = "fusionserve"
_metrics_dir: str | None = None  # where this server's replicas pool their Prometheus samples
_ingress_dir: str | None = None  # HAProxy's config, socket and state files


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``fusionserve serve`` takes; validated here, once."""

    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    max_batch_size: int = 32
    batch_wait_ms: float = 0.0
    max_queued: int = 64
    max_ongoing: int | None = None
    max_inputs: int = 64
    max_body_bytes: int = 1_000_000
    threads: int | None = None  # per replica; default: this machine's CPUs / replicas
    device: str = "auto"  # auto | cpu | cuda: see serving/runtime.py
    max_batch_tokens: int = 16384
    ingress: str = INGRESSES[0]  # see serving/ingress.py
    body_timeout_s: float = 10.0
    replace: bool = False  # on a cluster that already runs fusionserve: replace it instead of refusing

    def __post_init__(self) -> None:
        checks = {
            "--port": (self.port, 0 <= self.port <= 65535, "0..65535"),
            "--replicas": (self.replicas, self.replicas >= 1, ">= 1"),
            "--max-batch-size": (self.max_batch_size, self.max_batch_size >= 1, ">= 1"),
            "--batch-wait-ms": (self.batch_wait_ms, 0 <= self.batch_wait_ms <= 10_000, "0..10000"),
            "--max-queued": (self.max_queued, self.max_queued >= 0, ">= 0"),
            "--max-inputs": (self.max_inputs, self.max_inputs >= 1, ">= 1"),
            "--max-body-bytes": (self.max_body_bytes, self.max_body_bytes >= 1024, ">= 1024"),
            "--max-batch-tokens": (self.max_batch_tokens, self.max_batch_tokens >= 8, ">= 8"),
            "--body-timeout-s": (self.body_timeout_s, 0 < self.body_timeout_s <= 3600, "0..3600"),
        }
        for name, (value, ok, allowed) in checks.items():
            if not ok:
                raise FusionServeError(f"{name} = {value} is out of range; allowed: {allowed}")
        if self.threads is not None and self.threads < 1:
            raise FusionServeError(f"--threads = {self.threads} is out of range; allowed: >= 1")
        if self.device not in DEVICES:
            raise FusionServeError(f"--device = '{self.device}' is not known; allowed: {', '.join(DEVICES)}")
        if self.max_ongoing is not None and self.max_ongoing < 1:
            raise FusionServeError(f"--max-ongoing = {self.max_ongoing} is out of range; allowed: >= 1")
        if self.ingress not in VARIANTS:
            raise FusionServeError(f"--ingress = '{self.ingress}' is not known; allowed: {', '.join(INGRESSES)}")

    @property
    def ongoing_per_replica(self) -> int:
        """Requests Serve hands a replica at once: by default every request its queue may hold plus a full batch,
        so the replica's own queue, which answers 503 at once, is what refuses first."""
        return self.max_ongoing or self.max_queued + self.max_batch_size

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(self.max_batch_size, self.max_batch_tokens, self.max_queued, self.batch_wait_ms / 1000)

    @property
    def threads_per_replica(self) -> int:
        return self.threads or max(1, len(os.sched_getaffinity(0)) // self.replicas)


def placement(device: str, gpus: float, replicas: int) -> tuple[str, float]:
    """(device each replica runs on, GPUs each reserves) for ``--device`` when Ray sees ``gpus`` GPUs: CUDA
    replicas spread over the GPUs and share one when there are more replicas than GPUs (Ray gives each replica
    its GPU through CUDA_VISIBLE_DEVICES). auto falls back to CPU when the CUDA provider or a GPU is missing.

    Raises DeviceError for 'cuda' without the CUDA provider or without a GPU Ray can see."""
    if resolve_device(device) == "cpu":
        return "cpu", 0.0
    whole = int(gpus)
    if whole < 1:
        if device == "cuda":
            raise DeviceError(
                "--device cuda: onnxruntime has the CUDA provider but Ray sees no GPU on this node or cluster "
                "(check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and `docker run --gpus all` in a container)"
            )
        return "cpu", 0.0
    return "cuda", 1.0 / math.ceil(replicas / whole)


def build_app(cfg: ServerConfig, metrics_dir: str | None = None, gpus: float = 0.0) -> Any:
    """The Serve application: ``cfg.replicas`` replicas of FusionServe (HTTP, validation, batching, ONNX Runtime,
    metrics). With ``metrics_dir`` the replicas pool their Prometheus samples there; ``gpus`` is how many GPUs
    Ray sees (see ``placement``). Raises ArtifactError or DeviceError."""
    from .app import actor_options, deployment
    from .schemas import Limits

    artifact = load_artifact(cfg.artifact)  # fail here, with the file's name, not inside a replica
    if cfg.max_batch_tokens < artifact.max_seq_len:
        raise FusionServeError(
            f"--max-batch-tokens = {cfg.max_batch_tokens} cannot hold one input of {artifact.max_seq_len} tokens "
            f"(the artifact's token limit); allowed: >= {artifact.max_seq_len}"
        )
    device, gpus_per_replica = placement(cfg.device, gpus, cfg.replicas)
    dep = deployment(cfg.replicas, cfg.threads_per_replica, cfg.ongoing_per_replica, cfg.max_queued, gpus_per_replica)
    if metrics_dir:
        env = {"PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        options = actor_options(cfg.threads_per_replica, gpus_per_replica) | {"runtime_env": {"env_vars": env}}
        dep = dep.options(ray_actor_options=options)
    limits = Limits(cfg.max_inputs, cfg.max_body_bytes, cfg.body_timeout_s)
    return dep.bind(str(cfg.artifact.resolve()), limits, cfg.batch_limits(), cfg.threads_per_replica, device)


def start(cfg: ServerConfig, say: Callable[[str], object] = lambda _: None) -> str:
    """Start (or join, with RAY_ADDRESS) Ray, then Serve on host:port, and deploy; returns the base URL. ``say``
    gets one line per step. Raises FusionServeError (port taken, an application already deployed on the cluster
    without ``cfg.replace``, an unusable artifact or device) or ClusterError (Ray does not start)."""
    global _metrics_dir, _ingress_dir
    if importlib.util.find_spec("ray") is None:  # said before any step is announced (Ray is imported only later)
        raise ModuleNotFoundError("No module named 'ray'", name="ray")
    # a missing artifact or CUDA provider, or a taken port, fails before Ray starts; how many GPUs there are, Ray tells
    load_artifact(cfg.artifact, verify=False)
    resolve_device(cfg.device)
    holder = port_holder(cfg.host, cfg.port)
    if holder is not None:
        raise FusionServeError(f"port {cfg.port} on {cfg.host} is already in use by {holder}; stop it or choose another --port")
    # short: HAProxy's admin socket goes two levels below it, and a socket path may hold at most 97 characters
    _ingress_dir = tempfile.mkdtemp(prefix="fs-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.environ.update(ingress_env(cfg.ingress, Path(_ingress_dir)))  # read by Ray's processes when they start
    address = os.environ.get("RAY_ADDRESS")
    say(f"starting Ray ({'joining ' + address if address else 'a local instance'})")
    connect(quiet=True)
    import ray
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # importing Serve set it to INFO
    _refuse_to_replace(serve, cfg.replace)
    _metrics_dir = tempfile.mkdtemp(prefix="fusionserve-metrics-")
    app = build_app(cfg, _metrics_dir, float(ray.cluster_resources().get("GPU", 0.0)))
    say(f"deploying {cfg.replicas} replica(s) of {cfg.artifact} behind the {cfg.ingress} ingress")
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    url = f"http://{cfg.host}:{cfg.port}"
    _wait_routed(url)
    return url


def _refuse_to_replace(serve: Any, replace: bool) -> None:
    """On a cluster that already runs fusionserve, deploying would silently replace it: refuse unless asked."""
    try:
        running = serve.status().applications
    except Exception:  # no Serve on this cluster yet: nothing to replace
        return
    if APP_NAME in running and not replace:
        raise FusionServeError(
            f"the Ray cluster at {os.environ.get('RAY_ADDRESS', 'this address')} already runs a '{APP_NAME}' application "
            f"({running[APP_NAME].status}); pass --replace to replace it, or serve on another cluster"
        )


def _wait_routed(url: str, timeout_s: float = 120.0) -> None:
    """Return once the port answers the application's own route: the replicas report ready before the ingress
    (HAProxy) has its routes, and until then it answers 404. Raises FusionServeError after ``timeout_s``."""
    import urllib.error
    import urllib.request

    probe = url.replace("://0.0.0.0:", "://127.0.0.1:") + "/v1/tasks"
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(probe, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise FusionServeError(f"the application was deployed but {probe} did not answer within {timeout_s:.0f} s ({last})")


def stop() -> None:
    """Take the application down (its replicas drain what they hold), leave Ray (shutting it down when this process
    started it; a joined cluster keeps running), and remove what this server left: HAProxy, which outlives Ray's
    shutdown, and the metric and ingress folders. Deleting the one application instead of shutting Serve down
    leaves another team's applications on a shared cluster alone (and spares the controller's own shutdown task,
    whose retry notice reads like a failure)."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.delete(APP_NAME)
        except Exception as exc:  # Serve never came up, or is gone already: Ray still has to go
            print(f"fusionserve: could not delete the application: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            ray.shutdown()
    if _ingress_dir:
        reap(Path(_ingress_dir))
    for folder in (_metrics_dir, _ingress_dir):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def serve_forever(cfg: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM, then shut Serve and Ray down. Our handlers go in after Ray started: Ray's own
    SIGTERM handler prints a crash-style report. Raises what ``start`` raises, after cleaning up."""

    def say(text: str) -> None:
        print(f"fusionserve: {text}", file=sys.stderr, flush=True)

    try:
        url = start(cfg, say)
    except KeyboardInterrupt:
        say("interrupted while starting; shutting down")
        stop()
        return
    except BaseException:
        stop()
        raise
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    say(f"serving {cfg.artifact} at {url} (docs at {url}/docs); Ctrl-C stops")
    try:
        done.wait()
    finally:
        say("shutting down")
        stop()
