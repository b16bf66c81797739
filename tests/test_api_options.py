"""The API's request options and access control, without Ray: left truncation checked on token ids, the API key check,
TEI's request shapes, the deadline header, and a Serve config that names the key's variable, never the key."""

import hashlib
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from fusionserve.serving.api.auth import KeyCheck, is_open
from fusionserve.serving.api.schemas import HTTPError, timeout_header
from fusionserve.serving.api.tei import predictions, read_request
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.tokenize import Encoder
from tests.adapterhub_models import SENTENCES

MAX_LEN = 12


@pytest.fixture(scope="module")
def tokenizer(built_st) -> Tokenizer:
    return built_st.tokenizer.backend_tokenizer


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_left_truncation_keeps_the_last_tokens_and_the_special_ones(tokenizer):
    enc = Encoder(tokenizer, MAX_LEN)
    text = " ".join(SENTENCES)
    ids = _plain(tokenizer, text)
    assert len(ids) > MAX_LEN  # the text is over the limit
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    left, right = enc.tokens([TextInput(text)], "left")[0], enc.tokens([TextInput(text)], "right")[0]
    assert left.ids.tolist() == [cls, *ids[-(MAX_LEN - 2) :], sep] and left.truncated
    assert right.ids.tolist() == [cls, *ids[: MAX_LEN - 2], sep] and right.truncated
    assert enc.encode([TextInput(text)], "left").input_ids[0].tolist() == left.ids.tolist()
    short = TextInput(SENTENCES[0])  # under the limit: both directions leave it whole
    assert enc.tokens([short], "left")[0].ids.tolist() == enc.tokens([short], "right")[0].ids.tolist()


def test_left_truncation_of_a_text_past_the_character_cut_keeps_its_real_end(tokenizer):
    """A text far past the limit is cut at max_chars characters before tokenizing: with "left", its last ones."""
    enc = Encoder(tokenizer, MAX_LEN)
    text = " ".join(SENTENCES * 200)  # far over max_chars
    assert len(text) > 2 * enc.max_chars
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tail = _plain(tokenizer, text[-enc.max_chars :])
    assert enc.tokens([TextInput(text)], "left")[0].ids.tolist() == [cls, *tail[-(MAX_LEN - 2) :], sep]
    assert tail[-(MAX_LEN - 2) :] == _plain(tokenizer, " ".join(SENTENCES[-3:]))[-(MAX_LEN - 2) :]  # the text's real end


def test_a_pair_is_cut_from_the_longer_text_at_the_chosen_side(tokenizer):
    enc = Encoder(tokenizer, MAX_LEN)
    a, b = SENTENCES[0], " ".join(SENTENCES[1:])
    ia, ib = _plain(tokenizer, a), _plain(tokenizer, b)
    assert len(ia) + 3 < MAX_LEN < len(ia) + len(ib) + 3  # only the second text, the longer, must lose tokens
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    keep = MAX_LEN - 3 - len(ia)
    left = enc.tokens([TextInput(a, b)], "left")[0]
    assert left.ids.tolist() == [cls, *ia, sep, *ib[-keep:], sep]
    assert left.type_ids.tolist() == [0] * (len(ia) + 2) + [1] * (keep + 1)
    right = enc.tokens([TextInput(a, b)], "right")[0]
    assert right.ids.tolist() == [cls, *ia, sep, *ib[:keep], sep]


def test_an_unknown_truncation_direction_is_named(tokenizer):
    with pytest.raises(ValueError, match="truncation direction 'middle' is not known; allowed: right, left"):
        Encoder(tokenizer, MAX_LEN).tokens([TextInput("x")], "middle")


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Bearer wrong-key-of-same-len", "Bearer k", "Bearer " + "k" * 500, "Basic right-key-1234567",
     "right-key-1234567", "Bearer right-key-1234567x", "Bearer right-key-123456"],
)  # fmt: skip
def test_only_a_bearer_with_a_known_key_passes(header):
    check = KeyCheck(["right-key-1234567", "second-key"])
    assert not check.allows(header)
    assert check.allows("Bearer right-key-1234567") and check.allows(b"bearer second-key") and check.allows("Bearer  second-key ")


def test_a_key_check_keeps_only_digests():
    check = KeyCheck(["s3cret-value"])
    assert "s3cret-value" not in repr(vars(check)) and hashlib.sha256(b"s3cret-value").digest() in check._digests


def test_a_replica_asked_for_a_key_refuses_to_start_without_one(monkeypatch):
    monkeypatch.delenv("FUSIONSERVE_TEST_KEY", raising=False)
    with pytest.raises(Exception, match=r"\$FUSIONSERVE_TEST_KEY, but it is unset or empty"):
        KeyCheck.from_env("FUSIONSERVE_TEST_KEY")
    monkeypatch.setenv("FUSIONSERVE_TEST_KEY", " a , ,b ")
    assert KeyCheck.from_env("FUSIONSERVE_TEST_KEY").allows("Bearer b")


