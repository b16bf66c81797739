"""`fusionserve export` refusals: artifacts that refuse to load once changed (with a message naming the file), and
exports that fail (parity, an existing output, bad options, bad specs) without leaving anything behind."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from fusionserve.errors import FusionServeError, SpecError
from fusionserve.export.artifact import export_artifact
from fusionserve.export.validate import TOLERANCES, ParityError
from fusionserve.serving.model.artifact import ArtifactError, load_artifact, sha256
from fusionserve.serving.model.runtime import OnnxRunner
from tests.export_helpers import _cli

# one worker for test_export, test_export_errors and test_cli under xdist, so that conftest's ``exported`` is exported once
# per weight format: test_export checks that its manifest names the spec of this worker's ``built``, which an export
# shared across workers (tests/made_once.py) would not
pytestmark = pytest.mark.xdist_group("exported")


def _write_spec(built, path: Path, drop: tuple[str, ...] = (), edit=None) -> Path:
    """A copy of the build's spec with absolute folders, written to ``path``; ``drop`` removes tasks."""
    data = yaml.safe_load(built.spec.read_text())
    root = built.spec.parent
    data["base_model"] = str(root / data["base_model"])
    data["adapters"] = {n: str(root / p) for n, p in data["adapters"].items()}
    tasks = {}
    for name, body in data["tasks"].items():
        if name not in drop:
            tasks[name] = {k: (v if k == "adapter" else str(root / v)) for k, v in body.items()}
    data["tasks"] = tasks
    if edit is not None:
        edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- tampered artifacts --------------------------------------------------------------------------------------


def _edit_manifest(edit):
    def apply(folder: Path) -> None:
        path = folder / "manifest.json"
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))

    return apply


def _change_model(folder: Path) -> None:
    path = folder / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _list_outside(name: str):
    """A manifest whose ``files`` names a file outside the artifact, with that file's true checksum."""
    return _edit_manifest(lambda m: m["files"].update({name: sha256(Path("/etc/hostname"))}))


# case -> (tamper, file the message names, what it says)
TAMPER = {
    "file_outside": (
        _list_outside("../" * 30 + "etc/hostname"),  # deep enough to reach / from any tmp folder
        "manifest.json",
        "lists '../../../../../../../../",
    ),
    "absolute_file": (_list_outside("/etc/hostname"), "manifest.json", "entries name files in the folder itself"),
    "model_changed": (_change_model, "model.onnx", "checksum differs from the manifest"),
    "tokenizer_deleted": (lambda f: (f / "tokenizer.json").unlink(), "", "tokenizer.json is missing"),
    "manifest_not_json": (lambda f: (f / "manifest.json").write_text("{not json"), "manifest.json", "not valid JSON"),
    "wrong_format": (_edit_manifest(lambda m: m.update(format="onnx")), "manifest.json", "'format' must be"),
    "missing_field": (_edit_manifest(lambda m: m.pop("parity")), "manifest.json", "missing field(s) ['parity']"),
    "format_version": (
        _edit_manifest(lambda m: m.update(format_version=99)),
        "manifest.json",
        "format_version 99 is not supported",
    ),
}


@pytest.mark.parametrize("case", list(TAMPER))
def test_tampered_artifact_is_refused(exported, tmp_path, capsys, case):
    tamper, file, says = TAMPER[case]
    folder = tmp_path / "artifact"
    shutil.copytree(exported.folder, folder)
    folder = folder.resolve()
    OnnxRunner(folder, device="cpu")  # the copy itself loads
    tamper(folder)
    named = str(folder / file) if file else str(folder)
    with pytest.raises(ArtifactError) as exc:
        OnnxRunner(folder, device="cpu")
    assert named in str(exc.value) and says in str(exc.value)
    code, out, err = _cli(capsys, "predict", folder, "--task", "rte", "--text", "hi")
    assert code == 2 and out == ""
    assert err.startswith("fusionserve: error: ") and named in err and says in err
    assert "Traceback" not in err


def test_a_corrupt_model_whose_checksum_matches_is_refused_by_predict_and_by_serve_before_ray_starts(
    exported, tmp_path, capsys, monkeypatch
):
    folder = tmp_path / "artifact"
    shutil.copytree(exported.folder, folder)
    (folder / "model.onnx").write_bytes((folder / "model.onnx").read_bytes()[:5000])  # cut short, then re-hashed
    _edit_manifest(lambda m: m["files"].update({"model.onnx": sha256(folder / "model.onnx")}))(folder)
    import fusionserve.serving.process.server as server

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for an artifact that cannot load")

    monkeypatch.setattr(server, "connect", no_ray)
    for argv in (["predict", folder, "--task", "rte", "--text", "hi"], ["serve", folder, "--port", 8590]):
        code, out, err = _cli(capsys, *argv)
        assert code == 2 and out == "", err
        lines = [line for line in err.splitlines() if line.startswith("fusionserve: error: ")]
        assert len(lines) == 1 and f"cannot load {folder.resolve() / 'model.onnx'} with ONNX Runtime" in lines[0], err
        assert "Traceback" not in err


