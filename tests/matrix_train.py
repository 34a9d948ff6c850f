"""Test driver, launched by tests/test_architectures.py under ``torchrun --nproc-per-node=2``.

Trains several architectures one after another in the same torchrun job
(``train.train`` per run: its own process group, model, data loader and
output folder), so the matrix pays Python, torch and transformers start-up
once instead of once per architecture. Each run is given as a JSON object
on the command line: ``{"name", "args": [train.py flags], "env": {...}}``;
the exit code of every run (0, or ``SystemExit``'s) goes to
``<first run's --output-dir>/../results_<rank>.json``, rewritten after each
run, and rank 0 opens each run with a ``MATRIX RUN <name>`` line on stderr
(rank 0 only: the ranks' streams interleave, and another rank's marker for
the next run could land before rank 0's refusal of this one, which then read
as a crash in ``bench/bench_architectures.py``).

The process group is created by the first run and kept for the next ones
(``train.cleanup`` is replaced for the job's duration): destroying and
re-creating it under one torchrun agent hangs on the third creation here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402

RUN_MARKER = "MATRIX RUN"


def main() -> None:
    runs = [json.loads(arg) for arg in sys.argv[1:]]
    destroy = train.cleanup
    train.cleanup = lambda: None
    results = {}
    out = Path(runs[0]["args"][runs[0]["args"].index("--output-dir") + 1]).parent
    rank = os.environ.get("RANK", "0")
    for run in runs:
        if rank == "0":
            print(f"{RUN_MARKER} {run['name']}", file=sys.stderr, flush=True)  # splits the shared log per run
        saved = {key: os.environ.get(key) for key in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            train.main(run["args"])
            results[run["name"]] = 0
        except SystemExit as stop:
            results[run["name"]] = stop.code if isinstance(stop.code, int) else 1
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        # Written after every run: when one run crashes the job, the runs before it keep their results.
        (out / f"results_{rank}.json").write_text(json.dumps(results))
    destroy()


if __name__ == "__main__":
    main()
