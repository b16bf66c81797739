"""The documentation: the generated reference names everything the code has, found here by other means than the
generator's (the parsers walked anew, the source read as text), so an option, route, method, metric, error type or
environment variable that the generator would miss fails here; the site's hooks keep a new guide in the nav and
make links written for GitHub work in the site; the README stays short. ``mkdocs build --strict`` itself runs in
CI (.ci/run), beside the tests."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"
PACKAGE_DIRS = ("fusionserve", "serving", "scoring", "cli", "export", "training")


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(HOOKS))
    try:
        spec = importlib.util.spec_from_file_location(name, HOOKS / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HOOKS))


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    return _load("reference")


@pytest.fixture(scope="module")
def pages(reference: ModuleType) -> dict[str, str]:
    return reference.all_pages()


def _source(*folders: str) -> dict[Path, str]:
    return {p: p.read_text() for f in folders for p in sorted((ROOT / f).rglob("*.py")) if "_pb2" not in p.name}


def _sections(page: str) -> dict[str, str]:
    """'## heading' -> the text under it, up to the next '## '."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return {parts[i].split(" {")[0].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_cli_reference_names_every_subcommand_and_option(pages: dict[str, str]) -> None:
    from fusionserve.cli.main import build_parser

    sections = _sections(pages["reference/cli.md"])
    todo: list[tuple[tuple[str, ...], argparse.ArgumentParser]] = [((), build_parser())]
    checked = 0
    while todo:
        words, parser = todo.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                first = {id(sub): name for name, sub in reversed(action.choices.items())}  # an alias: its first name
                todo += [((*words, name), sub) for name, sub in action.choices.items() if first[id(sub)] == name]
                continue
            if not words or isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            section = sections.get(f"fusionserve {' '.join(words)}")
            assert section is not None, f"no section for 'fusionserve {' '.join(words)}' in the CLI reference"
            names = action.option_strings or [action.metavar or action.dest]
            for name in names:
                assert f"`{name}`" in section, f"'fusionserve {' '.join(words)}': {name} is not in the CLI reference"
                checked += 1
    assert checked > 50  # every subcommand's options were walked


def test_http_reference_names_every_route(pages: dict[str, str]) -> None:
    from fusionserve.serving.api.app import app

    page = pages["reference/http.md"]
    routes = set()
    for text in _source("serving").values():
        routes |= {(m.upper(), p) for m, p in re.findall(r"@app\.(get|post|put|patch|delete)\(\s*\"([^\"]+)\"", text)}
    assert ("POST", "/v1/classify") in routes
    for method, path in routes:
        assert re.search(rf"\| `{method}` \| [^|\n]*`{re.escape(path)}`", page), f"{method} {path} is not in the HTTP reference"
    for path in app.openapi()["paths"]:
        assert f"{path} {{ #" in page, f"{path} of the OpenAPI schema has no section in the HTTP reference"


def test_grpc_reference_names_every_method(pages: dict[str, str]) -> None:
    page = pages["reference/grpc.md"]
    for name in ("fusionserve.proto", "grpc_predict_v2.proto"):  # fusionserve's service and the Open Inference Protocol's
        proto = (ROOT / "serving" / "api" / name).read_text()
        package = re.search(r"^package ([\w.]+);", proto, flags=re.M).group(1)
        methods = []
        for service, body in re.findall(r"service (\w+) \{(.*?)\n\}", proto, flags=re.S):
            methods += [f"/{package}.{service}/{rpc}" for rpc in re.findall(r"rpc (\w+)\(", body)]
        assert methods
        for method in methods:
            assert f"`{method}`" in page, f"gRPC method {method} is not in the gRPC reference"
        for message in re.findall(r"^message (\w+)", proto, flags=re.M):
            assert f"### {message}" in page, f"gRPC message {message} is not in the gRPC reference"


_METRIC_CALL = re.compile(r"\b(?:Counter|Histogram|Gauge|Summary|Info|Enum|\w*MetricFamily)\(\s*(f?)\"([^\"]+)\"")


def test_metrics_reference_names_every_metric(pages: dict[str, str]) -> None:
    page = pages["reference/metrics.md"]
    found = []
    for text in _source("serving").values():
        constants = dict(re.findall(r"^(\w+) = \"([^\"]*)\"", text, flags=re.M))
        for is_f, name in _METRIC_CALL.findall(text):
            if is_f:
                name = re.sub(r"\{(\w+)\}", lambda m, known=constants: known[m.group(1)], name)
            found.append(name)
    assert "fusionserve_inputs_total" in found and "fusionserve_fusion_activation_mean_ratio" in found
    for name in found:
        assert f"| `{name}` |" in page, f"metric {name} is not in the metrics reference"


def test_errors_reference_names_every_error_type_and_exception(pages: dict[str, str]) -> None:
    import fusionserve.errors

    page = pages["reference/errors.md"]
    types = set()
    for text in _source("serving").values():
        types |= set(re.findall(r"(?:HTTPError|_error)\(\s*(\d{3}),\s*\"([a-z_]+)\"", text))
        types |= set(re.findall(r"\b(\d{3}): \"([a-z_]+)\"", text))
    assert ("404", "unknown_task") in types and ("503", "overloaded") in types
    for status, kind in types:
        assert re.search(rf"^\| `{kind}` \| {status} \|", page, flags=re.M), (
            f"error type {kind} ({status}) is not in the reference"
        )
    exceptions = [n for n, c in vars(fusionserve.errors).items() if isinstance(c, type) and issubclass(c, Exception)]
    for text in _source(*PACKAGE_DIRS).values():
        exceptions += re.findall(
            r"^class (\w+)\((?:[\w.]*\.)?(?:FusionServeError|SpecError|CheckpointError|InputError)\)", text, flags=re.M
        )
    for name in exceptions:
        assert f"| `{name}` |" in page, f"exception {name} is not in the errors reference"


def test_environment_reference_names_every_variable(pages: dict[str, str]) -> None:
    page = pages["reference/environment.md"]
    names = set()
    for text in _source(*PACKAGE_DIRS).values():
        code = re.sub(r'"""(.*?)"""', "", text, flags=re.S)  # docstrings mention variables; code reads them
        names |= set(re.findall(r"\"(FUSIONSERVE_[A-Z0-9_]+)\"", code))
        names |= set(re.findall(r"environ(?:\.get|\.setdefault|\.pop)?[\[(]\s*\"([A-Za-z_][A-Za-z0-9_]*)\"", code))
        names |= set(re.findall(r"getenv\(\s*\"([A-Za-z_][A-Za-z0-9_]*)\"", code))
    assert {"FUSIONSERVE_CACHE", "RAY_ADDRESS"} <= names
    for name in names:
        assert f"| `{name}` |" in page, f"environment variable {name} is not in the environment reference"


def test_a_guide_missing_from_the_nav_is_added_to_guides(tmp_path: Path) -> None:
    site = _load("site")
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "listed.md").write_text("# Listed\n")
    (tmp_path / "guides" / "new-topic.md").write_text("# A new topic\n\ntext\n")
    (tmp_path / "concepts").mkdir()
    (tmp_path / "concepts" / "idea.md").write_text("no title here\n")
    (tmp_path / "faq.md").write_text("# FAQ\n")
    config = {"docs_dir": str(tmp_path), "nav": [{"Home": "index.md"}, {"Guides": [{"Listed": "guides/listed.md"}]}]}
    site.on_config(config)
    assert config["nav"] == [
        {"Home": "index.md"},
        {"Guides": [{"Listed": "guides/listed.md"}, {"A new topic": "guides/new-topic.md"}]},
        {"Concepts": [{"Idea": "concepts/idea.md"}]},
        {"FAQ": "faq.md"},
    ]


