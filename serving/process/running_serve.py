"""Serve as it already runs on the Ray cluster a server joins, and what a start may not do there: replace the
fusionserve application unasked, ask Serve for other ports than the ones it listens on (it cannot move them while it
runs), use a port something else holds, bind replicas to loopback on a cluster of several machines. And taking the
application down again only while it is still this server's."""

from __future__ import annotations

import os
import sys
from typing import Any

from fusionserve.errors import FusionServeError

from ..api.metrics import METRICS_ENV
from ..builder import DEPLOYMENT
from ..private import serve_details

APP_NAME = "fusionserve"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def refuse_loopback_on_many_machines(ray: Any, host: str) -> None:
    """Every node's ingress (HAProxy, or Serve's proxy) reaches replicas on other machines at their node address, and
    the replicas listen on ``--host``: a loopback address would leave them unreachable from the other machines."""
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    if len(addresses) > 1 and host in LOOPBACK:
        raise FusionServeError(
            f"--host {host} on a cluster of {len(addresses)} machines ({', '.join(sorted(addresses))}): replicas would "
            "listen on loopback, unreachable from the other machines' ingress; pass --host 0.0.0.0 (and firewall the "
            "replica ports, see the docs' Scaling out guide)"
        )


def refuse_to_replace(running: Any, replace: bool) -> None:
    """On a cluster that already runs fusionserve, deploying would silently replace it: refuse unless asked."""
    app = running.applications.get(APP_NAME) if running is not None else None
    if app is not None and not replace:
        raise FusionServeError(
            f"the Ray cluster at {os.environ.get('RAY_ADDRESS', 'this address')} already runs a '{APP_NAME}' application "
            f"({getattr(app.status, 'value', app.status)}); pass --replace to replace it, or serve on another cluster"
        )


def check_ports(cfg: Any, running: Any, held: dict[int, str]) -> dict[int, str]:
    """Serve already runs on the joined cluster: it keeps the ports it listens on (``serve.start`` ignores new ones
    while it runs), so ``--port`` (and ``--grpc-port``, when given) must be its ports. Returns the held ports that are
    not Serve's: on a machine that is a node of the cluster, the node's own ingress holds Serve's ports. Raises
    FusionServeError naming both ports when they differ."""
    grpc = running.grpc_options
    theirs = {
        ("--port", "HTTP"): (cfg.port, running.http_options.port if running.http_options else None),
        ("--grpc-port", "gRPC"): (cfg.grpc_port, grpc.port if grpc and grpc.grpc_servicer_functions else None),
    }
    for (flag, protocol), (mine, port) in theirs.items():
        if mine is None or mine == port:
            continue
        if port is None:
            raise FusionServeError(
                f"{flag} {mine}: the cluster's Serve runs no {protocol} server and cannot start one while running; "
                f"leave {flag} out"
            )
        raise FusionServeError(
            f"{flag} {mine}: the cluster's Serve listens for {protocol} on port {port}; Serve cannot move it while "
            f"running; pass {flag} {port}"
        )
    return {port: who for port, who in held.items() if port not in {p for _, p in theirs.values()}}


def refuse_held(host: str, held: dict[int, str]) -> None:
    """Raise FusionServeError for the first of ``held`` (port -> what holds it), naming the port and its holder."""
    if held:
        port, holder = next(iter(held.items()))
        raise FusionServeError(f"port {port} on {host} is already in use by {holder}; stop it or choose another port")


def delete_if_ours(serve: Any, metrics_dir: str | None) -> None:
    """Delete the cluster's fusionserve application if it is still the one this server deployed: its replicas pool
    their metrics in this server's own folder (``metrics_dir``, ``PROMETHEUS_MULTIPROC_DIR``, in its run folder),
    which a server that replaced it since (``--replace``) or a deployment by Ray's own tools does not name."""
    running = serve_details()
    app = running.applications.get(APP_NAME) if running is not None else None
    if app is None:  # gone already (or serve.run failed before it was there)
        return
    deployment = app.deployments.get(DEPLOYMENT)
    options = deployment.deployment_config.ray_actor_options if deployment is not None else None
    env = (getattr(options, "runtime_env", None) or {}).get("env_vars") or {}  # options: a schema, or Serve's "unset"
    if metrics_dir is not None and env.get(METRICS_ENV) == metrics_dir:
        serve.delete(APP_NAME)
    else:
        print(f"fusionserve: the '{APP_NAME}' application was replaced by another deployment; leaving it", file=sys.stderr)
