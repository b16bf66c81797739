"""int8 in every GEMM (issue 28): SmoothQuant and static QDQ against today's int8, on the built-in model's targets.

    python -m benchmarks.int8_smooth [--alphas 0.8] [--workdir DIR] [--no-record] [--only VARIANT ...]

Every variant is quantized from one validated fp32 artifact of the built-in model (11 tasks, 64 tokens; exported
as its first start does) by ``models.int8_copy``, i.e. exactly as ``export --precision int8`` quantizes and gates,
with the gate off (thresholds 0 and 1) so that the figures show; its gate figures are recorded beside:

- ``int8 (FFN output fp32)``: the shipped int8 before issue 28 (dynamic, the FFN output GEMMs left in fp32)
- ``every GEMM``: dynamic, every Attention and constant-weight MatMul int8, no smoothing
- ``every GEMM, smoothed a=0.5 (QKV, FFN in)``: the same after SmoothQuant with alpha 0.5 on QKV and FFN-in
- ``smoothed a=0.5 (QKV, FFN in), FFN output fp32``: that, with the FFN output GEMMs in fp32 (the default between)
- ``static QDQ`` / ``static QDQ, smoothed a=0.5 (FFN in)``: every MatMul static (QDQ, MinMax calibration, per-channel
  weights; no int8 Attention in ONNX Runtime's QDQ, so QKV stays fp32 and unsmoothed), without and with smoothing
- ``int8 before per-row (no calibration file)``: the default between, without ``--calibration``
- ``every GEMM, per-row``: one activation scale and zero point per row (token) in the backbone's attention output
  and FFN GEMMs (export/int8/rowwise.py), QKV per tensor; ``..., smoothed a=X (QKV)``: with QKV smoothed (one per --alphas)
- ``shipped int8 (no calibration file)``: ``DEFAULT_OPTIONS`` as `export --precision int8` runs them without
  ``--calibration``: smoothing scales from the validation grid's random token ids; ``int8 before issue 38 (no
  calibration file)``: the same with the adapters' down-projection per tensor (``adapter_rows=False``). These two are
  also measured on amazon_food's own 1,000-text test split (the dataset's; the recipe's test split has 4,075 texts)

Every figure comes from logits computed as `fusionserve predict` computes them (``benchmarks.int8._logits``: windows of
1,024 texts, batches of similar length), so that they are what a user meets (issue 38). ``--only VARIANT ...`` measures
those variants alone and prints their table without recording it.

The variants before ``every GEMM, per-row`` have one activation scale per tensor (``activations="tensor"``). A variant whose figures are in
--workdir/results is not measured again (delete the file to redo it).

Calibration (smoothing scales, static ranges): the two target fusions' dev splits (the recipe's, the "spec's dev
data" of the built-in model), written to --workdir/calibration.jsonl. Alpha is chosen on those dev splits (the
largest mean of the two targets' label agreement); the test figures are both targets' whole test splits (as
REPORT.md evaluates them), against the fp32 graph: label agreement, accuracy, largest probability change.
Writes benchmarks/results/int8_smooth.json and its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from benchmarks.int8 import SEQ, THREADS, _logits, _split, compare, folder_name
from benchmarks.report import machine, record
from fusionserve.training.recipe import TARGETS

HERE = Path(__file__).parent
# measured on the dev splits only: static QDQ ran no faster than fp32 here (profile in RESULTS.md), and the shared
# 2-core machine did not leave the time for their 6,209 test rows
DEV_ONLY = ("static QDQ", "static QDQ, smoothed a=0.5 (FFN in)")
# amazon_food's own 1,000-text test split (issue 38), measured for the shipped int8 and the one before it
OWN = ("amazon_food", "own test")
WITH_OWN = ("int8 before issue 38 (no calibration file)", "shipped int8 (no calibration file)")


def variants(alphas: list[float], calibration: str) -> dict[str, Any]:
    from fusionserve.export.int8.quantize import DEFAULT_OPTIONS, Int8Gate, Int8Options

    off = Int8Gate(0.0, 1.0)
    # before per-row activations (issue 28's first part): one activation scale per tensor everywhere
    every = Int8Options(fp32_roles=(), gate=off, smooth_alpha=None, calibration=calibration, activations="tensor")
    both = ("attention_qkv", "ffn_in")
    out: dict[str, Any] = {
        "int8 (FFN output fp32)": replace(every, fp32_roles=("ffn_out",), calibration=None),
        "every GEMM": every,
        "every GEMM, smoothed a=0.5 (QKV, FFN in)": replace(every, smooth_alpha=0.5, smooth_roles=both),
        "smoothed a=0.5 (QKV, FFN in), FFN output fp32": replace(
            every, smooth_alpha=0.5, smooth_roles=both, fp32_roles=("ffn_out",)
        ),
        "static QDQ": replace(every, method="static"),
        "static QDQ, smoothed a=0.5 (FFN in)": replace(every, method="static", smooth_alpha=0.5),
        # the default before per-row activations, as `export --precision int8` ran it without --calibration
        "int8 before per-row (no calibration file)": replace(
            every, fp32_roles=("ffn_out",), smooth_alpha=0.5, smooth_roles=both, calibration=None
        ),
        # per-row activation scales in the backbone's attention output and FFN GEMMs (export/int8/rowwise.py)
        "every GEMM, per-row": replace(every, activations="row"),
    }
    out |= {
        f"every GEMM, per-row, smoothed a={a:g} (QKV)": replace(
            every, activations="row", smooth_alpha=a, smooth_roles=("attention_qkv",)
        )
        for a in alphas
    }
    # the default before issue 38: the adapters' down-projection with one activation scale per tensor (per batch)
    out["int8 before issue 38 (no calibration file)"] = replace(DEFAULT_OPTIONS, gate=off, adapter_rows=False)
    # what `export --precision int8` does without --calibration: smoothing scales from the validation grid
    out["shipped int8 (no calibration file)"] = replace(DEFAULT_OPTIONS, gate=off)
    return out


def _own_test(work: Path) -> list[dict[str, Any]]:
    """amazon_food's own 1,000-text test split (the dataset's, not the recipe's 4,075-text one), where issue 38 found
    the shipped int8 below 99% through `fusionserve predict`."""
    from fusionserve.training.datasets import load, write_jsonl

    path = work / "amazon_food.own-test.jsonl"
    if not path.is_file():
        write_jsonl(load(OWN[0]), "test", path)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _cached(path: Path, make: Any) -> np.ndarray:
    """``make()``'s logits, kept in ``path`` (a re-run after an interruption reuses them; delete --workdir to redo)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, make())
    return np.load(path)


