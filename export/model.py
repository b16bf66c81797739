"""The served model in PyTorch: one frozen HF encoder (``backbone.py``: BERT, RoBERTa, XLM-RoBERTa, DistilBERT), the
blocks that replace the LayerNorm after each attention block and each FFN (plain / adapter / folded fusion, see
``fusion.py``), shared by all tasks, and a prediction head per task (every kind AdapterHub trains: ``head.py``).

Built from plain transformers modules (no ``adapters.init`` patching), so the exported graph keeps the
attention pattern ONNX Runtime's transformer optimizer fuses. ``forward`` is pure: no state changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fusionserve.errors import SpecError
from fusionserve.serving.model.artifact import TOKEN_HEADS

from .backbone import Backbone, attention_bias
from .checkpoint import Site
from .head import HeadCheckpoint
from .nonlinearity import activation


@dataclass(frozen=True)
class TaskInfo:
    """What a caller needs to know about a task: its kind, labels in id order, and the adapters it uses."""

    name: str
    kind: Literal["fusion", "adapter", "head"]
    labels: tuple[str, ...]
    adapters: tuple[str, ...]  # fusion: in the fusion's order (the activation columns); adapter: one name
    adapters_per_layer: tuple[tuple[str, ...], ...]  # which of them act at each fusion site (leave_out removes some)
    head: str = "classification"  # the head's kind (``head.HeadCheckpoint.kind``)
    num_choices: int | None = None  # multiple choice: the count AdapterHub trained with

    @property
    def level(self) -> str:
        """ "token" for a head over every token (tagging, question answering: the graph's token_logits), else "sequence"."""
        return "token" if self.head in TOKEN_HEADS else "sequence"

    def manifest_entry(self) -> dict[str, Any]:
        """The task's fields in a manifest or revision document (``serving/model/artifact.py``'s TaskEntry reads them)."""
        entry: dict[str, Any] = {"kind": self.kind, "head": self.head, "labels": list(self.labels)}
        if self.num_choices is not None:
            entry["num_choices"] = self.num_choices
        entry["adapters"] = list(self.adapters)
        entry["adapters_per_layer"] = [list(layer) for layer in self.adapters_per_layer]
        return entry


LEVELS = ("sequence", "token")
# prefix of the live graph's head tables per level (w0, b0, w1, b1, ...): sequence-level heads read [CLS] (or the pooler)
# into ``logits``, token-level heads every token into ``token_logits``
HEAD_TABLES = {"sequence": "task.head.", "token": "task.token_head."}
OUTPUT = {"sequence": "logits", "token": "token_logits"}


@dataclass(frozen=True)
class HeadForm:
    """What every head of one level of a live graph shares: the stacked head tables hold only weights. With one linear
    layer there is nothing between layers to activate: the activation is None whatever the config names."""

    layers: int
    activation: str | None
    use_pooler: bool

    def __post_init__(self) -> None:
        if self.layers == 1:
            object.__setattr__(self, "activation", None)

    @classmethod
    def of(cls, head: Head) -> HeadForm:
        return cls(len(head.linears), head.act_name, head.use_pooler)

    def describe(self) -> str:
        return f"{self.layers} linear layer(s), activation {self.activation}, use_pooler {self.use_pooler}"


class Head(nn.Module):
    """An AdapterHub prediction head at inference (dropout off): (Linear -> act)* -> Linear over the last axis. A
    sequence-level head is fed the [CLS] state (or the pooler's output), a token-level one every token's state."""

    def __init__(self, ckpt: HeadCheckpoint) -> None:
        super().__init__()
        self.kind, self.level = ckpt.kind, ckpt.level
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, hidden) for a sequence-level head, (batch, seq, hidden) for a token-level one
        for i, lin in enumerate(self.linears):
            x = lin(x)
            if i < len(self.linears) - 1 and self.act_name is not None:
                x = activation(self.act_name)(x)
        return x  # (batch, [seq,] num_labels)


