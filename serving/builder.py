"""The fusionserve application as a Ray Serve application builder: ``fusionserve.serving.builder:app_builder``.

Stock Ray tools build the application from it with typed arguments (``AppArgs``, validated by pydantic before the
builder runs)::

    serve run fusionserve.serving.builder:app_builder artifact=/models/art max_batch_size=16
    serve run fusionserve.yaml          # a config written by `fusionserve serve ART --print-config`

and ``fusionserve serve`` builds its application with the same function. The artifact: an absolute path is read by
every replica at that path (a shared filesystem, or baked into the image as in deploy/); a relative one is resolved
in each replica's working directory, which is Ray's copy of the runtime env's ``working_dir`` when there is one (Ray
unpacks it on every node: ``fusionserve serve --ship-artifact``, ``serve run --working-dir ART ... artifact=.``, or
``runtime_env: {working_dir: <zip URI>}`` in a config). With ``artifact_sha256`` every replica refuses to start on
any other artifact.

Note for maintainers: no ``from __future__ import annotations`` here: Serve reads ``app_builder``'s annotation as a
class to find the pydantic model.
"""

import math
import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from fusionserve.errors import FusionServeError

from . import options
from .api.grpc_ingress import transport_env
from .api.metrics import METRICS_ENV
from .api.schemas import Limits
from .api.tei import check_default_task
from .model.artifact import MANIFEST, load_artifact
from .model.runtime import DeviceError, resolve_device
from .options import ONGOING_FLOOR, default
from .private import WORKER_NICENESS
from .scheduler.batching import BatchLimits

IMPORT_PATH = "fusionserve.serving.builder:app_builder"
DEPLOYMENT = "fusionserve"
SERVICER = "fusionserve.serving.api.grpc_ingress.add_servicer"  # for grpc_options


def check_ranges(values: dict[str, Any], flags: bool) -> None:
    """Raise FusionServeError for the first value out of range (``options.check_ranges``: each option's one check),
    a device not known, or an autoscaling range that does not hold; named as an option (``--max-batch-size``) when
    ``flags``, else as a builder argument (``max_batch_size``)."""
    options.check_ranges(values, flags)
    low, high, fixed = values.get("min_replicas"), values.get("max_replicas"), values.get("replicas", default("replicas"))
    if (low is None) != (high is None):
        raise FusionServeError(_named("autoscaling needs both min_replicas and max_replicas", flags))
    if low is not None and high is not None and low > high:
        raise FusionServeError(_named(f"min_replicas = {low} is above max_replicas = {high}", flags))
    if high is not None and fixed != 1:
        raise FusionServeError(_named(f"replicas = {fixed} and max_replicas: choose a fixed count or autoscaling", flags))
    if values.get("open_metrics") is False and values.get("api_key_env") is None:
        raise FusionServeError(
            "--private-metrics needs an API key (--api-key, or FUSIONSERVE_API_KEY in the environment)"
            if flags
            else "open_metrics = false needs api_key_env: /metrics would ask for a key there is none of"
        )


def _named(text: str, flags: bool) -> str:
    """``text`` with its argument names written as options (``--min-replicas``) when ``flags``."""
    return (
        re.sub(r"\b(min_replicas|max_replicas|replicas)\b", lambda m: "--" + m.group(1).replace("_", "-"), text)
        if flags
        else text
    )


