"""Code run where some packages cannot be imported, as a user without an extra meets it, or as a light command must
work without the heavy half: a finder put first on ``sys.meta_path`` refuses them. In a fresh interpreter
(test_layers, test_missing_extras, test_live_tasks), or, through a ``sitecustomize`` on PYTHONPATH, in every Python
process of a server's tree (conftest.shared_server: the supervisor, the server, Ray's workers, the replicas)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = ("torch", "transformers", "adapters")  # the export half: what the light commands and serving never import


def refusing(blocked: tuple[str, ...] | list[str]) -> str:
    """Python code that makes every module of the packages ``blocked`` unimportable from then on."""
    return (
        "import importlib.abc, sys\n"
        f"_BLOCKED = {tuple(blocked)!r}\n"
        "class _Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in _BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (refused by the test)', name=name)\n"
        "sys.meta_path.insert(0, _Refuse())\n"
    )


def cli_without(
    blocked: tuple[str, ...] | list[str], argv: list[object], modules: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``fusionserve *argv`` in a fresh interpreter where ``blocked`` cannot be imported. With ``modules``, its last
    line of output is a JSON object: which of them were imported by the end."""
    code = refusing(blocked) + f"from fusionserve.cli.main import main\ncode = main({[str(a) for a in argv]!r})\n"
    if modules:
        code += f"print(__import__('json').dumps({{m: m in sys.modules for m in {modules!r}}}))\n"
    code += "sys.exit(code)\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)


def imported(done: subprocess.CompletedProcess[str]) -> dict[str, bool]:
    """The JSON last line of a ``cli_without(..., modules=...)`` run."""
    return json.loads(done.stdout.strip().splitlines()[-1])


def environment_without(folder: Path, blocked: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Variables under which every Python process started with them (and by them) cannot import ``blocked``: a
    ``sitecustomize.py`` written into ``folder``, first on PYTHONPATH."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(refusing(blocked))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)}
