"""The served model in PyTorch: one frozen HF ``BertModel``, and per target task the blocks that replace each
layer's output LayerNorm (plain / adapter / folded fusion, see ``fusion.py``) plus a classification head.

Built from plain transformers modules (no ``adapters.init`` patching), so the exported graph keeps the
attention pattern ONNX Runtime's transformer optimizer fuses. ``forward`` is pure: no state changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertModel
from transformers.utils import logging as hf_logging

from fusionserve.errors import CheckpointError, SpecError

from .checkpoint import AdapterCheckpoint, FusionCheckpoint, HeadCheckpoint, load_adapter, load_fusion, load_head
from .fusion import AdapterLayerBlock, PlainBlock, activation, fold_adapter, fold_fusion, fold_nothing
from .spec import ModelSpec


@dataclass(frozen=True)
class TaskInfo:
    """What a caller needs to know about a task: its kind, labels in id order, and the adapters it uses."""

    name: str
    kind: Literal["fusion", "adapter", "head"]
    labels: tuple[str, ...]
    adapters: tuple[str, ...]  # fusion: in the fusion's order (the activation columns); adapter: one name
    adapters_per_layer: tuple[tuple[str, ...], ...]  # which of them act in each layer (leave_out removes some)


class ClassificationHead(nn.Module):
    """AdapterHub's ClassificationHead at inference: [CLS] (or pooler) -> (Linear -> act)* -> Linear."""

    def __init__(self, ckpt: HeadCheckpoint) -> None:
        super().__init__()
        self.act_name = ckpt.activation
        self.use_pooler = ckpt.use_pooler
        self.linears = nn.ModuleList()
        for w, b in ckpt.linears:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            with torch.no_grad():
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            self.linears.append(lin)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        x = cls  # (batch, hidden)
        for i, lin in enumerate(self.linears):
            x = lin(x)
            if i < len(self.linears) - 1 and self.act_name is not None:
                x = activation(self.act_name)(x)
        return x  # (batch, num_labels)


class FusionBertModel(nn.Module):
    """Frozen BERT + every adapter, fusion layer and head of a spec, in one module: the graph that gets exported.

    ``forward`` takes a task index and returns padded logits and the fusion activations over all adapters;
    ``classify`` is the by-name view of it. Both are pure: nothing in them changes state.
    """

    def __init__(
        self,
        bert: BertModel,
        blocks: list[nn.Module],
        heads: list[ClassificationHead],
        infos: list[TaskInfo],
        adapter_names: tuple[str, ...],
        stacks: list[tuple[str, ...]],
    ) -> None:
        super().__init__()
        self.bert = bert
        self.blocks = nn.ModuleList(blocks)  # one per layer, shared by all tasks
        self.heads = nn.ModuleList(heads)  # one per task, in task-index order
        self.infos = {info.name: info for info in infos}
        self.task_index = {info.name: i for i, info in enumerate(infos)}
        self.adapter_names = adapter_names  # the columns of the fusion activations
        self.stacks = stacks  # per layer, the adapters in its stack
        self.max_labels = max(len(info.labels) for info in infos)
        self.use_pooler = any(h.use_pooler for h in heads)
        for i, stack in enumerate(stacks):  # (N_layer, N_all) one-hot: layer stack -> activation columns
            expand = torch.zeros(len(stack), len(adapter_names))
            for row, name in enumerate(stack):
                expand[row, adapter_names.index(name)] = 1.0
            self.register_buffer(f"expand_{i}", expand, persistent=False)
        self.requires_grad_(False)
        self.eval()

    @property
    def task_infos(self) -> dict[str, TaskInfo]:
        return dict(self.infos)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
        task_id: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, max_labels), zero-padded past the task's labels, and the fusion activations
        (batch, layers, seq, n_adapters) over ``adapter_names``, zero where the task does not mix an adapter.
        ``task_id`` is an int64 tensor of shape (1,)."""
        bert = self.bert
        h = bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)  # (batch, seq, hidden)
        mask = bert.get_extended_attention_mask(attention_mask, input_ids.shape)  # (batch, 1, 1, seq)
        acts = []
        for i, (layer, block) in enumerate(zip(bert.encoder.layer, self.blocks, strict=True)):
            a = layer.attention(h, attention_mask=mask)[0]  # (batch, seq, hidden)
            f = layer.output.dense(layer.intermediate(a))  # (batch, seq, hidden), dropout is a no-op in eval
            h, s = block(f, a, layer.output.LayerNorm, task_id)
            expand = getattr(self, f"expand_{i}")
            acts.append(s @ expand if s is not None else h.new_zeros((*h.shape[:2], expand.shape[1])))
        cls = bert.pooler(h) if self.use_pooler else h[:, 0]  # (batch, hidden)
        logits = torch.stack([self._padded_head(head, h[:, 0], cls) for head in self.heads])  # (tasks, batch, max_labels)
        logits = logits[0] if len(self.heads) == 1 else logits.index_select(0, task_id).squeeze(0)
        return logits, torch.stack(acts, dim=1)  # (batch, max_labels), (batch, layers, seq, n_adapters)

    def _padded_head(self, head: nn.Module, first: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        out = head(pooled if head.use_pooler else first)  # (batch, num_labels)
        return F.pad(out, (0, self.max_labels - out.shape[-1]))

    def classify(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        *,
        task: str,
        return_fusion_activations: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, num_labels) of ``task``; with ``return_fusion_activations`` also the softmax weights
        (batch, layers, seq, n) over the task's fused adapters in the fusion's order (zero where one is absent).

        Raises SpecError for an unknown task, or when activations are asked of a task without fusion.
        """
        if task not in self.infos:
            raise SpecError(f"unknown task '{task}'; known tasks: {', '.join(self.infos)}")
        info = self.infos[task]
        if return_fusion_activations and info.kind != "fusion":
            raise SpecError(f"task '{task}' has no fusion layer ({info.kind} task); there are no fusion activations")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        task_id = torch.tensor([self.task_index[task]], dtype=torch.long)
        logits, acts = self(input_ids, attention_mask, token_type_ids, task_id)
        logits = logits[:, : len(info.labels)]
        if not return_fusion_activations:
            return logits
        columns = [self.adapter_names.index(n) for n in info.adapters]
        return logits, acts[..., columns]


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


