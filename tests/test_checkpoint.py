"""Hugging Face export in-process (one gloo rank): sharded safetensors with an index load as is; the weights in
``--save-dtype``, which config.json names.

    .venv/bin/python -m pytest -q tests/test_checkpoint.py
"""

import json

import pytest
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


def _trained(model) -> dict[str, torch.Tensor]:
    """Move every weight off the checkpoint's values, by amounts bf16 cannot hold (as training would), and
    return the full state the export starts from."""
    from minitrainer.checkpoint.hf_export import gather_full_state_dict

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():  # one rank: the local shard is the whole weight
            local = param.to_local()
            local.add_(torch.randn(local.shape, generator=generator) * 1e-3)
    return {name: tensor.clone() for name, tensor in gather_full_state_dict(model).items()}


@pytest.mark.parametrize(("save_dtype", "written"), [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                                     ("float32", torch.float32), ("auto", torch.float32)])
def test_export_is_written_in_save_dtype_and_says_so(tmp_path, chatml_model, save_dtype, written):
    """--save-dtype float32 of a float32 model reloads bit for bit; auto is the checkpoint's float32; the others
    are the trained weights rounded once. config.json names what the files hold, so dtype="auto" loads it so."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    dist_info = init_distributed()
    model, resolved = setup_model(model_name_or_path=str(chatml_model), dist_info=dist_info,
                                  attn_implementation="auto", sharding_strategy="FULL_SHARD", cpu_offload=False,
                                  activation_checkpointing=False, use_liger_kernels=False, local_world_size=1,
                                  save_dtype=save_dtype)
    assert resolved.export_dtype == written
    trained = _trained(model)
    folder = save_hf_checkpoint(model, output_dir=tmp_path, num_samples=3, rank=0,
                                tokenizer=AutoTokenizer.from_pretrained(chatml_model), generation_config=None,
                                dtype=resolved.export_dtype)
    assert json.loads((folder / "config.json").read_text())["dtype"] == str(written).removeprefix("torch.")
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        assert {handle.get_tensor(name).dtype for name in handle.keys()} == {written}
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert reloaded.dtype == written
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained[name].to(written)), name


@pytest.mark.parametrize("config_names_it", [True, False], ids=["config_dtype", "no_config_dtype"])
def test_auto_is_the_checkpoints_own_dtype(tmp_path, chatml_model, config_names_it):
    """A bfloat16 checkpoint exports in bfloat16 under auto: its config's dtype, or where the config names none
    (as GPT-2's) its weights', as from_pretrained(dtype="auto") reads them."""
    source = tmp_path / "bf16_model"
    AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.bfloat16).save_pretrained(source)
    if not config_names_it:
        config = json.loads((source / "config.json").read_text())
        del config["dtype"]
        (source / "config.json").write_text(json.dumps(config))
    _, resolved = setup_model(model_name_or_path=str(source), dist_info=init_distributed(),
                              attn_implementation="auto", sharding_strategy="FULL_SHARD", cpu_offload=False,
                              activation_checkpointing=False, use_liger_kernels=False, local_world_size=1,
                              save_dtype="auto")
    assert resolved.export_dtype == torch.bfloat16


def test_disk_plan_counts_the_export_dtype_bytes():
    from minitrainer.checkpoint.policy import plan_disk

    def export_bytes(**kwargs) -> int:
        return plan_disk(num_params=1000, param_bytes=4, total_samples=10, export_every=5, keep_exports=None,
                         full_state_every=5, keep_full_states=2, full_state=True, **kwargs).export_bytes

    assert (export_bytes(), export_bytes(export_bytes_per_param=torch.float32.itemsize)) == (2000, 4000)
