"""Print where the suite's CPU went, from the files tests/cpu_profile.py wrote (FUSIONSERVE_CPU_PROFILE):

python scripts/cpu_profile.py FOLDER [N]     # the top N (25) modules and tests by CPU seconds
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(folder: Path, top: int) -> None:
    rows = [row for path in sorted(folder.glob("*.json")) for row in json.loads(path.read_text())]
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, cpu, wall in rows:
        entry = modules[nodeid.split("::")[0]]
        entry[0] += cpu
        entry[1] += wall
        entry[2] += 1
    total_cpu, total_wall = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{len(rows)} tests, {total_cpu:.1f} CPU-s, {total_wall:.1f} s wall summed over the workers\n")
    print(f"{'CPU-s':>8} {'wall s':>8} {'tests':>6}  module")
    for name, (cpu, wall, count) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:8.1f} {wall:8.1f} {count:6d}  {name}")
    print(f"\n{'CPU-s':>8} {'wall s':>8}  test (setup + call + teardown)")
    for nodeid, cpu, wall in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{cpu:8.1f} {wall:8.1f}  {nodeid}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 25)
