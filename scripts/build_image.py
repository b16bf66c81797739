"""Build fusionserve's container image on a machine without a Docker engine or an image registry: buildah builds
the repository's Dockerfile from a local Debian 12 base that debootstrap makes (Debian's registry is all it needs).

    python3 scripts/build_image.py cpu        # -> localhost/fusionserve:cpu
    python3 scripts/build_image.py gpu        # -> localhost/fusionserve:gpu (builds anywhere; runs only on a GPU)

Needs root and `apt-get install buildah debootstrap`. Only the Python standard library: it runs with any python3.

- The base (``localhost/fusionserve-base:bookworm``: ``debootstrap --variant=minbase`` plus python3 and
  python3-venv, about 40 s) is made once and reused; ``--rebuild-base`` makes it again.
- pip inside the build sees the host's pip configuration: ``pip config list`` (files and PIP_* variables) is
  written to a pip.conf mounted at /etc/pip.conf during the build, and every local path it names (find-links
  folders, file:// indexes with the files beside them, the CA bundle, constraint files) is mounted read-only at
  the same path. ``torch==2.13.0`` therefore resolves exactly as on the host. Nothing of it reaches the image.
- ``buildah bud --isolation chroot --network host --storage-driver vfs --format docker``: chroot because these
  machines cannot start OCI runtimes, vfs because overlay mounts are not available, docker format because the
  OCI format drops the HEALTHCHECK.

Run the image with ``buildah from`` + ``buildah run --isolation chroot --network host CONTAINER -- CMD``
(tests/test_image.py does, docs/guides/container.md shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
BASE = "localhost/fusionserve-base:bookworm"
STORAGE = ("--storage-driver", "vfs")
SUITE = "bookworm"  # Debian 12: python3 is 3.11, as in python:3.11-slim
BASE_PACKAGES = ("python3", "python3-venv")  # venv brings ensurepip's wheels: the Dockerfile makes /opt/venv
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class BuildError(RuntimeError):
    """A tool is missing or a step failed; the message says which and what to do."""


def buildah(*args: str, capture: bool = True) -> str:
    """One buildah command on the vfs store; its output when ``capture``, else it prints as it runs."""
    cmd = ["buildah", *STORAGE, *args]
    done = subprocess.run(cmd, text=True, capture_output=capture, check=False)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed (exit {done.returncode}): {(done.stderr or '').strip()[-2000:]}")
    return (done.stdout or "").strip()


def image_exists(name: str) -> bool:
    cmd = ["buildah", *STORAGE, "inspect", "--type", "image", name]
    return subprocess.run(cmd, capture_output=True, check=False).returncode == 0


def image_size(name: str) -> int:
    """Bytes of the image's layers as stored, uncompressed (`buildah images` shows the same, rounded)."""
    cmd = ["buildah", *STORAGE, "inspect", "--type", "image", name]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildError(f"no image {name}: {done.stderr.strip()}")
    manifest = json.loads(json.loads(done.stdout)["Manifest"])
    return sum(int(layer["size"]) for layer in manifest["layers"])


def require(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise BuildError(f"{', '.join(missing)} not found: apt-get install -y {' '.join(missing)}")
    if os.geteuid() != 0:
        raise BuildError("buildah with chroot isolation and debootstrap need root here")


def apt_mirror() -> str:
    """The host's Debian mirror (deb822 sources first, then sources.list), so the base comes from where apt does."""
    for path in [*sorted(Path("/etc/apt/sources.list.d").glob("*.sources")), Path("/etc/apt/sources.list")]:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            words = line.split()
            if words[:1] == ["URIs:"] and len(words) > 1 and words[1].rstrip("/").endswith("/debian"):
                return words[1]
            if words[:1] == ["deb"] and len(words) > 2 and words[1].rstrip("/").endswith("/debian"):
                return words[1]
    return DEFAULT_MIRROR


def make_base(mirror: str) -> float:
    """debootstrap a minimal Debian 12 with python3 straight into a scratch container, commit it as BASE."""
    start = time.monotonic()
    ctr = buildah("from", "scratch")
    try:
        rootfs = buildah("mount", ctr)
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, rootfs, mirror]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd, check=False).returncode != 0:
            raise BuildError(f"debootstrap failed (mirror {mirror}); its log: {rootfs}/debootstrap/debootstrap.log")
        # the package cache and lists would only make the image larger: nothing in the build runs apt
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (Path(rootfs) / junk).glob("*"):
                if item.is_file():
                    item.unlink()
        buildah("umount", ctr)
        buildah("config", "--env", "LANG=C.UTF-8", "--cmd", "/bin/bash", ctr)
        buildah("commit", "--quiet", ctr, BASE)
    finally:
        subprocess.run(["buildah", *STORAGE, "rm", ctr], capture_output=True, check=False)
    return time.monotonic() - start


