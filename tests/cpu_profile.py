"""Opt-in: the CPU seconds each test costs, Ray's and the servers' processes included (every process a test starts
lands in its worker's cgroup). Set FUSIONSERVE_CPU_CGROUP to a cgroup-v1 cpuacct folder this user may create in
(for example /sys/fs/cgroup/cpuacct/suite) and FUSIONSERVE_CPU_PROFILE to a folder: each pytest process (each xdist
worker) moves itself into a cgroup of its own under the first and writes, per test, the cgroup's CPU seconds and the
wall seconds of setup + call + teardown into the second. ``scripts/cpu_profile.py FOLDER`` prints the top modules
and tests. Without the two variables this plugin does nothing."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

CGROUP_ENV, OUT_ENV = "FUSIONSERVE_CPU_CGROUP", "FUSIONSERVE_CPU_PROFILE"


class CgroupProfile:
    def __init__(self, cgroup: Path, out: Path) -> None:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.group, self.out = cgroup / name, out / f"{name}.json"
        self.group.mkdir(parents=True, exist_ok=True)
        (self.group / "tasks").write_text(str(os.getpid()))
        self.rows: list[tuple[str, float, float]] = []

    def usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        cpu, wall = self.usage(), time.monotonic()
        yield
        self.rows.append((item.nodeid, self.usage() - cpu, time.monotonic() - wall))

    def pytest_sessionfinish(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.rows))


def register(config: pytest.Config) -> None:
    cgroup, out = os.environ.get(CGROUP_ENV), os.environ.get(OUT_ENV)
    if cgroup and out and not _controller(config):
        config.pluginmanager.register(CgroupProfile(Path(cgroup), Path(out)), "fusionserve-cpu-profile")


def _controller(config: pytest.Config) -> bool:
    """The xdist controller runs no test: only the workers (or a run without -n) profile."""
    return getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None) not in (None, 0)
