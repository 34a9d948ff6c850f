"""Which head a checkpoint carries, read from its config: train.py trains a causal LM's own next-token head.

A ``*ForSequenceClassification`` checkpoint (a reward model, a classifier) holds a score head and no LM head.
Loaded as a causal LM it would get a fresh random LM head, train it, and export a folder whose ``config.json``
still names the classification class while it holds ``lm_head.weight`` and no score head: it is refused, before
anything loads. The classes are transformers' own registry of sequence-classification models.
"""

from __future__ import annotations


def sequence_classification_class(model_config) -> str | None:
    """The checkpoint's sequence-classification class (``Qwen2ForSequenceClassification``), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    known = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(getattr(model_config, "model_type", None))
    architectures = getattr(model_config, "architectures", None) or []
    return next((name for name in architectures if name == known or name.endswith("ForSequenceClassification")),
                None)


def head_refusal(model_config, path: str) -> str | None:
    """One line when the checkpoint at ``path`` is not a causal LM but a sequence classifier, else None."""
    found = sequence_classification_class(model_config)
    if found is None:
        return None
    return (f"{path} is a sequence-classification checkpoint ({found}: a score head, no LM head): train.py would "
            "give it a fresh random LM head and export a folder that is neither; train the causal LM it was made "
            "from")