class AppArgs(BaseModel):
    """The builder's arguments: everything ``fusionserve serve`` takes that belongs to the application. Where Serve
    listens (host, ports) is the config's http_options / grpc_options, and the ingress is how Ray's nodes are started
    (see docs/guides/scaling-out.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact: str
    artifact_sha256: str | None = None  # sha256 of the artifact's manifest.json: replicas refuse any other
    replicas: int = default("replicas")
    min_replicas: int | None = default("min_replicas")  # both set: Serve's autoscaling instead of a fixed count
    max_replicas: int | None = default("max_replicas")
    target_ongoing_requests: float = default("target_ongoing_requests")
    upscale_delay_s: float = default("upscale_delay_s")
    downscale_delay_s: float = default("downscale_delay_s")
    look_back_period_s: float = default("look_back_period_s")
    max_batch_size: int = default("max_batch_size")
    max_batch_tokens: int = default("max_batch_tokens")
    batch_wait_ms: float = default("batch_wait_ms")
    max_queued: int = default("max_queued")
    max_ongoing: int | None = default("max_ongoing")
    max_inputs: int = default("max_inputs")
    max_body_bytes: int = default("max_body_bytes")
    body_timeout_s: float = default("body_timeout_s")
    threads: int | None = default("threads")  # per replica; default: this machine's CPUs / (max) replicas
    device: str = default("device")
    gpus_per_replica: float | None = default(
        "gpus_per_replica"
    )  # GPUs each CUDA replica reserves; default: spread over the GPUs Ray sees now
    metrics_dir: str | None = None  # PROMETHEUS_MULTIPROC_DIR of the replicas; default: a fresh folder name
    api_key_env: str | None = default("api_key_env")  # the variable holding the API key(s), never the key
    open_metrics: bool = default("open_metrics")
    default_task: str | None = default("default_task")
    otlp_endpoint: str | None = default("otlp_endpoint")
    trace_sample_ratio: float = default("trace_sample_ratio")
    log_format: str = default("log_format")

    @model_validator(mode="after")
    def _in_range(self) -> "AppArgs":
        check_ranges(self.model_dump(), flags=False)
        return self

    @property
    def autoscaling_config(self) -> dict[str, Any] | None:
        if self.max_replicas is None:
            return None
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests, "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s, "look_back_period_s": self.look_back_period_s}  # fmt: skip

    @property
    def most_replicas(self) -> int:
        return self.max_replicas or self.replicas

    @property
    def threads_per_replica(self) -> int:
        return self.threads or max(1, len(os.sched_getaffinity(0)) // self.most_replicas)

    @property
    def ongoing_per_replica(self) -> int:
        """Requests Serve hands a replica at once: by default far more than the replica's own queue admits, so Serve
        never holds a request back and the replica's queue, which answers 503 at once, is what refuses. (Held in
        Serve's per-replica semaphore instead, the excess of a 300-request burst waited for running batches and got
        its 503 after up to 14 s.)"""
        return self.max_ongoing or max(ONGOING_FLOOR, self.max_queued + self.max_batch_size)

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(self.max_batch_size, self.max_batch_tokens, self.max_queued, self.batch_wait_ms)

    def request_limits(self) -> Limits:
        return Limits(self.max_inputs, self.max_body_bytes, self.body_timeout_s)


BF16_ON_CUDA = "a bf16 artifact runs on the CPU (OpenVINO): use --device cpu or auto, or an fp32 or fp16 export for CUDA"


def refuse_cuda_for_cpu_only(device: str, what: str = "") -> None:
    """The one rule for an artifact only the CPU runs (bf16): ``--device cuda`` with it raises DeviceError, naming
    ``what`` (the artifact's folder) where given; cpu and auto run it on the CPU."""
    if device == "cuda":
        raise DeviceError(f"--device cuda: {what + ': ' if what else ''}{BF16_ON_CUDA}")


def placement(device: str, gpus: float | None, replicas: int, cpu_only: bool = False) -> tuple[str, float]:
    """(device each replica runs on, GPUs each reserves) for ``device`` when Ray sees ``gpus`` GPUs (None: not known
    yet, as under `serve run` before it joins Ray: then cuda reserves one GPU per replica and auto means CPU). CUDA
    replicas spread over the GPUs and share one when there are more replicas than GPUs (Ray gives each replica its
    GPU through CUDA_VISIBLE_DEVICES). auto falls back to CPU when the CUDA provider or a GPU is missing, and always
    for ``cpu_only`` (a bf16 artifact: OpenVINO's CPU plugin runs it, whatever GPU the machine has).

    Raises DeviceError for 'cuda' without the CUDA provider, without a GPU Ray can see, or with ``cpu_only``."""
    if cpu_only:
        refuse_cuda_for_cpu_only(device)
        return "cpu", 0.0
    if resolve_device(device) == "cpu":
        return "cpu", 0.0
    if gpus is None:
        return ("cuda", 1.0) if device == "cuda" else ("cpu", 0.0)
    whole = int(gpus)
    if whole < 1:
        if device == "cuda":
            raise DeviceError(
                "--device cuda: onnxruntime has the CUDA provider but Ray sees no GPU on this node or cluster "
                "(check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and `docker run --gpus all` in a container)"
            )
        return "cpu", 0.0
    return "cuda", 1.0 / math.ceil(replicas / whole)


def _cluster_gpus() -> float | None:
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else None


def check_artifact(args: AppArgs) -> str | None:
    """Where the builder can read the artifact, fail here with the file's name rather than in every replica; where it
    cannot (a path only the cluster's nodes have, a runtime env's copy), the replicas check it when they start.
    Returns the artifact's precision, None where it cannot be read here."""
    folder = Path(args.artifact)
    if not (folder / MANIFEST).is_file():
        return None
    artifact = load_artifact(folder)
    check_default_task(artifact, args.default_task)
    args.batch_limits().check_fits(artifact.max_seq_len)
    return str(artifact.manifest["precision"])


def replica_placement(args: AppArgs) -> tuple[str, float]:
    """(device, GPUs each replica reserves) for ``args``, after ``check_artifact``: a bf16 artifact on the CPU."""
    cpu_only = check_artifact(args) == "bf16"
    if args.gpus_per_replica is not None and resolve_device(args.device) == "cuda" and not cpu_only:
        # fixed, as a cluster whose GPU nodes join later (an autoscaling KubeRay group) needs: Ray holds a replica
        # until a node with a free GPU is there
        return "cuda", args.gpus_per_replica
    return placement(args.device, _cluster_gpus(), args.most_replicas, cpu_only)


def app_builder(args: AppArgs) -> Any:
    """The Serve application for ``args`` (see the module docstring). Raises FusionServeError (an unusable artifact
    or option) or DeviceError."""
    from ray import serve

    from .api.app import FusionServe

    device, gpus = replica_placement(args)
    metrics_dir = args.metrics_dir or str(Path(tempfile.gettempdir()) / f"fusionserve-metrics-{uuid.uuid4().hex[:12]}")
    options: dict[str, Any] = {
        "num_cpus": args.threads_per_replica,
        # Ray starts workers at nice 15: a replica would lose every core to anything else on its node
        # and the replica's own gRPC server refuses a message over the size limit before reading it
        "runtime_env": {"env_vars": {METRICS_ENV: metrics_dir, **WORKER_NICENESS, **transport_env(args.max_body_bytes)}},
    }
    if gpus > 0:  # a GPU is asked for only when the replica runs on one (Ray then sets CUDA_VISIBLE_DEVICES)
        options["num_gpus"] = gpus
    autoscaling = args.autoscaling_config
    dep: Any = serve.deployment(  # typed as the decorator form; called with the class it is the Deployment
        FusionServe,
        name=DEPLOYMENT,
        num_replicas=None if autoscaling else args.replicas,
        autoscaling_config=autoscaling,
        max_ongoing_requests=args.ongoing_per_replica,
        max_queued_requests=args.max_queued,
        ray_actor_options=options,
        # Serve's own JSON log format for the replicas' log lines (fusionserve's lines add the request's trace id)
        **({"logging_config": {"encoding": "JSON"}} if args.log_format == "json" else {}),
    )
    artifact = args.artifact if not Path(args.artifact).is_absolute() else str(Path(args.artifact).resolve())
    return dep.bind(
        artifact, args.request_limits(), args.batch_limits(), args.threads_per_replica, device, args.artifact_sha256,
        api_key_env=args.api_key_env, open_metrics=args.open_metrics, default_task=args.default_task,
        otlp_endpoint=args.otlp_endpoint, trace_sample_ratio=args.trace_sample_ratio, log_format=args.log_format,
    )  # fmt: skip