class FusionModel(nn.Module):
    """The frozen backbone + every adapter, fusion layer and head of a spec, in one module: the graph that gets exported.

    ``blocks`` holds one block per place of the backbone, 2 x layers in computation order (``Site.index``: after each
    layer's attention block, after its FFN); ``sites`` are the places whose fusion weights are reported (the rows of
    the fusion activations: the FFN places only, or every place when some adapter sits after the attention block).
    ``forward`` takes a task index and returns padded logits, the fusion activations over all adapters and, when some
    task has a token-level head, padded token logits; ``classify`` is the by-name view of it. Both are pure: nothing in
    them changes state.
    """

    def __init__(
        self,
        backbone: Backbone,
        blocks: list[nn.Module],
        heads: list[Head],
        infos: list[TaskInfo],
        adapter_names: tuple[str, ...],
        sites: tuple[Site, ...],
        stacks: list[tuple[str, ...]],
    ) -> None:
        super().__init__()
        if len(blocks) != 2 * backbone.n_layers or len(stacks) != len(sites):
            raise ValueError(f"{len(blocks)} blocks for {backbone.n_layers} layers, {len(stacks)} stacks for {len(sites)} sites")
        self.backbone = backbone
        self.blocks = nn.ModuleList(blocks)  # one per place, shared by all tasks
        self.heads = nn.ModuleList(heads)  # one per task, in task-index order
        self.infos = {info.name: info for info in infos}
        self.task_index = {info.name: i for i, info in enumerate(infos)}
        self.adapter_names = adapter_names  # the columns of the fusion activations
        self.sites = sites  # the rows of the fusion activations
        self.stacks = stacks  # per site, the adapters in its stack
        # per level, the task indices whose head is of that level (sequence: logits; token: token_logits)
        self.levels = {level: [i for i, info in enumerate(infos) if info.level == level] for level in LEVELS}
        self.max_labels = max((len(infos[i].labels) for i in self.levels["sequence"]), default=1)  # logits' width
        self.token_width = max((len(infos[i].labels) for i in self.levels["token"]), default=0)  # token_logits' width
        self.use_pooler = any(h.use_pooler for h in heads)
        for level, other in zip(LEVELS, LEVELS[::-1], strict=True):
            if self.levels[other]:  # task index -> its head's place among its level's heads (0 for the other level's)
                slot = torch.zeros(len(infos), dtype=torch.long)
                slot[self.levels[level]] = torch.arange(len(self.levels[level]))
                self.register_buffer(f"{level}_slot", slot, persistent=False)
        for i, stack in enumerate(stacks):  # (N_site, N_all) one-hot: site stack -> activation columns
            expand = torch.zeros(len(stack), len(adapter_names))
            for row, name in enumerate(stack):
                expand[row, adapter_names.index(name)] = 1.0
            self.register_buffer(f"expand_{i}", expand, persistent=False)
        self.requires_grad_(False)
        self.eval()

    @property
    def task_infos(self) -> dict[str, TaskInfo]:
        return dict(self.infos)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The graph's outputs in ``forward``'s order: token_logits only when some task has a token-level head."""
        return ("logits", "fusion_activations", *(("token_logits",) if self.levels["token"] else ()))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
        task_id: torch.Tensor,
        tables: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Logits (batch, max_labels) of the sequence-level heads, zero-padded past the task's labels; the fusion
        activations (batch, sites, seq, n_adapters) over ``adapter_names``, zero where the task does not mix an adapter;
        with a token-level task, token logits (batch, seq, token_width) of the token-level heads, zero-padded. A row
        reads the output of its own task's level; the other is meaningless there (``outputs`` names them in order).
        ``task_id`` is an int64 tensor of shape (1,), the task of every row, or (batch,), each row's task. Backbones
        without token types do not read ``token_type_ids`` (the exported graph then has no such input).
        ``tables``: every per-task tensor by its ``live.table_names`` name (the live graph, whose tasks are inputs);
        None: the model's own tasks."""
        bb = self.backbone
        h = bb.embed(input_ids, token_type_ids)  # (batch, seq, hidden)
        bias = attention_bias(attention_mask, h.dtype)  # (batch, 1, 1, seq)
        weights: list[torch.Tensor | None] = []
        for i in range(bb.n_layers):
            # the projections are computed here, outside the blocks: fp16 export keeps the blocks' nodes in fp32
            dense, ln = bb.attention_output(i)
            ctx = bb.context(i, h, bias)  # (batch, seq, hidden)
            a, s = self.blocks[2 * i](F.linear(ctx, dense.weight), dense.bias, h, ln, task_id, _block(tables, 2 * i))
            weights.append(s)
            dense, ln = bb.ffn_output(i)
            inner = bb.intermediate(i, a)  # (batch, seq, intermediate)
            h, s = self.blocks[2 * i + 1](F.linear(inner, dense.weight), dense.bias, a, ln, task_id, _block(tables, 2 * i + 1))
            weights.append(s)
        acts = []
        for row, site in enumerate(self.sites):
            s, expand = weights[site.index], getattr(self, f"expand_{row}")
            acts.append(s @ expand if s is not None else h.new_zeros((*h.shape[:2], expand.shape[1])))
        cls = bb.pool(h) if self.use_pooler else h[:, 0]  # (batch, hidden)
        if not self.levels["sequence"]:  # no sequence-level head: logits are a placeholder, never read
            logits = h.new_zeros((h.shape[0], 1))
        elif tables is not None:
            logits = self._live_heads("sequence", cls, task_id, tables)
        else:
            outs = [self._padded(i, h[:, 0], cls) for i in self.levels["sequence"]]
            logits = self._gathered("sequence", outs, task_id.expand(input_ids.shape[0]))
        out = (logits, torch.stack(acts, dim=1))  # (batch, max_labels), (batch, sites, seq, n_adapters)
        if not self.levels["token"]:
            return out
        if tables is not None:
            return (*out, self._live_heads("token", h, task_id, tables))
        outs = [self._padded(i, h, h) for i in self.levels["token"]]
        return (*out, self._gathered("token", outs, task_id.expand(input_ids.shape[0])))  # (batch, seq, token_width)

    def _gathered(self, level: str, outs: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Each row's own task's output among ``outs`` (one per head of ``level``, every row through each); ``rows``:
        (batch,) each row's task (task_id expanded: one task for all, or one per row)."""
        stacked = torch.stack(outs)  # (heads, batch, [seq,] width)
        if len(outs) == 1:
            return stacked[0]
        if hasattr(self, f"{level}_slot"):  # heads of both levels: the task's place among its level's heads
            rows = getattr(self, f"{level}_slot").index_select(0, rows)
        pick = rows.reshape(1, -1, *([1] * (stacked.dim() - 2))).expand(1, -1, *stacked.shape[2:])  # (1, batch, ...)
        # [0], not .squeeze(0): the gathered axis is 1 by construction, but the tracer cannot know it and exports squeeze
        # as an If over that axis's size, whose two branches ONNX Runtime's optimizer shape-infers again in each of
        # its passes (benchmarks/RESULTS.md, "The optimize step of an export"); [0] is one Gather, the same values
        return stacked.gather(0, pick)[0]  # (batch, [seq,] width)

    def _live_heads(self, level: str, x: torch.Tensor, task_id: torch.Tensor, tables: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Every row through its own task's head of ``level``, from the stacked head tables (one head form per level;
        a task of the other level has zeros there). ``x``: (batch, hidden), or (batch, seq, hidden) for tokens."""
        form, prefix = self.head_form(level), HEAD_TABLES[level]
        token = level == "token"
        for j in range(form.layers):
            w = tables[f"{prefix}w{j}"].index_select(0, task_id)  # (k, out, in): k = 1 or batch
            b = tables[f"{prefix}b{j}"].index_select(0, task_id)  # (k, out)
            if token:
                x = torch.matmul(x, w.transpose(1, 2)) + b.unsqueeze(1)  # (batch, seq, out)
            else:
                x = torch.matmul(x.unsqueeze(1), w.transpose(1, 2)).squeeze(1) + b  # (batch, out)
            if j < form.layers - 1 and form.activation is not None:
                x = activation(form.activation)(x)
        return x  # (batch, [seq,] width)

    def head_form(self, level: str = "sequence") -> HeadForm:
        """The one head form of every task of ``level``, which the live graph's stacked head tables need.

        Raises SpecError naming the two tasks whose heads differ, or when no task has a head of that level."""
        names = list(self.task_index)
        forms = {names[i]: HeadForm.of(self.heads[i]) for i in self.levels[level]}
        if not forms:
            raise SpecError(f"no task has a {level}-level head")
        first = next(iter(forms))
        for name, form in forms.items():
            if form != forms[first]:
                raise SpecError(
                    f"live tasks need one head form for every {level}-level head: '{first}' has "
                    f"{forms[first].describe()}, '{name}' has {form.describe()}"
                )
        return forms[first]

    def _padded(self, index: int, first: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Task ``index``'s head on every row, zero-padded to its level's width."""
        head = self.heads[index]
        out = head(pooled if head.use_pooler else first)  # (batch, [seq,] num_labels)
        width = self.max_labels if head.level == "sequence" else self.token_width
        return F.pad(out, (0, width - out.shape[-1]))

    def classify(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        *,
        task: str,
        return_fusion_activations: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits of ``task``, (batch, num_labels), or (batch, seq, num_labels) for a token-level head (every token,
        padding included); with ``return_fusion_activations`` also the softmax weights (batch, sites, seq, n) over the
        task's fused adapters in the fusion's order (zero where one is absent).

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
        out = self(input_ids, attention_mask, token_type_ids, task_id)
        logits, acts = out[2 if info.level == "token" else 0][..., : len(info.labels)], out[1]
        if not return_fusion_activations:
            return logits
        columns = [self.adapter_names.index(n) for n in info.adapters]
        return logits, acts[..., columns]


def _block(tables: Mapping[str, torch.Tensor] | None, index: int) -> dict[str, torch.Tensor] | None:
    """Block ``index``'s own tables out of the live graph's (by field name), or None."""
    if tables is None:
        return None
    prefix = f"task.blocks.{index}."
    return {k[len(prefix) :]: v for k, v in tables.items() if k.startswith(prefix)}
