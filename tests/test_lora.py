"""LoRA: exact packed, sharded steps on a frozen base, exports peft and transformers load, exact resume.

    .venv/bin/python -m pytest -q tests/test_lora.py

The reference is the same peft-wrapped model run unpacked, sample by sample,
on one process, with torch's AdamW on the adapters alone. Adapters start with
B = 0, so A receives no gradient in step 1: the A of the step-1 export is the
initial A, which lets the reference start from the trainer's own init.

Runs whose numbers are the subject are warm calls (``fixtures/e2e.py``); fresh processes are kept for the
SIGKILLed run and for the libraries hidden or broken on the processes' path (``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fixtures.e2e import (ROOT, assert_ok, model_vocab_size, read_metrics, reference_adamw_losses, torchrun,
                          write_tokenized_jsonl)
from minitrainer.api import config_to_argv
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.common.cli import parse_config
from minitrainer.methods.lora import LoraSettings, apply_lora, base_model_reference, export_states, lora_preflight
from minitrainer.train import TrainConfig

BATCH = 12
BUDGET = 64  # forces several packed minibatches per rank
SEED = 5
LR = 1e-2
SETTINGS = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", use_rslora=False)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    vocab = model_vocab_size(chatml_model)
    return write_tokenized_jsonl(tmp_path_factory.mktemp("lora_data") / "train.jsonl", num_samples=48,
                                 vocab_size=vocab, seed=4)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", str(BUDGET), "--seed", str(SEED),
            "--learning-rate", str(LR), "--num-warmup-steps", "0", "--lr-scheduler", "constant",
            "--max-grad-norm", "0", "--num-data-workers", "0", "--lora-rank", str(SETTINGS.rank),
            "--lora-alpha", str(SETTINGS.alpha), *extra]


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, chatml_model, data_path) -> Path:
    out = tmp_path_factory.mktemp("lora_run")
    assert_ok(torchrun(_args(chatml_model, data_path, out, "--max-steps", "2", "--min-samples-per-checkpoint",
                       str(BATCH)), warm=True))
    return out


def _adapter(export: Path) -> dict[str, torch.Tensor]:
    return load_file(export / "adapter" / "adapter_model.safetensors")


def _peft_reference(model_dir: Path, initial_adapter: dict[str, torch.Tensor]):
    """The base model with the trainer's initial adapters, through peft itself."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, SETTINGS.peft_config())
    state = model.state_dict()
    for name, tensor in initial_adapter.items():
        key = name.replace(".weight", ".default.weight")
        state[key] = torch.zeros_like(tensor) if ".lora_B." in name else tensor
    model.load_state_dict(state)
    return model


def test_export_states_merge_equals_peft_merge_and_unload(chatml_model):
    model = AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32)
    apply_lora(model, SETTINGS)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    merged, adapter = export_states({k: v.detach().clone() for k, v in model.state_dict().items()},
                                    scaling=SETTINGS.alpha / SETTINGS.rank)
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32),
                               SETTINGS.peft_config())
    reference.load_state_dict({f"base_model.model.{k}": v for k, v in model.state_dict().items()})
    expected = reference.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
    assert len(adapter) == 2 * 7 * model.config.num_hidden_layers  # q k v o gate up down per block


def test_conv1d_projections_are_adapted_and_merged_in_their_own_layout():
    """GPT-2 stores its projections as Conv1D, [in, out]: the merged export must match peft's merge."""
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    peft_config = apply_lora(model, SETTINGS)
    assert peft_config.fan_in_fan_out and sorted(peft_config.target_modules) == ["c_attn", "c_fc", "c_proj"]
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    merged, _ = export_states({k: v.detach().clone() for k, v in model.state_dict().items()},
                              scaling=SETTINGS.alpha / SETTINGS.rank, fan_in_fan_out=peft_config.fan_in_fan_out)
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(base_state)
    reference = get_peft_model(fresh, SETTINGS.peft_config(fresh))
    reference.load_state_dict({f"base_model.model.{k}": v for k, v in model.state_dict().items()})
    expected = reference.merge_and_unload().state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(("save_dtype", "merge"), [("float32", True), ("bfloat16", True), ("bfloat16", False)])
