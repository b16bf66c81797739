"""Read AdapterHub (``adapters`` 1.3.0) checkpoint folders exactly as its save functions write them.

Three kinds of folder, each a JSON config beside a weight file (safetensors preferred, else a torch
pickle read with ``weights_only=True`` so no pickled code ever runs):

- ``save_adapter``:         adapter_config.json        + adapter.safetensors | pytorch_adapter.bin
- ``save_adapter_fusion``:  adapter_fusion_config.json + model_adapter_fusion.safetensors | pytorch_model_adapter_fusion.bin
- ``save_head``:            head_config.json           + model_head.safetensors | pytorch_model_head.bin

Only what fusionserve computes exactly is accepted: sequential bottleneck adapters (``seq_bn``, Pfeiffer)
after the FFN, fusion without ``residual_before``, classification heads. Anything else raises
CheckpointError naming the file, the field and the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionserve.errors import CheckpointError

from .nonlinearity import ACTIVATIONS
from .weights import check_shape, hidden_size, read_config, read_weights

# Fields of an adapter config that must hold exactly these values for the sequential bottleneck fusionserve computes.
_ADAPTER_REQUIRED: dict[str, Any] = {
    "mh_adapter": False,
    "output_adapter": True,
    "original_ln_before": True,
    "original_ln_after": True,
    "residual_before_ln": True,
    "ln_before": False,
    "ln_after": False,
    "is_parallel": False,
    "use_gating": False,
    "phm_layer": False,
    "inv_adapter": None,
    "cross_adapter": False,
}
# Config fields that only matter for training or initialisation: any value is fine at inference.
_ADAPTER_IGNORED = {
    "dropout", "init_weights", "init_weights_seed", "stochastic_depth", "adapter_residual_before_ln",
    "inv_adapter_reduction_factor", "phm_dim", "factorized_phm_W", "shared_W_phm", "shared_phm_rule",
    "factorized_phm_rule", "phm_c_init", "phm_init_range", "learn_phm", "hypercomplex_nonlinearity",
    "phm_rank", "phm_bias", "architecture",
}  # fmt: skip
_FUSION_FLAGS = {"key", "query", "value", "query_before_ln", "residual_before", "temperature", "value_before_softmax"}
_FUSION_IGNORED = {"regularization", "value_initialized", "dropout_prob"}
_HEAD_KNOWN = {"head_type", "num_labels", "layers", "activation_function", "label2id", "use_pooler", "bias", "dropout_prob"}

_ADAPTER_KEY = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.output\.adapters\.(.+)\.adapter_(down\.0|up)\.(weight|bias)$")
_FUSION_KEY = re.compile(
    r"(?:^|\.)encoder\.layer\.(\d+)\.output\.adapter_fusion_layer\.(.+)\.(query|key|value|dense)\.(weight|bias)$"
)
_HEAD_KEY = re.compile(r"^heads\.(.+)\.(\d+)\.(weight|bias)$")


@dataclass(frozen=True)
class AdapterLayer:
    """One layer's bottleneck: z = up_w @ act(down_w @ x + down_b) + up_b (scaling already folded in)."""

    down_w: torch.Tensor  # (r, hidden)
    down_b: torch.Tensor  # (r,)
    up_w: torch.Tensor  # (hidden, r)
    up_b: torch.Tensor  # (hidden,)


@dataclass(frozen=True)
class AdapterCheckpoint:
    name: str
    folder: Path
    hidden_size: int
    non_linearity: str
    layers: dict[int, AdapterLayer]  # absent layers (leave_out) are simply not keys
    leave_out: frozenset[int] = frozenset()


@dataclass(frozen=True)
class FusionLayer:
    query_w: torch.Tensor | None  # (hidden, hidden), None when the 'query' flag is off (identity)
    query_b: torch.Tensor | None
    key_w: torch.Tensor | None
    key_b: torch.Tensor | None
    value_w: torch.Tensor | None  # no bias in AdapterHub's fusion


@dataclass(frozen=True)
class FusionCheckpoint:
    name: str
    folder: Path
    hidden_size: int
    adapter_names: tuple[str, ...]
    query_before_ln: bool
    layers: dict[int, FusionLayer]


@dataclass(frozen=True)
class HeadCheckpoint:
    name: str
    folder: Path
    hidden_size: int
    labels: tuple[str, ...]  # in label-id order
    linears: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]  # (weight (out, in), bias)
    activation: str | None
    use_pooler: bool


