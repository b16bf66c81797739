"""Spec -> ``FusionModel``: load and check every checkpoint, decide each site's adapter stack, fold each task's
fusion (or single adapter, or nothing) over it, and describe the tasks.

A site (``checkpoint.Site``) is a place an adapter can sit: after each layer's FFN, and after each layer's attention
block when some adapter of the spec sits there (``mh_adapter``: Houlsby). The sites are the model's fusion layers,
as AdapterHub calls each fusion module: the rows of the fusion activations and what pruning addresses.

``dropped`` prunes fusions (see ``prune.py``): a task's fusion mixes only the adapters not dropped at a site (the
softmax renormalises over them), and nothing where all are dropped. A site's stack holds only the adapters some
task still uses there, so pruning an adapter no other task needs removes its cost from that site.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from fusionserve.errors import CheckpointError, SpecError

from .backbone import Backbone, load_backbone
from .checkpoint import PLACES, AdapterCheckpoint, FusionCheckpoint, Site, load_adapter, load_fusion
from .fusion import AdapterLayerBlock, PlainBlock, TaskLayer, fold_adapter, fold_fusion, fold_nothing
from .head import HeadCheckpoint, load_head
from .model import FusionModel, Head, TaskInfo
from .spec import ModelSpec

# task -> per site, the adapters removed from that task's fusion there (see prune.py)
Dropped = Mapping[str, Sequence[frozenset[str]]]


def _check_base(ckpt: AdapterCheckpoint | FusionCheckpoint | HeadCheckpoint, backbone: Backbone) -> None:
    """The checkpoint was saved on this kind of backbone, with its hidden size."""
    if ckpt.model_type is not None and ckpt.model_type != backbone.arch.name:
        raise CheckpointError(
            f"{ckpt.folder}: field 'model_type' = {ckpt.model_type!r}: saved on another architecture than the base "
            f"model's {backbone.arch.name!r}"
        )
    if ckpt.hidden_size != backbone.hidden_size:
        raise CheckpointError(
            f"{ckpt.folder}: hidden_size {ckpt.hidden_size} disagrees with the base model's hidden_size {backbone.hidden_size}"
        )
    if isinstance(ckpt, HeadCheckpoint) and ckpt.use_pooler and not backbone.arch.has_pooler:
        raise CheckpointError(
            f"{ckpt.folder}/head_config.json: field 'config.use_pooler' = True is not supported: "
            f"{backbone.arch.name} has no pooler"
        )


def _check_sites(ckpt: AdapterCheckpoint | FusionCheckpoint, n_layers: int) -> None:
    bad = sorted({s.layer for s in ckpt.sites if s.layer >= n_layers})
    if bad:
        raise CheckpointError(f"{ckpt.folder}: weights for layer(s) {bad}, but the base model has {n_layers} layers")
    if isinstance(ckpt, AdapterCheckpoint):
        missing = [
            str(site)
            for site in (Site(i, p) for i in range(n_layers) if i not in ckpt.leave_out for p in ckpt.places)
            if site not in ckpt.sites
        ]
        if missing:
            raise CheckpointError(f"{ckpt.folder}: no weights for {', '.join(missing)}, which 'leave_out' does not list")


def fusion_sites(adapters: Sequence[AdapterCheckpoint], n_layers: int) -> tuple[Site, ...]:
    """The model's sites in computation order: the places some adapter of the spec sits, in every layer (after the
    FFN when there is no adapter at all, so that a model always has its fusion layers)."""
    places = {p for ad in adapters for p in ad.places} or {"output"}
    return tuple(Site(i, p) for i in range(n_layers) for p in PLACES if p in places)


@dataclass
class _Loaded:
    """Every checkpoint of a spec, checked against the backbone and each other, and the pruning asked for."""

    spec: ModelSpec
    backbone: Backbone
    heads: dict[str, HeadCheckpoint]
    adapters: dict[str, AdapterCheckpoint]
    fusions: dict[str, FusionCheckpoint]
    dropped: dict[str, Sequence[frozenset[str]]]
    sites: tuple[Site, ...]

    def mixed(self, task: str, row: int) -> tuple[str, ...]:
        """The adapters ``task`` mixes at site ``row``, in its fusion's order (before checking which exist there)."""
        t = self.spec.tasks[task]
        if task in self.fusions:
            gone = self.dropped[task][row] if task in self.dropped else frozenset()
            return tuple(a for a in self.fusions[task].adapter_names if a not in gone)
        return (t.adapter,) if t.adapter else ()


