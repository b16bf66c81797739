"""How big the test suite is: tests collected and checks written (and, with --run, executed), so that a change to the
suite can show that it lost none.

    python scripts/suite_counts.py                 # collect (no test runs) and read tests/ as source
    python scripts/suite_counts.py --run [ARGS]    # the same, then run the suite (pytest ARGS) counting executed checks

Read from the source of every module under tests/ (test modules and their helpers):
- ``assert``: assert statements;
- ``raises``: ``pytest.raises(...)`` calls (a context manager or a call);
- ``np.testing``: calls of ``np.testing.assert_*`` / ``numpy.testing.assert_*`` (checks that are not ``assert``).
A check in a loop or a parametrized test counts once there: these are the checks written.

Executed (``--run``): every ``assert`` that passed in a test module or conftest.py (pytest's assertion-pass hook:
asserts in the helper modules are not rewritten by pytest and not counted), every ``pytest.raises`` entered and every
``np.testing.assert_*`` called, anywhere. A check in a loop counts each time it runs.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_ENV = "SUITE_COUNTS_OUT"  # the folder each pytest process (xdist workers included) writes its executed counts to


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def checks(source: str) -> Counter:
    """The checks written in one module's source."""
    found: Counter = Counter()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            found["assert"] += 1
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "pytest.raises":
                found["raises"] += 1
            elif name.startswith(("np.testing.assert", "numpy.testing.assert")):
                found["np.testing"] += 1
    return found


def collected() -> int:
    """Tests pytest collects (the opt-in --image ones included: the default run collects and skips them)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],  # xdist: addopts name it
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return sum(1 for line in out.splitlines() if "::" in line)


# --- the pytest plugin of --run (loaded as `-p suite_counts` with scripts/ on the path) ------------------------------

_executed: Counter = Counter()


def pytest_configure(config) -> None:
    import numpy as np
    import pytest

    raises = pytest.raises

    def counted_raises(*args, **kwargs):
        _executed["raises"] += 1
        return raises(*args, **kwargs)

    pytest.raises = counted_raises
    for name in [n for n in dir(np.testing) if n.startswith("assert_")]:
        real = getattr(np.testing, name)

        def counted(*args, _real=real, **kwargs):
            _executed["np.testing"] += 1
            return _real(*args, **kwargs)

        setattr(np.testing, name, counted)


def pytest_assertion_pass(item, lineno, orig, expl) -> None:
    _executed["assert"] += 1


def pytest_sessionfinish(session) -> None:
    folder = os.environ.get(OUT_ENV)
    if folder:
        Path(folder, f"{os.getpid()}.json").write_text(json.dumps(_executed))


def run(args: list[str]) -> tuple[int, Counter]:
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, **{OUT_ENV: folder}, PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)]))
        cmd = [sys.executable, "-m", "pytest", "-p", "suite_counts", "-o", "enable_assertion_pass_hook=true", *args]
        code = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
        total: Counter = Counter()
        for f in Path(folder).glob("*.json"):
            total += Counter(json.loads(f.read_text()))
    return code, total


def main() -> int:
    written: Counter = Counter()
    for path in sorted((ROOT / "tests").glob("*.py")):
        written += checks(path.read_text())
    print(f"tests collected: {collected()}")
    print(
        f"checks written in tests/: {written['assert']} assert, {written['raises']} pytest.raises, "
        f"{written['np.testing']} np.testing.assert_* ({sum(written.values())} in all)"
    )
    if sys.argv[1:2] != ["--run"]:
        return 0
    code, done = run(sys.argv[2:])
    print(
        f"checks executed: {done['assert']} assert passed (test modules and conftest), {done['raises']} pytest.raises, "
        f"{done['np.testing']} np.testing.assert_*; pytest exit {code}"
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
