"""One-command GPU acceptance: tests, exactness, speed, memory, written to one folder.

    make gpu-check                                   # CUDA machine, about 25 minutes (H100), into gpu_check/
    make gpu-check GPU_CHECK_ONLY=bench_32k,long_context   # a part (e.g. to fit 10-minute device calls)
    make gpu-check GPU_CHECK_DIR=$OUT/gpu_check      # choose the folder (e.g. one the caller collects)
    make gpu-check DEVICE=cpu                        # the CPU rehearsal: same code path, tiny sizes, ~2 min
    python -m bench.gpu_check --output-dir gpu_check --device cpu

Every sub-check runs as its own subprocess with its own time limit (``CHECKS``); one
that fails or runs out of time is recorded and the next one runs. The sub-checks:

* ``environment``: device, driver, torch/CUDA/transformers versions, the optional
  wheels (liger-kernel, peft, flash-attn: missing ones are reported, not fatal);
* ``matmul_peak``: an 8192^3 bf16 matmul (256^3 on CPU) as the device's measured peak;
* ``gpu_tests``: pytest of the tests marked ``gpu`` (``-m gpu``; all skip on CPU);
* ``exactness``: ``train.py``'s step-1 loss over a packed batch of several
  minibatches against the model's own unpacked loss, a dense and a MoE model,
  in the trainer's compute dtype (bf16 on GPU, fp32 on CPU; tolerances in ``EXACT_RTOL``);
* ``bench_32k``, ``bench_16k``: ``bench/bench_train.py`` on the Qwen2.5-1.5B shape (random
  init), packed vs padded at 32k and 16k tokens per GPU, Liger on/off, activation
  checkpointing on; the 16k run then searches the largest ``--max-tokens-per-gpu`` that
  trains, with and without Liger;
* ``levers``: the sweep of ``LEVERS``, recomputation policy x compile x Liger, ``train.py`` at
  each bench budget, largest first, train.py's defaults first (the reference): a table per
  budget (tokens/s, MFU of the measured peak, peak memory, step-1 loss, exact or not) and the
  fastest exact setting, within one 10-minute device call; what its time leaves out reads
  "not run: out of time", what runs out of memory rules out the hungrier settings;
* ``lora``: the same ``train.py`` runs as full fine-tuning, LoRA r=16 and QLoRA r=16 (NF4
  base): tokens/s, peak memory and step-1 loss side by side (a missing peft or torchao is
  recorded, not fatal);
* ``osft``: the same ``train.py`` runs as full fine-tuning and as OSFT (``--osft
  --osft-unfreeze-rank-ratio 0.25``): tokens/s, MFU, peak memory and step time side by side,
  with OSFT's ratios to full fine-tuning (the issue's goal: step time within 1.3x).
* ``optimizers``: the same ``train.py`` runs once per ``--optimizer`` of ``Sizes.optimizers`` (on GPU every
  one of the registry), each at ``bench/bench_optimizers.py``'s learning rate and ``--optimizer-args``: step
  time, tokens/s, peak memory, step-1 and final loss, with step time and peak memory as ratios to adamw's (a
  missing torchao is recorded, not fatal);
* ``long_context``: ``bench/bench_long_context.py`` on one GPU, one sample per step
  (activation checkpointing on, Liger on where installed): tokens/s, MFU and peak memory at
  32k, 64k and 128k tokens, then the longest single sample that trains (binary search).

Writes ``report.md`` (every figure with its command), ``report.json`` and
``log.txt`` (each command's output) into ``--output-dir``; models and data go to a
temporary folder that is removed at the end.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import itertools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from minitrainer.common.cli import comma_list, config_field, parse_config
from minitrainer.common.refusals import collect_errors

ROOT = Path(__file__).resolve().parent.parent

OPTIONAL_WHEELS = ("liger-kernel", "peft", "flash-attn")
REQUIRED_WHEELS = ("torch", "transformers", "datasets", "tokenizers", "safetensors", "numpy", "tqdm", "jinja2",
                   "psutil", "pytest")  # requirements.txt and pytest: a missing one fails the checks that need it


@dataclass(frozen=True)
class Lever:
    """A train.py speed lever of the ``levers`` sweep: a TrainConfig field and the values the sweep tries.

    ``values`` are in the order the sweep tries them. With ``more_memory_later``, each value needs at least
    the activation memory of the ones before it, so a run that ran out of memory rules out the later ones.
    """

    field: str
    values: tuple
    more_memory_later: bool = False

    def flags(self, value) -> tuple[str, ...]:
        flag = "--" + self.field.replace("_", "-")
        if isinstance(value, bool):
            return (flag,) if value else ("--no-" + flag[2:],)
        return (flag, str(value))


# The sweep's grid; adding a dimension is one line. The first lever varies slowest, so the runs try, after
# train.py's defaults: Liger on first (19% more tokens/s and 4.6 GB less at 32k on the first H100 run),
# then eager before compiled (compilation costs the most time), then the policies from most recomputation
# (surely fits) to least (fastest if it fits). compile's memory has no order: inductor may save more or
# fewer activations than eager.
LEVERS = (
    Lever("use_liger_kernels", (True, False), more_memory_later=True),
    Lever("compile", (False, True)),
    Lever("activation_checkpointing", ("full", "selective", "none"), more_memory_later=True),
)


@dataclass(frozen=True)
class Sizes:
    """How big each sub-check runs: the GPU sizes are the issue's; the CPU ones only rehearse."""

    shape: str                    # bench_train.py shape (random init)
    budgets: tuple[int, ...]      # --max-tokens-per-gpu of the bench runs
    median_len: int
    p99_len: int
    max_len: int
    num_steps: int                # timed rows per bench configuration
    num_warmup_steps: int
    max_probe_tokens: int         # upper end of the largest-budget search
    matmul_size: int
    lever_budget: int             # tokens per step of the train.py runs' data; lora's and osft's budget
    lever_steps: int              # train.py steps per run; the first is not timed
    time_budget_s: float          # the whole check
    optimizers: tuple[str, ...]   # the optimizers part's --optimizer runs, adamw (the ratios' reference) first
    limits_s: dict = dataclasses.field(default_factory=dict)  # per sub-check
    long_context_lengths: tuple[int, ...] = (32768, 65536, 131072)  # one sample of each, one GPU


