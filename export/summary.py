"""What ``fusionserve inspect`` reports about a spec: tasks, labels, adapters per layer, parameter counts."""

from __future__ import annotations

from typing import Any

from torch import nn

from fusionserve.serving.model.artifact import describe_head

from .checkpoint import load_adapter, load_fusion
from .fusion import AdapterLayerBlock
from .model import FusionModel
from .spec import ModelSpec


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers(recurse=True))


def summarize(spec: ModelSpec, model: FusionModel) -> dict[str, Any]:
    """A JSON-ready description of the model. Fusion parameters are given as saved (Q, K, V per layer) and as
    served (folded matrices, see fusion.py)."""
    bb = model.backbone
    adapters: dict[str, Any] = {}
    for name, folder in spec.adapters.items():
        ckpt = load_adapter(folder)
        adapters[name] = {
            "folder": str(folder),
            "non_linearity": ckpt.non_linearity,
            "places": list(ckpt.places),  # after the attention block and/or after the FFN
            "original_ln_before": ckpt.ln_before,
            # AdapterHub sizes a layer's bottleneck once, for every place in it
            "bottleneck_per_layer": {s.layer: int(lay.down_w.shape[0]) for s, lay in sorted(ckpt.sites.items())},
            "parameters": sum(t.numel() for lay in ckpt.sites.values() for t in vars(lay).values()),
        }
    tasks: dict[str, Any] = {}
    totals = {
        "backbone": sum(p.numel() for p in bb.parameters()),
        "adapters": 0,
        "fusion_saved": 0,
        "fusion_served": 0,
        "heads": 0,
    }
    totals["adapters"] = sum(a["parameters"] for a in adapters.values())
    blocks = [b for b in model.blocks if isinstance(b, AdapterLayerBlock)]
    totals["served_adapter_stack"] = sum(b.down_w.numel() + b.down_b.numel() for b in blocks)
    for index, (name, t) in enumerate(spec.tasks.items()):
        info = model.infos[name]
        head = model.heads[index]
        entry: dict[str, Any] = info.manifest_entry()
        entry["head_parameters"] = _numel(head)
        totals["heads"] += entry["head_parameters"]
        if t.fusion is not None:
            fusion = load_fusion(t.fusion)
            saved = sum(x.numel() for lay in fusion.sites.values() for x in vars(lay).values() if x is not None)
            served = sum(sum(getattr(b, k)[index].numel() for k in ("score_w", "score_b", "out_w", "out_b")) for b in blocks)
            entry["fusion_parameters"] = {"saved": saved, "served_folded": served}
            totals["fusion_saved"] += saved
            totals["fusion_served"] += served
        tasks[name] = entry
    return {
        "spec": str(spec.path),
        "base_model": {
            "folder": str(spec.base_model),
            "architecture": bb.arch.name,
            "layers": bb.n_layers,
            "hidden_size": bb.hidden_size,
            "attention_heads": bb.n_heads,
            "max_position_embeddings": bb.max_positions,
        },
        "fusion_layers": [str(site) for site in model.sites],
        "adapters": adapters,
        "tasks": tasks,
        "parameters": totals,
    }


def _short(site: str) -> str:
    """'layer 3 output' -> 'L3', 'layer 3 attention' -> 'L3a' (the attention-side fusion of layer 3)."""
    _, layer, place = site.split()
    return f"L{layer}" + ("a" if place == "attention" else "")


def render(summary: dict[str, Any]) -> str:
    """The summary as aligned text for a terminal."""
    b = summary["base_model"]
    lines = [
        f"spec        {summary['spec']}",
        f"base model  {b['folder']}",
        f"            {b['architecture']}, {b['layers']} layers, hidden {b['hidden_size']}, {b['attention_heads']} heads, "
        f"max {b['max_position_embeddings']} positions",
        "",
        "adapters",
    ]
    n_layers = b["layers"]
    for name, a in summary["adapters"].items():
        sizes = a["bottleneck_per_layer"]
        per_layer = " ".join(str(sizes.get(i, "-")) for i in range(n_layers))
        where = " and ".join({"attention": "attention", "output": "FFN"}[p] for p in a["places"])
        lines.append(
            f"  {name:<16} bottleneck per layer [{per_layer}]  {a['non_linearity']}  after {where}  {a['parameters']:,} params"
        )
    lines += ["", "tasks"]
    for name, t in summary["tasks"].items():
        what = {
            "fusion": f"fusion over {', '.join(t['adapters'])}",
            "adapter": f"adapter {t['adapters'][0]}" if t["adapters"] else "",
            "head": "head only",
        }[t["kind"]]
        lines.append(f"  {name:<16} {what}")
        lines.append(f"  {'':<16} {describe_head(t)}")
        if t["kind"] == "fusion":
            names = [_short(site) for site in summary["fusion_layers"]]
            layers = "  ".join(f"{n}:{'+'.join(a) if a else '-'}" for n, a in zip(names, t["adapters_per_layer"], strict=True))
            fp = t["fusion_parameters"]
            lines.append(f"  {'':<16} per layer: {layers}")
            lines.append(f"  {'':<16} fusion params: {fp['saved']:,} saved, {fp['served_folded']:,} served (folded)")
    p = summary["parameters"]
    lines += [
        "",
        "parameters",
        f"  backbone {p['backbone']:,}  adapters {p['adapters']:,}  fusion {p['fusion_saved']:,} saved / {p['fusion_served']:,} folded  heads {p['heads']:,}",
    ]
    return "\n".join(lines)
