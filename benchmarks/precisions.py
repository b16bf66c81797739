"""Every precision on every runtime, on this CPU, in one process (issue 38): which is fastest, and at what cost in answers.

    python -m benchmarks.precisions [--geometries minilm bert-base] [--cases 16x128 1x128 1x32] [--rounds-scale 1.0]
                                    [--no-eager] [--workdir DIR] [--no-record]

One model per geometry (N = 8 adapters and one fusion over them, as benchmarks/latency.py builds it), exported once in
fp32 (ONNX Runtime's fused graph), once in bf16 (the standard-op graph OpenVINO compiles; gate on) and quantized to int8
from the fp32 artifact as ``export --precision int8`` does (``models.int8_copy``). Variants, timed round-robin
(``scoring.timing.time_round_robin``; median after warm-up):

- ``ORT fp32``, ``ORT int8``: the fp32 and int8 artifacts with ONNX Runtime, as ``serve`` runs them
- ``OpenVINO fp32``: the bf16 artifact's graph compiled with inference precision f32
- ``OpenVINO bf16``: the bf16 artifact as ``serve`` runs it (``openvino_runtime.compile_graph``): bf16 units where the
  CPU has them, else oneDNN's AVX-512 emulation (rounding to bf16, fp32 arithmetic)
- ``OpenVINO int8 (static QDQ)``: the standard-op graph quantized by ONNX Runtime's static QDQ quantizer (per-channel
  int8 weights, uint8 activations calibrated on the validation grid) and compiled by OpenVINO, which runs QDQ graphs
  with its int8 kernels (VNNI / AMX); timed only, its answers are measured in ``benchmarks.int8_smooth``-style runs
  on the built-in model (docs/guides/int8.md)
- ``AdapterHub eager fp32`` and ``AdapterHub eager bf16 autocast`` (``torch.autocast("cpu", torch.bfloat16)``: the one
  line a user adds), unless ``--no-eager``

``--variants NAME ...`` times only those (``ORT fp32``, the ratios' reference, always among them): emulated bf16 on a CPU
without bf16 units takes most of a run, so one precision can be measured again alone (its table then has only those
rows; record it with ``--no-record`` and by hand where the full run's section should stay).

The CPU's model name, its ISA flags (bf16 and int8 units among them), OpenVINO's OPTIMIZATION_CAPABILITIES and the load
average before and after each case go beside the figures: results/precisions.json and RESULTS.md, "Precisions per
runtime".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from benchmarks.latency import _eager_adapterhub, _feeds, summary_ms
from benchmarks.models import BenchModel, bert_base_folder, build, int8_copy, minilm_folder
from benchmarks.report import machine, plot_median_bars, record
from fusionserve.scoring.timing import time_round_robin

HERE = Path(__file__).parent
THREADS = 2
CASES = ("16x128", "1x128", "1x32")  # batch x sequence: the speed case and its two batch-1 cases
VARIANTS = (
    "ORT fp32",
    "ORT int8",
    "OpenVINO fp32",
    "OpenVINO bf16",
    "OpenVINO int8 (static QDQ)",
    "AdapterHub eager fp32",
    "AdapterHub eager bf16 autocast",
)


def artifacts(model: BenchModel, work: Path, bf16: bool = True) -> dict[str, Path]:
    """fp32, int8 (from the fp32 artifact) and (unless not ``bf16``) bf16 artifacts of ``model`` under ``work``, made
    once."""
    from fusionserve.export.artifact import export_artifact

    out = {p: work / f"{p}-art" for p in ("fp32", "bf16")[: 2 if bf16 else 1]}
    for precision, folder in out.items():
        if not (folder / "manifest.json").is_file():
            export_artifact(model.spec, folder, precision, max_seq_len=128, force=True, parity_grid="quick", progress=False)
    out["int8"] = int8_copy(out["fp32"], work / "int8-art", model.spec)
    return out


def qdq_graph(bf16: Path, out: Path, vocab: int) -> Path:
    """The bf16 artifact's standard-op graph, static QDQ int8 (ONNX Runtime's quantizer, per-channel weights, MatMuls
    only), calibrated on random token ids: the int8 graph OpenVINO runs with its own int8 kernels."""
    if out.is_file():
        return out
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    wanted = {i.name for i in onnx.load(str(bf16 / "model.onnx"), load_external_data=False).graph.input}

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            feeds = [_feeds(4, s, vocab, seed) for seed, s in enumerate((16, 64, 128))]
            self.feeds = iter([{k: v for k, v in f.items() if k in wanted} for f in feeds])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    quantize_static(
        str(bf16 / "model.onnx"), str(out), Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
        per_channel=True, weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
    )  # fmt: skip
    return out


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    from fusionserve.serving.model.runtime import make_session

    session = make_session(path, threads=THREADS, device="cpu")
    feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
    return lambda: session.run(["logits"], feeds)


def _openvino(path: Path, precision: str, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    from fusionserve.serving.model.openvino_runtime import compile_graph

    session = compile_graph(path, precision, THREADS, cache=False)
    feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
    return lambda: session.run(["logits"], feeds)


def _autocast(ref: torch.nn.Module, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    plain = _eager_adapterhub(ref, feeds)

    def run() -> object:
        with torch.autocast("cpu", torch.bfloat16):
            return plain()

    return run


def run_geometry(
    name: str, base: Path, work: Path, cases: list[str], rounds_scale: float, eager: bool, only: list[str] | None = None
) -> dict:
    import json

    print(f"== {name}: building and exporting in {work}", file=sys.stderr)
    model = build(work / "n8", base, 8)
    wanted = set(only or VARIANTS) | {"ORT fp32"}
    arts = artifacts(model, work, bf16=any(v.startswith("OpenVINO") for v in wanted))
    vocab = int(json.loads((base / "config.json").read_text())["vocab_size"])
    qdq = qdq_graph(arts["bf16"], work / "qdq.onnx", vocab) if "OpenVINO int8 (static QDQ)" in wanted else None
    result: dict = {"geometry": name, "cases": {}, "load_average": {}}
    for case in cases:
        batch, seq = (int(x) for x in case.split("x"))
        feeds = _feeds(batch, seq, vocab)
        make: dict[str, tuple[Callable[..., Callable[[], object]], tuple]] = {  # name -> (maker, its arguments)
            "ORT fp32": (_ort, (arts["fp32"] / "model.onnx",)),
            "ORT int8": (_ort, (arts["int8"] / "model.onnx",)),
            "OpenVINO fp32": (_openvino, (arts.get("bf16", work) / "model.onnx", "f32")),
            "OpenVINO bf16": (_openvino, (arts.get("bf16", work) / "model.onnx", "bf16")),
            "OpenVINO int8 (static QDQ)": (_openvino, (qdq, "f32")),
        }
        if eager:
            make["AdapterHub eager fp32"] = (_eager_adapterhub, (model.reference,))
            make["AdapterHub eager bf16 autocast"] = (_autocast, (model.reference,))
        variants = {k: f(*a, feeds) for k, (f, a) in make.items() if k in wanted}  # made in VARIANTS' order
        work_units = batch * seq * (4 if name == "bert-base" else 1)
        rounds = max(5, int(rounds_scale * (40 if work_units <= 512 else 12 if work_units <= 4096 else 6)))
        print(f"-- {name} {case}: {len(variants)} variants x {rounds} rounds", file=sys.stderr)
        before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        result["cases"][case] = summary_ms(time_round_robin(variants, rounds, progress=True))
        result["load_average"][case] = f"{before} before, {' '.join(f'{x:.2f}' for x in os.getloadavg())} after"
    return result


def markdown(results: list[dict], command: str, m: dict[str, str], capabilities: list[str]) -> str:
    lines = [
        f"`{command}` on {m['cpu']} ({m['cores']} cores, {THREADS} threads per run; ISA flags: {m['isa']}; OpenVINO "
        f"OPTIMIZATION_CAPABILITIES: {', '.join(capabilities)}), onnxruntime {m['onnxruntime']}, openvino "
        f"{m.get('openvino', '?')}, torch {m['torch']}, {m['date']}. N = 8 adapters and one fusion; median ms of "
        "round-robin rounds after 2 warm-up calls; ratios are ORT fp32's time over the variant's (above 1: faster).",
        "",
    ]
    for res in results:
        cases = list(res["cases"])
        lines += [f"### {res['geometry']}", "", "| variant | " + " | ".join(f"{c} ms (x ORT fp32)" for c in cases) + " |"]
        lines.append("|---|" + "---:|" * len(cases))
        for variant in res["cases"][cases[0]]:
            cells = []
            for c in cases:
                row = res["cases"][c]
                ms = row[variant]["median_ms"]
                cells.append(f"{ms:.1f} ({row['ORT fp32']['median_ms'] / ms:.2f}x)")
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        loads = "; ".join(f"{c}: {v}" for c, v in res["load_average"].items())
        lines += ["", f"Load average (1, 5, 15 min) around each case: {loads}.", ""]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Median ms of every variant, one panel per geometry and case."""
    plot_median_bars(results, "cases", "{geometry}, {panel}: median ms", path)