def test_the_exports_weights_are_written_in_save_dtype(tmp_path, chatml_model, save_dtype, merge):
    """In process on one rank: the merged weights are export_states' merge of the trained state rounded once to
    --save-dtype (float32: bit for bit), the adapter beside them exact fp32; an adapter-only export's adapter is
    in --save-dtype."""
    import dataclasses

    from transformers import AutoTokenizer

    from minitrainer.checkpoint.hf_export import gather_full_state_dict, save_hf_checkpoint
    from minitrainer.common.distributed import init_distributed
    from minitrainer.methods.lora import LoRA, lora_scaling
    from minitrainer.setup.model import setup_model

    method = LoRA(dataclasses.replace(SETTINGS, merge_on_export=merge))
    model, resolved = setup_model(model_name_or_path=str(chatml_model), dist_info=init_distributed(),
                                  attn_implementation="auto", sharding_strategy="FULL_SHARD", cpu_offload=False,
                                  activation_checkpointing=False, use_liger_kernels=False, local_world_size=1,
                                  method=method, save_dtype=save_dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at zero: trained adapters move every adapted weight
        for name, param in model.named_parameters():
            if "lora_B" in name:
                local = param.to_local()  # one rank: the whole weight
                local.copy_(torch.randn(local.shape, generator=generator) * 0.1)
    merged, adapter = export_states(gather_full_state_dict(model), scaling=lora_scaling(method.peft_config))
    folder = save_hf_checkpoint(model, output_dir=tmp_path, num_samples=1, rank=0, generation_config=None,
                                tokenizer=AutoTokenizer.from_pretrained(chatml_model), dtype=resolved.export_dtype)
    dtype = getattr(torch, save_dtype)
    if merge:
        reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
        assert reloaded.dtype == dtype
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, merged[name].to(dtype)), name
    written = load_file(folder / "adapter" / "adapter_model.safetensors" if merge else
                        folder / "adapter_model.safetensors")
    assert written.keys() == adapter.keys()
    for name, tensor in adapter.items():
        assert torch.equal(written[name], tensor.to(torch.float32 if merge else dtype)), name


def test_packed_sharded_lora_steps_equal_unpacked_peft_reference(two_step_run, chatml_model, data_path):
    records = read_metrics(two_step_run)
    assert records[0]["grad_accum"] >= 2, "the budget should force gradient accumulation"
    first, second = complete_checkpoints(two_step_run / "hf_format")
    initial = _adapter(first)
    model = _peft_reference(chatml_model, initial)
    ref_losses = reference_adamw_losses(model, data_path, num_steps=2, batch_size=BATCH, seed=SEED, lr=LR)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    trained = _adapter(second)
    for name, tensor in trained.items():
        expected = model.state_dict()[name.replace(".weight", ".default.weight")]
        torch.testing.assert_close(tensor, expected, rtol=1e-4, atol=1e-6, msg=name)
    # Step 1 moved B only (A's gradient is zero while B = 0); step 2 moved both.
    moved_a = [n for n in initial if ".lora_A." in n and not torch.equal(initial[n], trained[n])]
    assert moved_a


def test_base_weights_untouched_and_exports_load(two_step_run, chatml_model):
    export = complete_checkpoints(two_step_run / "hf_format")[-1]
    base = AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32)
    base_state = base.state_dict()
    adapter = _adapter(export)
    merged = load_file(export / "model.safetensors")
    scaling = SETTINGS.alpha / SETTINGS.rank
    for name, tensor in merged.items():
        module = name.removesuffix(".weight")
        a_key = f"base_model.model.{module}.lora_A.weight"
        if a_key in adapter:
            delta = (adapter[a_key.replace("lora_A", "lora_B")] @ adapter[a_key]) * scaling
            expected = (base_state[name] + delta).to(torch.bfloat16)
            # One bf16 rounding step at most: the merge order of fp32 ops may differ by an ulp.
            torch.testing.assert_close(tensor.float(), expected.float(), rtol=2**-7, atol=1e-6, msg=name)
        else:
            assert torch.equal(tensor, base_state[name].to(torch.bfloat16)), name

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chatml_model, dtype=torch.float32),
                                           export / "adapter")
    merged_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    params = json.loads((two_step_run / "training_params.json").read_text())
    assert (params["lora_rank"], params["lora_alpha"], params["lora_target_modules"]) == (4, 8.0, "all-linear")
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == SETTINGS.rank and config["base_model_name_or_path"] == str(chatml_model)
    input_ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        adapted = peft_model(input_ids=input_ids).logits
        reloaded = merged_model(input_ids=input_ids).logits
        untrained = base(input_ids=input_ids).logits
    assert not torch.allclose(adapted, untrained, atol=1e-4), "the adapter must change the model"
    torch.testing.assert_close(reloaded, adapted, rtol=0.05, atol=0.05)


@pytest.fixture(scope="module")
def adapter_only(tmp_path_factory, chatml_model, data_path) -> Path:
    """One step exported as the adapter alone, its base given as a folder relative to the working folder (a warm
    call's is the repository root): the export of both tests below."""
    out = tmp_path_factory.mktemp("adapter_only")
    relative = Path(os.path.relpath(chatml_model, ROOT))
    assert_ok(torchrun(_args(relative, data_path, out, "--max-steps", "1", "--min-samples-per-checkpoint", "1000",
                             "--no-lora-merge-on-export"), warm=True))
    [export] = complete_checkpoints(out / "hf_format")
    return export


def test_adapter_only_export(adapter_only, chatml_model):
    names = {p.name for p in adapter_only.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert not any(name.startswith("model") for name in names)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chatml_model), adapter_only)


