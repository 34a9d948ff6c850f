"""Hugging Face export in-process (one gloo rank): sharded safetensors with an index load as is.

    .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""

import json

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from minitrainer.checkpoint.hf_export import save_hf_checkpoint
from minitrainer.common.distributed import init_distributed
from minitrainer.setup.model import setup_model


def test_sharded_export_with_index_round_trips(tmp_path, chatml_model):
    from transformers import AutoTokenizer

    dist_info = init_distributed()
    model, _ = setup_model(model_name_or_path=str(chatml_model), dist_info=dist_info, attn_implementation="auto",
                           sharding_strategy="FULL_SHARD", cpu_offload=True, activation_checkpointing=False,
                           use_liger_kernels=False, local_world_size=1)
    folder = save_hf_checkpoint(model, output_dir=tmp_path, num_samples=7, rank=0,
                                tokenizer=AutoTokenizer.from_pretrained(chatml_model),
                                generation_config=GenerationConfig.from_pretrained(chatml_model),
                                max_shard_size="40KB")
    assert folder.name == "samples_7"
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    original = AutoModelForCausalLM.from_pretrained(chatml_model)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    for name, param in original.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name].float(), param.to(torch.bfloat16).float(), msg=name)
