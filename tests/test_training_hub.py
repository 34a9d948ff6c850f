"""Backend ``minitrainer`` of training_hub: every parameter the hub's ``sft``, ``osft`` and ``lora_sft`` pass is
honoured or refused, and the three train through the hub's own functions.

    .venv/bin/python -m pytest -q tests/test_training_hub.py

The table's tests run here; the others run in a venv of training_hub 0.11.2 itself (``fixtures/hub_venv.py``,
built once under ``.venv-peers/``): its parameter lists, its ``osft``/``sft``/``lora_sft`` functions and
callbacks, 2 gloo CPU ranks on the tiny chatml model and the demo's raw chat data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.e2e import ROOT
from fixtures.hub_venv import run_in_hub_venv
from minitrainer.integrations.hub_parameters import RULES, translate
from minitrainer.train_config import TrainConfig

DEMO_DATA = ROOT / "minitrainer" / "tools" / "demo_chat.jsonl"
OSFT_REQUIRED = dict(model_path="m", data_path="d.jsonl", ckpt_output_dir="o", unfreeze_rank_ratio=0.25,
                     effective_batch_size=16, max_tokens_per_gpu=4096, max_seq_len=1024, learning_rate=1e-5)


def test_adamw_values_and_names_arrive_where_minitrainer_0_9_dropped_them():
    t = translate("osft", {**OSFT_REQUIRED, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.01,
                           "warmup_steps": 5, "target_patterns": ["q_proj", "v_proj"], "tensorboard_log_dir": "tb",
                           "wandb_entity": "team", "wandb_run_name": "r1", "use_liger": True})
    assert t.refusals == []
    assert t.train["adam_betas"] == (0.8, 0.99) and t.train["adam_eps"] == 1e-6 and t.train["weight_decay"] == 0.01
    assert t.train["osft"] is True and t.train["osft_unfreeze_rank_ratio"] == 0.25
    assert t.train["osft_target_patterns"] == "q_proj,v_proj"
    assert t.train["num_warmup_steps"] == 5 and t.train["tensorboard_dir"] == "tb" and t.train["use_liger_kernels"]
    assert t.train["max_sample_num_tokens"] == 1024 and t.train["batch_size"] == 16
    assert t.env == {"WANDB_ENTITY": "team", "WANDB_NAME": "r1"}
    TrainConfig(**t.train)


def test_tracker_parameters_left_out_come_from_the_variables_the_hubs_backends_read():
    environ = {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_EXPERIMENT_NAME": "exp", "WANDB_RUN_NAME": "r"}
    t = translate("osft", {**OSFT_REQUIRED, "mlflow_experiment_name": "mine"}, environ=environ)
    assert (t.train["mlflow_tracking_uri"], t.train["mlflow_experiment"]) == ("http://mlflow:5000", "mine")
    assert t.env == {"WANDB_NAME": "r"} and "wandb_project" not in t.train


def test_a_parameter_left_out_takes_the_default_of_the_algorithms_own_backend():
    osft = translate("osft", OSFT_REQUIRED).train
    assert (osft["lr_scheduler"], osft["num_warmup_steps"], osft["num_epochs"], osft["seed"]) == ("cosine", 0, 1.0, 42)
    assert osft.get("min_samples_per_checkpoint", 0) == 0
    sft = translate("sft", {"model_path": "m", "data_path": "d", "ckpt_output_dir": "o"}).train
    assert sft["checkpoint_at_epoch"] is True and sft["lr_scheduler"] == "cosine"
    lora = translate("lora_sft", {"model_path": "m", "data_path": "d", "ckpt_output_dir": "o", "lora_r": 16,
                                  "nproc_per_node": 4}).train
    # Unsloth's: 2 per device x 1 accumulation x 4 devices; a checkpoint every 500 steps, 3 kept.
    assert lora["batch_size"] == 8 and lora["min_samples_per_checkpoint"] == 500 * 8
    assert (lora["learning_rate"], lora["adam_betas"], lora["keep_last_n_checkpoints"]) == (2e-4, (0.9, 0.999), 3)
    TrainConfig(**lora)


def test_what_cannot_be_honoured_is_refused_one_line_each_naming_ours():
    t = translate("osft", {**OSFT_REQUIRED, "learning_rat": 1e-5, "lora_r": 8, "unmask_messages": True,
                           "lr_scheduler_kwargs": {"power": 2.0}, "checkpoint_storage": "s3://bucket/run"})
    assert sorted(t.refusals) == sorted([
        "osft(..., learning_rat=1e-05) with backend='minitrainer': not a parameter this backend knows (did you "
        "mean learning_rate?)",
        "osft(..., lora_r=8) with backend='minitrainer': a parameter of lora_sft, not of osft",
        "osft(..., unmask_messages=True) with backend='minitrainer': we learn assistant turns only (and whole text "
        "rows); write the rows to learn in full as text rows",
        "osft(..., lr_scheduler_kwargs={'power': 2.0}) with backend='minitrainer': only min_lr_rate (our "
        "min_lr_ratio) is taken; name the schedule's shape with lr_scheduler",
        "osft(..., checkpoint_storage='s3://bucket/run') with backend='minitrainer': checkpoints are written to "
        "ckpt_output_dir only; copy it to remote storage yourself"])
    assert all("\n" not in line for line in t.refusals)
    lora = translate("lora_sft", {"model_path": "m", "data_path": "d", "ckpt_output_dir": "o", "micro_batch_size": 4,
                                  "effective_batch_size": 32, "load_in_8bit": True, "use_dora": True})
    assert [line.split(": ", 1)[0] for line in sorted(lora.refusals)] == [
        "lora_sft(..., load_in_8bit=True) with backend='minitrainer'",
        "lora_sft(..., micro_batch_size=4) with backend='minitrainer'",
        "lora_sft(..., use_dora=True) with backend='minitrainer'"]


def test_our_own_field_names_pass_as_themselves_and_pretraining_reads_documents():
    t = translate("osft", {**OSFT_REQUIRED, "max_steps": 7, "osft_upcast_dtype": "float64", "is_pretraining": True,
                           "block_size": 512, "document_column_name": "body", "save_steps": None})
    assert t.refusals == []
    assert (t.train["max_steps"], t.train["osft_upcast_dtype"]) == (7, "float64")
    assert (t.train["input_format"], t.train["columns"], t.train["max_sample_num_tokens"], t.train["split_long_text"]) \
        == ("text", "text=body", 512, True)


HUB_PARAMETERS = """
import json
from training_hub import AlgorithmRegistry
from training_hub.algorithms.peft_extender import LoRAPEFTExtender
names = {}
for algorithm in ("sft", "osft", "lora_sft"):
    cls = AlgorithmRegistry.get_algorithm(algorithm)
    instance = cls.__new__(cls)
    instance.peft_extender = LoRAPEFTExtender()
    names[algorithm] = sorted({*instance.get_required_params(), *instance.get_optional_params()})
