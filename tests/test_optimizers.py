"""``--optimizer``: every optimizer trains the tiny model on 2 gloo CPU ranks equal to 1 rank (the quantized AdamWs on
2 ranks only) and resumes exactly; the registry's refusals; fused AdamW's on-device skip; the quantized AdamWs keep
quantized moments; your own class.

    .venv/bin/python -m pytest -q tests/test_optimizers.py      # ~4 min on 2 loaded CPU cores

The runs are warm calls (``fixtures/e2e.py``) but one: Muon SIGTERMed mid-run (a fresh ``torchrun``, the fault
needs it) resumes equal to the uninterrupted run. Muon's and Adafactor's own exactness against torch's
optimizers, sharded and not, is in tests/test_muon.py and tests/test_adafactor.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.e2e import ROOT, assert_ok, model_vocab_size, read_metrics, torchrun, write_tokenized_jsonl
from minitrainer.checkpoint.full_state import complete_checkpoints
from minitrainer.checkpoint.resume_policy import check_resume
from minitrainer.common.cli import parse_config
from minitrainer.common.config_files import config_from_file
from minitrainer.optim.base import OptimizerSetting
from minitrainer.optim.device_skip import skips_on_device, step_unless
from minitrainer.optim.registry import OPTIMIZERS, optimizer_choice
from minitrainer.train_config import TrainConfig

BATCH = 12
STEPS = 6
HALF = 3
LION = str(ROOT / "examples" / "lion.py") + ":Lion"
CPU = OptimizerSetting(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, device=torch.device("cpu"))
REQUIRED = {"model_name_or_path": "m", "data_path": "d.jsonl", "output_dir": "out"}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(128, 64, generator=gen)), torch.nn.Parameter(torch.randn(64, generator=gen))]


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_adamw_skips_a_non_finite_step_on_the_device(found_inf):
    params = _params()
    optimizer = torch.optim.AdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, fused=True)
    reference = _params()
    plain = torch.optim.AdamW([{"params": reference, "weight_decay": 0.1}], lr=1e-2, fused=True)
    assert skips_on_device(optimizer)
    for p, q in zip(params, reference):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    plain.step()
    optimizer.step()  # a first, normal step: moments exist
    before = [p.detach().clone() for p in params]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in params]
    step_unless(optimizer, torch.tensor(found_inf))
    if found_inf:
        for p, b, m in zip(params, before, moments):
            torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
            torch.testing.assert_close(optimizer.state[p]["exp_avg"], m, rtol=0, atol=0)
        assert optimizer.state[params[0]]["step"].item() == 1
    else:
        plain.step()
        for p, q in zip(params, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert not hasattr(optimizer, "found_inf")


def test_adamw_on_cpu_is_unchanged_and_cannot_skip_by_itself():
    optimizer = optimizer_choice("adamw").build([{"params": _params(), "weight_decay": 0.0}], CPU)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["fused"] is None and not skips_on_device(optimizer)


@pytest.mark.parametrize("name,state_class,bits", [("adamw_8bit", "OptimState8bit", 8),
                                                   ("adamw_4bit", "OptimState4bit", 4)])
def test_quantized_adamw_keeps_quantized_moments(name, state_class, bits):
    pytest.importorskip("torchao", reason="the quantized AdamWs need torchao (requirements-dev.txt)")
    params = _params()
    optimizer = optimizer_choice(name).build([{"params": params, "weight_decay": 0.0}], CPU)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    big = optimizer.state[params[0]]["exp_avg"]
    assert type(big).__name__ == state_class and big.codes.dtype == torch.uint8
    assert big.codes.numel() * 8 // bits == params[0].numel()  # 4-bit codes pack two to a byte
    assert optimizer.state[params[1]]["exp_avg"].dtype == torch.float32  # under 4096 elements: fp32
    assert not skips_on_device(optimizer)


def test_sgd_is_torchs_with_momentum_by_default():
    params, reference = _params(), _params()
    ours = optimizer_choice("sgd").build([{"params": params, "weight_decay": 0.01}], CPU)
    theirs = torch.optim.SGD([{"params": reference, "weight_decay": 0.01}], lr=1e-3, momentum=0.9)
    for _ in range(3):
        for p, q in zip(params, reference):
            p.grad = torch.full_like(p, 0.5)
            q.grad = torch.full_like(q, 0.5)
        ours.step()
        theirs.step()
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    nesterov = optimizer_choice("sgd", {"nesterov": True, "momentum": 0.5}).build([{"params": _params()}], CPU)
    assert nesterov.defaults["nesterov"] and nesterov.defaults["momentum"] == 0.5


@pytest.mark.parametrize("name,args,words", [
    ("sgdd", {}, "--optimizer 'sgdd' is not one of adamw"),
    ("sgd", {"momentom": 0.9}, "'momentom' is not one of its settings (momentum, dampening, nesterov)"),
    ("sgd", {"momentum": "high"}, "momentum must be a number, got 'high'"),
    ("sgd", {"momentum": 0, "nesterov": True}, "nesterov needs momentum > 0"),
    ("adamw", {"amsgrad": True}, "'amsgrad' is not one of its settings (none)"),
    ("no_such_package.optim:Fast", {}, "cannot import no_such_package.optim"),
    ("torch.nn:Linear", {}, "Linear is not a torch.optim.Optimizer subclass"),
    ("torch.optim:NoSuch", {}, "torch.optim has no NoSuch"),
    ("missing/lion.py:Lion", {}, "no file"),
])
def test_a_bad_choice_is_one_line_naming_it(name, args, words):
    with pytest.raises(ValueError) as raised:
        TrainConfig(**REQUIRED, optimizer=name, optimizer_args=args)
    assert words in str(raised.value) and str(raised.value).count("\n") <= 1, str(raised.value)


def test_your_own_class_imports_from_the_working_directory_or_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_optim").mkdir()
    (tmp_path / "my_optim" / "__init__.py").write_text("")
    (tmp_path / "my_optim" / "signs.py").write_text((ROOT / "examples" / "lion.py").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    by_module = optimizer_choice("my_optim.signs:Lion", {"betas": [0.9, 0.98]})
    by_file = optimizer_choice(LION)
    assert by_module.cls.__name__ == by_file.cls.__name__ == "Lion" and by_module.state_bytes_per_param == 4.0
    optimizer = by_module.build([{"params": _params(), "weight_decay": 0.1}], CPU)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.98) and optimizer.param_groups[0]["weight_decay"] == 0.1
    with pytest.raises(ValueError, match="unexpected keyword argument 'gamma'"):
        optimizer_choice(LION, {"gamma": 1}).build([{"params": _params()}], CPU)


def test_optimizer_args_come_from_the_flag_as_json_or_yaml_and_from_config_files(tmp_path):
    base = ["--model-name-or-path", "m", "--data-path", "d.jsonl", "--output-dir", "o", "--optimizer", "sgd"]
    assert parse_config(TrainConfig, [*base, "--optimizer-args", '{"momentum": 0.5}']).optimizer_args == \
        {"momentum": 0.5}
    assert parse_config(TrainConfig, [*base, "--optimizer-args", "{momentum: 0.5, nesterov: true}"]) \
        .optimizer_choice().args.nesterov
    file = tmp_path / "run.yaml"
    file.write_text("model_name_or_path: m\ndata_path: d.jsonl\noutput_dir: o\noptimizer: sgd\n"
                    "optimizer_args:\n  momentum: 0.0\n")
    assert config_from_file(TrainConfig, file).optimizer_choice().args.momentum == 0.0
    file.write_text("model_name_or_path: m\ndata_path: d.jsonl\noutput_dir: o\noptimizer_args: fast\n")
    with pytest.raises(ValueError, match="optimizer_args.*a mapping"):
        config_from_file(TrainConfig, file)


@pytest.mark.parametrize("old,new", [({"optimizer": "muon"}, {}), ({}, {"optimizer": "sgd"}),
                                     ({"optimizer": "sgd"}, {"optimizer": "sgd", "optimizer_args": {"momentum": 0.5}})])
def test_a_resume_with_another_optimizer_or_settings_is_refused_even_when_changes_are_allowed(tmp_path, old, new):
    """The full state brings back the old optimizer's states and groups: new ones would not fit, or not apply.
    The default's fields are absent from the record, so going back to adamw is a change too."""
    (tmp_path / "trainer_state.json").write_text(json.dumps({"run_params": {"seed": 1, **old}}))
    error, _ = check_resume([tmp_path], {"seed": 1, **new}, allow_change=True)
    assert error is not None and "another optimizer" in error and "\n" not in error, error


