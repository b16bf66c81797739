"""Start Ray Serve with the fusionserve application, wait, shut everything down on Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import onnxruntime as ort

from fusionserve.errors import FusionServeError

from ..api.grpc_ingress import transport_env
from ..builder import DEPLOYMENT, METRICS_ENV, SERVICER, AppArgs, app_builder, check_artifact, check_ranges, placement
from ..model.artifact import MANIFEST, load_artifact, sha256
from ..model.runtime import make_session, resolve_device
from . import loopback
from .cluster import connect
from .ingress import INGRESSES, VARIANTS, ingress_env, port_holder, wait_all_routed, wait_routed
from .supervise import (
    descendants,
    end_run,
    exit_with,
    new_run_folder,
    reap_stale,
    record,
    resume_supervised,
    started_at,
    supervise,
    supervise_end,
)

__all__ = ["APP_NAME", "ServerConfig", "placement", "serve_forever", "serve_handed_over", "serve_supervised", "start", "stop"]
APP_NAME = "fusionserve"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_metrics_dir: str | None = None  # where this server's replicas pool their Prometheus samples (in the run folder)
_ingress_dir: str | None = None  # the run folder (serving/process/supervise.py): HAProxy's config, socket and state files
_deployed = False  # this process deployed (or, with --replace, took over) the application: stop() takes it down
# unless another server replaced it since (see _delete_if_ours)


@dataclass(frozen=True, init=False)
class ServerConfig:
    """Everything ``fusionserve serve`` takes, validated here, once: ``ServerConfig(artifact, port=8001,
    max_batch_size=16, ...)``. Host, ports, ingress and how the artifact reaches the nodes are this process's to set
    up (the fields below); every other option is the application's and goes to the builder as ``app`` (its names and
    defaults are ``AppArgs``'s, the one place they are written). Raises FusionServeError for an option out of range
    or unknown, named as the command's flag (``--max-batch-size``)."""

    artifact: Path
    app: AppArgs
    host: str = "127.0.0.1"
    port: int = 8000
    ingress: str = INGRESSES[0]  # see serving/process/ingress.py
    replace: bool = False  # on a cluster that already runs fusionserve: replace it instead of refusing
    grpc_port: int | None = None  # Serve's gRPC ingress on this port (see serving/api/grpc_ingress.py)
    ship_artifact: bool = False  # hand the artifact to Ray (runtime env working_dir), which copies it to every node

    def __init__(self, artifact: Path | str, **options: Any) -> None:
        own = {f.name for f in fields(self)} - {"artifact", "app"}
        unknown = sorted(set(options) - own - set(AppArgs.model_fields) - {"artifact"})
        if unknown:
            raise FusionServeError(f"unknown server option(s): {', '.join(unknown)}")
        for name in own:
            object.__setattr__(self, name, options.pop(name, getattr(type(self), name)))
        object.__setattr__(self, "artifact", Path(artifact))
        for name, port in (("--port", self.port), ("--grpc-port", self.grpc_port)):
            if port is not None and not 0 <= port <= 65535:
                raise FusionServeError(f"{name} = {port} is out of range; allowed: 0..65535")
        if self.grpc_port is not None and self.grpc_port == self.port:
            raise FusionServeError(f"--grpc-port = {self.grpc_port} is the HTTP --port too; give gRPC its own port")
        if self.ingress not in VARIANTS:
            raise FusionServeError(f"--ingress = '{self.ingress}' is not known; allowed: {', '.join(INGRESSES)}")
        check_ranges(options, flags=True)  # before AppArgs checks them again, to name them as the command's flags
        object.__setattr__(self, "app", AppArgs(artifact=str(self.artifact.resolve()), **options))

    def options(self) -> dict[str, Any]:
        """The options this configuration was made with, but the artifact, as JSON values: ``ServerConfig(cfg.artifact,
        **cfg.options()) == cfg``."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("artifact", "app")}
        return own | {k: v for k, v in self.app.model_dump(mode="json", exclude_unset=True).items() if k != "artifact"}

    def app_args(self, **extra: Any) -> AppArgs:
        """The builder's arguments for this configuration; ``extra`` adds or overrides some (the artifact as the
        replicas see it, the metrics folder)."""
        return AppArgs(**(self.app.model_dump() | extra))


def start(
    cfg: ServerConfig,
    say: Callable[[str], object] = lambda _: None,
    after_ray: Callable[[], object] = lambda: None,
    run_folder: Path | None = None,
) -> str:
    """Start (or join, with RAY_ADDRESS) Ray, then Serve on host:port (and the gRPC port), and deploy the builder's
    application; returns the base URL. Where Serve already runs on the joined cluster it keeps its ports, so --port
    (and --grpc-port) must be the ones it listens on, and the port check leaves them to the node's ingress that holds
    them. ``say`` gets one line per step; ``after_ray`` runs as soon as Ray is up (Ray's start-up puts its own
    signal handlers in; serve_forever puts its own back there). ``run_folder``: this run's (default a new one), where
    HAProxy's and the metrics' files go; run folders left by servers that are gone are reaped first. Raises
    FusionServeError (port taken, a port other than the running Serve's, an application already deployed on the
    cluster without ``cfg.replace``, an unusable artifact or device, a loopback --host on a cluster of several
    machines) or ClusterError (Ray does not start)."""
    global _metrics_dir, _ingress_dir, _deployed
    artifact, held = _check_before_ray(cfg)
    before = {(pid, started_at(pid)) for pid in descendants(os.getpid())}  # not the run's: an embedder's own children
    address = os.environ.get("RAY_ADDRESS")
    _ingress_dir = str(run_folder or new_run_folder())
    _set_ray_env(cfg, Path(_ingress_dir))
    say(f"starting Ray ({'joining ' + address if address else 'a local instance'})")
    # --ship-artifact: Ray uploads the folder once and unpacks it on every node a replica starts on; Serve hands the
    # job's working_dir to the deployment, and the replicas load the artifact from their working directory
    connect(quiet=True, runtime_env={"working_dir": str(cfg.artifact)} if cfg.ship_artifact else None)
    after_ray()
    import ray
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # importing Serve set it to INFO
    running = _serve_details()  # None: no Serve on the cluster yet
    _refuse_to_replace(running, cfg.replace)
    _refuse_held(cfg.host, _check_ports(cfg, running, held) if running else held)
    _refuse_loopback_on_many_machines(ray, cfg.host)
    _metrics_dir = os.path.join(_ingress_dir, "metrics")
    os.makedirs(_metrics_dir, exist_ok=True)
    shipped = {"artifact": ".", "artifact_sha256": sha256(artifact.folder / MANIFEST)} if cfg.ship_artifact else {}
    application = app_builder(cfg.app_args(metrics_dir=_metrics_dir, **shipped))
    opts = cfg.app
    what = f"{opts.min_replicas}-{opts.max_replicas} (autoscaling)" if opts.max_replicas else str(opts.replicas)
    say(f"deploying {what} replica(s) of {cfg.artifact} behind the {cfg.ingress} ingress")
    if running is None:  # a running Serve keeps its own options (and says so in a notice that reads like a failure)
        serve.start(http_options={"host": cfg.host, "port": cfg.port}, grpc_options=grpc_options(cfg.grpc_port))
    _deployed = True  # from here on the application is this process's, even if serve.run fails halfway
    serve.run(application, name=APP_NAME, route_prefix="/")
    url = f"http://{cfg.host}:{cfg.port}"
    wait_routed(url)
    if _ingress_dir:
        wait_all_routed(Path(_ingress_dir), APP_NAME, opts.min_replicas or opts.replicas, say)
        # what a next start reaps if this run is killed, and what stop() ends
        record(Path(_ingress_dir), tree=[p for p in descendants(os.getpid()) if (p, started_at(p)) not in before])
    return url


def _check_before_ray(cfg: ServerConfig) -> tuple[Any, dict[int, str]]:
    """What fails before Ray starts: no Ray, a missing or unreadable artifact, a missing CUDA provider, a taken port
    (joining a cluster, a taken port is judged once Serve's own ports there are known; how many GPUs there are, Ray
    tells). Returns the artifact and the ports held (port -> holder)."""
    if importlib.util.find_spec("ray") is None:  # said before any step is announced (Ray is imported only later)
        raise ModuleNotFoundError("No module named 'ray'", name="ray")
    artifact = load_artifact(cfg.artifact, verify=False)
    # the graph is loaded once here, as predict loads it: a model.onnx ONNX Runtime cannot read (corrupt, yet with the
    # manifest's checksum) is one line now, not a replica's traceback from Ray after its start-up timeout
    make_session(
        artifact.model_path, threads=1, spin=False, device="cpu", optimization=ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    resolve_device(cfg.app.device)
    check_artifact(cfg.app)  # the options the artifact bounds (--default-task, --max-batch-tokens): before Ray too
    reap_stale()  # before the port check: a HAProxy left by a killed server of ours holds it, not another program
    held = {port: who for port in (cfg.port, cfg.grpc_port) if port is not None and (who := port_holder(cfg.host, port))}
    if not os.environ.get("RAY_ADDRESS"):  # a Ray of our own runs no Serve yet: whatever holds a port is not ours
        _refuse_held(cfg.host, held)
    return artifact, held


def _set_ray_env(cfg: ServerConfig, folder: Path) -> None:
    """The settings Ray's processes read when they start: the ingress's (HAProxy's files in ``folder``) and Serve's
    proxy's gRPC message limit. (What keeps them on loopback is in this process's environment from its start on:
    ``serve_supervised``.)"""
    os.environ.update(ingress_env(cfg.ingress, folder, cfg.app.body_timeout_s) | transport_env(cfg.app.max_body_bytes))


def grpc_options(port: int | None) -> dict[str, Any]:
    """Serve's gRPC options: fusionserve's servicer on ``port``, or none (Serve then starts no gRPC server)."""
    return {"port": port, "grpc_servicer_functions": [SERVICER]} if port is not None else {}


def _refuse_loopback_on_many_machines(ray: Any, host: str) -> None:
    """Every node's ingress (HAProxy, or Serve's proxy) reaches replicas on other machines at their node address, and
    the replicas listen on ``--host``: a loopback address would leave them unreachable from the other machines."""
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    if len(addresses) > 1 and host in LOOPBACK:
        raise FusionServeError(
            f"--host {host} on a cluster of {len(addresses)} machines ({', '.join(sorted(addresses))}): replicas would "
            "listen on loopback, unreachable from the other machines' ingress; pass --host 0.0.0.0 (and firewall the "
            "replica ports, see the docs' Scaling out guide)"
        )


def _serve_details() -> Any:
    """Serve on the joined cluster as its controller describes it (``ray.serve.schema.ServeInstanceDetails``: the HTTP
    and gRPC options it really listens with, each application and deployment with its options), or None when no Serve
    runs there. Serve's public calls do not give the listening options (``serve.status()`` leaves them out, and the
    dashboard's REST API that has them may be off), so this asks the controller through Serve's private client, the
    way ``serve.status()`` itself does (Ray 2.60); the only private API this module uses."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else ServeInstanceDetails(**client.get_serve_details())


