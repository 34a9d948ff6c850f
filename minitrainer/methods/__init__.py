"""Fine-tuning methods behind one interface (``base.FineTuningMethod``): LoRA, QLoRA, OSFT. Its place among
the layers: docs/code-layout.md."""
