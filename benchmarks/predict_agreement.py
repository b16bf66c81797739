"""An artifact's answers against fp32's as a user meets them: `fusionserve predict` on the built-in model's targets (issue 38).

    python -m benchmarks.predict_agreement ART --reference FP32_ART [--splits KEY ...] [--workdir DIR] [--no-record]

Runs ``fusionserve predict ART --task T --input TEXTS --output OUT --raw-scores`` (the command a user runs, in a
process of its own, default batch size) for the artifact and for the fp32 reference on each split, the texts only
(labels stripped), one run after another; an output already complete in --workdir is reused (delete it to redo).
The splits (``SPLITS``) are those the int8 study measured: amazon_food's test split of the recipe (4,075 texts, the
one ``benchmarks.int8_smooth`` uses), the dataset's own 1,000-text test split, and editorial_sentiment's test split
(2,134 texts), written as ``benchmarks.int8`` and ``benchmarks.int8_smooth`` write them.

Per split: label agreement with the reference (``benchmarks.int8.compare``: accuracy of both against the true labels,
the largest probability change), the texts whose label differs (with fp32's logit margin), and the logits' absolute
difference over every row and label (max, median; predict writes logits rounded to 6 digits). Also each run's wall
and CPU seconds (the children's user + system time) and the load average around it, since a bf16 artifact on a CPU
without bf16 units runs oneDNN's emulation, about 17x fp32's time. Writes results/predict_agreement_<precision>.json
and its section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from benchmarks.int8 import _split, compare
from benchmarks.report import machine, record

HERE = Path(__file__).parent
# key -> (task, what it is)
SPLITS = {
    "amazon_food.test": ("amazon_food", "amazon_food test, 4,075 texts (the recipe's; int8_smooth's)"),
    "amazon_food.own-test": ("amazon_food", "amazon_food test, the dataset's own 1,000 texts"),
    "editorial_sentiment.test": ("editorial_sentiment", "editorial_sentiment test, 2,134 texts"),
}
TARGET = 99.5  # issue 38: bf16's answers agree with fp32's on >= 99.5% of each target's test split


def split_rows(key: str, work: Path) -> list[dict[str, Any]]:
    """The split's labelled rows, written under ``work/data`` as the int8 benchmarks write them."""
    from benchmarks.int8_smooth import _own_test

    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    task, split = key.split(".")
    return _own_test(data) if split == "own-test" else _split(task, split, data, None)


def texts_file(key: str, rows: list[dict[str, Any]], work: Path) -> Path:
    """The split's inputs as `predict --input` reads them: text (and text_pair), no label."""
    path = work / "data" / f"{key}.texts.jsonl"
    if not path.is_file():
        keep = ("text", "text_pair")
        path.write_text("".join(json.dumps({k: r[k] for k in keep if r.get(k) is not None}) + "\n" for r in rows))
    return path


