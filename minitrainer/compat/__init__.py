"""Other trainers' Python APIs, field for field, run by ours: ``mini_trainer`` (0.9)."""
