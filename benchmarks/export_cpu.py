"""CPU seconds of one `fusionserve export` per precision, and what it wrote: the export's own process CPU time (best of
``--repeats``), the sha256 of model.onnx and a digest of the manifest without its creation time, so that two versions
of the exporter can be compared on the same spec (same digests: the same artifact).

    python -m benchmarks.export_cpu --precision int8 bf16 --repeats 2

Without ``--spec`` it builds (once, under ``--root``) all-MiniLM-L6-v2 with 3 adapters and 2 fusion tasks
(benchmarks/models.py). With ``--spec`` it needs only fusionserve, so another checkout's interpreter can run this file
on the same spec: ``/path/to/other/.venv/bin/python benchmarks/export_cpu.py --spec SPEC``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


def _minilm_spec(root: Path) -> Path:
    spec = root / "model.yaml"
    if not spec.is_file():
        from benchmarks.models import build, minilm_folder

        build(root, minilm_folder(), n_adapters=3, n_tasks=2)
    return spec


def export_once(spec: Path, precision: str, max_seq_len: int, out: Path) -> tuple[float, str, str]:
    """(process CPU-s, model.onnx sha256, manifest digest) of one export into ``out``."""
    from fusionserve.export.artifact import export_artifact

    shutil.rmtree(out, ignore_errors=True)
    start = time.process_time()
    manifest = export_artifact(spec, out, precision, max_seq_len=max_seq_len, progress=False)
    cpu = time.process_time() - start
    manifest.pop("created_utc")
    model = hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()[:16]
    return cpu, model, hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, help="the model to export (default: MiniLM with 3 adapters, built once)")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "fusionserve-bench-export-minilm")
    parser.add_argument("--precision", nargs="+", default=["int8", "bf16"])
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the tests' setting: 1)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    spec = args.spec or _minilm_spec(args.root)
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precision:
            runs = [export_once(spec, precision, args.max_seq_len, Path(tmp) / precision) for _ in range(args.repeats)]
            best = min(cpu for cpu, _, _ in runs)
            digests = {(m, d) for _, m, d in runs}
            print(
                f"{precision}: best of {args.repeats} {best:.2f} CPU-s (all: {', '.join(f'{c:.2f}' for c, _, _ in runs)}); "
                f"model.onnx {', '.join(m for m, _ in digests)}; manifest {', '.join(d for _, d in digests)}"
            )


if __name__ == "__main__":
    main()