def run_predict(artifact: Path, task: str, texts: Path, out: Path) -> dict[str, Any]:
    """``fusionserve predict`` on ``texts`` into ``out`` (kept: a later run reuses a complete one, marked by
    ``out.done``). Returns the run's wall and CPU seconds and the load average before and after."""
    done = out.with_suffix(".done.json")
    if done.is_file():
        return json.loads(done.read_text())
    cli = Path(sys.executable).with_name("fusionserve")
    argv = [str(cli), "predict", str(artifact), "--task", task, "--input", str(texts), "--output", str(out), "--raw-scores"]
    before, t0 = os.getloadavg(), time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(" ".join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    info = {
        "command": " ".join(argv[1:]),
        "wall_s": round(time.perf_counter() - t0, 1),
        "cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 1),
        "load_before": [round(x, 2) for x in before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    done.write_text(json.dumps(info))
    return info


def read_logits(path: Path) -> np.ndarray:
    """The logits `predict` wrote, one row per input line (every line must be an answer, not an error)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    bad = [i + 1 for i, r in enumerate(rows) if "logits" not in r]
    if bad:
        raise SystemExit(f"{path}: lines {bad[:5]} have no logits (errors?)")
    return np.array([r["logits"] for r in rows], dtype=np.float64)


def figures(ref: np.ndarray, got: np.ndarray, labels: np.ndarray, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``compare``'s figures, the differing texts and the logits' absolute difference."""
    out = compare(ref, got, labels)
    diff = np.abs(got - ref)
    top = np.sort(ref, axis=-1)
    margin = top[:, -1] - top[:, -2]
    differ = np.flatnonzero(ref.argmax(-1) != got.argmax(-1))
    out |= {
        "differ": len(differ),
        "logit_diff_max": round(float(diff.max()), 4),
        "logit_diff_median": round(float(np.median(diff)), 4),
        "fp32_margin_median": round(float(np.median(margin)), 3),
        "texts": [
            {
                "row": int(i),
                "text": rows[i]["text"][:100],
                "ref_margin": round(float(margin[i]), 4),
                "ref": int(ref[i].argmax()),
                "got": int(got[i].argmax()),
            }
            for i in differ
        ],
    }
    return out


def run(artifact: Path, reference: Path, work: Path, keys: list[str]) -> dict[str, Any]:
    from fusionserve.serving.model.artifact import load_artifact

    labels_of = load_artifact(reference).manifest["tasks"]
    result: dict[str, Any] = {"splits": {}, "runs": {}}
    for key in keys:
        task = SPLITS[key][0]
        rows = split_rows(key, work)
        texts = texts_file(key, rows, work)
        runs = {
            name: run_predict(folder, task, texts, work / f"{key}.{name}.jsonl")
            for name, folder in (("reference", reference), ("artifact", artifact))
        }
        names = labels_of[task]["labels"]
        y = np.array([names.index(r["label"]) for r in rows])
        got = figures(read_logits(work / f"{key}.reference.jsonl"), read_logits(work / f"{key}.artifact.jsonl"), y, rows)
        for t in got["texts"]:
            t["ref"], t["got"] = names[t["ref"]], names[t["got"]]
        result["splits"][key], result["runs"][key] = got, runs
        print(key, json.dumps({k: v for k, v in got.items() if k != "texts"}), file=sys.stderr, flush=True)
    return result


def markdown(result: dict[str, Any], command: str, precision: str, meta: dict[str, Any]) -> str:
    m = machine()
    lines = [
        f"`{command}` on {m['cpu']} ({m['cores']} cores; ISA flags: {m['isa']}), onnxruntime {m['onnxruntime']}, "
        f"{m['date']}. The {precision} artifact's labels through `fusionserve predict` against the fp32 artifact's "
        f"(`{meta['reference']}`), texts only; target: >= {TARGET}% on each split (issue 38).{_runtime(meta)}",
        "",
        f"| split | agreement (texts that differ) | target {TARGET}% | logit change max / median | largest probability "
        "change | accuracy fp32 / this (%) | predict's wall / CPU s, fp32; this (load before-after) | CPU x fp32 |",
        "|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for key, f in result["splits"].items():
        runs = result["runs"][key]
        times = "; ".join(
            f"{r['wall_s']:.0f} / {r['cpu_s']:.0f} ({r['load_before'][0]:.1f}-{r['load_after'][0]:.1f})"
            for r in (runs["reference"], runs["artifact"])
        )
        lines.append(
            f"| {SPLITS[key][1]} | {f['agreement']:.2f}% ({f['differ']} of {f['examples']}) | "
            f"{'met' if f['agreement'] >= TARGET else '**not met**'} | {f['logit_diff_max']:.4f} / "
            f"{f['logit_diff_median']:.4f} | {f['max_probability_change']:.4f} | {f['accuracy_ref']:.2f} / "
            f"{f['accuracy']:.2f} | {times} | {runs['artifact']['cpu_s'] / runs['reference']['cpu_s']:.1f}x |"
        )
    lines += ["", "The texts whose label differs (fp32's logit margin: how close fp32 itself was to the other label):", ""]
    for key, f in result["splits"].items():
        if f["texts"]:
            lines.append(
                f"- {SPLITS[key][1]} (fp32's median margin over all its texts: {f['fp32_margin_median']:.2f}): "
                + "; ".join(f"row {t['row']} {t['ref']} -> {t['got']} (margin {t['ref_margin']:.3f})" for t in f["texts"])
            )
    return "\n".join(lines) + "\n"


def _runtime(meta: dict[str, Any]) -> str:
    """What ran a bf16 artifact, from its manifest: OpenVINO's version, the inference precision, the bf16 units."""
    rt = meta.get("runtime")
    if not rt:
        return ""
    units = ", ".join(rt.get("cpu_bf16_units") or []) or "none"
    how = (
        " (oneDNN's AVX-512 emulation: the operands rounded to bf16 as AMX's tiles and AVX-512 BF16 round them, the "
        "products accumulated in fp32; the order of accumulation can differ on AMX, so a rerun there is the check)"
        if rt.get("emulated")
        else ""
    )
    return f" Runtime: {rt['name']} {rt['version']}, inference precision {rt['inference_precision']}, bf16 units: {units}{how}."


def plot(result: dict[str, Any], path: Path) -> None:
    """Label agreement with fp32 per split, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(result["splits"])
    fig, ax = plt.subplots(figsize=(7.0, 0.5 * len(keys) + 1.2))
    ax.barh(range(len(keys)), [result["splits"][k]["agreement"] for k in keys])
    ax.axvline(TARGET, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(keys)), [SPLITS[k][1] for k in keys], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(97, 100)
    ax.set_xlabel(f"label agreement with fp32 through predict (%); dashed: the {TARGET}% target")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from fusionserve.serving.model.artifact import load_artifact

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path, help="the artifact to measure (bf16, int8, ...)")
    p.add_argument("--reference", type=Path, required=True, help="the fp32 artifact of the same model")
    p.add_argument("--splits", nargs="+", choices=list(SPLITS), default=list(SPLITS))
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "predict_agreement")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.predict_agreement " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    manifest = load_artifact(args.artifact).manifest
    precision = manifest["precision"]
    result = run(args.artifact, args.reference, args.workdir, args.splits)
    meta = {"reference": str(args.reference), "artifact": str(args.artifact), "precision": precision}
    meta["runtime"] = manifest.get(precision, {}).get("runtime")
    text = markdown(result, command, precision, meta)
    key = f"predict_agreement_{precision}"
    title = f"{precision} as a user meets it: `fusionserve predict` against fp32 on the targets' test splits"
    data = {"command": command, "machine": machine(), **meta, "result": result}
    record(args.out, key, title, data, lambda path: plot(result, path), text, not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
