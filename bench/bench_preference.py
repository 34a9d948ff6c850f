"""A preference objective on packed pairs (``train.py --objective dpo|simpo|orpo|cpo``), a Bradley-Terry reward model
on them (``--objective reward``), or KTO on the same pairs unpaired (``--objective kto``), against TRL's own trainer
(padded) on the same rows: speed, CPU time and memory, the reference log-prob precompute (DPO, KTO) included on both
sides.

    .venv/bin/python -m bench.bench_preference                    # DPO, 64 pairs, hidden 128, 2 layers
    .venv/bin/python -m bench.bench_preference --objective simpo  # SimPO against CPOTrainer(loss_type="simpo")
    .venv/bin/python -m bench.bench_preference --objective orpo   # ORPO against ORPOTrainer
    .venv/bin/python -m bench.bench_preference --objective kto    # KTO, 128 examples (64 pairs unpaired), KTOTrainer
    .venv/bin/python -m bench.bench_preference --objective reward # Bradley-Terry reward model, RewardTrainer
    .venv/bin/python -m bench.bench_preference --hidden-size 256 --num-layers 4    # ~4x the work (TRL DPO: 490 CPU-s, 10 GiB)
    .venv/bin/python -m bench.bench_preference --num-pairs 128 --repeats 3 --sides trl

TRL runs in its own venv (``fixtures/trl_venv.py``, built once) through ``fixtures/trl_dpo.py`` (``DPOTrainer``),
``fixtures/trl_preference.py`` (``CPOTrainer`` for cpo and simpo, ``ORPOTrainer``), ``fixtures/trl_reward.py``
(``RewardTrainer``) or ``fixtures/trl_kto.py`` (``KTOTrainer``): our tokenized rows handed to it as prepared rows,
read in the same order (our sampler's stream, ``InfiniteSampler(N, seed)``'s epoch 0), fp32 on CPU, one micro-batch
of ``--batch-size`` pairs (KTO: examples) per step (TRL pads each micro-batch's 2B sequences of pairs to its
longest; for DPO and KTO ``precompute_ref_log_probs=True``, the reference being the step-0 policy, as ours, and for
DPO ``padding_free`` off, which TRL 1.16 forces). Ours packs the same rows padding-free under
``--max-tokens-per-gpu``. Gradient checkpointing is the same on both sides (``--gradient-checkpointing``, off by
default; DPO only).

The pairs: a prompt of ``--prompt-min``..``--prompt-max`` tokens (uniform) shared by both sides, then a reply per
side whose length is log-uniform over ``--reply-min``..``--reply-max`` tokens, random ids, the prompt masked
(-100). The model: ``minitrainer.tools.tiny_model``'s random Qwen2 (ChatML tokenizer), ``--hidden-size`` wide,
``--num-layers`` deep, built once in ``--work-dir`` and reused while its size is unchanged (the pairs are
regenerated, deterministically, on every run; reference log-probs cached by either side are removed before each run).

The reward model (``--objective reward``) trains on the DPO pairs as they are, both sides from the same one-label
``*ForSequenceClassification`` checkpoint (``--work-dir``/classifier): the tiny causal LM given a score head under
``torch.manual_seed(--seed)``, ``config.pad_token_id`` the tokenizer's (id 0, which the random replies never hold),
saved with the tokenizer, rebuilt whenever the causal LM is. Ours reads each side's score at its last learned token
inside the packed row; TRL's ``RewardTrainer`` (``fixtures/trl_reward.py``) gets each side cut after its last learned
token (here its last token, so the same lengths), chosen and rejected sides of a micro-batch padded together to
their longest, and reads the score at the last non-pad token. ``--reward-center-coefficient`` goes to both sides
(TRL's ``center_rewards_coefficient``; 0, the default, is TRL's None). No reference, no beta.

KTO (``--objective kto``) trains on the same ``--num-pairs`` pairs (the same tokens) written as ``2 * --num-pairs``
unpaired rows (``--work-dir``/examples; ``input_ids``, unshifted ``labels``, ``len``, ``num_loss_counted_tokens``,
``desirable``): every pair's chosen side a desirable row, its rejected side an undesirable one, in the order TRL's
``unpair_preference_dataset`` (and our ``unpair``) gives them: per block of 1,000 pairs, the chosen sides, then the
rejected ones (with the default sizes rows 0..P-1 desirable, P..2P-1 undesirable), so a KL sequence (the previous
row's completion after the row's prompt, within its chunk of file order) joins a prompt to another pair's reply
while the chunk is at most ``--num-pairs`` rows. ``--batch-size`` counts examples per step there (``2 *
--num-pairs`` a multiple of it), the figures are examples/s and examples per CPU-second. Ours runs with
``--kto-beta`` ``--beta`` and ``--kto-kl-chunk`` the per-device batch; TRL (``fixtures/trl_kto.py``) gets the same
KL partners (``minitrainer.data.unpaired.kl_partners``), so both sides compute the same KL sequences (as many tokens
as the own ones: the replies permuted within each chunk) and, with one micro-batch of the batch per rank and step,
the same KL baseline. Each side runs every row's own and KL sequence forward in the reference pass, then per step
the batch's KL sequences forward only and its own ones forward and backward; TRL pads each micro-batch's own
sequences to their longest and its KL sequences to theirs (``trl_padded_tokens`` counts both, once). Desirable and
undesirable weights are 1 on both sides.

Each side is timed from process start to exit (``run_timed``: wall, user + sys of the whole process tree, peak RSS
of the tree sampled every 50 ms), ``--repeats`` times alternating the order; medians are reported as pairs/s,
pairs per CPU-second and peak RSS (KTO: examples), with TRL's own split (trainer construction incl. reference
precompute, then training). DPO's step-1 loss must be ln 2 on both sides (a wrong reference would show there), KTO's
exactly 0.5 (``mean(weight * (1 - sigmoid(0)))`` with weights 1) with ``kl`` exactly 0 on both sides; the
reference-free objectives' (reward included) step-1 losses must agree with each other to 1e-5. Not part of the
suite.
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
    objective: str = config_field("dpo", help="dpo, simpo, orpo, cpo, kto or reward (TRL: DPOTrainer, CPOTrainer, "
                                              "ORPOTrainer, KTOTrainer, RewardTrainer)")
    work_dir: str = config_field("/tmp/bench_preference", help="model, pairs and run outputs (model and pairs "
                                                               "reused)")
    num_pairs: int = config_field(64, help="preference pairs; a multiple of --batch-size (one epoch is trained); "
                                           "kto: unpaired into 2x as many examples")
    batch_size: int = config_field(16, help="pairs (kto: examples) per optimizer step, on both sides")
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
    reward_center_coefficient: float = config_field(
        0.0, help="reward: --reward-center-coefficient on ours, center_rewards_coefficient on TRL's (0: None)")
    learning_rate: float = config_field(1e-5, help="constant learning rate")
    gradient_checkpointing: bool = config_field(False, help="recompute activations, on both sides")
    attn_implementation: str = config_field(
        "reference_varlen", help="ours: attention backend (on CPU, auto's sdpa masks the whole packed row, "
                                 "T x T; reference_varlen runs one causal SDPA per sequence)")
    seed: int = config_field(42, help="pairs, data order and training seed")
    repeats: int = config_field(1, help="timed runs of each side; medians are reported")
    sides: str = config_field("ours,trl", help="which sides to run, comma-separated: ours, trl")

    @property
    def num_units(self) -> int:
        """What one epoch trains on: pairs, or for kto examples (two per pair)."""
        return 2 * self.num_pairs if self.objective == "kto" else self.num_pairs

    @property
    def unit(self) -> str:
        return "examples" if self.objective == "kto" else "pairs"

    def __post_init__(self):
        if self.num_units % self.batch_size or self.batch_size % self.nproc:
            raise ValueError(f"--num-pairs{' x 2' if self.objective == 'kto' else ''} must be a multiple of "
                             "--batch-size, and --batch-size of --nproc")
        if self.objective == "kto" and self.batch_size // self.nproc < 2:
            raise ValueError("kto: --batch-size / --nproc must be at least 2 (TRL's KTO and --kto-kl-chunk refuse 1)")
        if not set(self.sides.split(",")) <= {"ours", "trl"}:
            raise ValueError("--sides takes ours, trl or both")
        if self.objective not in ("dpo", "simpo", "orpo", "cpo", "kto", "reward"):
            raise ValueError(f"--objective takes dpo, simpo, orpo, cpo, kto or reward, not {self.objective}")
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


def build_classifier(config: PreferenceBenchConfig, work: Path, causal_dir: Path) -> Path:
    """The one-label sequence classifier both reward sides start from: ``causal_dir``'s model given a score head
    under ``torch.manual_seed(config.seed)``, ``config.pad_token_id`` the tokenizer's, saved with the tokenizer
    (reused while the causal LM and the seed are unchanged)."""
    model_dir = work / "classifier"
    wanted = {"causal": json.loads((causal_dir / "bench_dpo.json").read_text()), "seed": config.seed,
              "causal_config_mtime_ns": (causal_dir / "config.json").stat().st_mtime_ns}
    marker = model_dir / "bench_reward.json"
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return model_dir
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(config.seed)
    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(causal_dir)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    marker.write_text(json.dumps(wanted))
    return model_dir


def generate_pairs(config: PreferenceBenchConfig, vocab_size: int) -> list[tuple[list[int], list[int], list[int]]]:
    """``num_pairs`` random ``(prompt, chosen reply, rejected reply)`` token lists (deterministic in the seed)."""
    import numpy as np

    rng = np.random.default_rng(config.seed)
    log_lo, log_hi = math.log(config.reply_min), math.log(config.reply_max + 1)
    pairs = []
    for _ in range(config.num_pairs):
        prompt = rng.integers(3, vocab_size, int(rng.integers(config.prompt_min, config.prompt_max + 1))).tolist()
        replies = [rng.integers(3, vocab_size, int(math.exp(rng.uniform(log_lo, log_hi)))).tolist() for _ in range(2)]
        pairs.append((prompt, *replies))
    return pairs


def write_pairs(config: PreferenceBenchConfig, path: Path, vocab_size: int) -> dict:
    """``num_pairs`` rows in our tokenized preference format at ``path``; their token counts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = learned = 0
    with path.open("w") as f:
        for prompt, *replies in generate_pairs(config, vocab_size):
            row = {}
            for side, reply in zip(("chosen", "rejected"), replies):
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


