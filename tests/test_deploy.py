"""deploy/: the KubeRay RayService manifests (CPU and GPU image) and the Serve configs they embed, checked without a
cluster: the RayService fields against a schema of KubeRay's ray.io/v1 types (RayServiceSpec, RayClusterSpec,
HeadGroupSpec, WorkerGroupSpec), every pod template field against the Kubernetes API's own models (the official
``kubernetes`` client), the embedded config against Ray Serve's schema and fusionserve's builder arguments, and
against what ``fusionserve serve /artifact ... --print-config`` writes with the command each file names."""

import io
import shlex
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import kubernetes.client.models as k8s
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from fusionserve.cli.main import main
from fusionserve.serving.builder import IMPORT_PATH, SERVICER, AppArgs
from fusionserve.serving.process import serve_config
from fusionserve.serving.process.ingress import node_env
from fusionserve.settings import API_KEY_ENV

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
VARIANTS = {"cpu": "serve-config.yaml", "gpu": "serve-config-gpu.yaml"}
# builder arguments a deploy config sets that `fusionserve serve` has no option for (its header says so)
BY_HAND = {"cpu": {}, "gpu": {"gpus_per_replica": 1}}

# KubeRay's ray.io/v1 types (ray-operator/apis/ray/v1: rayservice_types.go, raycluster_types.go), the fields a
# RayService may hold; pod templates are left to the Kubernetes models below
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_INT = {"type": "integer", "minimum": 0}
_TEMPLATE = {"type": "object"}
_HEAD = {
    "type": "object",
    "required": ["template", "rayStartParams"],
    "additionalProperties": False,
    "properties": {"template": _TEMPLATE, "rayStartParams": _STRINGS, "headService": {"type": "object"},
                   "enableIngress": {"type": "boolean"}, "serviceType": {"type": "string"}},
}  # fmt: skip
_WORKER = {
    "type": "object",
    "required": ["groupName", "template", "rayStartParams"],
    "additionalProperties": False,
    "properties": {"groupName": {"type": "string", "minLength": 1}, "replicas": _INT, "minReplicas": _INT,
                   "maxReplicas": _INT, "idleTimeoutSeconds": _INT, "rayStartParams": _STRINGS, "template": _TEMPLATE,
                   "scaleStrategy": {"type": "object"}, "numOfHosts": _INT, "suspend": {"type": "boolean"}},
}  # fmt: skip
_CLUSTER = {
    "type": "object",
    "required": ["headGroupSpec"],
    "additionalProperties": False,
    "properties": {"rayVersion": {"type": "string"}, "enableInTreeAutoscaling": {"type": "boolean"},
                   "autoscalerOptions": {"type": "object"}, "headServiceAnnotations": _STRINGS, "headGroupSpec": _HEAD,
                   "workerGroupSpecs": {"type": "array", "items": _WORKER}, "suspend": {"type": "boolean"},
                   "managedBy": {"type": "string"}, "gcsFaultToleranceOptions": {"type": "object"}},
}  # fmt: skip
RAYSERVICE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["serveConfigV2", "rayClusterConfig"],
            "additionalProperties": False,
            "properties": {
                "serveConfigV2": {"type": "string"},
                "rayClusterConfig": _CLUSTER,
                "serveService": {"type": "object"},
                "upgradeStrategy": {"type": "object"},
                "excludeHeadPodFromServeSvc": {"type": "boolean"},
            },
        },
    },
}


def _k8s(value: Any, kind: str, where: str) -> list[str]:
    """What in ``value`` is not a ``kind`` of the Kubernetes API (unknown field names, wrong types), recursively."""
    if kind.lower().startswith("list["):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [p for i, v in enumerate(value) for p in _k8s(v, kind[5:-1], f"{where}[{i}]")]
    if kind.lower().startswith(("dict(", "dict[")):
        inner = kind[5:-1].split(", ", 1)[1]
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping"]
        return [p for k, v in value.items() for p in _k8s(v, inner, f"{where}.{k}")]
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if kind in scalars:
        ok = isinstance(value, scalars[kind]) and not (kind == "int" and isinstance(value, bool))
        return [] if ok else [f"{where}: expected {kind}, got {value!r}"]
    if kind == "object":  # IntOrString and friends
        return []
    model = getattr(k8s, kind)
    if not isinstance(value, dict):
        return [f"{where}: expected a {kind} object"]
    fields = {json_name: model.openapi_types[attr] for attr, json_name in model.attribute_map.items()}
    problems = [f"{where}.{k}: not a field of {kind}" for k in value if k not in fields]
    return problems + [p for k, v in value.items() if k in fields for p in _k8s(v, fields[k], f"{where}.{k}")]