def test_folder_without_manifest_is_refused(exported, tmp_path, capsys):
    folder = tmp_path / "artifact"
    shutil.copytree(exported.folder, folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        OnnxRunner(folder, device="cpu")
    code, out, err = _cli(capsys, "predict", folder, "--task", "rte", "--text", "hi")
    assert code == 2 and out == ""
    assert f"{folder} is a folder without manifest.json" in err


# --- failed exports leave nothing ----------------------------------------------------------------------------


def test_parity_failure_raises_with_every_output_and_writes_nothing(built_st, tmp_path, monkeypatch):
    monkeypatch.setitem(TOLERANCES, "fp32", {"logits": 0.0, "fusion_activations": 0.0})
    out = tmp_path / "artifact"
    with pytest.raises(ParityError) as exc:  # one task: what fails is the graph's parity, whatever its tasks
        export_artifact(built_st.spec, out, max_seq_len=8, progress=False, tasks=["rte"])
    message = str(exc.value)
    for output in ("logits", "fusion_activations"):
        assert f"  {output}: max |diff| " in message and "(tolerance 0) at task " in message
    assert "no artifact written" in message
    assert not out.exists()
    assert list(tmp_path.glob(".artifact.*")) == []
    assert list(tmp_path.iterdir()) == []


def test_existing_out_needs_force(built_st, tmp_path):
    out = tmp_path / "artifact"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(FusionServeError, match="exists and is not empty; pass --force"):
        export_artifact(built_st.spec, out, progress=False)
    assert (out / "mine.txt").read_text() == "keep me"
    manifest = export_artifact(built_st.spec, out, max_seq_len=8, force=True, progress=False, tasks=["rte"])  # one will do
    assert not (out / "mine.txt").exists()
    assert load_artifact(out).manifest == manifest and manifest["max_seq_len"] == 8 and list(manifest["tasks"]) == ["rte"]
    assert list(tmp_path.iterdir()) == [out]  # no temporary folder left beside it


@pytest.mark.parametrize("out", [".", "heads", "heads/rte", "model.yaml"])
def test_out_that_holds_the_spec_or_its_folders_is_refused_even_with_force(root, out):
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(FusionServeError, match="which the spec reads; the export would replace it: choose another folder"):
        export_artifact(root / "model.yaml", root / out, force=True, progress=False)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing deleted


def test_existing_file_as_out_needs_force(built_st, tmp_path):
    out = tmp_path / "artifact"
    out.write_text("a file")
    with pytest.raises(FusionServeError, match="--force"):
        export_artifact(built_st.spec, out, progress=False)
    assert out.read_text() == "a file"


@pytest.mark.parametrize(
    "option, says",
    [
        ({"precision": "int4"}, ["--precision", "'int4'", "fp32, fp16, int8"]),
        ({"opset": 3}, ["--opset", "got 3"]),
        ({"max_seq_len": 4}, ["--max-seq-len", "got 4", "512"]),
        ({"max_seq_len": 100_000}, ["--max-seq-len", "got 100000"]),
    ],
    ids=["precision", "opset", "max_seq_len_small", "max_seq_len_large"],
)
def test_bad_options_are_refused(built_st, tmp_path, option, says):
    with pytest.raises(FusionServeError) as exc:
        export_artifact(built_st.spec, tmp_path / "artifact", progress=False, **option)
    for part in says:
        assert part in str(exc.value)
    assert list(tmp_path.iterdir()) == []


def _missing_adapter_folder(data: dict) -> None:
    data["adapters"]["alpha"] = data["adapters"]["alpha"] + "_gone"


def _fusion_names_unknown_adapter(data: dict) -> None:
    del data["adapters"]["beta"]
    del data["tasks"]["beta_only"]


@pytest.mark.parametrize(
    "edit, says",
    [
        (_missing_adapter_folder, ["adapters.alpha", "alpha_gone", "is not a folder"]),
        (_fusion_names_unknown_adapter, ["fusion of task 'rte'", "['beta']", "spec lacks"]),
    ],
    ids=["missing_folder", "fusion_names_unknown_adapter"],
)
def test_spec_errors_surface_and_write_nothing(built_st, tmp_path, capsys, edit, says):
    spec = _write_spec(built_st, tmp_path / "bad.yaml", edit=edit)
    out = tmp_path / "artifact"
    with pytest.raises(SpecError) as exc:
        export_artifact(spec, out, progress=False)
    for part in says:
        assert part in str(exc.value)
    code, _, err = _cli(capsys, "export", spec, "--out", out)
    assert code == 2 and says[0] in err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.yaml"]