# task -> per layer, the adapters removed from that task's fusion there (see prune.py)
Dropped = Mapping[str, Sequence[frozenset[str]]]


def build_model(spec: ModelSpec, dropped: Dropped | None = None) -> FusionBertModel:
    """Load every checkpoint a spec names and assemble the folded model.

    ``dropped`` prunes fusions: a task's fusion mixes only the adapters not dropped in a layer (the softmax
    renormalises over them), and nothing where all are dropped. A layer's stack holds only the adapters some task
    still uses there, so pruning an adapter no other task needs removes its cost from that layer.

    Raises SpecError or CheckpointError: a fusion naming an adapter the spec lacks, hidden sizes that
    disagree, missing weights, unsupported configurations, pruning of a task without fusion.
    """
    dropped = dict(dropped or {})
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
    for task, layers in dropped.items():
        if task not in fusions:
            kind = spec.task(task).kind
            raise SpecError(f"cannot prune task '{task}': it has no fusion layer ({kind} task); only fusions are pruned")
        if len(layers) != n_layers:
            raise SpecError(f"pruning of task '{task}' lists {len(layers)} layers; the base model has {n_layers}")

    def mixed(task: str, i: int) -> tuple[str, ...]:
        """The adapters ``task`` mixes in layer ``i``, in its fusion's order (before checking which exist there)."""
        t = spec.tasks[task]
        if task in fusions:
            gone = dropped[task][i] if task in dropped else frozenset()
            return tuple(a for a in fusions[task].adapter_names if a not in gone)
        return (t.adapter,) if t.adapter else ()

    # per layer, the adapters some task uses there: the layer's stack (an adapter absent from a layer is not in it)
    used_in = [{a for task in spec.tasks for a in mixed(task, i) if i in adapters[a].layers} for i in range(n_layers)]
    used = set().union(*used_in)
    names = tuple(a for a in adapters if a in used)  # spec order; unused adapters are validated, not served
    acts = {adapters[a].non_linearity for a in names}
    if len(acts) > 1:
        which = ", ".join(f"{a}={adapters[a].non_linearity}" for a in names)
        raise CheckpointError(
            f"{spec.path}: the served adapters use different non_linearity values ({which}); one graph needs one"
        )
    act = next(iter(acts), "relu")

    blocks: list[nn.Module] = []
    stacks: list[tuple[str, ...]] = []
    per_layer: dict[str, list[tuple[str, ...]]] = {task: [] for task in spec.tasks}
    for i in range(n_layers):
        stack_names = tuple(a for a in names if a in used_in[i])
        stacks.append(stack_names)
        if not stack_names:
            blocks.append(PlainBlock())
            for task in spec.tasks:
                per_layer[task].append(())
            continue
        stack = [adapters[a].layers[i] for a in stack_names]
        r = max(ad.down_w.shape[0] for ad in stack)
        folded = []
        for task, t in spec.tasks.items():
            if task in fusions:
                fusion = fusions[task]
                present = tuple(a for a in mixed(task, i) if a in stack_names)
                if present and i not in fusion.layers:
                    raise CheckpointError(f"{t.fusion}: missing fusion weights for layer {i}")
                members = [stack_names.index(a) for a in present]
                # AdapterHub skips the layer when none of the fused adapters is in it
                folded.append(
                    fold_fusion(stack, r, members, fusion.layers[i], fusion.query_before_ln)
                    if present
                    else fold_nothing(stack, r)
                )
            elif t.adapter is not None and t.adapter in stack_names:
                present = (t.adapter,)
                folded.append(fold_adapter(stack, r, stack_names.index(t.adapter)))
            else:
                present = ()
                folded.append(fold_nothing(stack, r))
            per_layer[task].append(present)
        blocks.append(AdapterLayerBlock(stack, act, folded))

    infos = []
    for task, t in spec.tasks.items():
        kind = t.kind
        if task in dropped:  # a pruned fusion reports only the adapters it still mixes somewhere
            task_adapters = tuple(a for a in fusions[task].adapter_names if any(a in layer for layer in per_layer[task]))
            if not task_adapters:
                raise SpecError(f"pruning leaves task '{task}' without any adapter in any layer; keep at least one")
        elif task in fusions:
            task_adapters = fusions[task].adapter_names
        else:
            task_adapters = (t.adapter,) if t.adapter else ()
        infos.append(TaskInfo(task, kind, heads[task].labels, tuple(task_adapters), tuple(per_layer[task])))
    head_modules = [ClassificationHead(heads[task]) for task in spec.tasks]
    return FusionBertModel(bert, blocks, head_modules, infos, names, stacks)
