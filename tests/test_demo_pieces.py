"""The demo's pieces at test size: Python API launch, plots, SLURM script, demo data, inspect_data.

    .venv/bin/python -m pytest -q tests/test_demo_pieces.py

``run_training`` starts a real 2-process CPU torchrun of the tiny model for 2
steps; its output feeds the plot, checkpoint-reload and generation tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures.e2e import ROOT, read_metrics, write_tokenized_jsonl
from minitrainer.tools.demo import DEMO_DATA

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------
# api.run_training: a real torchrun launch


@pytest.fixture(scope="module")
def api_run(tmp_path_factory, chatml_model) -> Path:
    from transformers import AutoConfig

    from minitrainer.api import TorchrunArgs, TrainConfig, run_training

    root = tmp_path_factory.mktemp("api_run")
    vocab = AutoConfig.from_pretrained(chatml_model).vocab_size
    data = write_tokenized_jsonl(root / "data.jsonl", num_samples=24, vocab_size=vocab, seed=3)
    out = root / "out"
    config = TrainConfig(output_dir=str(out), data_path=str(data), model_name_or_path=str(chatml_model),
                         min_samples_per_checkpoint=1000, batch_size=8, max_tokens_per_gpu=64, max_steps=2,
                         learning_rate=1e-3, num_warmup_steps=0, num_data_workers=0)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("CUDA_VISIBLE_DEVICES", "")
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        run_training(TorchrunArgs(nproc_per_node=2), config)
    return out


def test_run_training_launches_a_real_two_process_run(api_run):
    records = read_metrics(api_run)
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    params = json.loads((api_run / "training_params.json").read_text())
    assert params["world_size"] == 2 and params["max_steps"] == 2 and params["batch_size"] == 8


def test_run_training_raises_when_torchrun_fails(tmp_path, monkeypatch):
    from minitrainer import api

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    config = api.TrainConfig(output_dir=str(tmp_path / "out"), min_samples_per_checkpoint=10,
                             model_name_or_path=str(tmp_path / "no-such-model"), data_path=str(tmp_path / "data"))
    with pytest.raises(subprocess.CalledProcessError) as failed:
        api.run_training(api.TorchrunArgs(nproc_per_node=1), config)
    # The run's own line, not the command line: what a notebook shows.
    assert isinstance(failed.value, api.RunFailed) and failed.value.status == "failed"
    assert str(failed.value) == f"training failed: --data-path {tmp_path / 'data'}: no such file or folder"


def test_reloaded_checkpoint_generates(api_run):
    from minitrainer.tools.demo import generate_reply, latest_checkpoint

    checkpoint = latest_checkpoint(api_run)
    assert checkpoint.name == "samples_16"
    reply = generate_reply(checkpoint, "Hello there", max_new_tokens=8, seed=0)
    assert isinstance(reply, str)


def test_latest_checkpoint_is_numeric_not_lexicographic(tmp_path):
    from minitrainer.tools.demo import latest_checkpoint

    for n in (9, 10, 100):
        (tmp_path / "hf_format" / f"samples_{n}").mkdir(parents=True)
    assert latest_checkpoint(tmp_path).name == "samples_100"
    with pytest.raises(ValueError, match="no checkpoint"):
        latest_checkpoint(tmp_path / "empty")


# ----------------------------------------------------------------------------
# plot_metrics


def test_plots_are_valid_pngs(api_run, tmp_path):
    import matplotlib.image

    from minitrainer.tools.plot_metrics import plot_metrics

    paths = plot_metrics(api_run, out_dir=tmp_path)
    assert sorted(p.name for p in paths) == ["loss.png", "metrics_by_samples.png", "metrics_by_step.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        height, width, channels = matplotlib.image.imread(path).shape
        assert height >= 400 and width >= 600 and channels in (3, 4)


def test_plot_cli_and_errors(api_run, tmp_path, monkeypatch, capsys):
    from minitrainer.tools import plot_metrics

    plot_metrics.main([str(api_run), "--out-dir", str(tmp_path / "cli")])
    assert len(capsys.readouterr().out.split()) == 3
    with pytest.raises(SystemExit, match="no training_metrics"):
        plot_metrics.main([str(tmp_path)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_metrics.plot_metrics(api_run)


def _write_lines(run: Path, lines: list[dict]) -> Path:
    run.mkdir()
    (run / "training_metrics_0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def _preference_lines() -> list[dict]:
    """A DPO run's metrics lines (the fields objectives/pairs.py writes), validations after steps 2 and 4."""
    lines = []
    for step in range(1, 5):
        lines.append({"step": step, "loss": 0.69 - 0.05 * step, "lr": 1e-3, "samples_seen": 16 * step,
                      "num_samples": 16, "num_pairs": 16, "rewards/chosen": 0.1 * step,
                      "rewards/rejected": -0.05 * step, "rewards/accuracies": 0.25 * step,
                      "rewards/margins": 0.15 * step, "tokens_per_second": 100.0})
        if step % 2 == 0:
            lines.append({"step": step, "val_loss": 0.7 - 0.04 * step, "val_num_samples": 8, "samples_seen": 16 * step,
                          "val_rewards/chosen": 0.08 * step, "val_rewards/rejected": -0.02 * step,
                          "val_rewards/accuracies": 0.2 * step, "val_rewards/margins": 0.1 * step})
    return lines