def test_every_built_in_optimizer_states_its_bytes_for_the_memory_plan():
    for name, choice in OPTIMIZERS.items():
        assert 0 < choice.state_bytes_per_param <= 8, name


@pytest.fixture(scope="module")
def data_path(tmp_path_factory, chatml_model) -> Path:
    return write_tokenized_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", num_samples=60,
                                 vocab_size=model_vocab_size(chatml_model), seed=3)


def _args(model: Path, data: Path, out: Path, name: str, lr: float, *, steps: int = STEPS,
          schedule: str = "constant_with_warmup", args: str = "") -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", str(BATCH), "--max-tokens-per-gpu", "96", "--seed", "11",
            "--learning-rate", str(lr), "--num-warmup-steps", "2", "--lr-scheduler", schedule,
            "--max-steps", str(steps), "--weight-decay", "0.01", "--num-data-workers", "0",
            "--optimizer", name, *(["--optimizer-args", args] if args else [])]


def _close(a: list[dict], b: list[dict], *, rel: float, keys=("loss", "grad_norm", "lr")) -> None:
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert math.isclose(rb[key], ra[key], rel_tol=rel, abs_tol=1e-12), (ra["step"], key, ra[key], rb[key])


def _final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(complete_checkpoints(output_dir / "hf_format")[-1] / "model.safetensors")


