"""Extractive QA post-processing (serving/model/qa.py) against the real ``transformers.pipeline("question-answering")``:
the windows equal the tokenizer's own overflowing windows, and the answers picked from the same tiny random model's
logits equal the pipeline's (text, characters, scores to 1e-6) over long contexts read in several windows, texts with
accents, punctuation, sub-words, runs of spaces and non-Latin scripts, three tokenizer kinds, and the options top_k,
max_answer_len, handle_impossible_answer, align_to_words and doc_stride."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from transformers import pipeline
from transformers.pipelines.question_answering import QuestionAnsweringPipeline

from fusionserve.errors import InputError
from fusionserve.serving.model.qa import answer, default_doc_stride, windows
from tests.pipeline_helpers import TEXTS, TOKENIZER_KINDS, artifact_tokenizer, hf_tokenizer, logits_of, qa_model

QUESTIONS = ("Who met Macron in Paris?", "Où est Zoë allée — à São Paulo?", "東京は何ですか?")
LONG = " ".join(TEXTS[:6]) + "  " + " ".join(reversed(TEXTS[:6]))  # ~170 WordPiece tokens: several windows
CONTEXTS = (TEXTS[0], TEXTS[1], LONG, LONG + " " + LONG)
MAX_LENGTHS = (48, 64)


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def setup(request, tmp_path_factory):
    hf = hf_tokenizer(request.param)
    tok = artifact_tokenizer(hf, tmp_path_factory.mktemp(request.param))  # saved with padding/truncation: qa ignores them
    vocab = hf.vocab_size if request.param == "wordpiece" else len(hf)
    return request.param, hf, tok, vocab


def _ours(tok, model, question: str, context: str, max_length: int, doc_stride: int | None = None, **options) -> list[dict]:
    ws = windows(tok, question, context, max_length, doc_stride)
    logits = [logits_of(model, w.ids, w.type_ids) for w in ws]
    return answer(ws, [g[:, 0] for g in logits], [g[:, 1] for g in logits], context, **options)


def _theirs(nlp, question: str, context: str, max_length: int, doc_stride: int | None = None, **options) -> list[dict]:
    out = nlp(question=question, context=context, max_seq_len=max_length, doc_stride=doc_stride, **options)
    return out if isinstance(out, list) else [out]


def _fits(tok, question: str, context: str, max_length: int) -> bool:
    """The question leaves room for more than doc_stride context tokens, or the context needs no cut (else the
    tokenizer panics in the pipeline, and windows() raises InputError)."""
    try:
        windows(tok, question, context, max_length)
    except InputError:
        return False
    return True


def _same(ours: list[dict], theirs: list[dict]) -> None:
    assert [(a["answer"], a["start"], a["end"]) for a in ours] == [(a["answer"], a["start"], a["end"]) for a in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=1e-6)


def test_windows_are_the_tokenizers_overflowing_windows(setup):
    _, hf, tok, _ = setup
    checked = 0
    for question, context, max_length in itertools.product(QUESTIONS, CONTEXTS, MAX_LENGTHS):
        stride = default_doc_stride(max_length)
        kwargs = dict(truncation="only_second", max_length=max_length, stride=stride, return_overflowing_tokens=True)
        if not _fits(tok, question, context, max_length):
            with pytest.raises(BaseException, match="stride"):  # the tokenizer panics where windows raises InputError
                hf(question, context, **kwargs)
            continue
        ours = windows(tok, question, context, max_length)
        enc = hf(question, context, **kwargs, return_offsets_mapping=True, return_token_type_ids=True)
        assert len(ours) == len(enc["input_ids"])
        for i, w in enumerate(ours):
            assert w.ids.tolist() == enc["input_ids"][i]
            assert w.type_ids.tolist() == enc["token_type_ids"][i]
            assert [tuple(o) for o in w.offsets.tolist()] == [tuple(o) for o in enc["offset_mapping"][i]]
            assert w.context_mask.tolist() == [s == 1 for s in enc.sequence_ids(i)]
            assert w.length <= max_length
        checked += len(ours)
    assert checked > 3 * len(QUESTIONS) * len(CONTEXTS)  # the long contexts took several windows


def test_windows_cover_the_whole_context_with_the_overlap(setup):
    _, _, tok, _ = setup
    ws = windows(tok, QUESTIONS[0], LONG + " " + LONG, 48, doc_stride=10)
    assert len(ws) > 4
    parts = [w.offsets[w.context_mask] for w in ws]
    assert parts[0][0, 0] <= 1 and parts[-1][-1, 1] == len((LONG + " " + LONG).rstrip())  # first and last characters
    ids = [w.ids[w.context_mask] for w in ws]
    for before, after in itertools.pairwise(ids):
        assert before[-10:].tolist() == after[:10].tolist()  # the next window repeats doc_stride tokens


OPTIONS = (
    {},
    {"top_k": 3},
    {"top_k": 5, "max_answer_len": 4},
    {"handle_impossible_answer": True},
    {"top_k": 4, "handle_impossible_answer": True, "max_answer_len": 30},
    {"top_k": 3, "align_to_words": False},
    {"top_k": 12},  # 34 candidate spans per window
    {"top_k": 2, "max_answer_len": 1, "handle_impossible_answer": True},
)


class _FirstAnswer:
    """``QuestionAnsweringPipeline.get_answer(answers, target)`` in constant time: the first answer in ``answers`` whose
    text equals ``target`` case-folded, or None. The pipeline's own scans the whole list for every candidate span, which
    is quadratic in the spans of all windows (the Unigram's long context takes 262 windows: most of the time of
    test_answers_equal_the_pipelines_for_every_option). The same answer: postprocess only appends to ``answers`` and
    changes only their scores, so an index of each text's first answer, extended over what was appended since the last
    call, holds what the scan finds (test_the_answer_index_finds_what_the_pipelines_scan_finds checks it)."""

    def __init__(self) -> None:
        self._answers: list[dict] | None = None  # held, so that a new list cannot reuse its id
        self._seen = 0
        self._first: dict[str, dict] = {}

    def __call__(self, answers: list[dict], target: str) -> dict | None:
        if answers is not self._answers:
            self._answers, self._seen, self._first = answers, 0, {}
        for a in answers[self._seen :]:
            self._first.setdefault(a["answer"].lower(), a)
        self._seen = len(answers)
        return self._first.get(target.lower())


def _pipeline(model, hf) -> QuestionAnsweringPipeline:
    nlp = pipeline("question-answering", model=model, tokenizer=hf)
    nlp.get_answer = _FirstAnswer()
    return nlp


def test_the_answer_index_finds_what_the_pipelines_scan_finds():
    """Against transformers' own get_answer, over a list that grows between calls, with texts that differ in case
    only, targets found first, found later, and never, and a new list (a new postprocess call)."""
    rng = np.random.default_rng(0)
    words = ["Paris", "PARIS", "paris", "Zoë", "ZOË", "東京", "", " a", "A "]
    fast = _FirstAnswer()
    checked = 0
    for _ in range(3):
        answers: list[dict] = []
        for _ in range(60):
            target = str(rng.choice([*words, "absent"]))
            found = fast(answers, target)
            assert found is QuestionAnsweringPipeline.get_answer(None, answers, target)
            checked += found is not None
            if found is None:
                answers.append({"answer": str(rng.choice(words)), "score": 0.0})
            else:
                found["score"] += 1.0
    assert checked > 100


def test_answers_equal_the_pipelines_for_every_option(setup):
    """The model runs once per (question, context, window size) on each side: the pipeline's own preprocess and
    forward, then its postprocess with each set of options (its answer lookup indexed: _FirstAnswer); ours on the same
    windows' logits."""
    kind, hf, tok, vocab = setup
    compared = 0
    # the long context in one window size per seed, and one seed for BPE and Unigram: their small vocabularies make
    # three times as many tokens, and windows, as WordPiece's (the suite's time)
    for seed in (0, 1) if kind == "wordpiece" else (1,):
        model = qa_model(vocab, seed)
        nlp = _pipeline(model, hf)
        for question, context, max_length in [
            *itertools.product(QUESTIONS, CONTEXTS[:2], MAX_LENGTHS),
            *itertools.product(QUESTIONS, CONTEXTS[2:3], MAX_LENGTHS[seed : seed + 1]),
        ]:
            if not _fits(tok, question, context, max_length):
                continue
            example = {"question": question, "context": context}
            outputs = [nlp.forward(item) for item in nlp.preprocess(example, max_seq_len=max_length)]
            ws = windows(tok, question, context, max_length)
            logits = [logits_of(model, w.ids, w.type_ids) for w in ws]
            for options in OPTIONS:
                theirs = nlp.postprocess(outputs, **options)
                ours = answer(ws, [g[:, 0] for g in logits], [g[:, 1] for g in logits], context, **options)
                _same(ours, theirs if isinstance(theirs, list) else [theirs])
                compared += len(ours)
    assert compared >= len(OPTIONS) * len(QUESTIONS) * len(MAX_LENGTHS)


