"""Start to ready of the CPU container image (issue 19; target under 30 s), against the same artifact served by the
project's own venv, round-robin in one run so that the shared machine's load hits both alike.

    python -m benchmarks.image_start [--image localhost/fusionserve:cpu] [--rounds 3]

Container: ``buildah from`` (outside the timing), then ``buildah run --isolation chroot --network host`` of the
image's entrypoint with ``--port P`` after it, timed from launch to the first 200 on ``/readyz``. Native: the
image's ``/artifact`` copied out once, ``python -m fusionserve.cli.main serve ARTIFACT --device cpu --port P``.
Needs root, buildah and an image built by ``scripts/build_image.py cpu``."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

STORAGE = ["--storage-driver", "vfs"]


def buildah(*args: str) -> str:
    return subprocess.run(["buildah", *STORAGE, *args], capture_output=True, text=True, check=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready_after(proc: subprocess.Popen, port: int, log: Path, start: float, limit_s: float = 300) -> float:
    while time.perf_counter() - start < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                if resp.status == 200:
                    return time.perf_counter() - start
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"not ready in {limit_s} s:\n{log.read_text()[-2000:]}")


def server_pid(root: int) -> int:
    """The `fusionserve serve /artifact` Python process below `buildah run`; not buildah's chroot helper above it,
    whose arguments hold the same words (`buildah-chroot-exec /opt/venv/bin/fusionserve serve /artifact ...`) and
    which answers SIGTERM by killing the server with SIGKILL: no clean-up, HAProxy and Ray's agents left running."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode(errors="replace")).name.startswith("python") and argv[2:4] == [b"serve", b"/artifact"]:
            return int(entry.name)
    return root


def run_once(cmd: list[str], port: int, log: Path, contained: bool) -> float:
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        return ready_after(proc, port, log, start)
    finally:
        if proc.poll() is None:
            # the server's own shutdown takes Ray along
            os.kill(server_pid(proc.pid) if contained else proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--image", default="localhost/fusionserve:cpu")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    config = json.loads(buildah("inspect", "--type", "image", args.image))["Docker"]["config"]
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # buildah's default 1024 would cut HAProxy to 307 connections
    ctr = buildah("from", "--pull=never", f"--ulimit=nofile={nofile}:{nofile}", args.image)
    work = Path(tempfile.mkdtemp(prefix="image-start-"))
    times: dict[str, list[float]] = {"container": [], "native": []}
    try:
        shutil.copytree(Path(buildah("mount", ctr)) / "artifact", work / "artifact")
        buildah("umount", ctr)
        for r in range(args.rounds):
            for name in times:
                port = free_port()
                if name == "container":
                    cmd = ["buildah", *STORAGE, "run", "--isolation", "chroot", "--network", "host", ctr, "--",
                           *config["Entrypoint"], "--port", str(port)]  # fmt: skip
                else:
                    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(work / "artifact"), "--device", "cpu",
                           "--port", str(port)]  # fmt: skip
                times[name].append(run_once(cmd, port, work / f"{name}-{r}.log", name == "container"))
                print(f"round {r + 1} {name}: ready after {times[name][-1]:.1f} s", flush=True)
    finally:
        subprocess.run(["buildah", *STORAGE, "rm", ctr], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
    c, n = statistics.median(times["container"]), statistics.median(times["native"])
    print("\n| start to /readyz 200 | median | all |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} s | {', '.join(f'{v:.1f}' for v in values)} |")
    print(f"\ncontainer / native: {c / n:.2f}x")


if __name__ == "__main__":
    main()
