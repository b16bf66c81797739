"""Read AdapterHub (``adapters`` 1.3.0) checkpoint folders exactly as its save functions write them.

Two kinds of folder (heads: ``head.py``), each a JSON config beside a weight file (safetensors preferred, else a torch
pickle read with ``weights_only=True`` so no pickled code ever runs):

- ``save_adapter``:         adapter_config.json        + adapter.safetensors | pytorch_adapter.bin
- ``save_adapter_fusion``:  adapter_fusion_config.json + model_adapter_fusion.safetensors | pytorch_model_adapter_fusion.bin

Only what fusionserve computes exactly is accepted: sequential bottleneck adapters after the attention block
(``mh_adapter``) and/or after the FFN (``output_adapter``), with the pretrained LayerNorm before the adapter or not
(``original_ln_before``: ``seq_bn``/Pfeiffer has it, ``double_seq_bn``/Houlsby not) and after it; fusion without
``residual_before``. Anything else raises CheckpointError naming the file, the field and the
value. Weight names are read for every supported backbone (``encoder.layer.N.attention.output`` /
``encoder.layer.N.output`` for BERT and RoBERTa, ``transformer.layer.N.attention_adapters`` /
``transformer.layer.N.output_adapters`` for DistilBERT).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionserve.errors import CheckpointError

from .nonlinearity import ACTIVATIONS
from .weights import check_shape, hidden_size, model_type, read_config, read_weights

# Fields of an adapter config that must hold exactly these values for the sequential bottleneck fusionserve computes.
_ADAPTER_REQUIRED: dict[str, Any] = {
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
# Where an adapter sits, as the config says: (field, place); at least one must be true.
_PLACE_FIELDS = (("mh_adapter", "attention"), ("output_adapter", "output"))
_FUSION_FLAGS = {"key", "query", "value", "query_before_ln", "residual_before", "temperature", "value_before_softmax"}
_FUSION_IGNORED = {"regularization", "value_initialized", "dropout_prob"}

# The module holding a layer's adapters, per place: BERT / RoBERTa / XLM-RoBERTa, then DistilBERT names.
_SITE = r"(?:^|\.)(?:encoder|transformer)\.layer\.(\d+)\.(attention\.output|attention_adapters|output|output_adapters)\."
_PLACE_OF = {"attention.output": "attention", "attention_adapters": "attention", "output": "output", "output_adapters": "output"}
_ADAPTER_KEY = re.compile(_SITE + r"adapters\.(.+)\.adapter_(down\.0|up)\.(weight|bias)$")
_FUSION_KEY = re.compile(_SITE + r"adapter_fusion_layer\.(.+)\.(query|key|value|dense)\.(weight|bias)$")


PLACES = ("attention", "output")  # in computation order


@dataclass(frozen=True, order=True)
class Site:
    """Where a bottleneck adapter (and a fusion over such adapters) sits: after layer ``layer``'s attention block
    (AdapterHub's ``mh_adapter``) or after its FFN (``output_adapter``). Sites sort in computation order (by layer,
    then place: 'attention' < 'output')."""

    layer: int
    place: str  # one of PLACES

    @property
    def index(self) -> int:
        """The site's position among all 2 x layers places of the model."""
        return 2 * self.layer + PLACES.index(self.place)

    def __str__(self) -> str:
        return f"layer {self.layer} {self.place}"


@dataclass(frozen=True)
class AdapterLayer:
    """One site's bottleneck: z = up_w @ act(down_w @ x + down_b) + up_b (scaling already folded in)."""

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
    sites: dict[Site, AdapterLayer]  # absent layers (leave_out) are simply not keys
    leave_out: frozenset[int] = frozenset()
    places: tuple[str, ...] = ("output",)  # where the config puts it (mh_adapter, output_adapter)
    ln_before: bool = True  # original_ln_before: the adapter reads LN(h + residual), else h
    model_type: str | None = None  # the backbone architecture it was saved on


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
    sites: dict[Site, FusionLayer]
    model_type: str | None = None


@dataclass(frozen=True)
class _AdapterConfig:
    path: Path
    name: str | None
    hidden: int
    act: str
    scaling: float
    leave_out: frozenset[int]
    places: tuple[str, ...]
    ln_before: bool
    model_type: str | None


