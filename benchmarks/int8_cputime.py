"""CPU seconds per call of fp32 against the int8 variants (issue 38): a load-independent speed ratio on a shared machine.

    python -m benchmarks.int8_cputime [--workdir DIR] [--cases 16x128 1x128 1x32]

The MiniLM N = 8 graphs of ``benchmarks.latency --int8`` (fp32, the shipped int8, the int8 before issue 38 whose
adapters' down-projection had one activation scale per tensor; made in --workdir as that benchmark makes them, or
reused from its --workdir). Each session runs with one intra-op thread, in the calling thread, so the calling thread's
CPU time (``time.thread_time``) is the work of the call alone: other processes on the cores lengthen the wall clock, not
it. Round-robin, a shuffled order per round, after 2 warm-up calls each; the median per variant, and fp32's over each
variant's (above 1: faster). Prints a markdown table; the figures go into RESULTS.md by hand, with the load printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from benchmarks.latency import INT8_VARIANTS, _artifact, _feeds, _int8_artifacts
from benchmarks.models import build, minilm_folder

VARIANTS = {
    "n8": "fp32",
    "n8-int8": INT8_VARIANTS["n8-int8"],
    "n8-int8-adapters-tensor": INT8_VARIANTS["n8-int8-adapters-tensor"],
}
ROUNDS = {"16x128": 8, "1x128": 40, "1x32": 80}


def sessions(work: Path) -> dict[str, object]:
    import onnxruntime as ort

    model = build(work / "n8", minilm_folder(), 8)
    fp32 = _artifact(model, work / "n8-art")  # made once: kept where its manifest is
    arts = {"n8": fp32, **_int8_artifacts(model, fp32, work)}
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    return {
        name: ort.InferenceSession(str(arts[key] / "model.onnx"), options, providers=["CPUExecutionProvider"])
        for key, name in VARIANTS.items()
    }


def cpu_ms(runs: dict[str, object], batch: int, seq: int, vocab: int, rounds: int) -> dict[str, float]:
    """Median CPU ms of the calling thread per call, round-robin."""
    feeds = _feeds(batch, seq, vocab)
    own = {k: {i.name: feeds[i.name] for i in s.get_inputs()} for k, s in runs.items()}  # type: ignore[attr-defined]
    for k, s in runs.items():
        for _ in range(2):
            s.run(["logits"], own[k])  # type: ignore[attr-defined]
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        order = list(runs)
        random.Random(r).shuffle(order)
        for k in order:
            t = time.thread_time()
            runs[k].run(["logits"], own[k])  # type: ignore[attr-defined]
            times[k].append(time.thread_time() - t)
    return {k: 1000 * float(np.median(v)) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "minilm")
    p.add_argument("--cases", nargs="+", default=list(ROUNDS), choices=list(ROUNDS))
    args = p.parse_args(argv)
    runs = sessions(args.workdir)
    vocab = int(json.loads((minilm_folder() / "config.json").read_text())["vocab_size"])
    print("| case | " + " | ".join(runs) + " | load average before, after |")
    print("|---|" + "---:|" * len(runs) + "---|")
    for case in args.cases:
        batch, seq = map(int, case.split("x"))
        before = os.getloadavg()[0]
        ms = cpu_ms(runs, batch, seq, vocab, ROUNDS[case])
        cells = [f"{m:.1f} ms ({ms['fp32'] / m:.2f}x)" for m in ms.values()]
        print(f"| {case} ({ROUNDS[case]} rounds) | " + " | ".join(cells) + f" | {before:.1f}, {os.getloadavg()[0]:.1f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