@pytest.mark.parametrize("options", [{}, {"top_k": 3, "handle_impossible_answer": True}])
def test_answers_equal_the_pipeline_called_as_users_call_it(setup, options):
    _, hf, tok, vocab = setup
    model = qa_model(vocab, 3)
    nlp = pipeline("question-answering", model=model, tokenizer=hf)
    for question, context in itertools.product(QUESTIONS, (TEXTS[1], LONG)):
        if _fits(tok, question, context, 64):
            _same(_ours(tok, model, question, context, 64, **options), _theirs(nlp, question, context, 64, **options))


def test_answers_equal_the_pipelines_with_a_doc_stride(setup):
    _, hf, tok, vocab = setup
    model = qa_model(vocab, 2)
    nlp = _pipeline(model, hf)
    for stride, context in itertools.product((0, 5, 20), CONTEXTS[2:]):
        _same(
            _ours(tok, model, QUESTIONS[0], context, 48, stride, top_k=3),
            _theirs(nlp, QUESTIONS[0], context, 48, stride, top_k=3),
        )


def test_a_span_read_in_two_windows_adds_its_scores(tmp_path: Path):
    """Windows overlap: an answer found in both counts both scores, as in the pipeline."""
    tok = artifact_tokenizer(hf_tokenizer("bpe"), tmp_path)
    ws = windows(tok, "q?", LONG, 40, doc_stride=15)
    assert len(ws) >= 3
    # window 1's second context token is in window 0 too (its first may be trimmed differently: a window's first
    # token loses no leading space in byte-level BPE, the pipeline's offsets and ours alike)
    target = ws[1].offsets[ws[1].context_mask][1]
    starts, ends = [], []
    for w in ws:
        logits = np.zeros(w.length, dtype=np.float32)
        at = np.flatnonzero(w.context_mask & (w.offsets == target).all(axis=1))
        logits[at] = 20.0  # the span is that one token, wherever the window holds it
        starts.append(logits)
        ends.append(logits)
    best = answer(ws, starts, ends, LONG, align_to_words=False)[0]
    assert (best["start"], best["end"]) == (int(target[0]), int(target[1]))
    assert best["score"] == pytest.approx(2.0, abs=1e-4)  # ~1 from each of the two windows holding it


