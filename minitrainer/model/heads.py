"""Which head a checkpoint carries and which one a run trains, read from the model's config and structure.

Two heads exist: a causal LM's next-token head (``get_output_embeddings()``, the LM head every objective but
``reward`` trains) and a sequence classifier's score head (``*ForSequenceClassification``: a linear map from the
decoder's hidden states to ``num_labels`` scores; a reward model has one label). The head follows the config:
a config whose ``architectures`` names a sequence-classification class is built and loaded as one
(``multimodal.auto_model_class``), so the run's meta model, rank 0's load, the methods' copies and the export
all agree without a flag threaded through them.

Loaded as a causal LM, a sequence-classification checkpoint would get a fresh random LM head, train it, and
export a folder whose ``config.json`` still names the classification class while it holds ``lm_head.weight`` and
no score head: every objective that trains the LM head refuses it (``head_refusal``). ``--objective reward``
instead turns a causal LM's config into its sequence classifier's (``scoring_config``: the family's own class
from transformers' registry, one label), whose score head transformers initialises fresh. The classes are
transformers' own registry of sequence-classification models.
"""

from __future__ import annotations

import copy

from torch import nn


def sequence_classification_class(model_config) -> str | None:
    """The checkpoint's sequence-classification class (``Qwen2ForSequenceClassification``), or None."""
    known = _registered_class(model_config)
    architectures = getattr(model_config, "architectures", None) or []
    return next((name for name in architectures if name == known or name.endswith("ForSequenceClassification")),
                None)


def _registered_class(model_config) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(getattr(model_config, "model_type", None))


def head_refusal(model_config, path: str) -> str | None:
    """One line when the checkpoint at ``path`` is not a causal LM but a sequence classifier, else None."""
    found = sequence_classification_class(model_config)
    if found is None:
        return None
    return (f"{path} is a sequence-classification checkpoint ({found}: a score head, no LM head): train.py would "
            "give it a fresh random LM head and export a folder that is neither; train the causal LM it was made "
            "from, or train it as a reward model with --objective reward")


def scoring_refusal(model_config, path: str) -> str | None:
    """Why the causal LM or sequence classifier at ``path`` cannot be trained as a one-label reward model (one
    line), or None."""
    model_type = getattr(model_config, "model_type", None)
    found = sequence_classification_class(model_config)
    if found is not None and getattr(model_config, "num_labels", 1) != 1:
        return (f"--objective reward: {path} is a {found} with {model_config.num_labels} labels; a reward model "
                "scores with one: start from its causal LM, or set num_labels to 1 in its config.json")
    if found is None and _registered_class(model_config) is None:
        return (f"--objective reward: transformers has no sequence-classification class for model type "
                f"{model_type!r} ({path}), so it could not load the exported reward model; pick a model of "
                "another family")
    return None


def scoring_config(model_config):
    """The config of the one-label sequence classifier of ``model_config``'s family (a copy; a sequence
    classifier's own config as it is)."""
    scoring = copy.deepcopy(model_config)
    if sequence_classification_class(model_config) is None:
        scoring.architectures = [_registered_class(model_config)]
    scoring.num_labels = 1
    return scoring


def score_head_name(model: nn.Module) -> str:
    """The attribute of a sequence classifier that holds its score head: the one child beside the decoder that
    has parameters (transformers names it ``score``; a fine-tuning method may have wrapped it since)."""
    decoder = model.get_decoder()
    found = [name for name, child in model.named_children()
             if child is not decoder and any(True for _ in child.parameters())]
    if len(found) != 1:
        raise ValueError(f"cannot find the score head of {type(model).__name__}: {len(found)} children beside its "
                         f"decoder hold parameters ({', '.join(found)})")
    return found[0]


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that maps the decoder's final hidden states to the model's outputs: the LM head, or a sequence
    classifier's score head (what an optimizer, a method or the FLOPs count treat as "the head")."""
    head = model.get_output_embeddings()
    if head is None and sequence_classification_class(model.config) is not None:
        return getattr(model, score_head_name(model))
    return head