UNPAIR_BLOCK = 1000
"""Pairs per block of TRL's ``unpair_preference_dataset`` (``minitrainer.data.unpaired.UNPAIR_BATCH``)."""


def write_examples(config: PreferenceBenchConfig, path: Path, vocab_size: int) -> dict:
    """The pairs of ``generate_pairs`` as ``2 * num_pairs`` unpaired rows at ``path`` (per block of
    ``UNPAIR_BLOCK`` pairs: the chosen sides, desirable, then the rejected ones); their token counts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pairs = generate_pairs(config, vocab_size)
    tokens = learned = 0
    with path.open("w") as f:
        for start in range(0, len(pairs), UNPAIR_BLOCK):
            block = pairs[start:start + UNPAIR_BLOCK]
            for side in (1, 2):
                for pair in block:
                    prompt, reply = pair[0], pair[side]
                    row = {"input_ids": prompt + reply, "labels": [IGNORE_INDEX] * len(prompt) + reply,
                           "len": len(prompt) + len(reply),
                           # shifted targets: every reply token (the prompt is never empty here)
                           "num_loss_counted_tokens": len(reply), "desirable": side == 1}
                    tokens += row["len"]
                    learned += len(reply)
                    f.write(json.dumps(row) + "\n")
    return {"tokens": tokens, "learned_tokens": learned}


def kto_token_counts(path: Path, order: list[int], kl_partner: list[int], batch_size: int, nproc: int) -> dict:
    """The KL sequences' tokens (row i's prompt, then row ``kl_partner[i]``'s reply) and the tokens TRL's KTO
    forward sees: each rank's micro-batch of B/nproc own sequences padded to their longest, and its B/nproc KL
    sequences to theirs (each counted once, as ``padded_tokens``)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    prompts = [next(k for k, label in enumerate(row["labels"]) if label != IGNORE_INDEX) for row in rows]
    kl_lengths = [prompts[i] + rows[j]["len"] - prompts[j] for i, j in enumerate(kl_partner)]
    per_rank = batch_size // nproc
    padded = 0
    for start in range(0, len(order), per_rank):
        block = order[start:start + per_rank]
        padded += len(block) * (max(rows[i]["len"] for i in block) + max(kl_lengths[i] for i in block))
    return {"kl_tokens": sum(kl_lengths), "trl_padded_tokens": padded}


