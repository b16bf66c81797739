"""New fusion targets over the default model's adapters, made and saved by AdapterHub itself, for benchmarks/tasks.py.

Each target is an AdapterFusion (a distinct subset of the 7 adapters, 'dynamic' config) and a classification head, at
AdapterHub's initialisation plus a seeded perturbation: untrained (timings and parity do not depend on training),
but saved with the library's own ``save_adapter_fusion`` / ``save_head``, exactly as a trained target would be. A
spec over the default model plus the targets is written too, for the full export to compare against.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import torch
import yaml

from fusionserve.cli.default import DEFAULT_MODEL
from fusionserve.export.spec import load_spec


def adapter_subsets(names: list[str], n: int) -> list[tuple[str, ...]]:
    """``n`` distinct subsets of two or more adapters (AdapterHub keeps one fusion per set), largest first."""
    subsets = [c for size in range(len(names), 1, -1) for c in itertools.combinations(names, size)]
    if n > len(subsets):
        raise ValueError(f"{n} targets need {n} distinct adapter sets; {len(names)} adapters give {len(subsets)}")
    return subsets[:n]


def make_targets(out: Path, n: int, seed: int = 0) -> Path:
    """Write ``n`` targets under ``out``/fusions/target<k> and heads/target<k>, and ``out``/model.yaml: the default
    model's spec with them added. Reuses what an earlier call made. Returns the spec path."""
    spec_path = out / "model.yaml"
    if spec_path.is_file() and len(yaml.safe_load(spec_path.read_text())["tasks"]) >= n + 11:
        return spec_path
    from adapters import BertAdapterModel
    from adapters.composition import Fuse

    base = load_spec(DEFAULT_MODEL / "model.yaml")
    model = BertAdapterModel.from_pretrained(str(base.base_model))
    for name, folder in base.adapters.items():
        model.load_adapter(str(folder), load_as=name, set_active=False, use_safetensors=True)
    raw = yaml.safe_load((DEFAULT_MODEL / "model.yaml").read_text())
    raw["base_model"] = str(base.base_model)
    raw["adapters"] = {name: str(folder) for name, folder in base.adapters.items()}
    raw["tasks"] = {
        t: {k: str(DEFAULT_MODEL / v) if k in ("head", "fusion") else v for k, v in entry.items()}
        for t, entry in raw["tasks"].items()
    }
    gen = torch.Generator().manual_seed(seed)
    for sub in ("fusions", "heads"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for k, subset in enumerate(adapter_subsets(list(base.adapters), n)):
        task = f"target{k}"
        model.add_adapter_fusion(Fuse(*subset), config="dynamic")
        model.add_classification_head(task, num_labels=2 + k % 3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if f"adapter_fusion_layer.{','.join(subset)}." in name or name.startswith(f"heads.{task}."):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for sub in (f"fusions/{task}", f"heads/{task}"):
            shutil.rmtree(out / sub, ignore_errors=True)
        model.save_adapter_fusion(str(out / "fusions" / task), ",".join(subset))
        model.save_head(str(out / "heads" / task), task)
        # AdapterHub saves every fusion (head) whose name starts with the one asked for: keep one at a time
        model.delete_adapter_fusion(Fuse(*subset))
        model.delete_head(task)
        raw["tasks"][task] = {"fusion": str(out / "fusions" / task), "head": str(out / "heads" / task)}
    spec_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return spec_path
