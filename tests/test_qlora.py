"""QLoRA: LoRA on an NF4 base (torchao), sharded over 2 CPU ranks, exact against its dequantized self.

    .venv/bin/python -m pytest -q tests/test_qlora.py

The reference is ``test_lora``'s: the same peft-wrapped model run unpacked on
one process with torch's AdamW on the adapters, except that every adapted base
weight is replaced by its NF4 rounding (torchao's ``to_nf4`` then
``get_original_weight``, in fp32 as on CPU): the trainer's losses must equal
that model's own, and stay within a few percent of the unquantized base.
The tiny model is wider than the shared one (hidden 256) so that every
projection holds whole double-quantization groups (64 x 256 weights) per shard.
The shared run, the refusal on an unquantizable model and the SIGKILLed run are fresh torchrun launches (what the
processes print at exit, what a user sees, the kill); the other runs, whose numbers are the subject, are warm calls
(``fixtures/e2e.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2Config

from fixtures.e2e import model_vocab_size, read_metrics, reference_adamw_losses, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.methods.lora import LoraSettings, apply_lora
from minitrainer.methods.qlora import NF4_GROUP, nf4_refusal, qlora_preflight, quantize_base_weights
from minitrainer.tools.tiny_model import build_tiny_model
from minitrainer.train import TrainConfig

pytest.importorskip("torchao", reason="QLoRA needs torchao (requirements-dev.txt)")  # none of the above imports it

BATCH = 12
BUDGET = 64
SEED = 5
LR = 1e-2
NUM_STEPS = 3
SETTINGS = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", use_rslora=False,
                        quantize_data_type="nf4")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    return build_tiny_model("chatml", tmp_path_factory.mktemp("qlora_model"), hidden_size=256,
                            intermediate_size=512, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, wide_model) -> Path:
    vocab = model_vocab_size(wide_model)
    return write_tokenized_jsonl(tmp_path_factory.mktemp("qlora_data") / "train.jsonl", num_samples=48,
                                 vocab_size=vocab, seed=4)


def _args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", str(BUDGET), "--seed", str(SEED),
            "--learning-rate", str(LR), "--num-warmup-steps", "0", "--lr-scheduler", "constant",
            "--max-grad-norm", "0", "--num-data-workers", "0", "--lora-rank", str(SETTINGS.rank),
            "--lora-alpha", str(SETTINGS.alpha), "--lora-quantize-data-type", "nf4",
            "--max-steps", str(NUM_STEPS), "--min-samples-per-checkpoint", str(BATCH), *extra]


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    # torch's exit-time count of collectives nobody waited for (printed as a process ends: a fresh launch's).
    # Gathering NF4 DTensors for an export left torchao's three all-gathers per weight unwaited on rank 1 only
    # (rank 0 waited on its copy), so rank 1 ran ahead with collectives still in flight; one such run lost
    # rank 1 to SIGABRT.
    assert "unwaited collective calls" not in result.stderr, result.stderr[-6000:]


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, wide_model, data_path) -> Path:
    """Fresh: it exports NF4 weights gathered from 2 shards at every step, and the processes' exit says whether
    a collective was left unwaited."""
    out = tmp_path_factory.mktemp("qlora_run")
    _ok(torchrun(_args(wide_model, data_path, out)))
    return out


def _adapter(export: Path) -> dict[str, torch.Tensor]:
    return load_file(export / "adapter" / "adapter_model.safetensors")


def _nf4_rounded(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import to_nf4

    return to_nf4(weight).get_original_weight()


def _reference(model_dir: Path, initial_adapter: dict[str, torch.Tensor], *, rounded: bool):
    """peft on the base model (NF4-rounded adapted weights if ``rounded``) with the trainer's initial adapters."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           SETTINGS.peft_config())
    state = model.state_dict()
    for name, tensor in initial_adapter.items():
        key = name.replace(".weight", ".default.weight")
        state[key] = torch.zeros_like(tensor) if ".lora_B." in name else tensor
    if rounded:
        for key in [k for k in state if k.endswith(".base_layer.weight")]:
            state[key] = _nf4_rounded(state[key])
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize(("shape", "shard_size", "ok"), [
    ((256, 256), 1, True), ((256, 256), 4, True), ((256, 256), 8, False), ((128, 256), 2, True),
    ((128, 128), 1, True), ((64, 128), 1, False), ((255, 256), 1, False), ((8, 4, NF4_GROUP), 1, False),
])
def test_nf4_refusal_follows_whole_groups_per_shard(shape, shard_size, ok):
    assert (nf4_refusal(torch.Size(shape), shard_size) is None) == ok


