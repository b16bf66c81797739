"""Evaluation metrics (scoring/metrics.py) against their reference tools: Pearson and Spearman against scipy (ties,
constant series), entity-level precision/recall/F1 against the real seqeval package (random BIO, IOB1 and IOBES tag
sequences, malformed ones included), SQuAD against transformers' copy of the official script's functions and the
v1.1 script's own rules."""

from __future__ import annotations

import math
import random
import warnings

import numpy as np
import pytest

from fusionserve.scoring.metrics import accuracy, entities, entity_f1, normalize_answer, pearson, rank, spearman, squad

scipy_stats = pytest.importorskip("scipy.stats")
seqeval_metrics = pytest.importorskip("seqeval.metrics")


def test_accuracy():
    assert accuracy(["a", "b", "c", "a"], ["a", "b", "a", "b"]) == 0.5
    assert accuracy([0, 2, 1], [0, 2, 1]) == 1.0
    with pytest.raises(ValueError, match="3 gold labels and 2 predictions"):
        accuracy([0, 1, 2], [0, 1])
    with pytest.raises(ValueError, match="0 labels: at least 1 needed"):
        accuracy([], [])


def _series(rng: np.random.Generator, n: int, ties: bool) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=n)
    y = 0.6 * x + rng.normal(size=n)
    if ties:  # STS-B style gold scores: 0..5 in steps of 0.2, many ties; predictions rounded too
        x, y = np.round(np.clip(x + 2.5, 0, 5) * 5) / 5, np.round(y, 1)
    return x, y


@pytest.mark.parametrize("ties", [False, True])
def test_pearson_and_spearman_equal_scipys(ties):
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 257, 5000):
        x, y = _series(rng, n, ties)
        assert pearson(x, y) == pytest.approx(scipy_stats.pearsonr(x, y).statistic, abs=1e-12)
        assert spearman(x, y) == pytest.approx(scipy_stats.spearmanr(x, y).statistic, abs=1e-12)
        assert spearman(list(x), list(-y)) == pytest.approx(scipy_stats.spearmanr(x, -y).statistic, abs=1e-12)


def test_ranks_average_ties_as_scipy_does():
    rng = np.random.default_rng(1)
    for values in ([3.0, 1.0, 3.0, 2.0, 3.0], [1, 1, 1, 1], list(rng.integers(0, 5, size=100)), list(rng.normal(size=50))):
        np.testing.assert_array_equal(rank(values), scipy_stats.rankdata(values, method="average"))