def _flag(cfg: dict[str, Any], key: str, path: Path) -> bool:
    if key not in cfg:
        raise CheckpointError(f"{path}: field 'config.{key}' is missing")
    if not isinstance(cfg[key], bool):
        raise CheckpointError(f"{path}: field 'config.{key}' = {cfg[key]!r} is not supported; must be true or false")
    return bool(cfg[key])


def _adapter_config(folder: Path) -> _AdapterConfig:
    """The checked ``adapter_config.json`` of a sequential bottleneck adapter; raises CheckpointError naming the field."""
    data = read_config(folder, "adapter_config.json")
    cfg_path = folder / "adapter_config.json"
    cfg = data["config"]
    arch = cfg.get("architecture", "bottleneck")
    if arch not in ("bottleneck", None):
        raise CheckpointError(
            f"{cfg_path}: field 'config.architecture' = {arch!r} is not supported; only bottleneck adapters "
            "(seq_bn, double_seq_bn)"
        )
    for key, want in _ADAPTER_REQUIRED.items():
        if key in cfg and cfg[key] != want:
            raise CheckpointError(
                f"{cfg_path}: field 'config.{key}' = {cfg[key]!r} is not supported; fusionserve serves sequential "
                f"bottleneck adapters (seq_bn, double_seq_bn), which need {key} = {want!r}"
            )
    for key in ("original_ln_after", "residual_before_ln"):
        if key not in cfg:
            raise CheckpointError(f"{cfg_path}: field 'config.{key}' is missing")
    ln_before = _flag(cfg, "original_ln_before", cfg_path)
    places = tuple(place for key, place in _PLACE_FIELDS if _flag(cfg, key, cfg_path))
    if not places:
        raise CheckpointError(f"{cfg_path}: fields 'config.mh_adapter' and 'config.output_adapter' are both false")
    known = set(_ADAPTER_REQUIRED) | _ADAPTER_IGNORED | {k for k, _ in _PLACE_FIELDS}
    unknown = set(cfg) - known - {"reduction_factor", "non_linearity", "leave_out", "scaling", "original_ln_before"}
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
    return _AdapterConfig(
        cfg_path, data.get("name"), hidden, act, float(scaling), frozenset(raw_leave_out), places, ln_before,
        model_type(data),
    )  # fmt: skip


def _adapter_sites(folder: Path, cfg: _AdapterConfig) -> tuple[str | None, dict[Site, AdapterLayer]]:
    """(the adapter name in the weight keys, per site the checked weights with the up-projection scaled)."""
    weights = read_weights(folder, "adapter.safetensors", "pytorch_adapter.bin")
    raw: dict[tuple[Site, str], dict[str, torch.Tensor]] = {}
    names: set[str] = set()
    for key, tensor in weights.items():
        m = _ADAPTER_KEY.search(key)
        if m is None:
            raise CheckpointError(f"{folder}: unexpected weight '{key}' for a bottleneck adapter")
        site, name, part, kind = Site(int(m.group(1)), _PLACE_OF[m.group(2)]), m.group(3), m.group(4), m.group(5)
        if site.place not in cfg.places:
            field = dict((p, k) for k, p in _PLACE_FIELDS)[site.place]
            where = {"attention": "the attention block", "output": "the FFN"}[site.place]
            raise CheckpointError(f"{folder}: weight '{key}' sits after {where}, but 'config.{field}' is false")
        names.add(name)
        raw.setdefault((site, part), {})[kind] = tensor
    if len(names) > 1:
        raise CheckpointError(f"{folder}: weights of several adapters {sorted(names)} in one adapter folder")
    hidden, scaling = cfg.hidden, cfg.scaling
    sites: dict[Site, AdapterLayer] = {}
    for site in sorted({k[0] for k in raw}):
        if site.layer in cfg.leave_out:
            raise CheckpointError(f"{folder}: weights for layer {site.layer}, which 'leave_out' lists")
        down, up = raw.get((site, "down.0"), {}), raw.get((site, "up"), {})
        for part, got in (("adapter_down.0", down), ("adapter_up", up)):
            for kind in ("weight", "bias"):
                if kind not in got:
                    raise CheckpointError(f"{folder}: missing weight for {site}: {part}.{kind}")
        r = down["weight"].shape[0]
        sites[site] = AdapterLayer(
            down_w=check_shape(down["weight"], (r, hidden), f"{site} adapter_down.0.weight", folder),
            down_b=check_shape(down["bias"], (r,), f"{site} adapter_down.0.bias", folder),
            up_w=check_shape(up["weight"], (hidden, r), f"{site} adapter_up.weight", folder) * scaling,
            up_b=check_shape(up["bias"], (hidden,), f"{site} adapter_up.bias", folder) * scaling,
        )
    return (names.pop() if names else None), sites