def test_quantize_keeps_embeddings_norms_and_head_and_counts_what_stays():
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    model = AutoModelForCausalLM.from_config(config)
    apply_lora(model, SETTINGS)
    reference = {name: param.detach().clone() for name, param in model.named_parameters()}
    report = quantize_base_weights(model, shard_size=4, dtype=torch.float32)
    # k_proj and v_proj are 128 x 256 = 2 groups: not 4 shards' worth; the other five are quantized.
    assert (report.num_quantized, report.num_kept) == (5, 2)
    assert {name.rsplit(".", 1)[-1] for name in report.kept_names} == {"k_proj", "v_proj"}
    assert report.num_nf4_bytes < 0.14 * report.num_full_bytes  # ~0.52 of 4 bytes per weight
    for name, param in model.named_parameters():
        nf4 = type(param).__name__ == "NF4Tensor"
        assert nf4 == (name.endswith("base_layer.weight") and "_proj" in name
                       and name.split(".")[-3] not in ("k_proj", "v_proj")), name
        assert nf4 or torch.equal(param, reference[name]), name
        assert not nf4 or not param.requires_grad
        if nf4:
            torch.testing.assert_close(param.get_original_weight(), _nf4_rounded(reference[name]), rtol=0, atol=0)


def test_what_cannot_be_quantized_is_a_one_line_error(chatml_model):
    narrow = AutoModelForCausalLM.from_pretrained(chatml_model).config  # hidden 64: no whole group anywhere
    error = qlora_preflight(narrow, SETTINGS, shard_size=2)
    assert "none of its 14 adapted linear layers" in error and "--lora-quantize-data-type none" in error
    moe = MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, vocab_size=300)
    error = qlora_preflight(moe, SETTINGS)
    assert "fused 3-D parameters" in error and "--lora-quantize-data-type none" in error
    assert "\n" not in error
    with pytest.raises(ValueError, match="give --lora-rank"):
        TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, lora_quantize_data_type="nf4")


def test_cli_refuses_an_unquantizable_model_on_every_rank(tmp_path, chatml_model):
    vocab = model_vocab_size(chatml_model)
    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=8, vocab_size=vocab, seed=1)
    result = torchrun(_args(chatml_model, data, tmp_path / "out"))
    assert result.returncode != 0
    assert "--lora-quantize-data-type nf4: Qwen2ForCausalLM: none of its" in result.stderr
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr


def test_steps_equal_the_nf4_rounded_model_and_stay_near_the_base(qlora_run, wide_model, data_path):
    records = read_metrics(qlora_run)
    assert records[0]["grad_accum"] >= 2, "the budget should force gradient accumulation"
    exports = complete_checkpoints(qlora_run / "hf_format")
    initial = _adapter(exports[0])
    rounded = _reference(wide_model, initial, rounded=True)
    ref_losses = reference_adamw_losses(rounded, data_path, num_steps=NUM_STEPS, batch_size=BATCH, seed=SEED,
                                        lr=LR)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    unquantized = _reference(wide_model, initial, rounded=False)
    base_loss = reference_adamw_losses(unquantized, data_path, num_steps=1, batch_size=BATCH, seed=SEED, lr=LR)[0]
    assert records[0]["loss"] != base_loss and records[0]["loss"] == pytest.approx(base_loss, rel=0.03)
    assert records[-1]["loss"] < records[0]["loss"]
    trained = _adapter(exports[-1])
    for name, tensor in trained.items():
        expected = rounded.state_dict()[name.replace(".weight", ".default.weight")]
        # Three AdamW steps divide by sqrt(v): an entry with a near-zero gradient turns the
        # ranks' fp32 reduction order into ~1e-4 relative noise (seen: 1 of 2048 entries).
        torch.testing.assert_close(tensor, expected, rtol=1e-3, atol=1e-5, msg=name)


