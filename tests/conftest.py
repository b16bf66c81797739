import os
import signal

from tests import quiet_site  # first: scikit-learn hidden from transformers (tests/quiet_site)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fusionserve.export.artifact import export_artifact
from fusionserve.export.predict import TorchRunner
from fusionserve.scoring.calibrate import calibrate
from fusionserve.scoring.inputs import read_labelled_jsonl
from fusionserve.serving.model.activations import stats_document
from fusionserve.serving.model.artifact import MANIFEST
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.process.ports import draw_range
from fusionserve.settings import PORT_RANGE_ENV
from fusionserve.training import sources
from tests import checkpoint_helpers, cpu_profile, export_helpers, prune_helpers, runtime_helpers
from tests.adapterhub_models import TASKS, Built, build
from tests.backbone_models import ADAPTER_CONFIGS, ARCHS, BuiltArch, build_arch
from tests.head_kinds import HeadKinds, add_heads
from tests.import_helpers import TORCH, environment_without
from tests.made_once import export_once, made_once, source_digest
from tests.oip_helpers import Receiver, start_receiver
from tests.serving_helpers import (
    KEYED_ARGS,
    MARK_ENV,
    OIP_ARGS,
    OIP_KEY,
    SHARED_ARGS,
    Served,
    SharedServers,
    carrying,
    new_mark,
)
from tests.xdist_groups import SERVERS, group_of, in_groups, longest_first, make_scheduler, write_groups

quiet_site.lift()  # transformers has looked (above): seqeval imports scikit-learn in this process again


def _worker_port_range() -> None:
    """Under pytest-xdist each worker draws the servers' ports from its own slice of the range (FUSIONSERVE_PORT_RANGE,
    read by serving/process/ports.py in this process and in every server it starts): two workers' servers drawing one
    port in the seconds before its user binds it would fail one of them."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2:
        return
    ports, index = draw_range(), int(worker.removeprefix("gw"))
    size = len(ports) // count
    os.environ[PORT_RANGE_ENV] = f"{ports.start + index * size}-{ports.start + (index + 1) * size - 1}"


_worker_port_range()


# The tests run tiny models: a second intra-op thread adds nothing but contention on the shared 2 cores (the parity
# check of one tiny export took 8.7 s with 2 threads on a busy machine, 0.6 s with 1).
torch.set_num_threads(1)

# --- opt-in tests: `image` builds the container image (many minutes on 2 cores), not part of the default run -----


def pytest_configure(config: pytest.Config) -> None:
    cpu_profile.register(config)  # opt-in: FUSIONSERVE_CPU_CGROUP and FUSIONSERVE_CPU_PROFILE (tests/cpu_profile.py)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--image", action="store_true", help="run the tests marked `image`: build and run the container image")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = in_groups(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: whole groups per worker (tests/xdist_groups.py)
        items[:] = longest_first(items)
        write_groups(items)
    if config.getoption("--image"):
        return
    skip = pytest.mark.skip(
        reason="builds the container image (15-20 min on 2 shared cores): opt in with `pytest -m image --image`"
    )
    for item in items:
        if item.get_closest_marker("image"):
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed the suite runs serially
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n N`` (xdist's default distribution, ``load``): whole modules per worker and the shared server's tests as one
    group (tests/xdist_groups.py); another ``--dist`` is xdist's own."""
    return make_scheduler(config, log) if config.getvalue("dist") == "load" else None


@pytest.fixture(scope="session", params=["safetensors", "bin"])
def built(request, tmp_path_factory) -> Built:
    """A tiny model saved by AdapterHub, in each of its two weight formats."""
    return build(tmp_path_factory.mktemp(request.param), safetensors=request.param == "safetensors")


@pytest.fixture(scope="session")
def built_st(tmp_path_factory) -> Built:
    """One safetensors build, for tests that need a model but not both formats."""
    return build(tmp_path_factory.mktemp("st"), safetensors=True, seed=3)


# --- exported artifacts, each built once and only read by the tests ----------------------------------------------


@pytest.fixture(scope="session")
def exported(built, tmp_path_factory) -> export_helpers.Exported:
    """The tiny model exported once per weight format (fp32, opset 17, 64 tokens): test_export*.py and test_cli.py, one
    xdist group ("exported"): its manifest names this worker's build (made_once would share another worker's)."""
    folder = tmp_path_factory.mktemp("export") / "artifact"
    manifest = export_artifact(
        built.spec, folder, max_seq_len=export_helpers.MAX_SEQ_LEN, opset=export_helpers.OPSET, progress=False
    )
    return export_helpers.Exported(folder.resolve(), manifest)


@pytest.fixture(scope="session")
def artifact(built_st, tmp_path_factory) -> Path:
    """The tiny model exported once per run (fp32, runtime_helpers.MAX_SEQ_LEN tokens) and only read: scoring, the
    runtime and the servers of the end-to-end tests (one export where each serving module made its own copy)."""
    return export_once(tmp_path_factory, "artifact", built_st.spec, max_seq_len=runtime_helpers.MAX_SEQ_LEN)