def test_probes_and_docs_are_open_and_metrics_closable():
    assert all(is_open(p, True) for p in ("/healthz", "/readyz", "/docs", "/openapi.json", "/docs-assets/swagger-ui.css"))
    assert is_open("/metrics", True) and not is_open("/metrics", False)
    assert not any(is_open(p, True) for p in ("/v1/classify", "/v1/tasks", "/predict", "/", "/healthz/x", "/nope"))


@pytest.mark.parametrize(
    ("inputs", "want", "batch"),
    [
        ("a text", ["a text"], False),
        (["a", "b"], [{"text": "a", "text_pair": "b"}], False),  # TEI reads two texts as one pair
        ([["a", "b"]], [{"text": "a", "text_pair": "b"}], True),
        (["a", "b", "c"], ["a", "b", "c"], True),
        (["a", ["b", "c"]], ["a", {"text": "b", "text_pair": "c"}], True),
        # TEI's OpenAPI (1.6.0, PredictInput): a batch's items are lists, a single text as a list of one
        ([["a"], ["b", "c"]], ["a", {"text": "b", "text_pair": "c"}], True),
        ([["a"]], ["a"], True),
    ],
)
def test_tei_input_shapes(inputs, want, batch):
    req, is_batch, _ = read_request(f'{{"inputs": {__import__("json").dumps(inputs)}}}'.encode(), "rte")
    got = [i if isinstance(i, str) else {"text": i.text, "text_pair": i.text_pair} for i in req.inputs]
    assert got == want and is_batch == batch and req.task == "rte"


def test_tei_options_map_onto_the_classify_request():
    body = b'{"inputs": "x", "raw_scores": true, "truncate": false, "truncation_direction": "Left"}'
    req, _, shape = read_request(body, "rte")
    assert (req.raw_scores, req.strict, req.truncation_direction) == (True, True, "left")
    assert shape == {"top_k": None, "function": "none"}
    req, _, shape = read_request(b'{"inputs": "x", "parameters": {"top_k": 2, "function_to_apply": "sigmoid"}}', "rte")
    assert req.raw_scores and not req.strict and shape == {"top_k": 2, "function": "sigmoid"}
    answer = {"predictions": [{"scores": {"a": 0.0, "b": 2.0, "c": -1.0}}]}
    assert [p["label"] for p in predictions(answer, shape)[0]] == ["b", "a"]
    assert predictions(answer, shape)[0][1]["score"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"inputs": 3}', "inputs: must be a text, a pair"),
        (b'{"inputs": []}', "inputs: must be a text, a pair"),
        (b'{"inputs": ["a", ["b", "c", "d"]]}', "inputs[1]: must be a text, [text] or a pair"),
        (b'{"inputs": ["a", [1]]}', "inputs[1]: must be a text, [text] or a pair"),
        (b'{"inputs": "x", "nope": 1}', "unknown field(s) ['nope']"),
        (b'{"inputs": "x", "truncation_direction": "up"}', "truncation_direction"),
        (b'{"inputs": "x", "parameters": {"top_k": 0}}', "top_k: must be a whole number >= 1"),
        (b'{"inputs": "x", "parameters": {"function_to_apply": "tanh"}}', "function_to_apply: 'tanh' is not known"),
        (b'{"text": "x"}', 'must be an object with "inputs"'),
        (b"{nope", "the body is not valid JSON"),
    ],
)
def test_bad_tei_bodies_are_named(body, message):
    with pytest.raises(HTTPError) as err:
        read_request(body, "rte")
    assert err.value.status == 422 and message in err.value.message


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "abc", "3600001", "٣"])
def test_a_bad_timeout_header_is_refused(value):
    with pytest.raises(HTTPError, match="X-Request-Timeout-Ms: must be a whole number of milliseconds"):
        timeout_header(value)
    assert timeout_header("250") == 250 and timeout_header(None) is None


def test_the_printed_config_names_the_variable_never_the_key(artifact):
    key = "pc-" + hashlib.sha256(b"print-config").hexdigest()[:20]
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--api-key", key, "--private-metrics",
           "--default-task", "rte", "--print-config"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert key not in out.stdout + out.stderr
    assert "api_key_env: FUSIONSERVE_API_KEY" in out.stdout and "open_metrics: false" in out.stdout
    assert "default_task: rte" in out.stdout and "$FUSIONSERVE_API_KEY" in out.stdout


def test_a_default_task_must_be_served_and_private_metrics_need_a_key(artifact, monkeypatch, capsys):
    """The command's refusals (`serve --print-config` starts nothing: run in this process, as its own would run it)."""
    from fusionserve.cli.main import main

    base = ["serve", str(artifact), "--print-config"]
    assert main([*base, "--default-task", "nope"]) == 2
    assert "default_task 'nope' is not a task of" in capsys.readouterr().err
    monkeypatch.delenv("FUSIONSERVE_API_KEY", raising=False)
    assert main([*base, "--private-metrics"]) == 2
    assert "--private-metrics needs an API key" in capsys.readouterr().err