@pytest.mark.parametrize(
    ("page", "link", "expected"),
    [
        ("guides/x.md", "[results](../../benchmarks/RESULTS.md#load)", "[results](../benchmarks/index.md#load)"),
        ("guides/x.md", "![plot](../../benchmarks/results/load.png)", "![plot](../benchmarks/results/load.png)"),
        ("guides/x.md", "[the app](../../serving/api/app.py)", "the app (`serving/api/app.py`)"),
        ("guides/x.md", "[`serving/api/app.py`](../../serving/api/app.py)", "`serving/api/app.py`"),
        ("guides/x.md", "[Serving](serving.md#errors)", "[Serving](serving.md#errors)"),
        ("guides/x.md", "[README](../../README.md)", "[README](../index.md)"),
        ("index.md", "[Export](docs/guides/export.md#precisions)", "[Export](guides/export.md#precisions)"),
        ("index.md", "[report](fusionserve/default_model/REPORT.md)", "[report](benchmarks/default-model.md)"),
        ("benchmarks/index.md", "![latency](results/latency.png)", "![latency](results/latency.png)"),
        ("guides/x.md", "[ray](https://docs.ray.io)", "[ray](https://docs.ray.io)"),
    ],
)
def test_links_written_for_the_repository_work_in_the_site(page: str, link: str, expected: str) -> None:
    site = _load("site")

    class File:
        src_uri = page

    class Page:
        file = File()

    assert site.on_page_markdown(f"see {link}.\n", Page(), {}, None) == f"see {expected}.\n"


def test_readme_is_short_and_starts_with_the_install_command() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; keep it under 250 and move the rest into docs/"
    install = next(i for i, line in enumerate(lines) if "pip install torch==2.13.0" in line)
    assert install < 40, f"the install command is on README line {install + 1}; it belongs in the first 40"
    assert any(line.strip() == "bash .ci/run" for line in lines[:40])
