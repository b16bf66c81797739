"""The container image, built and run here (issue 19): `scripts/build_image.py cpu` builds the CPU variant with
buildah from a local Debian base; the image's own entrypoint starts inside it (`buildah run`, chroot isolation,
host network, as `docker run` would with arguments after the image name); from outside, /readyz turns 200 and
/v1/classify answers; every process of the server runs as the image's non-root user; the image holds no torch;
SIGTERM to the entrypoint (what `docker stop` sends) stops it with its own clean-up and leaves nothing running.

Opt-in (building and running took 4 to 19 minutes here, on 2 cores shared with other work, by their load):
`pytest -m image --image`. Skips, with the reason, where buildah or debootstrap is missing or the user is not root."""

import contextlib
import importlib.util
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.serving_helpers import alive, call, descendants, free_port, is_loopback, listeners_once_up

pytestmark = [pytest.mark.slow, pytest.mark.image]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "build_image.py"
TAG = "localhost/fusionserve-test:cpu"  # not the script's default name: the test removes it afterwards
USER_UID = 10001  # the Dockerfile's `useradd --uid`


def _script():
    spec = importlib.util.spec_from_file_location("build_image", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def buildah(*args: str) -> str:
    done = subprocess.run(["buildah", *_script().STORAGE, *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"buildah {' '.join(args)}: {done.stderr[-2000:]}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install -y buildah debootstrap): no image can be built here")
    if os.geteuid() != 0:
        pytest.skip("buildah with chroot isolation and debootstrap need root on these machines")
    # the quick parity grid: the built-in model's full grid runs in tests/test_default_model.py
    cmd = [sys.executable, str(SCRIPT), "cpu", "--tag", TAG, "--", "--build-arg", "PARITY_GRID=quick"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, f"build failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    print(done.stdout.splitlines()[-1])  # the image's size and build time
    yield TAG
    buildah("rmi", TAG)  # the vfs store keeps full copies of every layer


@contextmanager
def container(image: str) -> Iterator[str]:
    # buildah's default of 1024 open files is too few for the HAProxy ingress (it asks for about 10,300): the host's
    # hard limit, as high as buildah can set it here
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    ctr = buildah("from", "--pull=never", f"--ulimit=nofile={nofile}:{nofile}", image)
    try:
        yield ctr
    finally:
        buildah("rm", ctr)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, limit_s: float = 300) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if proc.poll() is not None:
            pytest.fail(f"the container's server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if call(url + "/readyz", timeout=5)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass  # not listening yet
        time.sleep(0.25)
    pytest.fail(f"/readyz not 200 within {limit_s} s:\n{log.read_text()[-3000:]}")


def uid_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/status").read_text().split("\nUid:", 1)[1].split()[0])
    except (OSError, IndexError):
        return None  # gone meanwhile


def entrypoint_pid(proc: subprocess.Popen) -> int:
    """The process of `fusionserve serve /artifact` below `buildah run`: the Python process itself, not buildah's
    chroot helper above it (`buildah-chroot-exec /opt/venv/bin/fusionserve serve /artifact ...`), whose arguments
    hold the same words and which answers SIGTERM by killing the server with SIGKILL."""
    for pid in sorted(descendants(proc.pid)):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode(errors="replace")).name.startswith("python") and argv[2:4] == [b"serve", b"/artifact"]:
            return pid
    pytest.fail("no `fusionserve serve` process below buildah run")


def image_user_processes() -> set[int]:
    """The live processes of the image's user (uid 10001, which nothing on the host uses). Not by an environment
    variable: Ray's agents retitle themselves past their short argument area in the image and blank their
    environment."""
    return alive({int(p.name) for p in Path("/proc").glob("[0-9]*") if uid_of(int(p.name)) == USER_UID})


def stop(proc: subprocess.Popen, before: set[int], bound_s: float = 60) -> tuple[int, dict[int, bytes]]:
    """SIGTERM to the server, as `docker stop` sends it to the entrypoint (its own shutdown takes Serve, Ray and
    HAProxy along). Returns how `buildah run` exited and which processes of the image's user that were not there
    ``before`` still ran ``bound_s`` after the signal; it then kills them."""
    sent = time.monotonic()
    if proc.poll() is None:
        os.kill(entrypoint_pid(proc), signal.SIGTERM)
        try:
            proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    while image_user_processes() - before and time.monotonic() - sent < bound_s:
        time.sleep(0.2)
    left = {}
    for pid in image_user_processes() - before:
        with contextlib.suppress(OSError):  # gone meanwhile
            left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()[:80]
            os.kill(pid, signal.SIGKILL)
    return proc.wait(), left


def test_cpu_image_serves_from_its_entrypoint_as_non_root_without_torch(image, tmp_path):
    config = json.loads(buildah("inspect", "--type", "image", image))["Docker"]["config"]
    assert config["User"] == "fusionserve" and config["Entrypoint"][:3] == ["fusionserve", "serve", "/artifact"]
    assert any("/readyz" in word for word in config["Healthcheck"]["Test"])  # kept: the image is in docker format
    with container(image) as ctr:
        found = buildah("run", "--isolation", "chroot", ctr, "--", "python", "-c",
                        "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])")  # fmt: skip
        assert found == "[]"
        port, log = free_port(), tmp_path / "serve.log"
        # what `docker run IMAGE --port N` does: the entrypoint plus the arguments after the image name
        cmd = ["buildah", *_script().STORAGE, "run", "--isolation", "chroot", "--network", "host", ctr, "--",
               *config["Entrypoint"], "--port", str(port)]  # fmt: skip
        before = image_user_processes()
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            ready_s = wait_ready(url, proc, log)
            print(f"start to ready: {ready_s:.1f} s")
            status, body = call(url + "/v1/classify", {"task": "bbc_news", "inputs": [
                "Manchester United beat Chelsea 3-1 in the Premier League on Saturday",
                "The central bank raised interest rates to curb inflation"]})  # fmt: skip
            assert status == 200, body
            assert [p["label"] for p in body["predictions"]] == ["sports", "business"]
            server = entrypoint_pid(proc)
            uids = {pid: uid_of(pid) for pid in {server} | descendants(server)}  # Ray's processes, HAProxy, replicas
            assert len(uids) > 1 and set(uids.values()) - {None} == {USER_UID}, uids
            # the entrypoint's --host 0.0.0.0 opens the serving port only: Ray's and HAProxy's other listeners stay
            # on loopback through the shim built into the wheel the image installed, without a compiler in it
            found = listeners_once_up(server, {port})
            outside = sorted({(name, ip, p) for name, ip, p in found if not is_loopback(ip)})
            assert len(found) > 10 and [p for _, _, p in outside] == [port], (outside, sorted(found))
        finally:
            code, left = stop(proc, before)
        # stopped as `docker stop` stops it: the server's own clean-up, nothing of the container left running
        text = log.read_text()
        assert code == 0 and "shutting down" in text and "SIGTERM received" not in text, text[-3000:]
        assert not left, left