GPU_SIZES = Sizes(shape="Qwen2.5-1.5B", budgets=(16384, 32768), median_len=600, p99_len=8000, max_len=16384,
                  num_steps=4, num_warmup_steps=1, max_probe_tokens=262144, matmul_size=8192, lever_budget=32768,
                  lever_steps=4, time_budget_s=1900,
                  optimizers=("adamw", "adamw_8bit", "adamw_4bit", "sgd", "adafactor", "muon"),
                  # bench_32k's four runs took 150 s on an H100 (2026-11-25) and hit its old limit by seconds.
                  # levers: one 10-minute device call, less the wheels' offline install and start-up; a
                  # train.py run costs 25-40 s of start-up plus its steps there, so the sweep is ordered.
                  # osft: 151 s on an H100 (2026-11-26), start-up 55 s with gesvd redoing all 196 SVDs.
                  # optimizers: six runs of 25-40 s start-up plus 4 steps; torchao's compile its update in step 1.
                  limits_s=dict(environment=60, matmul_peak=60, gpu_tests=150, exactness=150, bench_32k=240,
                                bench_16k=300, levers=540, lora=200, osft=420, optimizers=420, long_context=420))
CPU_SIZES = Sizes(shape="tiny", budgets=(256, 512), median_len=32, p99_len=128, max_len=256, num_steps=1,
                  num_warmup_steps=0, max_probe_tokens=1024, matmul_size=256, lever_budget=512, lever_steps=2,
                  time_budget_s=1800,  # generous: CI machines are shared; about 2 minutes on 2 idle cores
                  # Each train.py run costs ~15 s of the suite's rehearsal: the reference and the one optimizer
                  # whose path differs most (Muon's owner-rank exchange, its AdamW part) rehearse the rest.
                  optimizers=("adamw", "muon"),
                  # levers rehearses its time bound too: the whole grid would take 6 minutes here (compiling
                  # on CPU is slow), so the reference and a few runs fit and the rest are "out of time".
                  limits_s=dict(environment=120, matmul_peak=120, gpu_tests=300, exactness=600, bench_32k=300,
                                bench_16k=300, levers=75, lora=600, osft=600, optimizers=300, long_context=600),
                  long_context_lengths=(256, 512))

# bf16 keeps 8 significant bits (unit roundoff 2^-8 = 0.4%). The packed path (varlen attention,
# one long row, FSDP, several minibatches) and the unpacked reference (sdpa, one sample at a time)
# round every activation to bf16 in different kernels and orders, so per-token log-probs differ by
# a few roundoffs without bias; the step loss is their mean over the batch. 1% bounds that noise
# with margin, while a packing bug (attention across samples, a lost or double-counted sample, a
# wrong denominator) moves the loss of these sharp-logit test models by well over 1%. fp32 (CPU)
# differs only in summation order: 1e-4.
EXACT_RTOL = {"bfloat16": 1e-2, "float32": 1e-4}
EXACT_ARCHS = ("llama", "qwen3_moe_aux")  # dense, and MoE with the router loss (fixtures/architectures.py)

TARGETS = {"mfu_32k_liger": 0.50, "packed_over_padded": 1.5, "max_tokens_liger_ac": 131072,
           "osft_step_time_vs_full": 1.3}


@dataclass
class GpuCheckConfig:
    """What to check and where to write it; every field is a CLI flag."""

    output_dir: str = config_field("gpu_check", help="folder for report.md, report.json and log.txt")
    device: Literal["auto", "cuda", "cpu"] = config_field(
        "auto", help="cuda: the full check; cpu: the tiny rehearsal (hides GPUs); auto: cuda when visible")
    only: str = config_field("", help="comma-separated sub-checks to run (default: all of CHECKS); "
                                      "environment always runs")
    sub: str = config_field("", help="internal: run one device-side helper (env, matmul, reference_loss)")
    args: str = config_field("", help="internal: JSON arguments of --sub")

    def __post_init__(self) -> None:
        errors = []
        unknown = set(self.only_list) - {name for name, _ in CHECKS}
        if unknown:
            errors.append(f"--only: unknown {', '.join(sorted(unknown))}")
        collect_errors(errors)

    @property
    def only_list(self) -> list[str]:
        return comma_list(self.only)


# ----------------------------------------------------------------------------
# Running commands with limits


class Runner:
    """Runs each sub-check's commands, keeping the time budget, the commands and their output."""

    def __init__(self, sizes: Sizes, device: str, output_dir: Path, scratch: Path):
        self.sizes, self.device, self.output_dir, self.scratch = sizes, device, output_dir, scratch
        self.started = time.monotonic()
        self.log = (output_dir / "log.txt").open("w", encoding="utf-8")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal must take the CPU path even on a GPU machine
        self.commands: list[str] = []

    def remaining(self) -> float:
        return self.sizes.time_budget_s - (time.monotonic() - self.started)

    def run(self, cmd: list[str], *, deadline: float) -> subprocess.CompletedProcess:
        """Run ``cmd`` (from the repository root) until the sub-check's ``deadline``; raises on failure."""
        shown = shlex.join(str(part) for part in cmd).replace(sys.executable, "python")
        self.commands.append(shown)
        self.log.write(f"\n$ {shown}\n")
        self.log.flush()
        limit = max(1.0, deadline - time.monotonic())
        try:
            result = subprocess.run([str(part) for part in cmd], cwd=ROOT, env=self.env, capture_output=True,
                                    text=True, timeout=limit)
        except subprocess.TimeoutExpired as err:
            self.log.write(_text(err.stdout) + _text(err.stderr) + f"\n[timed out after {limit:.0f} s]\n")
            raise CheckTimeout(f"timed out after {limit:.0f} s: {shown}") from None
        self.log.write(result.stdout + result.stderr + f"\n[exit {result.returncode}]\n")
        self.log.flush()
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise CheckFailed(f"exit {result.returncode}: {shown}: {' | '.join(tail)}",
                              output=result.stdout + result.stderr)
        return result

    def helper(self, sub: str, args: dict, *, deadline: float) -> dict:
        """Run one ``--sub`` helper of this script in a fresh process; its last stdout line is JSON."""
        result = self.run([sys.executable, "-m", "bench.gpu_check", "--sub", sub, "--args", json.dumps(args)],
                          deadline=deadline)
        return json.loads(result.stdout.strip().splitlines()[-1])


class CheckFailed(RuntimeError):
    def __init__(self, message: str, *, output: str = ""):
        super().__init__(message)
        self.output = output  # the command's stdout and stderr, where a caller reads the cause


class CheckTimeout(RuntimeError):
    pass


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


