"""One set of request limits over HTTP and gRPC, against a real server (HAProxy ingress, gRPC on): a gRPC message
over the size limit is refused as it arrives, not read whole; task names and refusals are bounded; a message that
does not decode is INVALID_ARGUMENT and counted; texts that hold nothing to classify are refused; a text far over
the token limit is cut before it is tokenized; HTTP takes JSON only, builds no redirect from Host and answers HEAD."""

import gzip
import json
import urllib.request
from pathlib import Path

import grpc
import pytest

from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc
from fusionserve.serving.api.grpc_ingress import ERROR_TYPE_KEY
from fusionserve.serving.options import CHARS_PER_TOKEN_BUDGET, MAX_ERROR_CHARS, MAX_TASK_NAME_CHARS
from tests.runtime_helpers import MAX_SEQ_LEN  # the shared artifact's
from tests.serving_helpers import call, descendants, mutations

pytestmark = pytest.mark.slow
METADATA = (("application", "fusionserve"),)
METHOD = "/fusionserve.v1.Classifier/Classify"


@pytest.fixture
def server(shared_server):
    """The server shared with other modules (conftest.py), with gRPC stubs on its gRPC port."""
    with grpc.insecure_channel(f"127.0.0.1:{shared_server.grpc_port}", options=[("grpc.max_send_message_length", -1)]) as ch:
        shared_server.stub = pb_grpc.ClassifierStub(ch)
        shared_server.raw = ch.unary_unary(METHOD, request_serializer=None, response_deserializer=pb.ClassifyResponse.FromString)
        yield shared_server