def test_bad_options_and_inputs_are_input_errors(tmp_path: Path):
    tok = artifact_tokenizer(hf_tokenizer("bpe"), tmp_path)
    with pytest.raises(InputError, match="'context' must be a non-empty string"):
        windows(tok, "q?", "  \n ", 48)
    with pytest.raises(InputError, match="'question' must be a non-empty string"):
        windows(tok, "", "a context", 48)
    with pytest.raises(InputError, match=r"doc_stride = 48 is out of range; allowed: 0\.\.47"):
        windows(tok, "q?", LONG, 48, doc_stride=48)
    question = "Who met Macron?"
    room = 48 - len(tok.encode(question, add_special_tokens=False).ids) - 4  # <s> q </s></s> context </s>
    with pytest.raises(InputError, match=rf"the question is \d+ tokens: a window of 48 tokens leaves {room} for the context"):
        windows(tok, question, LONG, 48, doc_stride=room)
    assert len(windows(tok, question, "short", 48, doc_stride=room)) == 1  # it fits: nothing to cut, no stride needed
    assert len(windows(tok, question, LONG, 48, doc_stride=room - 1)) > 10
    ws = windows(tok, "q?", "a context", 48)
    logits = [np.zeros(ws[0].length, dtype=np.float32)]
    for bad in ({"top_k": 0}, {"max_answer_len": 0}, {"top_k": 1.5}):
        with pytest.raises(InputError, match="is out of range; allowed: an integer >= 1"):
            answer(ws, logits, logits, "a context", **bad)
    with pytest.raises(ValueError, match="1 windows with 2 start and 1 end logit rows"):
        answer(ws, logits * 2, logits, "a context")