def test_full_state_holds_only_adapters_and_resume_is_exact(tmp_path, chatml_model, data_path, two_step_run):
    out = tmp_path / "killed"
    args = _args(chatml_model, data_path, out, "--max-steps", "2", "--min-samples-per-checkpoint", str(BATCH))
    killed = torchrun(args, env={"MINI_TRAINER_TEST_KILL_AFTER_SAVE": str(BATCH)})
    assert killed.returncode != 0
    [state] = complete_checkpoints(out / "full_state")
    metadata = torch.distributed.checkpoint.FileSystemReader(str(state)).read_metadata()
    model_keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]
    assert_ok(torchrun(args, warm=True))
    a, b = read_metrics(two_step_run), read_metrics(out)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    final_a = _adapter(complete_checkpoints(two_step_run / "hf_format")[-1])
    final_b = _adapter(complete_checkpoints(out / "hf_format")[-1])
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name


def test_bad_lora_settings_are_one_line_errors(tmp_path, chatml_model, data_path):
    lora = TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, lora_rank=8, lora_target_modules="q_proj,v_proj",
                       lora_merge_on_export=False)
    assert parse_config(TrainConfig, config_to_argv(lora)) == lora  # the Python API carries LoRA settings
    with pytest.raises(ValueError, match="--lora-rank must be positive"):
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, lora_rank=-2)
    qlora = TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, lora_rank=4, lora_quantize_data_type="nf4")
    assert qlora.lora.quantize_data_type == "nf4"  # QLoRA itself: tests/test_qlora.py
    assert parse_config(TrainConfig, config_to_argv(qlora)) == qlora
    model_config = AutoModelForCausalLM.from_pretrained(chatml_model).config
    refused = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules="input_layernorm", use_rslora=False)
    assert "peft cannot adapt Qwen2ForCausalLM" in lora_preflight(model_config, refused)
    on_head = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules="q_proj,lm_head", use_rslora=False)
    assert "adapts the LM head" in lora_preflight(model_config, on_head)
    assert lora_preflight(model_config, SETTINGS) is None
    # Warm: the refusal's line is the subject (test_qlora.py's unquantizable model is the fresh run of a method's
    # preflight refusal). Every rank stops, none with a traceback.
    result = torchrun(_args(chatml_model, data_path, tmp_path / "bad", "--max-steps", "1",
                            "--min-samples-per-checkpoint", "100", "--lora-target-modules", "no_such_proj"), warm=True)
    assert result.returncode != 0 and all(result.rank_codes), result.rank_codes
    assert "--lora-target-modules no_such_proj: peft cannot adapt" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("library, extra", [("peft", ()), ("torchao", ("--lora-quantize-data-type", "nf4"))])
def test_a_missing_method_library_is_a_one_line_refusal(tmp_path, chatml_model, data_path, library, extra):
    """peft (and torchao for QLoRA) are optional: where one is not installed, as a ``sitecustomize`` that puts
    ``None`` in ``sys.modules`` makes it for these processes, the run stops in one line naming the install
    instead of a traceback on rank 0 and a lost connection on the others."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules[{library!r}] = None\n")
    result = torchrun(_args(chatml_model, data_path, tmp_path / "out", "--max-steps", "1",
                            "--min-samples-per-checkpoint", "100", *extra), env={"PYTHONPATH": str(hide)})
    assert result.returncode == 1
    assert f"ERROR --lora-{'rank' if library == 'peft' else 'quantize-data-type nf4'} needs {library}" in result.stderr
    assert f"'{library}>=" in result.stderr.split(f"needs {library}")[1].splitlines()[0]
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr


def test_a_peft_that_fails_to_import_is_a_one_line_refusal(tmp_path, chatml_model, data_path):
    """peft 0.17 cannot be imported beside transformers 5 (it asks for ``HybridCache``): a package of that
    name and version whose import fails the same way stands in for it, ahead of the installed one."""
    fake = tmp_path / "old_peft"
    (fake / "peft").mkdir(parents=True)
    (fake / "peft" / "__init__.py").write_text("from transformers import HybridCache\n")
    (fake / "peft-0.17.0.dist-info").mkdir()
    (fake / "peft-0.17.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: peft\nVersion: 0.17.0\n")
    result = torchrun(_args(chatml_model, data_path, tmp_path / "out", "--max-steps", "1",
                            "--min-samples-per-checkpoint", "100"), env={"PYTHONPATH": str(fake)})
    assert result.returncode == 1
    line = [line for line in result.stderr.splitlines() if "[rank0] ERROR" in line][0]
    assert "--lora-rank: peft 0.17.0 does not work with the libraries installed here" in line
    assert "HybridCache" in line and "pip install -U 'peft>=0.19'" in line
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr


def test_an_adapter_of_a_relative_base_path_loads_from_any_folder(adapter_only, tmp_path, chatml_model, monkeypatch):
    """A base given as a relative folder is recorded absolute: read from elsewhere, a relative path would be
    taken for a hub id (issue 54)."""
    config = json.loads((adapter_only / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(chatml_model).resolve())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoPeftModelForCausalLM.from_pretrained(adapter_only)
    assert isinstance(model, PeftModel)
    torch.testing.assert_close(model.get_base_model().model.embed_tokens.weight,
                               AutoModelForCausalLM.from_pretrained(chatml_model).model.embed_tokens.weight)


def test_a_hub_id_is_recorded_as_given():
    assert base_model_reference("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
