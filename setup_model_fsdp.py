"""The original mini_trainer's ``from setup_model_fsdp import ...``: ``minitrainer/setup_model_fsdp.py``,
re-exported."""

from minitrainer.setup_model_fsdp import *  # noqa: F403