def load_adapter(folder: Path) -> AdapterCheckpoint:
    """Read a ``save_adapter`` folder holding a sequential bottleneck adapter; raises CheckpointError for anything else."""
    cfg = _adapter_config(folder)
    key_name, sites = _adapter_sites(folder, cfg)
    name = cfg.name or key_name or folder.name
    if not sites:
        raise CheckpointError(f"{folder}: the weight file holds no adapter weights")
    return AdapterCheckpoint(
        name=str(name), folder=folder, hidden_size=cfg.hidden, non_linearity=cfg.act, sites=sites,
        leave_out=cfg.leave_out, places=cfg.places, ln_before=cfg.ln_before, model_type=cfg.model_type,
    )  # fmt: skip


def _fusion_config(folder: Path) -> tuple[dict[str, Any], list[str], int, str, str | None]:
    """(config flags, adapter names, hidden size, fusion name, model type) of a checked ``adapter_fusion_config.json``."""
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
    return cfg, names, hidden, data.get("name") or ",".join(names), model_type(data)


def _fusion_sites(folder: Path, cfg: dict[str, Any], hidden: int, fusion_name: str) -> dict[Site, FusionLayer]:
    """Per site, the checked query/key/value weights the config's flags use."""
    weights = read_weights(folder, "model_adapter_fusion.safetensors", "pytorch_model_adapter_fusion.bin")
    raw: dict[Site, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        m = _FUSION_KEY.search(key)
        if m is None:
            raise CheckpointError(f"{folder}: unexpected weight '{key}' for an adapter fusion")
        if m.group(3) != fusion_name and m.group(3).startswith(fusion_name):
            continue  # save_adapter_fusion("a,b") also writes fusions named "a,b..." ("a,b,c"): not this one's
        if m.group(3) != fusion_name:
            raise CheckpointError(f"{folder}: weight '{key}' belongs to fusion '{m.group(3)}', not '{fusion_name}'")
        site = Site(int(m.group(1)), _PLACE_OF[m.group(2)])
        raw.setdefault(site, {})[f"{m.group(4)}.{m.group(5)}"] = tensor
    if not raw:
        raise CheckpointError(f"{folder}: the weight file holds no fusion weights")
    wanted = [f"{p}.{k}" for p in ("query", "key") if cfg[p] for k in ("weight", "bias")]
    wanted += ["value.weight"] if cfg["value"] else []
    unused = {"dense.weight", "dense.bias"} if not (cfg["query"] or cfg["key"] or cfg["value"]) else set()
    sites: dict[Site, FusionLayer] = {}
    for site, got in sorted(raw.items()):
        for key in unused:  # created but never used by AdapterHub's forward when no flag is on
            got.pop(key, None)
        extra = set(got) - set(wanted)
        if extra:
            raise CheckpointError(f"{folder}: {site} has weights {sorted(extra)} that the config's flags do not use")
        for w in wanted:
            if w not in got:
                raise CheckpointError(f"{folder}: missing weight for {site}: {w}")
        h2, h1 = (hidden, hidden), (hidden,)

        def get(w: str, shape: tuple[int, ...], got: dict[str, torch.Tensor] = got, site: Site = site) -> torch.Tensor | None:
            return check_shape(got[w], shape, f"{site} {w}", folder) if w in got else None

        sites[site] = FusionLayer(
            query_w=get("query.weight", h2), query_b=get("query.bias", h1),
            key_w=get("key.weight", h2), key_b=get("key.bias", h1),
            value_w=get("value.weight", h2),
        )  # fmt: skip
    return sites


def load_fusion(folder: Path) -> FusionCheckpoint:
    """Read a ``save_adapter_fusion`` folder; raises CheckpointError for unsupported flags or missing weights."""
    cfg, names, hidden, fusion_name, arch = _fusion_config(folder)
    sites = _fusion_sites(folder, cfg, hidden, fusion_name)
    return FusionCheckpoint(
        name=str(fusion_name), folder=folder, hidden_size=hidden, adapter_names=tuple(names),
        query_before_ln=cfg["query_before_ln"], sites=sites, model_type=arch,
    )  # fmt: skip
