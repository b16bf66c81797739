"""``fusionserve serve``: an artifact over HTTP with Ray Serve, until Ctrl-C."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fusionserve.serving.ingress import INGRESSES

from . import default


def add_serve(sub: Any) -> None:
    sv = sub.add_parser("serve", help="serve an artifact over HTTP with Ray Serve (Ctrl-C stops)")
    sv.add_argument(
        "artifact",
        nargs="?",
        help="artifact folder written by `fusionserve export`; default: the built-in model, exported on first use",
    )
    sv.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1; see the README's security notes)")
    sv.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    sv.add_argument("--replicas", type=int, default=1, help="model replicas, each with its own ONNX Runtime session (default 1)")
    sv.add_argument("--threads", type=int, help="ONNX Runtime threads per replica (default: CPUs / replicas)")
    sv.add_argument("--max-batch-size", type=int, default=32, help="most texts in one model call (default 32)")
    sv.add_argument(
        "--max-batch-tokens",
        type=int,
        default=16384,
        help="most padded tokens (texts x longest) in one model call (default 16384)",
    )
    sv.add_argument(
        "--batch-wait-ms",
        type=float,
        default=0.0,
        help="how long a batch may wait to fill once the model is free (default 0: none)",
    )
    sv.add_argument(
        "--max-queued", type=int, default=64, help="requests a replica lets wait for the model; past it 503 at once (default 64)"
    )
    sv.add_argument(
        "--max-ongoing", type=int, help="requests Serve hands a replica at once (default: max queued + max batch size)"
    )
    sv.add_argument("--max-inputs", type=int, default=64, help="most inputs in one request, else 413 (default 64)")
    sv.add_argument("--max-body-bytes", type=int, default=1_000_000, help="largest request body, else 413 (default 1000000)")
    sv.add_argument(
        "--body-timeout-s", type=float, default=10.0, help="a request body not complete by then is answered 408 (default 10)"
    )
    sv.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where replicas run: cuda needs onnxruntime-gpu (pip install 'fusionserve[gpu]') and a GPU Ray sees; "
        "auto takes it when both are there (default auto)",
    )
    sv.add_argument(
        "--ingress",
        choices=list(INGRESSES),
        default=INGRESSES[0],
        help="haproxy: HAProxy hands connections straight to the replicas' own HTTP ports; proxy: Serve's proxy actor "
        f"forwards each request over Ray (default {INGRESSES[0]}; see the README for the measured difference)",
    )
    sv.add_argument(
        "--replace", action="store_true", help="on a Ray cluster (RAY_ADDRESS) that already runs fusionserve: replace it"
    )
    sv.set_defaults(run=run_serve, needs="serve")


def run_serve(args: argparse.Namespace) -> int:
    from fusionserve.serving.server import ServerConfig, serve_forever

    artifact = Path(args.artifact) if args.artifact is not None else default.ensure_artifact()
    cfg = ServerConfig(
        artifact, args.host, args.port, args.replicas, args.max_batch_size, args.batch_wait_ms,
        args.max_queued, args.max_ongoing, args.max_inputs, args.max_body_bytes, args.threads, args.device,
        args.max_batch_tokens, args.ingress, args.body_timeout_s, args.replace,
    )  # fmt: skip
    serve_forever(cfg)
    return 0