# ----------------------------------------------------------------------------
# Sub-checks: each returns its figures (a dict); the Runner records commands and status


def check_environment(runner: Runner, deadline: float) -> dict:
    figures = runner.helper("env", {}, deadline=deadline)
    wheels = {}
    for name in OPTIONAL_WHEELS:
        try:
            wheels[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wheels[name] = None
    figures["optional_wheels"] = wheels
    figures["missing_wheels"] = [name for name, version in wheels.items() if version is None]
    figures["missing_required"] = [name for name in REQUIRED_WHEELS if not _installed(name)]
    if shutil.which("nvidia-smi"):
        try:
            smi = runner.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             deadline=deadline)
            figures["driver"] = smi.stdout.strip().splitlines()[0]
        except (CheckFailed, CheckTimeout) as err:
            figures["driver"] = f"unknown ({err})"
    else:
        figures["driver"] = None
    return figures


def check_matmul_peak(runner: Runner, deadline: float) -> dict:
    return runner.helper("matmul", {"n": runner.sizes.matmul_size}, deadline=deadline)


def check_gpu_tests(runner: Runner, deadline: float) -> dict:
    result = runner.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                        deadline=deadline)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    counts = {}
    for part in summary.strip("= ").split(","):
        words = part.split()
        if len(words) >= 2 and words[0].isdigit():
            counts[words[1]] = int(words[0])
    return {"summary": summary, **{f"num_{key}": value for key, value in counts.items()}}


def check_exactness(runner: Runner, deadline: float) -> dict:
    from fixtures.architectures import ARCH_BY_NAME, build_architecture
    from fixtures.e2e import write_tokenized_jsonl
    from minitrainer.tools.tiny_model import build_tokenizer

    tokenizer_dir = runner.scratch / "tokenizer"
    tokenizer = build_tokenizer("chatml", tokenizer_dir)
    data = write_tokenized_jsonl(runner.scratch / "exact.jsonl", num_samples=24, vocab_size=len(tokenizer),
                                 seed=3, min_len=8, max_len=64)
    figures, records, model_dirs = {}, {}, []
    for name in EXACT_ARCHS:
        model_dir = build_architecture(ARCH_BY_NAME[name], tokenizer_dir, runner.scratch / f"exact_{name}")
        model_dirs.append(str(model_dir))
        out = runner.scratch / f"exact_{name}_run"
        # 24 samples of 8-64 tokens in 96-token rows: several minibatches in the one step.
        runner.run([sys.executable, "train.py", "--model-name-or-path", model_dir, "--data-path", data,
                    "--output-dir", out, "--batch-size", 24, "--max-tokens-per-gpu", 96, "--max-steps", 1,
                    "--min-samples-per-checkpoint", 10**9, "--no-full-state", "--learning-rate", 1e-6,
                    "--num-warmup-steps", 0, "--skip-objective-check"], deadline=deadline)
        records[name] = json.loads((out / "training_metrics_0.jsonl").read_text().splitlines()[0])
        shutil.rmtree(out, ignore_errors=True)
    references = runner.helper("reference_loss", {"models": model_dirs, "data": str(data)}, deadline=deadline)
    for name, reference in zip(EXACT_ARCHS, references["losses"], strict=True):
        record = records[name]
        rtol = EXACT_RTOL[reference["dtype"]]
        diff = abs(record["loss"] - reference["loss"]) / abs(reference["loss"])
        figures[name] = {"packed_loss": record["loss"], "unpacked_loss": reference["loss"],
                         "relative_difference": diff, "rtol": rtol, "dtype": reference["dtype"],
                         "grad_accum": record["grad_accum"], "ok": diff <= rtol}
    bad = [name for name, f in figures.items() if not f["ok"]]
    if bad:
        raise CheckFailed(f"packed loss differs beyond tolerance for {', '.join(bad)}: {figures}")
    return figures


def _bench_args(runner: Runner, budget: int, output_json: Path) -> list:
    s = runner.sizes
    return [sys.executable, "-m", "bench.bench_train", "--shape", s.shape, "--max-tokens-per-gpu", budget,
            "--median-len", s.median_len, "--p99-len", s.p99_len, "--max-len", min(s.max_len, budget),
            "--num-steps", s.num_steps, "--num-warmup-steps", s.num_warmup_steps, "--activation-checkpointing",
            "on", "--output-json", output_json]


def _liger(runner: Runner) -> str:
    """Liger both ways where it can run; off (and said so) without a GPU or the wheel."""
    return "both" if runner.device == "cuda" and _installed("liger-kernel") else "off"


def check_bench(index: int, *, find_max_tokens: bool = False) -> Callable[[Runner, float], dict]:
    """bench_train.py at the ``index``-th budget of the sizes (16k, 32k on GPU), packed vs padded, Liger on
    and off, activation checkpointing on; with ``find_max_tokens`` also the largest budget that trains
    (packed, with and without Liger), searched in the same process to spare a second model build."""

    def check(runner: Runner, deadline: float) -> dict:
        budget = runner.sizes.budgets[index]
        output_json = runner.scratch / f"bench_{budget}.json"
        extra = ["--find-max-tokens", "--max-probe-tokens", runner.sizes.max_probe_tokens] \
            if find_max_tokens else []
        runner.run([*_bench_args(runner, budget, output_json), "--layouts", "packed,padded",
                    "--liger", _liger(runner), *extra], deadline=deadline)
        report = json.loads(output_json.read_text())
        figures = {"budget": budget, "bf16_matmul_tflops": report["bf16_matmul_tflops"],
                   "liger": "measured" if _liger(runner) == "both" else _why_no_liger(runner),
                   "results": report["results"]}
        if find_max_tokens:
            found = {r["liger"]: r.get("max_tokens_per_gpu_that_fits") for r in report["results"]
                     if r["layout"] == "packed"}
            figures["max_tokens_per_gpu"] = {
                "liger_on": found.get(True), "liger_off": found.get(False),
                "note": ("largest budget that trains, packed, activation checkpointing on, no safety margin"
                         if runner.device == "cuda" else "not searched: bench_train.py searches on CUDA only")}
        return figures
    return check


