"""`make gpu-check DEVICE=cpu`: the GPU acceptance check's CPU rehearsal, end to end, plus its failure handling.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py        # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
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
    defaults = levers["defaults"]
    assert defaults["mfu"] is None and defaults["tokens_per_second_per_gpu"] > 0
    assert defaults["loss_tokens_per_second_per_gpu"] > 0 and defaults["model_flops_per_token"] > 0
    for lever in gpu_check.LEVERS:
        assert levers[lever.name]["status"] in ("ok", "not available in this build")

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