def test_a_preference_run_plots_its_loss_over_pairs_and_its_reward_panels(tmp_path):
    import matplotlib.pyplot as plt

    from minitrainer.tools.plot_metrics import figures, plot_metrics

    run = _write_lines(tmp_path / "dpo", _preference_lines())
    drawn = figures(run)
    try:
        assert list(drawn) == ["loss.png", "metrics_by_step.png", "metrics_by_samples.png", "rewards.png"]
        loss_ax = drawn["loss.png"].axes[0]
        assert loss_ax.get_ylabel() == "loss (mean over pairs)"
        assert [line.get_label() for line in loss_ax.lines] == ["loss", "smoothed (EMA 0.6)", "validation loss"]
        assert [ax.get_xlabel() for ax in loss_ax.child_axes] == ["pairs seen"]  # the top axis
        assert drawn["metrics_by_step.png"].axes[0].get_title() == "loss (mean over pairs)"
        assert drawn["metrics_by_samples.png"].axes[0].get_xlabel() == "pairs seen"
        rewards, accuracy, margin = drawn["rewards.png"].axes
        assert [ax.get_title() for ax in (rewards, accuracy, margin)] == [
            "rewards of the chosen and rejected sides (mean over pairs)",
            "reward accuracy (share of pairs with chosen > rejected)",
            "reward margin (chosen - rejected, mean over pairs)"]
        assert [line.get_label() for line in rewards.lines] == [
            "rewards/chosen", "val_rewards/chosen", "rewards/rejected", "val_rewards/rejected"]
        assert [line.get_label() for line in accuracy.lines] == ["rewards/accuracies", "val_rewards/accuracies"]
        assert list(accuracy.lines[0].get_ydata()) == [0.25, 0.5, 0.75, 1.0]
        val_steps, val_accuracies = accuracy.lines[1].get_data()
        assert list(val_steps) == [2, 4] and list(val_accuracies) == pytest.approx([0.4, 0.8])
        assert list(margin.lines[1].get_ydata()) == pytest.approx([0.2, 0.4])
    finally:
        for fig in drawn.values():
            plt.close(fig)
    paths = plot_metrics(run, out_dir=tmp_path / "plots")
    assert [p.name for p in paths] == ["loss.png", "metrics_by_step.png", "metrics_by_samples.png", "rewards.png"]
    assert all(p.read_bytes()[:8] == PNG_SIGNATURE for p in paths)


def test_a_reward_model_run_plots_its_extreme_scores_accuracy_and_margin(tmp_path):
    """A reward model's lines (objectives/reward.py, TRL's RewardTrainer names): a mean over pairs, the batch's
    highest and lowest scores, the accuracy and the margin, validation passes as points."""
    import matplotlib.pyplot as plt

    from minitrainer.tools.plot_metrics import figures

    lines = [{"step": s, "loss": 0.69 - 0.05 * s, "samples_seen": 8 * s, "num_samples": 8, "num_pairs": 8,
              "accuracy": 0.2 * s, "margin": 0.1 * s, "mean_reward": 0.0, "min_reward": -s, "max_reward": s}
             for s in range(1, 4)]
    lines.append({"step": 3, "val_loss": 0.5, "val_num_samples": 4, "samples_seen": 24, "val_accuracy": 0.75,
                  "val_margin": 0.4, "val_min_reward": -2.5, "val_max_reward": 2.5})
    drawn = figures(_write_lines(tmp_path / "reward", lines))
    try:
        assert drawn["loss.png"].axes[0].get_ylabel() == "loss (mean over pairs)"
        extremes, accuracy, margin = drawn["rewards.png"].axes
        assert drawn["rewards.png"].texts[0].get_text().endswith("reward model scores by step")
        assert [line.get_label() for line in extremes.lines] == ["max_reward", "val_max_reward", "min_reward",
                                                                 "val_min_reward"]
        assert [line.get_label() for line in accuracy.lines] == ["accuracy", "val_accuracy"]
        assert list(accuracy.lines[0].get_ydata()) == pytest.approx([0.2, 0.4, 0.6])
        assert list(margin.lines[1].get_ydata()) == [0.4]
    finally:
        for fig in drawn.values():
            plt.close(fig)


