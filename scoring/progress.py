"""The progress file of a scoring run (OUTPUT.progress.json): which run wrote an output and how far it got, and
whether a new run starts fresh, goes on, or is refused.

A run is identified by the sha256 of its input and of its model's manifest and by the options that shape the
output (task, fields, added columns, output format): a rerun with the same identity goes on from the last commit;
a different one is refused unless ``overwrite``. Paths may change between runs, contents may not.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fusionserve.errors import InputError

from .files import open_output

PROGRESS_FORMAT = "fusionserve-score-progress"


def side_files(output: Path) -> tuple[Path, Path, Path]:
    """The bad-row file, the progress file and the Parquet parts folder of ``output``."""
    return (
        output.with_name(output.name + ".errors.jsonl"),
        output.with_name(output.name + ".progress.json"),
        output.with_name(output.name + ".parts"),
    )


@dataclass
class Progress:
    """The progress file: which run wrote the output, and how far it got (at the last commit)."""

    run: dict[str, Any]
    rows_done: int = 0  # input rows (bad ones included) whose results are committed
    scored: int = 0
    failed: int = 0
    truncated: int = 0
    output_bytes: int = 0  # JSONL / CSV
    errors_bytes: int = 0
    parts: int = 0  # Parquet
    complete: bool = False
    final_bytes: int = 0  # the finished output's size and sha256, to tell a later cut or edit
    final_sha256: str = ""
    input: str = ""
    model: str = ""
    format: str = field(default=PROGRESS_FORMAT)

    def save(self, path: Path) -> None:
        """Atomically: a crash leaves the old file or the new one, never half of one."""
        tmp = path.with_name(path.name + ".tmp")
        with open_output(tmp, "w", what="progress file") as fh:
            fh.write(json.dumps(asdict(self), indent=1) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Progress:
        """Raises InputError when the file is not a progress file this version writes."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != PROGRESS_FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            return cls(**data)
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise InputError(f"{path} is not a readable progress file ({exc}); pass --overwrite to start over") from None


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Each part of a run's identity that differs, as "what: old then, new now"."""
    names = {"input_sha256": "input (sha256)", "model_sha256": "model (manifest sha256)", "output_format": "output format"}
    out = []
    for key, value in new.items():
        if old.get(key) != value:
            what = names.get(key, key if key == "task" else "--" + key.replace("_", "-"))
            before, now = old.get(key), value
            if key.endswith("sha256"):
                before, now = str(before)[:12], str(now)[:12]
            out.append(f"{what}: {before!r} then, {now!r} now")
    return out


def prepare(out: Path, run: dict[str, Any], overwrite: bool, input_name: str, model_name: str) -> Progress:
    """The progress to go on from: a fresh one (removing an old output when ``overwrite``) or the one on disk.
    Raises InputError for an output that is not ours, or that another run wrote."""
    errors, progress, parts = side_files(out)
    if progress.exists() and not overwrite:
        state = Progress.load(progress)
        diff = differences(state.run, run)
        if diff:
            raise InputError(
                f"{out} was written by a different scoring run ({'; '.join(diff)}); "
                "pass --overwrite to start over, or choose another --output"
            )
        return state
    if out.exists() and not overwrite:
        raise InputError(
            f"{out} exists and was not written by `fusionserve score` (no {progress.name}); pass --overwrite to replace it"
        )
    for path in (out, errors, progress):
        path.unlink(missing_ok=True)
    shutil.rmtree(parts, ignore_errors=True)
    state = Progress(run, input=input_name, model=model_name)
    state.save(progress)
    return state
