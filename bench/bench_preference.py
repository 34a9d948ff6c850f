"""A preference objective on packed pairs (``train.py --objective dpo|simpo|orpo|cpo``) against TRL's own trainer
(padded) on the same pairs: speed, CPU time and memory, DPO's reference log-prob precompute included on both sides.

    .venv/bin/python -m bench.bench_preference                    # DPO, 64 pairs, hidden 128, 2 layers
    .venv/bin/python -m bench.bench_preference --objective simpo  # SimPO against CPOTrainer(loss_type="simpo")
    .venv/bin/python -m bench.bench_preference --objective orpo   # ORPO against ORPOTrainer
    .venv/bin/python -m bench.bench_preference --hidden-size 256 --num-layers 4    # ~4x the work (TRL DPO: 490 CPU-s, 10 GiB)
    .venv/bin/python -m bench.bench_preference --num-pairs 128 --repeats 3 --sides trl

TRL runs in its own venv (``fixtures/trl_venv.py``, built once) through ``fixtures/trl_dpo.py`` (``DPOTrainer``) or
``fixtures/trl_preference.py`` (``CPOTrainer`` for cpo and simpo, ``ORPOTrainer``): our tokenized pairs handed to it
as prepared rows, read in the same order, fp32 on CPU, one micro-batch of ``--batch-size`` pairs per step (TRL pads
each micro-batch's 2B sequences to its longest; for DPO ``precompute_ref_log_probs=True``, the reference being the
step-0 policy, as ours, and ``padding_free`` off, which TRL 1.16 forces). Ours packs the same pairs padding-free
under ``--max-tokens-per-gpu``. Gradient checkpointing is the same on both sides (``--gradient-checkpointing``, off
by default; DPO only).

The pairs: a prompt of ``--prompt-min``..``--prompt-max`` tokens (uniform) shared by both sides, then a reply per
side whose length is log-uniform over ``--reply-min``..``--reply-max`` tokens, random ids, the prompt masked
(-100). The model: ``minitrainer.tools.tiny_model``'s random Qwen2 (ChatML tokenizer), ``--hidden-size`` wide,
``--num-layers`` deep, built once in ``--work-dir`` and reused while its size is unchanged (the pairs are
regenerated, deterministically, on every run; reference log-probs cached by either side are removed before each run).

Each side is timed from process start to exit (``run_timed``: wall, user + sys of the whole process tree, peak RSS
of the tree sampled every 50 ms), ``--repeats`` times alternating the order; medians are reported as pairs/s,
pairs per CPU-second and peak RSS, with TRL's own split (trainer construction incl. reference precompute, then
training). DPO's step-1 loss must be ln 2 on both sides (a wrong reference would show there); the reference-free
objectives' step-1 losses must agree with each other to 1e-5. Not part of the suite.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.bench_process_data import run_timed
from minitrainer.common.cli import config_field, parse_config

ROOT = Path(__file__).resolve().parent.parent
IGNORE_INDEX = -100


@dataclass
class PreferenceBenchConfig:
    objective: str = config_field("dpo", help="dpo, simpo, orpo or cpo (TRL: DPOTrainer, CPOTrainer, ORPOTrainer)")
    work_dir: str = config_field("/tmp/bench_preference", help="model, pairs and run outputs (model and pairs "
                                                               "reused)")
    num_pairs: int = config_field(64, help="preference pairs; a multiple of --batch-size (one epoch is trained)")
    batch_size: int = config_field(16, help="pairs per optimizer step, on both sides")
    max_tokens_per_gpu: int = config_field(8192, help="ours: token budget of a packed minibatch")
    nproc: int = config_field(1, help="ranks of each side (torchrun, gloo on CPU)")
    prompt_min: int = config_field(16, help="shortest prompt, tokens")
    prompt_max: int = config_field(128, help="longest prompt, tokens")
    reply_min: int = config_field(20, help="shortest reply per side, tokens (log-uniform)")
    reply_max: int = config_field(2000, help="longest reply per side, tokens (log-uniform)")
    hidden_size: int = config_field(128, help="model width")
    num_layers: int = config_field(2, help="decoder blocks")
    beta: float = config_field(0.1, help="the objective's beta (--dpo-beta, --simpo-beta, ...; SimPO's default "
                                         "2.0 is usual, 0.1 kept here for every objective)")
    learning_rate: float = config_field(1e-5, help="constant learning rate")
    gradient_checkpointing: bool = config_field(False, help="recompute activations, on both sides")
    attn_implementation: str = config_field(
        "reference_varlen", help="ours: attention backend (on CPU, auto's sdpa masks the whole packed row, "
                                 "T x T; reference_varlen runs one causal SDPA per sequence)")
    seed: int = config_field(42, help="pairs, data order and training seed")
    repeats: int = config_field(1, help="timed runs of each side; medians are reported")
    sides: str = config_field("ours,trl", help="which sides to run, comma-separated: ours, trl")

    def __post_init__(self):
        if self.num_pairs % (self.batch_size) or self.batch_size % self.nproc:
            raise ValueError("--num-pairs must be a multiple of --batch-size, and --batch-size of --nproc")
        if not set(self.sides.split(",")) <= {"ours", "trl"}:
            raise ValueError("--sides takes ours, trl or both")
        if self.objective not in ("dpo", "simpo", "orpo", "cpo"):
            raise ValueError(f"--objective takes dpo, simpo, orpo or cpo, not {self.objective}")
        if self.gradient_checkpointing and self.objective != "dpo":
            raise ValueError("--gradient-checkpointing: the TRL CPO/ORPO harness runs without it; DPO only")


def build_model(config: PreferenceBenchConfig, work: Path) -> Path:
    """The random model (reused while its parameters are unchanged)."""
    model_dir = work / "model"
    wanted = {"hidden_size": config.hidden_size, "num_layers": config.num_layers}
    marker = model_dir / "bench_dpo.json"
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return model_dir
    from minitrainer.tools.tiny_model import build_tiny_model

    build_tiny_model("chatml", model_dir, hidden_size=config.hidden_size, num_layers=config.num_layers,
                     intermediate_size=4 * config.hidden_size, num_heads=max(4, config.hidden_size // 64),
                     num_kv_heads=max(2, config.hidden_size // 128))
    marker.write_text(json.dumps(wanted))
    return model_dir


def write_pairs(config: PreferenceBenchConfig, path: Path, vocab_size: int) -> dict:
    """``num_pairs`` rows in our tokenized preference format at ``path``; their token counts."""
    import numpy as np

    rng = np.random.default_rng(config.seed)
    log_lo, log_hi = math.log(config.reply_min), math.log(config.reply_max + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = learned = 0
    with path.open("w") as f:
        for _ in range(config.num_pairs):
            prompt = rng.integers(3, vocab_size, int(rng.integers(config.prompt_min, config.prompt_max + 1))).tolist()
            row = {}
            for side in ("chosen", "rejected"):
                reply = rng.integers(3, vocab_size, int(math.exp(rng.uniform(log_lo, log_hi)))).tolist()
                row[f"{side}_input_ids"] = prompt + reply
                row[f"{side}_labels"] = [IGNORE_INDEX] * len(prompt) + reply
                row[f"{side}_len"] = len(prompt) + len(reply)
            row["len"] = row["chosen_len"] + row["rejected_len"]
            # shifted targets of both sides (position 0 is never a target; the prompt is never empty here)
            row["num_loss_counted_tokens"] = row["len"] - 2 * len(prompt)
            tokens += row["len"]
            learned += row["num_loss_counted_tokens"]
            f.write(json.dumps(row) + "\n")
    return {"tokens": tokens, "learned_tokens": learned}


def padded_tokens(path: Path, order: list[int], batch_size: int, nproc: int) -> int:
    """Tokens TRL's forward sees: each rank's micro-batch of 2*B/nproc sequences padded to its longest."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    per_rank = batch_size // nproc
    total = 0
    for start in range(0, len(order), per_rank):
        lengths = [n for i in order[start:start + per_rank] for n in (rows[i]["chosen_len"], rows[i]["rejected_len"])]
        total += max(lengths) * len(lengths)
    return total


