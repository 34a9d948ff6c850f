"""What a run reports: each step's metrics line (``metrics.py``), trackers, the progress on stderr, and the
launching process's watch of a run's events (``watch.py``). Where it sits among the layers: docs/code-layout.md."""