def padded_tokens(path: Path, order: list[int], batch_size: int, nproc: int, *, reward: bool = False) -> int:
    """Tokens TRL's forward sees: each rank's micro-batch of 2*B/nproc sequences padded to its longest (``reward``:
    each side first cut after its last learned token, as ``fixtures.trl_reward.reward_sides`` hands it over)."""
    from fixtures.trl_reward import reward_sides

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if reward:
        rows = [{f"{side}_len": len(ids) for side in ("chosen", "rejected")
                 for ids in (reward_sides(row)[f"{side}_ids"],)} for row in rows]
    per_rank = batch_size // nproc
    total = 0
    for start in range(0, len(order), per_rank):
        lengths = [n for i in order[start:start + per_rank] for n in (rows[i]["chosen_len"], rows[i]["rejected_len"])]
        total += max(lengths) * len(lengths)
    return total


def ours_command(config: PreferenceBenchConfig, model_dir: Path, data_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "minitrainer.run", "--standalone", f"--nproc-per-node={config.nproc}",
            "--model-name-or-path", str(model_dir), "--data-path", str(data_dir), "--output-dir", str(out),
            "--objective", config.objective,
            *(["--reward-center-coefficient", str(config.reward_center_coefficient)] if config.objective == "reward"
              else [f"--{config.objective}-beta", str(config.beta)]),
            *(["--cpo-alpha", "0"] if config.objective == "cpo" else []),
            *(["--kto-kl-chunk", str(config.batch_size // config.nproc)] if config.objective == "kto" else []),
            "--batch-size", str(config.batch_size),
            "--max-tokens-per-gpu", str(config.max_tokens_per_gpu), "--num-epochs", "1",
            "--lr-scheduler", "constant", "--num-warmup-steps", "0", "--adam-betas", "0.9", "0.95",
            "--learning-rate", str(config.learning_rate), "--max-grad-norm", "1.0", "--seed", str(config.seed),
            "--min-samples-per-checkpoint", str(10**9), "--no-checkpoint-at-epoch", "--no-full-state",
            "--num-data-workers", "0", "--attn-implementation", config.attn_implementation,
            "--activation-checkpointing" if config.gradient_checkpointing else "--no-activation-checkpointing"]


def first_step_ours(out: Path) -> dict:
    """Step 1's metrics entry of our run (``{}`` when there is none)."""
    path = out / "training_metrics_0.jsonl"
    if not path.is_file():
        return {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            return entry
    return {}


def main(argv: list[str] | None = None) -> None:
    import os
    import shutil

    from fixtures.e2e import model_vocab_size
    from fixtures.trl_dpo import read_trl_dpo_logs, trl_dpo_command
    from fixtures.trl_kto import trl_kto_command
    from fixtures.trl_preference import trl_preference_command
    from fixtures.trl_reward import trl_reward_command
    from fixtures.trl_venv import TRL_VERSION
    from minitrainer.data.sampler import InfiniteSampler
    from minitrainer.data.unpaired import kl_partners

    config = parse_config(PreferenceBenchConfig, argv,
                          description="a preference objective: packed pairs (ours) vs TRL's trainer (padded)")
    os.environ.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""})
    work = Path(config.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(config, work)
    kto, reward = config.objective == "kto", config.objective == "reward"
    if reward:
        model_dir = build_classifier(config, work, model_dir)
    unit, num_units = config.unit, config.num_units
    data_dir = work / ("examples" if kto else "pairs")
    write = write_examples if kto else write_pairs
    counts = write(config, data_dir / "data.jsonl", model_vocab_size(model_dir))
    shutil.rmtree(data_dir / "reference_logps", ignore_errors=True)    # precompute timed on every run
    # Our sampler's stream for the epoch (np.random.default_rng(seed).permutation(N)); TRL reads it sequentially.
    order = InfiniteSampler(num_units, config.seed).take(num_units).tolist()
    if kto:
        kl_partner = kl_partners(num_units, config.batch_size // config.nproc).tolist()
        counts.update(kto_token_counts(data_dir / "data.jsonl", order, kl_partner, config.batch_size, config.nproc))
        print(f"{config.num_pairs} pairs as {num_units} examples: {counts['tokens']} tokens "
              f"({counts['learned_tokens']} learned) + {counts['kl_tokens']} in KL sequences; TRL's padded forward "
              f"sees {counts['trl_padded_tokens']}", flush=True)
    else:
        counts["trl_padded_tokens"] = padded_tokens(data_dir / "data.jsonl", order, config.batch_size, config.nproc,
                                                    reward=reward)
        print(f"{config.num_pairs} pairs: {counts['tokens']} tokens ({counts['learned_tokens']} learned); "
              f"TRL's padded forward sees {counts['trl_padded_tokens']} "
              f"({counts['trl_padded_tokens'] / counts['tokens']:.2f}x)", flush=True)
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
            elif side == "trl" and reward:
                command = trl_reward_command(model_dir, data_dir / "data.jsonl", order, out_dir=out,
                                             world_size=config.nproc,
                                             per_device_batch_size=config.batch_size // config.nproc,
                                             max_steps=config.num_pairs // config.batch_size,
                                             learning_rate=config.learning_rate,
                                             center_rewards_coefficient=config.reward_center_coefficient or None,
                                             seed=config.seed)
            elif side == "trl" and kto:
                command = trl_kto_command(model_dir, data_dir / "data.jsonl", order, kl_partner, out_dir=out,
                                          world_size=config.nproc,
                                          per_device_batch_size=config.batch_size // config.nproc,
                                          max_steps=num_units // config.batch_size, beta=config.beta,
                                          desirable_weight=1.0, undesirable_weight=1.0,
                                          learning_rate=config.learning_rate, seed=config.seed)
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
                extra[side] = {"step1_loss": logs[0]["loss"], **({"step1_kl": logs[0].get("kl")} if kto else {}),
                               "steps": len(logs), **json.loads((out / "timing.json").read_text())}
            else:
                step1 = first_step_ours(out)
                extra[side] = {"step1_loss": step1.get("loss"), **({"step1_kl": step1.get("kl")} if kto else {})}
            timings[side].append((wall, cpu, peak))
            print(f"round {round_index + 1} {side}: wall {wall:.2f}s, CPU {cpu:.2f}s, peak RSS {peak:.3f} GiB",
                  flush=True)
    results = {"trl_version": TRL_VERSION, "config": asdict(config), f"num_{unit}": num_units, **counts}
    for side, runs in timings.items():
        wall, cpu, peak = (statistics.median(run[k] for run in runs) for k in range(3))
        results[side] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                         f"{unit}_per_s": round(num_units / wall, 3),
                         f"{unit}_per_cpu_s": round(num_units / cpu, 3), "peak_rss_tree_gib": round(peak, 3),
                         "runs": [[round(v, 2) for v in run] for run in runs],
                         **{k: round(v, 2) if isinstance(v, float) and k.endswith("_s") else v
                            for k, v in extra[side].items()}}
    if "ours" in results and "trl" in results:
        results["speed_ours_vs_trl_wall"] = round(results["trl"]["wall_s"] / results["ours"]["wall_s"], 2)
        results["speed_ours_vs_trl_cpu"] = round(results["trl"]["cpu_s"] / results["ours"]["cpu_s"], 2)
        results["rss_ours_vs_trl"] = round(results["ours"]["peak_rss_tree_gib"] / results["trl"]["peak_rss_tree_gib"], 2)
    (work / f"bench_{config.objective}_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"\n| side | wall s | {unit}/s | CPU s | {unit}/CPU-s | peak RSS GiB | step-1 loss |\n"
          "|---|---|---|---|---|---|---|")
    for side in sides:
        r = results[side]
        loss = "n/a" if r.get("step1_loss") is None else f"{r['step1_loss']:.6f}"
        print(f"| {side} | {r['wall_s']} | {r[f'{unit}_per_s']} | {r['cpu_s']} | {r[f'{unit}_per_cpu_s']} | "
              f"{r['peak_rss_tree_gib']} | {loss} |")
    if "speed_ours_vs_trl_wall" in results:
        print(f"| ours/TRL | x{results['speed_ours_vs_trl_wall']} | | x{results['speed_ours_vs_trl_cpu']} | | "
              f"x{results['rss_ours_vs_trl']} | |")
    if config.objective == "dpo":
        bad = [side for side in sides if results[side].get("step1_loss") is not None
               and abs(results[side]["step1_loss"] - math.log(2)) > 1e-5]
        if bad:
            raise SystemExit(f"step 1's loss is not ln 2 on: {', '.join(bad)}")
    elif kto:
        # The policy is its own reference at step 1: every log-ratio and the KL baseline are exactly 0, so each
        # row's loss is weight * (1 - sigmoid(0)) = 0.5 with weights 1, and so is their mean.
        bad = [f"{side} (loss {results[side].get('step1_loss')}, kl {results[side].get('step1_kl')})"
               for side in sides if results[side].get("step1_loss") != 0.5 or results[side].get("step1_kl") != 0]
        if bad:
            raise SystemExit(f"step 1's loss is not exactly 0.5 with kl 0 on: {', '.join(bad)}")
    elif len(sides) == 2:
        ours_loss, trl_loss = results["ours"]["step1_loss"], results["trl"]["step1_loss"]
        print(f"step 1's loss: ours {ours_loss!r}, TRL {trl_loss!r} (relative difference "
              f"{abs(ours_loss - trl_loss) / abs(trl_loss):.1e})")
        if not math.isclose(ours_loss, trl_loss, rel_tol=1e-5):
            raise SystemExit(f"step 1's losses differ: ours {ours_loss}, TRL {trl_loss}")


if __name__ == "__main__":
    main()
