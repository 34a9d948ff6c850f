"""Checkpoints: full states and their resume, Hugging Face exports, the output folder's lock, what to
save when. Its place among the layers: docs/code-layout.md."""
