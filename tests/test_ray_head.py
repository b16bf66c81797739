"""The local Ray a server starts (serving/private.py: lean_head): its GCS, raylet, dashboard head, the raylet's
dashboard and runtime-env agents, Serve's controller and the replica, but no autoscaler monitor and no log monitor,
two processes of Ray's head that a single-node server never uses (each cost a start CPU time and memory). Checked on
the shared server: an upgrade of Ray that ignored the settings would start them again."""

from __future__ import annotations

from pathlib import Path

from tests.serving_helpers import Served, call, descendants

TEXT = {"task": "rte", "inputs": ["a fine film"]}
LEFT_OUT = ("ray/autoscaler/_private/monitor.py", "ray/_private/log_monitor.py")


def _commands(pid: int) -> list[str]:
    out = []
    for child in descendants(pid):
        try:
            out.append(Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").replace("\0", " "))
        except OSError:  # ended in between
            continue
    return out


def test_the_servers_ray_has_no_autoscaler_monitor_and_no_log_monitor(shared_server: Served):
    status, _ = call(shared_server.url + "/v1/classify", TEXT)
    assert status == 200
    commands = _commands(shared_server.proc.pid)
    for part in (
        "gcs_server",
        "raylet",
        "ray/dashboard/dashboard.py",
        "ray::DashboardAgent",
        "ray::RuntimeEnvAgent",
        "ray::ServeController",
    ):
        assert any(part in c for c in commands), (part, commands)
    started = [c for c in commands if any(script in c for script in LEFT_OUT)]
    assert not started, started
