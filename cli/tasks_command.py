"""``fusionserve tasks add|remove|list``: change the tasks of a live artifact (``export --live``) as new revisions that
a running server picks up by itself (docs/guides/live-tasks.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fusionserve.errors import InputError
from fusionserve.serving.options import check_task_name


def add_tasks(sub: Any) -> None:
    p = sub.add_parser("tasks", help="add, replace, remove or list the tasks of a live artifact (export --live)")
    verbs = p.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="add a task (or --replace one) as a new revision, checked before it is served")
    add.add_argument("artifact", help="artifact folder written by `fusionserve export --live`")
    add.add_argument("name", help="the task's name")
    what = add.add_mutually_exclusive_group()
    what.add_argument("--fusion", type=Path, help="AdapterHub fusion folder (save_adapter_fusion) over the artifact's adapters")
    what.add_argument("--adapter", help="one adapter the artifact holds (a single-adapter task)")
    add.add_argument(
        "--head",
        type=Path,
        required=True,
        help="AdapterHub head folder (save_head): classification, regression, multiple choice, tagging or question answering",
    )
    add.add_argument("--replace", action="store_true", help="swap the weights of the existing task of this name")
    add.add_argument("--spec", type=Path, help="the export's spec, where the manifest's recorded path no longer holds it")
    add.set_defaults(run=run_add, needs="export")
    rm = verbs.add_parser("remove", help="remove a task as a new revision (its requests then get 404 unknown_task)")
    rm.add_argument("artifact")
    rm.add_argument("name")
    rm.set_defaults(run=run_remove, needs="serve")  # ONNX Runtime checks the other tasks; no torch
    ls = verbs.add_parser("list", help="the tasks of the published revision")
    ls.add_argument("artifact")
    ls.add_argument("--json", action="store_true", help="the revision document as JSON")
    ls.set_defaults(run=run_list, needs="serve")
    cfg = verbs.add_parser(
        "config",
        help="the published revision as a Ray Serve user_config, for clusters whose nodes do not share the folder",
    )
    cfg.add_argument("artifact")
    cfg.add_argument("--since", type=int, default=0, help="the revision the nodes' copies hold (default 0: as exported)")
    cfg.set_defaults(run=run_config, needs="serve")


def _checked(doc: dict[str, Any]) -> str:
    checks = doc.get("checks", {})
    parts = []
    if "task" in checks:
        t = checks["task"]
        out = next(iter(t["max_abs_diff"]))  # logits, or token_logits for a token-level head
        agreement = f"label agreement {t['label_agreement']:.1%}" if "label_agreement" in t else ""
        agreement = agreement or f"correlation {t['correlation']:.4f}"  # a regression head: no labels
        parts.append(f"vs PyTorch over {t['cases']} cases: max |diff| {out} {t['max_abs_diff'][out]:.2g}, {agreement}")
    if "others" in checks:
        parts.append(f"{checks['others']['tasks']} other task(s) bit-identical")
    return "; ".join(parts)


def run_add(args: argparse.Namespace) -> int:
    check_task_name(args.name)  # before any work (the imports below load torch)
    from fusionserve.export.live.tasks import add_task
    from fusionserve.export.spec import TaskSpec

    doc = add_task(args.artifact, TaskSpec(args.name, args.head, args.fusion, args.adapter), args.replace, args.spec)
    change = doc["change"]
    print(
        f"{args.artifact}: revision {doc['revision']} published: {change['op']} task '{args.name}' "
        f"({len(doc['tasks'])} tasks) in {change['seconds']:.1f} s; checked: {_checked(doc)}"
    )
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from fusionserve.export.live.publish import remove_task

    doc = remove_task(args.artifact, args.name)
    print(
        f"{args.artifact}: revision {doc['revision']} published: removed task '{args.name}' ({len(doc['tasks'])} tasks "
        f"left) in {doc['change']['seconds']:.1f} s; checked: {_checked(doc)}"
    )
    return 0


def run_list(args: argparse.Namespace) -> int:
    from fusionserve.serving.model import revisions
    from fusionserve.serving.model.artifact import load_artifact

    art = load_artifact(args.artifact, verify=False)
    if art.revision is None:
        raise InputError(f"{args.artifact}: not a live artifact (exported without --live); `fusionserve inspect` lists its tasks")
    doc = revisions.read(art.folder, art.revision)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{art.folder}: revision {doc['revision']} ({doc['change']['op']}, {doc.get('created_utc', '?')})")
    width = max(len(n) for n in doc["tasks"])
    for name, t in sorted(doc["tasks"].items(), key=lambda kv: kv[1]["index"]):
        what = {"fusion": "fusion over " + ", ".join(t["adapters"]), "adapter": f"adapter {', '.join(t['adapters'])}"}
        print(f"  {name:<{width}}  {what.get(t['kind'], 'head only')}; labels: {', '.join(t['labels'])}; {t['file']}")
    return 0


def run_config(args: argparse.Namespace) -> int:
    """Print the deployment ``user_config`` to put under the fusionserve deployment of a Serve config (JSON is YAML)."""
    from fusionserve.serving.model import revisions
    from fusionserve.serving.model.artifact import load_artifact

    art = load_artifact(args.artifact, verify=False)
    if art.revision is None:
        raise InputError(f"{args.artifact}: not a live artifact (exported without --live)")
    print(json.dumps({"user_config": revisions.bundle(art.folder, args.since)}))
    return 0