CHOICES = [("adamw_8bit", 1e-3, ""), ("adamw_4bit", 1e-3, ""), ("sgd", 0.1, '{"nesterov": true}'),
           ("adafactor", 1e-2, ""), ("muon", 2e-2, '{"adjust_lr_fn": "match_rms_adamw"}'), (LION, 1e-4, "")]


@pytest.mark.parametrize("name,lr,args", CHOICES, ids=[c[0].rsplit("/", 1)[-1] for c in CHOICES])
def test_two_ranks_train_equal_one_and_a_continued_run_equals_the_whole(tmp_path, chatml_model, data_path, name,
                                                                          lr, args):
    """2 ranks equal 1 (the first HALF steps); a run of HALF steps continued to STEPS from its final full state
    equals the uninterrupted run: losses, gradient norms, learning rates, then the final weights bit for bit.

    The quantized AdamWs skip the 1-rank run: on CPU each parameter shape compiles torchao's update, and a
    1-rank job's whole tensors are new shapes (half of these cases' minutes), for an agreement that only
    bounds the quantization's noise (each rank quantizes its own shard in blocks)."""
    quantized = "adamw_" in name
    if quantized:
        pytest.importorskip("torchao", reason="the quantized AdamWs need torchao (requirements-dev.txt)")
    whole, one, part = tmp_path / "whole", tmp_path / "one", tmp_path / "part"
    assert_ok(torchrun(_args(chatml_model, data_path, whole, name, lr, args=args), warm=True))
    if not quantized:
        assert_ok(torchrun(_args(chatml_model, data_path, one, name, lr, steps=HALF, args=args), nproc=1, warm=True))
    assert_ok(torchrun(_args(chatml_model, data_path, part, name, lr, steps=HALF, args=args), warm=True))
    continued = torchrun(_args(chatml_model, data_path, part, name, lr, args=args), warm=True)
    assert_ok(continued)
    assert "resumed from" in continued.stderr
    a = read_metrics(whole)
    assert a[-1]["loss"] < a[0]["loss"], [r["loss"] for r in a]  # it trains
    if not quantized:
        _close(a[:HALF], read_metrics(one), rel=1e-5)
    b = read_metrics(part)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    _close(a, b, rel=1e-6)
    final_a, final_b = _final_weights(whole), _final_weights(part)
    for tensor in final_a:
        torch.testing.assert_close(final_b[tensor], final_a[tensor], rtol=0, atol=0, msg=tensor)