@dataclass(frozen=True)
class _AdapterConfig:
    path: Path
    name: str | None
    hidden: int
    act: str
    scaling: float
    leave_out: frozenset[int]


def _adapter_config(folder: Path) -> _AdapterConfig:
    """The checked ``adapter_config.json`` of a seq_bn adapter; raises CheckpointError naming the field."""
    data = read_config(folder, "adapter_config.json")
    cfg_path = folder / "adapter_config.json"
    cfg = data["config"]
    arch = cfg.get("architecture", "bottleneck")
    if arch not in ("bottleneck", None):
        raise CheckpointError(
            f"{cfg_path}: field 'config.architecture' = {arch!r} is not supported; only bottleneck (seq_bn) adapters"
        )
    for key, want in _ADAPTER_REQUIRED.items():
        if key in cfg and cfg[key] != want:
            raise CheckpointError(
                f"{cfg_path}: field 'config.{key}' = {cfg[key]!r} is not supported; fusionserve serves seq_bn "
                f"(Pfeiffer) adapters, which need {key} = {want!r}"
            )
    for key in ("output_adapter", "original_ln_before", "residual_before_ln"):
        if key not in cfg:
            raise CheckpointError(f"{cfg_path}: field 'config.{key}' is missing")
    unknown = set(cfg) - set(_ADAPTER_REQUIRED) - _ADAPTER_IGNORED - {"reduction_factor", "non_linearity", "leave_out", "scaling"}
    if unknown:
        raise CheckpointError(f"{cfg_path}: unknown config field(s) {sorted(unknown)}; refusing to guess what they do")
    act = str(cfg.get("non_linearity", "relu")).lower()
    if act not in ACTIVATIONS:
        raise CheckpointError(
            f"{cfg_path}: field 'config.non_linearity' = {act!r} is not supported; allowed: {', '.join(ACTIVATIONS)}"
        )
    scaling = cfg.get("scaling", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise CheckpointError(f"{cfg_path}: field 'config.scaling' = {scaling!r} is not supported; only a constant number")
    hidden = hidden_size(data, cfg_path)
    raw_leave_out = cfg.get("leave_out") or []
    if not isinstance(raw_leave_out, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw_leave_out):
        raise CheckpointError(f"{cfg_path}: field 'config.leave_out' = {raw_leave_out!r} must be a list of layer numbers")
    return _AdapterConfig(cfg_path, data.get("name"), hidden, act, float(scaling), frozenset(raw_leave_out))


def _adapter_layers(folder: Path, cfg: _AdapterConfig) -> tuple[str | None, dict[int, AdapterLayer]]:
    """(the adapter name in the weight keys, per layer the checked weights with the up-projection scaled)."""
    weights = read_weights(folder, "adapter.safetensors", "pytorch_adapter.bin")
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: set[str] = set()
    for key, tensor in weights.items():
        m = _ADAPTER_KEY.search(key)
        if m is None:
            raise CheckpointError(f"{folder}: unexpected weight '{key}' for a seq_bn adapter")
        layer, name, part, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        names.add(name)
        raw.setdefault((layer, part), {})[kind] = tensor
    if len(names) > 1:
        raise CheckpointError(f"{folder}: weights of several adapters {sorted(names)} in one adapter folder")
    hidden, scaling = cfg.hidden, cfg.scaling
    layers: dict[int, AdapterLayer] = {}
    for layer in sorted({k[0] for k in raw}):
        if layer in cfg.leave_out:
            raise CheckpointError(f"{folder}: weights for layer {layer}, which 'leave_out' lists")
        down, up = raw.get((layer, "down.0"), {}), raw.get((layer, "up"), {})
        for part, got in (("adapter_down.0", down), ("adapter_up", up)):
            for kind in ("weight", "bias"):
                if kind not in got:
                    raise CheckpointError(f"{folder}: missing weight for layer {layer}: {part}.{kind}")
        r = down["weight"].shape[0]
        layers[layer] = AdapterLayer(
            down_w=check_shape(down["weight"], (r, hidden), f"layer {layer} adapter_down.0.weight", folder),
            down_b=check_shape(down["bias"], (r,), f"layer {layer} adapter_down.0.bias", folder),
            up_w=check_shape(up["weight"], (hidden, r), f"layer {layer} adapter_up.weight", folder) * scaling,
            up_b=check_shape(up["bias"], (hidden,), f"layer {layer} adapter_up.bias", folder) * scaling,
        )
    return (names.pop() if names else None), layers


def load_adapter(folder: Path) -> AdapterCheckpoint:
    """Read a ``save_adapter`` folder holding a seq_bn adapter; raises CheckpointError for anything else."""
    cfg = _adapter_config(folder)
    key_name, layers = _adapter_layers(folder, cfg)
    name = cfg.name or key_name or folder.name
    if not layers:
        raise CheckpointError(f"{folder}: the weight file holds no adapter weights")
    return AdapterCheckpoint(
        name=str(name), folder=folder, hidden_size=cfg.hidden, non_linearity=cfg.act, layers=layers, leave_out=cfg.leave_out
    )


def _fusion_config(folder: Path) -> tuple[dict[str, Any], list[str], int, str]:
    """(config flags, adapter names, hidden size, fusion name) of a checked ``adapter_fusion_config.json``."""
    data = read_config(folder, "adapter_fusion_config.json")
    cfg_path = folder / "adapter_fusion_config.json"
    cfg = data["config"]
    names = data.get("adapter_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{cfg_path}: field 'adapter_names' must be a non-empty list of adapter names, got {names!r}")
    unknown = set(cfg) - _FUSION_FLAGS - _FUSION_IGNORED
    if unknown:
        raise CheckpointError(f"{cfg_path}: unknown config field(s) {sorted(unknown)}; refusing to guess what they do")
    for flag in _FUSION_FLAGS:
        if flag not in cfg:
            raise CheckpointError(f"{cfg_path}: field 'config.{flag}' is missing")
        if not isinstance(cfg[flag], bool):
            raise CheckpointError(f"{cfg_path}: field 'config.{flag}' = {cfg[flag]!r} must be true or false")
    if cfg["residual_before"]:
        raise CheckpointError(
            f"{cfg_path}: field 'config.residual_before' = True is not supported; only False (the paper's setting)"
        )
    hidden = hidden_size(data, cfg_path)
    return cfg, names, hidden, data.get("name") or ",".join(names)


def _fusion_layers(folder: Path, cfg: dict[str, Any], hidden: int, fusion_name: str) -> dict[int, FusionLayer]:
    """Per layer, the checked query/key/value weights the config's flags use."""
    weights = read_weights(folder, "model_adapter_fusion.safetensors", "pytorch_model_adapter_fusion.bin")
    raw: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        m = _FUSION_KEY.search(key)
        if m is None:
            raise CheckpointError(f"{folder}: unexpected weight '{key}' for an adapter fusion")
        if m.group(2) != fusion_name:
            raise CheckpointError(f"{folder}: weight '{key}' belongs to fusion '{m.group(2)}', not '{fusion_name}'")
        raw.setdefault(int(m.group(1)), {})[f"{m.group(3)}.{m.group(4)}"] = tensor
    if not raw:
        raise CheckpointError(f"{folder}: the weight file holds no fusion weights")
    wanted = [f"{p}.{k}" for p in ("query", "key") if cfg[p] for k in ("weight", "bias")]
    wanted += ["value.weight"] if cfg["value"] else []
    unused = {"dense.weight", "dense.bias"} if not (cfg["query"] or cfg["key"] or cfg["value"]) else set()
    layers: dict[int, FusionLayer] = {}
    for layer, got in sorted(raw.items()):
        for key in unused:  # created but never used by AdapterHub's forward when no flag is on
            got.pop(key, None)
        extra = set(got) - set(wanted)
        if extra:
            raise CheckpointError(f"{folder}: layer {layer} has weights {sorted(extra)} that the config's flags do not use")
        for w in wanted:
            if w not in got:
                raise CheckpointError(f"{folder}: missing weight for layer {layer}: {w}")
        h2, h1 = (hidden, hidden), (hidden,)

        def get(w: str, shape: tuple[int, ...], got: dict[str, torch.Tensor] = got, layer: int = layer) -> torch.Tensor | None:
            return check_shape(got[w], shape, f"layer {layer} {w}", folder) if w in got else None

        layers[layer] = FusionLayer(
            query_w=get("query.weight", h2), query_b=get("query.bias", h1),
            key_w=get("key.weight", h2), key_b=get("key.bias", h1),
            value_w=get("value.weight", h2),
        )  # fmt: skip
    return layers


def load_fusion(folder: Path) -> FusionCheckpoint:
    """Read a ``save_adapter_fusion`` folder; raises CheckpointError for unsupported flags or missing weights."""
    cfg, names, hidden, fusion_name = _fusion_config(folder)
    layers = _fusion_layers(folder, cfg, hidden, fusion_name)
    return FusionCheckpoint(
        name=str(fusion_name), folder=folder, hidden_size=hidden, adapter_names=tuple(names),
        query_before_ln=cfg["query_before_ln"], layers=layers,
    )  # fmt: skip


def load_head(folder: Path) -> HeadCheckpoint:
    """Read a ``save_head`` folder holding a classification head; raises CheckpointError otherwise."""
    data = read_config(folder, "head_config.json")
    cfg_path = folder / "head_config.json"
    cfg = data["config"]
    if cfg.get("head_type") != "classification":
        raise CheckpointError(
            f"{cfg_path}: field 'config.head_type' = {cfg.get('head_type')!r} is not supported; only 'classification'"
        )
    unknown = set(cfg) - _HEAD_KNOWN
    if unknown:
        raise CheckpointError(f"{cfg_path}: unknown config field(s) {sorted(unknown)}; refusing to guess what they do")
    hidden = hidden_size(data, cfg_path)
    n_layers, n_labels = cfg.get("layers", 2), cfg.get("num_labels")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise CheckpointError(f"{cfg_path}: field 'config.layers' = {n_layers!r} must be an integer >= 1")
    if not isinstance(n_labels, int) or isinstance(n_labels, bool) or n_labels < 1:
        raise CheckpointError(f"{cfg_path}: field 'config.num_labels' = {n_labels!r} must be an integer >= 1")
    act = cfg.get("activation_function")
    act = str(act).lower() if act else None
    if act is not None and act not in ACTIVATIONS:
        raise CheckpointError(
            f"{cfg_path}: field 'config.activation_function' = {act!r} is not supported; allowed: {', '.join(ACTIVATIONS)}"
        )
    labels = _labels(cfg.get("label2id"), n_labels, cfg_path)

    weights = read_weights(folder, "model_head.safetensors", "pytorch_model_head.bin")
    name = data.get("name")
    by_index: dict[int, dict[str, torch.Tensor]] = {}
    others: set[str] = set()
    for key, tensor in weights.items():
        m = _HEAD_KEY.match(key)
        if m is None:
            raise CheckpointError(f"{folder}: unexpected weight '{key}' for a classification head")
        if name is not None and m.group(1) != name:
            # AdapterHub's save_head matches head names by prefix: saving "rte" also writes "rte_2"'s weights
            others.add(m.group(1))
            continue
        by_index.setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    if not by_index and others:
        raise CheckpointError(f"{folder}: no weights for head '{name}' (the file holds heads {sorted(others)})")
    if len(by_index) != n_layers:
        raise CheckpointError(f"{folder}: config says {n_layers} linear layer(s), weights hold {len(by_index)}")
    linears = []
    for i, idx in enumerate(sorted(by_index)):
        out = n_labels if i == n_layers - 1 else hidden
        got = by_index[idx]
        if "weight" not in got:
            raise CheckpointError(f"{folder}: missing weight for head module {idx}: weight")
        if cfg.get("bias", True) and "bias" not in got:
            raise CheckpointError(f"{folder}: missing weight for head module {idx}: bias")
        w = check_shape(got["weight"], (out, hidden), f"heads.{idx}.weight", folder)
        b = check_shape(got["bias"], (out,), f"heads.{idx}.bias", folder) if "bias" in got else None
        linears.append((w, b))
    return HeadCheckpoint(
        name=str(data.get("name") or folder.name), folder=folder, hidden_size=hidden, labels=labels,
        linears=tuple(linears), activation=act, use_pooler=bool(cfg.get("use_pooler", False)),
    )  # fmt: skip


def _labels(label2id: Any, n_labels: int, path: Path) -> tuple[str, ...]:
    if label2id is None:
        return tuple(f"LABEL_{i}" for i in range(n_labels))
    if not isinstance(label2id, dict):
        raise CheckpointError(f"{path}: field 'config.label2id' must map labels to ids, got {type(label2id).__name__}")
    ids = sorted(label2id.values()) if all(type(v) is int for v in label2id.values()) else None
    if ids != list(range(n_labels)):
        raise CheckpointError(
            f"{path}: field 'config.label2id' = {label2id!r} must give each of the {n_labels} label ids 0..{n_labels - 1} once"
        )
    by_id = {v: str(k) for k, v in label2id.items()}
    return tuple(by_id[i] for i in range(n_labels))
