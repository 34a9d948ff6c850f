"""mini_trainer 0.9's Python API, field for field (``minitrainer.compat.mini_trainer``): the same dataclasses as
0.9.0's own, each field honoured or refused, and a 0.9 script that trains after changing one import line.

    .venv/bin/python -m pytest -q tests/test_mini_trainer_compat.py

The comparison with the real 0.9.0 runs in the venv of training_hub 0.11.2, which installs it
(``fixtures/hub_venv.py``); the script's run is real: 2 gloo CPU ranks on the tiny chatml model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fixtures.e2e import ROOT
from fixtures.hub_venv import run_in_hub_venv
from minitrainer.compat.mini_trainer import (Refused, TorchrunArgs, TrainerCallback, TrainingArgs, TrainingMode,
                                             to_our_config)

DEMO_DATA = ROOT / "minitrainer" / "tools" / "demo_chat.jsonl"
REQUIRED = dict(model_name_or_path="m", data_path="d.jsonl", batch_size=16, max_tokens_per_gpu=2048,
                learning_rate=1e-5, output_dir="o")

SAME_FIELDS = """
import dataclasses, json, typing
import mini_trainer
from minitrainer.compat import mini_trainer as ours

def shape(cls):
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
        out.append([f.name, repr(hints[f.name]).replace("mini_trainer.training_types.", "").replace(
            "minitrainer.compat.mini_trainer.", ""), repr(default)])
    return out

report = {name: [shape(getattr(mini_trainer, name)), shape(getattr(ours, name))]
          for name in ("TrainingArgs", "TorchrunArgs", "PretrainingConfig", "TrainingContext")}
report["TrainingMode"] = [[m.value for m in mini_trainer.TrainingMode], [m.value for m in ours.TrainingMode]]
report["hooks"] = [sorted(n for n in vars(mini_trainer.TrainerCallback) if n.startswith("on_")),
                   sorted(n for n in vars(ours.TrainerCallback) if n.startswith("on_"))]
report["version"] = mini_trainer.__version__
print(json.dumps(report))
"""


def test_the_dataclasses_are_0_9_0s_field_for_field(tmp_path):
    result = run_in_hub_venv(SAME_FIELDS, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report.pop("version").startswith("0.9.0")
    for name, (theirs, ours) in report.items():
        assert ours == theirs, name
    assert len(report["TrainingArgs"][0]) == 47


def test_the_adamw_fields_0_9_never_forwarded_are_honoured_and_the_api_defaults_kept():
    config, torchrun, _ = to_our_config(TorchrunArgs(nproc_per_node="gpu"), TrainingArgs(
        **REQUIRED, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01, osft=True, osft_unfreeze_rank_ratio=0.3,
        osft_target_patterns=["q_proj"], lr_scheduler_kwargs={"min_lr_rate": 0.2}, validation_split=0.1,
        validation_frequency=5))
    assert (config.adam_betas, config.adam_eps, config.weight_decay) == ((0.8, 0.99), 1e-6, 0.01)
    assert (config.lr_scheduler, config.num_warmup_steps, config.seed, config.num_epochs) == ("cosine", 0, 42, 1.0)
    assert (config.osft, config.osft_unfreeze_rank_ratio, config.osft_target_patterns) == (True, 0.3, "q_proj")
    assert (config.min_lr_ratio, config.validation_split, config.validation_every_n_steps) == (0.2, 0.1, 5)
    assert torchrun.to_argv()[:2] == ["--nnodes=1", "--nproc-per-node=gpu"]
    step, _, _ = to_our_config(TorchrunArgs(), TrainingArgs(**REQUIRED, training_mode=TrainingMode.STEP, max_steps=9))
    assert (step.max_steps, step.num_epochs) == (9, None)


def test_every_field_of_0_9_has_exactly_one_rule():
    """Nothing is dropped unsaid: each ``TrainingArgs`` field is honoured, refused or read by another's rule."""
    import dataclasses

    from minitrainer.compat.mini_trainer import RULES

    assert [f.name for f in dataclasses.fields(TrainingArgs)] == list(RULES)


@pytest.mark.parametrize(("theirs", "ours"), [("float32", "float32"), ("float", "float32"), ("bfloat16", "bfloat16"),
                                              ("float16", "float16"), ("half", "float16"), (None, "auto")])
