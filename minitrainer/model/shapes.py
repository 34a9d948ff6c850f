"""Named model shapes: the published configs of a few released models, built without a download.

    python -m minitrainer.setup.flops --shape Llama-3-8B          # their FLOPs per token

Benchmarks train them at random init (``bench/bench_train.py``, ``make gpu-check``), count their
training-state memory on the meta device (``bench/bench_lora.py``) and their FLOPs (``flops.py``).
Only the architecture's fields are given; everything else is the transformers default of that model type.
"""

from __future__ import annotations

SHAPES: dict[str, dict] = {
    # Published configs of the named models (architecture = the transformers model type).
    "Qwen2.5-0.5B": dict(architecture="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "Qwen2.5-1.5B": dict(architecture="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "Qwen2.5-7B": dict(architecture="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
    "Llama-3-8B": dict(architecture="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5),
    "Llama-3-70B": dict(architecture="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                        tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(architecture="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                 tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
}


def model_config(shape: str, *, max_position_embeddings: int = 32768):
    """The transformers config of a named shape (random init, nothing downloaded)."""
    from transformers import LlamaConfig, Qwen2Config

    fields = dict(SHAPES[shape])
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[fields.pop("architecture")]
    return config_cls(**fields, max_position_embeddings=max_position_embeddings, use_cache=False)
