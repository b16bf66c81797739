"""The application builder through Ray's own argument path (no Ray started): typed, checked arguments, the
deployment it builds (fixed replicas or Serve's autoscaling), the config ``serve --print-config`` writes (Serve's own
schema, and the builder accepts its arguments), the gRPC stubs matching the .proto, and the proto <-> answer
conversion."""

import io
from contextlib import redirect_stdout
from pathlib import Path

import grpc
import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from fusionserve.cli.main import main
from fusionserve.errors import FusionServeError
from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api.app import FusionServe, _check_identity
from fusionserve.serving.api.grpc_ingress import grpc_code, request_fields, response_message
from fusionserve.serving.api.schemas import Limits
from fusionserve.serving.builder import IMPORT_PATH, SERVICER, app_builder, placement
from fusionserve.serving.model.artifact import MANIFEST, ArtifactError, sha256
from fusionserve.serving.process.server import ServerConfig
from fusionserve.serving.scheduler.batching import BatchLimits
from tests import grpc_stubs


def _build(args: dict):
    return call_user_app_builder_with_args_if_necessary(app_builder, args)._bound_deployment  # what Ray deploys


def test_builder_args_are_typed_and_become_the_deployment(artifact):
    dep = _build({"artifact": str(artifact), "replicas": "3", "max_batch_size": "8", "threads": 1, "device": "cpu"})
    assert (dep.name, dep.num_replicas, dep.max_ongoing_requests, dep.max_queued_requests) == ("fusionserve", 3, 1024, 64)
    assert dep.ray_actor_options["num_cpus"] == 1 and "num_gpus" not in dep.ray_actor_options
    assert dep.ray_actor_options["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"]
    assert dep.ray_actor_options["runtime_env"]["env_vars"]["RAY_worker_niceness"] == "0"  # Ray's default is 15
    path, limits, batch, threads, device, sha = dep.init_args
    assert (path, batch.max_batch_size, threads, device, sha) == (str(Path(artifact).resolve()), 8, 1, "cpu", None)
    assert limits.max_inputs == 64
    relative = _build({"artifact": ".", "artifact_sha256": "ab" * 32})  # resolved by each replica in its working dir
    assert relative.init_args[0] == "." and relative.init_args[5] == "ab" * 32


def test_autoscaling_arguments_become_serves_autoscaling_config(artifact):
    dep = _build({"artifact": str(artifact), "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8,
                  "downscale_delay_s": 5})  # fmt: skip
    config = dep._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests, config.downscale_delay_s) == (1, 4, 8, 5)
    assert (config.upscale_delay_s, config.look_back_period_s) == (30, 30)  # Serve's defaults stay where not given