def _refused(send, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        send(request, metadata=METADATA, timeout=120)
    return err.value


def _replica_rss_mb(server_pid: int) -> float:
    for pid in descendants(server_pid):
        try:
            if b"ServeReplica" in Path(f"/proc/{pid}/cmdline").read_bytes():
                status = Path(f"/proc/{pid}/status").read_text()
                return int(status.split("VmRSS:", 1)[1].split()[0]) / 1024
        except OSError:
            continue
    raise AssertionError("no replica process below the server")


def test_a_grpc_message_over_the_limit_is_refused_as_it_arrives(server):
    """Serve's gRPC servers took messages up to 2 GiB: a 300 MB one was read whole into the replica (601 MB -> 2.2
    GB) before the size check refused it. Now gRPC refuses it from its length prefix; the replica does not grow."""
    before = _replica_rss_mb(server.proc.pid)
    err = _refused(server.stub.Classify, pb.ClassifyRequest(task="rte", inputs=[pb.Input(text="x" * 120_000_000)]))
    after = _replica_rss_mb(server.proc.pid)
    print(f"\nreplica RSS {before:.0f} MB -> {after:.0f} MB around a 120 MB message")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.details(), err
    assert after - before < 50
    # between the size limit (1 MB) and gRPC's cap the replica's own check answers, as HTTP does (413)
    err = _refused(server.stub.Classify, pb.ClassifyRequest(task="rte", inputs=[pb.Input(text="x" * 2_000_000)]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and dict(err.trailing_metadata())[ERROR_TYPE_KEY] == "body_too_large"
    assert server.stub.Classify(pb.ClassifyRequest(task="rte", inputs=[pb.Input(text="still here")]), metadata=METADATA)


NAMES = [
    ("a 16,500-character name", {"task": "x" * 16_500}, 422, "invalid_request", f"at most {MAX_TASK_NAME_CHARS} characters"),
    ("300 unknown names", {"tasks": [f"{i:03d}" + "y" * 97 for i in range(300)]}, 422, "invalid_request", "at most 64 items"),
    ("50 unknown names", {"tasks": [f"{i:03d}" + "y" * 97 for i in range(50)]}, 404, "unknown_task", "and 45 more"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "names", "status", "reason", "message"), NAMES, ids=[n[0] for n in NAMES])
def test_task_names_are_bounded_and_so_is_the_refusal(server, what, names, status, reason, message):
    """Over gRPC, details over ~8 KB came back as RESOURCE_EXHAUSTED (over ~16 KB CANCELLED), without the error type,
    echoing every name; over HTTP the 404 echoed them all too."""
    code, answer = call(server.url + "/v1/classify", {**names, "inputs": ["a"]})
    assert (code, answer["error"]["type"]) == (status, reason) and message in answer["error"]["message"], answer
    assert len(answer["error"]["message"]) <= MAX_ERROR_CHARS
    err = _refused(server.stub.Classify, pb.ClassifyRequest(**names, inputs=[pb.Input(text="a")]))
    expected = grpc.StatusCode.NOT_FOUND if status == 404 else grpc.StatusCode.INVALID_ARGUMENT
    assert err.code() == expected and err.details() == answer["error"]["message"]
    assert dict(err.trailing_metadata())[ERROR_TYPE_KEY] == reason


def _metric(url: str, line_start: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(line_start))


def test_a_message_that_does_not_decode_is_invalid_argument_and_counted(server):
    """Invalid UTF-8, garbage and a message cut short were UNKNOWN, with a Python exception name, and not counted."""
    counted = 'fusionserve_rejected_requests_total{reason="malformed_request"}'
    before = _metric(server.url, counted)
    good = pb.ClassifyRequest(task="rte", inputs=[pb.Input(text="hello there")]).SerializeToString()
    cases = {"invalid UTF-8": good.replace(b"hello", b"hel\xff\xfe"), "garbage": b"\xff" * 20, "cut short": good[:-4]}
    for what, raw in cases.items():
        err = _refused(server.raw, raw)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err)
        assert dict(err.trailing_metadata())[ERROR_TYPE_KEY] == "malformed_request", what
        assert "not a valid fusionserve.v1.ClassifyRequest" in err.details(), err.details()
    assert _metric(server.url, counted) == before + len(cases)
    assert server.raw(good, metadata=METADATA, timeout=30).predictions


@pytest.mark.parametrize("text", ["\u200b\u200c\u200d\u2060\ufeff", "\x01\x02\x7f", "\t\u200b \x00"])
def test_a_text_of_only_control_or_zero_width_characters_is_refused(server, text):
    """They scored as the empty text (0.522837), while a whitespace-only text was 422."""
    code, answer = call(server.url + "/v1/classify", {"task": "rte", "inputs": ["fine", {"text": "a", "text_pair": text}]})
    assert code == 422 and answer["error"]["type"] == "invalid_request" and "inputs[1]" in answer["error"]["message"]
    err = _refused(server.stub.Classify, pb.ClassifyRequest(task="rte", inputs=[pb.Input(text=text)]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[0]" in err.details()


def test_a_text_far_over_the_token_limit_is_cut_before_it_is_tokenized(server):
    """A 900 KB text was tokenized whole (1.2 s); it is cut at token limit x CHARS_PER_TOKEN_BUDGET characters, and its
    answer is the cut text's, flagged truncated; strict mode counts only the cut part, and says so."""
    budget = MAX_SEQ_LEN * CHARS_PER_TOKEN_BUDGET
    huge, cut = "word " * 180_000, ("word " * 180_000)[:budget]
    code, answer = call(server.url + "/v1/classify", {"task": "rte", "inputs": [huge, cut]})
    assert code == 200 and [p["truncated"] for p in answer["predictions"]] == [True, True]
    assert answer["predictions"][0] == answer["predictions"][1]
    code, answer = call(server.url + "/v1/classify", {"task": "rte", "inputs": [huge], "strict": True})
    assert code == 413 and answer["error"]["message"].startswith("inputs[0] has 2"), answer  # 207+: counted in the cut
    assert f"+ tokens; the limit is {MAX_SEQ_LEN} (strict mode)" in answer["error"]["message"]
    got = server.stub.Classify(pb.ClassifyRequest(task="rte", inputs=[pb.Input(text=huge)]), metadata=METADATA, timeout=60)
    assert got.predictions[0].truncated


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, body, headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_http_takes_json_bodies_only(server):
    """text/plain and form bodies were read as JSON (a cross-site text/plain POST needs no CORS preflight); a gzip
    body failed as malformed JSON."""
    body = json.dumps({"task": "rte", "inputs": ["a fine film"]}).encode()
    url = server.url + "/v1/classify"
    for headers in (
        {"content-type": "text/plain"},
        {"content-type": "application/x-www-form-urlencoded"},
        {"content-type": "multipart/form-data; boundary=x"},
        {},
    ):
        code, _, answer = _post(url, body, headers)
        assert code == 415 and answer["error"]["type"] == "unsupported_media_type", (headers, answer)
    code, _, answer = _post(url, gzip.compress(body), {"content-type": "application/json", "content-encoding": "gzip"})
    assert code == 415 and "Content-Encoding 'gzip'" in answer["error"]["message"]
    assert _post(url, body, {"content-type": "application/json; charset=utf-8"})[0] == 200


def test_no_redirect_is_built_from_the_host_header(server):
    """POST /v1/classify/ with Host: evil.example was a 307 to http://evil.example/v1/classify."""
    body = json.dumps({"task": "rte", "inputs": ["a"]}).encode()
    code, headers, answer = _post(
        server.url + "/v1/classify/", body, {"content-type": "application/json", "host": "evil.example"}
    )
    assert code == 404 and answer["error"]["type"] == "not_found" and "location" not in {k.lower() for k in headers}


def test_head_answers_on_get_routes(server):
    """HEAD /healthz was a 405."""
    for path in ("/healthz", "/v1/tasks"):
        req = urllib.request.Request(server.url + path, method="HEAD")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200 and resp.read() == b"" and resp.headers["content-type"] == "application/json"


def test_fuzzed_grpc_messages_never_get_an_unknown_or_internal_status(server):
    """The gRPC side of the fuzz corpus (test_serving_hardening has the HTTP side): mutated encodings of a good
    message, and the inputs above, answer OK or a refusal of the caller's (with its type), never UNKNOWN/INTERNAL."""
    good = pb.ClassifyRequest(
        task="rte", inputs=[pb.Input(text="a fine film"), pb.Input(text="a cat", text_pair="a dog")]
    ).SerializeToString()
    corpus = [b"", b"\x00", b"\x0a", b"\x12\xff\xff\xff\xff\x0f", good + b"\xff", good[:1], *mutations(good, 120, 4)]
    seen = set()
    for raw in corpus:
        try:
            server.raw(raw, metadata=METADATA, timeout=60)
            seen.add(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            seen.add(err.code())
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (raw, err)
            assert dict(err.trailing_metadata())[ERROR_TYPE_KEY] and len(err.details()) <= MAX_ERROR_CHARS
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= seen
    assert server.raw(good, metadata=METADATA, timeout=30).predictions