def _load_fusions(spec: ModelSpec, adapters: dict[str, AdapterCheckpoint], backbone: Backbone) -> dict[str, FusionCheckpoint]:
    fusions = {}
    for name, t in spec.tasks.items():
        if t.fusion is None:
            continue
        fusion = fusions[name] = load_fusion(t.fusion)
        _check_base(fusion, backbone)
        _check_sites(fusion, backbone.n_layers)
        missing = [a for a in fusion.adapter_names if a not in adapters]
        if missing:
            raise SpecError(
                f"{t.fusion}: the fusion of task '{name}' names adapter(s) {missing} that the spec lacks "
                f"(spec adapters: {', '.join(adapters) or 'none'})"
            )
    return fusions


def _load(spec: ModelSpec, dropped: Dropped | None) -> _Loaded:
    """Load the backbone and every checkpoint; raises SpecError / CheckpointError for anything that does not fit."""
    heads = {name: load_head(t.head) for name, t in spec.tasks.items()}
    backbone = load_backbone(spec.base_model, use_pooler=any(h.use_pooler for h in heads.values()))
    adapters = {name: load_adapter(folder) for name, folder in spec.adapters.items()}
    checkpoints: list[AdapterCheckpoint | HeadCheckpoint] = [*adapters.values(), *heads.values()]
    for ckpt in checkpoints:
        _check_base(ckpt, backbone)
    for ad in adapters.values():
        _check_sites(ad, backbone.n_layers)
    fusions = _load_fusions(spec, adapters, backbone)
    sites = fusion_sites(list(adapters.values()), backbone.n_layers)
    pruned = dict(dropped or {})
    for task, rows in pruned.items():
        if task not in fusions:
            kind = spec.task(task).kind
            raise SpecError(f"cannot prune task '{task}': it has no fusion layer ({kind} task); only fusions are pruned")
        if len(rows) != len(sites):
            raise SpecError(f"pruning of task '{task}' lists {len(rows)} layers; the model has {len(sites)} fusion layers")
    return _Loaded(spec, backbone, heads, adapters, fusions, pruned, sites)


def _one(m: _Loaded, site: Site, stack: tuple[str, ...], what: str) -> object:
    """The one value of an adapter setting every adapter of a site's stack must share (one block computes them)."""
    values = {getattr(m.adapters[a], what) for a in stack}
    if len(values) > 1:
        which = ", ".join(f"{a}={getattr(m.adapters[a], what)}" for a in stack)
        field = {"non_linearity": "non_linearity", "ln_before": "original_ln_before"}[what]
        raise CheckpointError(
            f"{m.spec.path}: the adapters served at {site} use different {field} values ({which}); one site needs one"
        )
    return values.pop()


