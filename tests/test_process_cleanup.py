"""The process machinery's own faults: a server whose serving loop crashes exits non-zero (so that systemd's
``Restart=on-failure`` restarts it) and leaves nothing; clean-up ends only the processes a run started (a ``tail -f``
of its HAProxy config, or an embedding program's other children, are not the run's); each test ends only what it
started, by pid."""

import os
import signal
import subprocess
import textwrap
import time

import pytest

from tests.serving_helpers import MARK_ENV, carrying, haproxy_config, launch, new_mark

# Loaded by every Python process of the server (PYTHONPATH): once the server's module is imported, its serving loop's
# per-second check raises, as an unexpected error in the loop would.
CRASH = textwrap.dedent(
    """
    import importlib.abc, importlib.util, sys

    TARGET = "fusionserve.serving.process.server"

    def _crash(*args, **kwargs):
        raise RuntimeError("the serving loop crashed (made to, by tests/test_process_cleanup.py)")

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module._ray_died = _crash

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
    """
)


@pytest.fixture
def marked():
    mark = new_mark()
    yield mark, dict(os.environ, **{MARK_ENV: mark})
    for pid in carrying(mark):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_crash_of_the_serving_loop_exits_1_and_leaves_nothing(artifact, tmp_path, marked):
    """An uncaught exception in the serving loop ended the supervised server with exit 0 (its exit code stayed 0
    unless a start-up failure set it), so the supervisor exited 0 and Restart=on-failure did not restart it."""
    mark, env = marked
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
    served = launch(artifact, tmp_path / "serve.log", env=env, own_group=True)
    folder = haproxy_config(served.proc.pid).parent.parent
    try:
        code = served.proc.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running 120 s after its serving loop crashed:\n{served.log.read_text()[-3000:]}")
    text = served.log.read_text()
    assert code == 1, text[-3000:]
    assert "the serving loop crashed" in text, text[-3000:]
    deadline = time.monotonic() + 30
    while carrying(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not carrying(mark) and not folder.exists()