def _manifest(variant: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / f"rayservice-{variant}.yaml").read_text())


def _templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"]["template"])]
    return groups + [(g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs", [])]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rayservice_matches_kuberay_and_kubernetes_schemas(variant):
    doc = _manifest(variant)
    jsonschema.validate(doc, RAYSERVICE)
    for name, template in _templates(doc):
        assert _k8s(template, "V1PodTemplateSpec", name) == []
        for container in template["spec"]["containers"]:
            assert container["image"] == f"fusionserve:{variant}" and container["name"]
    with pytest.raises(jsonschema.ValidationError):  # the schema does refuse what KubeRay would not know
        jsonschema.validate({**doc, "spec": {**doc["spec"], "rayClusterConfg": {}}}, RAYSERVICE)
    assert _k8s({"spec": {"containers": [{"name": "x", "imagePullPolicy": 3, "readinesProbe": {}}]}}, "V1PodTemplateSpec", "t")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_embedded_serve_config_is_the_file_and_serve_and_the_builder_accept_it(variant):
    doc = _manifest(variant)
    embedded = yaml.safe_load(doc["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load((DEPLOY / VARIANTS[variant]).read_text())
    config = ServeDeploySchema.model_validate(embedded)
    assert config.http_options.host == "0.0.0.0"  # other pods reach this pod's ingress and replicas
    assert config.grpc_options.grpc_servicer_functions == [SERVICER]
    (app,) = config.applications
    assert app.import_path == IMPORT_PATH
    args = AppArgs.model_validate(app.args)
    assert args.artifact == "/artifact" and args.device == ("cuda" if variant == "gpu" else "cpu")
    assert args.max_replicas and args.min_replicas  # autoscaling, with the cluster's autoscaler adding pods
    ports = {(p["name"], p["containerPort"]) for _, t in _templates(doc) for c in t["spec"]["containers"] for p in c["ports"]}
    assert {("serve", config.http_options.port), ("grpc", config.grpc_options.port)} <= ports


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pods_start_ray_with_the_ingress_settings_and_workers_are_ready_on_readyz(variant):
    doc = _manifest(variant)
    wanted = node_env("haproxy")
    for name, template in _templates(doc):
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        key = next(e for e in container["env"] if e["name"] == API_KEY_ENV)  # from a Secret, never written here
        assert set(key) == {"name", "valueFrom"} and key["valueFrom"]["secretKeyRef"]["name"] == "fusionserve-api-key"
        assert set(wanted) <= set(env), f"{name} misses {set(wanted) - set(env)}"
        # Ray's token authentication on every pod, the token from a Secret (not written in the manifest)
        token = next(e for e in container["env"] if e["name"] == "RAY_AUTH_TOKEN")
        assert env["RAY_AUTH_MODE"] == "token" and set(token) == {"name", "valueFrom"}, token
        assert token["valueFrom"]["secretKeyRef"]["key"] == "token"
        assert {k: v for k, v in env.items() if k in wanted and k != "RAY_SERVE_HAPROXY_NBTHREAD"} == {
            k: v for k, v in wanted.items() if k != "RAY_SERVE_HAPROXY_NBTHREAD"
        }
        if name != "head":  # the head becomes ready before the application exists: KubeRay deploys it through the head
            probe = container["readinessProbe"]["httpGet"]
            assert (probe["path"], probe["port"]) == ("/readyz", 8000)
    if variant == "gpu":
        (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"


def _command(text: str) -> list[str]:
    """The `fusionserve serve ... --print-config` command a deploy config's header names (continued with \\)."""
    lines = [ln.removeprefix("#").strip() for ln in text.splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("fusionserve serve "))
    words: list[str] = []
    for line in lines[start:]:
        words += shlex.split(line.removesuffix("\\"))
        if not line.endswith("\\"):
            return words[1:]  # without the program name
    raise AssertionError("the command never ends")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_serve_config_is_what_print_config_writes_for_the_command_it_names(variant, monkeypatch):
    text = (DEPLOY / VARIANTS[variant]).read_text()
    monkeypatch.setenv(API_KEY_ENV, "any-key")  # the header's command runs with the key in the environment
    argv = _command(text)
    assert argv[:2] == ["serve", "/artifact"] and argv[-1] == "--print-config"
    # /artifact exists only inside the image: the config needs of it only its manifest's sha256, left out of the file
    monkeypatch.setattr(serve_config, "load_artifact", lambda path: SimpleNamespace(folder=Path(path)))
    monkeypatch.setattr(serve_config, "sha256", lambda path: "f" * 64)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    printed, written = yaml.safe_load(out.getvalue()), yaml.safe_load(text)
    (p_app,), (w_app,) = printed.pop("applications"), written.pop("applications")
    assert printed == written  # proxy_location, http_options, grpc_options
    p_args, w_args = p_app.pop("args"), w_app.pop("args")
    assert p_app == w_app  # name, route_prefix, import_path
    assert p_args.pop("artifact_sha256") == "f" * 64 and "artifact_sha256" not in w_args
    # the same arguments, a default written out or not
    assert AppArgs(**p_args, **BY_HAND[variant]).model_dump() == AppArgs(**w_args).model_dump()
    assert set(p_args) | set(BY_HAND[variant]) <= set(w_args)


# --- KServe: the InferenceService (serving.kserve.io/v1beta1) for the Open Inference Protocol ------------------------

# KServe's v1beta1 types (pkg/apis/serving/v1beta1: InferenceService, InferenceServiceSpec, PredictorSpec,
# ComponentExtensionSpec), the fields this manifest may hold; the containers are left to the Kubernetes models
_PREDICTOR = {
    "type": "object",
    "required": ["containers"],
    "additionalProperties": False,
    "properties": {"containers": {"type": "array", "minItems": 1, "maxItems": 1}, "minReplicas": _INT, "maxReplicas": _INT,
                   "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]}, "scaleTarget": _INT,
                   "serviceAccountName": {"type": "string"}, "timeout": _INT, "containerConcurrency": _INT,
                   "nodeSelector": _STRINGS, "tolerations": {"type": "array"}, "labels": _STRINGS, "annotations": _STRINGS},
}  # fmt: skip
INFERENCESERVICE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["predictor"],
            "additionalProperties": False,
            "properties": {"predictor": _PREDICTOR},
        },
    },
}


def test_kserve_inferenceservice_serves_the_open_inference_protocol_of_the_image():
    from fusionserve.cli.main import build_parser
    from fusionserve.serving.api.app import app
    from fusionserve.serving.api.auth import is_open
    from fusionserve.serving.api.openapi import describe

    doc = yaml.safe_load((DEPLOY / "kserve-inferenceservice.yaml").read_text())
    jsonschema.validate(doc, INFERENCESERVICE)
    (container,) = doc["spec"]["predictor"]["containers"]
    assert _k8s(container, "V1Container", "predictor") == [] and container["name"] == "kserve-container"
    assert container["image"] == "fusionserve:cpu"
    entrypoint = next(
        ln for ln in (DEPLOY.parent / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT") and "cpu" in ln
    )
    args = build_parser().parse_args(yaml.safe_load(entrypoint.removeprefix("ENTRYPOINT"))[1:] + container["args"])
    assert [p["containerPort"] for p in container["ports"]] == [args.port]
    paths = set(describe(app)["paths"])
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == args.port and get["path"] in paths and is_open(get["path"], True)  # no key for probes
    key = next(e for e in container["env"] if e["name"] == API_KEY_ENV)  # from a Secret, never written here
    assert key["valueFrom"]["secretKeyRef"] == {"name": "fusionserve-api-key", "key": "api-key", "optional": True}
