"""The CI run's time report: its phases (a background one overlaps the others; ``total`` is the whole run's), the 25 slowest tests by wall-clock and by CPU seconds (the test's and its
children's, which a loaded machine barely moves), and the fresh and warm launches, from the records conftest.py
writes under ``MINITRAINER_TEST_REPORT`` and the phases ``.ci/run`` timed.

    python .ci/report.py REPORT_FOLDER PHASES_FILE
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

SLOWEST = 25
WARN_SECONDS = 30 * 60


def main(report: Path, phases: Path) -> None:
    records = [json.loads(line) for path in sorted(report.glob("*.jsonl")) for line in path.read_text().splitlines()]
    print("\n== CI time report ==")
    total = 0.0
    for line in phases.read_text().splitlines() if phases.is_file() else []:
        name, seconds = line.rsplit(" ", 1)
        print(f"{name:<40} {float(seconds):8.0f} s")
        total = float(seconds) if name == "total" else total
    if not records:
        print("no per-test records")
        return
    for key, label in (("wall", "wall-clock"), ("cpu", "CPU")):
        print(f"\n{SLOWEST} slowest tests by {label} seconds:")
        for record in sorted(records, key=lambda r: -r[key])[:SLOWEST]:
            print(f"  {record[key]:7.1f} s  (wall {record['wall']:6.1f}, CPU {record['cpu']:6.1f})  {record['test']}")
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for record in records:
        for key in ("wall", "cpu", "fresh", "warm", "warm jobs"):
            files[record["test"].split("::")[0]][key] += record.get(key, 0)
    print("\nper file: wall s, CPU s, fresh launches, warm calls, warm jobs started (by CPU):")
    for name, sums in sorted(files.items(), key=lambda item: -item[1]["cpu"]):
        print(f"  {sums['wall']:7.0f} {sums['cpu']:7.0f} {int(sums['fresh']):4d} {int(sums['warm']):4d} "
              f"{int(sums['warm jobs']):3d}  {name}")
    sums = {key: sum(r.get(key, 0) for r in records) for key in ("wall", "cpu", "fresh", "warm", "warm jobs")}
    print(f"\n{len(records)} tests: {sums['wall']:.0f} s wall in all workers, {sums['cpu']:.0f} CPU s; "
          f"{int(sums['fresh'])} fresh torchrun launches, {int(sums['warm'])} warm calls in "
          f"{int(sums['warm jobs'])} warm jobs")
    if total > WARN_SECONDS:
        print(f"\nWARNING: this CI run took {total / 60:.0f} minutes, past the budget's "
              f"{WARN_SECONDS // 60}: move runs into the warm jobs or merge launches before adding any")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
