"""The optimizer and its learning-rate schedule. Where it sits among the layers: docs/code-layout.md."""