def _stacks(m: _Loaded) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(served adapters in spec order, per site the adapters stacked there). A site's stack holds the adapters some
    task uses there; an adapter absent from a site is not in it."""
    spec, adapters = m.spec, m.adapters
    used_in = [
        {a for task in spec.tasks for a in m.mixed(task, row) if site in adapters[a].sites} for row, site in enumerate(m.sites)
    ]
    used = set().union(*used_in)
    names = tuple(a for a in adapters if a in used)  # spec order; unused adapters are validated, not served
    stacks = [tuple(a for a in names if a in used_in[row]) for row in range(len(m.sites))]
    for site, stack in zip(m.sites, stacks, strict=True):
        for what in ("non_linearity", "ln_before"):
            if stack:
                _one(m, site, stack, what)
    return names, stacks


def _fold_site(m: _Loaded, row: int, stack_names: tuple[str, ...]) -> tuple[list[TaskLayer], dict[str, tuple[str, ...]]]:
    """Every task's folded weights over site ``row``'s stack, and the adapters each task mixes there."""
    site = m.sites[row]
    stack = [m.adapters[a].sites[site] for a in stack_names]
    r = max(ad.down_w.shape[0] for ad in stack)
    folded, present_by_task = [], {}
    for task, t in m.spec.tasks.items():
        if task in m.fusions:
            fusion = m.fusions[task]
            present = tuple(a for a in m.mixed(task, row) if a in stack_names)
            if present and site not in fusion.sites:
                raise CheckpointError(f"{t.fusion}: missing fusion weights for {site}")
            members = [stack_names.index(a) for a in present]
            # AdapterHub skips the site when none of the fused adapters is in it
            folded.append(
                fold_fusion(stack, r, members, fusion.sites[site], fusion.query_before_ln) if present else fold_nothing(stack, r)
            )
        elif t.adapter is not None and t.adapter in stack_names:
            present = (t.adapter,)
            folded.append(fold_adapter(stack, r, stack_names.index(t.adapter)))
        else:
            present = ()
            folded.append(fold_nothing(stack, r))
        present_by_task[task] = present
    return folded, present_by_task


def _task_infos(m: _Loaded, per_site: dict[str, list[tuple[str, ...]]]) -> list[TaskInfo]:
    """What each task is, in spec order; a pruned fusion reports only the adapters it still mixes somewhere."""
    infos = []
    for task, t in m.spec.tasks.items():
        if task in m.dropped:
            task_adapters = tuple(a for a in m.fusions[task].adapter_names if any(a in site for site in per_site[task]))
            if not task_adapters:
                raise SpecError(f"pruning leaves task '{task}' without any adapter in any layer; keep at least one")
        elif task in m.fusions:
            task_adapters = m.fusions[task].adapter_names
        else:
            task_adapters = (t.adapter,) if t.adapter else ()
        head = m.heads[task]
        infos.append(
            TaskInfo(task, t.kind, head.labels, tuple(task_adapters), tuple(per_site[task]), head.kind, head.num_choices)
        )
    return infos


def _fixed(m: _Loaded, names: Sequence[str], stacks: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Stacks given from outside (a live artifact's, which a new task must fit: ``tasks.py``), checked against what
    every task of the spec mixes. Raises SpecError naming the task, the adapter and the layer that does not fit."""
    if len(stacks) != len(m.sites):
        raise SpecError(f"the artifact has {len(stacks)} fusion layers; these checkpoints make {len(m.sites)}")
    for task in m.spec.tasks:
        for row, site in enumerate(m.sites):
            for a in m.mixed(task, row):
                if a not in names:
                    raise SpecError(
                        f"task '{task}' uses adapter '{a}', which the artifact does not hold (it holds: {', '.join(names)})"
                    )
                if site in m.adapters[a].sites and a not in stacks[row]:
                    raise SpecError(
                        f"task '{task}' mixes adapter '{a}' at {site}, where the artifact does not serve it (pruned from "
                        f"that layer: it serves {', '.join(stacks[row]) or 'none'} there); export again to serve it"
                    )
    return tuple(names), [tuple(stack) for stack in stacks]


def build_model(
    spec: ModelSpec,
    dropped: Dropped | None = None,
    stacks: tuple[Sequence[str], Sequence[Sequence[str]]] | None = None,
) -> FusionModel:
    """Load every checkpoint a spec names and assemble the folded model (``dropped``: see the module docstring).
    ``stacks``: (served adapters, per site its stack) to fold the tasks over, instead of the stacks the spec's tasks
    make (a live artifact's: see ``_fixed``).

    Raises SpecError or CheckpointError: a fusion naming an adapter the spec lacks, hidden sizes or architectures
    that disagree, missing weights, unsupported configurations, pruning of a task without fusion, a task that does
    not fit the given stacks.
    """
    m = _load(spec, dropped)
    names, stacks_ = _stacks(m) if stacks is None else _fixed(m, *stacks)
    blocks: list[nn.Module] = [PlainBlock() for _ in range(2 * m.backbone.n_layers)]
    per_site: dict[str, list[tuple[str, ...]]] = {task: [] for task in spec.tasks}
    for row, (site, stack_names) in enumerate(zip(m.sites, stacks_, strict=True)):
        if not stack_names:
            for task in spec.tasks:
                per_site[task].append(())
            continue
        folded, present = _fold_site(m, row, stack_names)
        for task in spec.tasks:
            per_site[task].append(present[task])
        first = m.adapters[stack_names[0]]
        stack = [m.adapters[a].sites[site] for a in stack_names]
        blocks[site.index] = AdapterLayerBlock(stack, first.non_linearity, folded, ln_before=first.ln_before)
    infos = _task_infos(m, per_site)
    head_modules = [Head(m.heads[task]) for task in spec.tasks]
    return FusionModel(m.backbone, blocks, head_modules, infos, names, m.sites, stacks_)
