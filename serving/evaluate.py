"""``fusionserve evaluate``: accuracy of a task on labelled JSONL lines, and the latency of a forward pass.

Input lines are ``{"text": ..., "text_pair": ..., "label": ...}``; a line without a usable text or with a label the
task does not have is reported with the reason and left out of the accuracy, and the rest go on.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionserve.errors import InputError

from .calibrate import ActivationRunner
from .predictions import LabelledInput, TextInput, batched
from .tokenize import Encoded


@dataclass(frozen=True)
class Evaluation:
    task: str
    examples: int
    correct: int
    per_label: dict[str, tuple[int, int]]  # label -> (examples, correct)
    bad: list[tuple[int, str]]  # (line, why) of the lines left out

    @property
    def accuracy(self) -> float:
        """Percent correct."""
        return 100.0 * self.correct / self.examples

    @property
    def ci95(self) -> tuple[float, float]:
        """Wilson 95% interval of the accuracy, in percent."""
        n, p, z = self.examples, self.correct / self.examples, 1.96
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return 100.0 * max(0.0, centre - half), 100.0 * min(1.0, centre + half)

    def as_dict(self) -> dict[str, Any]:
        low, high = self.ci95
        return {
            "task": self.task,
            "examples": self.examples,
            "correct": self.correct,
            "accuracy": round(self.accuracy, 2),
            "ci95": [round(low, 2), round(high, 2)],
            "per_label": {k: {"examples": n, "correct": c} for k, (n, c) in self.per_label.items()},
            "bad_lines": len(self.bad),
        }


def evaluate(
    runner: ActivationRunner,
    task: str,
    inputs: Iterator[tuple[int, LabelledInput | InputError]],
    batch_size: int = 32,
    progress: bool = False,
) -> Evaluation:
    """Accuracy of ``task`` over labelled inputs. Raises FusionServeError for an unknown task, InputError when no
    line is usable."""
    from tqdm import tqdm

    labels = runner.task(task).labels
    index = {label: i for i, label in enumerate(labels)}
    per_label = {label: [0, 0] for label in labels}
    bad: list[tuple[int, str]] = []
    bar = tqdm(desc=f"evaluate {task}", unit="text", disable=not progress, file=sys.stderr)
    for batch in batched(inputs, batch_size):
        good: list[tuple[TextInput, int]] = []
        for no, x in batch:
            if isinstance(x, InputError):
                bad.append((no, str(x)))
            elif x.label is None:
                bad.append((no, "missing field 'label'"))
            elif x.label not in index:
                bad.append((no, f"label {x.label!r} is not one of task '{task}''s labels: {', '.join(labels)}"))
            else:
                good.append((x.input, index[x.label]))
        if good:
            logits = runner.run(task, runner.encoder.encode([x for x, _ in good])).logits
            for (_, want), got in zip(good, np.argmax(logits, axis=-1), strict=True):
                per_label[labels[want]][0] += 1
                per_label[labels[want]][1] += int(got == want)
        bar.update(len(batch))
    bar.close()
    examples = sum(n for n, _ in per_label.values())
    if not examples:
        raise InputError(f"no usable labelled line to evaluate task '{task}' on ({len(bad)} bad line(s))")
    correct = sum(c for _, c in per_label.values())
    return Evaluation(task, examples, correct, {k: (n, c) for k, (n, c) in per_label.items()}, bad)


def fixed_batch(runner: ActivationRunner, batch: int, seq: int) -> Encoded:
    """A batch of ``batch`` real-token sequences of exactly ``seq`` tokens, no padding (for timing)."""
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * (seq // 4 + 8))
    one = runner.encoder.encode([TextInput(words)])
    if one.input_ids.shape[1] < seq:
        raise InputError(f"sequence length {seq} exceeds the model's token limit {runner.encoder.max_length}")
    ids, mask, types = (np.repeat(a[:, :seq], batch, axis=0) for a in (one.input_ids, one.attention_mask, one.token_type_ids))
    return Encoded(ids, mask, types, [False] * batch)


def time_round_robin(
    variants: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 2, progress: bool = False
) -> dict[str, list[float]]:
    """Milliseconds per call of each variant, ``rounds`` rounds after ``warmup`` untimed calls each. Every round
    calls every variant once, in a shuffled order, so that machine noise hits all of them alike and round r of
    two variants can be compared."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(0)
    for r in range(rounds):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            variants[name]()
            times[name].append(1000.0 * (time.perf_counter() - start))
        if progress:
            print(f"\r  round {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return times


def latency_samples(
    runs: Mapping[str, tuple[ActivationRunner, str]], batch: int = 16, seq: int = 128, rounds: int = 20, warmup: int = 3
) -> dict[str, list[float]]:
    """Milliseconds of one forward pass of each (runner, task) per round (``time_round_robin``) on a batch of
    ``batch`` sequences of ``seq`` tokens."""
    feeds = {name: fixed_batch(runner, batch, seq) for name, (runner, _) in runs.items()}
    calls = {name: functools.partial(runner.run, task, feeds[name]) for name, (runner, task) in runs.items()}
    return time_round_robin(calls, rounds, warmup)


def latency_ms(
    runs: Mapping[str, tuple[ActivationRunner, str]], batch: int = 16, seq: int = 128, rounds: int = 20, warmup: int = 3
) -> dict[str, float]:
    """Median milliseconds of one forward pass of each (runner, task), timed round-robin (``latency_samples``)."""
    return {name: statistics.median(t) for name, t in latency_samples(runs, batch, seq, rounds, warmup).items()}


def paired_ratio(samples: Mapping[str, list[float]], name: str, reference: str) -> float:
    """Median over rounds of ``name``'s time over ``reference``'s in the same round: slow drifts of a shared
    machine cancel in each round's ratio."""
    return statistics.median(a / b for a, b in zip(samples[name], samples[reference], strict=True))
