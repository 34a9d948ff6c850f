"""The lowest layer: config dataclass -> CLI, config files, logging, seeds, distributed start-up, exit
statuses, faults the tests inject, and leftovers of dead writers. Its place among the layers: docs/code-layout.md."""
