"""Fine-tuning methods behind one interface (``base.FineTuningMethod``): LoRA, QLoRA, OSFT. Imports
``common``, ``data`` and ``model``."""
