"""Spec -> ``FusionBertModel``: load and check every checkpoint, decide each layer's adapter stack, fold each
task's fusion (or single adapter, or nothing) over it, and describe the tasks.

``dropped`` prunes fusions (see ``prune.py``): a task's fusion mixes only the adapters not dropped in a layer (the
softmax renormalises over them), and nothing where all are dropped. A layer's stack holds only the adapters some
task still uses there, so pruning an adapter no other task needs removes its cost from that layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from transformers import BertConfig, BertModel
from transformers.utils import logging as hf_logging

from fusionserve.errors import CheckpointError, SpecError

from .checkpoint import AdapterCheckpoint, FusionCheckpoint, HeadCheckpoint, load_adapter, load_fusion, load_head
from .fusion import AdapterLayerBlock, PlainBlock, TaskLayer, fold_adapter, fold_fusion, fold_nothing
from .model import ClassificationHead, FusionBertModel, TaskInfo
from .spec import ModelSpec

# task -> per layer, the adapters removed from that task's fusion there (see prune.py)
Dropped = Mapping[str, Sequence[frozenset[str]]]


def load_backbone(folder: str, use_pooler: bool) -> BertModel:
    """The frozen base BERT, eager attention (the form ONNX Runtime fuses); raises CheckpointError on missing weights."""
    try:
        config = BertConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: cannot read the base model's config.json: {exc}") from None
    if config.model_type != "bert":
        raise CheckpointError(f"{folder}/config.json: field 'model_type' = {config.model_type!r} is not supported; only 'bert'")
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the unused-pooler notice is expected; real problems are raised below
    try:
        bert, info = BertModel.from_pretrained(
            folder, add_pooling_layer=use_pooler, attn_implementation="eager", output_loading_info=True
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{folder}: cannot load the base model weights: {exc}") from None
    finally:
        hf_logging.set_verbosity(previous)
    if info["missing_keys"]:
        raise CheckpointError(f"{folder}: base model weights are missing {sorted(info['missing_keys'])[:8]}")
    return bert.eval()


def _check_hidden(ckpt: AdapterCheckpoint | FusionCheckpoint | HeadCheckpoint, config: BertConfig) -> None:
    if ckpt.hidden_size != config.hidden_size:
        raise CheckpointError(
            f"{ckpt.folder}: hidden_size {ckpt.hidden_size} disagrees with the base model's hidden_size {config.hidden_size}"
        )


def _check_layers(ckpt: AdapterCheckpoint | FusionCheckpoint, n_layers: int) -> None:
    bad = [i for i in ckpt.layers if i >= n_layers]
    if bad:
        raise CheckpointError(f"{ckpt.folder}: weights for layer(s) {bad}, but the base model has {n_layers} layers")
    if isinstance(ckpt, AdapterCheckpoint):
        missing = [i for i in range(n_layers) if i not in ckpt.layers and i not in ckpt.leave_out]
        if missing:
            raise CheckpointError(f"{ckpt.folder}: no weights for layer(s) {missing}, which 'leave_out' does not list")


@dataclass
class _Loaded:
    """Every checkpoint of a spec, checked against the backbone and each other, and the pruning asked for."""

    spec: ModelSpec
    bert: BertModel
    heads: dict[str, HeadCheckpoint]
    adapters: dict[str, AdapterCheckpoint]
    fusions: dict[str, FusionCheckpoint]
    dropped: dict[str, Sequence[frozenset[str]]]

    @property
    def n_layers(self) -> int:
        return int(self.bert.config.num_hidden_layers)

    def mixed(self, task: str, i: int) -> tuple[str, ...]:
        """The adapters ``task`` mixes in layer ``i``, in its fusion's order (before checking which exist there)."""
        t = self.spec.tasks[task]
        if task in self.fusions:
            gone = self.dropped[task][i] if task in self.dropped else frozenset()
            return tuple(a for a in self.fusions[task].adapter_names if a not in gone)
        return (t.adapter,) if t.adapter else ()


def _load(spec: ModelSpec, dropped: Dropped | None) -> _Loaded:
    """Load the backbone and every checkpoint; raises SpecError / CheckpointError for anything that does not fit."""
    heads = {name: load_head(t.head) for name, t in spec.tasks.items()}
    bert = load_backbone(str(spec.base_model), use_pooler=any(h.use_pooler for h in heads.values()))
    config = bert.config
    n_layers = config.num_hidden_layers
    adapters = {name: load_adapter(folder) for name, folder in spec.adapters.items()}
    checkpoints: list[AdapterCheckpoint | HeadCheckpoint] = [*adapters.values(), *heads.values()]
    for ckpt in checkpoints:
        _check_hidden(ckpt, config)
    for ad in adapters.values():
        _check_layers(ad, n_layers)
    fusions = {}
    for name, t in spec.tasks.items():
        if t.fusion is None:
            continue
        fusion = fusions[name] = load_fusion(t.fusion)
        _check_hidden(fusion, config)
        _check_layers(fusion, n_layers)
        missing = [a for a in fusion.adapter_names if a not in adapters]
        if missing:
            raise SpecError(
                f"{t.fusion}: the fusion of task '{name}' names adapter(s) {missing} that the spec lacks "
                f"(spec adapters: {', '.join(adapters) or 'none'})"
            )
    pruned = dict(dropped or {})
    for task, layers in pruned.items():
        if task not in fusions:
            kind = spec.task(task).kind
            raise SpecError(f"cannot prune task '{task}': it has no fusion layer ({kind} task); only fusions are pruned")
        if len(layers) != n_layers:
            raise SpecError(f"pruning of task '{task}' lists {len(layers)} layers; the base model has {n_layers}")
    return _Loaded(spec, bert, heads, adapters, fusions, pruned)