def test_muon_sigtermed_and_resumed_equals_uninterrupted(tmp_path, chatml_model, data_path):
    """A SIGTERM to rank 1 after step HALF (a preemption): the run saves its full state (Muon's momentum sharded
    like the weights, its AdamW part's moments) and stops; the same command resumes it equal to the uninterrupted
    run, to the weights bit for bit. A resume with another optimizer is refused before the model loads."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    args = dict(name="muon", lr=2e-2, schedule="cosine")
    assert_ok(torchrun(_args(chatml_model, data_path, whole, **args), warm=True))
    signalled = torchrun(_args(chatml_model, data_path, stopped, **args), timeout=600,
                         env={"MINI_TRAINER_TEST_SIGTERM": f"{HALF}:1"})
    assert signalled.returncode != 0, signalled.stderr[-2000:]
    assert [p.name for p in complete_checkpoints(stopped / "full_state")] == [f"samples_{HALF * BATCH}"]
    resumed = torchrun(_args(chatml_model, data_path, stopped, **args), warm=True)
    assert_ok(resumed)
    assert "resumed from" in resumed.stderr
    a, b = read_metrics(whole), read_metrics(stopped)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    _close(a, b, rel=1e-6)
    final_a, final_b = _final_weights(whole), _final_weights(stopped)
    for tensor in final_a:
        torch.testing.assert_close(final_b[tensor], final_a[tensor], rtol=0, atol=0, msg=tensor)
    other = torchrun([*_args(chatml_model, data_path, stopped, **args)[:-2], "--optimizer", "adamw",
                      "--max-steps", str(STEPS + 1)], timeout=300, warm=True)
    assert other.returncode != 0 and "optimizer" in other.stderr


def test_muon_trains_lora_adapters_and_refuses_osft_in_one_line(tmp_path, chatml_model, data_path):
    """LoRA's adapters are matrices: Muon gets every one of them, AdamW nothing trainable beyond them. OSFT
    projects after each update, and that combination is refused before the model loads."""
    pytest.importorskip("peft", reason="LoRA needs peft (requirements-dev.txt)")
    out = tmp_path / "lora"
    result = torchrun([*_args(chatml_model, data_path, out, "muon", 2e-2, steps=HALF), "--lora-rank", "4"],
                      warm=True)
    assert_ok(result)
    [line] = [line for line in result.stderr.splitlines() if "orthogonalized" in line]
    assert "muon: 28 matrices" in line and "AdamW" not in line, line  # 2 layers x 7 projections x (A, B)
    losses = [r["loss"] for r in read_metrics(out)]
    assert losses[-1] < losses[0], losses
    refused = torchrun([*_args(chatml_model, data_path, tmp_path / "osft", "muon", 2e-2, steps=HALF), "--osft"],
                       warm=True)
    assert refused.returncode != 0
    [line] = [line for line in refused.stderr.splitlines() if "--optimizer muon" in line]
    assert "OSFT" in line and "--optimizer adamw" in line and "Traceback" not in refused.stderr


def test_muon_plans_4_bytes_for_the_hidden_matrices_and_8_for_the_rest(chatml_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chatml_model)
    hidden = {id(p) for block in model.model.layers for p in block.parameters() if p.ndim == 2}
    params = {id(p): p for p in model.parameters()}.values()
    expected = sum((4 if id(p) in hidden else 8) * p.numel() for p in params) / sum(p.numel() for p in params)
    assert optimizer_choice("muon").planned_state_bytes(model) == pytest.approx(expected, rel=1e-12)
    assert 4 < expected < 8
    assert optimizer_choice("sgd").planned_state_bytes(model) == 4.0