# What the algorithms add on their way to the backend: the LoRA extender's markers and JIT's switch.
added = LoRAPEFTExtender().apply_peft_config({})
names["lora_sft"] = sorted({*names["lora_sft"], *added})
print(json.dumps(names))
"""


@pytest.fixture(scope="module")
def hub_parameter_names(tmp_path_factory) -> dict[str, list[str]]:
    result = run_in_hub_venv(HUB_PARAMETERS, cwd=tmp_path_factory.mktemp("hub_parameters"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_every_parameter_of_the_hubs_three_algorithms_is_mapped_or_refused(hub_parameter_names):
    assert set(hub_parameter_names) == {"sft", "osft", "lora_sft"}
    for algorithm, names in hub_parameter_names.items():
        assert len(names) > 25, names
        assert sorted(set(names) - set(RULES)) == [], f"{algorithm}: parameters the table does not know"


E2E = """
import json, sys
import minitrainer.integrations.training_hub  # noqa: F401
from minitrainer.integrations.training_hub import ParameterRefused
from training_hub import TrainingHubCallback, lora_sft, osft, sft

class Seen(TrainingHubCallback):
    calls = []
    def on_train_begin(self, c): self.calls.append(["on_train_begin", c.step])
    def on_epoch_begin(self, c): self.calls.append(["on_epoch_begin", c.step])
    def on_step_end(self, c): self.calls.append(["on_step_end", c.step, c.loss, c.learning_rate])
    def on_log(self, c): self.calls.append(["on_log", c.step])
    def on_evaluate(self, c): self.calls.append(["on_evaluate", c.step, c.metrics["val_loss"]])
    def on_save(self, c): self.calls.append(["on_save", c.step, c.metrics["checkpoint_path"]])
    def on_epoch_end(self, c): self.calls.append(["on_epoch_end", c.step])
    def on_train_end(self, c): self.calls.append(["on_train_end", c.step])

class Broken(TrainingHubCallback):
    def on_step_end(self, c): raise ValueError("the user's bug")

model, data = sys.argv[1], sys.argv[2]
common = dict(model_path=model, data_path=data, nproc_per_node=2, backend="minitrainer", max_seq_len=512,
              max_tokens_per_gpu=2048, effective_batch_size=16, max_steps=4)
try:
    osft(ckpt_output_dir="typo", unfreeze_rank_ratio=0.5, learning_rate=1e-4, warmup_step=3, **common)
