"""The loop's parts, per step: the step itself (``step.py``), what the loop does between steps (``actions.py``:
batches, validation, checkpoints, rewinds), the divergence guard, preemption and validation's pass. Where it
sits among the layers: docs/code-layout.md."""
