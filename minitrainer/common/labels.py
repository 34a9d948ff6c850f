"""The label of a token that is not learned."""

IGNORE_INDEX = -100
"""Label value that contributes no loss (the Hugging Face / PyTorch convention)."""