BAD_ARGS = [
    ({"max_batch_size": 0}, FusionServeError, "max_batch_size = 0 is out of range; allowed: >= 1"),
    # 0 would refuse every request, and Serve's own max_queued_requests refuses it with a traceback at deploy time
    ({"max_queued": 0}, FusionServeError, "max_queued = 0 is out of range; allowed: >= 1"),
    ({"device": "tpu"}, FusionServeError, "device = 'tpu' is not known; allowed: auto, cpu, cuda"),
    ({"min_replicas": 1}, FusionServeError, "autoscaling needs both min_replicas and max_replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, FusionServeError, "min_replicas = 3 is above max_replicas = 2"),
    ({"replicas": 2, "min_replicas": 1, "max_replicas": 2}, FusionServeError, "choose a fixed count or autoscaling"),
    ({"max_batch_tokens": 8}, FusionServeError, "max_batch_tokens = 8 cannot hold one input of"),
    ({"colour": "red"}, ValidationError, "colour"),
    ({"max_inputs": "many"}, ValidationError, "max_inputs"),
]


@pytest.mark.parametrize(("extra", "error", "message"), BAD_ARGS, ids=[str(b[0]) for b in BAD_ARGS])
def test_bad_builder_arguments_are_refused_with_the_argument_named(artifact, extra, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        _build({"artifact": str(artifact), **extra})


def test_server_options_are_named_as_flags(artifact):
    with pytest.raises(FusionServeError, match="--max-batch-size = 0 is out of range"):
        ServerConfig(artifact, max_batch_size=0)
    with pytest.raises(FusionServeError, match="--max-queued = 0 is out of range; allowed: >= 1"):
        ServerConfig(artifact, max_queued=0)
    with pytest.raises(FusionServeError, match="--min-replicas = 3 is above --max-replicas = 2"):
        ServerConfig(artifact, min_replicas=3, max_replicas=2)
    with pytest.raises(FusionServeError, match="--grpc-port = 8000 is the HTTP --port too"):
        ServerConfig(artifact, grpc_port=8000)


def test_serve_help_states_the_defaults_the_server_uses(artifact):
    """`fusionserve serve` leaves an option not given to ServerConfig / AppArgs, where its default is written once;
    the "(default X)" of every option's help must say that same value."""
    import re

    from fusionserve.cli.main import build_parser

    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith(" serve"))
    cfg, checked = ServerConfig(artifact), 0
    for action in serve._actions:
        stated = re.search(r"\(default ([^:;)]+)", action.help or "")
        name = action.dest
        if not stated or not action.option_strings:
            continue
        actual = getattr(cfg, name) if hasattr(cfg, name) else getattr(cfg.app, name)
        if actual is None:  # derived at run time (CPUs / replicas, 1024): said in words
            continue
        assert action.default is None, f"--{name} has a default of its own in the CLI"
        assert stated.group(1) in {str(actual), f"{actual:g}" if isinstance(actual, float) else str(actual)}, name
        checked += 1
    assert checked >= 15


def test_print_config_is_a_serve_config_whose_args_the_builder_takes(artifact):
    out = io.StringIO()
    with redirect_stdout(out):
        argv = ["serve", str(artifact), "--host", "0.0.0.0", "--port", "8100", "--grpc-port", "9100", "--min-replicas", "1",
                "--max-replicas", "3", "--max-batch-size", "16", "--device", "cpu"]  # fmt: skip
        assert main([*argv, "--print-config"]) == 0
    text = out.getvalue()
    assert text.startswith("# Ray Serve config for") and "RAY_SERVE_ENABLE_HA_PROXY=1" in text
    config = ServeDeploySchema.model_validate(yaml.safe_load(text))
    assert (config.http_options.host, config.http_options.port, config.grpc_options.port) == ("0.0.0.0", 8100, 9100)
    assert config.grpc_options.grpc_servicer_functions == [SERVICER]
    (app,) = config.applications
    assert (app.name, app.import_path, app.route_prefix) == ("fusionserve", IMPORT_PATH, "/")
    assert app.args["artifact_sha256"] == sha256(Path(artifact) / MANIFEST)
    dep = _build(app.args)
    assert dep._deployment_config.autoscaling_config.max_replicas == 3 and dep.init_args[2].max_batch_size == 16


def test_a_replica_refuses_an_artifact_other_than_the_one_the_application_names(artifact):
    """The builder passes the manifest's sha256 to every replica; a node whose copy at that path differs (another
    model, a stale copy) must refuse to start rather than answer for the application."""
    expected = sha256(Path(artifact) / MANIFEST)
    other = "0" * 64
    with pytest.raises(ArtifactError, match="give every node the same artifact") as refused:
        # the class as written (serve.ingress wraps it; a replica's start runs this constructor first)
        FusionServe.__wrapped__(str(artifact), Limits(), BatchLimits(), 1, "cpu", artifact_sha256=other)
    assert f"manifest sha256 {expected[:12]}..., expected {other[:12]}..." in str(refused.value)
    assert str(Path(artifact).resolve()) in str(refused.value)
    _check_identity(Path(artifact), expected)  # the right one, or none named (a plain `serve run`): no refusal
    _check_identity(Path(artifact), None)


def test_placement_when_ray_is_not_joined_yet(artifact, monkeypatch):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert placement("cuda", None, 3) == ("cuda", 1.0)  # `serve run module:app_builder`: one GPU each, Ray places them
    assert placement("auto", None, 3) == ("cpu", 0.0)  # unknown GPUs: auto stays on CPU
    dep = _build({"artifact": str(artifact), "device": "cuda", "gpus_per_replica": 0.5, "min_replicas": 1, "max_replicas": 8})
    assert dep.ray_actor_options["num_gpus"] == 0.5 and dep.init_args[4] == "cuda"  # fixed, whatever GPUs Ray sees now


def test_grpc_stubs_are_what_the_proto_generates(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the stubs")
    for name, text in grpc_stubs.generate(tmp_path).items():
        committed = (grpc_stubs.ROOT / "serving" / "api" / name).read_text()
        assert committed == text, (
            f"serving/api/{name} differs from what {grpc_stubs.PROTO.name} generates: python -m tests.grpc_stubs"
        )


def test_proto_messages_map_to_the_json_request_and_answer():
    msg = pb.ClassifyRequest(
        task="t", inputs=[pb.Input(text="a"), pb.Input(text="b", text_pair="c"), pb.Input(text="d", text_pair="")]
    )
    fields = request_fields(msg)
    assert fields["inputs"] == [
        "a",
        {"text": "b", "text_pair": "c"},
        {"text": "d", "text_pair": ""},
    ]  # "" is sent on, and refused
    assert fields["task"] == "t" and "tasks" not in fields
    assert request_fields(pb.ClassifyRequest(tasks=["t", "u"]))["tasks"] == ["t", "u"]
    assert not {"task", "tasks"} & set(request_fields(pb.ClassifyRequest()))  # neither: refused as a JSON body is
    answer = {
        "task": "t",
        "predictions": [{"label": "y", "score": 0.75, "scores": {"n": 0.25, "y": 0.75}, "truncated": True}],
        "fusion_activations": {"adapters": ["p", "q"], "values": [[[0.1, 0.9], [0.2, 0.8], [0.3, 0.7]]]},
    }
    out = response_message(answer)
    assert list(out.labels) == ["n", "y"] and list(out.predictions[0].scores) == [0.25, 0.75] and out.predictions[0].truncated
    assert out.fusion_activations.layers == 3 and list(out.fusion_activations.values) == [0.1, 0.9, 0.2, 0.8, 0.3, 0.7]
    several = response_message({"results": [answer, {**answer, "task": "u"}]})
    assert [r.task for r in several.results] == ["t", "u"] and not several.task and not several.predictions
    assert list(several.results[1].predictions[0].scores) == [0.25, 0.75]
    assert [grpc_code(s) for s in (404, 413, 422, 503, 500)] == [
        grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
    ]  # fmt: skip
