"""Round-robin timing of runners: ``fusionserve prune --eval`` and the benchmarks (latency, GPU, pruning) time
their variants with these, so that every figure of a comparison comes from the same rounds of the same run."""

from __future__ import annotations

import functools
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping

import numpy as np

from fusionserve.errors import InputError
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runner import ActivationRunner
from fusionserve.serving.model.tokenize import Encoded


def fixed_batch(runner: ActivationRunner, batch: int, seq: int) -> Encoded:
    """A batch of ``batch`` real-token sequences of exactly ``seq`` tokens, no padding (for timing)."""
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * (seq // 4 + 8))
    one = runner.encoder.encode([TextInput(words)])
    if one.input_ids.shape[1] < seq:
        raise InputError(f"sequence length {seq} exceeds the model's token limit {runner.encoder.max_length}")
    ids, mask, types = (np.repeat(a[:, :seq], batch, axis=0) for a in (one.input_ids, one.attention_mask, one.token_type_ids))
    return Encoded(ids, mask, types, [False] * batch)


def time_round_robin(
    variants: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 2,
    progress: bool = False,
    pause_s: float = 0.0,
) -> dict[str, list[float]]:
    """Milliseconds per call of each variant, ``rounds`` rounds after ``warmup`` untimed calls each. Every round
    calls every variant once, in a shuffled order, so that machine noise hits all of them alike and round r of
    two variants can be compared. ``pause_s``: an untimed sleep before each timed call, so that the worker threads
    of the variant before (ONNX Runtime's spin, waiting for a next run) have stopped before this one starts."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(0)
    for r in range(rounds):
        rng.shuffle(order)
        for name in order:
            if pause_s:
                time.sleep(pause_s)
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
