"""GPU latency: the served graph on CUDA with IO binding, fp16 against fp32, against the plain backbone.

    python -m benchmarks.gpu [--batches 1 32] [--seq 128] [--rounds-scale 1.0]

Needs onnxruntime-gpu and a usable CUDA device (refuses at once otherwise, before building anything), plus what
``benchmarks.latency`` needs to build its models (``.[export,dev,bench]`` and the MiniLM package for the
tokenizer). Geometry BERT-base (hidden 768, 12 layers, random weights, see ``benchmarks.models``), one
AdapterFusion over N = 8 seq_bn adapters; every batch is BATCH x SEQ real-length tokens (no padding).

Variants, timed round-robin in one process (median over rounds after warm-up), each an ``OnnxRunner.run`` on a
pre-encoded batch, i.e. host-to-device copy of the inputs, the graph, device-to-host copy of the logits:

- ``plain fp32`` / ``plain fp16``: backbone + head only, exported by fusionserve, CUDA, IO binding
- ``fusion N=8 fp32`` / ``fusion N=8 fp16``: the fusion graph, CUDA, IO binding
- ``fusion N=8 fp32, TF32``: the fp32 graph with the CUDA provider's TF32 matrix products on (ONNX Runtime's default;
  fusionserve serves fp32 with them off, ``runtime.make_session``): what exact fp32 costs
- ``fusion N=8 fp16, session.run``: the same without IO binding, to show what the binding gives

Target: fusion N=8 fp16 at batch 1 under 2 ms. Writes benchmarks/results/gpu.json, gpu.png and the table in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

HERE = Path(__file__).parent
N_ADAPTERS = 8
TARGET_MS = 2.0  # fusion N=8 fp16, batch 1
COMMAND = "python -m benchmarks.gpu"


def require_cuda() -> str:
    """The GPU's name (from nvidia-smi when it is there). Raises SystemExit saying what is missing when
    onnxruntime has no CUDA provider or the provider does not start (no GPU, missing CUDA / cuDNN libraries)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from fusionserve.serving.model.runtime import CPU, CUDA, GPU_INSTALL

    if CUDA not in ort.get_available_providers():
        raise SystemExit(
            f"benchmarks.gpu: onnxruntime {ort.__version__} has no CUDAExecutionProvider "
            f"(available: {', '.join(ort.get_available_providers())}); this benchmark runs on a CUDA GPU only. "
            f"Install the GPU build: {GPU_INSTALL}"
        )
    # an installed provider may still fail to start; ONNX Runtime then falls back to CPU: try it on one node
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    probe = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,  # opset 17's; the onnx package's newest IR may be ahead of onnxruntime's
    )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), opts, providers=[CUDA, CPU])
    if CUDA not in session.get_providers():
        raise SystemExit(
            f"benchmarks.gpu: onnxruntime {ort.__version__} has the CUDA provider but it did not start: no usable "
            "GPU (check `nvidia-smi`, CUDA_VISIBLE_DEVICES) or missing CUDA / cuDNN libraries"
        )
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return done.stdout.strip().splitlines()[0].replace(", ", ", driver ")
    except (OSError, subprocess.SubprocessError, IndexError):
        return "CUDA GPU (nvidia-smi not available)"


def _artifact(spec: Path, out: Path, precision: str, seq: int) -> Path:
    from fusionserve.export.artifact import export_artifact

    if not (out / "manifest.json").is_file():
        export_artifact(spec, out, precision=precision, max_seq_len=seq, force=True)
    return out


def _encoded(batch: int, seq: int, vocab: int, seed: int = 0):
    from fusionserve.serving.model.tokenize import Encoded

    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, size=(batch, seq), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    return Encoded(ids, np.ones_like(ids), np.zeros_like(ids), [False] * batch)


