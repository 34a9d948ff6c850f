"""Data: input files and row formats, chat masking, tokenizing (process_data), the raw-data cache, mixes,
held-out rows, packing and the sampler; what every dataset kind offers (``rows.py``). Its place among the
layers: docs/code-layout.md."""
