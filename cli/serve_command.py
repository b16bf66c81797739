"""``fusionserve serve``: an artifact over HTTP with Ray Serve, until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fusionserve.errors import FusionServeError
from fusionserve.serving import options
from fusionserve.serving.process.ingress import INGRESSES
from fusionserve.settings import API_KEY_ENV, api_keys, parse_keys

from . import default


def _d(name: str) -> str:
    """An option's default for its help (serving/options.py holds it)."""
    value = options.default(name)
    return str(value) if isinstance(value, int | str) else f"{value:g}"


def add_serve(sub: Any) -> None:
    sv = sub.add_parser("serve", help="serve an artifact over HTTP with Ray Serve (Ctrl-C stops)")
    sv.add_argument(
        "artifact",
        nargs="?",
        help="artifact folder written by `fusionserve export`; default: the built-in model, exported on first use",
    )
    sv.add_argument("--host", help="HTTP bind address (default 127.0.0.1; see the docs' Serving guide, security notes)")
    sv.add_argument("--port", type=int, help="HTTP port (default 8000)")
    sv.add_argument(
        "--replicas", type=int, help=f"model replicas, each with its own ONNX Runtime session (default {_d('replicas')})"
    )
    sv.add_argument("--threads", type=int, help="ONNX Runtime threads per replica (default: CPUs / replicas)")
    sv.add_argument("--max-batch-size", type=int, help=f"most texts in one model call (default {_d('max_batch_size')})")
    sv.add_argument(
        "--max-batch-tokens",
        type=int,
        help=f"most padded tokens (texts x longest) in one model call (default {_d('max_batch_tokens')})",
    )
    sv.add_argument(
        "--batch-wait-ms",
        type=float,
        help=f"how long a batch may wait to fill once the model is free (default {_d('batch_wait_ms')}: none)",
    )
    sv.add_argument(
        "--max-queued",
        type=int,
        help=f"requests a replica lets wait for the model; past it 503 at once (default {_d('max_queued')})",
    )
    sv.add_argument(
        "--max-ongoing",
        type=int,
        help=f"requests Serve hands a replica at once (default max({options.ONGOING_FLOOR}, --max-queued + "
        "--max-batch-size): the replica's own queue refuses first)",
    )
    sv.add_argument("--max-inputs", type=int, help=f"most inputs in one request, else 413 (default {_d('max_inputs')})")
    sv.add_argument(
        "--max-body-bytes", type=int, help=f"largest request body or gRPC message, else 413 (default {_d('max_body_bytes')})"
    )
    sv.add_argument(
        "--body-timeout-s",
        type=float,
        help=f"a request body not complete by then is answered 408 (default {_d('body_timeout_s')})",
    )
    sv.add_argument(
        "--device",
        choices=list(options.DEVICES),
        help="where replicas run: cuda needs onnxruntime-gpu (pip install 'fusionserve[gpu]') and a GPU Ray sees; "
        f"auto takes it when both are there (default {_d('device')})",
    )
    sv.add_argument(
        "--ingress",
        choices=list(INGRESSES),
        help="haproxy: HAProxy hands connections straight to the replicas' own HTTP ports; proxy: Serve's proxy actor "
        f"forwards each request over Ray (default {INGRESSES[0]}; see the docs' Serving guide)",
    )
    sv.add_argument(
        "--replace", action="store_true", help="on a Ray cluster (RAY_ADDRESS) that already runs fusionserve: replace it"
    )
    sv.add_argument(
        "--grpc-port", type=int, help="also serve gRPC (fusionserve.v1.Classifier, serving/api/fusionserve.proto) on this port"
    )
    _add_access(sv)
    _add_observability(sv)
    _add_scaling(sv)
    sv.set_defaults(run=run_serve, needs="serve")


def _add_access(sv: Any) -> None:
    access = sv.add_argument_group("access and compatibility (see docs/guides/api.md)")
    access.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"every model route asks for 'Authorization: Bearer KEY' (several: comma-separated). Prefer ${API_KEY_ENV}: "
        "an argument is visible to other users in ps until the server hides it",
    )
    access.add_argument("--private-metrics", action="store_true", help="/metrics asks for the API key too (default: open)")
    access.add_argument(
        "--default-task", help="answer TEI's POST /predict and the Hugging Face Inference API's POST / for this task"
    )


def _add_observability(sv: Any) -> None:
    group = sv.add_argument_group("traces and logs (see docs/guides/tracing.md)")
    group.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export one OpenTelemetry trace per request over OTLP/HTTP to this collector (http://host:4318, or its "
        "/v1/traces URL; needs pip install 'fusionserve[otel]'); default: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT if set, "
        "else no tracing",
    )
    group.add_argument(
        "--trace-sample-ratio",
        type=float,
        help=f"share of requests traced, 0..1 (default {_d('trace_sample_ratio')}; a caller's traceparent decides for its own)",
    )
    group.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="json: every log line one JSON object, with the request's trace_id (default text)",
    )


