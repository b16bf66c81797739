"""A fusionserve server in this process: ``Server(cfg).serve_forever()`` starts (or joins) Ray, then Serve with the
fusionserve application, serves until SIGINT or SIGTERM, and shuts everything down in order. ``fusionserve serve``
runs it in a process of its own under a supervisor (serving/process/supervise.py); a program may embed it, as
``serve_forever`` (it then ends only the processes its run started, never the program's other children)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import onnxruntime as ort

from fusionserve.errors import FusionServeError

from .. import private
from ..api.grpc_ingress import transport_env
from ..builder import (
    SERVICER,
    AppArgs,
    app_builder,
    check_artifact,
    check_ranges,
    placement,
    refuse_cuda_for_cpu_only,
)
from ..model.artifact import MANIFEST, load_artifact, sha256
from ..model.openvino_runtime import require_openvino
from ..model.runtime import make_session, resolve_device
from .cluster import connect
from .ingress import INGRESSES, VARIANTS, drawn_ports, ingress_env
from .ports import listener, port_holder
from .routing import wait_all_routed, wait_routed
from .running_serve import (
    APP_NAME,
    LOOPBACK,
    check_ports,
    delete_if_ours,
    refuse_held,
    refuse_loopback_on_many_machines,
    refuse_to_replace,
)
from .runs import descendants, end_run, new_run_folder, reap_stale, record, started_at

PORT_ATTEMPTS = 3  # starts of Ray and Serve, each on freshly drawn ports, before a drawn port taken fails the start

__all__ = ["APP_NAME", "LOOPBACK", "Server", "ServerConfig", "check_before_ray", "placement", "serve_forever"]


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


def check_before_ray(cfg: ServerConfig, session: bool = True) -> tuple[Any, dict[int, str]]:
    """What fails before Ray starts: no Ray, a missing or unreadable artifact (``session``: its graph loaded once, as
    predict loads it: a model.onnx ONNX Runtime cannot read is one line then, not a replica's traceback from Ray), a
    bf16 artifact without OpenVINO, a missing CUDA provider, an option the artifact bounds, a taken port (joining a
    cluster, a taken port is judged once Serve's own ports there are known). Runs left by servers that are gone are
    reaped first. Returns the artifact and the ports held (port -> holder). Raises FusionServeError, or
    ModuleNotFoundError for Ray."""
    if importlib.util.find_spec("ray") is None:  # said before any step is announced (Ray is imported only later)
        raise ModuleNotFoundError("No module named 'ray'", name="ray")
    artifact = load_artifact(cfg.artifact, verify=False)
    if session:
        optimization = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        make_session(artifact.model_path, threads=1, spin=False, device="cpu", optimization=optimization)
    resolve_device(cfg.app.device)
    if artifact.manifest["precision"] == "bf16":  # its replicas run it with OpenVINO: missing, one line now
        require_openvino(f"{artifact.folder} (a bf16 artifact)")
        refuse_cuda_for_cpu_only(cfg.app.device, str(artifact.folder))
    check_artifact(cfg.app)  # the options the artifact bounds (--default-task, --max-batch-tokens)
    reap_stale()  # before the port check: a HAProxy left by a killed server of ours holds it, not another program
    held = {port: who for port in (cfg.port, cfg.grpc_port) if port is not None and (who := port_holder(cfg.host, port))}
    if not os.environ.get("RAY_ADDRESS"):  # a Ray of our own runs no Serve yet: whatever holds a port is not ours
        refuse_held(cfg.host, held)
    return artifact, held


def grpc_options(port: int | None) -> dict[str, Any]:
    """Serve's gRPC options: fusionserve's servicer on ``port``, or none (Serve then starts no gRPC server)."""
    return {"port": port, "grpc_servicer_functions": [SERVICER]} if port is not None else {}


def status_line(text: str, log_format: str = "text") -> str:
    """One line of the server's own news for its stderr: "fusionserve: text", or with ``--log-format json`` one JSON
    object, as the replicas' log lines."""
    if log_format != "json":
        return f"fusionserve: {text}"
    entry = {"asctime": time.strftime("%Y-%m-%d %H:%M:%S"), "levelname": "INFO", "name": "fusionserve", "message": text}
    return json.dumps(entry)


class Server:
    """One server: ``cfg``, its run folder (``run_folder``, default a new one: serving/process/runs.py), and whether a
    supervisor does its clean-up (``supervised``: the supervisor, this process's parent, checked ``cfg`` already and
    ends the run's processes once this one is gone; otherwise, or once the supervisor is gone, ``stop`` ends them)."""

    def __init__(self, cfg: ServerConfig, run_folder: Path | None = None, supervised: bool = False) -> None:
        self.cfg, self.supervised = cfg, supervised
        self.supervisor = os.getppid() if supervised else None
        self.folder = run_folder or new_run_folder()
        self.metrics_dir = str(self.folder / "metrics")  # where the replicas pool their Prometheus samples
        self.deployed = False  # this server deployed (or, with --replace, took over) the application
        self.serve_started = False  # this server started Serve on a Ray of its own

    def start(self, say: Callable[[str], object] = lambda _: None, after_ray: Callable[[], object] = lambda: None) -> str:
        """Start (or join, with RAY_ADDRESS) Ray, then Serve on host:port (and the gRPC port), and deploy the builder's
        application; returns the base URL. Where Serve already runs on the joined cluster it keeps its ports, so --port
        (and --grpc-port) must be the ones it listens on. A port the server drew for itself (``ingress.drawn_ports``)
        that another process took before Serve bound it: Ray and Serve are started again on freshly drawn ports, said in
        one line, up to ``PORT_ATTEMPTS`` starts in all. ``say`` gets one line per step; ``after_ray`` runs as soon as
        Ray is up (Ray's start-up puts its own signal handlers in). Raises FusionServeError (see ``check_before_ray``;
        --port or --grpc-port taken by another process while starting; a port other than the running Serve's, an
        application already deployed on the cluster without ``cfg.replace``, a loopback --host on a cluster of several
        machines) or ClusterError (Ray does not start)."""
        cfg = self.cfg
        artifact, held = check_before_ray(cfg, session=not self.supervised)
        before = {(pid, started_at(pid)) for pid in descendants(os.getpid())}  # not the run's: an embedder's children
        for attempt in range(1, PORT_ATTEMPTS + 1):
            # what Ray's processes read when they start: the ingress's settings (HAProxy's files in the run folder, the
            # ports drawn for it) and Serve's proxy's gRPC message limit (what keeps them on loopback is in the
            # environment the supervisor gave)
            env = ingress_env(cfg.ingress, self.folder, cfg.app.body_timeout_s) | transport_env(cfg.app.max_body_bytes)
            os.environ.update(env)
            try:
                url = self._start_serve(artifact, held, say, after_ray)
                break
            except Exception as exc:
                taken = self._taken(exc, drawn_ports(env))
                if taken is None or attempt == PORT_ATTEMPTS:
                    raise
                say(f"{taken}, before Serve bound it; starting again on fresh ports ({attempt + 1} of {PORT_ATTEMPTS})")
                self._leave_ray(shut_serve=self.serve_started)
                end_run(self.folder, remove=False)  # what the attempt started outside Ray (HAProxy), if it still runs
        # what stop() (or the supervisor, or a next start if this run is killed) ends
        record(self.folder, tree=[p for p in descendants(os.getpid()) if (p, started_at(p)) not in before])
        return url

    def _start_serve(
        self, artifact: Any, held: dict[int, str], say: Callable[[str], object], after_ray: Callable[[], object]
    ) -> str:
        """One start of Ray and Serve and the deployment (see ``start``), in the environment ``start`` set."""
        cfg = self.cfg
        if cfg.app.log_format == "json":  # each line written as it is logged (Serve's throughput settings buffer 1000)
            os.environ.update(private.serve_env({"RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": 1}))
        address = os.environ.get("RAY_ADDRESS")
        say(f"starting Ray ({'joining ' + address if address else 'a local instance'})")
        # --ship-artifact: Ray uploads the folder once and unpacks it on every node a replica starts on; Serve hands the
        # job's working_dir to the deployment, and the replicas load the artifact from their working directory
        connect(quiet=True, runtime_env={"working_dir": str(cfg.artifact)} if cfg.ship_artifact else None, serving=True)
        after_ray()
        import ray
        from ray import serve

        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # importing Serve set it to INFO
        running = private.serve_details()  # None: no Serve on the cluster yet
        refuse_to_replace(running, cfg.replace)
        refuse_held(cfg.host, check_ports(cfg, running, held) if running else held)
        refuse_loopback_on_many_machines(ray, cfg.host)
        os.makedirs(self.metrics_dir, exist_ok=True)
        shipped = {"artifact": ".", "artifact_sha256": sha256(artifact.folder / MANIFEST)} if cfg.ship_artifact else {}
        application = app_builder(cfg.app_args(metrics_dir=self.metrics_dir, **shipped))
        opts = cfg.app
        what = f"{opts.min_replicas}-{opts.max_replicas} (autoscaling)" if opts.max_replicas else str(opts.replicas)
        say(f"deploying {what} replica(s) of {cfg.artifact} behind the {cfg.ingress} ingress")
        if running is None:  # a running Serve keeps its own options (and says so in a notice that reads like a failure)
            serve.start(http_options={"host": cfg.host, "port": cfg.port}, grpc_options=grpc_options(cfg.grpc_port))
            self.serve_started = True  # (a drawn port taken fails serve.start, in its wait for the proxies)
        self.deployed = True  # from here on the application is this server's, even if serve.run fails halfway
        serve.run(application, name=APP_NAME, route_prefix="/")
        url = f"http://{cfg.host}:{cfg.port}"
        wait_routed(url)
        wait_all_routed(self.folder, APP_NAME, opts.min_replicas or opts.replicas, say)
        return url

    def _taken(self, failure: Exception, drawn: dict[int, str]) -> str | None:
        """Why the start failed, when it is a port taken by a process not of this server's (before Serve could bind
        it), as "port N (what) was taken by pid M (command)"; None for any other failure, or on a joined cluster, whose
        ports are its nodes'. Raises FusionServeError naming the holder when the port is one the user chose (--port,
        --grpc-port), never drawn again."""
        if os.environ.get("RAY_ADDRESS"):
            return None
        ours = set(descendants(os.getpid())) | {os.getpid()}
        foreign = {}
        for port in (self.cfg.port, self.cfg.grpc_port, *drawn):
            holder = listener("127.0.0.1", port) if port is not None else None
            if holder is not None and holder.pid not in ours:
                foreign[port] = str(holder)
        refuse_held(self.cfg.host, {p: who for p, who in foreign.items() if p in (self.cfg.port, self.cfg.grpc_port)})
        text = str(failure)
        for port, what in drawn.items():
            if port in foreign:
                return f"port {port} ({what}) was taken by {foreign[port]}"
            if str(port) in text and "bind" in text.lower():  # its holder is gone again: the failure names the port
                return f"port {port} ({what}) was taken by another process"
        return None

    def stop(self) -> None:
        """Take the application down if this server deployed it (its replicas drain what they hold) and leave Ray
        (shutting it down when this process started it; a joined cluster keeps running); unsupervised, end what the
        run left (HAProxy outlives Ray's shutdown) and remove its folder. Deleting the one application instead of
        shutting Serve down leaves another team's applications on a shared cluster alone, and an application another
        server replaced since (``--replace``) is left alone too."""
        self._leave_ray()
        if self.supervisor != os.getppid():  # no supervisor (embedded), or it was killed (then: this one's parent-death signal)
            end_run(self.folder)

    def _leave_ray(self, shut_serve: bool = False) -> None:
        """Take the application down if this server deployed it (``shut_serve``: Serve itself, which this server
        started, so that Serve's client forgets its controller: the next Ray's first job has this one's id), and leave
        Ray (see ``stop``)."""
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                if shut_serve:
                    serve.shutdown()
                    self.serve_started = False
                elif self.deployed:
                    delete_if_ours(serve, self.metrics_dir)
            except Exception as exc:  # Serve never came up, or is gone already: Ray still has to go
                print(f"fusionserve: could not delete the application: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                self.deployed = False
                ray.shutdown()

    def serve_forever(self) -> int:
        """Serve until SIGINT/SIGTERM, then stop; returns 0, or 1 when Ray's GCS or raylet died under the server (a
        supervised server then leaves the clean-up to its supervisor: Ray's shutdown would wait for what died).
        While starting, either signal is an interruption (``_Interrupted``, which Ray's ray.get, when the signal lands
        in it, raises again as a KeyboardInterrupt of its own; then the same stop); the handlers go in
        again once Ray is up, because Ray's start-up replaces them with its own, which ends the process without
        stopping anything. Raises what ``start`` raises, after stopping."""

        def say(text: str) -> None:
            print(status_line(text, self.cfg.app.log_format), file=sys.stderr, flush=True)

        _on_signals(_interrupt)
        try:
            url = self.start(say, after_ray=lambda: _on_signals(_interrupt))
        except KeyboardInterrupt:  # _Interrupted, or the KeyboardInterrupt that Ray's ray.get raises in its place
            _on_signals(lambda *_: None)  # a second signal must not cut the stop short
            say("interrupted while starting; shutting down")
            self.stop()
            return 0
        except BaseException:
            _on_signals(lambda *_: None)
            self.stop()
            raise
        # the handler only notes the signal: a handler that takes a lock (Event.set) deadlocked the server when the signal
        # came while the main thread held that lock itself (inside Event.wait); it then never stopped
        asked: list[int] = []
        _on_signals(lambda signum, _frame: asked.append(signum))
        say(f"serving {self.cfg.artifact} at {url} (docs at {url}/docs); Ctrl-C stops")
        died = False
        try:
            # woken every 0.1 s: a signal may be delivered to one of gRPC's or Ray's threads, and the main thread runs
            # the handler only once it wakes; Ray's processes are checked every second
            while not _sleep_unless(asked, 1.0):
                dead = _ray_died()
                if dead:
                    say(
                        f"Ray's {dead} died under the server; ending what is left of it (exit 1, for its supervisor to restart it)"
                    )
                    died = True
                    break
        finally:  # an error in the loop stops the server too, then goes on up
            if not (died and self.supervised):
                say("shutting down")
                self.stop()
            elif self.supervisor != os.getppid():  # its supervisor is gone too: no one else ends what is left
                end_run(self.folder)
        return 1 if died else 0


def serve_forever(cfg: ServerConfig, run_folder: Path | None = None, supervised: bool = False) -> int:
    """``Server(cfg, run_folder, supervised).serve_forever()``: 0 after a clean stop, 1 when Ray died under it."""
    return Server(cfg, run_folder, supervised).serve_forever()


def _sleep_unless(asked: list[int], seconds: float) -> bool:
    """Sleep ``seconds``, in steps of 0.1 s, unless ``asked`` (the signals noted) has one; whether it has."""
    deadline = time.monotonic() + seconds
    while not asked and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(asked)


def _ray_died() -> str | None:
    """Which of the Ray processes this server started and cannot serve without (the GCS, the raylet) has died, as
    "raylet (pid N)", or None. A dead raylet left the replicas answering from a node that can no longer restart
    anything, and the server waiting for a GCS call that never returns."""
    return private.dead_ray_process()


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