def test_a_kto_run_plots_its_loss_over_examples_and_its_baseline(tmp_path):
    """KTO's lines (objectives/kto.py): a mean over examples, the two labels' rewards, the KL baseline; a step
    without undesirable rows has no such fields (as TRL logs it), a gap in their line."""
    import matplotlib.pyplot as plt

    from minitrainer.tools.plot_metrics import figures

    lines = [{"step": s, "loss": 0.5 - 0.02 * s, "samples_seen": 8 * s, "num_samples": 8, "num_examples": 8,
              "kl": 0.1 * (s - 1), "rewards/chosen": 0.2 * s,
              **({"rewards/rejected": -0.1 * s, "rewards/margins": 0.3 * s} if s != 2 else {})}
             for s in range(1, 4)]
    lines.append({"step": 3, "val_loss": 0.45, "val_num_samples": 4, "samples_seen": 24, "val_kl": 0.15})
    drawn = figures(_write_lines(tmp_path / "kto", lines))
    try:
        assert list(drawn) == ["loss.png", "metrics_by_step.png", "metrics_by_samples.png", "rewards.png"]
        assert drawn["loss.png"].axes[0].get_ylabel() == "loss (mean over examples)"
        assert [ax.get_xlabel() for ax in drawn["loss.png"].axes[0].child_axes] == ["examples seen"]
        rewards, kl, margin = drawn["rewards.png"].axes
        assert kl.get_title() == "KL baseline (the batch's mismatched rows, at least 0)"
        assert [line.get_label() for line in kl.lines] == ["kl", "val_kl"]
        assert list(kl.lines[0].get_ydata()) == pytest.approx([0.0, 0.1, 0.2])
        rejected = [line for line in rewards.lines if line.get_label() == "rewards/rejected"][0]
        assert np.isnan(rejected.get_ydata()[1])
    finally:
        for fig in drawn.values():
            plt.close(fig)


def test_an_sft_run_plots_its_per_token_loss_and_no_reward_panels(tmp_path):
    import matplotlib.pyplot as plt

    from minitrainer.tools.plot_metrics import figures

    lines = [{"step": s, "loss": 3 - 0.1 * s, "lr": 1e-5, "samples_seen": 8 * s, "num_samples": 8}
             for s in range(1, 4)]
    drawn = figures(_write_lines(tmp_path / "sft", lines))
    assert list(drawn) == ["loss.png", "metrics_by_step.png", "metrics_by_samples.png"]
    assert drawn["loss.png"].axes[0].get_ylabel() == "loss (per-token mean)"
    assert [ax.get_xlabel() for ax in drawn["loss.png"].axes[0].child_axes] == ["samples seen"]
    assert drawn["metrics_by_step.png"].axes[0].get_title() == "loss (per-token mean)"
    assert drawn["metrics_by_samples.png"].axes[0].get_xlabel() == "samples seen"
    for fig in drawn.values():
        plt.close(fig)


def test_a_preference_run_without_reward_fields_still_plots(tmp_path):
    """Nulls (a skipped step's non-finite values) and missing fields are n/a panels, never an error."""
    from minitrainer.tools.plot_metrics import plot_metrics

    lines = [{"step": s, "loss": None if s == 1 else 0.6, "num_pairs": 16, "samples_seen": 16 * s,
              "rewards/accuracies": None} for s in (1, 2)]
    paths = plot_metrics(_write_lines(tmp_path / "nulls", lines), out_dir=tmp_path / "plots")
    assert [p.name for p in paths][-1] == "rewards.png"


def test_smoothing_is_a_bias_corrected_ema():
    from minitrainer.tools.plot_metrics import smooth

    values = np.array([4.0, 2.0, np.nan, 1.0])
    out = smooth(values, 0.5)
    assert out[0] == 4.0  # bias correction: the first point is not pulled towards 0
    assert out[1] == pytest.approx((0.25 * 4 + 0.5 * 2) / 0.75)
    assert out[2] == out[1]  # a missing value holds the average
    np.testing.assert_allclose(smooth(np.ones(5), 0.9), np.ones(5))


# ----------------------------------------------------------------------------
# api: flags from the config dataclass


