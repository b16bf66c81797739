"""`fusionserve tasks add|remove|list` on live artifacts (export --live): new targets against AdapterHub's own Fuse,
the other tasks bit for bit unchanged, every refusal leaving the published revision as it was, crash safety, and
every precision and backbone kind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from fusionserve.cli.main import main
from fusionserve.export.artifact import export_artifact
from fusionserve.export.live.tasks import add_task
from fusionserve.export.spec import TaskSpec
from fusionserve.serving.model import revisions
from fusionserve.serving.model.artifact import ArtifactError, load_artifact
from fusionserve.serving.model.runtime import OnnxRunner
from tests import live_helpers
from tests.import_helpers import TORCH, cli_without, imported
from tests.live_helpers import FIRST, LiveModel, answers, live_once, make_live

TOL = 1e-4


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> LiveModel:
    """The live export of FIRST, made once per run (shared with test_head_kinds_export): every test copies it."""
    return live_once(tmp_path_factory, tmp_path_factory.mktemp("live"))


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _state(folder: Path) -> dict[str, bytes]:
    """Every file of the revisions folder and the task files, by name: what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "lock"}


def test_add_replace_remove_match_adapterhub_and_leave_the_others_bit_identical(live, tmp_path, capsys):
    art = live.copy(tmp_path / "art")
    before = {t: answers(art, t) for t in FIRST}
    code, out, err = _cli(
        capsys, "tasks", "add", art, "flat", "--fusion", live.root / "fusions/flat", "--head", live.root / "heads/flat"
    )
    assert code == 0, err
    assert "revision 1 published: add task 'flat'" in out and "3 other task(s) bit-identical" in out
    np.testing.assert_allclose(answers(art, "flat"), live.reference("flat"), atol=TOL, rtol=0)
    for t in FIRST:
        assert np.array_equal(answers(art, t), before[t]), t

    # a retrained target: same name, other weights (here another fusion and head), published as revision 2
    code, out, err = _cli(
        capsys,
        "tasks",
        "add",
        art,
        "flat",
        "--fusion",
        live.root / "fusions/custom",
        "--head",
        live.root / "heads/custom",
        "--replace",
    )
    assert code == 0, err
    np.testing.assert_allclose(answers(art, "flat"), live.reference("custom"), atol=TOL, rtol=0)
    for t in FIRST:
        assert np.array_equal(answers(art, t), before[t]), t

    # a single-adapter task and a head on the frozen backbone
    assert _cli(capsys, "tasks", "add", art, "a2", "--adapter", "alpha", "--head", live.root / "heads/alpha_only")[0] == 0
    assert _cli(capsys, "tasks", "add", art, "h2", "--head", live.root / "heads/head_only")[0] == 0
    np.testing.assert_allclose(answers(art, "a2"), live.reference("alpha_only"), atol=TOL, rtol=0)
    np.testing.assert_allclose(answers(art, "h2"), live.reference("head_only"), atol=TOL, rtol=0)

    code, out, err = _cli(capsys, "tasks", "remove", art, "flat")
    assert code == 0, err
    assert "removed task 'flat'" in out
    runner = OnnxRunner(art, threads=1)
    assert runner.artifact.revision == 5 and list(runner.artifact.tasks) == [*FIRST, "a2", "h2"]
    with pytest.raises(ArtifactError, match="unknown task 'flat'"):
        runner.task("flat")
    for t in FIRST:
        assert np.array_equal(answers(art, t), before[t]), t
    np.testing.assert_allclose(answers(art, "h2"), live.reference("head_only"), atol=TOL, rtol=0)

    code, out, _ = _cli(capsys, "tasks", "list", art)
    assert code == 0 and "revision 5 (remove" in out and "a2" in out and "flat" not in out
    docs = [revisions.read(art, n) for n in range(6)]  # every revision stays, with its tasks and their checksums
    assert [d["change"]["op"] for d in docs] == ["export", "add", "replace", "add", "add", "remove"]
    assert all(t["sha256"] and (art / t["file"]).is_file() for d in docs for t in d["tasks"].values())


