"""tests/xdist_groups.py: which tests run together and in what order (stand-in items, no server started). The modules
of one ``xdist_group`` share a server or Ray only if they run in one row, with the test that stops it last. And
serving_helpers.SharedServers, what they share."""

import pytest

from tests.serving_helpers import SharedServers
from tests.xdist_groups import LONGEST, group_of, in_groups


class Item:
    """What xdist_groups reads of a pytest item: its node id, fixture names and marks."""

    def __init__(self, nodeid: str, fixtures: tuple[str, ...] = (), group: str | None = None, stops: bool = False):
        self.nodeid, self.fixturenames = nodeid, list(fixtures)
        self.marks = {"xdist_group": pytest.mark.xdist_group(group).mark} if group else {}
        if stops:
            self.marks["stops_shared_server"] = pytest.mark.stops_shared_server.mark

    def get_closest_marker(self, name: str):
        return self.marks.get(name)

    def __repr__(self) -> str:
        return self.nodeid


def test_a_tests_group_is_the_shared_server_its_modules_mark_or_its_module():
    assert group_of(Item("tests/test_a.py::t", ("artifact", "shared_server"), group="g")) == "shared_server"
    assert group_of(Item("tests/test_a.py::t", ("keyed_server",), group="keyed_server")) == "keyed_server"
    assert group_of(Item("tests/test_a.py::t[x]", ("artifact",))) == "tests/test_a.py"


def test_a_group_runs_in_one_row_where_its_first_test_was_and_its_stopping_test_last():
    a1, a2 = Item("tests/test_a.py::one"), Item("tests/test_a.py::two")
    api = Item("tests/test_api.py::t", ("keyed_server",), group="keyed_server")
    b = Item("tests/test_b.py::t")
    e2e_stop = Item("tests/test_e2e.py::stop", ("keyed_server",), group="keyed_server", stops=True)
    e2e = Item("tests/test_e2e.py::t", ("keyed_server",), group="keyed_server")
    shared_stop = Item("tests/test_h.py::stop", ("shared_server",), stops=True)
    shared = Item("tests/test_l.py::t", ("shared_server",))
    c = Item("tests/test_c.py::t")
    items = [a1, api, b, shared_stop, e2e_stop, shared, e2e, a2, c]
    assert in_groups(items) == [a1, api, e2e, e2e_stop, b, a2, c, shared, shared_stop]
    assert in_groups(in_groups(items)) == in_groups(items)  # xdist's workers order again what they collected


def test_the_longest_groups_are_groups():
    """A stale name would leave its group unranked (the longest groups go first so that both workers end together): a
    module named there carries no ``xdist_group`` mark (its tests' group is the mark's), and a group named there is
    the shared server's or a mark's."""
    from pathlib import Path

    texts = {path.name: path.read_text() for path in Path(__file__).parent.glob("test_*.py")}
    modules = [name for name in LONGEST if name.startswith("tests/")]
    assert modules and all(name.removeprefix("tests/") in texts for name in modules)
    assert [name for name in modules if "pytest.mark.xdist_group(" in texts[name.removeprefix("tests/")]] == []
    marked = {name for name in LONGEST if not name.startswith("tests/") and name != "shared_server"}
    assert {name for name in marked if not any(f'xdist_group("{name}")' in text for text in texts.values())} == set()


def test_a_shared_server_that_did_not_start_fails_the_tests_after_it_at_once(tmp_path):
    """Each test of a group asks for its server: after a failed start they fail saying so, instead of each starting it
    again (up to 240 s each)."""
    servers = SharedServers(tmp_path)
    with pytest.raises(pytest.fail.Exception, match="server exited with"):
        servers.get("broken", tmp_path / "no-artifact")
    with pytest.raises(pytest.fail.Exception, match="'broken' did not start earlier in this session: server exited"):
        servers.get("broken", tmp_path / "no-artifact")
    assert servers.starts == {"broken": 1}
