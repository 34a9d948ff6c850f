"""Checkpoints: full states and their resume, Hugging Face exports, the output folder's lock, what to
save when. Imports the layers below: ``common``, ``data``, ``model``, ``methods``."""