@pytest.mark.slow
def test_the_light_commands_run_without_torch(live, tmp_path):
    """`tasks list`, `tasks config`, `inspect` of an artifact and `tasks remove` in a fresh interpreter where torch,
    transformers and adapters cannot be imported: none needs them, and none imports them (`tasks remove` spent 7.4 of
    its 7.5 s importing torch). `serve` runs so in conftest.shared_server."""
    art = live.copy(tmp_path / "art")
    light = ("torch", "onnx", "onnxruntime")
    commands = {"list": ["tasks", "list", art], "config": ["tasks", "config", art], "inspect": ["inspect", art],
                "remove": ["tasks", "remove", art, "head_only"]}  # fmt: skip
    outputs = {}
    for name, argv in commands.items():
        done = cli_without(TORCH, argv, modules=light)
        assert done.returncode == 0, (argv, done.stderr[-2000:])
        assert imported(done) == {"torch": False, "onnx": False, "onnxruntime": name == "remove"}, argv
        outputs[name] = done.stdout
    assert all(t in outputs["list"] for t in FIRST) and "revision 0" in outputs["list"]
    assert json.loads(outputs["config"].splitlines()[0])["user_config"]
    assert outputs["inspect"].startswith("artifact    fusionserve") and all(t in outputs["inspect"] for t in FIRST)
    assert (
        "revision 1 published: removed task 'head_only'" in outputs["remove"]
        and "2 other task(s) bit-identical" in outputs["remove"]
    )
    assert list(load_artifact(art).tasks) == ["custom", "alpha_only"]
    for t in ("custom", "alpha_only"):
        assert np.array_equal(answers(art, t), answers(live.artifact, t)), t


def _refusals(live: LiveModel, tmp: Path) -> dict[str, tuple[list, str]]:
    """case -> (argv after `tasks add ART`, what the error must say)."""
    r = live.root
    trunc = tmp / "truncated_head"
    shutil.copytree(r / "heads/flat", trunc)
    weights = trunc / "model_head.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    bad_json = tmp / "bad_fusion"
    shutil.copytree(r / "fusions/flat", bad_json)
    (bad_json / "adapter_fusion_config.json").write_text('{"config": ')
    deep = tmp / "deep_fusion"  # weights for a layer 7 the 3-layer base lacks
    shutil.copytree(r / "fusions/flat", deep)
    st = deep / "model_adapter_fusion.safetensors"
    save_file({k.replace("layer.2.", "layer.7."): v for k, v in load_file(st).items()}, st)
    wide = tmp / "wide_head"
    shutil.copytree(r / "heads/flat", wide)
    cfg = json.loads((wide / "head_config.json").read_text())
    cfg["hidden_size"] = 48
    (wide / "head_config.json").write_text(json.dumps(cfg))
    return {
        "adapter the artifact lacks": (
            ["nli", "--fusion", r / "fusions/nli", "--head", r / "heads/nli"],
            "adapter_names' names adapter(s) ['beta']",
        ),
        "unknown adapter": (
            ["b", "--adapter", "beta", "--head", r / "heads/beta_only"],
            "--adapter 'beta': the artifact lacks it",
        ),
        "more labels than the logits hold": (["f", "--head", r / "heads/five"], "field 'config.num_labels' = 5"),
        "another head form": (["o", "--head", r / "heads/one_layer"], "the head has 1 linear layer(s)"),
        "other hidden size": (["w", "--head", wide], "wide_head: weight 'heads.1.weight' has shape (32, 32), expected (48, 48)"),
        "other layer count": (
            ["d", "--fusion", deep, "--head", r / "heads/flat"],
            "weights for layer(s) [7], but the base model has 3",
        ),
        "taken name": (["custom", "--fusion", r / "fusions/flat", "--head", r / "heads/flat"], "task 'custom' exists"),
        "replace of nothing": (["nope", "--head", r / "heads/flat", "--replace"], "no task 'nope' to replace"),
        "truncated file": (["t", "--fusion", r / "fusions/flat", "--head", trunc], "model_head.safetensors"),
        "corrupt file": (["c", "--fusion", bad_json, "--head", r / "heads/flat"], "adapter_fusion_config.json"),
    }


