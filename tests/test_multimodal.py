"""Image-text-to-text checkpoints: the language model trains on text, the export is the whole checkpoint.

    .venv/bin/python -m pytest -q tests/test_multimodal.py

Eight tiny random image-text-to-text checkpoints (``fixtures.architectures.MULTIMODAL``: Gemma-3,
Gemma-4, Qwen2.5-VL, Qwen3.5, Llama-4, Mistral-3, LLaVA, Qwen3-VL; the CI sample of
``bench/bench_architectures.py --mapping image-text-to-text``), stored in bf16 beside a
``preprocessor_config.json``, train one packed step each in ONE ``torchrun --nproc-per-node=2`` job
(``fixtures/matrix_train.py``), with LoRA (Qwen2.5-VL), ``--export-text-only`` (Gemma-3, and its
refusal where the text config has no causal-LM class: Qwen2.5-VL), validation (Mistral-3) and a
resumed run (LLaVA) in the same job. The invariants: step 1's loss is the model's own text
``forward(labels=...)``; the export holds every tensor of the source in its class and config, the
non-text ones bit-identical, the language model's trained; loading it with
``AutoModelForImageTextToText`` gives those tensors; the text-only export is the whole export's
language model as a causal LM; adapters sit on the language model only and load with peft; a resumed
run continues the uninterrupted one exactly.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fixtures.architectures import MULTIMODAL, build_multimodal, export_differs, matrix_args, reference_step_one
from fixtures.e2e import read_metrics, torchrun, write_tokenized_jsonl

LORA = "qwen2_5_vl_lora"
TEXT_ONLY = "gemma3_text_only"
TEXT_ONLY_REFUSED = "qwen2_5_vl_text_only"
VALIDATION = "mistral3_validation"
STRAIGHT, FIRST, RESUMED = "llava_two_steps", "llava_first_step", "llava_resumed"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, chatml_model) -> dict:
    """Build the sample, train each one step (and the variants) in one torchrun job."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("multimodal")
    models = {name: build_multimodal(name, chatml_model, root / "models" / name) for name in MULTIMODAL}
    vocab = len(AutoTokenizer.from_pretrained(chatml_model))
    data = write_tokenized_jsonl(root / "data.jsonl", num_samples=40, vocab_size=vocab, seed=3)
    runs_dir = root / "runs"

    def run(name: str, model: str, *extra: str, out: str | None = None) -> dict:
        return {"name": name, "args": matrix_args(models[model], data, runs_dir / (out or name), *extra)}

    runs = [run(name, name) for name in MULTIMODAL]
    runs += [run(LORA, "qwen2_5_vl", "--lora-rank", "4"),
             run(TEXT_ONLY, "gemma3", "--export-text-only"),
             run(TEXT_ONLY_REFUSED, "qwen2_5_vl", "--export-text-only"),
             run(VALIDATION, "mistral3", "--validation-split", "0.25", "--validation-every-n-steps", "1"),
             run(STRAIGHT, "llava", "--max-steps", "2"),  # after matrix_args' --max-steps 1: the later wins
             run(FIRST, "llava", "--max-steps", "1", out=RESUMED),
             run(RESUMED, "llava", "--max-steps", "2")]
    result = torchrun([json.dumps(entry) for entry in runs], module="fixtures.matrix_train", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    exits = json.loads((runs_dir / "results_0.json").read_text())
    return {"root": root, "runs": runs_dir, "models": models, "data": data, "exits": exits, "log": result.stderr}


def _export(run_dir):
    [export] = sorted((run_dir / "hf_format").glob("samples_*"))
    return export


@pytest.mark.parametrize("name", MULTIMODAL)
def test_step_one_equals_the_models_own_text_forward(matrix, name):
    assert matrix["exits"][name] == 0
    [record] = read_metrics(matrix["runs"] / name)
    assert record["grad_accum"] >= 2, "the budget should force several packed minibatches per rank"
    ref = reference_step_one(matrix["models"][name], matrix["data"], with_gradients=False)
    assert record["loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.parametrize("name", MULTIMODAL)
def test_export_is_the_whole_checkpoint(matrix, name):
    """Same tensors, class and config; the non-text tensors bit-identical (stored dtype kept), the language
    model's trained; the processor file along; and so after loading with AutoModelForImageTextToText."""
    from transformers import AutoModelForImageTextToText

    from minitrainer.model.multimodal import detach_non_text

    source_dir, export = matrix["models"][name], _export(matrix["runs"] / name)
    assert export_differs(source_dir, matrix["runs"] / name) is None
    assert json.loads((export / "preprocessor_config.json").read_text()) == \
        json.loads((source_dir / "preprocessor_config.json").read_text())
    source = AutoModelForImageTextToText.from_pretrained(source_dir)
    loaded = AutoModelForImageTextToText.from_pretrained(export)
    assert type(loaded) is type(source)
    source_non_text, _ = detach_non_text(source)
    loaded_non_text, _ = detach_non_text(loaded)
    assert source_non_text.keys() == loaded_non_text.keys() and source_non_text
    assert all(torch.equal(source_non_text[key], loaded_non_text[key]) for key in source_non_text)
    trained = [key for key, value in loaded.state_dict().items() if not torch.equal(value, source.state_dict()[key])]
    assert trained


def test_flops_count_the_language_model(matrix):
    """The config-based FLOPs count equals the matrices the trained module holds: the towers are not in it."""
    assert ("FLOPs per token from the config:" in matrix["log"].split("MATRIX RUN qwen2_5_vl\n", 1)[1]
            .split("MATRIX RUN", 1)[0])


def test_text_only_export_is_the_language_model(matrix):
    """--export-text-only: a causal LM of the text config, equal to the whole export's language model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    export = _export(matrix["runs"] / TEXT_ONLY)
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert not (export / "preprocessor_config.json").exists()
    text_only = AutoModelForCausalLM.from_pretrained(export)
    whole = AutoModelForImageTextToText.from_pretrained(_export(matrix["runs"] / "gemma3"))
    assert torch.equal(text_only.model.layers[0].mlp.up_proj.weight,
                       whole.model.language_model.layers[0].mlp.up_proj.weight)
    assert torch.equal(text_only.lm_head.weight, whole.lm_head.weight)


def test_text_only_export_without_a_causal_lm_class_is_refused_in_one_line(matrix):
    assert matrix["exits"][TEXT_ONLY_REFUSED] == 1
    [line] = [ln for ln in matrix["log"].splitlines() if "--export-text-only:" in ln and " ERROR " in ln]
    assert "Qwen2_5_VLForConditionalGeneration" in line and "no causal-LM class" in line


def test_lora_adapts_the_language_model_only(matrix):
    """Step 1 is the base model's own loss; adapters sit on the language model; peft loads them onto the
    whole checkpoint; the merged export is still the whole checkpoint."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    assert matrix["exits"][LORA] == 0
    [record] = read_metrics(matrix["runs"] / LORA)
    ref = reference_step_one(matrix["models"]["qwen2_5_vl"], matrix["data"], with_gradients=False)
    assert record["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    export = _export(matrix["runs"] / LORA)
    adapter = load_file(export / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".language_model." in key for key in adapter)
    assert export_differs(matrix["models"]["qwen2_5_vl"], matrix["runs"] / LORA) is None
    base = AutoModelForImageTextToText.from_pretrained(matrix["models"]["qwen2_5_vl"])
    peft_model = PeftModel.from_pretrained(base, export / "adapter")
    assert any("lora_A" in name for name, _ in peft_model.named_parameters())


def test_validation_runs_on_the_language_model(matrix):
    assert matrix["exits"][VALIDATION] == 0
    records = read_metrics(matrix["runs"] / VALIDATION)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val and all(math.isfinite(v) for v in val)


def test_resume_continues_exactly(matrix):
    assert matrix["exits"][FIRST] == 0 and matrix["exits"][RESUMED] == 0
    straight = read_metrics(matrix["runs"] / STRAIGHT)
    resumed = read_metrics(matrix["runs"] / RESUMED)
    assert [r["step"] for r in resumed] == [1, 2]
    assert resumed[-1]["loss"] == straight[-1]["loss"]