def ours_command(config: PreferenceBenchConfig, model_dir: Path, data_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "minitrainer.run", "--standalone", f"--nproc-per-node={config.nproc}",
            "--model-name-or-path", str(model_dir), "--data-path", str(data_dir), "--output-dir", str(out),
            "--objective", config.objective, f"--{config.objective}-beta", str(config.beta),
            *(["--cpo-alpha", "0"] if config.objective == "cpo" else []), "--batch-size", str(config.batch_size),
            "--max-tokens-per-gpu", str(config.max_tokens_per_gpu), "--num-epochs", "1",
            "--lr-scheduler", "constant", "--num-warmup-steps", "0", "--adam-betas", "0.9", "0.95",
            "--learning-rate", str(config.learning_rate), "--max-grad-norm", "1.0", "--seed", str(config.seed),
            "--min-samples-per-checkpoint", str(10**9), "--no-checkpoint-at-epoch", "--no-full-state",
            "--num-data-workers", "0", "--attn-implementation", config.attn_implementation,
            "--activation-checkpointing" if config.gradient_checkpointing else "--no-activation-checkpointing"]


def first_loss_ours(out: Path) -> float | None:
    path = out / "training_metrics_0.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            return entry["loss"]
    return None


def main(argv: list[str] | None = None) -> None:
    import os
    import shutil

    import numpy as np

    from fixtures.e2e import model_vocab_size
    from fixtures.trl_dpo import read_trl_dpo_logs, trl_dpo_command
    from fixtures.trl_preference import trl_preference_command
    from fixtures.trl_venv import TRL_VERSION

    config = parse_config(PreferenceBenchConfig, argv,
                          description="a preference objective: packed pairs (ours) vs TRL's trainer (padded)")
    os.environ.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""})
    work = Path(config.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(config, work)
    data_dir = work / "pairs"
    counts = write_pairs(config, data_dir / "data.jsonl", model_vocab_size(model_dir))
    shutil.rmtree(data_dir / "reference_logps", ignore_errors=True)    # precompute timed on every run
    order = np.random.default_rng(config.seed).permutation(config.num_pairs).tolist()
    counts["trl_padded_tokens"] = padded_tokens(data_dir / "data.jsonl", order, config.batch_size, config.nproc)
    print(f"{config.num_pairs} pairs: {counts['tokens']} tokens ({counts['learned_tokens']} learned); "
          f"TRL's padded forward sees {counts['trl_padded_tokens']}", flush=True)
    sides = config.sides.split(",")
    timings: dict[str, list[tuple[float, float, float]]] = {side: [] for side in sides}
    extra: dict[str, dict] = {side: {} for side in sides}
    for round_index in range(config.repeats):
        for side in sides[:: 1 if round_index % 2 == 0 else -1]:
            out = work / f"out_{side}"
            if side == "trl" and config.objective == "dpo":
                command = trl_dpo_command(model_dir, data_dir / "data.jsonl", order, out_dir=out,
                                          world_size=config.nproc, per_device_batch_size=config.batch_size // config.nproc,
                                          max_steps=config.num_pairs // config.batch_size, beta=config.beta,
                                          loss_type=["sigmoid"], learning_rate=config.learning_rate, seed=config.seed,
                                          gradient_checkpointing=config.gradient_checkpointing)
            elif side == "trl":
                trainer = "orpo" if config.objective == "orpo" else "cpo"
                loss_type = "simpo" if config.objective == "simpo" else "sigmoid"
                command = trl_preference_command(trainer, model_dir, data_dir / "data.jsonl", order, out_dir=out,
                                                 world_size=config.nproc,
                                                 per_device_batch_size=config.batch_size // config.nproc,
                                                 max_steps=config.num_pairs // config.batch_size, beta=config.beta,
                                                 loss_type=loss_type, cpo_alpha=0.0, learning_rate=config.learning_rate,
                                                 seed=config.seed)
            else:
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(data_dir / "reference_logps", ignore_errors=True)
                command = ours_command(config, model_dir, data_dir, out)
            wall, cpu, peak, returncode = run_timed(command)
            if returncode != 0:
                raise SystemExit(f"the {side} side exited with {returncode} (its output is printed above)")
            if side == "trl":
                logs = read_trl_dpo_logs(out)
                extra[side] = {"step1_loss": logs[0]["loss"], "steps": len(logs),
                               **json.loads((out / "timing.json").read_text())}
            else:
                extra[side] = {"step1_loss": first_loss_ours(out)}
            timings[side].append((wall, cpu, peak))
            print(f"round {round_index + 1} {side}: wall {wall:.2f}s, CPU {cpu:.2f}s, peak RSS {peak:.3f} GiB",
                  flush=True)
    results = {"trl_version": TRL_VERSION, "config": asdict(config), **counts}
    for side, runs in timings.items():
        wall, cpu, peak = (statistics.median(run[k] for run in runs) for k in range(3))
        results[side] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                         "pairs_per_s": round(config.num_pairs / wall, 3),
                         "pairs_per_cpu_s": round(config.num_pairs / cpu, 3), "peak_rss_tree_gib": round(peak, 3),
                         "runs": [[round(v, 2) for v in run] for run in runs],
                         **{k: round(v, 2) if isinstance(v, float) and k.endswith("_s") else v
                            for k, v in extra[side].items()}}
    if "ours" in results and "trl" in results:
        results["speed_ours_vs_trl_wall"] = round(results["trl"]["wall_s"] / results["ours"]["wall_s"], 2)
        results["speed_ours_vs_trl_cpu"] = round(results["trl"]["cpu_s"] / results["ours"]["cpu_s"], 2)
        results["rss_ours_vs_trl"] = round(results["ours"]["peak_rss_tree_gib"] / results["trl"]["peak_rss_tree_gib"], 2)
    (work / f"bench_{config.objective}_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print("\n| side | wall s | pairs/s | CPU s | pairs/CPU-s | peak RSS GiB | step-1 loss |\n|---|---|---|---|---|---|---|")
    for side in sides:
        r = results[side]
        loss = "n/a" if r.get("step1_loss") is None else f"{r['step1_loss']:.6f}"
        print(f"| {side} | {r['wall_s']} | {r['pairs_per_s']} | {r['cpu_s']} | {r['pairs_per_cpu_s']} | "
              f"{r['peak_rss_tree_gib']} | {loss} |")
    if "speed_ours_vs_trl_wall" in results:
        print(f"| ours/TRL | x{results['speed_ours_vs_trl_wall']} | | x{results['speed_ours_vs_trl_cpu']} | | "
              f"x{results['rss_ours_vs_trl']} | |")
    if config.objective == "dpo":
        bad = [side for side in sides if results[side].get("step1_loss") is not None
               and abs(results[side]["step1_loss"] - math.log(2)) > 1e-5]
        if bad:
            raise SystemExit(f"step 1's loss is not ln 2 on: {', '.join(bad)}")
    elif len(sides) == 2 and not math.isclose(results["ours"]["step1_loss"], results["trl"]["step1_loss"],
                                              rel_tol=1e-5):
        raise SystemExit(f"step 1's losses differ: ours {results['ours']['step1_loss']}, "
                         f"TRL {results['trl']['step1_loss']}")


if __name__ == "__main__":
    main()
