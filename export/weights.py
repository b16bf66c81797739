"""The files of an AdapterHub checkpoint folder, read safely: the JSON config, and the weights from safetensors or
from a torch pickle loaded with ``weights_only=True`` (no pickled code ever runs), checked before use."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from fusionserve.errors import CheckpointError


def read_config(folder: Path, filename: str) -> dict[str, Any]:
    """A checkpoint's JSON config: an object with a ``config`` object inside; raises CheckpointError naming the file."""
    path = folder / filename
    if not path.is_file():
        raise CheckpointError(f"{folder}: missing {filename} (is this a folder written by the adapters library?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise CheckpointError(f"{path}: expected an object with a 'config' object inside")
    return data


def read_weights(folder: Path, safetensors_name: str, bin_name: str) -> dict[str, torch.Tensor]:
    """Load a weight file, never executing pickled code; raises CheckpointError when neither file is there."""
    st, pt = folder / safetensors_name, folder / bin_name
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.is_file():
            state = torch.load(str(pt), map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise CheckpointError(f"{pt}: expected a state dict, got {type(state).__name__}")
            for key, value in state.items():  # weights_only still lets plain Python keys and values through
                if not isinstance(key, str):
                    raise CheckpointError(f"{pt}: key {key!r} is a {type(key).__name__}, expected a weight name (string)")
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"{pt}: entry {key!r} is a {type(value).__name__}, expected a tensor")
            return state
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        # torch's message is long and suggests turning the protection off; keep only the line naming the object
        why = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported" in ln), "not a plain state dict")
        raise CheckpointError(f"{pt}: refused to load: it holds pickled objects other than tensors ({why})") from None
    except Exception as exc:  # corrupt file, truncated safetensors: say which file
        raise CheckpointError(f"cannot read weights from {st if st.is_file() else pt}: {exc}") from None
    raise CheckpointError(f"{folder}: no weights; expected {safetensors_name} or {bin_name}")


def hidden_size(data: dict[str, Any], path: Path) -> int:
    """The config's ``hidden_size``, a positive integer; raises CheckpointError naming the file."""
    hidden = data.get("hidden_size")
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
        raise CheckpointError(f"{path}: field 'hidden_size' must be a positive integer, got {hidden!r}")
    return hidden


def model_type(data: dict[str, Any]) -> str | None:
    """The backbone architecture AdapterHub saved the checkpoint on (``model_type``), when the config names one."""
    value = data.get("model_type")
    return str(value) if value is not None else None


def check_shape(t: torch.Tensor, shape: tuple[int, ...], key: str, path: Path) -> torch.Tensor:
    """``t`` as float32 when it has ``shape``; raises CheckpointError naming the weight and both shapes."""
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{path}: weight '{key}' has shape {tuple(t.shape)}, expected {shape}")
    return t.detach().to(torch.float32)
