"""The default model's recipe pieces that decide what it is trained and judged on: the learning curve's nested
training sets, a target's test set, the recipe's checks, and the paired verdict of fusion against its own adapter."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fusionserve.errors import FusionServeError
from fusionserve.training import recipe as recipe_module
from fusionserve.training.datasets import Dataset, Example
from fusionserve.training.recipe import Recipe, nested_order, target_data
from fusionserve.training.report import outcome, paired_summary


def _examples(counts: dict[str, int], prefix: str = "t") -> tuple[Example, ...]:
    return tuple(Example(f"{prefix} {label} {i}", None, label) for label, n in counts.items() for i in range(n))


def test_nested_order_gives_label_balanced_prefixes_that_nest():
    examples = _examples({"a": 300, "b": 150, "c": 50})
    order = nested_order(examples, seed=0, what="x")
    assert sorted(order) == list(range(len(examples)))  # every example once
    for n in (10, 100, 250, 499):
        got = Counter(examples[i].label for i in order[:n])
        for label, share in (("a", 0.6), ("b", 0.3), ("c", 0.1)):
            assert abs(got[label] - share * n) <= 1, (n, got)
    # the same seed gives the same order; another seed shuffles within labels
    assert nested_order(examples, seed=0, what="x") == order
    assert nested_order(examples, seed=1, what="x") != order
    assert [examples[i].label for i in nested_order(examples, seed=1, what="x")] == [examples[i].label for i in order]


def test_target_data_trains_on_the_curve_and_can_test_on_everything_else(monkeypatch):
    train, dev, test = (
        _examples({"pos": 60, "neg": 40}),
        _examples({"pos": 6, "neg": 4}, "d"),
        _examples({"pos": 5, "neg": 5}, "s"),
    )
    monkeypatch.setattr(recipe_module.datasets, "load", lambda name, seed=0: Dataset(name, ("neg", "pos"), train, dev, test))
    r = Recipe(curve=(10, 20, 40), target_train=20)
    assert target_data("t", r).test == test  # by default: the official test split only
    monkeypatch.setattr(recipe_module, "TEST_PLUS_UNUSED", ("t",))
    ds = target_data("t", r)
    assert len(ds.train) == 40 and ds.dev == dev
    assert ds.test[: len(test)] == test and len(ds.test) == len(test) + 60  # official test, then the unused train
    assert not set(ds.train) & set(ds.test) and set(ds.train) | set(ds.test[len(test) :]) == set(train)
    assert Counter(ex.label for ex in ds.train[:20]) == {"pos": 12, "neg": 8}  # the served set: a balanced prefix
    with pytest.raises(FusionServeError, match="the curve needs 200"):
        target_data("t", Recipe(curve=(100, 200), target_train=100))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"curve": (100, 500), "target_train": 250}, "including target_train 250"),
        ({"curve": (500, 100), "target_train": 100}, "increasing"),
        ({"eval_every": 0}, "at least 1"),
        ({"max_train": {"snli": 10}}, "no entry for"),
        ({"precision": "fp16"}, "bf16 or fp32"),
    ],
)
def test_recipe_refuses_settings_it_cannot_train(change, message):
    with pytest.raises(FusionServeError, match=message):
        Recipe(**change)


def test_recipe_read_back_from_json_keeps_its_curve():
    r = Recipe(curve=[100, 250], target_train=250)  # training.json stores the tuple as a list
    assert r.curve == (100, 250)
    assert Recipe.quick().target_train in Recipe.quick().curve


def _vectors(n: int, fusion_right: int, adapter_right: int) -> dict[str, np.ndarray]:
    fusion, adapter = np.zeros(n), np.zeros(n)
    fusion[:fusion_right], adapter[:adapter_right] = 1, 1
    return {"fusion": fusion, "adapter": adapter, "head": adapter.copy()}


def test_paired_verdict_says_wins_only_when_the_interval_is_above_zero():
    win = paired_summary(_vectors(1000, 800, 700), seed=0)
    assert win["fusion"]["accuracy"] == 80.0 and win["adapter"]["accuracy"] == 70.0 and win["n"] == 1000
    assert win["fusion_minus_adapter"]["points"] == 10.0 and win["fusion_minus_adapter"]["ci95"][0] > 0
    assert outcome(win["fusion_minus_adapter"]) == "wins"
    assert outcome(paired_summary(_vectors(1000, 700, 800), seed=0)["fusion_minus_adapter"]) == "loses"
    # one example apart on 1,000: the paired interval straddles 0
    tie = paired_summary(_vectors(1000, 701, 700), seed=0)["fusion_minus_adapter"]
    assert tie["ci95"][0] <= 0 <= tie["ci95"][1] and outcome(tie) == "ties"
    # the same predictions give an interval of exactly 0: nothing to tell apart
    same = paired_summary(_vectors(100, 50, 50), seed=0)["fusion_minus_adapter"]
    assert same == {"points": 0.0, "ci95": [0.0, 0.0]} and outcome(same) == "ties"