def test_a_one_rank_shard_group_trains_the_same(tmp_path, wide_model, data_path, qlora_run):
    # NO_SHARD: FSDP2 leaves the NF4 weights whole on every rank (its one-rank path cannot unshard them).
    out = tmp_path / "no_shard"
    _ok(torchrun(_args(wide_model, data_path, out, "--fsdp-sharding-strategy", "NO_SHARD", "--max-steps", "2",
                       "--min-samples-per-checkpoint", "1000"), warm=True))
    expected = [r["loss"] for r in read_metrics(qlora_run)][:2]
    assert [r["loss"] for r in read_metrics(out)] == pytest.approx(expected, rel=1e-6)


def test_exports_load_adapter_on_the_original_base_and_merge_the_rounded_one(qlora_run, wide_model):
    export = complete_checkpoints(qlora_run / "hf_format")[-1]
    base = AutoModelForCausalLM.from_pretrained(wide_model, dtype=torch.float32)
    base_state = base.state_dict()
    adapter = _adapter(export)
    merged = load_file(export / "model.safetensors")
    assert merged.keys() == base_state.keys()
    scaling = SETTINGS.alpha / SETTINGS.rank
    num_merged = 0
    for name, tensor in merged.items():
        assert tensor.dtype == torch.bfloat16, name
        a_key = f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"
        if a_key in adapter:
            delta = (adapter[a_key.replace("lora_A", "lora_B")] @ adapter[a_key]) * scaling
            expected = (_nf4_rounded(base_state[name]) + delta).to(torch.bfloat16)
            torch.testing.assert_close(tensor.float(), expected.float(), rtol=2**-7, atol=1e-6, msg=name)
            num_merged += 1
        else:
            assert torch.equal(tensor, base_state[name].to(torch.bfloat16)), name
    assert num_merged == 14
    # The adapter is peft's format and loads on the original, unquantized base.
    input_ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        untrained = base(input_ids=input_ids).logits
        on_original = PeftModel.from_pretrained(base, export / "adapter")(input_ids=input_ids).logits
    assert not torch.allclose(on_original, untrained, atol=1e-4), "the adapter must change the model"
    # The merged model loads as is and computes what the adapter does on the NF4-rounded base.
    rounded_base = AutoModelForCausalLM.from_pretrained(wide_model, dtype=torch.float32)
    rounded_base.load_state_dict({name: _nf4_rounded(tensor) if name in merged and f"base_model.model."
                                  f"{name.removesuffix('.weight')}.lora_A.weight" in adapter else tensor
                                  for name, tensor in base_state.items()})
    merged_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        on_rounded = PeftModel.from_pretrained(rounded_base, export / "adapter")(input_ids=input_ids).logits
        reloaded = merged_model(input_ids=input_ids).logits
    torch.testing.assert_close(reloaded, on_rounded, rtol=0.05, atol=0.05)


def test_resume_after_sigkill_is_exact_and_quantization_is_fingerprinted(tmp_path, wide_model, data_path,
                                                                         qlora_run):
    out = tmp_path / "killed"
    args = _args(wide_model, data_path, out)
    killed = torchrun(args, env={"MINI_TRAINER_TEST_KILL_AFTER_SAVE": str(BATCH)})
    assert killed.returncode != 0
    [state] = complete_checkpoints(out / "full_state")
    metadata = torch.distributed.checkpoint.FileSystemReader(str(state)).read_metadata()
    model_keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]
    refused = torchrun(["none" if arg == "nf4" else arg for arg in args], warm=True)
    assert refused.returncode != 0 and "another model or dataset" in refused.stderr
    _ok(torchrun(args, warm=True))
    assert [r["loss"] for r in read_metrics(qlora_run)] == [r["loss"] for r in read_metrics(out)]
    final_a = _adapter(complete_checkpoints(qlora_run / "hf_format")[-1])
    final_b = _adapter(complete_checkpoints(out / "hf_format")[-1])
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name


def test_the_python_api_passes_the_quantization_to_the_cli():
    from minitrainer.api import config_to_argv
    from minitrainer.common.cli import parse_config

    config = TrainConfig(model_name_or_path="m", data_path="d", output_dir="out", min_samples_per_checkpoint=12, lora_rank=4,
                         lora_quantize_data_type="nf4")
    argv = config_to_argv(config)
    assert argv[argv.index("--lora-quantize-data-type") + 1] == "nf4"
    assert parse_config(TrainConfig, argv) == config
