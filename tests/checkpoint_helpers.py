"""Shared by the error tests (test_spec_errors.py, test_checkpoint_errors.py, test_config_errors.py): editing a
private copy of folders AdapterHub saved (the ``root`` and ``any_root`` fixtures in conftest.py), in either weight
format, and matching messages that must name several things."""

import json
import re
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from fusionserve.export.build import build_model
from fusionserve.export.spec import load_spec

WEIGHT_FILES = {
    "adapter": ("adapter.safetensors", "pytorch_adapter.bin"),
    "fusion": ("model_adapter_fusion.safetensors", "pytorch_model_adapter_fusion.bin"),
    "head": ("model_head.safetensors", "pytorch_model_head.bin"),
}


def _copy(src_spec: Path, dst: Path) -> Path:
    shutil.copytree(src_spec.parent, dst)
    return dst.resolve()  # load_spec resolves paths, so messages hold resolved ones


def _all_of(*parts: object) -> str:
    """A regex that matches when every part occurs in the message, in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(str(p))})" for p in parts)


def _build(root: Path):
    return build_model(load_spec(root / "model.yaml"))


def _edit_spec(root: Path, edit) -> Path:
    path = root / "model.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _set_config(path: Path, **fields) -> None:
    _edit_json(path, lambda d: d["config"].update(fields))


def _weight_path(folder: Path, kind: str) -> Path:
    st, pt = (folder / name for name in WEIGHT_FILES[kind])
    return st if st.is_file() else pt


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)


def _save_weights(path: Path, state: dict[str, torch.Tensor]) -> None:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)


def _edit_weights(folder: Path, kind: str, edit) -> Path:
    """Rewrite a folder's weight file in its own format after ``edit(state)``; returns the file."""
    path = _weight_path(folder, kind)
    state = _load_weights(path)
    edit(state)
    _save_weights(path, state)
    return path


def _key(state: dict[str, torch.Tensor], suffix: str) -> str:
    (key,) = [k for k in state if k.endswith(suffix)]
    return key