def _api_key_options(args: argparse.Namespace) -> dict[str, Any]:
    """--api-key goes into this process's environment, which the local Ray and so every replica inherit (on a joined
    cluster, every node must have it: see the guide), and out of its command line, which Ray records. Returns the
    application's options that name the variable, never the key."""
    if args.api_key is not None:
        if not parse_keys(args.api_key):
            raise FusionServeError("--api-key: empty; give a key (or several, comma-separated)")
        os.environ[API_KEY_ENV] = args.api_key
        _hide(args.api_key)
    options: dict[str, Any] = {"api_key_env": API_KEY_ENV} if api_keys() else {}
    if args.private_metrics:
        options["open_metrics"] = False
    return options


def _hide(key: str) -> None:
    """Blank the key out of this process's command line (what ps and Ray's job table show) and of sys.argv. Raises
    FusionServeError where the command line cannot be rewritten (serving/private.py): the key would stay visible."""
    import importlib.util

    from fusionserve.serving.private import set_process_title

    if importlib.util.find_spec("ray") is None:  # serve needs Ray anyway: say which extra brings it
        raise ModuleNotFoundError("No module named 'ray'", name="ray")
    sys.argv[:] = [a.replace(key, "<hidden>") for a in sys.argv]
    if not set_process_title(" ".join([Path(sys.executable).name, "-m", "fusionserve.cli.main", *sys.argv[1:]])):
        raise FusionServeError(
            f"--api-key: this Ray cannot rewrite the command line, so the key would stay visible in ps; pass it in "
            f"${API_KEY_ENV} instead"
        )


def _add_scaling(sv: Any) -> None:
    scale = sv.add_argument_group("autoscaling (Serve's autoscaling_config; both --min- and --max-replicas turn it on)")
    scale.add_argument("--min-replicas", type=int, help="fewest replicas (>= 1)")
    scale.add_argument("--max-replicas", type=int, help="most replicas")
    scale.add_argument(
        "--target-ongoing-requests",
        type=float,
        help=f"ongoing requests per replica Serve scales to (default {_d('target_ongoing_requests')})",
    )
    scale.add_argument(
        "--upscale-delay-s", type=float, help=f"load held this long adds replicas (default {_d('upscale_delay_s')})"
    )
    scale.add_argument(
        "--downscale-delay-s", type=float, help=f"low load held this long removes replicas (default {_d('downscale_delay_s')})"
    )
    scale.add_argument(
        "--look-back-period-s",
        type=float,
        help=f"window the ongoing requests are averaged over (default {_d('look_back_period_s')})",
    )
    cluster = sv.add_argument_group("clusters and stock Ray tools (see the docs' Scaling out guide)")
    cluster.add_argument(
        "--ship-artifact",
        action="store_true",
        help="hand the artifact to Ray (runtime env working_dir): every node gets its own copy; without it every node "
        "reads ARTIFACT at this same path",
    )
    cluster.add_argument(
        "--print-config",
        action="store_true",
        help="print a Ray Serve config file for these options (for `serve run`/`serve deploy`, KubeRay) and exit",
    )


def run_serve(args: argparse.Namespace) -> int:
    from fusionserve.serving.process.server import ServerConfig, serve_forever
    from fusionserve.serving.process.supervise import supervise

    if args.artifact is not None:
        artifact = Path(args.artifact)
    else:  # the built-in model: the fastest precision that passes its gate here (cli/default.py), said in one line
        precision, why = default.choose_precision(args.device or "auto")
        print(f"fusionserve: the built-in model in {precision}: {why}", file=sys.stderr)
        artifact = default.ensure_artifact(precision=precision)
    names = (
        "host", "port", "replicas", "max_batch_size", "batch_wait_ms", "max_queued", "max_ongoing", "max_inputs",
        "max_body_bytes", "threads", "device", "max_batch_tokens", "ingress", "body_timeout_s", "replace", "grpc_port",
        "min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s",
        "look_back_period_s", "ship_artifact", "default_task", "otlp_endpoint", "trace_sample_ratio", "log_format",
    )  # fmt: skip
    # an option not given is left out: its default is the application's (AppArgs), written in one place
    chosen = {n: getattr(args, n) for n in names if getattr(args, n) is not None} | _api_key_options(args)
    cfg = ServerConfig(artifact, **chosen)
    if args.print_config:
        from fusionserve.serving.process.serve_config import render

        print(render(cfg), end="")
        return 0
    # the command itself is the supervisor of a server process; main(argv) called from Python code (tests) serves in
    # the calling process
    if getattr(args, "own_process", False):
        return supervise(cfg)
    return serve_forever(cfg) or 0