def run(workdir: Path, batches: list[int], seq: int, rounds_scale: float) -> dict:
    """Build (or reuse) the models and artifacts under ``workdir`` and time every variant; returns the results."""
    from benchmarks.latency import summary_ms
    from benchmarks.models import bert_base_folder, build
    from fusionserve.scoring.timing import time_round_robin
    from fusionserve.serving.model.runtime import OnnxRunner

    base = bert_base_folder(workdir)
    work = workdir / "bert-base"
    print(f"== bert-base: building and exporting models in {work}", file=sys.stderr)
    specs = {"plain": build(work / "plain", base, 0).spec, "fusion": build(work / f"n{N_ADAPTERS}", base, N_ADAPTERS).spec}
    # at 128 tokens the fp32 artifacts are benchmarks.latency's (same spec, same export): reused when there
    arts = {}
    for kind, spec in specs.items():
        for precision in ("fp32", "fp16"):
            name = ("plain" if kind == "plain" else f"n{N_ADAPTERS}") + ("" if seq == 128 else f"-s{seq}")
            name += "" if precision == "fp32" else "-fp16"
            arts[kind, precision] = _artifact(spec, work / f"{name}-art", precision, seq)
    vocab = int(json.loads((base / "config.json").read_text())["vocab_size"])
    runners = {
        "plain fp32": OnnxRunner(arts["plain", "fp32"], device="cuda"),
        "plain fp16": OnnxRunner(arts["plain", "fp16"], device="cuda"),
        f"fusion N={N_ADAPTERS} fp32": OnnxRunner(arts["fusion", "fp32"], device="cuda"),
        f"fusion N={N_ADAPTERS} fp32, TF32": OnnxRunner(arts["fusion", "fp32"], device="cuda", tf32=True),
        f"fusion N={N_ADAPTERS} fp16": OnnxRunner(arts["fusion", "fp16"], device="cuda"),
        f"fusion N={N_ADAPTERS} fp16, session.run": OnnxRunner(arts["fusion", "fp16"], device="cuda", io_binding=False),
    }
    result: dict = {"geometry": "bert-base", "n_adapters": N_ADAPTERS, "seq": seq, "batches": {}}
    for batch in batches:
        enc = _encoded(batch, seq, vocab)
        variants: dict[str, Callable[[], object]] = {
            name: functools.partial(r.run, next(iter(r.artifact.tasks)), enc) for name, r in runners.items()
        }
        rounds = max(20, int(rounds_scale * (300 if batch <= 4 else 60)))
        print(f"-- batch {batch}, seq {seq}: {len(variants)} variants x {rounds} rounds", file=sys.stderr)
        # warm-up: cuBLAS picks its kernels and the CUDA memory arena grows on the first runs of a shape
        times = time_round_robin(variants, rounds, warmup=20, progress=True)
        result["batches"][str(batch)] = summary_ms(times)
    return result


def markdown(res: dict, command: str, gpu: str, machine: dict[str, str]) -> str:
    batches = list(res["batches"])
    n = res["n_adapters"]
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {gpu}; {machine['cpu']}, {machine['cores']} cores; {machine['python']}, onnxruntime "
        f"{machine['onnxruntime']}; {machine['date']}. BERT-base geometry (random weights), sequence length "
        f"{res['seq']}, CUDA provider, IO binding unless said otherwise; median of round-robin rounds after 20 "
        "warm-up calls each; one call = host-to-device inputs, the graph, device-to-host logits.",
        "",
        "| variant | " + " | ".join(f"batch {b} (ms)" for b in batches) + " |",
        "|---|" + "---:|" * len(batches),
    ]
    for variant in res["batches"][batches[0]]:
        cells = [f"{res['batches'][b][variant]['median_ms']:.2f} ({res['batches'][b][variant]['runs']} runs)" for b in batches]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    ratios = {
        f"fusion N={n} / plain, fp32": (f"fusion N={n} fp32", "plain fp32"),
        f"fusion N={n} / plain, fp16": (f"fusion N={n} fp16", "plain fp16"),
        f"fusion N={n}: fp32 / fp16": (f"fusion N={n} fp32", f"fusion N={n} fp16"),
        f"fusion N={n} fp32: TF32 off (served) / on": (f"fusion N={n} fp32", f"fusion N={n} fp32, TF32"),
        f"fusion N={n} fp16: session.run / IO binding": (f"fusion N={n} fp16, session.run", f"fusion N={n} fp16"),
    }
    lines += ["", "| ratio | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---:|" * len(batches)]
    for label, (a, b) in ratios.items():
        if not {a, b} <= res["batches"][batches[0]].keys():  # a run from before that variant was timed
            continue
        cells = [f"{res['batches'][x][a]['median_ms'] / res['batches'][x][b]['median_ms']:.2f}x" for x in batches]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "1" in res["batches"]:
        got = res["batches"]["1"][f"fusion N={n} fp16"]["median_ms"]
        verdict = "met" if got < TARGET_MS else "NOT met"
        lines += ["", f"Target: fusion N={n} fp16 at batch 1 under {TARGET_MS:g} ms: {got:.2f} ms, {verdict}."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(res["batches"])
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        row = res["batches"][b]
        names = list(row)
        ax.barh(names, [row[k]["median_ms"] for k in names], color="tab:blue")
        if b == "1":
            ax.axvline(TARGET_MS, color="tab:red", linestyle=":", label=f"target {TARGET_MS:g} ms (fusion fp16)")
            ax.legend(fontsize=8)
        ax.set_title(f"bert-base, batch {b}, seq {res['seq']}, CUDA")
        ax.set_xlabel("median latency (ms)")
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds-scale", type=float, default=1.0, help="multiply the default number of rounds")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    args = p.parse_args(argv)

    gpu = require_cuda()  # before building anything: minutes of export are wasted on a machine that cannot run it
    from benchmarks.report import machine, record

    command = (COMMAND + " " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    res = run(args.workdir, args.batches, args.seq, args.rounds_scale)
    m = machine()
    data = {"command": command, "gpu": gpu, "machine": m, "results": res, "target_ms": TARGET_MS}
    text = markdown(res, command, gpu, m)
    record(args.out, "gpu", "GPU latency (CUDA, IO binding)", data, lambda path: plot(res, path), text, not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