def _stacks(m: _Loaded) -> tuple[tuple[str, ...], list[tuple[str, ...]], str]:
    """(served adapters in spec order, per layer the adapters stacked there, their one non-linearity). A layer's
    stack holds the adapters some task uses there; an adapter absent from a layer is not in it."""
    spec, adapters = m.spec, m.adapters
    used_in = [{a for task in spec.tasks for a in m.mixed(task, i) if i in adapters[a].layers} for i in range(m.n_layers)]
    used = set().union(*used_in)
    names = tuple(a for a in adapters if a in used)  # spec order; unused adapters are validated, not served
    acts = {adapters[a].non_linearity for a in names}
    if len(acts) > 1:
        which = ", ".join(f"{a}={adapters[a].non_linearity}" for a in names)
        raise CheckpointError(
            f"{spec.path}: the served adapters use different non_linearity values ({which}); one graph needs one"
        )
    stacks = [tuple(a for a in names if a in used_in[i]) for i in range(m.n_layers)]
    return names, stacks, next(iter(acts), "relu")


def _fold_layer(m: _Loaded, i: int, stack_names: tuple[str, ...]) -> tuple[list[TaskLayer], dict[str, tuple[str, ...]]]:
    """Every task's folded weights over layer ``i``'s stack, and the adapters each task mixes there."""
    stack = [m.adapters[a].layers[i] for a in stack_names]
    r = max(ad.down_w.shape[0] for ad in stack)
    folded, present_by_task = [], {}
    for task, t in m.spec.tasks.items():
        if task in m.fusions:
            fusion = m.fusions[task]
            present = tuple(a for a in m.mixed(task, i) if a in stack_names)
            if present and i not in fusion.layers:
                raise CheckpointError(f"{t.fusion}: missing fusion weights for layer {i}")
            members = [stack_names.index(a) for a in present]
            # AdapterHub skips the layer when none of the fused adapters is in it
            folded.append(
                fold_fusion(stack, r, members, fusion.layers[i], fusion.query_before_ln) if present else fold_nothing(stack, r)
            )
        elif t.adapter is not None and t.adapter in stack_names:
            present = (t.adapter,)
            folded.append(fold_adapter(stack, r, stack_names.index(t.adapter)))
        else:
            present = ()
            folded.append(fold_nothing(stack, r))
        present_by_task[task] = present
    return folded, present_by_task


def _task_infos(m: _Loaded, per_layer: dict[str, list[tuple[str, ...]]]) -> list[TaskInfo]:
    """What each task is, in spec order; a pruned fusion reports only the adapters it still mixes somewhere."""
    infos = []
    for task, t in m.spec.tasks.items():
        if task in m.dropped:
            task_adapters = tuple(a for a in m.fusions[task].adapter_names if any(a in layer for layer in per_layer[task]))
            if not task_adapters:
                raise SpecError(f"pruning leaves task '{task}' without any adapter in any layer; keep at least one")
        elif task in m.fusions:
            task_adapters = m.fusions[task].adapter_names
        else:
            task_adapters = (t.adapter,) if t.adapter else ()
        infos.append(TaskInfo(task, t.kind, m.heads[task].labels, tuple(task_adapters), tuple(per_layer[task])))
    return infos


def build_model(spec: ModelSpec, dropped: Dropped | None = None) -> FusionBertModel:
    """Load every checkpoint a spec names and assemble the folded model (``dropped``: see the module docstring).

    Raises SpecError or CheckpointError: a fusion naming an adapter the spec lacks, hidden sizes that
    disagree, missing weights, unsupported configurations, pruning of a task without fusion.
    """
    m = _load(spec, dropped)
    names, stacks, act = _stacks(m)
    blocks: list[nn.Module] = []
    per_layer: dict[str, list[tuple[str, ...]]] = {task: [] for task in spec.tasks}
    for i, stack_names in enumerate(stacks):
        if not stack_names:
            blocks.append(PlainBlock())
            for task in spec.tasks:
                per_layer[task].append(())
            continue
        folded, present = _fold_layer(m, i, stack_names)
        for task in spec.tasks:
            per_layer[task].append(present[task])
        blocks.append(AdapterLayerBlock([m.adapters[a].layers[i] for a in stack_names], act, folded))
    infos = _task_infos(m, per_layer)
    head_modules = [ClassificationHead(m.heads[task]) for task in spec.tasks]
    return FusionBertModel(m.bert, blocks, head_modules, infos, names, stacks)