def test_the_callers_tokenizer_settings_are_left_alone(tmp_path: Path):
    hf = hf_tokenizer("bpe")
    hf.backend_tokenizer.enable_truncation(max_length=20)
    hf.backend_tokenizer.enable_padding(length=30)
    tok = artifact_tokenizer(hf, tmp_path)
    before = (tok.truncation, tok.padding)
    ws = windows(tok, "q?", LONG, 64)
    assert (tok.truncation, tok.padding) == before
    assert all(w.length <= 64 for w in ws) and len(ws) > 1


def test_answers_with_the_same_text_in_another_case_are_one_answer(tmp_path: Path):
    """ "Paris" and later "PARIS": one answer at the first one's characters, with both scores, as in the pipeline."""
    tok = artifact_tokenizer(hf_tokenizer("bpe"), tmp_path)
    context = "Paris is big. I like PARIS a lot."
    ws = windows(tok, "Where?", context, 64)
    assert len(ws) == 1
    w = ws[0]
    starts = np.zeros(w.length, dtype=np.float32)
    ends = np.zeros(w.length, dtype=np.float32)
    spans = []
    for word in ("Paris", "PARIS"):
        first, last = context.index(word), context.index(word) + len(word)
        inside = np.flatnonzero(
            w.context_mask & (w.offsets[:, 0] >= first) & (w.offsets[:, 1] <= last) & (w.offsets[:, 1] > w.offsets[:, 0])
        )
        starts[inside[0]] = ends[inside[-1]] = 10.0
        spans.append((int(inside[0]), int(inside[-1])))
    longest = max(b - a + 1 for a, b in spans)
    assert spans[1][1] - spans[0][0] + 1 > longest  # max_answer_len=longest admits each word, not the span across both
    both = answer(ws, [starts], [ends], context, top_k=3, max_answer_len=longest)
    paris = [a for a in both if a["answer"].lower() == "paris"]
    assert len(paris) == 1 and (paris[0]["start"], paris[0]["end"]) in {(0, 5), (21, 26)}  # where it was found first
    assert paris[0] is both[0] and paris[0]["score"] == pytest.approx(0.5, abs=1e-3)  # 0.25 + 0.25


def test_a_context_the_tokenizer_keeps_nothing_of_is_an_input_error(tmp_path: Path):
    """Combining accents alone: an uncased WordPiece strips them, no token is left to answer from."""
    tok = artifact_tokenizer(hf_tokenizer("wordpiece"), tmp_path)
    with pytest.raises(InputError, match="'context' holds nothing the tokenizer keeps"):
        windows(tok, "q?", "\u0301\u0301", 48)
    assert windows(tok, "q?", "e\u0301", 48)[0].context_mask.sum() == 1