def _train_setup(runner: Runner, deadline: float) -> tuple[list, dict]:
    """The bench-shape model and data that train.py's timed runs share (built once), and their base flags:
    each check adds its budget, recomputation and Liger (the data's longest sample fits every budget)."""
    model_dir = runner.scratch / "lever_model"
    data = runner.scratch / "lever_data.jsonl"
    info_path = runner.scratch / "lever_info.json"
    if not info_path.exists():
        info = runner.helper("lever_setup", {"shape": runner.sizes.shape, "model": str(model_dir), "data": str(data),
                                             "budget": runner.sizes.lever_budget, "steps": runner.sizes.lever_steps,
                                             "median_len": runner.sizes.median_len, "p99_len": runner.sizes.p99_len,
                                             "max_len": min(runner.sizes.max_len, *runner.sizes.budgets,
                                                            runner.sizes.lever_budget)},
                             deadline=deadline)
        info_path.write_text(json.dumps(info))
    info = json.loads(info_path.read_text())
    base = ["--model-name-or-path", model_dir, "--data-path", data, "--batch-size", info["batch_size"],
            "--max-steps", runner.sizes.lever_steps, "--min-samples-per-checkpoint", 10**9, "--no-full-state",
            "--learning-rate", 1e-6, "--num-warmup-steps", 0, "--skip-objective-check"]
    return base, info


def _bench_speed_flags(runner: Runner) -> list:
    """lora's and osft's budget, recomputation and Liger: the bench's (32k, full, Liger where it runs)."""
    liger = ["--use-liger-kernels"] if _liger(runner) == "both" else []
    return ["--max-tokens-per-gpu", runner.sizes.lever_budget, "--activation-checkpointing", "full", *liger]