def test_save_dtype_is_our_save_dtype(theirs, ours):
    """0.9's names (its ``get_model_save_dtype``'s) are ours; its None, the checkpoint's own dtype, is our auto."""
    config, _, _ = to_our_config(TorchrunArgs(), TrainingArgs(**REQUIRED, save_dtype=theirs))
    assert config.save_dtype == ours


def test_what_cannot_be_honoured_is_refused_one_line_each():
    class InStep(TrainerCallback):
        def on_before_forward(self, context): ...

    with pytest.raises(Refused) as refused:
        to_our_config(TorchrunArgs(), TrainingArgs(**REQUIRED, training_mode="token", max_tokens=10**6,
                                                   save_dtype="float64", callbacks=[InStep()]))
    assert str(refused.value).splitlines() == [
        "TrainingArgs(training_mode='token'): a run stops after steps, samples or epochs, not tokens: "
        "TrainingMode.STEP or EPOCH",
        "TrainingArgs(save_dtype='float64'): bfloat16, float16 or float32 (or None: the checkpoint's own dtype); "
        "exports are not written in float64",
        "TrainingArgs(callbacks=[InStep()]): on_before_forward would have to run inside the step on the workers; "
        "on_step_end gets the step's metrics"]
    with pytest.raises(Refused, match="lr-scheduler cosine decays over a known number of steps"):
        to_our_config(TorchrunArgs(), TrainingArgs(**REQUIRED, training_mode=TrainingMode.INFINITE))


SCRIPT_0_9 = """
import json, sys
from minitrainer.compat.mini_trainer import run_training, TrainingArgs, TorchrunArgs, TrainingMode, TrainerCallback

class Count(TrainerCallback):
    calls = []
    def on_step_end(self, context):
        self.calls.append(["step", context.step, context.loss, context.total_samples])
    def on_save(self, context):
        self.calls.append(["save", context.step, context.checkpoint_path])
    def on_train_end(self, context):
        self.calls.append(["end", context.step])

class Broken(TrainerCallback):
    def on_log(self, context):
        raise ValueError("the user's bug")

run_training(
    torch_args=TorchrunArgs(nproc_per_node=2),
    train_args=TrainingArgs(model_name_or_path=sys.argv[1], data_path=sys.argv[2], batch_size=16,
                            max_tokens_per_gpu=2048, learning_rate=1e-4, output_dir="out", weight_decay=0.05,
                            beta2=0.98, training_mode=TrainingMode.STEP, max_steps=4, min_samples_per_checkpoint=32,
                            callbacks=[Broken(), Count()]))
print("CALLS", json.dumps(Count.calls))
"""


def test_a_0_9_script_trains_after_changing_its_import_line(tmp_path, chatml_model):
    (tmp_path / "script.py").write_text(SCRIPT_0_9)
    result = subprocess.run([sys.executable, "script.py", str(chatml_model), str(DEMO_DATA)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    calls = json.loads(result.stdout.split("CALLS ", 1)[1])
    metrics = [json.loads(line) for line in (tmp_path / "out" / "training_metrics_0.jsonl").read_text().splitlines()]
    assert [c for c in calls if c[0] == "step"] == [["step", m["step"], m["loss"], m["samples_seen"]] for m in metrics]
    assert [c[2] for c in calls if c[0] == "save"] == ["out/hf_format/samples_32", "out/hf_format/samples_64"]
    assert calls[-1] == ["end", 4]
    said = [line[line.index("callback Broken"):] for line in (result.stdout + result.stderr).splitlines()
            if "callback Broken" in line]
    assert said == [  # a hook failing on every step: once with its error, then its count, once
        "callback Broken.on_log failed at step 1 (ValueError: the user's bug); training goes on (its further "
        "failures are counted, said at the end)",
        f"callback Broken.on_log failed on {len(metrics)} of {len(metrics)} calls (first at step 1: ValueError: the "
        "user's bug)"]
    params = json.loads((tmp_path / "out" / "training_params.json").read_text())
    assert (params["weight_decay"], params["adam_betas"], params["lr_scheduler"]) == (0.05, [0.9, 0.98], "cosine")