@pytest.fixture(scope="session")
def artifacts(artifact, built_st, tmp_path_factory) -> runtime_helpers.Artifacts:
    """The tiny model at each precision (fp32 is ``artifact``), fp16 exported once per run: test_runtime.py and
    test_gpu.py."""
    fp16 = export_once(tmp_path_factory, "artifact", built_st.spec, precision="fp16", max_seq_len=runtime_helpers.MAX_SEQ_LEN)
    return runtime_helpers.Artifacts(artifact, fp16)


@pytest.fixture
def runner(artifacts) -> OnnxRunner:
    """A one-thread ONNX Runtime session of the fp32 tiny model, fresh for each test (batching_helpers.Gate wraps its
    ``run``): the scheduler tests. test_export and test_score define their own."""
    return OnnxRunner(artifacts.fp32, threads=1, device="cpu")


# --- calibration statistics: test_calibrate_evaluate.py and test_prune.py ----------------------------------------


@pytest.fixture(scope="session")
def spec_runner(built_st) -> TorchRunner:
    return TorchRunner(built_st.spec)


@pytest.fixture(scope="session")
def stats(built_st, spec_runner, tmp_path_factory) -> Path:
    """Statistics of every fusion task of the tiny model, as `fusionserve calibrate` writes them, computed once per
    run (tests/made_once.py) from texts written once per run (the file records the texts' path)."""
    src = made_once(tmp_path_factory, "calibration-texts", lambda f: prune_helpers._texts(f / "in.jsonl")) / "in.jsonl"

    def make(folder: Path) -> None:
        fusion_tasks = [t for t, (kind, *_) in TASKS.items() if kind == "fusion"]
        result, bad = calibrate(spec_runner, fusion_tasks, read_labelled_jsonl(src, False), batch_size=4)
        assert bad == []
        (folder / "stats.json").write_text(json.dumps(stats_document(result, str(built_st.spec), src, 0)))

    return made_once(tmp_path_factory, f"stats-{source_digest(built_st.spec)}", make) / "stats.json"


# --- private copies of a build to tamper with: test_spec_errors.py, test_checkpoint_errors.py, test_config_errors.py


@pytest.fixture
def root(built_st, tmp_path) -> Path:
    """A private copy of a safetensors build, free to tamper with."""
    return checkpoint_helpers._copy(built_st.spec, tmp_path / "model")


@pytest.fixture
def any_root(built, tmp_path) -> Path:
    """A private copy of a build in each weight format (safetensors and .bin), for tests that edit weights."""
    return checkpoint_helpers._copy(built.spec, tmp_path / "model")


# --- the dataset loaders: test_datasets.py and test_sources.py -------------------------------------------------
# (``cache`` replaces pytest's own fixture of that name, which no test here uses.)


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture()
def no_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to run pip or apt fails the test: the synthetic archives must be found in the cache.
    Not autouse: the dataset test modules ask for it with ``pytestmark = pytest.mark.usefixtures("no_downloads")``."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a test tried to run {args[0] if args else kwargs}")

    monkeypatch.setattr(sources.subprocess, "run", refuse)


# --- every backbone x adapter architecture, saved by AdapterHub: test_backbones*.py ---------------------------------


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory) -> Callable[[str, str], BuiltArch]:
    """(backbone, adapter architecture) -> the tiny model saved by AdapterHub, each built once per session."""
    cache: dict[tuple[str, str], BuiltArch] = {}

    def get(arch: str, adapter_config: str) -> BuiltArch:
        if (arch, adapter_config) not in cache:
            folder = tmp_path_factory.mktemp(f"{arch}-{adapter_config}")
            cache[arch, adapter_config] = build_arch(folder, arch, adapter_config)
        return cache[arch, adapter_config]

    return get


@pytest.fixture(scope="session", params=[(a, c) for a in ARCHS for c in ADAPTER_CONFIGS], ids=lambda p: f"{p[0]}-{p[1]}")
def arch_built(request, arch_models) -> BuiltArch:
    """A tiny model of each backbone with three adapters of each architecture, fusions, an adapter and a head task."""
    return arch_models(*request.param)


@pytest.fixture(scope="session")
def arch_exported(arch_built, tmp_path_factory) -> export_helpers.Exported:
    """Each of those exported once per run (fp32; tests/made_once.py), with the manifest it wrote."""
    folder = export_helpers.arch_export(tmp_path_factory, arch_built.spec, arch_built.arch, arch_built.adapter_config)
    return export_helpers.Exported(folder.resolve(), json.loads((folder / MANIFEST).read_text()))


# --- every head kind AdapterHub trains, saved by it: test_head_kinds*.py --------------------------------------------


@pytest.fixture(scope="session")
def arch_heads(arch_built) -> HeadKinds:
    """Each backbone x adapter architecture's tiny model with a head of every kind added (head_kinds.py)."""
    return add_heads(arch_built.reference, arch_built.spec.parent, arch_built.tokenizer, classification="dyn")


