"""The original mini_trainer's ``from sampler import ...``: ``minitrainer/data/sampler.py``, re-exported."""

from minitrainer.data.sampler import *  # noqa: F403
from minitrainer.data.sampler import batch_lengths_to_minibatches  # noqa: F401