def _non_default_config():
    from minitrainer.train import TrainConfig

    return TrainConfig(output_dir="/tmp/o", min_samples_per_checkpoint=7, model_name_or_path="m",
                       data_path="d", batch_size=3, max_tokens_per_gpu=99, learning_rate=1.2345678901234e-5,
                       num_warmup_steps=0, lr_scheduler="cosine", seed=5, use_liger_kernels=True,
                       logging_level="debug", max_steps=11, max_samples=1000, num_epochs=1.5,
                       fsdp_sharding_strategy="HYBRID_SHARD", cpu_offload=True, attn_implementation="eager",
                       weight_decay=0.1, adam_betas=(0.8, 0.999), max_grad_norm=0.0,
                       activation_checkpointing=False, balance="attention", num_data_workers=0)


@pytest.mark.parametrize("which", ["defaults", "non_defaults"])
def test_config_flags_round_trip_through_train_parser(which):
    from minitrainer.api import config_to_argv
    from minitrainer.train import TrainConfig
    from minitrainer.common.cli import build_arg_parser, parse_config

    config = TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1) if which == "defaults" \
        else _non_default_config()
    argv = config_to_argv(config)
    assert parse_config(TrainConfig, argv) == config
    namespace = vars(build_arg_parser(TrainConfig).parse_args(argv))
    for field in dataclasses.fields(TrainConfig):
        value = getattr(config, field.name)
        assert namespace[field.name] == (list(value) if isinstance(value, tuple) else value), field.name


def test_config_to_argv_spells_bools_tuples_and_none():
    from minitrainer.api import config_to_argv
    from minitrainer.train import TrainConfig

    argv = config_to_argv(TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1, adam_betas=(0.5, 0.6),
                                      cpu_offload=False, use_liger_kernels=True))
    assert "--no-cpu-offload" in argv and "--use-liger-kernels" in argv
    i = argv.index("--adam-betas")
    assert argv[i + 1: i + 3] == ["0.5", "0.6"]
    assert "--max-steps" not in argv  # None is omitted


def test_torchrun_args_parse_with_torchruns_own_parser():
    from torch.distributed.run import get_args_parser

    from minitrainer.api import TorchrunArgs, torchrun_command
    from minitrainer.train import TrainConfig

    parser = get_args_parser()
    single = parser.parse_args([*TorchrunArgs(nproc_per_node=4).to_argv(), "train.py"])
    assert single.standalone and single.nproc_per_node == "4"
    multi = parser.parse_args([*TorchrunArgs(nnodes=2, nproc_per_node=8, rdzv_endpoint="node1:29400",
                                             rdzv_id="job7").to_argv(), "train.py"])
    assert (multi.nnodes, multi.rdzv_backend, multi.rdzv_endpoint, multi.rdzv_id) == ("2", "c10d", "node1:29400",
                                                                                       "job7")
    static = parser.parse_args([*TorchrunArgs(nnodes=2, node_rank=1, master_addr="10.0.0.1").to_argv(), "x.py"])
    assert (static.node_rank, static.master_addr, static.master_port) == (1, "10.0.0.1", 29500)
    command = torchrun_command(TorchrunArgs(), TrainConfig(model_name_or_path="m", data_path="d", output_dir="o", min_samples_per_checkpoint=1))
    assert command[:3] == [sys.executable, "-m", "minitrainer.run"] and command[6] == "--"


@pytest.mark.parametrize("kwargs, match", [
    ({"nnodes": 2}, "rdzv_endpoint or master_addr"),
    ({"nnodes": 2, "rdzv_endpoint": "a:1", "master_addr": "b"}, "not both"),
    ({"nnodes": 2, "master_addr": "b"}, "node_rank"),
    ({"nproc_per_node": 0}, ">= 1"),
])
def test_torchrun_args_validation(kwargs, match):
    from minitrainer.api import TorchrunArgs

    with pytest.raises(ValueError, match=match):
        TorchrunArgs(**kwargs)


def test_api_reexports_process_data():
    from minitrainer import api
    from minitrainer.data import process_data

    assert api.process_data is process_data.process_data and api.ProcessDataConfig is process_data.ProcessDataConfig


# ----------------------------------------------------------------------------
# slurm_multi_node.sbatch


