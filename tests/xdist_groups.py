"""Whole groups per pytest-xdist worker (``pytest -n N``; CI runs ``-n 3``): each test module runs whole on one
worker, in its order, so its module fixtures (a server, a Ray cluster) start once; the tests on the shared server
(conftest's ``shared_server``) run as one group, and so do the modules of one ``xdist_group`` mark (several modules on
one of conftest's shared servers, or on its ``local_ray``), ``stops_shared_server`` last, so that each starts once in
the run.

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


# The shared servers' fixtures (conftest) -> their names in SharedServers.
SERVERS = {"shared_server": "shared", "keyed_server": "keyed", "oip_server": "oip"}


def group_of(item: pytest.Item) -> str:
    """The tests on conftest's ``shared_server``; a module's ``xdist_group`` mark (several modules on one shared
    server); or the test's module."""
    if "shared_server" in getattr(item, "fixturenames", ()):
        return "shared_server"
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return mark.args[0] if mark.args else mark.kwargs["name"]
    return item.nodeid.split("::")[0]


def in_groups(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items in collection order, but each ``xdist_group`` together where its first test is, and the tests on the
    shared server at the end; in each group those marked ``stops_shared_server`` last. A shared server then starts
    once, even without xdist, and does not sit idle (a Ray node, Serve and a replica) while other tests run."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        named = group_of(item) != item.nodeid.split("::")[0]
        groups.setdefault(group_of(item) if named else item.nodeid, []).append(item)
    order = sorted(groups, key=lambda name: name == "shared_server")
    stops = lambda item: item.get_closest_marker("stops_shared_server") is not None  # noqa: E731
    return [item for name in order for item in sorted(groups[name], key=stops)]


# The longest groups, longest first, as profiled (the runs' --durations, scripts/cpu_profile.py): each starts servers
# or Ray several times. A stale entry only costs balance, never a test.
LONGEST = [
    name if name.endswith(("_server", "_ray")) else f"tests/test_{name}.py"
    for name in (
        "serving_faults_load", "serve_config", "oip_server", "serving_faults", "shared_server", "backbones_int8",
        "backbones_export", "default_model", "cluster", "head_kinds_export", "backbones_serving",
        "local_ray", "keyed_server", "live_tasks", "heads_serving", "live_serving", "bf16_serving",
        "int8_serving", "drawn_port_taken",
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
