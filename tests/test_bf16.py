"""bf16 artifacts (issue 38): `export --precision bf16` and its gate, OpenVINO running them behind the runner's usual
interface (mixed-task batches, predict / score / evaluate), the warning on a CPU without bf16 units (faked cpuinfo),
the refusal where OpenVINO cannot even emulate bf16, and one line where OpenVINO is missing.

This machine's CPU has AVX-512 but no bf16 units: OpenVINO's oneDNN emulates bf16 there (rounding to bf16, fp32
arithmetic), so the gate and these tests see bf16's real rounding; only its speed is not that of bf16 units."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from fusionserve.cli.main import main
from fusionserve.export.bf16 import Bf16Gate, Bf16GateError, check_bf16
from fusionserve.export.build import build_model
from fusionserve.export.spec import load_spec
from fusionserve.serving.model import cpu_flags
from fusionserve.serving.model.artifact import load_artifact
from fusionserve.serving.model.openvino_runtime import compile_graph
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner, make_session
from tests.adapterhub_models import PAIRS, SENTENCES

MAX_SEQ_LEN = 24
AMX = "flags\t\t: fpu sse avx2 avx512f avx512_vnni amx_bf16 amx_int8 amx_tile avx512_bf16\n"
NO_BF16 = "flags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n"


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.fixture(scope="module")
def arts(built_st, artifact, tmp_path_factory):
    """The tiny model in fp32 (conftest's ``artifact``, made once per run: 32 tokens, longer than any text here) and,
    exported through the command line, in bf16."""
    root = tmp_path_factory.mktemp("bf16")
    code = main(
        ["export", str(built_st.spec), "--out", str(root / "bf16"), "--precision", "bf16", "--max-seq-len", str(MAX_SEQ_LEN)]
    )
    assert code == 0
    return artifact, root / "bf16"


def test_export_bf16_writes_the_standard_op_graph_gated_in_real_bf16(arts, capsys):
    _, bf16 = arts
    manifest = load_artifact(bf16).manifest
    assert manifest["precision"] == "bf16"
    record = manifest["bf16"]
    gate, runtime = record["gate"], record["runtime"]
    assert runtime["name"] == "openvino" and runtime["inference_precision"] == "bf16"
    # bf16 rounding really happened (fp32 on OpenVINO is within 1e-5 of ONNX Runtime) and stayed inside the gate
    assert 1e-3 < gate["max_logit_change"] <= gate["thresholds"]["max_logit_change"] == Bf16Gate().max_logit_change
    assert gate["label_agreement"] >= Bf16Gate().min_label_agreement and gate["rows"] > 40
    assert gate["cases"] > len(manifest["tasks"])  # the grid per task, and the batches mixing every task
    assert manifest["parity"]["max_abs_diff"]["logits"] <= 1e-4  # the fp32 graph it is compiled from, against PyTorch
    graph = onnx.load(str(bf16 / "model.onnx"))
    assert {n.domain for n in graph.graph.node} <= {"", "ai.onnx"}, "standard operators only: OpenVINO reads them"
    code, out, _ = _cli(capsys, "inspect", bf16)
    assert code == 0
    assert "bf16 gate   vs the fp32 graph over" in out and "runs with OpenVINO's CPU plugin" in out
    assert "of the fp32 graph OpenVINO compiles in bf16" in out


def test_the_bf16_gate_measures_and_refuses(built_st, arts):
    """The gate on the real OpenVINO bf16 session: nonzero figures, a refusal naming each figure past a threshold, and
    a session that answers other labels caught by label agreement."""
    fp32_graph = arts[1] / "model.onnx"
    model = build_model(load_spec(built_st.spec))
    fp32 = make_session(fp32_graph, device="cpu")
    bf16 = compile_graph(fp32_graph, "bf16", cache=False)
    report = check_bf16(bf16, fp32, model, MAX_SEQ_LEN, Bf16Gate())
    assert report.max_logit_change > 1e-3 and report.max_fusion_activation_change > 0
    with pytest.raises(Bf16GateError) as err:
        check_bf16(bf16, fp32, model, MAX_SEQ_LEN, Bf16Gate(max_logit_change=1e-4))
    assert "max logit change" in str(err.value) and "no artifact written" in str(err.value)

    class Flipped:  # the bf16 session's answers with each row's logits reversed: other labels
        def get_inputs(self):
            return bf16.get_inputs()

        def run(self, names, feeds):
            out = bf16.run(names, feeds)
            return [out[0][:, ::-1].copy(), *out[1:]]

    with pytest.raises(Bf16GateError) as err:
        check_bf16(Flipped(), fp32, model, MAX_SEQ_LEN, Bf16Gate(max_logit_change=1e9))
    assert "label agreement" in str(err.value)


def test_mixed_task_batches_answer_as_one_task_batches_and_as_fp32(arts):
    fp32, bf16 = (OnnxRunner(a, threads=1, device="cpu") for a in arts)
    assert bf16.provider == "OpenVINO CPU" and bf16.per_row_tasks
    texts = [TextInput(t) for t in SENTENCES[:4]] + [TextInput(*p) for p in PAIRS[:2]]
    tasks = ["rte", "nli", "custom", "rte", "nli", "custom"]
    enc = bf16.encoder.encode(texts)
    mixed = bf16.run_rows(tasks, enc, return_fusion_activations=True)
    ref = fp32.run_rows(tasks, fp32.encoder.encode(texts), return_fusion_activations=True)
    for i, task in enumerate(tasks):
        alone = bf16.run(task, enc.rows([i]), return_fusion_activations=True)
        np.testing.assert_allclose(mixed.logits[i], alone.logits[0], atol=0.05)
        np.testing.assert_allclose(mixed.logits[i], ref.logits[i], atol=Bf16Gate().max_logit_change)
        assert mixed.fusion_activations[i] is not None and mixed.fusion_activations[i].shape[-1] == len(bf16.task(task).adapters)
        np.testing.assert_allclose(mixed.fusion_activations[i], ref.fusion_activations[i], atol=0.1)
    labels = [int(np.argmax(x)) for x in mixed.logits]
    assert labels == [int(np.argmax(x)) for x in ref.logits]


def test_predict_score_and_evaluate_run_a_bf16_artifact(arts, tmp_path, capsys):
    _, bf16 = arts
    rows, labelled = tmp_path / "in.jsonl", tmp_path / "labelled.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in SENTENCES[:5]))
    labelled.write_text("".join(json.dumps({"text": t, "label": "yes"}) + "\n" for t in SENTENCES[:5]))
    code, out, err = _cli(capsys, "predict", bf16, "--task", "nli", "--input", rows)
    assert code == 0, err
    predicted = [json.loads(line) for line in out.splitlines()]
    assert len(predicted) == 5 and all(p["label"] in ("yes", "no") for p in predicted)
    code, _, err = _cli(capsys, "score", bf16, "--task", "nli", "--input", rows, "--output", tmp_path / "out.jsonl")
    assert code == 0, err
    scored = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [s["label"] for s in scored] == [p["label"] for p in predicted]
    code, out, err = _cli(capsys, "evaluate", bf16, "--task", "nli", "--input", labelled, "--json")
    assert code == 0, err
    assert json.loads(out)["examples"] == 5


def test_a_bf16_artifact_on_a_cpu_without_bf16_units_warns_once_with_the_cost(arts, tmp_path, monkeypatch, caplog):
    fp32, bf16 = arts
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text(AMX)
    plain.write_text(NO_BF16)
    manifest = load_artifact(bf16).manifest
    warning = cpu_flags.bf16_risk(manifest, "bf16", plain)
    assert warning and "no bf16 units" in warning and f"{cpu_flags.BF16_EMULATED_SLOWDOWN:g}x" in warning
    assert "export fp32" in warning
    assert cpu_flags.bf16_risk(manifest, "bf16", amx) is None
    assert cpu_flags.bf16_risk(load_artifact(fp32).manifest, "f32", plain) is None
    assert "runs it in fp32" in (cpu_flags.bf16_risk(manifest, "f32", plain) or "")
    for flags, warned in ((plain, True), (amx, False)):
        monkeypatch.setattr(cpu_flags, "CPUINFO", flags)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fusionserve"):
            OnnxRunner(bf16, threads=1, device="cpu")
        said = [r.getMessage() for r in caplog.records if r.name == "fusionserve"]
        assert said == ([f"fusionserve: {bf16}: {warning}"] if warned else []), said


def test_without_openvino_each_command_says_what_to_install_in_one_line(arts, built_st, tmp_path, monkeypatch, capsys):
    _, bf16 = arts
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino raises ImportError
    code, out, err = _cli(capsys, "predict", bf16, "--task", "nli", "--text", "a film")
    assert code == 2 and not out
    assert err.strip() == (
        f"fusionserve: error: {bf16} (a bf16 artifact) runs with OpenVINO, which is not installed here: "
        "pip install 'fusionserve[openvino]'"
    )
    code, _, err = _cli(capsys, "export", built_st.spec, "--out", tmp_path / "x", "--precision", "bf16")
    assert code == 2 and err.count("\n") == 1 and "--precision bf16 runs with OpenVINO" in err and "fusionserve[openvino]" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_where_openvino_cannot_emulate_bf16_export_refuses_and_a_server_says_it_runs_fp32(arts, built_st, tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 hides AVX-512 from OpenVINO's oneDNN, as on a CPU without it: it compiles bf16 as f32,
    so the export cannot check bf16 and refuses; predict still runs the artifact, and says so."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "fusionserve.cli.main"]
    out = tmp_path / "bf16"
    done = subprocess.run([*cmd, "export", str(built_st.spec), "--out", str(out), "--precision", "bf16",
                           "--max-seq-len", str(MAX_SEQ_LEN), "--parity-grid", "quick"],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "the bf16 gate cannot be checked here" in last and "no artifact written" in last and not out.exists()
    done = subprocess.run([*cmd, "predict", str(arts[1]), "--task", "nli", "--text", "a film"],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "runs it in fp32 here" in done.stderr and json.loads(done.stdout)["label"] in ("yes", "no")


def test_a_bf16_export_where_openvino_compiles_f32_is_refused_before_anything_is_built(built_st, tmp_path, monkeypatch):
    """export_artifact's own check (the command checks the same before it imports the exporter): where OpenVINO
    compiles bf16 in f32 (here said so by ``bf16_compiled_as``; the real case is the subprocess test above), the export
    refuses before it builds the model, with the gate's words, and writes nothing."""
    from fusionserve.export import artifact
    from fusionserve.serving.model import openvino_runtime

    monkeypatch.setattr(openvino_runtime, "bf16_compiled_as", lambda: "f32")
    monkeypatch.setattr(artifact, "_built", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(Bf16GateError, match=r"compiles model\.onnx in f32 on this CPU.*no artifact written"):
        artifact.export_artifact(built_st.spec, tmp_path / "out", "bf16", max_seq_len=MAX_SEQ_LEN, progress=False)
    assert not (tmp_path / "out").exists()


def test_the_built_in_model_is_served_in_the_fastest_precision_that_passes_on_this_cpu(arts, tmp_path, monkeypatch, capsys):
    """bf16 where the CPU has AMX bf16 tiles and OpenVINO is installed, else today's choice (int8 with VNNI, fp32
    without), said in one line by `serve`."""
    from fusionserve.cli import default

    cpus = {"amx": AMX, "vnni": NO_BF16, "avx2": "flags\t\t: fpu sse avx2 fma\n"}
    for name, text in cpus.items():
        (tmp_path / name).write_text(text)
    chosen = {}
    for name in cpus:
        monkeypatch.setattr(cpu_flags, "CPUINFO", tmp_path / name)
        chosen[name] = default.choose_precision("cpu")
    assert {k: p for k, (p, _) in chosen.items()} == {"amx": "bf16", "vnni": "int8", "avx2": "fp32"}
    assert "amx_bf16" in chosen["amx"][1] and "fusionserve[openvino]" not in chosen["vnni"][1]
    monkeypatch.setattr(default, "openvino_version", lambda: None)  # an install without OpenVINO
    monkeypatch.setattr(cpu_flags, "CPUINFO", tmp_path / "amx")
    precision, why = default.choose_precision("cpu")
    assert precision == "int8" and "bf16 would be faster" in why and "pip install 'fusionserve[openvino]'" in why
    monkeypatch.undo()

    monkeypatch.setattr(cpu_flags, "CPUINFO", tmp_path / "amx")
    asked = []
    monkeypatch.setattr(default, "ensure_artifact", lambda precision: asked.append(precision) or arts[1])
    code, out, err = _cli(capsys, "serve", "--device", "cpu", "--print-config")
    assert code == 0 and asked == ["bf16"] and str(arts[1]) in out
    assert err.splitlines()[0].startswith("fusionserve: the built-in model in bf16: this CPU has amx_bf16")


@pytest.mark.slow
def test_calibrate_on_a_bf16_artifact_then_prune_to_bf16(arts, built_st, stats, tmp_path, capsys):
    """Fusion activations from the bf16 graph (calibrate), and a pruned export in bf16 that passes its own gate."""
    _, bf16 = arts
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in SENTENCES))
    code, _, err = _cli(capsys, "calibrate", bf16, "--task", "rte", "--input", src, "--output", tmp_path / "s.json")
    assert code == 0, err
    assert json.loads((tmp_path / "s.json").read_text())["tasks"]["rte"]
    out = tmp_path / "pruned"
    code, _, err = _cli(capsys, "prune", built_st.spec, "--stats", stats, "--keep-top", "1", "--out", out, "--precision", "bf16",
                        "--max-seq-len", MAX_SEQ_LEN, "--tasks", "rte")  # fmt: skip
    assert code == 0, err
    manifest = load_artifact(out).manifest
    assert manifest["precision"] == "bf16" and "pruning" in manifest and manifest["bf16"]["gate"]["max_logit_change"] > 0
    logits, _ = OnnxRunner(out, threads=1, device="cpu").logits("rte", [TextInput(t) for t in SENTENCES[:3]])
    assert logits.shape == (3, 3) and np.isfinite(logits).all()


