"""Tools beside training: tiny models, the demo, plots of a run's metrics, data inspection. Its place among the
layers: docs/code-layout.md."""
