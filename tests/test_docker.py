"""The Dockerfile, checked without a Docker engine: what it copies exists, and its entrypoints parse as
`fusionserve serve` with the flags it passes."""

from pathlib import Path


def test_dockerfile_copies_what_exists_and_runs_known_flags():
    import json
    import re
    import shlex

    from fusionserve.cli.main import build_parser

    root = Path(__file__).resolve().parent.parent
    text = (root / "Dockerfile").read_text()
    copies = [shlex.split(line)[1:-1] for line in text.splitlines() if line.startswith("COPY") and "--from" not in line]
    assert copies and all((root / src).exists() for srcs in copies for src in srcs)
    entrypoints = [json.loads(m) for m in re.findall(r"^ENTRYPOINT (\[.*\])$", text, flags=re.M)]
    assert [e[-1] for e in entrypoints] == ["cuda", "cpu"]  # the gpu variant refuses to fall back to CPU
    for argv in entrypoints:
        args = build_parser().parse_args([*argv[1:], "--replicas", "2"])  # arguments after the image name are appended
        assert (args.command, args.artifact, args.host, args.replicas) == ("serve", "/artifact", "0.0.0.0", 2)
    assert "/readyz" in text.split("HEALTHCHECK", 1)[1] and "\nUSER fusionserve\n" in text


def test_every_stage_that_installs_the_package_copies_all_of_its_folders():
    import tomllib

    root = Path(__file__).resolve().parent.parent
    package_dirs = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    stages = (root / "Dockerfile").read_text().split("\nFROM ")[1:]
    installing = [s for s in stages if 'pip install ".[' in s]
    assert len(installing) == 3  # export, runtime-gpu, runtime-cpu
    for stage in installing:
        before = stage.split('pip install ".[', 1)[0]
        copied = {line.split()[1] for line in before.splitlines() if line.startswith("COPY") and "--from" not in line}
        assert package_dirs | {"fusionserve"} <= copied, f"{stage.splitlines()[0]} misses {package_dirs - copied}"