def _refuse_to_replace(running: Any, replace: bool) -> None:
    """On a cluster that already runs fusionserve, deploying would silently replace it: refuse unless asked."""
    app = running.applications.get(APP_NAME) if running is not None else None
    if app is not None and not replace:
        raise FusionServeError(
            f"the Ray cluster at {os.environ.get('RAY_ADDRESS', 'this address')} already runs a '{APP_NAME}' application "
            f"({getattr(app.status, 'value', app.status)}); pass --replace to replace it, or serve on another cluster"
        )


def _check_ports(cfg: ServerConfig, running: Any, held: dict[int, str]) -> dict[int, str]:
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


def _refuse_held(host: str, held: dict[int, str]) -> None:
    """Raise FusionServeError for the first of ``held`` (port -> what holds it), naming the port and its holder."""
    if held:
        port, holder = next(iter(held.items()))
        raise FusionServeError(f"port {port} on {host} is already in use by {holder}; stop it or choose another port")


def _delete_if_ours(serve: Any) -> None:
    """Delete the cluster's fusionserve application if it is still the one this process deployed: its replicas pool
    their metrics in this server's own folder (``PROMETHEUS_MULTIPROC_DIR``, a fresh ``mkdtemp`` of this process),
    which a server that replaced it since (``--replace``) or a deployment by Ray's own tools does not name."""
    running = _serve_details()
    app = running.applications.get(APP_NAME) if running is not None else None
    if app is None:  # gone already (or serve.run failed before it was there)
        return
    deployment = app.deployments.get(DEPLOYMENT)
    options = deployment.deployment_config.ray_actor_options if deployment is not None else None
    env = (getattr(options, "runtime_env", None) or {}).get("env_vars") or {}  # options: a schema, or Serve's "unset"
    if _metrics_dir is not None and env.get(METRICS_ENV) == _metrics_dir:
        serve.delete(APP_NAME)
    else:
        print(f"fusionserve: the '{APP_NAME}' application was replaced by another deployment; leaving it", file=sys.stderr)