def test_serve_places_a_bf16_artifact_on_the_cpu_on_a_machine_with_a_gpu(arts, monkeypatch):
    """Seen on an H100 machine: under the default --device auto, `serve` placed every replica of a bf16 artifact on
    CUDA (the GPU build of onnxruntime, a GPU Ray sees), and each replica refused it. A bf16 artifact runs on the CPU
    whatever GPU is there; --device cuda is refused before Ray starts, in one line."""
    import onnxruntime as ort

    from fusionserve.serving import builder
    from fusionserve.serving.builder import AppArgs, replica_placement
    from fusionserve.serving.model.runtime import DeviceError
    from fusionserve.serving.process.server import ServerConfig, check_before_ray

    fp32, bf16 = arts
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(builder, "_cluster_gpus", lambda: 1.0)
    assert replica_placement(AppArgs(artifact=str(fp32))) == ("cuda", 1.0)  # fp32 goes to the GPU, as before
    assert replica_placement(AppArgs(artifact=str(bf16))) == ("cpu", 0.0)
    assert replica_placement(AppArgs(artifact=str(bf16), gpus_per_replica=1)) == ("cpu", 0.0)
    for call in (
        lambda: replica_placement(AppArgs(artifact=str(bf16), device="cuda")),
        lambda: check_before_ray(ServerConfig(bf16, device="cuda"), session=False),
    ):
        with pytest.raises(DeviceError, match=r"--device cuda: .*a bf16 artifact runs on the CPU"):
            call()