@pytest.fixture(scope="session")
def bert_heads(arch_models) -> HeadKinds:
    """The tiny BERT (Pfeiffer adapters) of backbone_models with a head of every kind added, for the export tests. Its
    fusion is the gentler one (weights moved by 0.1): with the 0.3 of adapterhub_models the fusion softmax is nearly
    one-hot, and a tagging head over every token (37 x 8 of them) then shows float rounding near the 1e-4 parity
    tolerance (2.9e-4 seen after ONNX Runtime's fusions, 8e-5 before them, while [CLS] stays at 5e-6)."""
    built = arch_models("bert", "seq_bn")
    return add_heads(built.reference, built.spec.parent, built.tokenizer, classification="dyn")


# --- a real server shared by the end-to-end tests that only need one running ---------------------------------------


@pytest.fixture(scope="session")
def shared_servers(tmp_path_factory) -> Iterator[SharedServers]:
    """Shared servers, started where torch cannot be imported (in any process of theirs: `serve` needs no torch)."""
    folder = tmp_path_factory.mktemp("servers")
    servers = SharedServers(folder, env=dict(os.environ, **environment_without(folder / "no-torch", TORCH)))
    yield servers
    servers.stop_all()


@pytest.fixture
def shared_server(shared_servers, artifact) -> Served:
    """`fusionserve serve` of ``artifact`` on 127.0.0.1 with the default limits, gRPC on (``grpc_port``), one ONNX
    Runtime thread and a 2 s body timeout, torch unimportable, started once for test_loopback, test_request_limits,
    test_serving_faults and test_serving_hardening (again after a test stopped it)."""
    return shared_servers.get("shared", artifact, *SHARED_ARGS, grpc=True)


@pytest.fixture
def keyed_server(shared_servers, artifact) -> Served:
    """`fusionserve serve` of ``artifact`` with two API keys, a default task, gRPC and tight limits
    (serving_helpers.KEYED_ARGS), torch unimportable: test_serving_api and test_serving_e2e, one group
    (``xdist_group("keyed_server")``), so that it starts once for both."""
    return shared_servers.get("keyed", artifact, *KEYED_ARGS, grpc=True, env={"FUSIONSERVE_API_KEY": None})


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver in this process (oip_helpers.py): every span ``oip_server`` exports."""
    receiver = start_receiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture
def oip_server(shared_servers, artifact, otlp_receiver) -> Served:
    """`fusionserve serve` of ``artifact`` with the key from FUSIONSERVE_API_KEY, gRPC, JSON logs, small limits
    (serving_helpers.OIP_ARGS), every request traced to ``otlp_receiver`` within 100 ms, torch unimportable:
    test_open_inference, test_openapi_description and test_tracing_server, one group (``xdist_group("oip_server")``)."""
    otel = {k: None for k in shared_servers.env if k.startswith("OTEL_")}  # the session's: the same at every call
    env = otel | {"FUSIONSERVE_API_KEY": OIP_KEY, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    args = (*OIP_ARGS, "--otlp-endpoint", otlp_receiver.endpoint)
    return shared_servers.get("oip", artifact, *args, grpc=True, env=env)


@pytest.fixture
def local_ray() -> None:
    """A local Ray in this process (2 CPUs, no dashboard) for `score --ray`, the lean head that `score --ray` starts
    itself (serving/private.py ``lean_head``: no autoscaler or log monitor): started by the first test that asks for it
    and ended after the last of those in a row (``pytest_runtest_teardown``), so that test_score_ray and
    test_heads_files, one group (``xdist_group("local_ray")``), start it once."""
    import ray

    from fusionserve.serving.private import lean_head

    if not ray.is_initialized():
        with lean_head():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """A shared server, or ``local_ray``, is stopped after the last of the tests in a row that use it: it does not sit
    idle (a Ray node; Serve and a replica) while other tests run. A later test that asks for it starts it again."""
    servers = getattr(item, "funcargs", {}).get("shared_servers")
    try:
        return (yield)
    finally:
        for fixture in (*SERVERS, "local_ray"):
            used = fixture in getattr(item, "fixturenames", ())
            later = nextitem is not None and (
                fixture in getattr(nextitem, "fixturenames", ()) or group_of(nextitem) == group_of(item)
            )
            if used and not later and fixture == "local_ray":
                import ray

                ray.shutdown()
            elif used and not later and servers is not None:
                servers.stop(SERVERS[fixture])


@pytest.fixture
def marked() -> Iterator[tuple[str, dict[str, str]]]:
    """A mark and an environment carrying it: every process of the servers started with that environment carries
    the mark, and what is left of them at the test's end is killed."""
    mark = new_mark()
    yield mark, dict(os.environ, **{MARK_ENV: mark})
    for pid in carrying(mark):
        os.kill(pid, signal.SIGKILL)
