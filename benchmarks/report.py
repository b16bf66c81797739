"""Recording benchmark figures: the machine they were measured on, and one section per benchmark in RESULTS.md."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "RESULTS.md"


# what decides int8's and bf16's speed on x86
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict[str, str]:
    """The CPU (model name, the int8-relevant ISA flags it has), cores, versions, date and the load average now."""
    cpu, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == (platform.processor() or "unknown CPU"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    versions = {}
    for mod in ("onnxruntime", "torch"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = "-"
    return {
        "cpu": cpu,
        "cores": str(len(os.sched_getaffinity(0))),
        "python": f"Python {platform.python_version()}",
        "date": dt.date.today().isoformat(),
        "isa": " ".join(f for f in ISA_FLAGS if f in flags) or "-",
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        **versions,
    }


def write_section(path: Path, key: str, title: str, body: str) -> None:
    """Replace (or append) the section between ``<!-- key:start -->`` and ``<!-- key:end -->``."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    block = f"{start}\n## {title}\n\n{body.rstrip()}\n{end}"
    text = (
        path.read_text()
        if path.exists()
        else "# Benchmark results\n\nFigures recorded by the benchmarks, each with the command and machine that made it.\n"
    )
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def record(
    out_dir: Path, key: str, title: str, data: dict[str, Any], plot: Callable[[Path], None], text: str, to_results: bool
) -> None:
    """Write ``<key>.json`` and ``<key>.png`` under ``out_dir``, print the table, and (unless told not to) put it
    with the plot into its section of RESULTS.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{key}.json").write_text(json.dumps(data, indent=2))
    plot(out_dir / f"{key}.png")
    print(text)
    if to_results:
        write_section(RESULTS, key, title, text + f"\n![{key}](results/{key}.png)\n")


def plot_median_bars(results: list[dict], panels: str, title: str, path: Path, width: float = 5.0) -> None:
    """One bar chart of median ms per variant for each geometry (a row of panels) and each entry of
    ``results[i][panels]`` (a column: a batch, a case); ``title`` is formatted with ``geometry``, ``panel`` and the
    result's own keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(results[0][panels])
    fig, axes = plt.subplots(len(results), len(columns), figsize=(width * len(columns), 3.1 * len(results)), squeeze=False)
    for i, res in enumerate(results):
        for j, col in enumerate(columns):
            ax, row = axes[i][j], res[panels][col]
            ax.barh(list(row), [v["median_ms"] for v in row.values()])
            ax.set_title(title.format(panel=col, **res), fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
