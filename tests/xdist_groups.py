"""Whole groups per pytest-xdist worker (``pytest -n 2``): each test module runs whole on one worker, in its order, so
its module fixtures (a server, a Ray cluster) start once; the tests on the shared server (conftest's
``shared_server``) run as one group, ``stops_shared_server`` last, so it starts once in the whole run.

xdist's own ``--dist loadgroup`` would do this from ``xdist_group`` marks, but it renames the tests' node ids to carry
the group, which pytest 9.2 no longer lets a plugin do (pytest-xdist 3.8 sets an attribute pytest stopped reading:
every test then ran on either worker). So each worker writes which group each of its tests belongs to into a file
named by the run's id, and the controller's scheduler (``WholeGroups``, a ``--dist loadscope`` whose scopes are those
groups) reads it once every worker has collected. The workers collect in one order (conftest), the controller hands
out the groups in that order: the longest first."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest


def groups_file(run_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"fusionserve-xdist-groups-{run_id}.json"


def group_of(item: pytest.Item) -> str:
    return "shared_server" if "shared_server" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]


# The longest groups, longest first, as profiled (the runs' --durations, scripts/cpu_profile.py): each starts servers
# or Ray several times. A stale entry only costs balance, never a test.
LONGEST = [
    f"tests/test_{name}.py" if name != "shared_server" else name
    for name in (
        "serving_faults_load", "serve_config", "open_inference", "serving_faults", "shared_server", "backbones_int8",
        "backbones_export", "default_model", "cluster", "head_kinds_export", "backbones_serving", "process_cleanup",
        "score_ray", "loopback", "serving_api", "live_tasks", "heads_files", "heads_serving", "tracing_server", "live_serving",
        "int8_serving", "drawn_port_taken", "serving_e2e",
    )
]  # fmt: skip


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items by group: the LONGEST in that order, then the groups with the most ``slow`` tests (servers, Ray,
    long processes), the rest in collection order after them. The short groups then fill both workers at the end,
    instead of one long module running alone."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(group_of(item), []).append(item)
    slow = {name: sum(1 for i in group if i.get_closest_marker("slow")) for name, group in groups.items()}
    rank = {name: (LONGEST.index(name) if name in LONGEST else len(LONGEST), -slow[name]) for name in groups}
    return [item for name in sorted(groups, key=rank.__getitem__) for item in groups[name]]


def write_groups(items: list[pytest.Item]) -> None:
    """In a worker: node id -> group, for the controller (every worker writes the same; the last one stays)."""
    path = groups_file(os.environ["PYTEST_XDIST_TESTRUNUID"])
    part = path.with_suffix(f".{os.getpid()}")
    part.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    os.replace(part, path)


def make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WholeGroups(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                path = groups_file(self.nodes[0].workerinput["testrunuid"])
                self.groups = json.loads(path.read_text())
                path.unlink(missing_ok=True)
            return self.groups.get(nodeid, nodeid.split("::")[0])

    config.option.loadscopereorder = False  # the workers' order: longest first
    return WholeGroups(config, log)
