"""Other tools' entry points into ours: ``training_hub`` (import it to register the backend)."""