def main(argv: list[str] | None = None) -> int:
    from fusionserve.serving.model.openvino_runtime import device_capabilities, openvino_version

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometries", nargs="+", default=["minilm"], choices=["minilm", "bert-base"])
    p.add_argument("--cases", nargs="+", default=list(CASES), help="BATCHxSEQ (default: %(default)s)")
    p.add_argument("--rounds-scale", type=float, default=1.0)
    p.add_argument("--no-eager", action="store_true", help="leave AdapterHub's eager variants out")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, metavar="NAME", help="time only these (and ORT fp32); default: all")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench-precisions")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    torch.set_num_interop_threads(1)
    command = "python -m benchmarks.precisions " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for geo in args.geometries:
        base = minilm_folder() if geo == "minilm" else bert_base_folder(args.workdir)
        results.append(
            run_geometry(geo, base, args.workdir / geo, args.cases, args.rounds_scale, not args.no_eager, args.variants)
        )
    m = machine() | {"openvino": openvino_version() or "-"}
    data = {"command": command.strip(), "machine": m, "capabilities": device_capabilities(), "results": results}
    text = markdown(results, command.strip(), m, data["capabilities"])
    record(
        args.out,
        "precisions",
        "Precisions per runtime (issue 38)",
        data,
        lambda path: plot(results, path),
        text,
        not args.no_record,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
