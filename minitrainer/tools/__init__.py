"""Tools beside training: tiny models, the demo, plots of a run's metrics, data inspection. The top layer:
imports anything of the package."""
