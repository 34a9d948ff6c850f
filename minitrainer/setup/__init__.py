"""Set-up, before step 1: the run bundle (``run.py``), the sharded model (``model.py``), the self-check of the
loss, the token budget's autotune and the FLOPs a step costs. Where it sits among the layers:
docs/code-layout.md."""