def test_undefined_correlations_are_nan_as_in_scipy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns of the constant input
        assert math.isnan(scipy_stats.pearsonr([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).statistic)
        assert math.isnan(scipy_stats.spearmanr([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).statistic)
    assert math.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    assert math.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    assert math.isnan(pearson([1.0, float("nan"), 3.0], [1.0, 2.0, 3.0]))
    assert math.isnan(spearman([1.0, float("nan"), 3.0], [1.0, 2.0, 3.0]))
    assert pearson([1.0, 2.0], [2.0, 4.0]) == 1.0 and spearman([1.0, 2.0], [4.0, 2.0]) == -1.0
    with pytest.raises(ValueError, match="1 values: at least 2 needed"):
        pearson([1.0], [1.0])
    with pytest.raises(ValueError, match="2 gold values and 3 predictions"):
        spearman([1.0, 2.0], [1.0, 2.0, 3.0])


def _seqeval(gold, pred) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seqeval warns of ill-defined scores and of tags it does not know
        p, r, f, _ = seqeval_metrics.sequence_labeling.precision_recall_fscore_support(gold, pred, average="micro")
        per = seqeval_metrics.sequence_labeling.precision_recall_fscore_support(gold, pred, average=None)
        types = sorted({t for t, _, _ in seqeval_metrics.sequence_labeling.get_entities(gold + pred)})
    return {"micro": (p, r, f), "per_type": {t: (per[0][i], per[1][i], per[2][i], per[3][i]) for i, t in enumerate(types)}}


TAG_SETS = {
    "IOB2": ["O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG"],
    "malformed": ["O", "I-PER", "I-LOC", "B-PER", "B-MISC", "I-MISC", "PER", "B", "I", "LOC"],
    "IOBES": ["O", "B-PER", "I-PER", "E-PER", "S-LOC", "S-PER", "B-LOC", "E-LOC"],
}


@pytest.mark.parametrize("scheme", list(TAG_SETS))
def test_entity_scores_equal_seqevals(scheme):
    rng = random.Random(0)
    tags = TAG_SETS[scheme]
    for _ in range(60):
        gold = [[rng.choice(tags) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 6))]
        # predictions: gold with some tags changed, so that some entities match and some do not
        pred = [[t if rng.random() < 0.7 else rng.choice(tags) for t in s] for s in gold]
        ours, theirs = entity_f1(gold, pred), _seqeval(gold, pred)
        assert (ours["precision"], ours["recall"], ours["f1"]) == pytest.approx(theirs["micro"], abs=1e-12)
        assert set(ours["per_type"]) == set(theirs["per_type"])
        for kind, (p, r, f, support) in theirs["per_type"].items():
            mine = ours["per_type"][kind]
            assert (mine["precision"], mine["recall"], mine["f1"], mine["support"]) == pytest.approx(
                (p, r, f, support), abs=1e-12
            )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_entities_are_read_as_seqeval_reads_them():
    for tags in (
        ["B-PER", "I-PER", "O", "B-LOC"],
        ["I-PER", "I-PER", "B-PER", "I-LOC"],
        ["O", "S-PER", "E-PER", "B-X", "E-X"],
        [],
    ):
        assert entities(tags) == seqeval_metrics.sequence_labeling.get_entities(tags)


def test_entity_f1_worked_example_and_edges():
    gold = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    pred = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    scores = entity_f1(gold, pred)
    assert (scores["precision"], scores["recall"], scores["f1"]) == (0.5, 0.5, 0.5)  # seqeval's docstring example
    assert scores["per_type"]["PER"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 1}
    # an entity never runs from one sentence into the next
    assert entity_f1([["B-PER"], ["I-PER"]], [["B-PER"], ["I-PER"]])["per_type"]["PER"]["support"] == 2
    assert entity_f1([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "per_type": {}}
    with pytest.raises(ValueError, match="sentence 1: 2 gold tags and 3 predicted tags"):
        entity_f1([["O"], ["O", "O"]], [["O"], ["O", "O", "O"]])
    with pytest.raises(ValueError, match="'' is not a tag"):
        entity_f1([["O", ""]], [["O", "O"]])


def test_squad_normalization_and_scores_follow_the_script():
    from transformers.data.metrics import squad_metrics  # the SQuAD script's functions (its 2.0 version)

    cases = [
        ("The Eiffel Tower!", ["the eiffel tower", "Eiffel"]),
        ("an  apple, a pear", ["apple pear"]),
        ("Denver Broncos", ["Broncos", "the Denver Broncos", "Carolina Panthers"]),
        ("1,000 people", ["1000 people", "a thousand people"]),
        ("Ünïcödé café", ["ünïcödé CAFÉ"]),
        ("theatre", ["the atre"]),
        ("in 1990 and 1991", ["1990", "1991"]),
    ]
    for prediction, golds in cases:
        assert normalize_answer(prediction) == squad_metrics.normalize_answer(prediction)
        scores = squad([golds], [prediction])
        assert scores["exact_match"] == max(squad_metrics.compute_exact(g, prediction) for g in golds)
        assert scores["f1"] == pytest.approx(max(squad_metrics.compute_f1(g, prediction) for g in golds), abs=1e-12)
    both = squad([c[1] for c in cases], [c[0] for c in cases])
    assert both["exact_match"] == pytest.approx(5 / 7) and 5 / 7 < both["f1"] < 1  # all but the last two match


def test_squad_v11_rules_where_the_20_script_differs():
    # v1.1: an answer that normalizes to nothing shares no token: F1 0 (the 2.0 script gives 1), exact match 1
    assert squad([["The"]], ["a"]) == {"exact_match": 1.0, "f1": 0.0}
    # no acceptable answer: unanswerable, right only when the prediction is empty
    assert squad([[]], [""]) == {"exact_match": 1.0, "f1": 1.0}
    assert squad([[]], ["Paris"]) == {"exact_match": 0.0, "f1": 0.0}
    with pytest.raises(ValueError, match="a list of acceptable answers per question"):
        squad(["Paris"], ["Paris"])
    with pytest.raises(ValueError, match="2 gold questions and 1 predictions"):
        squad([["a"], ["b"]], ["a"])
