"""The served model in PyTorch: one frozen HF ``BertModel``, and per target task the blocks that replace each
layer's output LayerNorm (plain / adapter / folded fusion, see ``fusion.py``) plus a classification head.

Built from plain transformers modules (no ``adapters.init`` patching), so the exported graph keeps the
attention pattern ONNX Runtime's transformer optimizer fuses. ``forward`` is pure: no state changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import BertConfig, BertModel
from transformers.utils import logging as hf_logging

from fusionserve.errors import CheckpointError, SpecError

from .checkpoint import AdapterCheckpoint, FusionCheckpoint, HeadCheckpoint, load_adapter, load_fusion, load_head
from .fusion import AdapterBlock, FoldedFusionBlock, PlainBlock, activation
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


class TaskModule(nn.Module):
    def __init__(self, info: TaskInfo, blocks: list[nn.Module], head: ClassificationHead) -> None:
        super().__init__()
        self.info = info
        self.blocks = nn.ModuleList(blocks)
        self.head = head


class FusionBertModel(nn.Module):
    """Frozen BERT + adapters + fusion layers + heads for every task of a spec, sharing one backbone."""

    def __init__(self, bert: BertModel, tasks: dict[str, TaskModule]) -> None:
        super().__init__()
        self.bert = bert
        self.tasks = nn.ModuleDict(tasks)
        self.requires_grad_(False)
        self.eval()

    @property
    def task_infos(self) -> dict[str, TaskInfo]:
        return {name: t.info for name, t in self.tasks.items()}  # type: ignore[union-attr]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        *,
        task: str,
        return_fusion_activations: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, num_labels); with ``return_fusion_activations`` also the softmax weights
        (batch, layers, seq, n_adapters) of a fusion task (zeros where an adapter is absent from a layer).

        Raises SpecError for an unknown task, or when activations are asked of a task without fusion.
        """
        if task not in self.tasks:
            raise SpecError(f"unknown task '{task}'; known tasks: {', '.join(self.tasks)}")
        mod: TaskModule = self.tasks[task]  # type: ignore[assignment]
        if return_fusion_activations and mod.info.kind != "fusion":
            raise SpecError(f"task '{task}' has no fusion layer ({mod.info.kind} task); there are no fusion activations")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        bert = self.bert
        h = bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)  # (batch, seq, hidden)
        mask = bert.get_extended_attention_mask(attention_mask, input_ids.shape)  # (batch, 1, 1, seq)
        acts = []
        for layer, block in zip(bert.encoder.layer, mod.blocks, strict=True):
            a = layer.attention(h, attention_mask=mask)[0]  # (batch, seq, hidden)
            f = layer.output.dense(layer.intermediate(a))  # (batch, seq, hidden), dropout is a no-op in eval
            h, s = block(f, a, layer.output.LayerNorm)
            if return_fusion_activations:
                n = len(mod.info.adapters)
                acts.append(s if s is not None else h.new_zeros((*h.shape[:2], n)))
        cls = h[:, 0]
        if mod.head.use_pooler:
            cls = bert.pooler(h)
        logits = mod.head(cls)
        if return_fusion_activations:
            return logits, torch.stack(acts, dim=1)  # (batch, layers, seq, n_adapters)
        return logits


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


def build_model(spec: ModelSpec) -> FusionBertModel:
    """Load every checkpoint a spec names and assemble the folded model.

    Raises SpecError or CheckpointError: a fusion naming an adapter the spec lacks, hidden sizes that
    disagree, missing weights, unsupported configurations.
    """
    heads = {name: load_head(t.head) for name, t in spec.tasks.items()}
    bert = load_backbone(str(spec.base_model), use_pooler=any(h.use_pooler for h in heads.values()))
    config = bert.config
    n_layers = config.num_hidden_layers
    adapters = {name: load_adapter(folder) for name, folder in spec.adapters.items()}
    for ckpt in (*adapters.values(), *heads.values()):
        _check_hidden(ckpt, config)
    for ad in adapters.values():
        _check_layers(ad, n_layers)

    tasks: dict[str, TaskModule] = {}
    for name, t in spec.tasks.items():
        head = heads[name]
        blocks: list[nn.Module]
        if t.fusion is not None:
            fusion = load_fusion(t.fusion)
            _check_hidden(fusion, config)
            _check_layers(fusion, n_layers)
            missing = [a for a in fusion.adapter_names if a not in adapters]
            if missing:
                raise SpecError(
                    f"{t.fusion}: the fusion of task '{name}' names adapter(s) {missing} that the spec lacks "
                    f"(spec adapters: {', '.join(adapters) or 'none'})"
                )
            members = [adapters[a] for a in fusion.adapter_names]
            acts = {m.non_linearity for m in members}
            if len(acts) > 1:
                raise CheckpointError(f"{t.fusion}: the fused adapters use different non_linearity values {sorted(acts)}")
            act = members[0].non_linearity
            blocks, per_layer = [], []
            for i in range(n_layers):
                present = [p for p, m in enumerate(members) if i in m.layers]
                per_layer.append(tuple(fusion.adapter_names[p] for p in present))
                if not present:  # AdapterHub skips the layer when none of the fused adapters is in it
                    blocks.append(PlainBlock())
                    continue
                if i not in fusion.layers:
                    raise CheckpointError(f"{t.fusion}: missing fusion weights for layer {i}")
                block = FoldedFusionBlock(
                    [members[p].layers[i] for p in present], act, fusion.layers[i], present, len(members),
                    fusion.query_before_ln,
                )  # fmt: skip
                blocks.append(block)
            info = TaskInfo(name, "fusion", head.labels, fusion.adapter_names, tuple(per_layer))
        elif t.adapter is not None:
            ad = adapters[t.adapter]
            blocks = [AdapterBlock(ad.layers[i], ad.non_linearity) if i in ad.layers else PlainBlock() for i in range(n_layers)]
            per = tuple((t.adapter,) if i in ad.layers else () for i in range(n_layers))
            info = TaskInfo(name, "adapter", head.labels, (t.adapter,), per)
        else:
            blocks = [PlainBlock() for _ in range(n_layers)]
            info = TaskInfo(name, "head", head.labels, (), tuple(() for _ in range(n_layers)))
        tasks[name] = TaskModule(info, blocks, ClassificationHead(head))
    return FusionBertModel(bert, tasks)