except ParameterRefused as err:
    print("REFUSED", json.dumps(str(err)))
for name, call, extra in [
        ("osft", osft, dict(unfreeze_rank_ratio=0.5, learning_rate=1e-4, beta1=0.8, beta2=0.99, eps=1e-6,
                            weight_decay=0.01, callbacks=[Broken(), Seen()])),
        ("sft", sft, dict(learning_rate=1e-4, save_samples=32, callbacks=[Seen()])),
        ("lora_sft", lora_sft, dict(learning_rate=1e-3, lora_r=4, lora_alpha=8, eval_data_path=data, eval_steps=2,
                                    enable_jit_checkpoint=True, callbacks=[Seen()]))]:
    Seen.calls = []
    result = call(ckpt_output_dir="out_" + name, **extra, **common)
    print("RESULT", json.dumps({"name": name, "last_checkpoint": str(result.last_checkpoint),
                                "metrics": str(result.metrics_path), "calls": Seen.calls}))
"""


@pytest.fixture(scope="module")
def hub_runs(tmp_path_factory, tiny_models):
    """The three algorithms through the hub's own functions, 4 steps each, from one notebook-like script."""
    cwd = tmp_path_factory.mktemp("hub_runs")
    result = run_in_hub_venv(E2E, str(tiny_models["chatml"]), str(DEMO_DATA), cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    runs = {r["name"]: r for r in (json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
                                   if line.startswith("RESULT "))}
    refused = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("REFUSED")]
    return cwd, runs, refused, result.stdout + result.stderr


def test_a_typo_is_refused_before_anything_starts(hub_runs):
    cwd, _, refused, _ = hub_runs
    assert refused == ["osft(..., warmup_step=3) with backend='minitrainer': not a parameter this backend knows "
                       "(did you mean warmup_steps?)"]
    assert not (cwd / "typo").exists()


@pytest.mark.parametrize("name", ["osft", "sft", "lora_sft"])
def test_each_algorithm_trains_exports_and_its_callbacks_see_every_step(hub_runs, name):
    cwd, runs, _, output = hub_runs
    run = runs[name]
    metrics = [json.loads(line) for line in (cwd / run["metrics"]).read_text().splitlines()]
    steps = [m for m in metrics if "val_loss" not in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    calls = run["calls"]
    assert [c for c in calls if c[0] == "on_step_end"] == [["on_step_end", m["step"], m["loss"], m["lr"]]
                                                           for m in steps]
    assert [c[1] for c in calls if c[0] == "on_log"] == [1, 2, 3, 4]
    assert calls[0] == ["on_train_begin", 0] and calls[1] == ["on_epoch_begin", 1]
    assert calls[-2:] == [["on_epoch_end", 4], ["on_train_end", 4]]
    saves = [Path(c[2]).name for c in calls if c[0] == "on_save"]
    assert saves[-1] == Path(run["last_checkpoint"]).name == f"samples_{steps[-1]['samples_seen']}"
    export = cwd / run["last_checkpoint"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(export)
    params = json.loads((cwd / f"out_{name}" / "training_params.json").read_text())
    if name == "osft":
        assert (params["adam_betas"], params["adam_eps"], params["weight_decay"]) == ([0.8, 0.99], 1e-6, 0.01)
        assert params["osft"] is True and params["lr_scheduler"] == "cosine"
        said = [line[line.index("training_hub callback Broken"):] for line in output.splitlines()
                if "training_hub callback Broken" in line]
        assert said == [  # said once, then counted: one end line, however many steps it failed
            "training_hub callback Broken.on_step_end failed at step 1 (ValueError: the user's bug); training goes on "
            "(its further failures are counted, said at the end)",
            "training_hub callback Broken.on_step_end failed on 4 of 4 calls (first at step 1: ValueError: the "
            "user's bug)"]
    if name == "sft":
        assert saves == ["samples_32", "samples_64"]  # save_samples=32
    if name == "lora_sft":
        from peft import AutoPeftModelForCausalLM

        AutoPeftModelForCausalLM.from_pretrained(export / "adapter")
        assert [c[1] for c in calls if c[0] == "on_evaluate"] == [2, 4]
        assert params["lora_rank"] == 4 and params["adam_betas"] == [0.9, 0.999]


def test_the_docs_table_names_every_parameter_and_only_one_module_imports_training_hub():
    page = (ROOT / "docs" / "training-hub.md").read_text()
    assert sorted(name for name in RULES if f"`{name}`" not in page) == []
    importers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "minitrainer").rglob("*.py")
                       if "from training_hub" in path.read_text() or "import training_hub" in path.read_text())
    assert importers == ["minitrainer/integrations/training_hub.py"]
