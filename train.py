"""Training, run from the repository root: ``torchrun --nproc-per-node=8 train.py --output-dir ... --data-path ...``.

CPU: ``torchrun --nproc-per-node=2 train.py ...`` (gloo). The loop and its manual: ``minitrainer/train.py``
(``torchrun -m minitrainer.train``, or ``torchrun --no-python minitrainer-train`` once installed).
Python: ``from train import train, TrainConfig`` still works; ``from minitrainer import ...`` is the API.
"""

from minitrainer.train import TrainConfig, cli, main, train  # noqa: F401

if __name__ == "__main__":
    cli()
