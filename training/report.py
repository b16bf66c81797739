"""The default model's evaluation report, in the spirit of the paper's Table 1 and Figure 4.

Runs the model exactly as fusionserve serves it (fp32, built from the saved folder by ``build_model``) on each
target's dev and test sets: accuracy of the head-only, single-adapter and fusion tasks, with paired bootstrap
confidence intervals, and the fusion's softmax activations per layer averaged over the real (unpadded) tokens of
the test set. Writes REPORT.md, accuracy.png and fusion_activations.png into the folder; returns the numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fusionserve.serving.model.activations import token_sums
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.tokenize import Encoder

from .datasets import Dataset
from .recipe import REFERENCE, RELATED, SOURCES, TARGETS, TEST_PLUS_UNUSED, Recipe, load_data, seed_of

COLUMNS = (("head", "{t}_head", "Head"), ("adapter", "{t}_adapter", "ST-A (own adapter)"), ("fusion", "{t}", "Fusion w/ ST-A"))
BOOTSTRAP_SAMPLES = 2000
BATCH = 64


def _predict(model: Any, encoder: Encoder, examples: tuple, task: str, fusion: bool) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Predicted label ids (n,); for a fusion task the activation sums over real tokens (layers, adapters); tokens."""
    inputs = [TextInput(ex.text, ex.text_pair) for ex in examples]
    order = np.argsort(encoder.count_tokens(inputs), kind="stable")  # similar lengths together: little padding
    preds = np.empty(len(inputs), dtype=np.int64)
    act_sum, tokens = None, 0
    with torch.inference_mode():
        for start in range(0, len(order), BATCH):
            idx = order[start : start + BATCH]
            enc = encoder.encode([inputs[i] for i in idx])
            ids, mask, types = (torch.from_numpy(a) for a in (enc.input_ids, enc.attention_mask, enc.token_type_ids))
            if fusion:
                logits, acts = model.classify(ids, mask, types, task=task, return_fusion_activations=True)
                summed = token_sums(acts.numpy(), enc.attention_mask).sum(axis=0)  # (layers, adapters), padding excluded
                act_sum = summed if act_sum is None else act_sum + summed
            else:
                logits = model.classify(ids, mask, types, task=task)
            preds[idx] = logits.argmax(-1).numpy()
            tokens += int(mask.sum())
    return preds, (act_sum.astype(np.float64) if act_sum is not None else None), tokens


def _ci(samples: np.ndarray) -> list[float]:
    return [round(float(np.percentile(samples, 2.5)) * 100, 2), round(float(np.percentile(samples, 97.5)) * 100, 2)]


def paired_summary(correct: dict[str, np.ndarray], seed: int) -> dict[str, Any]:
    """Accuracy (percent) of each column with a 95% bootstrap interval, and fusion minus adapter with its paired
    interval: every column is resampled with the same ``BOOTSTRAP_SAMPLES`` draws of the examples."""
    n = len(next(iter(correct.values())))
    boot = np.random.default_rng(seed).integers(0, n, size=(BOOTSTRAP_SAMPLES, n))
    row: dict[str, Any] = {"n": n}
    for column, c in correct.items():
        row[column] = {"accuracy": round(float(c.mean()) * 100, 2), "ci95": _ci(c[boot].mean(1))}
    diff = correct["fusion"] - correct["adapter"]
    row["fusion_minus_adapter"] = {"points": round(float(diff.mean()) * 100, 2), "ci95": _ci(diff[boot].mean(1))}
    return row


def evaluate(folder: Path, targets: dict[str, Dataset], max_seq_len: int, seed: int = 0) -> dict[str, Any]:
    """Accuracies (percent) with 95% bootstrap intervals, and the mean fusion activations per layer on test."""
    from fusionserve.export.build import build_model
    from fusionserve.export.spec import load_spec
    from fusionserve.export.tokenizer import load_tokenizer

    spec = load_spec(folder / "model.yaml")
    model = build_model(spec)
    tok = load_tokenizer(spec.base_model)
    encoder = Encoder(tok.backend_tokenizer, max_seq_len, str(tok.pad_token))
    results: dict[str, Any] = {}
    for target, ds in targets.items():
        info = model.task_infos[target]
        entry: dict[str, Any] = {"adapters": list(info.adapters), "labels": list(info.labels), "n_train": len(ds.train)}
        for split in ("dev", "test"):
            examples = getattr(ds, split)
            gold = np.array([ds.labels.index(ex.label) for ex in examples])
            correct = {}
            for column, pattern, _ in tqdm(COLUMNS, desc=f"report {target} {split}", file=sys.stderr, leave=False):
                preds, acts, tokens = _predict(model, encoder, examples, pattern.format(t=target), fusion=column == "fusion")
                correct[column] = (preds == gold).astype(np.float64)
                if acts is not None and split == "test":
                    entry["activations"] = (acts / acts.sum(axis=1, keepdims=True)).round(4).tolist()  # (layers, adapters)
                    entry["activation_tokens"] = tokens
            entry[split] = paired_summary(correct, seed_of(seed, "report", target, split))
        results[target] = entry
    return results