def stop() -> None:
    """Take the application down if this process deployed it (its replicas drain what they hold), leave Ray
    (shutting it down when this process started it; a joined cluster keeps running), and remove what this server
    left: HAProxy, which outlives Ray's shutdown, and the metric and ingress folders. Deleting the one application
    instead of shutting Serve down leaves another team's applications on a shared cluster alone (and spares the
    controller's own shutdown task, whose retry notice reads like a failure); a server refused before it deployed
    (the cluster already runs fusionserve) leaves the application it refused to replace alone, and one whose
    application another server replaced since (``--replace``) leaves the replacement alone."""
    global _deployed
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            if _deployed:
                _delete_if_ours(serve)
        except Exception as exc:  # Serve never came up, or is gone already: Ray still has to go
            print(f"fusionserve: could not delete the application: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            _deployed = False
            ray.shutdown()
    if _ingress_dir:
        end_run(Path(_ingress_dir))


def serve_supervised(cfg: ServerConfig) -> None:
    """``serve_forever`` in a child process under this one (``supervise``: whatever ends either, nothing of the run
    outlives them; see serving/process/supervise.py). Where it starts its own Ray, the child first execs itself afresh with the
    loopback shim preloaded (serving/process/loopback.py), or says once why it cannot. For a process of its own (the
    ``fusionserve serve`` command): in the caller, this never returns."""
    folder = supervise()
    if not os.environ.get("RAY_ADDRESS"):
        shim = loopback.find_shim()
        if shim.library is None:
            print(f"fusionserve: {loopback.fallback_warning(str(shim.problem))}", file=sys.stderr, flush=True)
        else:
            ports = loopback.open_ports(cfg.host, (cfg.port, cfg.grpc_port), LOOPBACK)
            handoff = {"artifact": str(cfg.artifact), "options": cfg.options(), "folder": str(folder), "shim": str(shim.library)}
            try:
                loopback.exec_preloaded(shim.library, ports, f"{__name__}:serve_handed_over", handoff)
            except OSError as exc:  # the interpreter cannot be started again: serve from this process as it is
                print(f"fusionserve: {loopback.fallback_warning(f'cannot exec {sys.executable}: {exc}')}", file=sys.stderr)
    serve_forever(cfg, run_folder=folder)


def serve_handed_over() -> None:
    """The supervised server, exec'd by ``serve_supervised`` with the loopback shim preloaded: its options and run
    folder from the handoff, then ``serve_forever``. Raises KeyError when started any other way."""
    handoff = loopback.take_handoff()
    resume_supervised()
    shim = Path(handoff["shim"])
    if not loopback.preloaded(shim):  # e.g. where the loader ignores LD_PRELOAD (secure execution)
        print(f"fusionserve: {loopback.fallback_warning(f'{shim} was not preloaded')}", file=sys.stderr, flush=True)
    try:
        serve_forever(ServerConfig(str(handoff["artifact"]), **handoff["options"]), run_folder=Path(str(handoff["folder"])))
    except FusionServeError as exc:  # a refusal, said as the command says every other one (cli/main.py)
        print(f"fusionserve: error: {exc}", file=sys.stderr, flush=True)
        supervise_end(2)


def serve_forever(cfg: ServerConfig, run_folder: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut Serve and Ray down (``run_folder``: the supervised server's, see
    ``serve_supervised``; default a new one, in this process, which then ends nothing itself). While starting,
    either signal is an interruption (``_Interrupted``, then the same clean-up); the handlers go in again once Ray is
    up, because Ray's start-up replaces them with its own, which prints a crash-style report and ends the process
    without cleaning up (HAProxy and some of Ray's processes then outlived the server). Raises what ``start`` raises,
    after cleaning up."""

    def say(text: str) -> None:
        print(f"fusionserve: {text}", file=sys.stderr, flush=True)

    _on_signals(_interrupt)
    try:
        url = start(cfg, say, after_ray=lambda: _on_signals(_interrupt), run_folder=run_folder)
    except _Interrupted:
        _on_signals(lambda *_: None)  # a second signal must not cut the clean-up short
        say("interrupted while starting; shutting down")
        stop()
        exit_with(0)
        return
    except BaseException as exc:
        exit_with(2 if isinstance(exc, FusionServeError | ModuleNotFoundError) else 1)  # as cli/main.py says it
        stop()
        raise
    done = threading.Event()
    _on_signals(lambda *_: done.set())
    say(f"serving {cfg.artifact} at {url} (docs at {url}/docs); Ctrl-C stops")
    try:
        # woken every second: a signal may be delivered to one of gRPC's or Ray's threads, and the main thread runs
        # the handler only once it wakes (a plain wait() then never returns)
        while not done.wait(1.0):
            dead = _ray_died()
            if dead:
                say(f"Ray's {dead} died under the server; ending what is left of it (exit 1, for its supervisor to restart it)")
                if run_folder is None:  # in the caller's own process: the usual stop below, and no exit
                    break
                end_run(run_folder)
                supervise_end(1)
    finally:
        say("shutting down")
        stop()
    exit_with(0)  # a clean stop: only now (a crash above leaves the exit code a failure, for Restart=on-failure)


def _ray_died() -> str | None:
    """Which of the Ray processes this server started and cannot serve without (the GCS, the raylet) has died, as
    "raylet (pid N)", or None. A dead raylet left the replicas answering from a node that can no longer restart
    anything, and the server waiting for a GCS call that never returns. Reads Ray's own record of the processes it
    started (a private API; a joined cluster's processes are not this server's, and are not in it)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return None
    for kind, process in node.dead_processes():
        if kind in ("raylet", "gcs_server"):
            return f"{kind} (pid {process.pid})"
    return None


def _on_signals(handler: Callable[[int, Any], object]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


class _Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while starting. A subclass, not KeyboardInterrupt itself: CPython marks a KeyboardInterrupt
    that leaves code run by exec() or eval() of a string (dataclasses and namedtuple build methods so, and start-up
    defines many) as unhandled even when it is caught later, and then ends the process by SIGINT after a clean
    shutdown (exit -2, no traceback); it checks the exact type."""


def _interrupt(signum: int, _frame: Any) -> None:
    raise _Interrupted(signal.Signals(signum).name)