def run(work: Path, alphas: list[float], only: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.models import int8_copy
    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE
    from fusionserve.export.artifact import export_artifact
    from fusionserve.serving.model.artifact import load_artifact
    from fusionserve.serving.model.runtime import OnnxRunner

    spec, fp32 = DEFAULT_MODEL / SPEC_FILE, work / "fp32"
    work.mkdir(parents=True, exist_ok=True)
    if not (fp32 / "manifest.json").is_file():
        export_artifact(spec, fp32, "fp32", SEQ, force=True, parity_grid="quick")
    cal = work / "calibration.jsonl"
    rows = [r for t in TARGETS for r in _split(t, "dev", work, None)]
    cal.write_text("".join(json.dumps({k: r[k] for k in ("text", "text_pair") if r.get(k) is not None}) + "\n" for r in rows))
    ref = OnnxRunner(fp32, THREADS, device="cpu")
    data = {(t, s): _split(t, s, work, None) for t in TARGETS for s in ("dev", "test")}
    data[OWN] = _own_test(work)
    labels = {k: np.array([ref.task(k[0]).labels.index(r["label"]) for r in v]) for k, v in data.items()}
    want = {k: _cached(work / "logits" / f"fp32.{k[0]}.{k[1]}.npy", lambda k=k: _logits(ref, k[0], data[k])) for k in data}
    result: dict[str, Any] = {"calibration_rows": len(rows), "variants": {}}
    for name, options in variants(alphas, str(cal)).items():
        done = work / "results" / f"{folder_name(name).replace('=', '')}.json"
        if done.is_file() and not (only and name in only):  # measured before, or by another process (--only)
            result["variants"][name] = json.loads(done.read_text())
            continue
        if only and name not in only:
            continue
        print(f"== {name}", file=sys.stderr)
        folder = int8_copy(fp32, work / folder_name(name).replace("=", ""), spec, options)
        record_ = load_artifact(folder).manifest["int8"]
        runner = OnnxRunner(folder, THREADS, device="cpu")
        splits = [k for k in data if k[1] == "dev" or (name not in DEV_ONLY and (k != OWN or name in WITH_OWN))]
        figures = {
            f"{t} {s}": compare(
                want[t, s],
                _cached(work / "logits" / f"{folder.name}.{t}.{s}.npy", lambda r=runner, t=t, s=s: _logits(r, t, data[t, s])),
                labels[t, s],
            )
            for t, s in splits
        }
        result["variants"][name] = {
            "figures": figures,
            "gate": {k: record_["gate"][k] for k in ("label_agreement", "rows", "max_probability_change")},
            "quantized": record_["quantization"]["quantized"],
            "smoothing": record_.get("smoothing"),
        }
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps(result["variants"][name]))
        print(name, json.dumps(figures), file=sys.stderr, flush=True)
    return result


