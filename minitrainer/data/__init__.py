"""Data: input files and row formats, chat masking, tokenizing (process_data), the raw-data cache, mixes,
packing and the sampler. Imports only ``common``."""
