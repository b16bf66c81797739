"""The plain training loop the stages share: tokenized splits, length-grouped batches, and ``fit`` (AdamW with
linear decay, early stopping on dev accuracy, best epoch kept)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from .datasets import Dataset


@dataclass
class Encoded:
    """One split, tokenized without padding."""

    ids: list[list[int]]
    types: list[list[int]]
    labels: torch.Tensor  # (n,) int64

    def __len__(self) -> int:
        return len(self.ids)


def encode(tokenizer: Any, ds: Dataset, split: str, max_len: int) -> Encoded:
    examples = getattr(ds, split)
    pairs = [ex.text_pair for ex in examples] if examples and examples[0].text_pair is not None else None
    enc = tokenizer([ex.text for ex in examples], pairs, truncation=True, max_length=max_len)
    labels = torch.tensor([ds.labels.index(ex.label) for ex in examples], dtype=torch.long)
    return Encoded(enc["input_ids"], enc["token_type_ids"], labels)


def batches(data: Encoded, size: int, gen: torch.Generator | None = None) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """(indices, padded batch). Training (``gen`` given): shuffled, with similar lengths grouped in pools of 16
    batches to pad little; evaluation: sorted by length."""
    n = len(data)
    if gen is None:
        order = sorted(range(n), key=lambda i: len(data.ids[i]))
        chunks = [order[i : i + size] for i in range(0, n, size)]
    else:
        perm, pool, chunks = torch.randperm(n, generator=gen).tolist(), size * 16, []
        for start in range(0, n, pool):
            group = sorted(perm[start : start + pool], key=lambda i: len(data.ids[i]))
            chunks += [group[i : i + size] for i in range(0, len(group), size)]
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=gen).tolist()]
    for idx in chunks:
        width = max(len(data.ids[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)  # (batch, seq); [PAD] is id 0
        types = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            k = len(data.ids[i])
            ids[row, :k], types[row, :k], mask[row, :k] = torch.tensor(data.ids[i]), torch.tensor(data.types[i]), 1
        yield idx, {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": data.labels[idx]}


def n_batches(n: int, size: int) -> int:
    return -(-n // size)


def fit(
    desc: str,
    params: list[nn.Parameter],
    epoch_batches: Callable[[int], Iterator[Any]],
    steps_per_epoch: int,
    loss_of: Callable[[Any], torch.Tensor],
    dev_accuracy: Callable[[], float],
    epochs: int,
    lr: float,
    patience: int,
) -> dict[str, Any]:
    """AdamW with linear decay; dev accuracy after every epoch; stops after ``patience`` epochs without a new best
    and puts the best epoch's weights back. Returns the history."""
    opt = torch.optim.AdamW(params, lr=lr)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1.0 - step / total))
    best_acc, best_epoch, best = -1.0, 0, [p.detach().clone() for p in params]
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        losses = []
        with tqdm(
            total=steps_per_epoch, desc=f"{desc} epoch {epoch}/{epochs}", unit="batch", file=sys.stderr, leave=False
        ) as bar:
            for batch in epoch_batches(epoch):
                loss = loss_of(batch)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
                bar.update()
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        acc = dev_accuracy()
        history.append({"epoch": epoch, "train_loss": round(sum(losses) / len(losses), 4), "dev_accuracy": round(acc, 4)})
        tqdm.write(f"{desc} epoch {epoch}: train loss {history[-1]['train_loss']:.4f}, dev accuracy {acc:.4f}", file=sys.stderr)
        if acc > best_acc:
            best_acc, best_epoch, best = acc, epoch, [p.detach().clone() for p in params]
        elif epoch - best_epoch >= patience:
            break
    with torch.no_grad():
        for p, b in zip(params, best, strict=True):
            p.copy_(b)
    return {"best_epoch": best_epoch, "dev_accuracy": round(best_acc, 4), "epochs": history,
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def stream(make_pass: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """Batches of one shuffled pass after another, without end (a target's fits are counted in steps)."""
    while True:
        yield from make_pass()


def first(data: Encoded, n: int | None) -> Encoded:
    return data if n is None else Encoded(data.ids[:n], data.types[:n], data.labels[:n])
