"""The original mini_trainer's ``from batch_metrics import ...``: ``minitrainer/report/metrics.py``, re-exported."""

from minitrainer.report.metrics import *  # noqa: F403
