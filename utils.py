"""The original mini_trainer's ``from utils import ...``: ``minitrainer/common/utils.py``, re-exported."""

from minitrainer.common.utils import *  # noqa: F403
