"""`make gpu-check DEVICE=cpu`: the GPU acceptance check's CPU rehearsal, end to end, plus its failure handling.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py        # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from fixtures.e2e import ROOT


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_check") / "report folder"  # a space: the Makefile must quote nothing away
    result = subprocess.run(["make", "-s", "gpu-check", "DEVICE=cpu", f"GPU_CHECK_DIR={out}",
                             f"GPU_CHECK_PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_rehearsal_writes_exactly_the_report_files(rehearsal):
    # The device tool brings back at most 8 files: models and data stay in a temporary folder.
    assert sorted(p.name for p in rehearsal.iterdir()) == ["log.txt", "report.json", "report.md"]


def test_every_sub_check_ran_and_passed_on_cpu(rehearsal):
    report = json.loads((rehearsal / "report.json").read_text())
    assert report["device_kind"] == "cpu"
    checks = report["checks"]
    assert list(checks) == [name for name, _ in gpu_check.CHECKS]
    assert {name: c["status"] for name, c in checks.items()} == {name: "ok" for name in checks}
    assert all(c["commands"] for c in checks.values()), "every figure comes with its command"
    assert report["total_seconds"] < report["time_budget_s"]

    env = checks["environment"]["figures"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["driver"] is None
    assert set(env["optional_wheels"]) == {"liger-kernel", "peft", "flash-attn"}
    assert env["missing_required"] == []
    assert checks["matmul_peak"]["figures"]["bf16_matmul_tflops"] > 0

    for name in gpu_check.EXACT_ARCHS:
        exact = checks["exactness"]["figures"][name]
        assert exact["ok"] and exact["dtype"] == "float32" and exact["rtol"] == 1e-4
        assert exact["grad_accum"] >= 2, "the step must span several minibatches"
        assert exact["relative_difference"] <= 1e-4

    tests = checks["gpu_tests"]["figures"]
    assert tests["num_skipped"] >= 1 and "num_failed" not in tests and "num_passed" not in tests

    for name, budget in (("bench_16k", 256), ("bench_32k", 512)):
        figures = checks[name]["figures"]
        assert figures["budget"] == budget and figures["bf16_matmul_tflops"] is None
        rows = {(r["layout"], r["liger"], r["activation_checkpointing"]): r for r in figures["results"]}
        assert set(rows) == {("packed", False, True), ("padded", False, True)}
        assert all(r["status"] == "ok" and r["tokens_per_second_per_gpu"] > 0 and r["mfu"] is None
                   for r in rows.values())

    levers = checks["levers"]["figures"]
    rows = levers["rows"]
    reference_setting = tuple(levers["reference"].values())
    large, small = sorted(gpu_check.CPU_SIZES.budgets, reverse=True)
    large_rows = [r for r in rows if r["budget"] == large]
    assert [gpu_check._setting(r) for r in large_rows] == gpu_check.settings_order(reference_setting)
    assert [gpu_check._setting(r) for r in rows if r["budget"] == small] == gpu_check.settings_order(
        reference_setting, large_rows)
    assert [r["budget"] for r in rows] == [large] * len(large_rows) + [small] * (len(rows) - len(large_rows))
    reference = rows[0]  # train.py's defaults at the largest budget: always run first
    assert reference["status"] == "ok" and reference["exact"] and reference["speedup_vs_defaults"] == 1.0
    assert reference["tokens_per_second_per_gpu"] > 0 and reference["mfu_of_measured_peak"] is None
    assert reference["loss_tokens_per_second_per_gpu"] > 0 and reference["model_flops_per_token"] > 0
    out_of_time = False
    for row in rows:
        if row["use_liger_kernels"]:
            assert row["status"] == "not measured: no GPU"
        elif row["status"] == "ok":
            assert not out_of_time, "a run started after one was left out for time"
            assert row["exact"], "fp32 on CPU: every policy and compile keep step 1's loss within 1e-4"
        else:
            assert row["status"] in ("not run: out of time", "not finished: out of time"), row
            out_of_time = True
    assert levers["fastest_exact"][str(max(gpu_check.CPU_SIZES.budgets))].endswith(
        "(CPU rehearsal: not a recommendation)")
    assert report["summary"]["fastest_exact_setting"]["value"].startswith("at 512: --no-use-liger-kernels")

    lora = checks["lora"]["figures"]
    assert lora["full"]["status"] == "ok" and lora["lora_r16"]["status"] == "ok"
    assert lora["lora_r16"]["step_1_loss_equal_full"], "adapters start at B = 0: step 1 is the base model's"
    assert lora["qlora_r16"]["status"] in ("ok", "not installed: torchao")
    assert lora["full"]["peak_memory_gb"] > 0 and lora["lora_r16"]["tokens_per_second_per_gpu"] > 0

    osft = checks["osft"]["figures"]
    assert osft["full"]["status"] == "ok" and osft["osft_0.25"]["status"] == "ok"
    assert osft["osft_0.25"]["step_time_vs_full"] > 0 and osft["osft_0.25"]["peak_memory_vs_full"] > 0
    assert osft["osft_0.25"]["step_1_loss_relative_difference"] <= 1e-4, "fp32 on CPU: the factors reproduce W"
    assert any("matrices decomposed" in line for line in osft["osft_0.25"]["log_lines"]), "the start-up's figures"
    assert report["summary"]["osft_step_time_vs_full"]["value"] == osft["osft_0.25"]["step_time_vs_full"]

    optimizers = checks["optimizers"]["figures"]
    rows = {row["optimizer"]: row for row in optimizers["rows"]}
    assert list(rows) == list(gpu_check.CPU_SIZES.optimizers) == ["adamw", "muon"]
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert row["args"][:2] == ["--optimizer", name], "each run names its optimizer"
        assert row["time_per_batch"] > 0 and row["tokens_per_second_per_gpu"] > 0 and row["peak_memory_gb"] > 0
        assert math.isfinite(row["final_loss"])
        assert row["step_time_vs_adamw"] > 0 and row["peak_memory_vs_adamw"] > 0
        assert row["step_1_loss_equal_adamw"], "step 1 comes before any update: every optimizer's is adamw's"
    assert rows["adamw"]["step_time_vs_adamw"] == 1.0 and rows["adamw"]["peak_memory_vs_adamw"] == 1.0
    assert "--optimizer-args" in rows["muon"]["args"], "the bench's settings reach train.py"
    long_context = checks["long_context"]["figures"]
    rows = {row["length"]: row for row in long_context["rows"]}
    assert set(rows) == set(gpu_check.CPU_SIZES.long_context_lengths)
    assert all(r["status"] == "ok" and r["context_parallel_size"] == 1 and r["tokens_per_second_per_gpu"] > 0
               and r["mfu"] is None for r in rows.values())
    assert long_context["longest_single_sample"] is None and "CUDA only" in long_context["note"]

    found = checks["bench_16k"]["figures"]["max_tokens_per_gpu"]
    assert found["liger_off"] is None and found["liger_on"] is None  # the search runs on CUDA only
    assert set(report["summary"]) >= {"mfu_32k_liger", "packed_over_padded", "max_tokens_liger_ac"}
    assert report["summary"]["mfu_32k_liger"]["value"] is None
    assert report["summary"]["packed_over_padded"]["value"] > 0


def test_report_md_names_device_checks_and_commands(rehearsal):
    text = (rehearsal / "report.md").read_text()
    assert text.startswith("# gpu-check report (cpu)")
    for name, _ in gpu_check.CHECKS:
        assert f"### {name}: ok" in text
    for command in ("python train.py", "python -m bench.bench_train", "python -m pytest -q -m gpu"):
        assert command in text
    assert f"| torch | {torch.__version__} |" in text
    assert "## Targets" in text
    assert "| use_liger_kernels | compile | activation_checkpointing | tok/s/GPU |" in text
    assert "- Fastest exact at 512: --no-use-liger-kernels" in text
    assert "| optimizer | lr | optimizer args | s/step | tok/s/GPU | peak GB |" in text
    assert "| muon | 0.001 | `{\"adjust_lr_fn\": \"match_rms_adamw\"}` |" in text


def test_the_gpu_run_benches_every_registered_optimizer_at_the_cpu_benchs_settings():
    from bench.bench_optimizers import SETTINGS
    from minitrainer.optim.registry import OPTIMIZERS

    assert gpu_check.GPU_SIZES.optimizers == tuple(OPTIMIZERS), "a new --optimizer joins the GPU run"
    assert gpu_check.GPU_SIZES.optimizers[0] == gpu_check.CPU_SIZES.optimizers[0] == "adamw", "the ratios' reference"
    assert set(SETTINGS) == set(OPTIMIZERS), "each optimizer has its own learning rate in the bench's table"
    assert {"optimizers"} <= set(gpu_check.GPU_SIZES.limits_s) & set(gpu_check.CPU_SIZES.limits_s)


def test_a_failing_or_slow_sub_check_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    def fails(runner, deadline):
        runner.run([sys.executable, "-c", "raise SystemExit('broken on purpose')"], deadline=deadline)

    def hangs(runner, deadline):
        runner.run([sys.executable, "-c", "import time; time.sleep(60)"], deadline=min(deadline, time.monotonic() + 2))

    def works(runner, deadline):
        runner.run([sys.executable, "-c", "print('fine')"], deadline=deadline)
        return {"value": 1}

    monkeypatch.setattr(gpu_check, "CHECKS", (("fails", fails), ("hangs", hangs), ("works", works)))
    report = gpu_check.gpu_check(gpu_check.GpuCheckConfig(output_dir=str(tmp_path), device="cpu"))
    checks = report["checks"]
    assert checks["fails"]["status"] == "failed" and "broken on purpose" in checks["fails"]["error"]
    assert checks["hangs"]["status"] == "timeout"
    assert checks["works"]["status"] == "ok" and checks["works"]["figures"] == {"value": 1}
    assert "broken on purpose" in (tmp_path / "log.txt").read_text()
    assert "| fails | failed |" in (tmp_path / "report.md").read_text()


def test_a_part_of_the_check_still_names_its_machine(tmp_path):
    """--only runs its sub-checks and environment, whose figures head every report."""
    report = gpu_check.gpu_check(gpu_check.GpuCheckConfig(output_dir=str(tmp_path), device="cpu", only="matmul_peak"))
    assert list(report["checks"]) == ["environment", "matmul_peak"]
    assert all(check["status"] == "ok" for check in report["checks"].values())
    assert f"| torch | {torch.__version__} |" in (tmp_path / "report.md").read_text()


def test_levers_sweep_starts_at_train_py_defaults_and_its_flags_parse_to_its_values(tmp_path):
    from minitrainer.train import TrainConfig
    from minitrainer.common.cli import parse_config

    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    reference = tuple(defaults[lever.field] for lever in gpu_check.LEVERS)
    order = gpu_check.settings_order(reference)
    grid = math.prod(len(lever.values) for lever in gpu_check.LEVERS)
    assert len(order) == len(set(order)) == grid
    assert order[0] == reference
    assert order[1] == (True, False, "full"), "Liger first: the known win"
    required = ["--model-name-or-path", str(tmp_path), "--data-path", str(tmp_path), "--output-dir", str(tmp_path),
                "--min-samples-per-checkpoint", "1"]
    for setting in order:
        config = parse_config(TrainConfig, [*required, *gpu_check._setting_flags(setting)])
        assert tuple(getattr(config, lever.field) for lever in gpu_check.LEVERS) == setting


def test_a_smaller_budget_runs_the_larger_ones_winners_first_then_what_did_not_fit_there():
    reference = (False, False, "full")
    larger = [{"status": "ok", "tokens_per_second_per_gpu": 100.0},
              {"status": "ok", "tokens_per_second_per_gpu": 130.0},
              {"status": "out of memory"}, {"status": "not run: out of time"}, {"status": "ok",
                                                                                "tokens_per_second_per_gpu": 90.0}]
    settings = [reference, (True, False, "full"), (True, False, "none"), (True, True, "full"), (True, False, "selective")]
    larger = [{**row, **dict(zip((lever.field for lever in gpu_check.LEVERS), setting))}
              for row, setting in zip(larger, settings)]
    order = gpu_check.settings_order(reference, larger)
    assert order[:5] == [reference, (True, False, "full"), (True, False, "selective"), (True, False, "none"),
                         (True, True, "full")]
    assert sorted(order) == sorted(gpu_check.settings_order(reference))


def test_an_out_of_memory_rules_out_the_hungrier_settings_only():
    oom = [(16384, (True, False, "selective"))]
    ruled_out = {(budget, setting) for budget in (16384, 32768)
                 for setting in gpu_check.settings_order((False, False, "full"))
                 if gpu_check.ruled_out_by(budget, setting, oom)}
    # Larger budget, less recomputation, Liger off: each needs at least the memory that ran out; compile
    # may need more or less, so only the same compile value is ruled out.
    assert ruled_out == {(budget, (liger, False, policy)) for budget in (16384, 32768) for liger in (True, False)
                         for policy in ("selective", "none")}
    assert gpu_check.ruled_out_by(32768, (False, False, "none"), oom) == oom[0]
    assert gpu_check.ruled_out_by(8192, (True, False, "none"), oom) is None


def test_out_of_memory_is_told_from_other_failures_by_the_traceback():
    assert gpu_check.out_of_memory("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 18.55 GiB")
    assert gpu_check.out_of_memory("RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")
    assert not gpu_check.out_of_memory("torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised")
    assert not gpu_check.out_of_memory("rank 1 is gone (it stopped on its own error, or was killed, e.g. by the "
                                       "out-of-memory killer)")


def test_fastest_exact_skips_inexact_and_failed_runs_and_other_budgets():
    def row(budget, tokens_per_second, *, status="ok", exact=True):
        return {"budget": budget, "tokens_per_second_per_gpu": tokens_per_second, "status": status, "exact": exact}

    rows = [row(32768, 100.0), row(32768, 300.0, exact=False), row(32768, 200.0), row(16384, 900.0),
            row(32768, 0.0, status="out of memory", exact=None)]
    assert gpu_check.fastest_exact(rows, 32768) is rows[2]
    assert gpu_check.fastest_exact(rows, 16384) is rows[3]
    assert gpu_check.fastest_exact(rows, 8192) is None
