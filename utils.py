"""The original mini_trainer's ``from utils import ...``: the modules of ``minitrainer/common/`` (the command
line, logging, seeds, devices, distributed start-up, exit statuses, the label sentinel), re-exported."""

from minitrainer.common.cli import *  # noqa: F403
from minitrainer.common.device import *  # noqa: F403
from minitrainer.common.distributed import *  # noqa: F403
from minitrainer.common.exits import *  # noqa: F403
from minitrainer.common.labels import *  # noqa: F403
from minitrainer.common.log import *  # noqa: F403
from minitrainer.common.rng import *  # noqa: F403