def _timed_train(runner: Runner, base: list, extra: tuple[str, ...], deadline: float, *,
                 keep_log_lines: str | None = None) -> dict:
    """One train.py run: medians over its steps but the first (warm-up, compilation), from the metrics lines;
    with ``keep_log_lines``, the output lines that contain it too (``log_lines``)."""
    out = Path(tempfile.mkdtemp(prefix="train_run_", dir=runner.scratch))  # never a folder a run could resume
    result = runner.run([sys.executable, "train.py", *base, "--output-dir", out, *extra], deadline=deadline)
    records = [json.loads(line) for line in (out / "training_metrics_0.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)
    timed = records[1:] or records
    kept = {}
    if keep_log_lines:
        kept["log_lines"] = [line.strip() for line in (result.stdout + result.stderr).splitlines()
                             if keep_log_lines in line]
    return {"args": list(extra), **kept, "step_1_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
            "peak_memory_gb": max(r["peak_memory_usage_GB"] for r in records),
            **{key: _median([r[key] for r in timed]) for key in
               ("tokens_per_second_per_gpu", "loss_tokens_per_second_per_gpu", "mfu", "model_flops_per_token",
                "model_tflops_per_second_per_gpu", "time_per_batch")}}


def settings_order(reference: tuple, larger: list[dict] = ()) -> list[tuple]:
    """The settings in the order one budget runs them, ``reference`` (train.py's defaults) first.

    At the largest budget (the issue's question, run first; ``larger`` empty) the grid in ``LEVERS``' order.
    At a smaller one, ``larger`` holds the rows of the budget above: what trained there runs first, fastest
    first, then what ran out of memory there (it may fit here), then the rest. A 10-minute call that runs out
    of time at the smaller budget has still measured there the settings that matter.
    """
    grid = [reference, *(s for s in itertools.product(*(lever.values for lever in LEVERS)) if s != reference)]
    speed = {_setting(r): r["tokens_per_second_per_gpu"] for r in larger if r["status"] == "ok"}
    ran_out = {_setting(r) for r in larger if r["status"] == "out of memory"}
    return sorted(grid, key=lambda s: (s != reference, s not in speed, -speed.get(s, 0.0), s not in ran_out,
                                       grid.index(s)))


def ruled_out_by(budget: int, setting: tuple, out_of_memory: list[tuple[int, tuple]]) -> tuple[int, tuple] | None:
    """The run of ``out_of_memory`` that needed no more memory than ``(budget, setting)``, if any: a budget as
    large or smaller, each ``more_memory_later`` lever at a value as lean or leaner, the others equal."""
    def leaner(lever: Lever, a, b) -> bool:
        return lever.values.index(a) <= lever.values.index(b) if lever.more_memory_later else a == b

    for ran_out in out_of_memory:
        oom_budget, oom_setting = ran_out
        if oom_budget <= budget and all(leaner(lever, a, b) for lever, a, b in zip(LEVERS, oom_setting, setting)):
            return ran_out
    return None


def fastest_exact(rows: list[dict], budget: int) -> dict | None:
    """The row at ``budget`` with the most tokens/s among those that trained with the reference's step-1 loss."""
    exact = [r for r in rows if r["budget"] == budget and r["status"] == "ok" and r.get("exact")]
    return max(exact, key=lambda r: r["tokens_per_second_per_gpu"]) if exact else None


def out_of_memory(output: str) -> bool:
    """Whether a failed train.py ran out of device memory: its traceback names the allocation failure."""
    from minitrainer.setup.autotune import ALLOCATION_FAILURES

    return any(text in output for text in ALLOCATION_FAILURES)


def _setting_flags(setting: tuple) -> list[str]:
    return [flag for lever, value in zip(LEVERS, setting) for flag in lever.flags(value)]


def _setting(row: dict) -> tuple:
    return tuple(row[lever.field] for lever in LEVERS)


def check_levers(runner: Runner, deadline: float) -> dict:
    """The sweep: recomputation policy x compile x Liger at each bench budget, ``train.py`` on the bench shape.

    Step 1 runs before any update, so its loss shows only the forward's numerics: a setting is exact when
    its step-1 loss lies within the device's ``EXACT_RTOL`` of the reference's, train.py's defaults (full
    recomputation, eager, no Liger: the fewest fused kernels, and what a new default is measured against).
    Every budget trains the same batches (the budget only cuts them into minibatches, which ``exactness``
    shows leaves the loss alone), so the reference's first run that trained serves all budgets.

    Bounded by ``deadline``: a run is not started when less time is left than the shortest run so far took
    ("not run: out of time"; one that starts and meets the deadline reads "not finished: out of time"), nor
    when a run that needed no more memory ran out ("skipped: ..."); hence the order of ``settings_order``, so
    whatever fits gives an answer. Out of memory is told from other failures by train.py's traceback.
    """
    from minitrainer.train import TrainConfig

    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    reference = tuple(defaults[lever.field] for lever in LEVERS)
    base, info = _train_setup(runner, deadline)
    figures: dict = {"train_flags": [str(part) for part in base], "batch_size": info["batch_size"],
                     "reference": dict(zip((lever.field for lever in LEVERS), reference))}
    peak = None
    if runner.device == "cuda":  # no meaningful peak on CPU (fp32 there): MFU reads n/a, as bench_train.py's
        try:
            peak = runner.helper("matmul", {"n": runner.sizes.matmul_size}, deadline=deadline)["bf16_matmul_tflops"]
        except CheckFailed as err:
            figures["peak_error"] = str(err)
    figures["bf16_matmul_tflops"] = peak
    rows: list[dict] = []
    ran_out: list[tuple[int, tuple]] = []
    shortest = 0.0
    budgets = sorted(runner.sizes.budgets, reverse=True)
    for budget, larger_budget in zip(budgets, [None, *budgets]):
        for setting in settings_order(reference, [r for r in rows if r["budget"] == larger_budget]):
            row = {"budget": budget, **dict(zip((lever.field for lever in LEVERS), setting)),
                   "flags": ["--max-tokens-per-gpu", str(budget), *_setting_flags(setting)]}
            rows.append(row)
            by = ruled_out_by(budget, setting, ran_out)
            if row["use_liger_kernels"] and _liger(runner) != "both":
                row["status"] = _why_no_liger(runner)
            elif by:
                row["status"] = f"skipped: out of memory at {by[0]} with {shlex.join(_setting_flags(by[1]))}"
            elif deadline - time.monotonic() < max(shortest, 5.0):
                row["status"] = "not run: out of time"
            else:
                began = time.monotonic()
                try:
                    row.update(_timed_train(runner, base, tuple(row["flags"]), deadline), status="ok")
                    shortest = min(shortest or math.inf, time.monotonic() - began)
                except CheckTimeout:
                    row["status"] = "not finished: out of time"
                except CheckFailed as err:  # recorded; the next run still gets what time is left
                    row["status"] = "out of memory" if out_of_memory(err.output) else f"failed: {err}"
                    if row["status"] == "out of memory":
                        ran_out.append((budget, setting))
                row["seconds"] = time.monotonic() - began
            speed = f", {row['tokens_per_second_per_gpu']:.0f} tok/s/GPU" if row["status"] == "ok" else ""
            print(f"        {budget:>6} {shlex.join(_setting_flags(setting))}: {row['status']}{speed}", flush=True)

    dtype = "bfloat16" if runner.device == "cuda" else "float32"  # as setup_model_fsdp computes
    trained = [r for r in rows if r["status"] == "ok"]
    ref = next((r for r in trained if _setting(r) == reference), None)
    for row in trained:
        row["mfu_of_measured_peak"] = (row["model_tflops_per_second_per_gpu"] / peak
                                       if peak and row.get("model_tflops_per_second_per_gpu") else None)
        if ref:
            row["step_1_loss_relative_difference"] = abs(row["step_1_loss"] - ref["step_1_loss"]) / ref["step_1_loss"]
            row["exact"] = row["step_1_loss_relative_difference"] <= EXACT_RTOL[dtype]
        same_budget_ref = next((r for r in trained if r["budget"] == row["budget"] and _setting(r) == reference),
                               None)
        if same_budget_ref:
            row["speedup_vs_defaults"] = (row["tokens_per_second_per_gpu"]
                                          / same_budget_ref["tokens_per_second_per_gpu"])
    figures.update(rows=rows, rtol=EXACT_RTOL[dtype], fastest_exact={})
    for budget in budgets:
        figures["fastest_exact"][str(budget)] = _recommendation(fastest_exact(rows, budget), runner.device,
                                                                largest=budget == budgets[0])
    for line in sweep_tables(figures):
        print(line, flush=True)
    return figures


def _recommendation(best: dict | None, device: str, *, largest: bool) -> str:
    if best is None:
        return "none: no run at this budget both trained and kept the reference's step-1 loss"
    text = (f"{shlex.join(_setting_flags(_setting(best)))}: {best['tokens_per_second_per_gpu']:.0f} tok/s/GPU, "
            f"{_fmt(best.get('speedup_vs_defaults'))}x train.py's defaults, {_fmt(best['peak_memory_gb'])} GB")
    if device != "cuda":
        return text + " (CPU rehearsal: not a recommendation)"
    if not largest:
        return text
    # Memory grows with the budget, so what fits the largest fits the smaller ones too; the runs' seconds
    # show what compilation adds to every start-up.
    return text + ": exact and fits, so the candidate for train.py's default (issue 42 item 4)"


def sweep_tables(figures: dict) -> list[str]:
    """The ``levers`` sweep as one markdown table per budget, then the fastest exact setting of each."""
    lines = []
    for budget in figures["fastest_exact"]:
        lines += ["", f"**{budget} tokens per GPU** (exact: step-1 loss within {figures['rtol']:g} of train.py's "
                  "defaults)",
                  "", "| " + " | ".join(lever.field for lever in LEVERS)
                  + " | tok/s/GPU | MFU (measured peak) | peak GB | step-1 loss | exact | seconds | status |",
                  "|" + "---|" * (len(LEVERS) + 7)]
        for r in (r for r in figures["rows"] if str(r["budget"]) == budget):
            loss = f"{r['step_1_loss']:.6f}" if "step_1_loss" in r else "n/a"
            lines.append("| " + " | ".join(str(r[lever.field]) for lever in LEVERS) + " | " + " | ".join(
                _fmt(r.get(key)) for key in ("tokens_per_second_per_gpu", "mfu_of_measured_peak", "peak_memory_gb"))
                + f" | {loss} | {_fmt(r.get('exact'))} | {_fmt(r.get('seconds'))} | {r['status']} |")
    lines.append("")
    for budget, text in figures["fastest_exact"].items():
        lines.append(f"- Fastest exact at {budget}: {text}")
    return lines


def check_lora(runner: Runner, deadline: float) -> dict:
    """Full fine-tuning, LoRA and QLoRA (r=16, all-linear) side by side: speed, peak memory, step-1 loss."""
    base, info = _train_setup(runner, deadline)
    base += _bench_speed_flags(runner)
    modes = {"full": (), "lora_r16": ("--lora-rank", "16"),
             "qlora_r16": ("--lora-rank", "16", "--lora-quantize-data-type", "nf4")}
    needs = {"lora_r16": ("peft",), "qlora_r16": ("peft", "torchao")}
    figures: dict = {"train_flags": [str(part) for part in base], "batch_size": info["batch_size"]}
    for mode, extra in modes.items():
        missing = [name for name in needs.get(mode, ()) if not _installed(name)]
        if missing:
            figures[mode] = {"status": f"not installed: {', '.join(missing)}"}
            continue
        try:
            figures[mode] = {"status": "ok", **_timed_train(runner, base, extra, deadline)}
        except (CheckFailed, CheckTimeout) as err:  # recorded; the next mode still gets what time is left
            figures[mode] = {"status": f"{'timeout' if isinstance(err, CheckTimeout) else 'failed'}: {err}"}
    full = figures["full"]
    for mode in ("lora_r16", "qlora_r16"):
        row = figures[mode]
        if row["status"] == "ok" and full["status"] == "ok":
            row["speed_vs_full"] = row["tokens_per_second_per_gpu"] / full["tokens_per_second_per_gpu"]
            row["peak_memory_vs_full"] = row["peak_memory_gb"] / full["peak_memory_gb"]
            row["step_1_loss_equal_full"] = row["step_1_loss"] == full["step_1_loss"]
    return figures


def check_osft(runner: Runner, deadline: float) -> dict:
    """Full fine-tuning and OSFT (unfreeze rank ratio 0.25) side by side: tokens/s, MFU, peak memory, step time."""
    base, info = _train_setup(runner, deadline)
    base += _bench_speed_flags(runner)
    figures: dict = {"train_flags": [str(part) for part in base], "batch_size": info["batch_size"]}
    for mode, extra in (("full", ()), ("osft_0.25", ("--osft", "--osft-unfreeze-rank-ratio", "0.25"))):
        try:
            # The start-up lines: decomposition seconds, peak memory, SVDs redone by gesvd, reconstruction.
            figures[mode] = {"status": "ok", **_timed_train(runner, base, extra, deadline, keep_log_lines="OSFT:")}
        except (CheckFailed, CheckTimeout) as err:  # recorded; the other mode still runs
            figures[mode] = {"status": f"{'timeout' if isinstance(err, CheckTimeout) else 'failed'}: {err}"}
    full, osft = figures["full"], figures["osft_0.25"]
    if full["status"] == "ok" and osft["status"] == "ok":
        osft["step_time_vs_full"] = osft["time_per_batch"] / full["time_per_batch"]
        osft["tokens_per_second_vs_full"] = osft["tokens_per_second_per_gpu"] / full["tokens_per_second_per_gpu"]
        osft["peak_memory_vs_full"] = osft["peak_memory_gb"] / full["peak_memory_gb"]
        # The factors reproduce W to ~1e-6 in fp32; bf16 compute rounds them differently from W.
        osft["step_1_loss_relative_difference"] = abs(osft["step_1_loss"] - full["step_1_loss"]) / full["step_1_loss"]
        osft["target_step_time_vs_full"] = TARGETS["osft_step_time_vs_full"]
    return figures


def check_optimizers(runner: Runner, deadline: float) -> dict:
    """One train.py run per optimizer of ``Sizes.optimizers`` at bench_optimizers.py's learning rate and
    ``--optimizer-args`` (the same table, so the CPU bench and this part bench the same settings): step time,
    tokens/s, peak memory and losses, with step time and peak memory over adamw's."""
    from bench.bench_optimizers import REFERENCE, setting_for

    base, info = _train_setup(runner, deadline)
    base = _without_flag(base, "--learning-rate") + _bench_speed_flags(runner)
    figures: dict = {"train_flags": [str(part) for part in base], "batch_size": info["batch_size"], "rows": []}
    for name in runner.sizes.optimizers:
        setting = setting_for(name)
        row: dict = {"optimizer": name, "learning_rate": setting.learning_rate, "optimizer_args": setting.args}
        figures["rows"].append(row)
        if name in ("adamw_8bit", "adamw_4bit") and not _installed("torchao"):
            row["status"] = "not installed: torchao"
            continue
        if deadline - time.monotonic() < 5:
            row["status"] = "not run: out of time"
            continue
        try:
            row.update(status="ok", **_timed_train(runner, base, tuple(setting.train_flags(name)), deadline))
        except (CheckFailed, CheckTimeout) as err:  # recorded; the next optimizer still gets what time is left
            row["status"] = f"{'timeout' if isinstance(err, CheckTimeout) else 'failed'}: {err}"
        print(f"        {name}: {row['status']}" + (f", {row['time_per_batch']:.3g} s/step"
                                                      if row["status"] == "ok" else ""), flush=True)
    reference = next((r for r in figures["rows"] if r["optimizer"] == REFERENCE and r["status"] == "ok"), None)
    for row in figures["rows"]:
        if reference and row["status"] == "ok":
            row["step_time_vs_adamw"] = row["time_per_batch"] / reference["time_per_batch"]
            row["peak_memory_vs_adamw"] = row["peak_memory_gb"] / reference["peak_memory_gb"]
            # Step 1's loss comes before any update: a differing one means the runs did not train the same model.
            row["step_1_loss_equal_adamw"] = row["step_1_loss"] == reference["step_1_loss"]
    if runner.device != "cuda":
        figures["note"] = ("CPU rehearsal: peak memory is each train.py process's peak RSS, and the step times "
                           "say nothing of a GPU's")
    return figures


def _without_flag(flags: list, flag: str) -> list:
    """``flags`` less ``flag`` and its value."""
    at = flags.index(flag)
    return flags[:at] + flags[at + 2:]


def optimizer_table(figures: dict) -> list[str]:
    """The ``optimizers`` part as one markdown table."""
    lines = ["", "| optimizer | lr | optimizer args | s/step | tok/s/GPU | peak GB | step-1 loss | final loss | "
             "step time vs adamw | peak memory vs adamw | status |", "|" + "---|" * 11]
    for r in figures["rows"]:
        args = f"`{json.dumps(r['optimizer_args'])}`" if r.get("optimizer_args") else ""
        figures_of = [_fmt(r.get(key)) for key in ("time_per_batch", "tokens_per_second_per_gpu", "peak_memory_gb",
                                                    "step_1_loss", "final_loss", "step_time_vs_adamw",
                                                    "peak_memory_vs_adamw")]
        lines.append(f"| {r['optimizer']} | {r['learning_rate']:g} | {args} | {' | '.join(figures_of)} | "
                     f"{r['status']} |")
    return lines


def check_long_context(runner: Runner, deadline: float) -> dict:
    """One sample per step on one GPU at the long-context lengths, then the longest one that trains."""
    s = runner.sizes
    output_json = runner.scratch / "long_context.json"
    search = ["--find-longest", "--max-probe-tokens", s.max_probe_tokens] if runner.device == "cuda" else []
    runner.run([sys.executable, "-m", "bench.bench_long_context", "--shape", s.shape, "--context-parallel-sizes", 1,
                "--lengths", ",".join(str(n) for n in s.long_context_lengths), "--repeats", 1,
                "--liger" if _liger(runner) == "both" else "--no-liger", "--activation-checkpointing", *search,
                "--output-json", output_json], deadline=deadline)
    report = json.loads(output_json.read_text())
    return {"liger": "on" if _liger(runner) == "both" else _why_no_liger(runner), "rows": report["rows"],
            "longest_single_sample": report["longest_sample_by_n"].get("1"),
            "note": ("longest single sample that trains: AC on, no safety margin, binary search at 1024 tokens"
                     if search else "not searched: the search runs on CUDA only")}


def _median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _why_no_liger(runner: Runner) -> str:
    return "not measured: no GPU" if runner.device != "cuda" else "not measured: liger-kernel is not installed"


CHECKS: tuple[tuple[str, Callable[[Runner, float], dict]], ...] = (
    ("environment", check_environment),
    ("matmul_peak", check_matmul_peak),
    ("exactness", check_exactness),
    ("gpu_tests", check_gpu_tests),
    ("bench_32k", check_bench(1)),
    ("levers", check_levers),
    ("lora", check_lora),
    ("osft", check_osft),
    ("optimizers", check_optimizers),
    ("long_context", check_long_context),
    ("bench_16k", check_bench(0, find_max_tokens=True)),
)


# ----------------------------------------------------------------------------
# Device-side helpers (run as `--sub NAME` in their own process)


def sub_env(_: dict) -> dict:
    import platform

    import torch
    import transformers

    from minitrainer.setup.flops import peak_bf16_tflops_for
    from minitrainer.common.device import gpu_name

    name = gpu_name()
    return {"device": name, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "datasheet_bf16_tflops": peak_bf16_tflops_for(name)}


def sub_matmul(args: dict) -> dict:
    import torch

    from minitrainer.setup.flops import time_bf16_matmul
    from minitrainer.common.device import device_type

    device = torch.device(device_type())
    return {"n": args["n"], "device": device.type, "bf16_matmul_tflops": time_bf16_matmul(device, n=args["n"])}


def sub_reference_loss(args: dict) -> dict:
    """The model's own loss, one sample at a time, in the trainer's compute dtype on this device."""
    import torch
    from transformers import AutoModelForCausalLM

    from fixtures.e2e import unpacked_loss_sum
    from minitrainer.common.device import device_type

    device = torch.device(device_type())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as setup_model_fsdp computes
    rows = [json.loads(line) for line in Path(args["data"]).read_text().splitlines()]
    losses = []
    for path in args["models"]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
        with torch.no_grad(), device:
            total, num_tokens = unpacked_loss_sum(model, [(r["input_ids"], r["labels"]) for r in rows],
                                                  dtype=torch.float32)
        losses.append({"loss": float(total) / num_tokens, "num_loss_counted_tokens": num_tokens,
                       "dtype": str(dtype).removeprefix("torch.")})
    return {"losses": losses}


def sub_lever_setup(args: dict) -> dict:
    """A random-init model of a bench shape saved like a checkpoint, a tokenizer, and chat-like data:
    lognormal lengths as bench_train.py draws them, the first ~60% of each sample a masked prompt."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from bench.bench_train import BenchConfig, draw_samples
    from minitrainer.model.shapes import model_config
    from minitrainer.tools.tiny_model import build_tokenizer
    from minitrainer.common.device import device_type

    config = model_config(args["shape"], max_position_embeddings=max(32768, args["budget"]))
    device = torch.device(device_type())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(args["model"])
    build_tokenizer("chatml", args["model"])  # only rank 0's exports read it; ids come from the data
    bench = BenchConfig(max_tokens_per_gpu=args["budget"], median_len=args["median_len"], p99_len=args["p99_len"],
                        max_len=args["max_len"], output_json=os.devnull)
    rng = np.random.default_rng(0)
    samples = draw_samples(bench, args["steps"] * args["budget"], config.vocab_size, rng)
    with open(args["data"], "w") as f:
        for sample in samples:
            ids = sample.input_ids.tolist()
            prompt = int(0.6 * len(ids))
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}) + "\n")
    return {"batch_size": max(1, len(samples) // args["steps"]), "num_samples": len(samples)}


SUBS = {"env": sub_env, "matmul": sub_matmul, "reference_loss": sub_reference_loss, "lever_setup": sub_lever_setup}


# ----------------------------------------------------------------------------
# Report


def summarize(checks: dict) -> dict:
    """The issue's targets against what was measured (None where a figure is missing)."""
    def result(name: str, *, layout: str, liger: bool) -> dict | None:
        for r in checks.get(name, {}).get("figures", {}).get("results", []):
            if r["layout"] == layout and r["liger"] == liger and r["status"] == "ok":
                return r
        return None

    packed = result("bench_32k", layout="packed", liger=True)
    padded = result("bench_32k", layout="padded", liger=True)
    packed_off = result("bench_32k", layout="packed", liger=False)
    padded_off = result("bench_32k", layout="padded", liger=False)
    max_liger = checks.get("bench_16k", {}).get("figures", {}).get("max_tokens_per_gpu", {}).get("liger_on")
    ratio = (packed["tokens_per_second_per_gpu"] / padded["tokens_per_second_per_gpu"] if packed and padded
             else packed_off["tokens_per_second_per_gpu"] / padded_off["tokens_per_second_per_gpu"]
             if packed_off and padded_off else None)
    env = checks.get("environment", {}).get("figures", {})
    fastest = checks.get("levers", {}).get("figures", {}).get("fastest_exact", {})  # the largest budget first
    measured = checks.get("bench_32k", {}).get("figures", {}).get("bf16_matmul_tflops")
    datasheet = env.get("datasheet_bf16_tflops")

    def vs_datasheet(row: dict | None) -> float | None:
        # bench_train.py divides by the measured matmul rate; the metrics lines by the data sheet's.
        if not row or row.get("mfu") is None or not measured or not datasheet:
            return None
        return row["mfu"] * measured / datasheet

    return {
        "mfu_32k_liger": {"value": packed["mfu"] if packed else None, "target": TARGETS["mfu_32k_liger"],
                          "of": "measured bf16 matmul peak"},
        "mfu_32k_liger_datasheet": {"value": vs_datasheet(packed), "target": TARGETS["mfu_32k_liger"],
                                    "of": "data-sheet dense bf16 peak"},
        "mfu_32k_no_liger": {"value": packed_off["mfu"] if packed_off else None, "target": None,
                             "of": "measured bf16 matmul peak"},
        "packed_over_padded": {"value": ratio, "target": TARGETS["packed_over_padded"],
                               "liger": bool(packed and padded)},
        "max_tokens_liger_ac": {"value": max_liger, "target": TARGETS["max_tokens_liger_ac"]},
        "osft_step_time_vs_full": {"value": checks.get("osft", {}).get("figures", {}).get("osft_0.25", {}).get(
            "step_time_vs_full"), "target": TARGETS["osft_step_time_vs_full"]},
        "longest_single_sample_ac": {"value": checks.get("long_context", {}).get("figures", {}).get(
            "longest_single_sample"), "target": None},
        "fastest_exact_setting": {"value": next((f"at {budget}: {text}" for budget, text in fastest.items()), None),
                                  "target": None},
    }


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def render_markdown(report: dict) -> str:
    env = report["checks"].get("environment", {}).get("figures", {})
    lines = [f"# gpu-check report ({report['device_kind']})", "",
             f"Started {report['started']}, {report['total_seconds']:.0f} s in all "
             f"(budget {report['time_budget_s']:.0f} s). Sizes: {report['sizes']['shape']} shape, "
             f"bench budgets {report['sizes']['budgets']} tokens per device.", "",
             "| | |", "|---|---|"]
    for key in ("device", "driver", "torch", "cuda", "transformers", "python", "datasheet_bf16_tflops"):
        lines.append(f"| {key} | {_fmt(env.get(key))} |")
    wheels = env.get("optional_wheels", {})
    listed = ", ".join(f"{name} {version or 'MISSING'}" for name, version in wheels.items())
    lines.append(f"| optional wheels | {listed or 'n/a'} |")
    lines += ["", "## Targets", "", "| target | measured | goal |", "|---|---|---|"]
    for key, item in report["summary"].items():
        lines.append(f"| {key} | {_fmt(item['value'])} | {_fmt(item['target'])} |")
    lines += ["", "## Sub-checks", "", "| check | status | seconds |", "|---|---|---|"]
    for name, check in report["checks"].items():
        lines.append(f"| {name} | {check['status']} | {check['seconds']:.1f} |")
    for name, check in report["checks"].items():
        lines += ["", f"### {name}: {check['status']}", ""]
        if check.get("error"):
            lines += [f"Error: `{check['error']}`", ""]
        for command in check.get("commands", []):
            lines.append(f"    {command}")
        figures = check.get("figures", {})
        if "results" in figures:
            lines += ["", "| layout | attention | liger | AC | tok/s/GPU | MFU | peak GB | status |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in figures["results"]:
                lines.append(f"| {r['layout']} | {r.get('attention')} | {r['liger']} | "
                             f"{r['activation_checkpointing']} | {_fmt(r.get('tokens_per_second_per_gpu'))} | "
                             f"{_fmt(r.get('mfu'))} | {_fmt(r.get('peak_memory_gb'))} | {r['status']} |")
            rest = {k: v for k, v in figures.items() if k != "results"}
        elif "fastest_exact" in figures:  # the levers sweep
            lines += sweep_tables(figures)
            rest = {k: v for k, v in figures.items() if k not in ("rows", "fastest_exact")}
        elif name == "optimizers" and "rows" in figures:
            lines += optimizer_table(figures)
            rest = {k: v for k, v in figures.items() if k != "rows"}
        else:
            rest = figures
        if rest:
            lines += ["", "```json", json.dumps(rest, indent=1, default=str), "```"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# Driver


def gpu_check(config: GpuCheckConfig) -> dict:
    """Run every sub-check (or ``--only``'s) and write the report; returns report.json's content."""
    device = config.device
    if device == "auto":
        device = "cuda" if _cuda_visible() else "cpu"
    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    output_dir = Path(config.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    runner = Runner(sizes, device, output_dir, scratch)
    print(f"gpu-check on {device} into {output_dir} (budget {sizes.time_budget_s:.0f} s)", flush=True)
    report = {"device_kind": device, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "time_budget_s": sizes.time_budget_s, "sizes": dataclasses.asdict(sizes), "exact_rtol": EXACT_RTOL,
              "levers": [dataclasses.asdict(lever) for lever in LEVERS], "checks": {}}
    try:
        for name, check in CHECKS:
            # environment (seconds) always runs: a report that does not name its machine and versions is
            # a table of numbers nobody can compare.
            if config.only_list and name not in config.only_list and name != "environment":
                continue
            limit = min(sizes.limits_s.get(name, 60), runner.remaining())
            entry: dict = {"status": "ok", "seconds": 0.0, "limit_s": limit}
            report["checks"][name] = entry
            runner.commands = []
            if limit < 5:
                entry["status"] = "skipped: the whole check's time budget is spent"
                continue
            began = time.monotonic()
            print(f"[{time.monotonic() - runner.started:5.0f} s] {name} (limit {limit:.0f} s)", flush=True)
            try:
                entry["figures"] = check(runner, began + limit)
            except CheckTimeout as err:
                entry.update(status="timeout", error=str(err))
            except (CheckFailed, OSError, ValueError, KeyError, json.JSONDecodeError) as err:
                entry.update(status="failed", error=f"{type(err).__name__}: {err}")
            entry["seconds"] = time.monotonic() - began
            entry["commands"] = list(runner.commands)
            print(f"        {entry['status']} in {entry['seconds']:.0f} s", flush=True)
    finally:
        runner.log.close()
        shutil.rmtree(scratch, ignore_errors=True)
    report["total_seconds"] = time.monotonic() - runner.started
    report["summary"] = summarize(report["checks"])
    (output_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (output_dir / "report.md").write_text(render_markdown(report))
    print(f"wrote {output_dir / 'report.md'} and report.json", flush=True)
    return report


def _cuda_visible() -> bool:
    from minitrainer.common.device import device_type

    return device_type() == "cuda"


def main(argv: list[str] | None = None) -> None:
    config = parse_config(GpuCheckConfig, argv, description=__doc__.split("\n\n")[0])
    if config.sub:
        print(json.dumps(SUBS[config.sub](json.loads(config.args or "{}"))))
        return
    gpu_check(config)


if __name__ == "__main__":
    main()
