"""The original mini_trainer's ``from setup_model_fsdp import ...``: ``minitrainer/setup/model.py``,
re-exported."""

from minitrainer.setup.model import *  # noqa: F403