def _plots(folder: Path, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(results)
    adapters = _columns(results)
    acts = np.array([results[t]["activations"] for t in targets])  # (targets, layers, adapters)
    panels = [(f"layer {i + 1}", acts[:, i]) for i in range(acts.shape[1])] + [("mean over layers", acts.mean(1))]
    cols = 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.2 * rows + 0.6), squeeze=False, layout="constrained")
    for k, (ax, (title, grid)) in enumerate(zip(axes.flat, panels, strict=False)):
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(adapters)), adapters, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(targets)), targets if k % cols == 0 else [""] * len(targets), fontsize=8)
        for (r, c), v in np.ndenumerate(grid):
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="white" if v < 0.5 else "black")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="mean softmax activation")
    fig.suptitle("AdapterFusion activations on the test sets (rows: target task, columns: adapter)", fontsize=11)
    fig.savefig(folder / "fusion_activations.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    width = 0.27
    for k, (column, _, label) in enumerate(COLUMNS):
        acc = np.array([results[t]["test"][column]["accuracy"] for t in targets])
        ci = np.array([results[t]["test"][column]["ci95"] for t in targets])
        x = np.arange(len(targets)) + (k - 1) * width
        ax.bar(x, acc, width, label=label, yerr=[acc - ci[:, 0], ci[:, 1] - acc], capsize=3)
        for xi, a, top in zip(x, acc, ci[:, 1], strict=True):
            ax.text(xi, top + 0.5, f"{a:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(targets)), targets)
    ax.set_ylabel("test accuracy (%), 95% CI")
    low = min(results[t]["test"][c]["ci95"][0] for t in targets for c, _, _ in COLUMNS)
    ax.set_ylim(max(0, low - 10), 104)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(COLUMNS), frameon=False)
    fig.savefig(folder / "accuracy.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def _columns(results: dict[str, Any]) -> list[str]:
    """The activation columns: the sources in fusion order, then each target's own adapter as "own"."""
    first = results[next(iter(results))]["adapters"]
    return [a if a in SOURCES else "own" for a in first]


def _curve_plot(folder: Path, curve: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(curve)
    fig, axes = plt.subplots(1, len(targets), figsize=(4.6 * len(targets), 3.6), squeeze=False, layout="constrained")
    for ax, target in zip(axes[0], targets, strict=True):
        points = curve[target]["test"]
        sizes = sorted(points, key=int)
        x = np.array([int(n) for n in sizes])
        for column, _, label in COLUMNS:
            acc = np.array([points[n][column]["accuracy"] for n in sizes])
            ci = np.array([points[n][column]["ci95"] for n in sizes])
            ax.plot(x, acc, marker="o", label=label)
            ax.fill_between(x, ci[:, 0], ci[:, 1], alpha=0.15)
        ax.set_xscale("log")
        ax.set_xticks(x, [str(n) for n in x])
        ax.minorticks_off()
        ax.set_xlabel("target training examples")
        ax.set_title(f"{target} (test n={points[sizes[0]]['n']:,})", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (%), 95% CI")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle("Learning curve: accuracy by target training size (each point trained and chosen on dev, then tested)",
                 fontsize=10)  # fmt: skip
    fig.savefig(folder / "learning_curve.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def _kept(log: dict[str, Any]) -> str:
    """Where a fit's kept weights come from: an epoch of a source, a step of a target's step-counted fit."""
    every = log.get("eval_every_steps")
    if every:
        return f"step {log['best_epoch'] * every} / {len(log['epochs']) * every}"
    return f"epoch {log['best_epoch']} / {len(log['epochs'])}"


def _fmt(cell: dict[str, Any]) -> str:
    lo, hi = cell["ci95"]
    return f"{cell['accuracy']:.1f} [{lo:.1f}, {hi:.1f}]"


def _why(target: str, r: dict[str, Any], logs: dict[str, Any]) -> str:
    """Evidence for a fusion that trails its adapter: the dev curve, overfitting, and where the fusion looks."""
    fusion, adapter = logs["fusion"][target], logs["adapters"][target]
    curve = [e["dev_accuracy"] * 100 for e in fusion["epochs"]]
    best = adapter["dev_accuracy"] * 100
    shown = ", ".join(f"{a:.1f}" for a in curve)
    parts = [
        (f"At no dev check did the fusion pass the adapter's best (fusion by check: {shown}; adapter: {best:.1f}), so "
         "choosing otherwise on dev could not have reversed it." if max(curve) < best else
         f"On dev the fusion reached the adapter's best ({max(curve):.1f} vs {best:.1f}) but did not keep it on test.")
    ]  # fmt: skip
    losses = [e["train_loss"] for e in fusion["epochs"]]
    if fusion["best_epoch"] < len(curve) and losses[-1] < losses[fusion["best_epoch"] - 1]:
        parts.append(f"After the kept check ({_kept(fusion)}) its training loss kept falling ({losses[0]:.2f} to {losses[-1]:.2f}) "
                     f"while dev accuracy did not rise: {fusion['trainable_parameters']:,} fusion and head parameters fit "
                     f"{r['n_train']:,} training examples.")  # fmt: skip
    return " ".join(parts)


def outcome(diff: dict[str, Any]) -> str:
    """'wins', 'ties' or 'loses': where the paired 95% interval of fusion minus adapter lies against 0."""
    lo, hi = diff["ci95"]
    return "wins" if lo > 0 else "loses" if hi < 0 else "ties"


def _verdict(target: str, r: dict[str, Any], logs: dict[str, Any]) -> str:
    test, dev = r["test"], r["dev"]
    diff = test["fusion_minus_adapter"]
    d, (lo, hi) = diff["points"], diff["ci95"]
    own = r["adapters"].index(target)
    mean = np.mean(r["activations"], axis=0)
    related = RELATED.get(target, ())
    uses = f"it gives its own adapter {mean[own] * 100:.0f}% of the weight on average over layers"
    if related:
        share = sum(mean[r["adapters"].index(a)] for a in related if a in r["adapters"]) * 100
        uses += f" and the related source{'s' if len(related) > 1 else ''} ({', '.join(f'`{a}`' for a in related)}) {share:.0f}%"
    spread = float(np.abs(np.asarray(r["activations"]) - 1 / len(r["adapters"])).max())
    if spread < 0.05:  # the scores barely moved from their random start: the mix is (close to) an average
        uses += (f"; every weight is within {spread:.3f} of the uniform 1/{len(r['adapters'])}: the fusion mixes an "
                 "average of all adapter outputs")  # fmt: skip
    dev_line = (f"On dev fusion scored {dev['fusion']['accuracy']:.1f} against the adapter's "
                f"{dev['adapter']['accuracy']:.1f} ({dev['fusion_minus_adapter']['points']:+.1f}).")  # fmt: skip
    said = {"wins": "yes, fusion wins", "ties": "no difference shown", "loses": "no, fusion loses"}[outcome(diff)]
    where = ("The interval lies above 0." if lo > 0 else "The interval lies below 0." if hi < 0 else
             "The interval contains 0: on this test set the gap is within sampling noise.")  # fmt: skip
    out = (f"- **{target}: {said}.** Fusion {test['fusion']['accuracy']:.1f} vs own adapter {test['adapter']['accuracy']:.1f} "
           f"on test ({d:+.1f} points, {round(d * test['n'] / 100):+,} of {test['n']:,} examples; paired 95% CI "
           f"[{lo:+.1f}, {hi:+.1f}]). {where} {dev_line} In the fusion {uses}.")  # fmt: skip
    if d < 0:
        out += f" Why: {_why(target, r, logs)}"
    return out


def _sources_table(logs: dict[str, Any]) -> list[str]:
    out = ["| source | training examples | dev accuracy by epoch | kept | seconds | published figure to compare |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for name in SOURCES:
        log = logs["adapters"].get(name)
        if log is None:
            continue
        curve = ", ".join(f"{e['dev_accuracy'] * 100:.1f}" for e in log["epochs"])
        out.append(f"| {name} | {log.get('n_train', '?'):,} | {curve} | epoch {log['best_epoch']}: **{log['dev_accuracy'] * 100:.1f}** "
                   f"| {log['seconds']:.0f} | {REFERENCE.get(name, 'none for this split')} |")  # fmt: skip
    return out


def _curve_table(target: str, curve: dict[str, Any]) -> list[str]:
    out = [f"| {target}: training examples | " + " | ".join(label for _, _, label in COLUMNS) + " | Fusion − ST-A [95% CI] | |",
           "|---" * (len(COLUMNS) + 3) + "|"]  # fmt: skip
    for n in sorted(curve["test"], key=int):
        r = curve["test"][n]
        diff = r["fusion_minus_adapter"]
        cells = " | ".join(_fmt(r[c]) for c, _, _ in COLUMNS)
        lo, hi = diff["ci95"]
        out.append(f"| {n} | {cells} | {diff['points']:+.1f} [{lo:+.1f}, {hi:+.1f}] | {outcome(diff)} |")
    return out


def _markdown(results: dict[str, Any], logs: dict[str, Any], max_seq_len: int, notes: tuple[str, ...]) -> str:
    targets = list(results)
    columns = _columns(results)
    n_train = results[targets[0]]["n_train"]
    head = "| target | " + " | ".join(label for _, _, label in COLUMNS) + " | Fusion − ST-A, points [95% CI] |"
    sep = "|---" * (len(COLUMNS) + 2) + "|"
    related = "; ".join(f"`{t}` with {', '.join(f'`{a}`' for a in RELATED.get(t, ()))}" for t in targets)
    unrelated = ", ".join(f"`{a}`" for a in SOURCES if not any(a in RELATED.get(t, ()) for t in targets)) or "none"
    unused = " and ".join(t for t in targets if t in TEST_PLUS_UNUSED)  # targets whose test also holds unused train
    out = [
        "# Default model: evaluation",
        "",
        "The paper's experiment in miniature: AdapterFusion (Pfeiffer et al., EACL 2021) on the frozen all-MiniLM-L6-v2 "
        f"backbone (6 layers, hidden 384). {len(SOURCES)} source tasks, each with a `seq_bn` adapter (reduction factor "
        f"16) trained on thousands of examples: {', '.join(f'`{a}`' for a in SOURCES)}. Low-resource targets, each "
        f"trained on {n_train} labelled examples and chosen for a related source ({related}; related to no target: "
        f"{unrelated}). Each target is served three ways, the columns below: a head on the frozen backbone "
        "(`<target>_head`), the target's own adapter with its head (`<target>_adapter`), and a fusion over the source "
        "adapters and the target's own, with its head (`<target>`). Numbers come from the served model (fusionserve's fp32 "
        f"PyTorch model built from this folder; inputs cut at {max_seq_len} tokens, as in training). Settings, data sizes and "
        "timings: `training.json`.",
        "",
        "## Sources",
        "",
        "Each source adapter trains until its dev accuracy stops rising or the epoch ceiling is reached "
        "(`source_epochs` in training.json); the epoch with the best dev accuracy is kept.",
        "",
        *_sources_table(logs),
        "",
        f"## Accuracy (Table 1 analogue), targets trained on {n_train} examples",
        "",
    ]
    for split, what in (("test", "Test accuracy (%), read once after training"),
                        ("dev", "Dev accuracy (%): the split early stopping selected on")):  # fmt: skip
        out += [f"{what}; 95% bootstrap intervals ({BOOTSTRAP_SAMPLES} paired resamples):", "", head, sep]
        for t in targets:
            r = results[t][split]
            diff = r["fusion_minus_adapter"]
            cells = " | ".join(_fmt(r[c]) for c, _, _ in COLUMNS)
            out.append(
                f"| {t} (n={r['n']:,}) | {cells} | {diff['points']:+.1f} [{diff['ci95'][0]:+.1f}, {diff['ci95'][1]:+.1f}] |"
            )
        out.append("")
    wins = [t for t in targets if outcome(results[t]["test"]["fusion_minus_adapter"]) == "wins"]
    losses = [t for t in targets if outcome(results[t]["test"]["fusion_minus_adapter"]) == "loses"]
    out += ["![test accuracy](accuracy.png)", "", "## Does fusion beat the target's own adapter?", "",
            f"On test, fusion wins (paired 95% interval of fusion minus adapter above 0) on {len(wins)} of {len(targets)} "
            f"targets{' (' + ', '.join(wins) + ')' if wins else ''} and loses (interval below 0) on {len(losses)}"
            f"{' (' + ', '.join(losses) + ')' if losses else ''}.", ""]  # fmt: skip
    out += [_verdict(t, results[t], logs) for t in targets]
    if logs.get("curve"):
        out += ["", "## Learning curve", "",
                "Each target trained again on nested subsets of its training data (each smaller set inside the larger): "
                "head-only, own adapter and fusion, each chosen on the same dev set and then scored once on test "
                "(training-time fp32 run of the AdapterHub model). The paper's Table 1 finds fusion helps most on the "
                "smallest targets.", "", "![learning curve](learning_curve.png)", ""]  # fmt: skip
        for t in targets:
            if t in logs["curve"]:
                out += [*_curve_table(t, logs["curve"][t]), ""]
    out += ["## Fusion activations (Figure 4 analogue)", "",
            "Mean softmax weight of each adapter, per layer, over every real token of the test set (padding excluded); "
            "each row of a panel sums to 1. `own` is the target's own adapter.", "", "![fusion activations](fusion_activations.png)", "",
            "Mean over layers:", "", "| target | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]  # fmt: skip
    for t in targets:
        mean = np.mean(results[t]["activations"], axis=0)
        out.append(f"| {t} | " + " | ".join(f"**{v:.2f}**" if a in RELATED.get(t, ()) or a == t else f"{v:.2f}"
                                            for a, v in zip(results[t]["adapters"], mean, strict=True)) + " |")  # fmt: skip
    out += ["", "Bold: the target's own adapter and its related sources.", "",
            "## Training of the served model (every fit: AdamW, linear decay, early stopping on dev accuracy, best epoch kept)", "",
            "| stage | task | trained parameters | training examples | kept / run | dev accuracy (training) | seconds |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for stage in ("head_only", "adapters", "fusion"):
        for task, log in logs.get(stage, {}).items():
            n = log.get("trainable_parameters", "head only")
            n = f"{n:,}" if isinstance(n, int) else n
            out.append(f"| {stage} | {task} | {n} | {log.get('n_train', '?'):,} | {_kept(log)} | "
                       f"{log['dev_accuracy'] * 100:.1f} | {log['seconds']:.0f} |")  # fmt: skip
    out += ["", "Dev accuracy during training ran under the training precision (`recipe.precision` in training.json); the "
            "tables above rerun the saved model in fp32, so the two can differ by a few examples.", ""]  # fmt: skip
    out += ["## Data", "",
            "Splits as `fusionserve.training.datasets` documents them; a source's training set is a stratified sample "
            "of its train split, a target's training sets are prefixes of one label-balanced order of its train split. "
            "A target's test set is its test split" + (f"; for {unused} it also holds the train examples the learning "
            "curve never reaches (never trained or selected on)" if unused else "") + ".", ""]  # fmt: skip
    if notes:
        out += ["## Departures from the paper's recipe", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(out)


def write(
    folder: Path, targets: dict[str, Dataset], max_seq_len: int, logs: dict[str, Any], notes: tuple[str, ...] = (), seed: int = 0
) -> dict[str, Any]:
    """Evaluate the model folder and write REPORT.md, accuracy.png and fusion_activations.png into it."""
    results = evaluate(folder, targets, max_seq_len, seed)
    for target, r in results.items():  # what the served fits trained on (a target's train holds the whole curve)
        r["n_train"] = logs.get("adapters", {}).get(target, {}).get("n_train", r["n_train"])
    _plots(folder, results)
    if logs.get("curve"):
        _curve_plot(folder, logs["curve"])
    (folder / "REPORT.md").write_text(_markdown(results, logs, max_seq_len, notes), encoding="utf-8")
    return results


def main(argv: list[str] | None = None) -> int:
    """Re-evaluate a trained model folder and rewrite its report from its training.json (no training)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m fusionserve.training.report", description=main.__doc__)
    p.add_argument("folder", type=Path, help="model folder written by fusionserve.training.train")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args(argv)
    folder = args.folder

    torch.set_num_threads(args.threads)
    record = json.loads((folder / "training.json").read_text(encoding="utf-8"))
    recipe = Recipe(**record["recipe"])
    data = load_data(recipe)
    notes = tuple(record.get("notes", ()))
    record["evaluation"] = write(
        folder, {t: data[t] for t in TARGETS}, recipe.max_seq_len, record["training"], notes, recipe.seed
    )
    (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"rewrote {folder / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
