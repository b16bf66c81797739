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


def test_every_stage_that_builds_the_package_copies_all_of_its_folders():
    import tomllib

    root = Path(__file__).resolve().parent.parent
    package_dirs = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    stages = (root / "Dockerfile").read_text().split("\nFROM ")[1:]
    installing = [s for s in stages if 'pip install ".[' in s or "pip wheel --no-deps ." in s]
    assert len(installing) == 2  # export, and the wheel the runtime stages install
    for stage in installing:
        before = stage.split('pip install ".[', 1)[0].split("pip wheel --no-deps .", 1)[0]
        copied = {line.split()[1] for line in before.splitlines() if line.startswith("COPY") and "--from" not in line}
        assert package_dirs | {"fusionserve"} <= copied, f"{stage.splitlines()[0]} misses {package_dirs - copied}"


def _build_script():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "build_image.py"
    spec = importlib.util.spec_from_file_location("build_image", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_stage_starts_from_the_base_argument_or_another_stage():
    import re

    text = (Path(__file__).resolve().parent.parent / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, flags=re.M)
    names = {alias for _, alias in froms if alias}
    assert froms[0] == ("${BASE_IMAGE}", "python")  # the one place an image from outside comes in
    for image, _ in froms[1:]:
        assert image in names or image == "runtime-${VARIANT}", image
    args = set(re.findall(r"^ARG (\w+)", text, flags=re.M))
    script = _build_script()
    passed = [a.split("=", 1)[0] for a in script.bud_command("cpu", "t", Path("/x"), [])[1:] if "=" in a and a[0].isupper()]
    assert passed and set(passed) <= args  # every --build-arg the local build passes is one the Dockerfile takes


def test_the_hosts_pip_configuration_goes_into_the_build_with_the_paths_it_names(tmp_path):
    index, wheels = tmp_path / "mirror" / "simple", tmp_path / "wheels"
    index.mkdir(parents=True)
    wheels.mkdir()
    cert = tmp_path / "ca.crt"
    cert.write_text("x")
    sections = {
        "global": {"extra-index-url": f"file://{index} https://example.invalid/simple", "find-links": str(wheels)},
        "install": {"cert": str(cert), "constraint": str(tmp_path / "gone.txt"), "no-binary": ":none:"},
    }
    script = _build_script()
    # the index with the files beside it; folders and files as they are; a path that does not exist is not mounted
    assert script.local_paths(sections) == sorted([tmp_path / "mirror", wheels, cert])
    assert script.local_paths({"global": {"find-links": f"{tmp_path} {wheels}"}}) == [tmp_path]  # nested: once
    conf = script.pip_conf_text(sections)
    assert f"[global]\nextra-index-url = file://{index} https://example.invalid/simple\n" in conf
    assert f"[install]\ncert = {cert}\n" in conf


def test_the_build_context_leaves_out_everything_git_ignores():
    """`COPY . /src` takes the whole context: what git ignores (venvs, caches, local builds, exported artifacts) must
    stay out of it too, or a checkout with an exported artifact or a wheel build sends it all into the image."""
    root = Path(__file__).resolve().parent.parent

    def patterns(name: str) -> set[str]:
        lines = (root / name).read_text().splitlines()
        return {ln.strip().removeprefix("**/").strip("/") for ln in lines if ln.strip() and not ln.startswith("#")}

    assert "COPY . /src" in (root / "Dockerfile").read_text()
    assert patterns(".gitignore") <= patterns(".dockerignore"), patterns(".gitignore") - patterns(".dockerignore")


def test_the_image_exports_the_built_in_model_at_the_length_it_was_trained_at():
    import re

    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE
    from fusionserve.export.spec import load_spec

    text = (Path(__file__).resolve().parent.parent / "Dockerfile").read_text()
    default = re.search(r"^ARG MAX_SEQ_LEN=(.*)$", text, flags=re.M).group(1).strip()
    trained = load_spec(DEFAULT_MODEL / SPEC_FILE).max_seq_len
    # an empty default leaves the limit to the spec; any other default overrides it for every image
    assert default in ("", str(trained)), (
        f"ARG MAX_SEQ_LEN={default} exports the built-in model at {default} tokens, not {trained}"
    )
