"""The model: attention backends, context parallelism, the loss and the model's own loss terms, multimodal
checkpoints, recomputation, recurrent mixers, named shapes, where a model comes from. Its place among the
layers: docs/code-layout.md."""
