"""The boundary's catch-all, without Ray: an error of ours (not a refusal of the caller's request) becomes a JSON 500
of type ``internal`` whose message carries an id, and the same id is in the server log with the traceback, so an
operator can find what a client reports. Both places are checked: the classify core (``Classifier``, behind HTTP and
gRPC) and the HTTP app's exception handler for every other route."""

import asyncio
import dataclasses
import logging
import re
from collections.abc import Iterator

import orjson
import pytest

from fusionserve.serving.api.classify import Classifier
from fusionserve.serving.api.metrics import Metrics
from fusionserve.serving.api.schemas import HTTPError, Limits
from fusionserve.serving.model.artifact import Artifact
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.scheduler.batching import BatchLimits, Scheduler

LOGGER = "ray.serve.fusionserve"
ERROR_ID = re.compile(r"unexpected server error \(id ([0-9a-f]{12}), also in the server log\)")


@pytest.fixture
def logged(caplog) -> Iterator[pytest.LogCaptureFixture]:
    """The records of the replica's logger. caplog's handler goes on that logger itself, which stops propagating
    meanwhile (each record caught once): importing Ray stops the 'ray' loggers from propagating to the root logger,
    where caplog listens."""
    logger = logging.getLogger(LOGGER)
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate


def _the_id(message: str, logged: pytest.LogCaptureFixture, where: str) -> None:
    """``message`` names an id; exactly one error record names the same id and ``where``, with the exception."""
    match = ERROR_ID.search(message)
    assert match, message
    records = logged.records  # this phase's (a fixture's own list is replaced when the test starts)
    mine = [r for r in records if r.name == LOGGER and match.group(1) in r.getMessage()]
    assert len(mine) == 1, [r.getMessage() for r in records]
    assert mine[0].levelno == logging.ERROR and where in mine[0].getMessage()
    assert mine[0].exc_info is not None and mine[0].exc_info[0] is RuntimeError


def test_an_error_in_the_classify_path_is_a_500_with_an_id_that_is_in_the_log(artifacts, logged):
    runner = OnnxRunner(artifacts.fp32, threads=1, device="cpu")
    stats = Metrics()
    core = Classifier(runner.encoder, Scheduler(runner, BatchLimits()), Limits(), stats)

    async def read():
        raise RuntimeError("a bug while reading the request")

    outcome = asyncio.run(core(read, "POST /v1/classify"))
    assert isinstance(outcome, HTTPError) and (outcome.status, outcome.reason) == (500, "internal"), outcome
    assert "a bug while reading" not in outcome.message  # the details stay in the log
    _the_id(outcome.message, logged, "POST /v1/classify")
    second = asyncio.run(core(read, "POST /v1/classify"))
    assert isinstance(second, HTTPError) and ERROR_ID.search(second.message).group(1) != ERROR_ID.search(outcome.message).group(1)


def test_an_error_in_any_other_route_is_a_json_500_with_an_id_that_is_in_the_log(logged):
    from starlette.requests import Request

    from fusionserve.serving.api import app as http_app  # imports Ray (not started) and FastAPI

    assert http_app.app.exception_handlers[Exception] is http_app._unexpected
    request = Request({"type": "http", "method": "GET", "path": "/v1/tasks", "headers": [], "query_string": b""})
    response = asyncio.run(http_app._unexpected(request, RuntimeError("a bug in a route")))
    body = orjson.loads(response.body)
    assert response.status_code == 500 and response.media_type == "application/json"
    assert set(body) == {"error"} and body["error"]["type"] == "internal", body
    _the_id(body["error"]["message"], logged, "GET /v1/tasks")


def test_a_grpc_answer_takes_its_labels_from_the_revision_that_computed_it(artifacts):
    """A live artifact's task can be removed or replaced (other labels) between the answer and the reply: the gRPC
    reply's labels are those the answer was computed with, not a lookup in whatever revision is served after it."""
    from fusionserve.serving.api import fusionserve_pb2 as pb
    from fusionserve.serving.api.grpc_ingress import classify_grpc

    runner = OnnxRunner(artifacts.fp32, threads=1, device="cpu")
    labels = runner.artifact.tasks["rte"].labels

    class RevisionSwitchedAfterTheAnswer(Classifier):
        after: Artifact | None = None

        @property
        def artifact(self) -> Artifact:
            return self.after or super().artifact

        async def __call__(self, *args, **kwargs):
            outcome = await super().__call__(*args, **kwargs)
            self.after = dataclasses.replace(runner.artifact, tasks={})  # the next revision removed every task
            return outcome

    core = RevisionSwitchedAfterTheAnswer(runner.encoder, Scheduler(runner, BatchLimits()), Limits(), Metrics())
    request = pb.ClassifyRequest(task="rte", inputs=[pb.Input(text="the cat sat")])
    reply = asyncio.run(classify_grpc(core, request, None, {}))
    assert core.after is not None and reply.task == "rte"
    assert tuple(reply.labels) == labels and len(reply.predictions[0].scores) == len(labels)