def pip_settings() -> dict[str, dict[str, str]]:
    """The host's pip configuration by section, as `pip config list` gives it: files, then PIP_* variables
    (':env:' rows, which pip lets win) folded into [global]."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildError(f"pip config list failed: {done.stderr.strip()}")
    sections: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for row in done.stdout.splitlines():
        key, sep, value = row.partition("=")
        if not sep or "." not in key:
            continue
        section, name = key.split(".", 1)
        value = value.strip().strip("'\"")
        if section == ":env:":
            env[name] = value
        else:
            sections.setdefault(section, {})[name] = value
    sections.setdefault("global", {}).update(env)
    return sections


def pip_conf_text(sections: dict[str, dict[str, str]]) -> str:
    return "".join(f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) for s, kv in sections.items())


def local_paths(sections: dict[str, dict[str, str]]) -> list[Path]:
    """The local files and folders the configuration names, as they must be mounted into the build. A file://
    index is mounted with its parent folder: its pages may link to files beside it (../../files/...)."""
    found: set[Path] = set()
    for values in sections.values():
        for value in values.values():
            for word in value.split():
                if word.startswith("file://"):
                    path = Path(urlparse(word).path)
                    if path.exists():
                        found.add(path.parent if path.is_dir() else path)
                elif word.startswith("/") and Path(word).exists():
                    found.add(Path(word))
    # a folder already mounted covers whatever lies below it
    return sorted(p for p in found if not any(q != p and q in p.parents for q in found))


def bud_command(variant: str, tag: str, pip_conf: Path, extra: list[str]) -> list[str]:
    mounts = [f"--volume={p}:{p}:ro" for p in local_paths(pip_settings())]
    return [
        "buildah", *STORAGE, "bud",
        "--isolation", "chroot", "--network", "host", "--format", "docker", "--pull=never",
        "--build-arg", f"VARIANT={variant}",
        "--build-arg", f"BASE_IMAGE={BASE}",
        "--build-arg", "TORCH_INDEX_URL=",  # the host's configuration (mounted) knows where the CPU wheel is
        f"--volume={pip_conf}:/etc/pip.conf:ro", *mounts,
        "--tag", tag, *extra, "--file", str(ROOT / "Dockerfile"), str(ROOT),
    ]  # fmt: skip


def build(variant: str, tag: str, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory(prefix="fusionserve-pip-") as tmp:
        pip_conf = Path(tmp) / "pip.conf"
        pip_conf.write_text(pip_conf_text(pip_settings()))
        cmd = bud_command(variant, tag, pip_conf, extra)
        print("$", " ".join(cmd), flush=True)
        start = time.monotonic()
        if subprocess.run(cmd, check=False).returncode != 0:
            raise BuildError(f"buildah bud failed for the {variant} image (its output is above)")
        return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("variant", choices=["cpu", "gpu"])
    p.add_argument("--tag", help="image name (default localhost/fusionserve:VARIANT)")
    p.add_argument("--rebuild-base", action="store_true", help=f"debootstrap {BASE} again even when it exists")
    p.add_argument("--mirror", help="Debian mirror for the base (default: the host's apt source)")
    p.epilog = "Arguments after -- go to `buildah bud` (e.g. -- --build-arg PARITY_GRID=quick)."
    argv = sys.argv[1:] if argv is None else argv
    bud_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    tag = args.tag or f"localhost/fusionserve:{args.variant}"
    try:
        require("buildah", "debootstrap")
        if args.rebuild_base or not image_exists(BASE):
            seconds = make_base(args.mirror or apt_mirror())
            print(f"base {BASE}: {image_size(BASE) / 1e6:.0f} MB, made in {seconds:.0f} s", flush=True)
        seconds = build(args.variant, tag, bud_args)
        print(f"image {tag}: {image_size(tag) / 1e6:.0f} MB, built in {seconds:.0f} s", flush=True)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
