"""FUSIONSERVE_PORT_RANGE: the ports a server draws its own from (serving/process/ports.py), validated with an error
that names it, and honoured by every draw; the test suite's parallel workers each get a slice of their own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fusionserve.errors import FusionServeError
from fusionserve.serving.process.ports import REPLICA_GRPC_PORTS, draw_range, free_port, replica_grpc_ports
from fusionserve.settings import PORT_RANGE_ENV, port_range
from tests.serving_helpers import free_port as a_free_port


def test_every_draw_falls_in_the_range_it_is_given(monkeypatch):
    base = draw_range()  # this worker's slice under pytest-xdist
    monkeypatch.setenv(PORT_RANGE_ENV, f"{base.start} - {base.start + 299}")  # blanks around the dash are fine
    assert draw_range() == range(base.start, base.start + 300)
    grpc = replica_grpc_ports()
    assert len(grpc) == REPLICA_GRPC_PORTS + 1 and base.start <= grpc.start and grpc.stop <= base.start + 300
    ports = [free_port() for _ in range(40)]
    assert all(base.start <= p < base.start + 300 and p not in grpc for p in ports) and len(set(ports)) == len(ports)


def test_a_full_range_is_an_error_that_names_it(monkeypatch):
    base = draw_range()
    monkeypatch.setenv(PORT_RANGE_ENV, f"{base.start}-{base.start + 2 * (REPLICA_GRPC_PORTS + 1) - 1}")
    with pytest.raises(FusionServeError, match=f"no free port left in {PORT_RANGE_ENV}"):
        for _ in range(2 * (REPLICA_GRPC_PORTS + 1) + 1):  # more than it holds: this process remembers its draws
            free_port()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("abc", "is not a port range; expected LOW-HIGH"),
        ("30000", "is not a port range; expected LOW-HIGH"),
        ("-1-2000", "is not a port range"),
        ("100-2000", "out of range; allowed: 1024 <= LOW <= HIGH <= 65535"),
        ("30000-20000", "out of range"),
        ("60000-70000", "out of range"),
        ("30000-30099", "holds 100 ports; a server needs at least 130"),
    ],
)
def test_a_bad_range_is_refused_with_what_is_allowed(monkeypatch, value, says):
    monkeypatch.setenv(PORT_RANGE_ENV, value)
    with pytest.raises(FusionServeError, match=f"{PORT_RANGE_ENV} = {value!r}.*{says}"):
        free_port()


def test_unset_or_empty_means_the_default_range(monkeypatch):
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    assert port_range() is None and draw_range() == range(20000, 32640)
    monkeypatch.setenv(PORT_RANGE_ENV, " ")
    assert port_range() is None


def test_serve_refuses_a_bad_range_in_one_line_before_ray_starts(artifact, tmp_path):
    env = dict(os.environ, **{PORT_RANGE_ENV: "20000"})
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(a_free_port())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert f"{PORT_RANGE_ENV} = '20000' is not a port range" in done.stderr and "Traceback" not in done.stderr
    assert "starting Ray" not in done.stdout + done.stderr


def test_parallel_workers_draw_from_slices_of_their_own(monkeypatch):
    """tests/conftest.py: worker gwN of a ``-n K`` run takes the N-th of K equal slices of the range."""
    from tests.conftest import _worker_port_range

    slices = []
    for n in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
        _worker_port_range()
        slices.append(draw_range())
    assert slices == [range(20000, 24213), range(24213, 28426), range(28426, 32639)]