def test_sbatch_script_parses_and_builds_torchrun_from_slurm():
    script = ROOT / "slurm_multi_node.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --signal=B:USR1@" in text and "trap on_usr1 USR1" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    launch = text[text.index("srun "):text.index("SRUN_PID=$!")]
    for piece in ('--nnodes="$SLURM_JOB_NUM_NODES"', '--nproc-per-node="$GPUS_PER_NODE"', "--rdzv-backend=c10d",
                  '--rdzv-endpoint="$HEAD_NODE:$RDZV_PORT"', '--rdzv-id="$SLURM_JOB_ID"',
                  "--min-samples-per-checkpoint", "--ntasks-per-node=1", '--output-dir "$OUTPUT_DIR"'):
        assert piece in launch, piece
    assert "NCCL_TIMEOUT_MINUTES" in text


def test_sbatch_train_flags_exist_in_train_parser():
    from minitrainer.train import TrainConfig
    from minitrainer.common.cli import build_arg_parser

    text = (ROOT / "slurm_multi_node.sbatch").read_text()
    # The training flags: after the launcher's own "--".
    launch = text[text.index("    -- \\\n") + len("    --"):text.index("SRUN_PID=$!")]
    flags = {token for token in launch.split() if token.startswith("--")}
    assert "--min-samples-per-checkpoint" in flags
    known = set(build_arg_parser(TrainConfig)._option_string_actions)
    assert flags <= known, flags - known


# ----------------------------------------------------------------------------
# The shipped demo dataset


def _demo_rows() -> list[dict]:
    return [json.loads(line) for line in DEMO_DATA.read_text().splitlines()]


def test_demo_dataset_is_valid_and_varied():
    from minitrainer.data.chat_masking import parse_row

    path = DEMO_DATA
    assert path.stat().st_size < 1_000_000
    lines = path.read_bytes().splitlines()
    for line in lines:
        messages, extra = parse_row(line)  # raises SampleError on any malformed row
        assert messages and "id" in extra
    rows = _demo_rows()
    assert len({r["id"] for r in rows}) == len(rows)
    chats = [r for r in rows if r["messages"][0]["role"] != "pretrain"]
    pretrain = [r for r in rows if r["messages"][0]["role"] == "pretrain"]
    assert len(chats) >= 300 and len(pretrain) >= 30
    assert sum(r["messages"][0]["role"] == "system" for r in chats) >= 50
    multi_turn = [r for r in chats if sum(m["role"] == "assistant" for m in r["messages"]) >= 2]
    assert len(multi_turn) >= len(chats) // 2
    assert len({r["messages"][-1]["content"] for r in chats}) >= 100


def test_demo_dataset_is_the_generator_output():
    from minitrainer.tools.make_demo_data import build_rows

    assert build_rows(0, num_conversations=360) == _demo_rows()


def test_demo_dataset_tokenizes_without_rejections(tmp_path):
    from minitrainer.tools.demo import DemoConfig, build_demo_model
    from minitrainer.data.process_data import ProcessDataConfig, process_data

    model = build_demo_model(tmp_path / "model", DemoConfig(vocab_size=512, hidden_size=32, num_layers=1))
    summary = process_data(ProcessDataConfig(input_file=str(DEMO_DATA),
                                             output_dir=str(tmp_path / "data"), model_name_or_path=str(model),
                                             num_proc=1, num_printed_samples=0))
    assert summary["num_rejected"] == 0 and summary["num_written"] == len(_demo_rows())
    assert 0 < summary["num_loss_counted_tokens"] < summary["num_tokens"]


# ----------------------------------------------------------------------------
# inspect_data


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_inspect_data_reports_the_trainers_plan(tmp_path, capsys, world_size):
    from minitrainer.tools.inspect_data import main

    data = write_tokenized_jsonl(tmp_path / "d.jsonl", num_samples=30, vocab_size=100, seed=2, max_len=48)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    lengths = np.array([r["len"] for r in rows])
    budget, batch = 40, 8
    report = main(["--data-path", str(data), "--batch-size", str(batch), "--max-tokens-per-gpu", str(budget),
                   "--world-size", str(world_size), "--num-steps", "4"])
    out = capsys.readouterr().out
    assert "length histogram" in out and "packing plan" in out
    assert report["num_over_budget"] == int((lengths > budget).sum())
    assert sum(count for _, _, count in report["histogram"]) == len(rows)
    loss_tokens = sum(sum(label != -100 for label in r["labels"][1:]) for r in rows)
    assert report["loss_token_share"] == pytest.approx(loss_tokens / lengths.sum())
    for step in report["steps"]:
        assert step.num_samples + step.num_dropped == batch
        assert step.max_rank_tokens <= budget
        assert step.num_minibatches >= math.ceil(step.num_tokens / (world_size * budget))
        assert 0 < step.utilization <= 1 and 0 < step.balance <= 1
