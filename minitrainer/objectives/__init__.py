"""Training objectives: what one packed minibatch's loss is, and how a step's metrics read it (``base.py``)."""