COLUMNS = [*((t, s) for t in TARGETS for s in ("dev", "test")), OWN]


def markdown(result: dict[str, Any], command: str) -> str:
    m = machine()
    lines = [
        f"`{command}` on {m['cpu']} ({m['cores']} cores; ISA flags: {m['isa']}), onnxruntime {m['onnxruntime']}, "
        f"{m['date']}. The built-in model (11 tasks) at {SEQ} tokens; every int8 variant quantized from the same "
        "validated fp32 graph and compared with it; calibration: the targets' dev splits "
        f"({result['calibration_rows']} texts). No speed here (benchmarks/latency.py --int8), so the machine's load does "
        "not matter.",
        "",
        "| variant | int8 MatMul / Attention | "
        + " | ".join(f"{t} {s}: agreement % / accuracy vs fp32 (pt)" for t, s in COLUMNS)
        + " | gate grid agreement |",
        "|---|---|" + "---:|" * len(COLUMNS) + "---:|",
    ]
    for name, v in result["variants"].items():
        cells = []
        for t, s in COLUMNS:
            f = v["figures"].get(f"{t} {s}")
            cells.append(f"{f['agreement']:.2f} / {f['accuracy'] - f['accuracy_ref']:+.2f}" if f else "-")
        q = v["quantized"]
        lines.append(
            f"| {name} | {q['MatMul']} / {q['Attention']} | "
            + " | ".join(cells)
            + f" | {100 * v['gate']['label_agreement']:.1f}% |"
        )
    first = max((v["figures"] for v in result["variants"].values()), key=len)
    lines += [
        "",
        "fp32 accuracy: " + ", ".join(f"{k} {f['accuracy_ref']:.2f}% ({f['examples']} examples)" for k, f in first.items()) + ".",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Label agreement with fp32 on each target's test split, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    y = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8.0, 0.45 * len(names) + 1.2))
    for i, t in enumerate(TARGETS):
        got = [result["variants"][n]["figures"].get(f"{t} test", {}).get("agreement", 0.0) for n in names]
        ax.barh(y + 0.4 * i - 0.2, got, 0.4, label=t)
    ax.axvline(99, color="k", lw=0.8, ls="--")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(94, 100)
    ax.set_xlabel("label agreement with fp32 on the whole test split (%); dashed: the 99% target")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--alphas", nargs="+", type=float, default=[0.8], help="SmoothQuant alphas of QKV with per-row activations (default 0.8)"
    )
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "int8_smooth")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    p.add_argument("--only", nargs="+", metavar="VARIANT", help="measure only these variants (kept for the full run)")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.int8_smooth " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    result = run(args.workdir, args.alphas, args.only)
    text = markdown(result, command)
    if args.only:  # a part of the comparison: the run without --only gathers every part and records
        print(markdown({**result, "variants": {k: v for k, v in result["variants"].items() if k in args.only}}, command))
        return 0
    data = {"command": command, "machine": machine(), "result": result}
    record(
        args.out,
        "int8_smooth",
        "int8 in every GEMM: smoothing and static QDQ (issue 28)",
        data,
        lambda path: plot(result, path),
        text,
        not args.no_record,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
