"""The HAProxy wrapper (serving/haproxy_rules.py) always runs the real HAProxy, also in a process that starts a second
server after the first one's run folder (with its wrapper) was removed. No Ray here."""

from __future__ import annotations

import shutil

import pytest

from fusionserve.serving.haproxy_rules import BINARY_ENV, real_haproxy, write_wrapper


def test_a_removed_wrapper_of_an_earlier_server_is_not_taken_for_the_binary(tmp_path, monkeypatch):
    """ingress_env sets RAY_SERVE_HAPROXY_BINARY_PATH to its wrapper in this process's environment; once that server
    stopped and its run folder was removed, the next server's wrapper ran the removed file ('setpriv: failed to
    execute .../haproxy: No such file or directory'), and no HAProxy started."""
    monkeypatch.delenv(BINARY_ENV, raising=False)
    binary = real_haproxy()
    if binary is None:
        pytest.skip("no HAProxy on this machine")
    first = write_wrapper(tmp_path / "fs-first", [binary], 30.0)
    monkeypatch.setenv(BINARY_ENV, str(first))  # what the first server's ingress_env left in os.environ
    assert real_haproxy() == binary  # the wrapper is recognised while it exists
    shutil.rmtree(first.parent)
    assert real_haproxy() == binary


def test_a_binary_the_user_named_is_kept(tmp_path, monkeypatch):
    own = tmp_path / "my-haproxy"
    own.write_text("#!/bin/sh\nexit 0\n")
    own.chmod(0o755)
    monkeypatch.setenv(BINARY_ENV, str(own))
    assert real_haproxy() == str(own)
