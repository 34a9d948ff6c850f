"""The lowest layer: config dataclass -> CLI, config files, logging, seeds, distributed start-up, exit
statuses, faults the tests inject, and leftovers of dead writers. Imports nothing of the package."""
