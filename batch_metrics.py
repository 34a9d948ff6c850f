"""The original mini_trainer's ``from batch_metrics import ...``: ``minitrainer/batch_metrics.py``, re-exported."""

from minitrainer.batch_metrics import *  # noqa: F403
