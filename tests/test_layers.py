"""The layers import one way: the CLI above everything; export (torch) and scoring on serving's light contracts;
serving on nothing but itself; no module cycles. Read from the source (every import, the lazy ones inside
functions included), and checked for real by importing the torch-free side where torch cannot be imported."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_helpers import TORCH, refusing

ROOT = Path(__file__).resolve().parents[1]
# folder -> package (pyproject's package-dir)
PACKAGES = {"fusionserve": "fusionserve", "cli": "fusionserve.cli", "export": "fusionserve.export",
            "serving": "fusionserve.serving", "scoring": "fusionserve.scoring", "training": "fusionserve.training"}  # fmt: skip
BASE = {"fusionserve", "fusionserve.errors", "fusionserve.settings"}
# serving's light contracts: what the artifact is and how to run it, usable without the HTTP server
# (serving/model/: the artifact, its revisions and tables, tokenizing, the runtime; joining Ray, for score --ray; and
# serving/options.py, standard library only, for the rule every task name follows; serving/private.py, standard library
# only at import, for the ONNX Runtime parts the graph relies on)
CONTRACTS = {
    "fusionserve.serving.model", "fusionserve.serving.options", "fusionserve.serving.private",
    "fusionserve.serving.process.cluster",
}  # fmt: skip
SERVING = "fusionserve.serving"
# layer -> what it may import besides itself and the base
ALLOWED = {
    "fusionserve": set(),
    "fusionserve.serving": set(),
    "fusionserve.scoring": CONTRACTS,
    "fusionserve.export": CONTRACTS,
    "fusionserve.training": CONTRACTS | {"fusionserve.export"},
    "fusionserve.cli": {"*"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every fusionserve module ``name`` imports, at the top or inside a function."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import module` names a module; `from module import symbol` the module itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known}
    return out


def _layer(module: str) -> str:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) - {name} for name, path in modules.items()}


# serving/'s parts, bottom to top: a module imports its own part and the parts below it, never one above
SERVING_PARTS = [f"{SERVING}.{p}" for p in ("options", "private", "model", "scheduler", "api", "builder", "process")]


def _part(module: str) -> int:
    for i, part in enumerate(SERVING_PARTS):
        if module == part or module.startswith(part + "."):
            return i
    raise AssertionError(f"{module} belongs to no part of serving/: {SERVING_PARTS}")


def test_serving_parts_import_downwards():
    graph = _graph()  # once: it parses every module (22 s when the comprehension below read it again for each module)
    modules = [m for m in graph if m.startswith(SERVING + ".")]
    assert {SERVING_PARTS[_part(m)] for m in modules} == set(SERVING_PARTS)  # every part was found
    wrong = [
        f"{m} ({SERVING_PARTS[_part(m)]}) imports {t}"
        for m in modules
        for t in sorted(graph[m])
        if t.startswith(SERVING + ".") and t != SERVING and _part(t) > _part(m)
    ]
    assert not wrong, "serving/ imports against its parts' order:\n" + "\n".join(wrong)


def test_every_import_points_down_the_layers():
    wrong = []
    for module, targets in _graph().items():
        layer = _layer(module)
        for target in sorted(targets):
            if target in BASE or _layer(target) == layer or "*" in ALLOWED[layer]:
                continue
            if not any(target == ok or target.startswith(ok + ".") for ok in ALLOWED[layer]):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_scoring_and_export_use_only_servings_contracts_not_the_http_server():
    http = {m for m in _modules() if m.startswith(SERVING + ".") and not any(m == c or m.startswith(c + ".") for c in CONTRACTS)}
    assert http >= {
        f"{SERVING}.api.app",
        f"{SERVING}.api.oip",
        f"{SERVING}.api.oip_http",
        f"{SERVING}.api.oip_grpc",
        f"{SERVING}.api.tracing",
        f"{SERVING}.process.server",
        f"{SERVING}.scheduler.batching",
    }  # the check means something
    users = [(m, t) for m, ts in _graph().items() for t in ts & http if not m.startswith((SERVING, "fusionserve.cli"))]
    assert not users


def test_no_module_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.slow
def test_serving_scoring_and_cli_import_without_torch():
    modules = [m for m in _modules() if _layer(m) in ("fusionserve", SERVING, "fusionserve.scoring", "fusionserve.cli")]
    code = refusing(TORCH) + (
        "import json\n"
        f"for m in {modules!r}:\n    __import__(m)\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'transformers', 'onnx', 'onnxruntime', 'tokenizers')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "torch": False,
        "transformers": False,
        "onnx": False,  # the export extra's graph library: the CLI's parser takes int8 roles from export/int8/gemm_roles.py
        "onnxruntime": True,
        "tokenizers": True,
    }
    assert len(modules) > 20


# style.md's size limits: modules in the package folders, functions in the two halves (export/, serving/)
SIZED_FOLDERS = ("cli", "export", "serving", "scoring", "training", "fusionserve", "benchmarks")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def _sources(folders: tuple[str, ...]) -> list[Path]:
    """Every hand-written .py file under ``folders`` (gRPC stubs are generated: *_pb2.py, *_pb2_grpc.py)."""
    paths = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in paths if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def test_no_module_over_the_line_limit():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in _sources(SIZED_FOLDERS)
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert len(_sources(SIZED_FOLDERS)) > 60  # the folders were found
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_the_line_limit_in_export_and_serving():
    long = []
    for path in _sources(("export", "serving")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # def line to last line (decorators not counted); methods and nested functions included
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
