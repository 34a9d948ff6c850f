"""The model: attention backends, context parallelism, the loss and the model's own loss terms, multimodal
checkpoints, recomputation, recurrent mixers, named shapes. Imports ``common`` and ``data``."""