def test_every_refusal_exits_2_naming_the_problem_and_leaves_the_revision_served(live, tmp_path, capsys):
    art = live.copy(tmp_path / "art")
    state, before = _state(art), answers(art, "custom")
    for case, (argv, message) in _refusals(live, tmp_path).items():
        code, out, err = _cli(capsys, "tasks", "add", art, *argv)
        assert code == 2, (case, out, err)
        assert message in err and err.count("\n") == 1, (case, err)
        assert _state(art) == state, case
    assert load_artifact(art).revision == 0 and np.array_equal(answers(art, "custom"), before)
    code, _, err = _cli(capsys, "tasks", "remove", art, "nope")
    assert code == 2 and "no task 'nope' to remove" in err and _state(art) == state


# another `fusionserve tasks` command at work: a fresh interpreter that takes the artifact's lock, says so, and holds it
# until its stdin closes (only revisions.py imported: no torch)
_HOLDER = (
    "import sys\nfrom pathlib import Path\nfrom fusionserve.serving.model.revisions import TasksLock\n"
    "with TasksLock(Path(sys.argv[1])):\n    print('held', flush=True)\n    sys.stdin.read()\n"
)


def test_a_second_tasks_command_is_refused_while_one_holds_the_lock(live, tmp_path, capsys):
    """The lock is held by another process (the kernel's flock, as between two commands); the refused command runs
    here, in-process (`main`), as its own interpreter would run it."""
    art = live.copy(tmp_path / "art")
    state = _state(art)
    add = ["tasks", "add", art, "h", "--head", live.root / "heads/head_only"]
    with subprocess.Popen([sys.executable, "-c", _HOLDER, str(art)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as holder:  # fmt: skip
        try:
            assert holder.stdout.readline() == "held\n"
            code, _, err = _cli(capsys, *add)
        finally:
            holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    assert code == 2 and "another `fusionserve tasks` command" in err and "revisions/lock" in err
    assert f"(pid {holder.pid})" in err and err.count("\n") == 1  # it names the holder, in one line
    assert _state(art) == state
    assert _cli(capsys, *add)[0] == 0  # free again


def test_a_crash_between_writing_and_publishing_leaves_the_old_revision_served_and_usable(live, tmp_path, capsys):
    art = live.copy(tmp_path / "art")
    before = answers(art, "custom")
    # what a crash after writing revision 1 but before moving the pointer leaves: its files, a stray temporary
    doc = revisions.read(art, 0)
    revisions.write(art, {**doc, "revision": 1, "parent": 0, "change": {"op": "add", "task": "ghost"}})
    (art / "revisions" / ".CURRENT.tmp99").write_text("1\n")
    runner = OnnxRunner(art, threads=1)
    assert runner.artifact.revision == 0 and not runner.refresh()
    assert np.array_equal(answers(art, "custom"), before)
    # the next command numbers past the unpublished revision, and publishes
    doc = add_task(art, TaskSpec("flat", live.root / "heads/flat", live.root / "fusions/flat"))
    assert doc["revision"] == 2 and doc["parent"] == 0 and revisions.current(art) == 2
    assert runner.refresh() and runner.artifact.revision == 2 and "flat" in runner.artifact.tasks


def test_a_new_target_over_a_pruned_adapter_is_refused_with_the_reason(tmp_path, capsys):
    # custom mixes gamma and alpha; pruned of alpha in layer 0, where no other exported task uses alpha
    dropped = {"custom": [frozenset({"alpha"}), frozenset(), frozenset()]}
    pruned = make_live(tmp_path / "m", dropped=dropped, out=tmp_path / "pruned", tasks=("custom", "head_only"))
    load = load_artifact(pruned.artifact)
    assert "alpha" not in load.manifest["adapters_per_layer"][0]
    code, _, err = _cli(
        capsys,
        "tasks",
        "add",
        pruned.artifact,
        "flat",
        "--fusion",
        pruned.root / "fusions/flat",
        "--head",
        pruned.root / "heads/flat",
    )
    assert code == 2 and "mixes adapter 'alpha' at layer 0" in err and "pruned from that layer" in err
    assert revisions.current(pruned.artifact) == 0
    # a head over the frozen backbone needs no adapter: fine on a pruned artifact
    assert _cli(capsys, "tasks", "add", pruned.artifact, "h2", "--head", pruned.root / "heads/head_only")[0] == 0
    np.testing.assert_allclose(answers(pruned.artifact, "h2"), pruned.reference("head_only"), atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int8", "bf16"])
def test_fp16_int8_and_bf16_artifacts_take_new_tasks_within_their_gate(live, precision, tmp_path, capsys):
    art = tmp_path / precision
    export_artifact(
        live.built.spec, art, precision=precision, max_seq_len=live_helpers.MAX_SEQ_LEN, progress=False, tasks=FIRST,
        live=True, parity_grid="quick",
    )  # fmt: skip
    before = answers(art, "custom")
    code, _, err = _cli(
        capsys, "tasks", "add", art, "flat", "--fusion", live.root / "fusions/flat", "--head", live.root / "heads/flat"
    )
    assert code == 0, err
    got, want = answers(art, "flat"), live.reference("flat")
    if precision == "fp16":
        np.testing.assert_allclose(got, want, atol=5e-2, rtol=0)
    elif precision == "bf16":  # gated in bf16 (OpenVINO) against AdapterHub, and served so
        report = revisions.read(art, revisions.current(art))["checks"]["task"]
        assert report["precision"] == "bf16" and 1e-3 < report["max_abs_diff"]["logits"] <= report["gate"]["max_logit_change"]
        np.testing.assert_allclose(got, want, atol=report["gate"]["max_logit_change"], rtol=0)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    else:
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
    assert np.array_equal(answers(art, "custom"), before)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "roberta", "xlm-roberta", "distilbert"])
@pytest.mark.parametrize("adapter_config", ["seq_bn", "double_seq_bn"])
def test_every_backbone_and_adapter_kind_takes_new_tasks(arch_models, arch, adapter_config, tmp_path, capsys):
    built = arch_models(arch, adapter_config)
    art = tmp_path / "art"
    export_artifact(built.spec, art, max_seq_len=40, progress=False, tasks=["dyn", "head"], live=True, parity_grid="quick")
    root = built.spec.parent
    assert _cli(capsys, "tasks", "add", art, "stat", "--fusion", root / "fusions/stat", "--head", root / "heads/stat")[0] == 0
    assert _cli(capsys, "tasks", "add", art, "single", "--adapter", "gamma", "--head", root / "heads/single")[0] == 0
    texts = live_helpers.SENTENCES
    for task in ("stat", "single"):
        batch = built.tokenizer(texts, padding=True, truncation=True, max_length=40, return_tensors="pt")
        want = built.reference_logits(task, dict(batch)).numpy()
        np.testing.assert_allclose(answers(art, task, texts), want, atol=TOL, rtol=0)


def test_a_revision_travels_to_a_node_without_the_folder_as_a_serve_user_config(live, tmp_path, capsys):
    here, node = live.copy(tmp_path / "here"), live.copy(tmp_path / "node")  # the node got the artifact as exported
    assert (
        _cli(capsys, "tasks", "add", here, "flat", "--fusion", live.root / "fusions/flat", "--head", live.root / "heads/flat")[0]
        == 0
    )
    code, out, _ = _cli(capsys, "tasks", "config", here)
    config = json.loads(out)["user_config"]
    assert code == 0 and config["revision"] == 1 and any(n.startswith("tasks/flat.") for n in config["files"])
    runner = OnnxRunner(node, threads=1)
    bad = {**config, "files": {n: (v if n.endswith(".json") else v[:-8] + "AAAAAAAA") for n, v in config["files"].items()}}
    with pytest.raises(revisions.RevisionError, match="checksum differs"):
        revisions.install(node, bad)
    assert revisions.current(node) == 0 and not runner.refresh()
    assert revisions.install(node, json.loads(json.dumps(config))) == 1  # what a replica's reconfigure does
    assert runner.refresh() and runner.artifact.revision == 1
    assert np.array_equal(answers(node, "flat"), answers(here, "flat"))
